"""Files on disk: label PNGs with the VOC palette, feature .npy/.pt files, RGB images (read by
the rule of ``images.py``).

Layout used by the ``mars`` command line (one file per image, the image *stem* is the key):

* ``images/<stem>.jpg|.png``: RGB images.
* ``labels/<stem>.png``: pseudo labels, one byte per pixel (P mode with the VOC palette, or L):
  0 = background, 1..C = classes, 255 = ignore.
* ``features/<stem>.npy`` or ``features/<stem>.pt``: float16 (or float32) USS embeddings of
  shape (D, h, w); (h, w) may be smaller than the label (the core resizes). ``.pt`` is what the
  MARS authors' DHR writes (``torch.save(f_us.half().cpu(), ...)``, produce_uss_features.py:34,
  read back with ``torch.load(...).float()``, core/datasets.py:94). A folder may mix both
  formats across stems, never two files for one stem (:func:`find_features`).
* debiased labels: like pseudo labels, with biased pixels (-1 in memory) written as
  :data:`BIASED_VALUE` = 254, a value no VOC/COCO class uses.

Every writer is atomic: it writes a temporary file in the target folder and renames it, so an
interrupted run never leaves a half-written file that a resumed run would take as done.
Readers never unpickle: ``np.load(..., allow_pickle=False)`` and
``torch.load(..., weights_only=True)`` (tensors only, no Python objects), both through the
bounded door (``bounded_load.py``): a file never declares more than it holds or the read allows.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import BIASED_PNG_VALUE
from mars_plugin.formats.bounded_load import ReadRefused, check_declared, numpy_load, torch_load
from mars_plugin.formats.images import to_rgb

__all__ = [
    "BIASED_VALUE",
    "IGNORE_VALUE",
    "IMAGE_EXTENSIONS",
    "FEATURE_EXTENSIONS",
    "voc_palette",
    "atomic_write",
    "save_torch",
    "WriteError",
    "read_label",
    "write_label",
    "read_features",
    "write_features",
    "find_features",
    "feature_shape",
    "read_image",
    "write_image",
    "list_stems",
    "find_image",
    "classes_in_label",
    "check_stem",
    "stem_path",
]

#: Byte written for biased pixels (-1) of debiased labels (defined beside the core's label
#: checks, which point a raw 254 to :func:`read_label`).
BIASED_VALUE = BIASED_PNG_VALUE
#: Byte of ignored pixels, as in every WSSS repository.
IGNORE_VALUE = 255
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
#: Feature files: numpy arrays, or torch tensors as DHR writes them (see the module docstring).
FEATURE_EXTENSIONS = (".npy", ".pt")

PathLike = Union[str, os.PathLike]


def voc_palette(n: int = 256) -> List[int]:
    """The PASCAL VOC colour map (bit-interleaved), flat [r0, g0, b0, r1, ...] of 3n ints."""
    pal = []
    for i in range(n):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        pal += [r, g, b]
    return pal


class WriteError(OSError):
    """An atomic write that failed (a full disk, a quota, an I/O error): ``WriteError(errno,
    reason, path)``, whose message names the file, the reason and, in ``after``, what became of
    the file there before (a caller that knows more, a checkpoint's, sets ``after`` and ``what``)."""

    what = ""
    after = "the file there before, if any, is unchanged"

    def __str__(self) -> str:
        return f"cannot write {self.what}{self.filename} ({self.strerror}); {self.after}"


def atomic_write(path: PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it to ``path``.

    A write or rename that fails with an OSError (``ENOSPC``...) removes the temporary file and
    raises :class:`WriteError`, one line that names ``path`` (not the temporary name) and says
    that the file there before, if any, is unchanged."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates 0600 files: give the result the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            reason = e.strerror or " ".join(str(e).split()) or type(e).__name__
            raise WriteError(e.errno, reason, path) from None
        raise


def save_torch(obj: object, path: PathLike) -> None:
    """``torch.save(obj, path)`` through an unbuffered Python file (for :func:`atomic_write`):
    to a path, torch's zip writer reports a failed write (a full disk) as a RuntimeError ("unexpected
    pos"), then another as it closes; through the file, the write's own OSError (``ENOSPC``)
    comes out, which :func:`atomic_write` turns into one line naming the file."""
    with open(path, "wb", buffering=0) as f:
        torch.save(obj, f)


def check_stem(stem: str) -> str:
    """``stem`` if it is a plain file name (what a writer may put in its output folder), else a
    ValueError: empty, ``.``, ``..``, a path separator or a NUL byte could write outside the
    folder or fail half-way."""
    if not isinstance(stem, str):
        raise ValueError(f"image id must be a string, got {type(stem).__name__}")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if stem in ("", ".", "..") or "\0" in stem or any(c in stem for c in seps):
        raise ValueError(f"image id {stem!r} is not a plain file name (no path separators, NUL, '.', '..' or empty)")
    return stem


def stem_path(folder: PathLike, stem: str, suffix: str) -> Path:
    """``folder/<stem><suffix>`` for a checked ``stem`` (see :func:`check_stem`)."""
    return Path(folder) / f"{check_stem(stem)}{suffix}"


def _image_errors() -> tuple:
    """What PIL raises on a file it cannot decode: OSError (truncated, not an image),
    SyntaxError (bad header) and DecompressionBombError (a declared size over twice
    ``Image.MAX_IMAGE_PIXELS``, refused before decoding)."""
    from PIL import Image

    return (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def _check_not_empty(path: str, shape: Tuple[int, ...], what: str) -> None:
    """An image, label or feature map of ``shape`` (..., H, W) has at least one pixel (and a
    feature map at least one channel): a 0-height or 0-width file is a ValueError naming it,
    not an error without the file from a resize or a CRF later. (PIL itself refuses to open
    such PNG/JPEG files; a .npy or .pt holds any shape.)"""
    if any(int(n) < 1 for n in shape):
        raise ValueError(f"{path}: {what} of shape {tuple(int(n) for n in shape)} is empty; expected every "
                         f"dimension >= 1 (an image has at least one pixel)")


#: Why a label file of a common non-label mode is refused (by the mode's first two letters).
_LABEL_MODE_HINTS = {
    "I;": " (16-bit: its values are not read as bytes; write the ids as an 8-bit P or L PNG)",
    "I": " (32-bit integer: write the ids as an 8-bit P or L PNG)",
    "RG": " (a colour image: a label holds one class id per pixel, not a colour; an RGB rendering of a palette "
          "label is not read back)",
    "LA": " (grey with alpha: write the ids as an 8-bit P or L PNG, without alpha)",
    "PA": " (palette with alpha: write the ids as an 8-bit P or L PNG, without alpha)",
}


def read_label(path: PathLike, *, biased_value: Optional[int] = BIASED_VALUE) -> torch.Tensor:
    """A (H, W) long label from a P-mode or L-mode PNG; ``biased_value`` bytes become -1.

    Pass ``biased_value=None`` to read the bytes unchanged.
    """
    from PIL import Image

    path = os.fspath(path)
    try:
        with Image.open(path) as im:
            if im.mode not in ("P", "L"):
                raise ValueError(f"{path}: label PNGs must be 8-bit palette (P) or grayscale (L) images of class ids, "
                                 f"got mode {im.mode}{_LABEL_MODE_HINTS.get(im.mode[:2], '')}")
            check_declared(path, "label", (im.height, im.width), 8)  # 8: the int64 map it becomes
            arr = np.array(im, dtype=np.uint8)
    except _image_errors() as e:
        if isinstance(e, ValueError) and str(e).startswith(path):
            raise
        raise ValueError(f"{path}: cannot read label image ({e})") from e
    _check_not_empty(path, arr.shape, "label")
    t = torch.from_numpy(arr.astype(np.int64))
    if biased_value is not None:
        t[t == biased_value] = -1
    return t


def write_label(path: PathLike, label, *, biased_value: int = BIASED_VALUE, mode: str = "P") -> None:
    """Write a (H, W) label as a PNG, atomically: P mode with the VOC palette (default, what
    RS+EPM and the VOC tools write) or L mode (plain grayscale, what IRNet and SEAM write).

    -1 (biased) is written as ``biased_value``; other values must be 0..255.
    """
    if mode not in ("P", "L"):
        raise ValueError(f"mode must be 'P' or 'L', got {mode!r}")
    from PIL import Image

    t = torch.as_tensor(np.asarray(label.cpu() if isinstance(label, torch.Tensor) else label))
    if t.ndim != 2:
        raise ValueError(f"label must be (H, W), got shape {tuple(t.shape)}")
    t = t.long().clone()
    t[t == -1] = biased_value
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > 255):
        raise ValueError(f"label values must be -1 or 0..255 to fit a PNG byte, got [{int(t.min())}, {int(t.max())}]")
    im = Image.fromarray(t.numpy().astype(np.uint8), mode="L")
    if mode == "P":
        im = im.convert("P")  # no palette quantisation: L -> P keeps the byte values
        im.putpalette(voc_palette())
    atomic_write(path, lambda tmp: im.save(tmp, format="PNG"))


def _feature_suffix(path: str) -> str:
    """The suffix of a feature file, one of :data:`FEATURE_EXTENSIONS` (else a ValueError)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FEATURE_EXTENSIONS:
        raise ValueError(f"{path}: feature files must end in one of {', '.join(FEATURE_EXTENSIONS)}, got "
                         f"{suffix or 'no suffix'!r}")
    return suffix


def _torch_load_error(path: str, e: BaseException) -> ValueError:
    """A one-line ValueError naming ``path`` for a failed ``torch.load(weights_only=True)``."""
    msg = str(e)
    if isinstance(e, EOFError) or (os.path.isfile(path) and os.path.getsize(path) == 0):
        why = "empty file, 0 bytes"
    elif isinstance(e, pickle.UnpicklingError) or "weights only" in msg.lower():
        # torch's safe unpickler: a GLOBAL it refuses is a pickled Python object (a class, a
        # function); anything else it refuses is no torch file at all (e.g. a plain pickle).
        glob = re.search(r"GLOBAL\s+([\w.]+)", msg)
        if glob:
            why = f"it holds a pickled Python object, {glob.group(1)}, which mars never unpickles: weights_only=True"
        else:
            why = "not a tensor written by torch.save: the safe unpickler refused it"
    elif "zip archive" in msg or "central directory" in msg:
        why = "truncated or corrupt torch zip archive"
    elif re.search(r"record size \((\d+) bytes\) does not match expected size \((\d+) bytes", msg):
        got, want = re.search(r"record size \((\d+) bytes\) does not match expected size \((\d+) bytes", msg).groups()
        why = (f"its storage record holds {int(got):,} bytes where the file declares {int(want):,}: a truncated or "
               "altered file")
    elif "not resizable" in msg or "out of bounds for storage" in msg:
        why = ("the tensor it declares (shape, strides, offset) needs more bytes than its storage holds: a truncated "
               "or altered file")
    elif isinstance(e, OSError):
        why = e.strerror or _one_line(e)
    else:
        why = f"not a tensor written by torch.save: {type(e).__name__} {_one_line(e)[:120]}"
    return ValueError(f"{path}: cannot read features as a torch tensor ({why})")


def _one_line(e: BaseException) -> str:
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def _load_pt(path: str, *, mmap: bool = False):
    """``torch.load(path, map_location="cpu", weights_only=True)`` through the bounded door
    (:func:`mars_plugin.formats.bounded_load.torch_load`): tensors, dicts, lists and numbers only,
    never a Python object (so never code), whatever the file holds; every tensor's values in the
    file, each once. Errors name ``path``."""
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols: the error says it
            warnings.simplefilter("ignore")
            return torch_load(path, mmap=mmap, what="features")
    except ReadRefused:
        raise
    except Exception as e:  # noqa: BLE001 -- every failure to read the file is the same user error
        raise _torch_load_error(path, e) from e


def _check_pt_features(path: str, obj) -> torch.Tensor:
    """``obj`` (what a .pt held, its values already checked to be in the file by
    :func:`_load_pt`) if it is a floating (D, h, w) tensor, else a ValueError."""
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{path}: a .pt feature file must hold one float tensor of shape (D, h, w), got a "
                         f"{type(obj).__name__}")
    if obj.layout != torch.strided or not obj.is_floating_point() or obj.ndim != 3:
        layout = "" if obj.layout == torch.strided else f" {obj.layout}"
        raise ValueError(f"{path}: features must be a float tensor of shape (D, h, w), got{layout} "
                         f"{obj.dtype} {tuple(obj.shape)}")
    return obj


def read_features(path: PathLike, *, keep_half: bool = False) -> torch.Tensor:
    """(D, h, w) float32 embeddings from a ``.npy`` or ``.pt`` file (never unpickled).

    ``keep_half``: a float16 or bfloat16 file comes back in its own dtype (widening it later, on
    the device that uses it, gives the same float32 values and moves half the bytes); every
    other float dtype is still converted to float32 here.

    ``.npy``: ``np.load(allow_pickle=False)`` of a float array. ``.pt``: ``torch.load(...,
    map_location="cpu", weights_only=True)`` of one float tensor, as DHR writes them
    (produce_uss_features.py:34); weights_only never unpickles Python objects, so a file that
    holds any (or needs them) is refused, never executed. Any other content, a 0-byte or
    truncated file, or another suffix is a ValueError naming the file and what it held; so is a
    tensor whose values are not in the file, each once (a meta tensor, a stride-0 or overlapping
    view declaring more values than it stores, a storage smaller than its shape needs): checked
    before the float32 copy, which is then at most 4 / (item size) times the file's storage.
    """
    path = os.fspath(path)
    if _feature_suffix(path) == ".pt":
        t = _check_pt_features(path, _load_pt(path))
        _check_not_empty(path, t.shape, "features (D, h, w)")
        dtype = t.dtype if keep_half and t.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return t.detach().to(dtype, memory_format=torch.contiguous_format, copy=True)
    try:
        arr = numpy_load(path, what="features")
    except ReadRefused:
        raise
    except (OSError, ValueError, EOFError) as e:  # EOFError: a 0-byte file
        raise ValueError(f"{path}: cannot read features as a plain .npy array ({e})") from e
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{path}: features must be a float array of shape (D, h, w), got {arr.dtype} {arr.shape}")
    _check_not_empty(path, arr.shape, "features (D, h, w)")
    if keep_half and arr.dtype == np.float16:
        return torch.from_numpy(np.ascontiguousarray(arr))
    return torch.from_numpy(arr.astype(np.float32))


def feature_shape(path: PathLike) -> Tuple[int, ...]:
    """The shape of the array in a feature file, without reading its data: the ``.npy`` header
    (``mmap_mode="r"``), or ``torch.load(..., mmap=True, weights_only=True)`` for ``.pt`` (the
    storage is mapped, not read). A file that cannot be mapped (torch < 2.1, the legacy
    non-zip format) is read in full. A ValueError (naming the file) when it holds no array.
    """
    path = os.fspath(path)
    if _feature_suffix(path) == ".npy":
        return tuple(numpy_load(path, mmap_mode="r", what="features").shape)
    try:  # the shape is only what the file declares: the door checks that it is backed
        obj = _load_pt(path, mmap=True)
    except ReadRefused:
        raise
    except ValueError:
        obj = _load_pt(path)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a tensor")
    return tuple(obj.shape)


def find_features(folder: PathLike, stem: str) -> Path:
    """``folder/<stem>.npy`` or ``folder/<stem>.pt``, whichever exists.

    A folder may hold either format, even mixed across stems, but never both files for one stem
    (which one would be meant?): that, or neither, is a ValueError naming the files.
    """
    found = [p for p in (stem_path(folder, stem, ext) for ext in FEATURE_EXTENSIONS) if p.is_file()]
    if not found:
        looked = ", ".join(f"{stem}{ext}" for ext in FEATURE_EXTENSIONS)
        raise ValueError(f"no features for {stem} in {folder} (looked for {looked})")
    if len(found) > 1:
        raise ValueError(f"two feature files for {stem}: {' and '.join(map(str, found))}; keep one")
    return found[0]


def write_features(path: PathLike, features, *, dtype=np.float16) -> None:
    """Write (D, h, w) embeddings, atomically, as ``dtype`` (float16 by default): a ``.npy``
    array, or for ``.pt`` a tensor with ``torch.save`` (the file DHR writes and
    :func:`read_features` reads).

    The ``.pt`` tensor is a fresh contiguous copy: ``torch.save`` writes a tensor's whole
    underlying storage, so saving a slice of a bigger tensor as is would write all of it.
    """
    path = os.fspath(path)
    suffix = _feature_suffix(path)
    if isinstance(features, torch.Tensor):
        f = features.detach().cpu()
        arr = (f.float() if f.dtype == torch.bfloat16 else f).numpy()  # numpy has no bfloat16
    else:
        arr = np.asarray(features)
    if arr.ndim != 3:
        raise ValueError(f"features must be (D, h, w), got shape {arr.shape}")
    arr = arr.astype(dtype)
    if suffix == ".pt":
        # astype copies already; the clone makes sure the saved storage holds exactly D*h*w values.
        t = torch.from_numpy(arr).clone(memory_format=torch.contiguous_format)
        atomic_write(path, lambda tmp: save_torch(t, tmp))
        return

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)

    atomic_write(path, write)


def read_image(path: PathLike) -> np.ndarray:
    """(H, W, 3) uint8 RGB, by the one rule of :mod:`mars_plugin.formats.images`: 8-bit modes as
    PIL's ``convert("RGB")``, alpha dropped, 16/32-bit integer scaled by the bit depth, float in
    [0, 1] times 255, EXIF orientation not applied; any other mode or range a ValueError naming
    the file and its mode."""
    from PIL import Image

    path = os.fspath(path)
    try:
        with Image.open(path) as im:
            arr = to_rgb(im, path)
    except _image_errors() as e:
        if isinstance(e, ValueError) and str(e).startswith(path):
            raise
        raise ValueError(f"{path}: cannot read image ({e})") from e
    _check_not_empty(path, arr.shape[:2], "image (H, W)")
    return arr


def write_image(path: PathLike, rgb) -> None:
    """Write an (H, W, 3) uint8 RGB image (format from the extension), atomically."""
    from PIL import Image

    arr = rgb.cpu().numpy() if isinstance(rgb, torch.Tensor) else np.asarray(rgb)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"rgb must be an (H, W, 3) uint8 image, got {arr.dtype} {arr.shape}")
    fmt = "JPEG" if str(path).lower().endswith((".jpg", ".jpeg")) else "PNG"
    atomic_write(path, lambda tmp: Image.fromarray(arr).save(tmp, format=fmt))


def list_stems(folder: PathLike, extensions: Sequence[str]) -> List[str]:
    """Sorted stems of the files in ``folder`` with one of ``extensions`` (hidden files skipped)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    exts = tuple(e.lower() for e in extensions)
    return sorted(p.stem for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in exts)


def find_image(folder: PathLike, stem: str) -> Path:
    """The image file of ``stem`` in ``folder`` (any of :data:`IMAGE_EXTENSIONS`)."""
    for ext in IMAGE_EXTENSIONS:
        for e in (ext, ext.upper()):
            p = Path(folder) / f"{stem}{e}"
            if p.is_file():
                return p
    raise ValueError(f"no image for {stem!r} in {folder} (looked for {', '.join(IMAGE_EXTENSIONS)})")


def classes_in_label(label: torch.Tensor, ignore_index: int = IGNORE_VALUE) -> List[int]:
    """Foreground class ids present in a label (the default image-level labels), ascending."""
    flat = label.reshape(-1)
    if flat.numel() and not flat.is_floating_point() and flat.dtype != torch.bool:
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo >= 0 and hi < 1 << 16:
            # A label's ids are bytes: a histogram is 10-20x faster than torch.unique's sort
            # (the job's files are read in threads beside the GPU, whose rate this bounds).
            vals = torch.nonzero(torch.bincount(flat)).flatten()
        else:
            vals = torch.unique(flat)
    else:
        vals = torch.unique(flat)
    return [int(v) for v in vals.tolist() if v > 0 and v != ignore_index]
