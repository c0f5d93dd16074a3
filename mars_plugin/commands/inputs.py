"""What several ``mars`` commands share to read and check their inputs, before any work and
per file: the input folders (a mistyped or wrong folder is one line, not one failure per image),
the output file or folder, label values, features, the centroid file, the numeric parameters,
and the progress bar.

Each job streams one image at a time and treats a bad input file according to ``on_error``:
``"stop"`` raises a :class:`~mars_plugin.runs.errors.JobError` naming the file, ``"skip"``
reports it and goes on (the summary lists every skipped file). The checks here raise
``ValueError`` for one file (the job applies ``on_error``) and ``JobError`` for a whole input.
"""
from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import (
    MAX_BATCH_SIZE,
    MAX_EXAMPLES,
    MAX_K,
    MAX_PER_CLASS,
    MAX_WORKERS,
    all_finite,
    check_fraction,
    check_int_param,
    check_num_classes,
    check_real_param,
    check_seed,
    check_varying_features,
)
from mars_plugin.formats.files import (BIASED_VALUE, IMAGE_EXTENSIONS, feature_shape, find_features, find_image,
                                       list_stems, read_label)
from mars_plugin.runs.errors import JobError, one_line
from mars_plugin.method.selection import DebiasedCentroids

__all__ = ["load_centroids", "check_job_params", "no_valid_pixel", "check_any_valid", "check_label_values",
           "check_features", "check_input_folder", "check_images_folder", "list_images", "check_out_apart",
           "root_reads"]


def no_valid_pixel(label: torch.Tensor, path: os.PathLike, ignore_index: int) -> Optional[str]:
    """The warning for a label map of which every pixel is ``ignore_index`` (None otherwise).

    One such label is a warning, not a per-file failure: a WSSS method may leave an image it is
    unsure of entirely ignored, the file is valid and contributes nothing, and stopping a long
    run on it would be wrong. A whole set of them is an error (see :func:`check_any_valid`)."""
    if bool((label != ignore_index).any()):
        return None
    return f"{os.fspath(path)}: every pixel is --ignore-index {ignore_index} (no valid pixel)"


def check_any_valid(folder: os.PathLike, stems: Sequence[str], flag: str, ignore_index: int) -> None:
    """Read the labels of ``stems`` in ``folder`` until one has a valid pixel (usually the
    first); when none has, a :class:`JobError` naming the folder, before any work: a set of
    labels with no valid pixel at all (all ``ignore_index``: the wrong folder or the wrong
    ``--ignore-index``) has nothing to give. Unreadable files are left to the per-file read."""
    read = 0
    for stem in stems:
        try:
            label = read_label(Path(folder) / f"{stem}.png", biased_value=None)
        except Exception:  # noqa: BLE001 -- reported, with its file, by the per-file read
            continue
        read += 1
        if bool((label != ignore_index).any()):
            return
    if read:
        raise JobError(f"{flag} {folder}: no label has a valid pixel (every pixel of all {read} read is "
                       f"--ignore-index {ignore_index}); is it the right folder and --ignore-index?")


def check_label_values(label: torch.Tensor, path: os.PathLike, num_classes: int, ignore_index: int,
                       flag: str = "--num-classes") -> None:
    """A pseudo label (read raw) holds only 0..C and ``ignore_index``; the error names the file,
    the flag that set C, and 254 when a debiased label was passed as a pseudo label."""
    if not label.numel():
        return
    # The usual case in one pass: ignore pixels read as 0, which is a valid id either way.
    lo, hi = (int(v) for v in torch.aminmax(label.masked_fill(label == ignore_index, 0)))
    if hi <= num_classes and lo >= 0:
        return
    vals = label[label != ignore_index]
    hi, lo = int(vals.max()), int(vals.min())
    if num_classes < BIASED_VALUE and bool((vals == BIASED_VALUE).any()):
        raise ValueError(f"{os.fspath(path)}: holds {BIASED_VALUE}, the biased-pixel byte of debiased labels, "
                         f"where a pseudo label of 0..{num_classes} (and --ignore-index {ignore_index}) was expected")
    bad = hi if hi > num_classes else lo
    raise ValueError(f"{os.fspath(path)}: holds class {bad} but {flag} is {num_classes} "
                     f"(labels are 0..{num_classes} and --ignore-index {ignore_index})")


def check_features(feats: torch.Tensor, path: os.PathLike, dim: Optional[int], dim_from: str) -> None:
    """Features are finite, not degenerate (all zero, or one vector at every pixel:
    :func:`~mars_plugin._checks.degenerate_features`) and of embedding size ``dim`` (None: any);
    the error names the file."""
    if not all_finite(feats):
        raise ValueError(f"{os.fspath(path)}: features hold NaN or infinite values")
    check_varying_features(feats, os.fspath(path))
    if dim is not None and int(feats.shape[0]) != dim:
        raise ValueError(f"{os.fspath(path)}: features have embedding size D={int(feats.shape[0])}, expected "
                         f"D={dim} ({dim_from})")


def _common_dim(features_dir: Path, stems: Sequence[str]) -> Optional[Tuple[int, str]]:
    """The most common embedding size D among the stems' feature files (.npy headers, or .pt
    tensors mapped without reading their data, see :func:`~mars_plugin.formats.files.feature_shape`),
    and the first file that has it; missing, clashing or unreadable files are left for the
    per-file read to report."""
    first: Dict[int, str] = {}
    count: Dict[int, int] = {}
    for stem in stems:
        try:
            p = find_features(features_dir, stem)
            shape = feature_shape(p)
        except Exception:  # noqa: BLE001 -- reported, with its file, by the per-file read
            continue
        if len(shape) == 3:
            d = int(shape[0])
            count[d] = count.get(d, 0) + 1
            first.setdefault(d, p.name)
    if not count:
        return None
    d = max(count, key=lambda k: (count[k], -list(first).index(k)))
    return d, f"as most feature files, e.g. {first[d]}"


#: What :func:`check_out_apart` takes per input flag: a path, several (a flag whose command
#: reads several folders under it, e.g. ``--root``), or None (not given).
InputPaths = Union[None, os.PathLike, str, Sequence[Union[None, os.PathLike, str]]]


def _real(path: Union[os.PathLike, str]) -> Path:
    """The absolute path with every symlink, ``.`` and ``..`` resolved; a part that does not
    exist yet is kept as written below its deepest existing (resolved) ancestor."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def _lineage(real: Path) -> List[Tuple[Path, Optional[os.stat_result]]]:
    """``real`` and its ancestors, deepest first, with their ``os.stat`` (None: does not exist)."""
    out = []
    for p in (real, *real.parents):
        try:
            out.append((p, os.stat(p)))
        except OSError:
            out.append((p, None))
    return out


def _within(inner: List[Tuple[Path, Optional[os.stat_result]]],
            outer: List[Tuple[Path, Optional[os.stat_result]]]) -> Optional[bool]:
    """Whether the path of lineage ``inner`` is (True: the same) or lies inside (False) the
    path of lineage ``outer``; None: neither. Compared by resolved name and, where both exist,
    by device and inode (a bind mount, a case-insensitive file system)."""
    top, top_stat = outer[0]
    for i, (p, st) in enumerate(inner):
        if p == top or (st is not None and top_stat is not None and os.path.samestat(st, top_stat)):
            return i == 0
    return None


def check_out_apart(out: Optional[Union[os.PathLike, str]], out_flag: str,
                    inputs: Mapping[str, InputPaths]) -> None:
    """An output is never an input: a :class:`JobError` naming both flags and both paths,
    before any work (nothing read, created or locked), when ``out`` (given as ``out_flag``) is,
    contains or lies inside one of ``inputs`` ({flag: path or paths} of the files and folders
    the same command reads), under any spelling: symlinks (to the folder or to a parent, the
    output's deepest existing ancestor when it does not exist yet), ``.``, ``..``, trailing
    slashes, relative or absolute. ``mars predict --images D --out D`` would replace the
    photographs with labels; an output inside an input folder would be read as an input next
    time. Inputs that do not exist are left to the command's own check (nothing to overwrite);
    ``out`` None: nothing is written."""
    if out is None:
        return
    mine = _lineage(_real(out))
    for flag, given in inputs.items():
        paths = given if isinstance(given, (list, tuple)) else [given]
        for path in paths:
            if path is None or not os.path.exists(path):
                continue
            theirs = _lineage(_real(path))
            inside, contains = _within(mine, theirs), _within(theirs, mine)
            if inside is None and contains is None:
                continue
            real, theirs_real = mine[0][0], theirs[0][0]
            if inside or contains:
                how, where = "is", f"{real}"
            elif inside is not None:
                how, where = "lies inside", f"{real} in {theirs_real}"
            else:
                how, where = "contains", f"{theirs_real} in {real}"
            raise JobError(f"{out_flag} {os.fspath(out)} {how} {flag} {os.fspath(path)} ({where}): an output never "
                           f"goes where the command reads its inputs; give {out_flag} a path apart from them")


def root_reads(root: Union[os.PathLike, str], data: str, domains: Sequence[str],
               references: bool = False) -> List[Path]:
    """What a command reads under DHR's ``--root`` (the inputs :func:`check_out_apart` keeps
    an output apart from): ``<root>/<data>/<domain>/`` of each domain (``image``, ``mask``,
    ``xml``) and, with ``references``, ``<root>/WSS/<data>/`` (the other methods' masks). An
    output elsewhere under ``--root`` (DHR's checkout, ``runs/``) is apart from them."""
    root = Path(root)
    return [root / data / d for d in domains] + ([root / "WSS" / data] if references else [])


def _check_out_file(out: os.PathLike, flag: str) -> None:
    """Fail before the work, not after it, when the output file ``out`` cannot be written."""
    p = Path(out)
    if p.is_dir():
        raise JobError(f"{flag} {p}: is a folder; expected a file name")
    parent = p.parent if str(p.parent) else Path(".")
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise JobError(f"{flag} {p}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise JobError(f"{flag} {p}: folder {probe} is not writable")


def _check_out_dir(out: os.PathLike, flag: str) -> None:
    """Create the output folder ``out``, or fail with one line naming ``flag``."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise JobError(f"{flag} {p}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"{flag} {p}: cannot create the folder ({e.strerror or one_line(e)})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise JobError(f"{flag} {p}: folder is not writable")


def load_centroids(path: os.PathLike, flag: str = "--centroids") -> DebiasedCentroids:
    """:meth:`DebiasedCentroids.load` with one-line errors that name the file and ``flag``: a
    missing file, random bytes, a torch file of another structure, a pickle that would need
    unpickling (refused: the file may come from anyone)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise JobError(f"{flag} {p}: no such file")
    if not os.path.isfile(p):
        raise JobError(f"{flag} {p}: not a file")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols: the error says it
            warnings.simplefilter("ignore")
            V = DebiasedCentroids.load(p)
        if V.centroids.ndim != 2 or V.valid.shape[0] != V.centroids.shape[0]:
            raise ValueError(f"centroids of shape {tuple(V.centroids.shape)} and valid of {tuple(V.valid.shape)}")
    except Exception as e:  # noqa: BLE001 -- any failure to read it is the same user error
        if isinstance(e, pickle.UnpicklingError) or "weights only" in str(e).lower():
            # torch's safe loader: "Unsupported global" is a pickled Python object; anything
            # else (random bytes, a plain pickle) is not a tensor file at all.
            why = ("it would need unpickling Python objects, which mars refuses" if "unsupported global" in
                   str(e).lower() else "unreadable as a file of tensors")
        elif isinstance(e, KeyError):
            why = f"no {e.args[0]!r} entry"
        else:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = why.replace(repr(p), "").strip(" :") or type(e).__name__
        raise JobError(f"{flag} {p}: not a centroid file written by 'mars centroids' ({why[:200]})") from None
    return V


#: The numeric parameters of the jobs (and of ``mars reproduce``), each with its check: the
#: bounds of their flags (:mod:`mars_plugin.commands.cli_types`), for callers of the Python functions.
_PARAM_CHECKS = {
    "alpha": lambda v, n: check_fraction(v, n),
    "k_fg": lambda v, n: check_int_param(v, n, 1, MAX_K),
    "k_bg": lambda v, n: check_int_param(v, n, 1, MAX_K),
    "seed": lambda v, n: check_seed(v, n),
    "batch_size": lambda v, n: check_int_param(v, n, 1, MAX_BATCH_SIZE),
    "feature_batch_size": lambda v, n: check_int_param(v, n, 1, MAX_BATCH_SIZE),
    "workers": lambda v, n: check_int_param(v, n, 1, MAX_WORKERS),
    "num_examples": lambda v, n: check_int_param(v, n, 0, MAX_EXAMPLES),
    "per_class": lambda v, n: check_int_param(v, n, 0, MAX_PER_CLASS),
    "spill_mb": lambda v, n: check_real_param(v, n, 0.0, float("inf")),  # 0: spill every batch
    "threshold": lambda v, n: check_real_param(v, n, 0.0, 1.0, high_open=True),  # >= 1 keeps no pixel
    "num_classes": lambda v, n: check_num_classes(v, n),
}


def check_job_params(**params: Any) -> Dict[str, Any]:
    """Each keyword (``alpha``, ``k_fg``, ``k_bg``, ``seed``, ``batch_size``,
    ``feature_batch_size``, ``workers``, ``num_examples``, ``per_class``, ``spill_mb``,
    ``threshold``, ``num_classes``) checked against its bounds, scikit-learn style (the error
    names the parameter, its value and the range); returns them converted."""
    return {name: _PARAM_CHECKS[name](value, name) for name, value in params.items()}


def _progress(it, total: int, desc: str, enabled: bool):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, unit="img")


def _stems(labels_dir: os.PathLike, skip_suffixes: Sequence[str] = (), flag: str = "--labels") -> List[str]:
    _check_folder(labels_dir, flag)
    stems = [s for s in list_stems(labels_dir, (".png",)) if not any(s.endswith(x) for x in skip_suffixes)]
    if not stems:
        raise JobError(f"{flag} {labels_dir}: no .png label files in this folder")
    return stems


# --------------------------------------------------------------------------------------------
# input folders, checked once before any work: a mistyped or wrong folder is one line, not one
# failure per image (and, with --on-error skip, an empty output folder)
# --------------------------------------------------------------------------------------------


def _check_folder(folder: os.PathLike, flag: str) -> Path:
    p = Path(folder)
    if not p.exists():
        raise JobError(f"{flag} {p}: no such folder")
    if not p.is_dir():
        raise JobError(f"{flag} {p}: not a folder")
    return p


def check_input_folder(folder: os.PathLike, flag: str, stems: Sequence[str], extensions: Sequence[str],
                       what: str, of: str = "labels") -> None:
    """``folder`` (given as ``flag``) exists and holds a file for at least one of ``stems``
    (``<stem><ext>`` for one of ``extensions``); else a :class:`JobError` of one line, before any
    work. A stem without its file is a per-file failure later; no stem with one is the wrong
    folder (a typo, the images given as the features, ...)."""
    p = _check_folder(folder, flag)
    have = set(list_stems(p, extensions))
    if not have:
        raise JobError(f"{flag} {p}: no {what} files ({', '.join(extensions)}) in this folder")
    if stems and not any(s in have for s in stems):
        raise JobError(f"{flag} {p}: none of the {len(stems)} {of} has its {what} file here (<stem>"
                       f"{'/'.join(extensions)}, e.g. {stems[0]}{extensions[0]}); is it the right folder?")


#: A label map's values are class ids (at most this many foreground classes when C is unknown:
#: COCO's 80 in the 81-class form, 90 in the 91-id form) and the ignore and biased bytes.
_MAX_LABEL_CLASS = 90


def _label_like(path: Path, num_classes: Optional[int]) -> Optional[str]:
    """How the file at ``path`` looks like a label map rather than a photograph (None: it does
    not): a one-channel (P or L) PNG of at most 32 distinct values, all class ids 0..C, 254 or
    255, and at least one foreground class."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.format != "PNG" or im.mode not in ("P", "L"):
                return None
            values = np.unique(np.asarray(im))
            mode = im.mode
    except Exception:  # noqa: BLE001 -- an unreadable file is reported by the per-file read
        return None
    top = _MAX_LABEL_CLASS if num_classes is None else num_classes
    fg = values[(values > 0) & (values < BIASED_VALUE)]
    if len(values) > 32 or not fg.size or int(fg.max()) > top:
        return None
    shown = ", ".join(str(int(v)) for v in values[:8]) + (", ..." if len(values) > 8 else "")
    return f"{path.name}: a {mode}-mode PNG of the values {shown}"


def check_images_folder(images_dir: os.PathLike, stems: Sequence[str], *, flag: str = "--images",
                        labels_dir: Optional[os.PathLike] = None, num_classes: Optional[int] = None,
                        of: str = "labels") -> None:
    """:func:`check_input_folder` for RGB images, and not a folder of label maps: the labels'
    own folder, or one whose first images (up to 8) all look like label PNGs
    (:func:`_label_like`: the pseudo labels or the ground truth given by mistake, which the CRF
    would otherwise read as colours and silently change the result)."""
    from mars_plugin.formats.files import IMAGE_EXTENSIONS

    check_input_folder(images_dir, flag, stems, IMAGE_EXTENSIONS, "image", of)
    p = Path(images_dir)
    if labels_dir is not None and Path(labels_dir).is_dir() and p.resolve() == Path(labels_dir).resolve():
        raise JobError(f"{flag} {p}: is the --labels folder; give the folder of the RGB images")
    looked: List[str] = []
    for stem in stems:
        try:
            path = find_image(p, stem)
        except ValueError:
            continue
        why = _label_like(path, num_classes)
        if why is None:
            return
        looked.append(why)
        if len(looked) == 8:
            break
    if looked:
        raise JobError(f"{flag} {p}: holds label maps, not RGB images ({len(looked)} of {len(looked)} looked at are "
                       f"class-id PNGs, e.g. {looked[0]}); give the folder of the photographs")


def list_images(images_dir: Path, flag: str) -> Tuple[List[Tuple[str, Path]], Dict[str, List[str]]]:
    """(stem, path) of every image of ``images_dir`` sorted by stem, and the stems of several
    files (``a.jpg`` and ``a.png``); a missing, empty or label-map folder is a JobError naming
    ``flag``."""
    if not images_dir.exists():
        raise JobError(f"{flag} {images_dir}: no such folder")
    if not images_dir.is_dir():
        raise JobError(f"{flag} {images_dir}: not a folder")
    by_stem: Dict[str, List[Path]] = {}
    for p in images_dir.iterdir():
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS:
            by_stem.setdefault(p.stem, []).append(p)
    if not by_stem:
        raise JobError(f"{flag} {images_dir}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
    items = [(s, ps[0]) for s, ps in sorted(by_stem.items()) if len(ps) == 1]
    clashes = {s: sorted(p.name for p in ps) for s, ps in by_stem.items() if len(ps) > 1}
    # The masks or pseudo labels given as the images would be "predicted" without complaint.
    looked = [_label_like(p, None) for _, p in items[:8]]
    if looked and all(looked):
        raise JobError(f"{flag} {images_dir}: holds label maps, not RGB images ({len(looked)} of {len(looked)} "
                       f"looked at are class-id PNGs, e.g. {looked[0]}); give the folder of the photographs")
    return items, clashes


def _only(found: List[str], wanted: Optional[Sequence[str]]) -> List[str]:
    """The stems of ``found`` (a folder's listing) that are in ``wanted`` (None: all), in order."""
    if wanted is None:
        return found
    keep = set(wanted)
    return [s for s in found if s in keep]
