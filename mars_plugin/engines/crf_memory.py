"""The dense CRF's memory: a model of what the torch backend allocates for one lattice
(:func:`crf_memory_bytes`), the budget ``max_bytes`` checked against it before any work
(:func:`check_crf_image` for one image, the images of a batch grouped within it), and the
errors that name the size that fits.

The label blocks of the mean field (:func:`_label_blocks`) live here because the model counts
them.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES, check_crf_params, check_crf_std_bounds
from mars_plugin.engines.permutohedral import LatticeTooLarge

__all__ = ["crf_memory_bytes", "check_crf_image", "FILTER_LABELS"]


#: Labels filtered at a time when a lattice has more than a third as many points as there are
#: pixels (the filter's three (M, labels) arrays would outgrow one (N, L) array): VOC's 21 in
#: two passes of 11, within a few per cent of one pass. Sparser lattices ("psa") filter all
#: labels in one pass, which is faster for them.
FILTER_LABELS = 12


def _label_blocks(L: int, N: int, M: int) -> List[Tuple[int, int]]:
    """Label ranges filtered at a time for N pixels and a largest lattice of M points: all L
    when 3 (M + 1) <= N, else at most FILTER_LABELS, of equal widths (21 -> 11, 10)."""
    if 3 * (M + 1) <= N:
        return [(0, L)]
    n = -(-L // FILTER_LABELS)
    width = -(-L // n)
    return [(a, min(a + width, L)) for a in range(0, L, width)]


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
                    max_bytes: Optional[int] = DEFAULT_MAX_BYTES, name: str = "crf_params",
                    budget_name: str = "max_bytes") -> Dict[str, float]:
    """What :func:`~mars_plugin.engines.crf.dense_crf` checks of one ``height`` x ``width`` image
    with ``labels`` labels before any work, for callers that want it per file first: the
    parameters (:func:`~mars_plugin.engines.crf_params.check_crf_params`), standard deviations
    that fit the image's size (:func:`~mars_plugin.engines.crf_params.check_crf_std_bounds`)
    and, unless ``max_bytes`` is None, its memory (:func:`crf_memory_bytes`). Messages call the
    parameters ``name`` (``--crf-params`` on the command line) and the budget ``budget_name``
    (``--max-memory``, in GiB, on the command line). Returns the checked parameters."""
    prm = check_crf_params(params)
    check_crf_std_bounds(prm, height, width, name)
    if max_bytes is not None:
        _check_budget([(int(height), int(width))], int(labels), prm, max_bytes, budget_name)
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


def _check_budget(shapes: Sequence[Tuple[int, int]], L: int, p: Mapping[str, float], max_bytes: float,
                  budget_name: str = "max_bytes") -> None:
    """Refuse, before any work, an image whose dense CRF alone needs more than ``max_bytes``."""
    for H, W in shapes:
        N = H * W
        need = _memory_model(N, L, _gaussian_points(N, p["gaussian_sxy"]), int(N * _BILATERAL_POINTS_PER_PIXEL) + 64)
        if need > max_bytes:
            fit = _pixels_within(max_bytes, L, p)
            larger = "max_bytes (None: no limit)" if budget_name == "max_bytes" else f"{budget_name} GIB"
            raise ValueError(
                f"the dense CRF of a {H}x{W} image with {L} labels needs about {_gb(need)} (crf_memory_bytes), more "
                f"than {budget_name} = {_gb(max_bytes)}; at {L} labels at most {fit:,} pixels fit (e.g. "
                f"{_example_size((H, W), fit)}); pass a larger {larger} or downscale the image")


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
