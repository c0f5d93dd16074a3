"""One checked-input idiom for the whole package.

Every public function converts and validates its arguments through these helpers so that
errors always name the argument, what it got and what was expected (scikit-learn style).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

# The value debiased PNGs store the biased label -1 as (mars_plugin.formats.files.BIASED_VALUE, which
# is this one): kept here so that the core's label checks can point a raw 254 to read_label
# without importing the I/O layer.
BIASED_PNG_VALUE = 254
#: The ignore byte of every label file (``mars_plugin.formats.files.IGNORE_VALUE`` is this one).
IGNORE_PNG_VALUE = 255
#: The largest number of foreground classes C: labels are bytes 0..C, and 254 (biased) and 255
#: (ignore) are not classes.
MAX_NUM_CLASSES = 253
#: Why C stops at :data:`MAX_NUM_CLASSES`, said by every error that refuses a larger C.
RESERVED_REASON = "labels are 0..C with 254 = biased and 255 = ignore, so C <= 253"

__all__ = [
    "MAX_NUM_CLASSES",
    "degenerate_features",
    "check_varying_features",
    "RESERVED_REASON",
    "check_num_classes",
    "check_class_names",
    "check_ignore_byte",
    "check_seed",
    "check_real_param",
    "rgb_layout",
    "as_tensor",
    "check_ndim",
    "check_finite",
    "check_float_tensor",
    "check_label_tensor",
    "check_same_spatial",
    "check_int_param",
    "check_fraction",
    "describe",
    "check_image_classes",
]


def describe(x: Any) -> str:
    """Short description of a value for error messages."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:200]


def as_tensor(x: Any, name: str, device: Optional[torch.device] = None) -> torch.Tensor:
    """Convert numpy arrays (and nested sequences) to tensors; refuse anything else."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        if x.dtype == object:
            raise TypeError(f"{name} must be a numeric array or tensor, got {describe(x)}")
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, (list, tuple)):
        try:
            t = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError) as e:  # ragged lists and the like
            raise TypeError(f"{name} must be a tensor or array, got {describe(x)}") from e
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {describe(x)}")
    if device is not None:
        t = t.to(device)
    return t


def check_ndim(t: torch.Tensor, name: str, ndims: Iterable[int], layout: str) -> None:
    ndims = tuple(ndims)
    if t.ndim not in ndims:
        raise ValueError(
            f"{name} must have {' or '.join(str(n) for n in ndims)} dimensions ({layout}), "
            f"got {describe(t)}"
        )


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (integer and bool tensors always are).

    First the sum: NaN and +-Inf carry through a sum, so a finite sum means finite values, and
    a sum is several times faster than ``isfinite`` on float16 CPU tensors (the features' dtype,
    checked per file by the folder jobs). A sum that is not finite (a NaN, or finite values that
    overflow it) is settled value by value.
    """
    if not t.is_floating_point() or not t.numel():
        return True
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=wide))):
        return True
    return bool(torch.isfinite(t).all())


def check_finite(t: torch.Tensor, name: str) -> None:
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} contains {bad} NaN or Inf value(s); expected finite values")


def degenerate_features(f: torch.Tensor) -> Optional[str]:
    """Why one image's (D, h, w) feature map carries no per-pixel information, or None.

    Degenerate: every value 0, or (h * w >= 2) every pixel the same vector, what a failed
    extractor leaves behind. Eq. 4 would then give every pixel of the image one similarity, so
    Eq. 5 marks all its foreground biased or none of it. A map constant only inside one class
    region is not degenerate (a real extractor may give a flat object one code); a 1 x 1 map
    that is not zero is one vector by its size, not by a failure. The usual map differs between
    its first and last pixel, an O(D) look; only a map that does not is compared in full.
    """
    flat = f.detach().reshape(f.shape[0], -1)
    n = flat.shape[1]
    if n == 0 or flat.shape[0] == 0:
        return None
    if n >= 2 and not torch.equal(flat[:, 0], flat[:, -1]):
        return None
    if n >= 2 and not bool((flat == flat[:, :1]).all()):
        return None
    if not bool(flat[:, 0].any()):
        return "every value is 0"
    return "every pixel holds the same vector" if n >= 2 else None


def check_varying_features(f: torch.Tensor, name: str) -> None:
    """A ValueError naming ``name`` when the (D, h, w) map ``f`` is degenerate
    (:func:`degenerate_features`)."""
    why = degenerate_features(f)
    if why is not None:
        raise ValueError(f"{name}: {why} ({int(f.shape[-2])}x{int(f.shape[-1])} pixels, D={int(f.shape[0])}), as a "
                         "failed feature extractor leaves them; Eq. 4 would give every pixel one similarity and "
                         "Eq. 5 mark all or none of the image's foreground biased; compute the features again")


def check_float_tensor(x: Any, name: str, ndims: Iterable[int], layout: str, *, finite: bool = True) -> torch.Tensor:
    """A finite floating tensor of the given rank (integers are promoted to float32).

    ``finite=False`` skips the scan for NaN/Inf, for callers that check a whole batch at once.
    """
    t = as_tensor(x, name)
    check_ndim(t, name, ndims, layout)
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be a real floating tensor, got {describe(t)}")
    if not t.is_floating_point():
        t = t.float()
    if finite:
        check_finite(t, name)
    return t


def check_label_tensor(
    x: Any,
    name: str,
    ndims: Iterable[int],
    layout: str,
    *,
    ignore_index: int,
    allow_biased: bool = False,
    num_classes: Optional[int] = None,
    values: bool = True,
) -> torch.Tensor:
    """An integer label map with values in {0..C}, ``ignore_index`` and optionally -1.

    ``values=False`` checks rank and type only, for callers that check a whole batch at once;
    an integer tensor then comes back in its own dtype (the caller widens it if it must).
    """
    t = as_tensor(x, name)
    check_ndim(t, name, ndims, layout)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        if t.is_floating_point() and bool((t == t.round()).all()):
            t = t.long()
        else:
            raise TypeError(f"{name} must be an integer label map, got {describe(t)}")
    if not values:
        return t
    t = t.long()
    special = t == ignore_index
    if allow_biased:
        special |= t == -1
    values = t[~special]
    if values.numel():
        lo, hi = int(values.min()), int(values.max())
        if lo < 0:
            allowed = "-1 (biased), " if allow_biased else ""
            raise ValueError(
                f"{name} holds the negative value {lo}; expected class ids >= 0, "
                f"{allowed}or ignore_index={ignore_index}"
            )
        if num_classes is not None and hi > num_classes:
            raise ValueError(
                f"{name} holds the class id {hi} but num_classes={num_classes}; expected ids in "
                f"0..{num_classes} (0 = background) or ignore_index={ignore_index}{_biased_hint(t, allow_biased)}"
            )
    return t


def _biased_hint(t: torch.Tensor, allow_biased: bool) -> str:
    """Why a 254 is there: it is how debiased PNGs store the biased label -1, and the one
    reader that maps it back is ``read_label`` (a plain PIL/numpy read keeps 254)."""
    if not bool((t == BIASED_PNG_VALUE).any()):
        return ""
    if allow_biased:
        return (f"; {BIASED_PNG_VALUE} is how debiased PNGs store biased pixels: read them with "
                f"mars_plugin.formats.files.read_label, which maps {BIASED_PNG_VALUE} to -1")
    return (f"; {BIASED_PNG_VALUE} is how debiased PNGs store biased pixels: this argument takes the WSSS "
            f"pseudo label, not a debiased one")


def check_same_spatial(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if tuple(a.shape[-2:]) != tuple(b.shape[-2:]):
        raise ValueError(
            f"{a_name} and {b_name} must have the same height and width, got "
            f"{tuple(a.shape[-2:])} and {tuple(b.shape[-2:])}"
        )


def check_int_param(value: Any, name: str, minimum: int, maximum: Optional[int] = None, why: str = "") -> int:
    """An integer in ``minimum..maximum`` (no upper bound when ``maximum`` is None); ``why``
    is appended to the error in parentheses (the reason for the bound)."""
    expected = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    reason = f" ({why})" if why else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {describe(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {expected}, got {value}{reason}")
    return int(value)


def check_num_classes(value: Any, name: str = "num_classes") -> int:
    """C, the number of foreground classes: an integer in 1..253 (:data:`RESERVED_REASON`)."""
    return check_int_param(value, name, 1, MAX_NUM_CLASSES, RESERVED_REASON)


def check_class_names(names: Any, name: str = "class_names") -> List[str]:
    """Class names, background first: a list of 2..254 strings (C = len - 1 <= 253)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) \
            or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{name} must be a list of class names (background first), got {describe(names)}")
    if len(names) < 2:
        raise ValueError(f"{name} must hold background and at least one class, got {len(names)} name(s)")
    if len(names) - 1 > MAX_NUM_CLASSES:
        raise ValueError(f"{name} holds {len(names)} names = background + {len(names) - 1} classes, but "
                         f"{RESERVED_REASON} (at most {MAX_NUM_CLASSES + 1} names)")
    return list(names)


def check_ignore_byte(value: Any, name: str = "ignore_index", num_classes: Optional[int] = None) -> int:
    """The ignore value of label *files*: a byte 0..255 that is neither the biased byte 254 nor
    a class id 0..C (when ``num_classes`` C is known)."""
    v = check_int_param(value, name, 0, IGNORE_PNG_VALUE, "label files hold bytes")
    if v == BIASED_PNG_VALUE:
        raise ValueError(f"{name} must not be {BIASED_PNG_VALUE}: that byte marks biased pixels in debiased labels "
                         f"(255, the default, is the ignore byte of every WSSS repository)")
    if num_classes is not None and v <= num_classes:
        raise ValueError(f"{name} is {v}, a class id of 0..{num_classes} (0 = background); expected a value above "
                         f"the classes, e.g. 255")
    return v


# Bounds of the parameters of the folder jobs and their flags (mars_plugin.commands.inputs,
# mars_plugin.commands.cli_types): typos caught before hours of work or an allocation that cannot fit.
#: K-means clusters per class (the paper: 2); beyond an image's pixels K gives one centroid
#: per pixel, so a larger K is a typo, not a setting.
MAX_K = 1000
#: Images per batched K-means, CRF or forward call.
MAX_BATCH_SIZE = 4096
#: Worker processes of ``mars debias``.
MAX_WORKERS = 256
#: CPU threads (``--threads``).
MAX_THREADS = 1024
#: Rows of the report's overlay grids: most-changed images, and images per class (up to 24
#: classes): more makes a grid image past PIL's decompression-bomb limit.
MAX_EXAMPLES = 100
MAX_PER_CLASS = 10

#: ``res`` of the feature extractors (``--res``): the smallest patch of the models ``mars
#: features`` loads (STEGO and Leopart ViT/8; DINOv2 and CAUSE 14, Leopart ViT/16; each model
#: then checks its own) up to a side whose ViT attention still fits a GPU.
MIN_RES, MAX_RES = 8, 2048
#: ``stride`` of the feature files (``--stride``): output cells of N x N pixels.
MAX_STRIDE = 1024

#: Seeds are reduced modulo 2**32 where numpy seeds (``np.random.SeedSequence`` of the K-means):
#: a larger or negative seed would silently give the same run as another one.
MAX_SEED = 2**32 - 1


def check_seed(value: Any, name: str = "seed") -> int:
    """A seed in 0..2**32 - 1 (numpy's legacy range; every seed in it gives its own run)."""
    return check_int_param(value, name, 0, MAX_SEED, "larger seeds would repeat smaller ones")


def check_real_param(value: Any, name: str, low: float, high: float, *, low_open: bool = False,
                     high_open: bool = False) -> float:
    """A finite real number in the interval ``low..high`` (``*_open``: that end excluded;
    ``math.inf`` as ``high`` leaves it unbounded, finiteness still required)."""
    lo_b, hi_b = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    interval = f"{lo_b}{low:g}, {'inf' if high == math.inf else f'{high:g}'}{hi_b}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number in {interval}, got {describe(value)}")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name} must be a finite number in {interval}, got {value}")
    return float(value)


def rgb_layout(shape: Tuple[int, ...], name: str, size: Tuple[int, int]) -> Optional[str]:
    """Which layout an image of ``shape`` (three dimensions) has, for an expected (H, W) =
    ``size``: ``"chw"`` for (3, H, W), ``"hwc"`` for (H, W, 3), None for neither (the caller
    says what it expected).

    A 3x3 image's (3, 3, 3) reads both ways, with different pixels: a ValueError naming both
    readings, instead of picking one silently."""
    H, W = size
    chw, hwc = tuple(shape) == (3, H, W), tuple(shape) == (H, W, 3)
    if chw and hwc:
        raise ValueError(
            f"{name} of shape {tuple(shape)} is ambiguous: for a 3x3 image it reads both as (3, H, W) (channels "
            f"first) and as (H, W, 3) (channels last), which hold different pixels; 3x3 images are refused "
            f"(pad or resize it)")
    return "chw" if chw else "hwc" if hwc else None


def check_fraction(value: Any, name: str, *, low_open: bool = True, low: float = 0.0, high: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a real number in ({low}, {high}], got {describe(value)}")
    ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must lie in {bracket}{low}, {high}], got {value}")
    return float(value)


def check_image_classes(x: Any, name: str, num_classes: int, batch: Optional[int]) -> torch.Tensor:
    """Image-level labels as a boolean multi-hot tensor, (C,) or (B, C) when ``batch`` is set.

    Two spellings are accepted and never confused:

    * a tensor or numpy array is a **multi-hot vector** over the C foreground classes
      (index k <-> class k+1, the layout of IRNet/SEAM ``cls_labels.npy``), shape (C,) or (B, C);
    * a Python list/tuple/set of ints is a list of **1-based class ids** (1..C); for a batch,
      a list of such lists.
    """
    if isinstance(x, (torch.Tensor, np.ndarray)):
        t = as_tensor(x, name)
        want = (num_classes,) if batch is None else (batch, num_classes)
        if tuple(t.shape) != want:
            layout = "(C,)" if batch is None else "(B, C)"
            raise ValueError(
                f"{name} as a multi-hot tensor must have shape {layout} = {want} "
                f"(foreground classes only, index k is class k+1), got {describe(t)}"
            )
        if t.is_complex():
            raise TypeError(f"{name} must be real, got {describe(t)}")
        if not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"{name} as a multi-hot tensor must hold only 0 and 1, got {describe(t)}")
        return t.bool()
    if isinstance(x, (list, tuple, set, frozenset)):
        if batch is not None:
            if len(x) != batch or (batch and all(isinstance(i, numbers.Integral) for i in x)):
                got = f"the flat id list {list(x)!r}" if all(isinstance(i, numbers.Integral) for i in x) else len(x)
                raise ValueError(f"{name} must hold one class-id list per image ({batch}), got {got}")
            return torch.stack([check_image_classes(list(ids) if isinstance(ids, (list, tuple, set, frozenset)) else ids,
                                                    f"{name}[{i}]", num_classes, None)
                                for i, ids in enumerate(x)])
        out = torch.zeros(num_classes, dtype=torch.bool)
        for cid in x:
            if isinstance(cid, bool) or not isinstance(cid, numbers.Integral):
                raise TypeError(f"{name} must hold integer class ids, got {describe(cid)}")
            if not 1 <= cid <= num_classes:
                raise ValueError(
                    f"{name} holds class id {cid}; expected 1-based foreground ids in 1..{num_classes}"
                )
            out[int(cid) - 1] = True
        return out
    raise TypeError(
        f"{name} must be a multi-hot tensor/array (C,) or a list of 1-based class ids, got {describe(x)}"
    )


#: At most this many scales (DHR: 4), each at most this factor (DHR: 2): each scale is one more
#: forward pass, and the ViT's attention grows with the square of a scale's token count.
MAX_SCALES, MAX_SCALE = 16, 8.0


#: Shown in check_scales' error: DHR's scales (adapters/uss/multiscale.py's DHR_SCALES, which
#: this base module cannot import).
_SCALES_EXAMPLE = (2.0, 1.0, 1.5, 0.5)


def check_scales(scales: Any, name: str = "scales") -> Tuple[float, ...]:
    """A sequence of 1..16 positive finite numbers up to 8, as a tuple of floats (order kept):
    the scales of multi-scale inference (``mars features``, ``mars predict``)."""
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence):
        raise TypeError(f"{name} must be a sequence of positive numbers such as {_SCALES_EXAMPLE}, "
                        f"got {describe(scales)}")
    if len(scales) == 0:
        raise ValueError(f"{name} must hold at least one scale, got an empty {type(scales).__name__}")
    if len(scales) > MAX_SCALES:
        raise ValueError(f"{name} must hold at most {MAX_SCALES} scales (one forward pass each), got {len(scales)}")
    out = []
    for i, s in enumerate(scales):
        if isinstance(s, bool) or not isinstance(s, numbers.Real):
            raise TypeError(f"{name}[{i}] must be a positive number, got {describe(s)}")
        if not math.isfinite(s) or s <= 0 or s > MAX_SCALE:
            raise ValueError(f"{name}[{i}] must be a finite number in (0, {MAX_SCALE:g}], got {s}")
        out.append(float(s))
    return tuple(out)
