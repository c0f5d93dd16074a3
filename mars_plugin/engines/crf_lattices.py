"""The dense CRF's two kernels as lattices: the positions (x / sxy, y / sxy) and, for the
bilateral kernel, the colours (r / srgb, g / srgb, b / srgb) of every pixel; the torch lattice
(:class:`mars_plugin.engines.permutohedral.PermutohedralLattice`) with pydensecrf's symmetric
normaliser folded in; and the kept position-kernel lattices, torch and compiled, which depend
on the image sizes alone (:func:`clear_lattice_cache` frees them).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.engines import crf_compiled
from mars_plugin.engines.lattice_concat import concatenate_lattices
from mars_plugin.engines.permutohedral import MAX_COORDINATE, PermutohedralLattice, max_lifted_coordinate

__all__ = ["GAUSSIAN_CACHE_ENTRIES", "GAUSSIAN_CACHE_PIXELS", "clear_lattice_cache"]


#: The position-only (Gaussian) kernel's lattice depends on the image sizes alone; the last
#: GAUSSIAN_CACHE_ENTRIES of at most GAUSSIAN_CACHE_PIXELS pixels are kept (about 80 bytes a
#: pixel, 15 MB for a 500x375 image; :func:`clear_lattice_cache` frees them).
GAUSSIAN_CACHE_ENTRIES = 8
GAUSSIAN_CACHE_PIXELS = 1 << 19


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


def _segments(sizes: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    if len(sizes) == 1:
        return None
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


_GAUSSIAN_CACHE: "OrderedDict[tuple, PermutohedralLattice]" = OrderedDict()
_GAUSSIAN_CACHE_LOCK = threading.Lock()


def _gaussian_lattice(shapes: Tuple[Tuple[int, int], ...], sxy: float, device: torch.device) -> PermutohedralLattice:
    """The position-only kernel's (normalised) lattice depends on the image sizes alone: each
    size's (VOC's handful, a training loop's fixed crop) is kept, when small, and a batch's is
    the kept ones joined (:func:`~mars_plugin.engines.lattice_concat.concatenate_lattices`, equal
    to building it: a teacher's batch that changes from step to step builds nothing)."""
    if len(shapes) > 1:
        return concatenate_lattices([_gaussian_lattice((shape,), sxy, device) for shape in shapes])
    return _kept((shapes, float(np.float32(sxy)), str(device)),
                 lambda: _lattice(_features(shapes, sxy, None, 1.0, device), None))


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
