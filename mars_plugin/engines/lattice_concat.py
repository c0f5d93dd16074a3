"""Several images' lattices joined into the lattice of the batch, without building it again.

:class:`~mars_plugin.engines.permutohedral.PermutohedralLattice` filters a batch of images as one
lattice whose keys start with the image's index, so that points of different images never
meet. That lattice is made of the images' own lattices: its points are numbered by (vertex
class r, image, key), so class r of the batch is class r of image 0, then of image 1, ...; each
splat row holds one image's vertices in point order, each slice row one pixel's d+1 vertices,
and an axis neighbour is the image's own neighbour. :func:`concatenate_lattices` renumbers the
images' tables that way: gathers and a cumulative sum instead of d+1 sorts and neighbour
searches. The dense CRF keeps each image size's position-kernel lattice
(:mod:`mars_plugin.engines.crf_lattices`) and joins the kept ones for a batch: a training loop's
teacher, whose batch differs from step to step, no longer rebuilds it every step.

The filter of the joined lattice equals the batch's built lattice bit for bit on the CPU
(tests/test_lattice_concat.py): the same rows with the same entries in the same order. One
difference that changes no value: the splat columns of pydensecrf's SIMD padding points (weight
0) point at their own image's first pixel instead of the batch's.
"""
from __future__ import annotations

import copy
from typing import List, Sequence

import torch

from mars_plugin.engines.permutohedral import PermutohedralLattice, _csr

__all__ = ["concatenate_lattices"]


def concatenate_lattices(lattices: Sequence[PermutohedralLattice]) -> PermutohedralLattice:
    """The lattice of all the points of ``lattices``, lattice i's points as segment i, equal to
    ``PermutohedralLattice(torch.cat(features), segment)`` (see the module docstring).

    Shapes: lattice i over N_i points of dimension d (the same d and device for all) -> a lattice
    over sum N_i points. The inputs are not changed (their index tables are read, not shared).
    """
    if not lattices:
        raise ValueError("lattices must hold at least one lattice, got none")
    first = lattices[0]
    for i, lat in enumerate(lattices):
        if not isinstance(lat, PermutohedralLattice):
            raise TypeError(f"lattices[{i}] must be a PermutohedralLattice, got {type(lat).__name__}")
        if lat.dim != first.dim or lat.device != first.device:
            raise ValueError(f"lattices[{i}] has dimension {lat.dim} on {lat.device}, but lattices[0] has "
                             f"dimension {first.dim} on {first.device}; expected one dimension and device")
    if len(lattices) == 1:
        return first
    d, dev = first.dim, first.device
    sizes = [lat.class_starts for lat in lattices]  # per lattice: d+2 class starts, the last = M_i
    counts = torch.tensor([[s[r + 1] - s[r] for r in range(d + 1)] for s in sizes], dtype=torch.long)  # (K, d+1)
    M = int(counts.sum())
    # Global number of lattice i's class-r points: after every class < r, then lattices < i's class r.
    base = counts.t().reshape(-1).cumsum(0).sub(counts.t().reshape(-1)).view(d + 1, len(lattices)).t()  # (K, d+1)
    remaps = []
    for i, s in enumerate(sizes):
        # local point -> global point: one shift per vertex class (row M_i, the empty one, -> M),
        # made on the lattices' device (a teacher's batch is 16 lattices of ~10^5 points each)
        shift = torch.tensor([int(base[i, r]) - s[r] for r in range(d + 1)] + [M - s[-1]], device=dev)
        repeats = torch.tensor([s[r + 1] - s[r] for r in range(d + 1)] + [1], device=dev)
        remaps.append(torch.arange(s[-1] + 1, device=dev).add_(torch.repeat_interleave(shift, repeats)))
    itype = first._splat.col_indices().dtype
    out = copy.copy(first)
    out.num_points = sum(lat.num_points for lat in lattices)
    out.num_lattice_points = M
    out.class_starts = [int(v) for v in torch.cat([torch.zeros(1, dtype=torch.long),
                                                   counts.sum(0).cumsum(0)]).tolist()]
    out._splat = _splat(lattices, M, out.num_points, itype)
    out._slice = _slice(lattices, remaps, M, out.num_points, itype)
    out._blur = _blur(lattices, remaps, M)
    return out


def _rows_in_global_order(lattices):
    """(lattice i, vertex class r, its local rows) of every global lattice point, in global
    order: (r, i) blocks."""
    d = lattices[0].dim
    return [(i, r, slice(lat.class_starts[r], lat.class_starts[r + 1])) for r in range(d + 1)
            for i, lat in enumerate(lattices)]


def _splat(lattices, M, N, itype) -> torch.Tensor:
    """The (M+1) x N splat: the global rows in order, each lattice's row with its columns moved
    by the points before it; row M empty."""
    offsets, total = [], 0
    for lat in lattices:
        offsets.append(total)
        total += lat.num_points
    # per lattice once: its rows' lengths, and where each vertex class's entries start (one
    # read back from the device per lattice, not two per class)
    crows = [lat._splat.crow_indices().long() for lat in lattices]
    lengths_of = [crow.diff() for crow in crows]
    entry_starts = [crow[lat.class_starts].tolist() for crow, lat in zip(crows, lattices)]
    lengths, cols, vals = [], [], []
    for i, r, rows in _rows_in_global_order(lattices):
        sp = lattices[i]._splat
        a, b = entry_starts[i][r], entry_starts[i][r + 1]
        lengths.append(lengths_of[i][rows])
        cols.append(sp.col_indices()[a:b].long() + offsets[i])
        vals.append(sp.values()[a:b])
    dev = lattices[0].device
    counts = torch.cat(lengths + [torch.zeros(1, dtype=torch.long, device=dev)])
    crow = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), counts.cumsum(0)]).to(itype)
    return _csr(crow, torch.cat(cols).to(itype), torch.cat(vals), (M + 1, N))


def _slice(lattices, remaps, M, N, itype) -> torch.Tensor:
    """The N x (M+1) slice: each pixel's d+1 vertices renumbered, the images one after another."""
    d1 = lattices[0].dim + 1
    cols = torch.cat([remaps[i][lat._slice.col_indices().long()] for i, lat in enumerate(lattices)])
    vals = torch.cat([lat._slice.values() for lat in lattices])
    crow = torch.arange(0, N * d1 + 1, d1, device=cols.device, dtype=itype)
    return _csr(crow, cols.to(itype), vals, (N, M + 1))


def _blur(lattices, remaps, M) -> List:
    """Each axis's (n1, n2): the global point's neighbour is its own lattice's, renumbered."""
    btype = lattices[0]._blur[0][0].dtype
    out = []
    for axis in range(len(lattices[0]._blur)):
        pair = []
        for k in range(2):
            parts = [remaps[i][lattices[i]._blur[axis][k][rows].long()]
                     for i, _, rows in _rows_in_global_order(lattices)]
            parts.append(torch.tensor([M], device=parts[0].device))
            pair.append(torch.cat(parts).to(btype))
        out.append(tuple(pair))
    return out
