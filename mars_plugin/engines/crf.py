"""The dense CRF (Krahenbuhl & Koltun, NIPS 2011) in torch: batched, on the inputs' device.

This is the refinement R of MARS Eq. 5 (the debiased mask) and Eq. 6 (the teacher), and of the
WSSS repositories' own pseudo-label steps. It computes what pydensecrf's ``DenseCRF2D``
computes (``densecrf/src/densecrf.cpp``, ``pairwise.cpp``; the lattice in
:mod:`mars_plugin.engines.permutohedral`), to float32 rounding:

* unary energy U = -log(clip(p, 1e-5, 1)) (``unary_from_softmax``), or the label unary of
  ``unary_from_labels`` (IRNet/AdvCAM's ``crf_inference_label``);
* two Potts pairwise terms, each a Gaussian filter on the permutohedral lattice with
  pydensecrf's symmetric normalisation (``n = 1 / sqrt(K 1)``, the message ``n * K(n * Q)``,
  the point itself included, as the lattice filter gives it): a Gaussian kernel on the pixel
  position (x / sxy, y / sxy) and a bilateral kernel on (x / sxy, y / sxy, r / srgb, g / srgb,
  b / srgb) of the uint8 RGB image;
* mean field: Q = softmax(-U), then ``iterations`` times
  Q = softmax(-U + w_g n_g K_g(n_g Q) + w_b n_b K_b(n_b Q)).

A batch of B images, of equal or different sizes, is one lattice per kernel whose keys start
with the image index, so the result equals B separate runs and nothing is padded.
``backend="pydensecrf"`` runs the reference itself (the ``crf`` extra; CPU, one image at a time).

Parameters come as a preset name or a dict (:data:`CRF_PRESETS`, :func:`check_crf_params`).
"""
from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from mars_plugin.engines import crf_compiled
from mars_plugin._checks import as_tensor, check_finite, describe, rgb_layout
from mars_plugin.engines.permutohedral import MAX_COORDINATE, LatticeTooLarge, PermutohedralLattice, lifted_bounds, max_lifted_coordinate

__all__ = [
    "CRF_PRESETS",
    "DEFAULT_CRF_PRESET",
    "DEFAULT_CRF_PARAMS",
    "CRF_BACKENDS",
    "DenseCRF",
    "dense_crf",
    "dense_crf_from_unary",
    "unary_from_probs",
    "unary_from_labels",
    "check_crf_params",
    "check_crf_std_bounds",
    "check_crf_image",
    "crf_memory_bytes",
    "DEFAULT_MAX_BYTES",
    "MAX_ITERATIONS",
    "MAX_COMPAT",
    "check_crf_backend",
    "clear_lattice_cache",
    "image_to_hwc_uint8",
]

#: Named parameter sets. ``"mars"`` (the default) is the setting of the MARS authors' own code:
#: RS+EPM ``convert_seed_to_pseudo_masks.py`` ``crf_dict['deeplab']``, DHR
#: ``core/refinements/densecrf.py`` ``DenseCRF.__init__`` defaults, and STEGO ``src/crf.py``
#: (``MAX_ITER``, ``POS_*``, ``Bi_*``) -- DeepLab's CRF, hence its alias ``"deeplab"``.
#: ``"psa"`` (alias ``"seam"``) is the probability-input ``crf_inference`` of PSA and SEAM
#: (``tool/imutils.py``).
CRF_PRESETS: Dict[str, Dict[str, float]] = {
    "mars": {
        "iterations": 10,
        "gaussian_sxy": 1,
        "gaussian_compat": 3,
        "bilateral_sxy": 67,
        "bilateral_srgb": 3,
        "bilateral_compat": 4,
    },
    "psa": {
        "iterations": 10,
        "gaussian_sxy": 3,
        "gaussian_compat": 3,
        "bilateral_sxy": 80,
        "bilateral_srgb": 13,
        "bilateral_compat": 10,
    },
}
_ALIASES = {"deeplab": "mars", "seam": "psa"}
DEFAULT_CRF_PRESET = "mars"
#: The default parameters (a copy of ``CRF_PRESETS["mars"]``); a dict given as ``crf_params``
#: overrides these keys.
DEFAULT_CRF_PARAMS: Dict[str, float] = dict(CRF_PRESETS[DEFAULT_CRF_PRESET])
CRF_BACKENDS = ("torch", "pydensecrf")
#: pydensecrf's ``unary_from_softmax`` clip.
PROB_CLIP = 1e-5
#: Pixels filtered as one lattice. On the CPU one VOC image at a time is fastest (a batch of
#: eight 500x375 images as one lattice ran 1.6-2.3x slower than eight single runs: the working
#: set leaves the caches), small images are still grouped; on a GPU the batch is the point, up
#: to about 64 images of 512x512 per lattice.
CPU_CHUNK_PIXELS = 1 << 18
CUDA_CHUNK_PIXELS = 1 << 24
#: On the CPU with numba, the lattices (runs of at most CPU_CHUNK_PIXELS) of a batch are solved
#: in torch.get_num_threads() parallel threads, up to this many per thread in a group (so that
#: the threads stay busy when images differ in size; a group is within max_bytes; only one
#: lattice per thread is alive at a time).
COMPILED_RUNS_PER_THREAD = 4
#: The position-only (Gaussian) kernel's lattice depends on the image sizes alone; the last
#: GAUSSIAN_CACHE_ENTRIES of at most GAUSSIAN_CACHE_PIXELS pixels are kept (about 80 bytes a
#: pixel, 15 MB for a 500x375 image; :func:`clear_lattice_cache` frees them).
GAUSSIAN_CACHE_ENTRIES = 8
GAUSSIAN_CACHE_PIXELS = 1 << 19
#: Labels filtered at a time when a lattice has more than a third as many points as there are
#: pixels (the filter's three (M, labels) arrays would outgrow one (N, L) array): VOC's 21 in
#: two passes of 11, within a few per cent of one pass. Sparser lattices ("psa") filter all
#: labels in one pass, which is faster for them.
FILTER_LABELS = 12
_SOFTMAX_ROWS = 1 << 16
_SOFTMAX_ROWS_CUDA = 1 << 22
#: The most mean-field iterations ``crf_params`` may ask for. MARS, its WSSS sources and
#: DeepLab run 10 (pydensecrf's examples 5); the update has long converged by 100, and 10^6
#: would run for hours.
MAX_ITERATIONS = 100
#: The largest Potts weight (``gaussian_compat``, ``bilateral_compat``): a normalised message
#: is at most sqrt(N), so the float32 energies stay finite for any image below it.
MAX_COMPAT = 1e30
#: The default ``max_bytes``: the most memory one lattice's work may take (6 GiB: with the
#: inputs and torch itself, a process within 8 GB). The images of a batch are grouped within
#: it; an image that needs more alone is refused before any work (see :func:`crf_memory_bytes`).
DEFAULT_MAX_BYTES = 6 << 30
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_STD_KEYS = ("gaussian_sxy", "bilateral_sxy", "bilateral_srgb")


def check_crf_params(params: Union[None, str, Mapping[str, Any]], defaults: Mapping[str, float] = DEFAULT_CRF_PARAMS,
                     integers: Tuple[str, ...] = ("iterations",)) -> Dict[str, float]:
    """CRF parameters from a preset name (``"mars"``/``"deeplab"``, ``"psa"``/``"seam"``), a
    dict of overrides of ``defaults``, or None (``defaults``).

    Every value must be a real number (not a bool or a string), positive and finite in float32
    (pydensecrf takes them as C floats); the ``integers`` keys must be integers, ``iterations``
    at most :data:`MAX_ITERATIONS`, the ``*_compat`` weights at most :data:`MAX_COMPAT`.
    Unknown names and keys are errors. The standard deviations' lower bound depends on the
    image size and is checked with the image (:func:`check_crf_std_bounds`)."""
    if isinstance(params, str):
        name = _ALIASES.get(params, params)
        if name not in CRF_PRESETS:
            raise ValueError(f"crf_params {params!r} is not a preset; expected one of "
                             f"{sorted(set(CRF_PRESETS) | set(_ALIASES))} or a dict")
        out = dict(defaults)
        out.update(CRF_PRESETS[name])
        return out
    out = dict(defaults)
    if params is None:
        return out
    if not isinstance(params, Mapping):
        raise TypeError(f"crf_params must be a preset name or a dict, got {describe(params)}")
    for key, value in params.items():
        if key not in out:
            raise ValueError(f"crf_params has the unknown key {key!r}; expected some of {sorted(out)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not value > 0:
            raise ValueError(f"crf_params[{key!r}] must be a positive number, got {value!r}")
        if value > _FLOAT32_MAX or float(np.float32(value)) == 0.0:
            raise ValueError(f"crf_params[{key!r}] must be a positive number that float32 holds "
                             f"({np.finfo(np.float32).tiny:.3g} to {_FLOAT32_MAX:.3g}), got {value!r}")
        if key in integers and int(value) != value:
            raise ValueError(f"crf_params[{key!r}] must be an integer, got {value!r}")
        if key == "iterations" and value > MAX_ITERATIONS:
            raise ValueError(f"crf_params['iterations'] must be at most {MAX_ITERATIONS} (mean field has long "
                             f"converged; MARS runs 10), got {value!r}")
        if key.endswith("_compat") and value > MAX_COMPAT:
            raise ValueError(f"crf_params[{key!r}] must be at most {MAX_COMPAT:g} (larger weights overflow the "
                             f"float32 energies), got {value!r}")
        out[key] = value
    return out


def _round_up(x: float) -> float:
    """x rounded up to three significant digits (a bound that is still a bound when printed)."""
    y = float(f"{x:.3g}")
    return y if y >= x else float(f"{x * (1 + 5e-3):.3g}")


def check_crf_std_bounds(params: Mapping[str, float], height: int, width: int, name: str = "crf_params") -> None:
    """Refuse standard deviations so small that, on a ``height`` x ``width`` image, x / sxy,
    y / sxy or rgb / srgb lift to lattice coordinates beyond
    :data:`mars_plugin.engines.permutohedral.MAX_COORDINATE` (the lattice works in float32, as
    pydensecrf): the message names the key (as ``name[key]``: ``--crf-params`` on the command
    line), its value and the smallest value that works for this image size (the other standard
    deviations as they are)."""
    limit = MAX_COORDINATE / (1 + 1e-5)  # below the lattice's own check, whatever float32 rounding does
    pos = [float(width - 1), float(height - 1)]

    def smallest(alpha: List[float], beta: List[float]) -> float:
        # the lifted bound is max_j alpha_j / s + beta_j: the smallest s with it <= limit
        need = 0.0
        for a, b in zip(alpha, beta):
            if a > 0:
                need = max(need, a / (limit - b) if b < limit else math.inf)
        return need

    def fail(key: str, need: float, what: str, other: str = "") -> None:
        value = params[key]
        hint = (f"the smallest that works for this image size{other} is {_round_up(need)}" if math.isfinite(need)
                else f"no value works for this image size{other}")
        # A flag's key as the command line writes it everywhere (``--crf-params "key"``); a Python
        # parameter's as Python does (``crf_params['key']``).
        where = f'{name} "{key}"' if name.startswith("--") else f"{name}[{key!r}]"
        raise ValueError(f"{where} = {value!r} is too small for a {height}x{width} image: {what} would "
                         f"overflow the lattice's float32 coordinates (at most {MAX_COORDINATE:.4g}); {hint}")

    g = float(np.float32(params["gaussian_sxy"]))
    need = smallest(lifted_bounds(pos), [0.0] * 3)
    if g < need:
        fail("gaussian_sxy", need, "x / sxy and y / sxy")
    sxy, srgb = float(np.float32(params["bilateral_sxy"])), float(np.float32(params["bilateral_srgb"]))
    alpha = lifted_bounds(pos + [0.0] * 3)
    beta = lifted_bounds([0.0, 0.0] + [255.0] * 3)
    if max(a / sxy + b / srgb for a, b in zip(alpha, beta)) <= limit:
        return
    need_sxy = smallest(alpha, [b / srgb for b in beta])
    need_srgb = smallest(beta, [a / sxy for a in alpha])
    position_part, colour_part = max(alpha) / sxy, max(beta) / srgb
    if colour_part >= position_part:
        fail("bilateral_srgb", need_srgb, "rgb / srgb", f" with bilateral_sxy = {params['bilateral_sxy']!r}")
    fail("bilateral_sxy", need_sxy, "x / sxy and y / sxy", f" with bilateral_srgb = {params['bilateral_srgb']!r}")


def check_crf_backend(backend: Any) -> str:
    if backend not in CRF_BACKENDS:
        raise ValueError(f"crf_backend must be one of {CRF_BACKENDS}, got {backend!r}")
    return backend


# ---------------------------------------------------------------------------------- inputs

def _rgb_tensor(image: Any, name: str, size: Tuple[int, int]) -> torch.Tensor:
    """An RGB image as an (H, W, 3) uint8 tensor (on the image's device).

    Accepts (H, W, 3) or (3, H, W) (whichever matches ``size``; a 3x3 image, which reads both
    ways, is refused), as uint8 or as float in [0, 1] (torchvision's convention, scaled by 255
    and rounded).
    """
    t = as_tensor(image, name)
    layout = rgb_layout(t.shape, name, size) if t.ndim == 3 else None
    if layout == "chw":
        t = t.permute(1, 2, 0)
    elif layout is None:
        raise ValueError(f"{name} must be an RGB image (H, W, 3) or (3, H, W) with (H, W) = {size}, got {describe(t)}")
    if t.dtype == torch.uint8:
        return t.detach()
    if t.is_floating_point():
        t = t.detach()
        if not bool(torch.isfinite(t).all()) or float(t.min()) < 0 or float(t.max()) > 1:
            raise ValueError(f"{name} as a float image must hold values in [0, 1], got {describe(t)}")
        return (t * 255).round().to(torch.uint8)
    raise TypeError(f"{name} must be uint8 or float in [0, 1], got {describe(t)}")


def image_to_hwc_uint8(image: Any, name: str, size: Tuple[int, int]) -> np.ndarray:
    """An RGB image as a contiguous (H, W, 3) uint8 numpy array, the layout pydensecrf needs
    (see :func:`_rgb_tensor` for what is accepted)."""
    return np.ascontiguousarray(_rgb_tensor(image, name, size).cpu().numpy())


def _as_list(x: Any, name: str, ndim: int) -> Tuple[List[Any], str]:
    """Split the three input forms into per-image items: one image (``ndim`` dims), a batch
    (``ndim + 1``) or a list of images. Returns (items, form)."""
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            raise ValueError(f"{name} is an empty list; expected at least one image")
        return list(x), "list"
    t = as_tensor(x, name)
    if t.ndim == ndim:
        return [t], "single"
    if t.ndim == ndim + 1:
        if t.shape[0] == 0:
            raise ValueError(f"{name} is an empty batch {describe(t)}; expected at least one image")
        return list(t.unbind(0)), "batch"
    raise ValueError(f"{name} must be one image with {ndim} dimensions, a batch with {ndim + 1}, or a list, got {describe(t)}")


def _check_energy(u: torch.Tensor, name: str) -> torch.Tensor:
    if u.ndim != 3 or not u.is_floating_point():
        raise ValueError(f"{name} must be an (L, H, W) floating tensor, got {describe(u)}")
    L, H, W = u.shape
    if L < 1 or H < 1 or W < 1:
        raise ValueError(f"{name} must have at least one label and one pixel, got {describe(u)}")
    return u


def _check_valid(valid: Any, n: int, L: int, device: torch.device) -> List[Optional[torch.Tensor]]:
    if valid is None:
        return [None] * n
    items = list(valid) if isinstance(valid, (list, tuple)) else None
    if items is None:
        t = as_tensor(valid, "valid")
        if t.ndim == 1:
            t = t[None].expand(n, -1)
        if tuple(t.shape) != (n, L) or t.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor (L,) or (B, L) = {(n, L)}, got {describe(t)}")
        items = list(t.unbind(0))
    if len(items) != n:
        raise ValueError(f"valid must hold one (L,) mask per image ({n}), got {len(items)}")
    out = []
    for i, m in enumerate(items):
        m = as_tensor(m, f"valid[{i}]")
        if tuple(m.shape) != (L,) or m.dtype != torch.bool:
            raise ValueError(f"valid[{i}] must be an (L,) = ({L},) bool tensor, got {describe(m)}")
        if not bool(m.any()):
            raise ValueError(f"valid[{i}] allows no label; every image needs at least one")
        out.append(m.to(device))
    return out


# ---------------------------------------------------------------------------------- unaries

def unary_from_probs(probs: Any, clip: float = PROB_CLIP) -> torch.Tensor:
    """pydensecrf's ``unary_from_softmax``: -log(clip(p, clip, 1)) in the input's floating dtype,
    returned as float32 (any shape; the labels are wherever the caller keeps them)."""
    p = as_tensor(probs, "probs")
    if not p.is_floating_point() or p.dtype in (torch.float16, torch.bfloat16):
        p = p.float()  # the log of a half is too coarse for the unary
    check_finite(p, "probs")
    u = p.detach().clamp(clip, 1.0)  # the one copy; log and sign in place
    return u.log_().neg_().to(torch.float32)


def unary_from_labels(labels: Any, n_labels: int, gt_prob: float, *, zero_unsure: bool = True) -> torch.Tensor:
    """pydensecrf's ``unary_from_labels``: the label unary of IRNet/AdvCAM's ``crf_inference_label``.

    Shapes:
        labels: (H, W) integer map (any shape works; the energy gets a leading label axis).

    Returns:
        (n_labels, H, W) float32 energy: -log(gt_prob) at the pixel's label,
        -log((1 - gt_prob) / (n_labels - 1)) elsewhere. With ``zero_unsure`` label 0 means
        "unknown" (uniform energy -log(1 / n_labels)) and label k is channel k - 1, as upstream.
    """
    y = as_tensor(labels, "labels")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"labels must be an integer label map, got {describe(y)}")
    if isinstance(n_labels, bool) or not isinstance(n_labels, numbers.Integral) or n_labels < 2:
        raise ValueError(f"n_labels must be an integer >= 2, got {n_labels!r}")
    if isinstance(gt_prob, bool) or not isinstance(gt_prob, numbers.Real) or not 0 < gt_prob < 1:
        raise ValueError(f"gt_prob must lie in (0, 1), got {gt_prob!r}")
    y = y.long()
    channel = y - 1 if zero_unsure else y
    lo, hi = (0, n_labels) if zero_unsure else (0, n_labels - 1)
    if y.numel() and (int(y.min()) < lo or int(y.max()) > hi):
        raise ValueError(f"labels must hold values in {lo}..{hi} for n_labels={n_labels} "
                         f"(zero_unsure={zero_unsure}), got {int(y.min())}..{int(y.max())}")
    # The energies in float64, then stored as float32, as numpy does it upstream.
    n_energy = -math.log((1.0 - gt_prob) / (n_labels - 1))
    p_energy = -math.log(gt_prob)
    u = torch.full((n_labels,) + tuple(y.shape), n_energy, dtype=torch.float64, device=y.device)
    u.scatter_(0, channel.clamp_min(0)[None], p_energy)
    if zero_unsure:
        u[:, y == 0] = -math.log(1.0 / n_labels)
    return u.to(torch.float32)


# ---------------------------------------------------------------------------------- engine

def _features(shapes: Sequence[Tuple[int, int]], sxy: float, rgbs: Optional[List[torch.Tensor]], srgb: float,
              device: torch.device) -> torch.Tensor:
    """(N, 2) (x / sxy, y / sxy) of every pixel in row-major order, as DenseCRF2D numbers them,
    or (N, 5) with (r / srgb, g / srgb, b / srgb) of the uint8 images appended: written into one
    float32 array (no (N, 2) positions or float RGB copy on the way)."""
    N = sum(H * W for H, W in shapes)
    out = torch.empty(N, 2 if rgbs is None else 5, dtype=torch.float32, device=device)
    s, c = _f32(sxy, device), _f32(srgb, device)
    start = 0
    for i, (H, W) in enumerate(shapes):
        view = out[start:start + H * W].view(H, W, -1)
        torch.div(torch.arange(W, dtype=torch.float32, device=device), s, out=view[0, :, 0])
        view[1:, :, 0] = view[0, :, 0]
        torch.div(torch.arange(H, dtype=torch.float32, device=device), s, out=view[:, 0, 1])
        view[:, 1:, 1] = view[:, :1, 1]
        if rgbs is not None:
            torch.div(rgbs[i], c, out=view[:, :, 2:])
        start += H * W
    return out


def _f32(x: float, device: torch.device) -> torch.Tensor:
    # pydensecrf takes its standard deviations as C floats: divide by the float32 value.
    return torch.tensor(float(x), dtype=torch.float32, device=device)


def _normaliser(lattice: PermutohedralLattice, N: int, device: torch.device) -> torch.Tensor:
    """pydensecrf's NORMALIZE_SYMMETRIC: 1 / sqrt(K 1 + 1e-20), computed in double as there."""
    k1 = lattice.filter(torch.ones(N, 1, dtype=torch.float32, device=device))
    return (1.0 / torch.sqrt(k1.double() + 1e-20)).to(torch.float32)


def _softmax_rows_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the L labels of (N, L) energies, in place: exp(x - max) / sum, pydensecrf's
    ``expAndNormalize``.

    On the CPU torch's softmax over a short last axis is slow (5.3 ms at L = 2 for 187,500
    pixels, 15.7 ms at L = 8, against 1.4 and 2.6 ms written out); from about 16 labels on it
    is the faster one (4.9 against 7.9 ms at L = 21): it runs on blocks of rows, so that its
    output is never a second (N, L) array.
    """
    if x.is_cuda or x.shape[1] >= 16:
        rows = _SOFTMAX_ROWS_CUDA if x.is_cuda else _SOFTMAX_ROWS
        for a in range(0, x.shape[0], rows):
            x[a:a + rows] = torch.softmax(x[a:a + rows], 1)
        return x
    x.sub_(x.amax(1, keepdim=True)).exp_()
    return x.div_(x.sum(1, keepdim=True))


def _label_blocks(L: int, N: int, M: int) -> List[Tuple[int, int]]:
    """Label ranges filtered at a time for N pixels and a largest lattice of M points: all L
    when 3 (M + 1) <= N, else at most FILTER_LABELS, of equal widths (21 -> 11, 10)."""
    if 3 * (M + 1) <= N:
        return [(0, L)]
    n = -(-L // FILTER_LABELS)
    width = -(-L // n)
    return [(a, min(a + width, L)) for a in range(0, L, width)]


def _chunks(sizes: Sequence[int], limit: int) -> List[Tuple[int, int]]:
    """Consecutive runs of images with at most ``limit`` pixels in all (one image at least)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            runs.append((start, i))
            start, total = i, 0
        total += n
    runs.append((start, len(sizes)))
    return runs


def _mean_field_torch(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                      rgbs: List[torch.Tensor], p: Mapping[str, float], chunk_pixels: Optional[int],
                      max_bytes: Optional[int]) -> List[torch.Tensor]:
    """Mean field for a batch, in runs of at most ``chunk_pixels`` pixels (one lattice each) that
    fit in ``max_bytes``; an image that does not fit alone is refused before any work.

    On the CPU with numba (:mod:`mars_plugin.engines.crf_compiled`), groups of up to
    ``COMPILED_RUNS_PER_THREAD`` runs per thread (within ``max_bytes`` together) are solved in
    parallel threads, one run per thread at a time."""
    device = sources[0].device
    compiled = device.type == "cpu" and crf_compiled.available()
    if chunk_pixels is None:
        chunk_pixels = CUDA_CHUNK_PIXELS if device.type == "cuda" else CPU_CHUNK_PIXELS
    L = sources[0].shape[0]
    shapes = [(s.shape[1], s.shape[2]) for s in sources]
    sizes = [H * W for H, W in shapes]
    fit = None
    if max_bytes is not None:
        _check_budget(shapes, L, p, max_bytes)
        fit = _pixels_within(max_bytes, L, p)
        chunk_pixels = max(1, min(chunk_pixels, fit))
    groups = _chunks(sizes, chunk_pixels)
    if compiled:  # runs of images grouped: up to so many runs per thread, within the budget
        most = COMPILED_RUNS_PER_THREAD * torch.get_num_threads()
        groups, runs = [], _chunks(sizes, chunk_pixels)
        for a, b in runs:
            n = sum(sizes[a:b])
            if groups and groups[-1][2] < most and (fit is None or groups[-1][3] + n <= fit):
                groups[-1] = (groups[-1][0], b, groups[-1][2] + 1, groups[-1][3] + n)
            else:
                groups.append((a, b, 1, n))
        groups = [(a, b) for a, b, _, _ in groups]
    out: List[torch.Tensor] = []
    for a, b in groups:
        try:
            out.extend(_mean_field_chunk(sources[a:b], kind, masks[a:b], rgbs[a:b], p, max_bytes, chunk_pixels))
        except LatticeTooLarge:  # images whose colours make a denser lattice than assumed: one at a time
            for i in range(a, b):
                out.extend(_mean_field_chunk(sources[i:i + 1], kind, masks[i:i + 1], rgbs[i:i + 1], p, max_bytes,
                                             chunk_pixels))
    return out


def _lattice(features: torch.Tensor, segment: Optional[torch.Tensor], max_points: Optional[int] = None
             ) -> PermutohedralLattice:
    """A kernel's lattice with its normaliser n folded in on both sides: ``filter(Q)`` is
    n K(n Q), the message of the Potts term before its weight (built in place: one copy of the
    sparse weights)."""
    if not bool(torch.isfinite(features).all()):
        raise ValueError("crf_params: gaussian_sxy, bilateral_sxy or bilateral_srgb is so small that x / sxy or "
                         "rgb / srgb overflows float32; expected standard deviations of about 1 or more")
    lattice = PermutohedralLattice(features, segment, max_points=max_points)
    norm = _normaliser(lattice, features.shape[0], features.device)
    return lattice.scale_(norm, norm)


# ---------------------------------------------------------------------------------- memory
# Bytes of the torch backend's work on one lattice of N pixels, L labels, a position lattice of
# Mg points and a bilateral one of Mb, from what the code allocates (int32 indices, float32
# values): a lattice of dimension d keeps (16 (d+1) + 4) N + (8 (d+1) + 4) M bytes (the
# bilateral one's 52 Mb counted as 56: its neighbour search's leftovers); building the bilateral
# one takes about 190 N + 12 Mb (lifting, one vertex class's sort), then 145 N + 76 Mb (its blur
# tables); the mean field holds -U and Q (8 L N), one label block's energy and input
# (8 Lb N) and the filter's three (M, Lb) arrays; 40 N and _MEMORY_SLACK cover what the
# allocator keeps of the build's freed pages (peak RSS growth measured on 1 to 12 Mpx images /
# this model: 0.66 to 0.98, docs/crf.md; small images fragment more, but are far from any budget).
_MEMORY_SLACK = 1.15


def _gaussian_points(N: int, sxy: float) -> int:
    """The position lattice's size, from above: 1.16 points per pixel at sxy = 1, falling as
    1 / sxy^2 (0.13 at 3), at most d + 1 = 3 per pixel (measured on grids of several sizes)."""
    return int(N * min(3.0, 1.2 / max(float(sxy), 1e-30) ** 2 + 0.01)) + 64


#: The bilateral lattice's points per pixel assumed before it is built: photographs give 0.76
#: to 0.87 at the "mars" preset, 0.03 at "psa"; a noise image up to 6. The lattice is refused
#: when it turns out larger than the budget allows, before its tables are made.
_BILATERAL_POINTS_PER_PIXEL = 1.0


def _memory_model(N: int, L: int, Mg: int, Mb: int) -> int:
    blocks = _label_blocks(L, N, max(Mg, Mb))
    lb = blocks[0][1]
    gaussian = 52 * N + 28 * Mg
    bilateral = 100 * N + 56 * Mb
    build = gaussian + max(190 * N + 12 * Mb, 145 * N + 76 * Mb)
    # -U and Q, one block's energy (and its copy of Q when Q is cut into blocks), the filter
    field = gaussian + bilateral + 8 * L * N + (4 if len(blocks) == 1 else 8) * lb * N + 12 * lb * max(Mg, Mb)
    return int(_MEMORY_SLACK * (43 * N + max(build, field)))


def crf_memory_bytes(height: int, width: int, labels: int, params: Union[None, str, Mapping[str, Any]] = None,
                     bilateral_points_per_pixel: float = _BILATERAL_POINTS_PER_PIXEL) -> int:
    """The memory (bytes) the torch backend's dense CRF takes for one ``height`` x ``width``
    image with ``labels`` labels: what ``max_bytes`` is compared with.

    About 330 bytes a pixel at 2 labels and 580 at 21 with the "mars" preset on a photograph
    (bench_crf.py --memory measures it; the inputs and the result are the caller's). The
    bilateral lattice's size depends on the image's colours: ``bilateral_points_per_pixel``
    is assumed (1.0; a photograph gives 0.76-0.87 at "mars", 0.03 at "psa", noise up to 6).
    """
    prm = check_crf_params(params)
    N = int(height) * int(width)
    return _memory_model(N, int(labels), _gaussian_points(N, prm["gaussian_sxy"]),
                         int(N * bilateral_points_per_pixel) + 64)


def check_crf_image(params: Union[None, str, Mapping[str, Any]], height: int, width: int, labels: int, *,
                    max_bytes: Optional[int] = DEFAULT_MAX_BYTES, name: str = "crf_params") -> Dict[str, float]:
    """What :func:`dense_crf` checks of one ``height`` x ``width`` image with ``labels`` labels
    before any work, for callers that want it per file first: the parameters
    (:func:`check_crf_params`), standard deviations that fit the image's size
    (:func:`check_crf_std_bounds`) and, unless ``max_bytes`` is None, its memory
    (:func:`crf_memory_bytes`). Messages call the parameters ``name`` (``--crf-params`` on the
    command line). Returns the checked parameters."""
    prm = check_crf_params(params)
    check_crf_std_bounds(prm, height, width, name)
    if max_bytes is not None:
        _check_budget([(int(height), int(width))], int(labels), prm, max_bytes)
    return prm


def _gb(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def _describe_sizes(shapes: Sequence[Tuple[int, int]]) -> str:
    if len(shapes) == 1:
        return f"a {shapes[0][0]}x{shapes[0][1]} image"
    return f"{len(shapes)} images ({sum(H * W for H, W in shapes):,} pixels)"


def _example_size(shape: Tuple[int, int], pixels: int) -> str:
    """An H x W of about ``pixels`` pixels at the aspect ratio of ``shape``."""
    H, W = shape
    f = math.sqrt(max(pixels, 1) / (H * W))
    return f"{max(1, int(H * f))}x{max(1, int(W * f))}"


def _pixels_within(max_bytes: float, L: int, p: Mapping[str, float],
                   bilateral_per_pixel: Optional[float] = None) -> int:
    """The most pixels one lattice may hold within ``max_bytes`` (the model is linear in N)."""
    per = bilateral_per_pixel if bilateral_per_pixel is not None else _BILATERAL_POINTS_PER_PIXEL
    n = 1 << 20
    cost = _memory_model(n, L, _gaussian_points(n, p["gaussian_sxy"]) - 64, int(n * per)) / n
    return int(max_bytes // cost)


def _check_budget(shapes: Sequence[Tuple[int, int]], L: int, p: Mapping[str, float], max_bytes: float) -> None:
    """Refuse, before any work, an image whose dense CRF alone needs more than ``max_bytes``."""
    for H, W in shapes:
        N = H * W
        need = _memory_model(N, L, _gaussian_points(N, p["gaussian_sxy"]), int(N * _BILATERAL_POINTS_PER_PIXEL) + 64)
        if need > max_bytes:
            fit = _pixels_within(max_bytes, L, p)
            raise ValueError(
                f"the dense CRF of a {H}x{W} image with {L} labels needs about {_gb(need)} (crf_memory_bytes), more "
                f"than max_bytes = {_gb(max_bytes)}; at {L} labels at most {fit:,} pixels fit (e.g. "
                f"{_example_size((H, W), fit)}); pass a larger max_bytes (None: no limit) or downscale the image")


def _bilateral_points_within(max_bytes: float, N: int, L: int, Mg: int) -> int:
    """The largest bilateral lattice (points) whose mean field fits in ``max_bytes``."""
    lo, hi = 0, 6 * N + 64  # a lattice has at most d + 1 = 6 points per pixel
    if _memory_model(N, L, Mg, hi) <= max_bytes:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _memory_model(N, L, Mg, mid) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _segments(sizes: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    if len(sizes) == 1:
        return None
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


_GAUSSIAN_CACHE: "OrderedDict[tuple, PermutohedralLattice]" = OrderedDict()
_GAUSSIAN_CACHE_LOCK = threading.Lock()


def _gaussian_lattice(shapes: Tuple[Tuple[int, int], ...], sxy: float, device: torch.device) -> PermutohedralLattice:
    """The position-only kernel's (normalised) lattice depends on the image sizes alone: the
    last few (VOC's handful of sizes, a training loop's fixed crop) are kept, when small."""
    return _kept((shapes, float(np.float32(sxy)), str(device)), lambda: _lattice(
        _features(shapes, sxy, None, 1.0, device), _segments([H * W for H, W in shapes], device)))


def _kept(key: Any, build: Callable[[], Any]) -> Any:
    """The kept lattice of ``key``, else ``build()`` (kept when small; the least recently used
    goes first). Built outside the lock: two threads may build the same one, neither waits."""
    with _GAUSSIAN_CACHE_LOCK:
        hit = _GAUSSIAN_CACHE.get(key)
        if hit is not None:
            _GAUSSIAN_CACHE.move_to_end(key)
            return hit
    built = build()
    if built.num_points <= GAUSSIAN_CACHE_PIXELS:
        with _GAUSSIAN_CACHE_LOCK:
            _GAUSSIAN_CACHE[key] = built
            while len(_GAUSSIAN_CACHE) > GAUSSIAN_CACHE_ENTRIES:
                _GAUSSIAN_CACHE.popitem(last=False)
    return built


def clear_lattice_cache() -> None:
    """Forget the kept position-kernel lattices (they hold about 85 bytes per pixel)."""
    with _GAUSSIAN_CACHE_LOCK:
        _GAUSSIAN_CACHE.clear()


def _neg_energy(dst: torch.Tensor, src: torch.Tensor, kind: str, mask: Optional[torch.Tensor]) -> None:
    """Write -U of one image into its (n, L) rows of the mean field's array: log(clip(p, 1e-5,
    1)) of probabilities (``unary_from_softmax``, in the probabilities' precision, the half
    types widened to float32 first, as :func:`unary_from_probs`) or -U of a unary; -inf for
    the labels ``mask`` forbids."""
    rows = src.reshape(src.shape[0], -1).t()
    if kind == "unary":
        dst.copy_(rows).neg_()
    elif src.dtype == torch.float32:
        torch.clamp(rows, PROB_CLIP, 1.0, out=dst).log_()
    else:
        wide = rows.float() if src.dtype in (torch.float16, torch.bfloat16) else rows
        dst.copy_(wide.clamp(PROB_CLIP, 1.0).log_())
    if mask is not None:
        dst[:, ~mask] = float("-inf")


def _mean_field_chunk(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                      rgbs: List[torch.Tensor], p: Mapping[str, float], max_bytes: Optional[int],
                      chunk_pixels: int = CPU_CHUNK_PIXELS) -> List[torch.Tensor]:
    """Mean field for one lattice: sources[i] (L, H_i, W_i) probabilities (``kind="probs"``) or
    unary energies (``"unary"``, +inf = label not allowed), masks[i] None or (L,) bool, rgbs[i]
    (H_i, W_i, 3) uint8, all on one device. Returns the (L, H_i, W_i) float32 marginals.

    On the CPU with numba: one lattice per run of at most ``chunk_pixels`` pixels, the runs
    solved in parallel (:func:`_mean_field_compiled`).

    Memory (see :func:`crf_memory_bytes`): the lattices are built first; then three (N, L)
    arrays (-U, Q and the energy, reused by every iteration; -U is written straight from the
    inputs, no unary array is made) and the filter's (M, L) arrays, a few labels at a time.
    """
    device = sources[0].device
    L = sources[0].shape[0]
    shapes = tuple((s.shape[1], s.shape[2]) for s in sources)
    sizes = [H * W for H, W in shapes]
    N = sum(sizes)
    if device.type == "cpu" and crf_compiled.available():
        return _mean_field_compiled(sources, kind, masks, rgbs, p, max_bytes, chunk_pixels)
    gaussian = _gaussian_lattice(shapes, p["gaussian_sxy"], device)
    max_points = None
    if max_bytes is not None:
        max_points = _bilateral_points_within(max_bytes, N, L, gaussian.num_lattice_points)
    try:
        bilateral = _lattice(_features(shapes, p["bilateral_sxy"], rgbs, p["bilateral_srgb"], device),
                             _segments(sizes, device), max_points)
    except LatticeTooLarge as e:
        if len(shapes) > 1:
            raise  # the caller runs these images one at a time
        raise _too_large(e, shapes, L, p, max_bytes) from None
    # The Potts message of one kernel is compat * n * K(n * Q), compat applied by the product.
    terms = [(gaussian, float(np.float32(p["gaussian_compat"]))), (bilateral, float(np.float32(p["bilateral_compat"])))]
    # (N, L): one row per pixel, the layout the sparse products want.
    neg_u = torch.empty(N, L, dtype=torch.float32, device=device)
    start = 0
    for s, m, n in zip(sources, masks, sizes):
        _neg_energy(neg_u[start:start + n], s, kind, m)
        start += n
    # Q = softmax(-U), then each iteration the energy -U + messages and Q = softmax in place.
    # All labels at once into a second (N, L) array, the roles of the two swapped every
    # iteration; or, where the filter's (M, L) arrays would be large, a block of labels at a
    # time (the Potts message of a label depends on that label's Q alone): the block's energy
    # is made aside and written over that block of Q once both kernels have read it.
    q = _softmax_rows_(neg_u.clone())
    blocks = _label_blocks(L, N, max(gaussian.num_lattice_points, bilateral.num_lattice_points))
    spare = torch.empty_like(neg_u) if len(blocks) == 1 else None
    for _ in range(int(p["iterations"])):
        if spare is not None:
            spare.copy_(neg_u)
            for lattice, compat in terms:
                lattice.filter(q, add_to=spare, scale=compat)
            q, spare = spare, q
        else:
            for a, b in blocks:
                energy = neg_u[:, a:b].clone(memory_format=torch.contiguous_format)
                block = q[:, a:b]
                for lattice, compat in terms:
                    lattice.filter(block, add_to=energy, scale=compat)
                block.copy_(energy)
                del energy, block
        _softmax_rows_(q)
    del neg_u, spare, terms, gaussian, bilateral
    out, start = [], 0
    for (H, W), n in zip(shapes, sizes):
        out.append(q[start:start + n].t().reshape(L, H, W).contiguous())
        start += n
    return out


def _too_large(e: LatticeTooLarge, shapes: Sequence[Tuple[int, int]], L: int, p: Mapping[str, float],
               max_bytes: float) -> ValueError:
    """The error for one image whose bilateral lattice outgrew ``max_bytes``."""
    per_pixel = e.points / e.num_points
    fit = _pixels_within(max_bytes, L, p, bilateral_per_pixel=per_pixel)
    return ValueError(
        f"the dense CRF of {_describe_sizes(shapes)} with {L} labels needs more than max_bytes = "
        f"{_gb(max_bytes)}: its colours make a bilateral lattice of {e.points:,} points ({per_pixel:.2f} per "
        f"pixel; {e.limit:,} fit); at that density at most {fit:,} pixels fit (e.g. "
        f"{_example_size(shapes[0], fit)}); pass a larger max_bytes, downscale the image, or use a larger "
        "bilateral_srgb or bilateral_sxy")


def _checked_features(features: torch.Tensor) -> np.ndarray:
    """The positions of a kernel for the compiled lattice, with the torch lattice's checks."""
    if not bool(torch.isfinite(features).all()):
        raise ValueError("crf_params: gaussian_sxy, bilateral_sxy or bilateral_srgb is so small that x / sxy or "
                         "rgb / srgb overflows float32; expected standard deviations of about 1 or more")
    top = max_lifted_coordinate(features.abs().amax(0).tolist())
    if top > MAX_COORDINATE:
        raise ValueError(f"features are too large for the float32 lattice: lifted coordinates reach up to "
                         f"{top:.4g}, at most {MAX_COORDINATE:.4g} work (MAX_COORDINATE); divide the positions "
                         "by larger standard deviations")
    return features.numpy()


def _compiled_gaussian(shapes: Tuple[Tuple[int, int], ...], sxy: float) -> "crf_compiled.CompiledLattice":
    """The compiled position-kernel lattice of these image sizes, kept as :func:`_gaussian_lattice`
    keeps the torch one."""
    cpu = torch.device("cpu")
    return _kept((shapes, float(np.float32(sxy)), "compiled"), lambda: crf_compiled.CompiledLattice(
        _checked_features(_features(shapes, sxy, None, 1.0, cpu)), [H * W for H, W in shapes]))


def _mean_field_compiled(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                         rgbs: List[torch.Tensor], p: Mapping[str, float], max_bytes: Optional[int],
                         chunk_pixels: int) -> List[torch.Tensor]:
    """:func:`_mean_field_chunk` on the CPU with numba: the images cut into runs of at most
    ``chunk_pixels`` pixels, one lattice pair per run, the runs solved in
    ``torch.get_num_threads()`` threads (:func:`mars_plugin.engines.crf_compiled.mean_field`), each
    run's bilateral lattice within its share of ``max_bytes``."""
    L = sources[0].shape[0]
    shapes = tuple((s.shape[1], s.shape[2]) for s in sources)
    sizes = [H * W for H, W in shapes]
    N = sum(sizes)
    neg_u = torch.empty(N, L, dtype=torch.float32)
    start = 0
    for s, m, n in zip(sources, masks, sizes):
        _neg_energy(neg_u[start:start + n], s, kind, m)
        start += n
    cpu = torch.device("cpu")
    units, start = [], 0
    for a, b in _chunks(sizes, chunk_pixels):
        run_shapes = shapes[a:b]
        n = sum(sizes[a:b])
        gaussian = _compiled_gaussian(run_shapes, p["gaussian_sxy"])
        features = _checked_features(_features(run_shapes, p["bilateral_sxy"], rgbs[a:b], p["bilateral_srgb"], cpu))
        limit = None
        if max_bytes is not None:
            limit = _bilateral_points_within(max_bytes * n / N, n, L, gaussian.num_lattice_points)

        def build(features=features, run=sizes[a:b], limit=limit):
            return crf_compiled.CompiledLattice(features, run, limit)

        units.append((start, start + n, gaussian, build))
        start += n
    compats = (float(np.float32(p["gaussian_compat"])), float(np.float32(p["bilateral_compat"])))
    try:
        q = crf_compiled.mean_field(neg_u.numpy(), units, compats, int(p["iterations"]), torch.get_num_threads())
    except LatticeTooLarge as e:
        if len(shapes) > 1:
            raise  # the caller runs these images one at a time
        raise _too_large(e, shapes, L, p, max_bytes) from None
    del neg_u
    out, start = [], 0
    for (H, W), n in zip(shapes, sizes):
        out.append(torch.from_numpy(q[start:start + n].T.reshape(L, H, W).copy()))
        start += n
    return out


def _mean_field_pydensecrf(unaries: List[torch.Tensor], rgbs: List[torch.Tensor], p: Mapping[str, float]) -> List[torch.Tensor]:
    """The reference: pydensecrf's DenseCRF2D, one image at a time on the CPU."""
    try:
        import pydensecrf.densecrf as dcrf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("crf_backend='pydensecrf' needs pydensecrf: pip install 'mars-plugin[crf]' "
                          "(installs pydensecrf2), or use the default crf_backend='torch'") from e
    out = []
    for u, c in zip(unaries, rgbs):
        L, H, W = u.shape
        d = dcrf.DenseCRF2D(W, H, L)
        d.setUnaryEnergy(np.ascontiguousarray(u.detach().cpu().numpy().reshape(L, -1), dtype=np.float32))
        d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
        d.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"],
                               rgbim=np.ascontiguousarray(c.cpu().numpy()), compat=p["bilateral_compat"])
        q = np.asarray(d.inference(int(p["iterations"])), dtype=np.float32).reshape(L, H, W)
        out.append(torch.from_numpy(q).to(u.device))
    return out


def _dense_crf(items: List[Any], form: str, kind: str, image: Any, params: Union[None, str, Mapping[str, Any]],
               valid: Any, backend: str, chunk_pixels: Optional[int], max_bytes: Optional[int]
               ) -> Union[torch.Tensor, List[torch.Tensor]]:
    """The checks and the run shared by :func:`dense_crf` (``kind="probs"``) and
    :func:`dense_crf_from_unary` (``"unary"``). Everything is checked before any work."""
    backend = check_crf_backend(backend)
    if chunk_pixels is not None and (isinstance(chunk_pixels, bool) or not isinstance(chunk_pixels, numbers.Integral)
                                     or chunk_pixels < 1):
        raise ValueError(f"chunk_pixels must be a positive integer or None, got {chunk_pixels!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Real)
                                  or not math.isfinite(max_bytes) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive number of bytes or None (no limit), got {max_bytes!r}")
    prm = check_crf_params(params)
    imgs, img_form = _as_list(image, "image", 3)
    if len(imgs) != len(items) or (form == "list") != (img_form == "list"):
        raise ValueError(f"image must come in the form of unary (one image, a batch or a list) with "
                         f"{len(items)} image(s), got {img_form} with {len(imgs)}")
    sources, rgbs = [], []
    for i, x in enumerate(items):
        name = kind if form == "single" else f"{kind}[{i}]"
        sources.append(_check_energy(as_tensor(x, name), name).detach())
    L = sources[0].shape[0]
    for i, t in enumerate(sources):
        if t.shape[0] != L:
            raise ValueError(f"every image needs the same number of labels L = {L}, got {t.shape[0]} for {kind}[{i}]")
    shapes = [(t.shape[1], t.shape[2]) for t in sources]
    for H, W in shapes:  # the sizes' checks first: they read no values
        check_crf_std_bounds(prm, H, W)
    if backend == "torch" and max_bytes is not None:
        _check_budget(shapes, L, prm, max_bytes)
    for i, t in enumerate(sources):
        name = kind if form == "single" else f"{kind}[{i}]"
        if kind == "probs":
            check_finite(t, name)
        elif bool(torch.isnan(t).any()) or bool((t == float("-inf")).any()):
            raise ValueError(f"{name} contains NaN or -Inf; expected finite energies (+Inf marks a forbidden label)")
        sources[i] = t.to(sources[0].device)
        iname = "image" if form == "single" else f"image[{i}]"
        rgbs.append(_rgb_tensor(imgs[i], iname, shapes[i]).to(sources[0].device))
    masks = _check_valid(valid, len(sources), L, sources[0].device)
    if kind == "unary":
        for i, (t, m) in enumerate(zip(sources, masks)):
            allowed = torch.isfinite(t) if m is None else torch.isfinite(t) & m[:, None, None]
            if not bool(allowed.any(0).all()):
                raise ValueError(f"unary[{i}] forbids every label (+Inf) at some pixel; each pixel needs one allowed "
                                 "label")
    if backend == "torch":
        out = _mean_field_torch(sources, kind, masks, rgbs, prm, chunk_pixels, max_bytes)
    else:
        us = [unary_from_probs(t) if kind == "probs" else t.to(torch.float32) for t in sources]
        us = [u if m is None else u.masked_fill(~m[:, None, None], float("inf")) for u, m in zip(us, masks)]
        out = _mean_field_pydensecrf(us, rgbs, prm)
    if form == "single":
        return out[0]
    if form == "batch":
        return torch.stack(out)
    return out


def dense_crf_from_unary(
    unary: Any,
    image: Any,
    params: Union[None, str, Mapping[str, Any]] = None,
    *,
    valid: Any = None,
    backend: str = "torch",
    chunk_pixels: Optional[int] = None,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Dense-CRF marginals from a unary energy (see :func:`dense_crf`, which takes probabilities).

    Shapes:
        unary: (L, H, W) for one image, (B, L, H, W) for a batch, or a list of (L, H_i, W_i)
            (images of different sizes, one L), float energies (e.g. :func:`unary_from_labels`).
        image: RGB in the same form: (H, W, 3) or (3, H, W), a batch (B, ...) or a list; uint8,
            or float in [0, 1] (scaled by 255 and rounded).
        valid: optional bool (L,), (B, L) or a list of (L,): labels an image may take. The
            others get Q = 0 and send no message, exactly as if the image had only its valid
            labels.

    Args:
        chunk_pixels: the most pixels filtered as one lattice (whole images; default
            :data:`CPU_CHUNK_PIXELS` or :data:`CUDA_CHUNK_PIXELS`). Results do not depend on it.
        max_bytes: the most memory the torch backend may take for one lattice's work (default
            :data:`DEFAULT_MAX_BYTES`, 6 GiB; None: no limit). Images are grouped within it,
            and an image that needs more alone (:func:`crf_memory_bytes`) is refused before
            any work, with the size that fits.

    Returns:
        float32 marginals Q in the form of ``unary``: (L, H, W), (B, L, H, W) or a list, on
        ``unary``'s device (``backend="torch"`` computes there, CPU or CUDA).
    """
    items, form = _as_list(unary, "unary", 3)
    return _dense_crf(items, form, "unary", image, params, valid, backend, chunk_pixels, max_bytes)


def dense_crf(
    probs: Any,
    image: Any,
    params: Union[None, str, Mapping[str, Any]] = None,
    *,
    valid: Any = None,
    backend: str = "torch",
    chunk_pixels: Optional[int] = None,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Mean-field dense CRF over L labels, pydensecrf's ``DenseCRF2D`` with
    ``unary_from_softmax`` in torch.

    Shapes:
        probs: (L, H, W) for one image, (B, L, H, W) for a batch, or a list of (L, H_i, W_i)
            for images of different sizes: probabilities (or scores, clipped to [1e-5, 1]
            before -log, as ``unary_from_softmax``).
        image: RGB in the same form, (H, W, 3) or (3, H, W) per image, uint8 or float in [0, 1].
        valid: optional (L,), (B, L) or list of (L,) bool: labels an image may take (see
            :func:`dense_crf_from_unary`).

    Args:
        params: a preset name (``"mars"`` default, ``"psa"``; see :data:`CRF_PRESETS`) or a dict
            overriding the default's keys ``iterations``, ``gaussian_sxy``, ``gaussian_compat``,
            ``bilateral_sxy``, ``bilateral_srgb``, ``bilateral_compat`` (see
            :func:`check_crf_params` for their ranges).
        backend: ``"torch"`` (batched, on ``probs``' device) or ``"pydensecrf"`` (the reference,
            CPU, one image at a time; the ``crf`` extra).
        chunk_pixels, max_bytes: see :func:`dense_crf_from_unary`.

    Returns:
        float32 marginals Q in the form of ``probs``, on its device.
    """
    items, form = _as_list(probs, "probs", 3)
    return _dense_crf(items, form, "probs", image, params, valid, backend, chunk_pixels, max_bytes)


class DenseCRF(nn.Module):
    """:func:`dense_crf` as a module (no learnable parameters).

    Shapes:
        forward(probs, image, valid=None): as :func:`dense_crf`, e.g. (B, L, H, W) probabilities
        and (B, H, W, 3) uint8 images -> (B, L, H, W) marginals.
    """

    def __init__(self, params: Union[None, str, Mapping[str, Any]] = None, backend: str = "torch",
                 max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> None:
        super().__init__()
        self.params = check_crf_params(params)
        self.backend = check_crf_backend(backend)
        self.max_bytes = max_bytes

    def forward(self, probs: Any, image: Any, valid: Any = None) -> Union[torch.Tensor, List[torch.Tensor]]:
        return dense_crf(probs, image, self.params, valid=valid, backend=self.backend, max_bytes=self.max_bytes)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) + f", backend={self.backend!r}"
