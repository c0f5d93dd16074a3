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

This module holds the entry points (:func:`dense_crf`, :func:`dense_crf_from_unary`,
:class:`DenseCRF`), their inputs and the unaries. Parameters come as a preset name or a dict
(:data:`mars_plugin.engines.crf_params.CRF_PRESETS`,
:func:`mars_plugin.engines.crf_params.check_crf_params`); the memory budget is
:mod:`mars_plugin.engines.crf_memory`, the kernels' lattices :mod:`mars_plugin.engines.crf_lattices`,
the mean field per backend :mod:`mars_plugin.engines.crf_mean_field`.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from mars_plugin._checks import as_tensor, check_finite, describe, rgb_layout
from mars_plugin.engines.crf_mean_field import _mean_field_pydensecrf, _mean_field_torch
from mars_plugin.engines.crf_memory import _check_budget
from mars_plugin.engines.crf_params import (
    DEFAULT_MAX_BYTES,
    PROB_CLIP,
    check_crf_backend,
    check_crf_params,
    check_crf_std_bounds,
)

__all__ = [
    "DenseCRF",
    "dense_crf",
    "dense_crf_from_unary",
    "unary_from_probs",
    "unary_from_labels",
    "image_to_hwc_uint8",
]


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
            :data:`~mars_plugin.engines.crf_mean_field.CPU_CHUNK_PIXELS` or
            :data:`~mars_plugin.engines.crf_mean_field.CUDA_CHUNK_PIXELS`). Results do not depend on it.
        max_bytes: the most memory the torch backend may take for one lattice's work (default
            :data:`~mars_plugin.engines.crf_params.DEFAULT_MAX_BYTES`, 6 GiB; None: no limit). Images
            are grouped within it, and an image that needs more alone
            (:func:`~mars_plugin.engines.crf_memory.crf_memory_bytes`) is refused before any work,
            with the size that fits.

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
        params: a preset name (``"mars"`` default, ``"psa"``; see
            :data:`~mars_plugin.engines.crf_params.CRF_PRESETS`) or a dict overriding the default's
            keys ``iterations``, ``gaussian_sxy``, ``gaussian_compat``, ``bilateral_sxy``,
            ``bilateral_srgb``, ``bilateral_compat`` (see
            :func:`~mars_plugin.engines.crf_params.check_crf_params` for their ranges).
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
