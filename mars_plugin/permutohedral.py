"""The permutohedral lattice (Adams, Baek & Davis, Eurographics 2010) in torch operations.

This is the Gaussian filter of the dense CRF (Krahenbuhl & Koltun, NIPS 2011) built the way
pydensecrf's ``densecrf/src/permutohedral.cpp`` builds it, so that the filtered values agree with
it to float32 rounding:

* every feature vector f (d values) is lifted onto the hyperplane of the (d+1)-dimensional
  lattice with the same scale factors (``sqrt(2/3) (d+1) / sqrt((i+1)(i+2))``), rounded to the
  nearest "0-coloured" lattice point (round half to even, as the SSE code does), and the
  simplex holding it is found from the ranking of the remainders; the d+1 vertices of that
  simplex and the point's barycentric weights are the lattice's view of the point;
* filtering splats values onto the vertices with those weights, blurs each of the d+1 lattice
  axes with the kernel [1/2, 1, 1/2] in order (a missing neighbour counts as 0), and slices back
  with the same weights times ``1 / (1 + 2^-d)``.

What differs is the bookkeeping, not the arithmetic: instead of a hash table filled one point
at a time, every vertex key is packed into one integer code (mixed radix over the key's range,
int32 when it fits, else int64, else rows compared as such) and the lattice points are the
sorted unique codes; neighbours along an axis are the codes shifted by a constant, found by a
table look-up or a binary search. Several images are filtered as one
lattice whose keys start with the image's index (``segment``), so their points never mix and no
image is padded. Splatting and slicing are sparse (CSR) matrix products, blurring is two row
gathers per axis, so the same code runs batched on the CPU and on CUDA.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["PermutohedralLattice"]

# Neighbour look-up by a dense table when the codes span at most this many entries per lattice
# point (plus a fixed allowance); otherwise a binary search in the sorted codes. Both give the
# same indices; the table is a few times faster where the lattice is dense (the xy kernel).
_TABLE_SPAN_PER_POINT = 16
_TABLE_SPAN_MIN = 1 << 20
_TABLE_SPAN_MAX = 1 << 28  # 1 GB of int32, for a GPU batch's position lattice at most
# pydensecrf's SSE code lifts points in blocks of this many (one __m128 of floats).
_SIMD_BLOCK = 4
# Room kept around the q coordinates of the packed keys: vertices reach rem0 / (d+1) - 1,
# their axis neighbours one more on either side.
_Q_MARGIN = 2
# Codes are packed into int64 while the mixed radix needs at most this many bits; past it
# (very fine kernels on large images) the keys are compared as rows instead, with the same
# result.
_MAX_CODE_BITS = 62


def _f32(x: float) -> float:
    """A Python float rounded to float32, as the C++ stores its constants."""
    return float(np.float32(x))


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """A CSR matrix from indices this module built itself (so not re-checked), without torch's
    "sparse CSR support is in beta" warning on every lattice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


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


class PermutohedralLattice:
    """A permutohedral lattice over N points, and the Gaussian filter it approximates.

    Shapes:
        features: (N, d) float32 positions, already divided by the kernel's standard deviations
            (pydensecrf's ``x / sxy, y / sxy, r / srgb, ...``).
        segment: optional (N,) int64 in 0..S-1, the image each point belongs to; points of
            different segments never share a lattice point (filtering a batch as one lattice
            equals filtering each image alone).

    ``filter(values)`` maps (N, L) values to (N, L): splat, blur, slice, without normalisation
    (the dense CRF normalises with the filtered ones, see :mod:`mars_plugin.crf`).
    Everything lives on the features' device.
    """

    def __init__(self, features: torch.Tensor, segment: Optional[torch.Tensor] = None, *,
                 simd_padding: bool = True) -> None:
        if features.ndim != 2 or features.dtype != torch.float32 or features.shape[1] < 1:
            raise ValueError(f"features must be an (N, d) float32 tensor with d >= 1, got {tuple(features.shape)} {features.dtype}")
        N, d = features.shape
        if N == 0:
            raise ValueError("features must hold at least one point, got N = 0")
        if not bool(torch.isfinite(features).all()):
            raise ValueError("features contain NaN or Inf values; expected finite positions")
        dev = features.device
        self.num_points, self.dim, self.device = N, d, dev
        seg = torch.zeros(N, dtype=torch.long, device=dev) if segment is None else segment.to(dev, torch.long)
        if segment is not None and (seg.shape != (N,) or int(seg.min()) < 0):
            raise ValueError(f"segment must be (N,) = ({N},) non-negative image indices, got {tuple(segment.shape)}")
        if simd_padding:
            # pydensecrf's x86 build lifts the points four at a time and pads the last block
            # with all-zero feature vectors, whose simplex vertices it inserts into the lattice
            # too: they hold no value, but the blur runs through them (near a black top-left
            # pixel in bilateral space). One zero point per image whose count is not a
            # multiple of 4 recreates them.
            per_image = torch.bincount(seg)
            padded = torch.nonzero(per_image % _SIMD_BLOCK).flatten()
            features = torch.cat([features, features.new_zeros(padded.numel(), d)])
            seg = torch.cat([seg, padded])
        rem0, rank, bary = _simplex(_elevate(features))
        bary[:, N:] = 0.0  # the padding points splat nothing

        # Key of vertex r of point n, coordinate i < d (C++: rem0[i] + canonical[r][rank[i]]):
        #   key[r, i, n] = rem0[i, n] + r - (d+1) [rank[i, n] > d - r].
        # rem0 is a multiple of d+1, so every coordinate of vertex r is r modulo d+1: the key is
        # (r, q) with q[i] = rem0[i] / (d+1) - [rank[i] > d - r], d+1 times fewer values per
        # coordinate than the key itself (about 10 bits fewer for the bilateral kernel, which
        # lets most codes be sorted as int32). Axis neighbours move q by at most 1 and r
        # wraps: q stays within rem0 / (d+1) - 2 .. + 1.
        q0 = torch.div(rem0[:d], d + 1, rounding_mode="floor")
        lo = q0.amin(1) - _Q_MARGIN
        radix = [int(x) for x in (q0.amax(1) - lo + _Q_MARGIN + 1).tolist()]
        num_segments = int(seg.max()) + 1
        bits = math.log2(num_segments) + math.log2(d + 1) + sum(math.log2(x) for x in radix)
        if bits <= _MAX_CODE_BITS:
            order, ids, counts, neighbours = self._points_packed(q0, rank, lo, radix, seg, bits)
        else:
            order, ids, counts, neighbours = self._points_rows(q0, rank, seg)
        # From here on vertices are numbered pixel-major, n * (d+1) + r, as the C++ visits
        # them; ``order`` sorts them by lattice point (stable), ``ids`` is the point of each
        # vertex in that order, ``counts`` the vertices of each point.
        M = counts.numel()
        self.num_lattice_points = M
        # n2 along an axis is the inverse of n1 (a + delta = b  <=>  b - delta = a): one look-up.
        idx = torch.arange(M, device=dev)
        btype = torch.int32 if M < 2 ** 31 - 1 else torch.long  # as fast, half the memory
        self._blur = []
        for n1 in neighbours:
            n2 = torch.full((M + 1,), M, dtype=torch.long, device=dev)
            found = n1 < M
            n2[n1[found]] = idx[found]
            self._blur.append((torch.cat([n1, n1.new_full((1,), M)]).to(btype), n2.to(btype)))

        nnz = ids.numel()  # (N + padding points) * (d+1)
        itype = torch.int32 if nnz < 2 ** 31 - 1 else torch.long
        vertex_point = torch.empty_like(ids).index_copy_(0, order, ids)[:N * (d + 1)]
        self._vertices = vertex_point.view(N, d + 1)
        weights = bary.t().reshape(-1)
        # Splat: (M+1) x N, one row per lattice point with its vertices in the C++ order; row
        # M stays empty: it is the zero "missing neighbour" of the blur. Padding points are
        # column 0 with weight 0.
        crow = torch.zeros(M + 2, dtype=torch.long, device=dev)
        torch.cumsum(counts, 0, out=crow[1:M + 1])
        crow[M + 1] = nnz
        col = torch.div(order, d + 1, rounding_mode="floor")
        col = col.masked_fill(col >= N, 0)
        self._splat = _csr(crow.to(itype), col.to(itype), weights[order], (M + 1, N))
        # Slice: N x (M+1), the d+1 vertices of each point with its weights times the C++'s
        # "magic" alpha = 1 / (1 + 2^-d).
        alpha = _f32(1.0 / (1.0 + 2.0 ** -d))
        crow = torch.arange(0, N * (d + 1) + 1, d + 1, device=dev).to(itype)
        self._slice = _csr(crow, vertex_point.to(itype), weights[:N * (d + 1)] * alpha, (N, M + 1))

    # ------------------------------------------------------------ lattice points, packed codes
    def _points_packed(self, q0, rank, lo, radix, seg, bits):
        """Sort the vertices by one mixed-radix code of (segment, r, q) in int64, or int32
        when it fits (twice as fast; the order, and so every result, is the same)."""
        d = rank.shape[0] - 1
        dev = q0.device
        strides = [1] * d
        for i in range(d - 2, -1, -1):
            strides[i] = strides[i + 1] * radix[i + 1]
        stride_r = strides[0] * radix[0]
        stride_sum = sum(strides)
        base = seg * (stride_r * (d + 1))
        for i in range(d):
            base += (q0[i] - int(lo[i])) * strides[i]
        # sum_i stride_i [rank_i > d - r] for r = 1..d: a suffix sum over the ranks.
        stride_t = torch.tensor(strides + [0], dtype=torch.long, device=dev)
        by_rank = torch.zeros_like(rank).scatter_(0, rank, stride_t[:, None].expand_as(rank).contiguous())
        above = torch.cumsum(by_rank.flip(0), 0)[:d]
        code = base + torch.arange(d + 1, device=dev)[:, None] * stride_r
        code[1:] -= above
        ctype = torch.int32 if bits <= 31 else torch.long
        sorted_code, order = torch.sort(code.t().reshape(-1).to(ctype), stable=True)
        points, ids, counts = torch.unique_consecutive(sorted_code, return_inverse=True, return_counts=True)
        points = points.long()
        # Axis j neighbour n1 (C++: key - 1 everywhere, key[j] + d; the last axis has no stored
        # coordinate) of a point with remainder r: (r - 1, q + e_j) when r > 0, (d, q - 1 + e_j)
        # when r = 0; a constant shift of the code within each case, the margins prevent carries.
        r = torch.div(points, stride_r, rounding_mode="floor") % (d + 1)
        deltas = [(-stride_r + (strides[j] if j < d else 0), d * stride_r - stride_sum + (strides[j] if j < d else 0))
                  for j in range(d + 1)]
        M = points.numel()
        reach = max(max(abs(a), abs(b)) for a, b in deltas)
        span = int(points[-1] - points[0]) + 1 + 2 * reach
        queries = [points + torch.where(r > 0, a, b) for a, b in deltas]
        if span <= min(_TABLE_SPAN_PER_POINT * M + _TABLE_SPAN_MIN, _TABLE_SPAN_MAX):
            start = int(points[0]) - reach
            table = torch.full((span,), M, dtype=torch.int32 if M < 2 ** 31 - 1 else torch.long, device=dev)
            table[points - start] = torch.arange(M, device=dev, dtype=table.dtype)
            neighbours = [table[q - start].long() for q in queries]
        else:
            neighbours = []
            for q in queries:
                pos = torch.searchsorted(points, q).clamp_max(M - 1)
                neighbours.append(torch.where(points[pos] == q, pos, M))
        return order, ids, counts, neighbours

    # ------------------------------------------------------------ lattice points, key rows
    def _points_rows(self, q0, rank, seg):
        """The same lattice when the packed code would not fit in int64: (segment, r, q)
        compared as rows."""
        d = rank.shape[0] - 1
        dev = q0.device
        N = q0.shape[1]
        r = torch.arange(d + 1, device=dev)
        q = q0[None] - (rank[None, :d] > (d - r)[:, None, None]).long()  # (d+1, d, N)
        rows = torch.cat([seg[None, None, :].expand(d + 1, 1, N), r[:, None, None].expand(d + 1, 1, N), q], 1)
        rows = rows.permute(2, 0, 1).reshape(-1, d + 2)
        # unique(dim=0) sorts rows lexicographically, the order of the packed codes, so both
        # builds number the lattice points alike.
        points, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
        ids, order = torch.sort(inverse, stable=True)
        M = points.shape[0]
        neighbours = []
        positive = (points[:, 1] > 0)[:, None]
        for j in range(d + 1):
            step = torch.zeros(d + 2, dtype=torch.long, device=dev)
            if j < d:
                step[2 + j] = 1
            from_pos = step.clone()
            from_pos[1] = -1
            from_zero = step.clone()
            from_zero[1] = d
            from_zero[2:] -= 1
            query = points + torch.where(positive, from_pos, from_zero)
            _, inv = torch.unique(torch.cat([points, query]), dim=0, return_inverse=True)
            table = torch.full((int(inv.max()) + 1,), M, dtype=torch.long, device=dev)
            table[inv[:M]] = torch.arange(M, device=dev)
            neighbours.append(table[inv[M:]])
        return order, ids, counts, neighbours

    # ------------------------------------------------------------ filtering
    @property
    def vertices(self) -> torch.Tensor:
        """(N, d+1) lattice-point index of each point's simplex vertices, vertex r in column r."""
        return self._vertices

    def scaled(self, before: torch.Tensor, after: torch.Tensor) -> "PermutohedralLattice":
        """The lattice whose ``filter(v)`` is ``after * K(before * v)`` (before, after: (N,) or
        (N, 1)): the two diagonals folded into the sparse weights once, instead of two
        multiplications of the values at every call. ``self`` is left as it is (the rest is
        shared)."""
        b = before.reshape(-1).to(self._splat.values().dtype)
        a = after.reshape(-1).to(self._slice.values().dtype)
        out = copy.copy(self)
        col = self._splat.col_indices().long()
        out._splat = _csr(self._splat.crow_indices(), self._splat.col_indices(), self._splat.values() * b[col],
                          tuple(self._splat.shape))
        rows = torch.repeat_interleave(a, self.dim + 1)
        out._slice = _csr(self._slice.crow_indices(), self._slice.col_indices(), self._slice.values() * rows,
                          tuple(self._slice.shape))
        return out

    def filter(self, values: torch.Tensor, *, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Shapes: values (N, L) float32 -> (N, L) float32, on the lattice's device.

        With ``add_to`` ((N, L) float32, contiguous), the result is added into it in place and
        it is returned (one pass over the output instead of two).
        """
        if values.ndim != 2 or values.shape[0] != self.num_points:
            raise ValueError(f"values must be (N, L) with N = {self.num_points}, got {tuple(values.shape)}")
        v = self._splat @ values.to(torch.float32).contiguous()
        w = torch.empty_like(v)
        t = torch.empty_like(v)
        for n1, n2 in self._blur:
            # new = old + 0.5 (n1 + n2), in the C++'s float operations
            torch.index_select(v, 0, n1, out=w)
            w.add_(torch.index_select(v, 0, n2, out=t)).mul_(0.5).add_(v)
            v, w = w, v
        if add_to is None:
            return self._slice @ v
        return add_to.addmm_(self._slice, v)
