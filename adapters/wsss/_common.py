"""Shared pieces of the WSSS adapters: pickle opt-in, class lists, id decoding, label writing.

Nothing here knows a particular repository; each adapter module states that repository's
formats and defaults and calls these helpers.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.formats.bounded_load import ReadRefused, numpy_load, pickle_load
from mars_plugin.formats.files import BIASED_VALUE, list_stems, read_label, stem_path, write_label

__all__ = [
    "VOC_CLASSES",
    "COCO_CLASSES",
    "require_trust",
    "load_pickled_npy",
    "load_pickle",
    "decode_voc_id",
    "multi_hot",
    "iter_label_dir",
    "write_label_dir",
    "check_biased_value",
    "checked_labels",
    "read_image_list",
]

#: PASCAL VOC 2012 class names, background first (21 entries, ids 0..20).
VOC_CLASSES: Tuple[str, ...] = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)

#: COCO 2014 class names in COCO's category order, background first (81 entries, ids 0..80): RS+EPM's
#: ``data/COCO.json`` ``class_names`` and the order of the MARS paper's COCO table.
COCO_CLASSES: Tuple[str, ...] = (
    "background", "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse",
    "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie",
    "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove",
    "skateboard", "surfboard", "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon",
    "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut",
    "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse",
    "remote", "keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book",
    "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)

PathLike = Union[str, os.PathLike]


def require_trust(trust_pickle: bool, path: PathLike, what: str) -> None:
    """Refuse to unpickle unless the caller opted in by name (pickles can run arbitrary code)."""
    if trust_pickle is not True:
        raise PermissionError(
            f"{os.fspath(path)} is a pickled {what}; unpickling can run arbitrary code, so it is only "
            f"opened with trust_pickle=True (CLI: --trust-pickle). Pass it if you made this file yourself."
        )


def load_pickled_npy(path: PathLike, *, trust_pickle: bool, what: str) -> Any:
    """``np.load(path, allow_pickle=True).item()`` after the opt-in check.

    Works on numpy 1 and 2 (numpy 2 still resolves the ``numpy.core`` names that files pickled
    by numpy 1 refer to). Tensors inside (IRNet's ``keys``/``cam``) need torch, imported here.
    """
    require_trust(trust_pickle, path, what)
    try:  # the bounded door: a declared size past the file or the bound is refused before reading
        obj = numpy_load(path, allow_pickle=True, what=what)
    except ReadRefused:
        raise
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{os.fspath(path)}: cannot read {what} ({e})") from e
    if isinstance(obj, np.ndarray) and obj.dtype == object and obj.shape == ():
        return obj.item()
    return obj


def load_pickle(path: PathLike, *, trust_pickle: bool, what: str) -> Any:
    """A plain pickle file after the opt-in check."""
    require_trust(trust_pickle, path, what)
    try:
        return pickle_load(path)  # then every tensor and array in it is checked (bounded_load)
    except ReadRefused:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ModuleNotFoundError) as e:
        raise ValueError(f"{os.fspath(path)}: cannot read {what} ({e})") from e


def decode_voc_id(key: Any) -> str:
    """VOC image ids as IRNet stores them (np.int32 2007000032) or as strings -> '2007_000032'."""
    if isinstance(key, (bytes, np.bytes_)):
        key = key.decode()
    if isinstance(key, str):
        return key
    k = int(key)
    s = str(k)
    if len(s) != 10:
        raise ValueError(f"cannot decode the VOC image id {key!r}: expected 10 digits like 2007000032")
    return f"{s[:4]}_{s[4:]}"


def multi_hot(ids: Iterable[int], num_classes: int, *, one_based: bool = True) -> torch.Tensor:
    """(C,) bool multi-hot from class ids (1-based foreground ids by default)."""
    out = torch.zeros(num_classes, dtype=torch.bool)
    for i in ids:
        j = int(i) - (1 if one_based else 0)
        if not 0 <= j < num_classes:
            raise ValueError(f"class id {i} is outside the {num_classes} classes")
        out[j] = True
    return out


def iter_label_dir(
    folder: PathLike, *, ids: Optional[Sequence[str]] = None, skip_suffixes: Sequence[str] = ("_palette",)
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(image id, (H, W) long label) for every PNG of a folder, in sorted order.

    Files whose stem ends with one of ``skip_suffixes`` (AdvCAM/IRNet's ``<name>_palette.png``
    visualisations) are skipped. With ``ids``, exactly those images are read, in that order.
    Pixel values are returned as stored (255 = ignore). An id that is not a plain file name
    (``../x``, ``a/b``, empty, NUL) is a ValueError: it would read outside ``folder``.
    """
    folder = Path(folder)
    stems = list(ids) if ids is not None else [
        s for s in list_stems(folder, (".png",)) if not any(s.endswith(x) for x in skip_suffixes)
    ]
    for stem in stems:
        path = stem_path(folder, stem, ".png")
        if not path.is_file():
            raise ValueError(f"missing label {path}")
        yield stem, read_label(path, biased_value=None)


def write_label_dir(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    mode: str,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
) -> List[Path]:
    """Write ``<out_dir>/<id>.png`` for each (id, label) with -1 as ``biased_value``, atomically.

    ``dry_run=True`` writes nothing and returns the paths that would be written. An id that is
    not a plain file name (empty, ``.``, ``..``, a path separator, NUL) is a ValueError.
    """
    out = Path(out_dir)
    paths = []
    for stem, label in labels:
        # an id such as "../x" or "a/b" would write outside out_dir: refused, also in a dry run
        p = stem_path(out, stem, ".png")
        if not dry_run:
            write_label(p, label, biased_value=biased_value, mode=mode)
        paths.append(p)
    return paths


def check_map_size(shape: Sequence[int], what: str) -> None:
    """Maps of (..., H, W) have at least one pixel: a 0-height or 0-width map is a ValueError
    naming ``what`` (the file, or the in-memory object), not an error deep in a resize later."""
    if len(shape) >= 2 and (int(shape[-2]) < 1 or int(shape[-1]) < 1):
        raise ValueError(f"{what}: maps of height {int(shape[-2])} and width {int(shape[-1])}; an image has at "
                         "least one pixel (H, W >= 1)")


def file_error(path: PathLike, stem: str, e: ValueError) -> ValueError:
    """``e`` (a message about the object read from ``path``, which starts with ``stem: ``) as a
    ValueError that names the file instead."""
    msg = str(e)
    if msg.startswith(f"{stem}: "):
        msg = msg[len(stem) + 2:]
    return ValueError(f"{os.fspath(path)}: {msg}")


def check_biased_value(biased_value: int, num_classes: int) -> int:
    """The byte for biased pixels: an int above every class id 0..C and at most 255."""
    if isinstance(biased_value, bool) or not isinstance(biased_value, (int, np.integer)):
        raise ValueError(f"biased_value must be an integer byte, got {biased_value!r}")
    v = int(biased_value)
    if not num_classes < v <= 255:
        raise ValueError(f"biased_value must be a byte above the class ids 0..{num_classes} (254 by default), got {v}")
    return v


def checked_labels(
    labels: Iterable[Tuple[str, Any]], num_classes: int, hint: str = ""
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(id, label) pairs passed through, refusing anything but integer (H, W) maps of -1
    (biased), 0..C and 255 (ignore)."""
    for stem, label in labels:
        t = torch.as_tensor(label.detach().cpu() if isinstance(label, torch.Tensor) else np.asarray(label))
        if t.is_floating_point() or t.dtype == torch.bool or t.ndim != 2:
            raise ValueError(f"label of {stem} must be an integer (H, W) tensor, got {t.dtype} {tuple(t.shape)}")
        t = t.long()
        ok = (t == -1) | ((t >= 0) & (t <= num_classes)) | (t == 255)
        if not bool(ok.all()):
            bad = sorted(set(t[~ok].tolist()))[:5]
            raise ValueError(f"label of {stem} holds {bad}; expected -1 (biased), 0..{num_classes} or 255{hint}")
        yield str(stem), t


def argmax_label(prepared: Any, marginals: Optional[Sequence[Any]] = None) -> torch.Tensor:
    """(H, W) long label of the argmax rule SEAM, RS+EPM and DHR apply after their CRF: the
    argmax over the channels (ties to the first, as ``np.argmax`` upstream) of the CRF's (L, H, W)
    marginals (None: the adapter's ``crf_input`` scores as they are), mapped through the channel
    ids; all background when ``crf_input`` had nothing to refine (no map)."""
    if not prepared["maps"]:
        return torch.zeros(tuple(prepared["size"]), dtype=torch.long)
    scores = prepared["maps"][0] if marginals is None else marginals[0]
    scores = scores.detach().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores)
    return torch.from_numpy(np.asarray(prepared["ids"])[np.argmax(scores, axis=0)].astype(np.int64))


def read_image_list(path: PathLike) -> List[str]:
    """Image ids of a list file: the first whitespace-separated field of each non-empty line,
    without folder or image extension, so plain lists (``2007_000032``) and deeplab/SEAM lines
    (``/JPEGImages/2007_000032.jpg /SegmentationClassAug/2007_000032.png``) give the same ids.
    Ids stay strings."""
    try:
        with open(os.fspath(path), "r", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ValueError(f"{os.fspath(path)}: cannot read the image list ({e})") from e
    out = []
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        name = fields[0].replace("\\", "/").rsplit("/", 1)[-1]
        stem, dot, ext = name.rpartition(".")
        out.append(stem if dot and ext.lower() in ("jpg", "jpeg", "png") else name)
    return out
