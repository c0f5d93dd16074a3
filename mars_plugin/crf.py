"""The dense CRF (Krahenbuhl & Koltun, NIPS 2011) in torch: batched, on the inputs' device.

This is the refinement R of MARS Eq. 5 (the debiased mask) and Eq. 6 (the teacher), and of the
WSSS repositories' own pseudo-label steps. It computes what pydensecrf's ``DenseCRF2D``
computes (``densecrf/src/densecrf.cpp``, ``pairwise.cpp``; the lattice in
:mod:`mars_plugin.permutohedral`), to float32 rounding:

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
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from ._checks import as_tensor, check_finite, describe, rgb_layout
from .permutohedral import PermutohedralLattice

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
#: The position-only (Gaussian) kernel's lattice depends on the image sizes alone; the last
#: GAUSSIAN_CACHE_ENTRIES of at most GAUSSIAN_CACHE_PIXELS pixels are kept (about 80 bytes a
#: pixel, 15 MB for a 500x375 image; :func:`clear_lattice_cache` frees them).
GAUSSIAN_CACHE_ENTRIES = 8
GAUSSIAN_CACHE_PIXELS = 1 << 19


def check_crf_params(params: Union[None, str, Mapping[str, Any]], defaults: Mapping[str, float] = DEFAULT_CRF_PARAMS,
                     integers: Tuple[str, ...] = ("iterations",)) -> Dict[str, float]:
    """CRF parameters from a preset name (``"mars"``/``"deeplab"``, ``"psa"``/``"seam"``), a
    dict of overrides of ``defaults``, or None (``defaults``). Unknown names and keys,
    non-positive values and non-integers for the ``integers`` keys are errors."""
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
        if key in integers and int(value) != value:
            raise ValueError(f"crf_params[{key!r}] must be an integer, got {value!r}")
        out[key] = value
    return out


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
    return (-p.detach().clamp(clip, 1.0).log()).to(torch.float32)


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

def _positions(H: int, W: int, device: torch.device) -> torch.Tensor:
    """(H*W, 2) float32 (x, y) of every pixel in row-major order, as DenseCRF2D numbers them."""
    ys, xs = torch.meshgrid(torch.arange(H, device=device, dtype=torch.float32),
                            torch.arange(W, device=device, dtype=torch.float32), indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], 1)


def _f32(x: float, device: torch.device) -> torch.Tensor:
    # pydensecrf takes its standard deviations as C floats: divide by the float32 value.
    return torch.tensor(float(x), dtype=torch.float32, device=device)


def _normaliser(lattice: PermutohedralLattice, N: int, device: torch.device) -> torch.Tensor:
    """pydensecrf's NORMALIZE_SYMMETRIC: 1 / sqrt(K 1 + 1e-20), computed in double as there."""
    k1 = lattice.filter(torch.ones(N, 1, dtype=torch.float32, device=device))
    return (1.0 / torch.sqrt(k1.double() + 1e-20)).to(torch.float32)


def _softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the L labels of (N, L) energies: exp(x - max) / sum, pydensecrf's
    ``expAndNormalize``.

    On the CPU torch's softmax over a short last axis is slow (5.3 ms at L = 2 for 187,500
    pixels, 15.7 ms at L = 8, against 1.4 and 2.6 ms written out); from about 16 labels on it
    is the faster one (4.9 against 7.9 ms at L = 21).
    """
    if x.is_cuda or x.shape[1] >= 16:
        return torch.softmax(x, 1)
    e = torch.exp(x - x.amax(1, keepdim=True))
    return e.div_(e.sum(1, keepdim=True))


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


def _mean_field_torch(unaries: List[torch.Tensor], rgbs: List[torch.Tensor], p: Mapping[str, float],
                      chunk_pixels: Optional[int] = None) -> List[torch.Tensor]:
    """Mean field for a batch, in runs of at most ``chunk_pixels`` pixels (one lattice each)."""
    device = unaries[0].device
    if chunk_pixels is None:
        chunk_pixels = CUDA_CHUNK_PIXELS if device.type == "cuda" else CPU_CHUNK_PIXELS
    out: List[torch.Tensor] = []
    for a, b in _chunks([u.shape[1] * u.shape[2] for u in unaries], chunk_pixels):
        out.extend(_mean_field_chunk(unaries[a:b], rgbs[a:b], p))
    return out


def _lattice(features: torch.Tensor, segment: Optional[torch.Tensor]) -> Tuple[PermutohedralLattice, torch.Tensor]:
    """A kernel's lattice and its normaliser n."""
    if not bool(torch.isfinite(features).all()):
        raise ValueError("crf_params: gaussian_sxy, bilateral_sxy or bilateral_srgb is so small that x / sxy or "
                         "rgb / srgb overflows float32; expected standard deviations of about 1 or more")
    lattice = PermutohedralLattice(features, segment)
    return lattice, _normaliser(lattice, features.shape[0], features.device)


def _segments(sizes: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    if len(sizes) == 1:
        return None
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


_GAUSSIAN_CACHE: "OrderedDict[tuple, Tuple[PermutohedralLattice, torch.Tensor]]" = OrderedDict()
_GAUSSIAN_CACHE_LOCK = threading.Lock()


def _gaussian_lattice(shapes: Tuple[Tuple[int, int], ...], sxy: float, device: torch.device
                      ) -> Tuple[PermutohedralLattice, torch.Tensor]:
    """The position-only kernel's lattice and normaliser depend on the image sizes alone: the
    last few (VOC's handful of sizes, a training loop's fixed crop) are kept, when small."""
    key = (shapes, float(np.float32(sxy)), str(device))
    with _GAUSSIAN_CACHE_LOCK:
        hit = _GAUSSIAN_CACHE.get(key)
        if hit is not None:
            _GAUSSIAN_CACHE.move_to_end(key)
            return hit
    pos = torch.cat([_positions(H, W, device) for H, W in shapes])
    built = _lattice(pos / _f32(sxy, device), _segments([H * W for H, W in shapes], device))
    if pos.shape[0] <= GAUSSIAN_CACHE_PIXELS:
        with _GAUSSIAN_CACHE_LOCK:
            _GAUSSIAN_CACHE[key] = built
            while len(_GAUSSIAN_CACHE) > GAUSSIAN_CACHE_ENTRIES:
                _GAUSSIAN_CACHE.popitem(last=False)
    return built


def clear_lattice_cache() -> None:
    """Forget the kept position-kernel lattices (they hold about 80 bytes per pixel)."""
    with _GAUSSIAN_CACHE_LOCK:
        _GAUSSIAN_CACHE.clear()


def _mean_field_chunk(unaries: List[torch.Tensor], rgbs: List[torch.Tensor], p: Mapping[str, float]) -> List[torch.Tensor]:
    """Mean field for one lattice: unaries[i] (L, H_i, W_i) float32 (+inf = label not allowed),
    rgbs[i] (H_i, W_i, 3) uint8, all on one device. Returns the (L, H_i, W_i) marginals."""
    device = unaries[0].device
    L = unaries[0].shape[0]
    shapes = tuple((u.shape[1], u.shape[2]) for u in unaries)
    sizes = [H * W for H, W in shapes]
    pos = torch.cat([_positions(H, W, device) for H, W in shapes])
    rgb = torch.cat([c.reshape(-1, 3) for c in rgbs]).to(torch.float32)
    bilateral = torch.cat([pos / _f32(p["bilateral_sxy"], device), rgb / _f32(p["bilateral_srgb"], device)], 1)
    lattices = []
    for (lattice, norm), compat in (
        (_gaussian_lattice(shapes, p["gaussian_sxy"], device), p["gaussian_compat"]),
        (_lattice(bilateral, _segments(sizes, device)), p["bilateral_compat"]),
    ):
        # The Potts message of one kernel is compat * n * K(n * Q): both diagonals folded
        # into the lattice's sparse weights once.
        lattices.append(lattice.scaled(norm, norm * float(np.float32(compat))))
    # (N, L): one row per pixel, the layout the sparse products want.
    neg_u = -torch.cat([u.reshape(L, -1) for u in unaries], 1).t().contiguous()
    q = _softmax_rows(neg_u)
    for _ in range(int(p["iterations"])):
        energy = neg_u.clone()
        for lattice in lattices:
            lattice.filter(q, add_to=energy)
        q = _softmax_rows(energy)
    out, start = [], 0
    for u, n in zip(unaries, sizes):
        out.append(q[start:start + n].t().reshape(u.shape).contiguous())
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


def dense_crf_from_unary(
    unary: Any,
    image: Any,
    params: Union[None, str, Mapping[str, Any]] = None,
    *,
    valid: Any = None,
    backend: str = "torch",
    chunk_pixels: Optional[int] = None,
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

    Returns:
        float32 marginals Q in the form of ``unary``: (L, H, W), (B, L, H, W) or a list, on
        ``unary``'s device (``backend="torch"`` computes there, CPU or CUDA).
    """
    backend = check_crf_backend(backend)
    if chunk_pixels is not None and (isinstance(chunk_pixels, bool) or not isinstance(chunk_pixels, numbers.Integral)
                                     or chunk_pixels < 1):
        raise ValueError(f"chunk_pixels must be a positive integer or None, got {chunk_pixels!r}")
    prm = check_crf_params(params)
    items, form = _as_list(unary, "unary", 3)
    imgs, img_form = _as_list(image, "image", 3)
    if len(imgs) != len(items) or (form == "list") != (img_form == "list"):
        raise ValueError(f"image must come in the form of unary (one image, a batch or a list) with "
                         f"{len(items)} image(s), got {img_form} with {len(imgs)}")
    us, rgbs = [], []
    for i, u in enumerate(items):
        name = "unary" if form == "single" else f"unary[{i}]"
        u = _check_energy(as_tensor(u, name), name)
        if bool(torch.isnan(u).any()) or bool((u == float("-inf")).any()):
            raise ValueError(f"{name} contains NaN or -Inf; expected finite energies (+Inf marks a forbidden label)")
        us.append(u.detach().to(device=us[0].device if us else u.device, dtype=torch.float32))
        iname = "image" if form == "single" else f"image[{i}]"
        rgbs.append(_rgb_tensor(imgs[i], iname, tuple(u.shape[1:])).to(us[0].device))
    L = us[0].shape[0]
    for i, u in enumerate(us):
        if u.shape[0] != L:
            raise ValueError(f"every image needs the same number of labels L = {L}, got {u.shape[0]} for unary[{i}]")
    masks = _check_valid(valid, len(us), L, us[0].device)
    for i, m in enumerate(masks):
        if m is not None:
            us[i] = us[i].masked_fill(~m[:, None, None], float("inf"))
        if not bool(torch.isfinite(us[i]).any(0).all()):
            raise ValueError(f"unary[{i}] forbids every label (+Inf) at some pixel; each pixel needs one allowed label")
    if backend == "torch":
        out = _mean_field_torch(us, rgbs, prm, chunk_pixels)
    else:
        out = _mean_field_pydensecrf(us, rgbs, prm)
    if form == "single":
        return out[0]
    if form == "batch":
        return torch.stack(out)
    return out


def dense_crf(
    probs: Any,
    image: Any,
    params: Union[None, str, Mapping[str, Any]] = None,
    *,
    valid: Any = None,
    backend: str = "torch",
    chunk_pixels: Optional[int] = None,
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
            ``bilateral_sxy``, ``bilateral_srgb``, ``bilateral_compat``.
        backend: ``"torch"`` (batched, on ``probs``' device) or ``"pydensecrf"`` (the reference,
            CPU, one image at a time; the ``crf`` extra).
        chunk_pixels: see :func:`dense_crf_from_unary`.

    Returns:
        float32 marginals Q in the form of ``probs``, on its device.
    """
    items, form = _as_list(probs, "probs", 3)
    unaries = []
    for i, p in enumerate(items):
        name = "probs" if form == "single" else f"probs[{i}]"
        t = as_tensor(p, name)
        if t.ndim != 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be an (L, H, W) floating tensor, got {describe(t)}")
        try:
            unaries.append(unary_from_probs(t))
        except ValueError as e:
            raise ValueError(str(e).replace("probs", name, 1)) from None
    unary = unaries[0] if form == "single" else (torch.stack(unaries) if form == "batch" else unaries)
    return dense_crf_from_unary(unary, image, params, valid=valid, backend=backend, chunk_pixels=chunk_pixels)


class DenseCRF(nn.Module):
    """:func:`dense_crf` as a module (no learnable parameters).

    Shapes:
        forward(probs, image, valid=None): as :func:`dense_crf`, e.g. (B, L, H, W) probabilities
        and (B, H, W, 3) uint8 images -> (B, L, H, W) marginals.
    """

    def __init__(self, params: Union[None, str, Mapping[str, Any]] = None, backend: str = "torch") -> None:
        super().__init__()
        self.params = check_crf_params(params)
        self.backend = check_crf_backend(backend)

    def forward(self, probs: Any, image: Any, valid: Any = None) -> Union[torch.Tensor, List[torch.Tensor]]:
        return dense_crf(probs, image, self.params, valid=valid, backend=self.backend)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) + f", backend={self.backend!r}"
