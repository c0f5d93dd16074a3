"""The drop-in's argument checks and device choice: pydensecrf's refusals (Cython's typed
memoryviews: ValueError for a wrong dtype, number of dimensions or memory order, TypeError for
None or an object without a buffer) with messages that name the argument, what it got and what
was expected; and the device of a new CRF object (keyword, :func:`set_default_device`, the
``MARS_DENSECRF_DEVICE`` environment variable, else the CPU).

Where we differ, we accept more, never less: read-only arrays (pydensecrf's memoryviews refuse
them; nothing here writes to its inputs), and we refuse what pydensecrf would run on into
undefined or meaningless results: NaN or -inf energies, a compat whose length is not the number
of labels, a kernel or normalisation value outside pydensecrf's enums, NaN features.
"""
from __future__ import annotations

import enum
import numbers
import operator
import os
from typing import Optional, Tuple, Union

import numpy as np
import torch

__all__ = ["KernelType", "NormalizationType", "DEVICE_ENV", "set_default_device", "get_default_device"]


class KernelType(enum.IntEnum):
    """pydensecrf's kernel types (pairwise.h). They do not change inference: pydensecrf starts
    every kernel's parameters at the identity and its Python API cannot set them."""
    CONST_KERNEL = 0
    DIAG_KERNEL = 1
    FULL_KERNEL = 2


class NormalizationType(enum.IntEnum):
    """pydensecrf's kernel normalisations (pairwise.h); see :mod:`mars_plugin.engines.crf_terms`."""
    NO_NORMALIZATION = 0
    NORMALIZE_BEFORE = 1
    NORMALIZE_AFTER = 2
    NORMALIZE_SYMMETRIC = 3


#: The environment variable read when a CRF object is made, for a codebase left unchanged
#: (e.g. ``MARS_DENSECRF_DEVICE=cuda``); :func:`set_default_device` overrides it.
DEVICE_ENV = "MARS_DENSECRF_DEVICE"
_DEFAULT_DEVICE: Optional[torch.device] = None


def _parse_device(device: Union[str, torch.device], what: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what}: got {device!r}; expected a torch device such as 'cpu', 'cuda' or 'cuda:1'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: got {device!r}; expected 'cpu' or a CUDA device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what}: got {device!r} but torch sees no CUDA device; expected 'cpu' here")
    return dev


def set_default_device(device: Optional[Union[str, torch.device]]) -> None:
    """The device of the CRF objects made from now on without a ``device`` keyword (None: back
    to ``MARS_DENSECRF_DEVICE``, else the CPU)."""
    global _DEFAULT_DEVICE
    _DEFAULT_DEVICE = None if device is None else _parse_device(device, "set_default_device")


def get_default_device() -> torch.device:
    """The device a new CRF object gets: :func:`set_default_device`'s, else ``MARS_DENSECRF_DEVICE``'s, else the CPU."""
    if _DEFAULT_DEVICE is not None:
        return _DEFAULT_DEVICE
    env = os.environ.get(DEVICE_ENV, "").strip()
    return _parse_device(env, DEVICE_ENV) if env else torch.device("cpu")


def resolve_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    return get_default_device() if device is None else _parse_device(device, "device")


def count(value, name: str) -> int:
    """A positive integer argument (pydensecrf's C ``int``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: got {value!r}; expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{name}: got {n}; expected a positive integer")
    return n


#: pydensecrf's C ``int`` arguments: what its Cython wrapper converts
C_INT_MIN, C_INT_MAX = -2 ** 31, 2 ** 31 - 1


def c_int(value, name: str) -> int:
    """An argument pydensecrf takes as a C ``int`` (``inference(n)``), converted as its Cython
    wrapper does: a number truncated to an integer (1.5 -> 1), anything else a ``TypeError``, and
    outside -2**31..2**31-1 an ``OverflowError`` at once (pydensecrf's "value too large to
    convert to int"; without the check 2**40 mean-field steps would run for hours)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: got {value!r}; expected an integer (pydensecrf's C int)")
    n = int(value)  # truncates as Cython's conversion does; inf: OverflowError, nan: ValueError
    if not C_INT_MIN <= n <= C_INT_MAX:
        raise OverflowError(f"{name}: got {n}; value too large to convert to int (pydensecrf's C int: "
                            f"{C_INT_MIN}..{C_INT_MAX})")
    return n


def buffer(arr, name: str, ndim: int, dtype: type, expected: str) -> np.ndarray:
    """``arr`` as a C-contiguous ndarray of ``dtype`` and ``ndim`` dimensions, else the error
    kind Cython's typed memoryview raises (``expected`` describes the shape for the message)."""
    want = f"a C-contiguous {np.dtype(dtype).name} array of shape {expected}"
    if arr is None:
        raise TypeError(f"{name}: got None; expected {want}")
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.asarray(memoryview(arr))
        except TypeError:
            raise TypeError(f"{name}: got a {type(arr).__name__}; expected {want} (a numpy array)") from None
    if arr.ndim != ndim:
        raise ValueError(f"{name}: got {arr.ndim} dimensions {arr.shape}; expected {want}")
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: got dtype {arr.dtype}; expected {want} (convert with .astype(np.{np.dtype(dtype).name}))")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: got an array that is not C-contiguous; expected {want} (use np.ascontiguousarray)")
    return arr


def no_nan(arr: np.ndarray, name: str) -> None:
    """Energies may be +inf (a label ruled out), never NaN or -inf (both make Q NaN)."""
    if np.isnan(arr).any() or np.isneginf(arr).any():
        raise ValueError(f"{name}: contains NaN or -inf values; expected finite energies (+inf rules a label out)")


def enum_value(value, cls, name: str):
    try:
        return cls(operator.index(value))
    except (TypeError, ValueError):
        names = ", ".join(f"{m.name} ({m.value})" for m in cls)
        raise ValueError(f"{name}: got {value!r}; expected one of {names}") from None


def compat(value, num_labels: int) -> Tuple[str, Union[float, np.ndarray]]:
    """pydensecrf's ``_labelcomp``: a number (Potts weight w, message -w Kn(Q)), a 1-D float32
    array of L values (diagonal), an (L, L) float32 array (a matrix, symmetrised as
    0.5 (M + M^T) as labelcompatibility.cpp does)."""
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        w = float(np.float32(value))
        if not np.isfinite(w):
            raise ValueError(f"compat: got {value!r}; expected a finite Potts weight")
        return ("potts", w)
    if value is None or not hasattr(value, "__array__") and not isinstance(value, memoryview):
        raise TypeError(f"compat: got a {type(value).__name__}; expected a number, a float32 array of shape "
                        f"({num_labels},) or ({num_labels}, {num_labels})")
    nd = np.ndim(value)
    if nd not in (1, 2):
        raise ValueError(f"compat: got {nd} dimensions {np.shape(value)}; expected a number (Potts), a float32 "
                         f"array of shape ({num_labels},) (diagonal) or ({num_labels}, {num_labels}) (matrix)")
    shape = f"({num_labels},)" if nd == 1 else f"({num_labels}, {num_labels})"
    arr = buffer(value, "compat", nd, np.float32, shape)
    if arr.shape != ((num_labels,) if nd == 1 else (num_labels, num_labels)):
        raise ValueError(f"compat: got shape {arr.shape}; expected {shape} for {num_labels} labels")
    if not np.isfinite(arr).all():
        raise ValueError("compat: contains NaN or Inf values; expected finite weights")
    if nd == 1:
        return ("diagonal", arr.copy())
    return ("matrix", (np.float32(0.5) * (arr + arr.T)).astype(np.float32))


def pair(value, name: str, n: int) -> Tuple[float, ...]:
    """A standard deviation given as one number or n numbers (sxy: 2, srgb: 3), as C floats."""
    if isinstance(value, numbers.Number):
        vals = (value,) * n
    else:
        try:
            vals = tuple(value)
        except TypeError:
            raise TypeError(f"{name}: got {value!r}; expected a number or {n} numbers") from None
        if len(vals) != n:
            raise ValueError(f"{name}: got {len(vals)} values {value!r}; expected a number or {n} numbers")
    out = tuple(np.float32(v) for v in vals)
    if not all(np.isfinite(v) and v != 0 for v in out):
        raise ValueError(f"{name}: got {value!r}; expected finite non-zero standard deviations")
    return out
