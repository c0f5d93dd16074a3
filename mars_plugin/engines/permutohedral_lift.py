"""The lifting of the permutohedral lattice (:mod:`mars_plugin.engines.permutohedral`): feature
vectors onto the lattice's hyperplane, the enclosing simplex of each lifted point and its
barycentric weights, in pydensecrf's float32 operations and order (``densecrf/src/permutohedral.cpp``),
and bounds of the lifted coordinates (what the dense CRF's parameter checks use).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

__all__ = ["lifted_bounds", "max_lifted_coordinate"]

# Points lifted at a time (the float temporaries of the lifting: about 250 bytes a point).
_LIFT_BLOCK = 1 << 16
_LIFT_BLOCK_CUDA = 1 << 22


def _f32(x: float) -> float:
    """A Python float rounded to float32, as the C++ stores its constants."""
    return float(np.float32(x))


def _elevate(f: torch.Tensor) -> torch.Tensor:
    """(N, d) features -> (d+1, N) coordinates on the lattice's hyperplane (Adams et al., p. 5).

    The same float32 operations in the same order as the C++, so that points on a simplex
    boundary fall on the same side. Coordinates are rows: every later step works on whole
    contiguous rows.
    """
    N, d = f.shape
    inv_std_dev = _f32(math.sqrt(2.0 / 3.0) * (d + 1))
    scale = torch.tensor([_f32(1.0 / math.sqrt((i + 2) * (i + 1)) * inv_std_dev) for i in range(d)],
                         dtype=torch.float32, device=f.device)
    cf = (f * scale).t().contiguous()
    elevated = torch.empty(d + 1, N, dtype=torch.float32, device=f.device)
    running = torch.zeros(N, dtype=torch.float32, device=f.device)
    for j in range(d, 0, -1):
        elevated[j] = running - float(j) * cf[j - 1]
        running = running + cf[j - 1]
    elevated[0] = running
    return elevated


def _simplex(elevated: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The enclosing simplex of each lifted point, all (d+1, N).

    Returns ``rem0`` int64, the nearest 0-coloured lattice point; ``rank`` int64, the position
    of each remainder in decreasing order (ties: the earlier coordinate first), per point a
    permutation of 0..d; and ``bary`` float32 barycentric weights, row r for vertex r.
    """
    d1, N = elevated.shape
    d = d1 - 1
    down = _f32(1.0 / d1)
    v = torch.round(elevated * down)  # half to even, as _mm_round_ps / _mm_cvtps_epi32
    rem0 = v * float(d1)
    shift = v.sum(0).long()  # small integers: exact in any order
    diff = elevated - rem0
    # The C++ ranking loop, "if (di < dj) rank[i]++ else rank[j]++" for every i < j.
    rank = torch.zeros(d1, N, dtype=torch.int32, device=elevated.device)
    for i in range(d1):
        for j in range(i + 1, d1):
            less = diff[i] < diff[j]
            rank[i].add_(less)
            rank[j].add_(~less)
    rank = rank.long() + shift
    # Bring the point back onto the plane: ranks wrap around modulo d+1.
    wrap = (rank < 0).long() - (rank > d).long()
    rank += wrap * d1
    rem0 = rem0.long() + wrap * d1
    # Barycentric weights (Adams et al., p. 10): with vr[k] the scaled remainder of rank k,
    # b[p] = vr[d-p] - vr[d-p+1] and b[0] wraps around, as the C++ accumulates them.
    rest = (elevated - rem0.to(torch.float32)) * down
    by_rank = torch.zeros_like(rest).scatter_(0, rank, rest).flip(0)
    bary = torch.empty_like(rest)
    bary[1:] = by_rank[1:] - by_rank[:-1]
    bary[0] = by_rank[0] + (1.0 - by_rank[d])
    return rem0, rank, bary


def lifted_bounds(abs_max: Sequence[float]) -> List[float]:
    """Upper bounds of |lifted coordinate j|, j = 0..d, for features whose column i is at most
    ``abs_max[i]`` in magnitude: the lifting is linear, coordinate j is
    sum_{i >= j} s_i f_i - j s_{j-1} f_{j-1} with the scale factors s_i."""
    d = len(abs_max)
    terms = [math.sqrt(2.0 / 3.0) * (d + 1) / math.sqrt((i + 1) * (i + 2)) * float(abs_max[i]) for i in range(d)]
    return [sum(terms[j:]) + (j * terms[j - 1] if j else 0.0) for j in range(d + 1)]


def max_lifted_coordinate(abs_max: Sequence[float]) -> float:
    """An upper bound of |lifted coordinate| (see :func:`lifted_bounds`)."""
    return max(lifted_bounds(abs_max))


def _lift(features: torch.Tensor, P: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lift the N points and P zero padding points and find their simplices, a block of points
    at a time (the float temporaries of a block stay small).

    Returns ``q0`` (d, N+P) int32, the nearest 0-coloured lattice point divided by d+1;
    ``rank`` (d+1, N+P) uint8; ``bary`` (d+1, N+P) float32 (0 for the padding points).
    """
    N, d = features.shape
    dev = features.device
    Np = N + P
    q0 = torch.empty(d, Np, dtype=torch.int32, device=dev)
    rank = torch.empty(d + 1, Np, dtype=torch.uint8, device=dev)
    bary = torch.zeros(d + 1, Np, dtype=torch.float32, device=dev)
    block = _LIFT_BLOCK_CUDA if dev.type == "cuda" else _LIFT_BLOCK
    spans = [(a, min(a + block, N)) for a in range(0, N, block)] + ([(N, Np)] if P else [])
    for a, b in spans:
        rem0, rk, by = _simplex(_elevate(features[a:b] if a < N else features.new_zeros(P, d)))
        q0[:, a:b] = torch.div(rem0[:d], d + 1, rounding_mode="floor")
        rank[:, a:b] = rk
        if a < N:
            bary[:, a:b] = by
    return q0, rank, bary
