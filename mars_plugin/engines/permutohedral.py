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
sorted unique codes, one vertex class (remainder r) at a time: vertices of different classes
never share a point, so d+1 sorts of N codes replace one of N (d+1). Neighbours along an axis
are the codes of the next class shifted by a constant, found by a table look-up or a binary
search. Several images are filtered as one lattice whose keys start with the image's index
(``segment``), so their points never mix and no image is padded. Splatting and slicing are
sparse (CSR) matrix products, blurring is two row gathers per axis, so the same code runs
batched on the CPU and on CUDA.

Memory is bounded by construction: points are lifted in blocks, only int32 indices and float32
weights are kept (16 bytes per vertex, 8 per lattice point and axis), and ``max_points``
refuses a lattice before its blur tables exist (the dense CRF's budget, :mod:`mars_plugin.engines.crf_memory`).
"""
from __future__ import annotations

import copy
import importlib.util
import math
import os
import warnings
from typing import List, Optional, Tuple

import torch

from mars_plugin.engines.permutohedral_lift import _f32, _lift, lifted_bounds, max_lifted_coordinate

__all__ = ["PermutohedralLattice", "LatticeTooLarge", "MAX_COORDINATE", "lifted_bounds", "max_lifted_coordinate"]

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
#: The largest magnitude of a lifted coordinate the lattice accepts. The lifting and the
#: rounding to the nearest 0-coloured point run in float32, as in the C++: the lifted
#: coordinates must sum to 0 within less than one lattice step, which float32 keeps while they
#: stay well below 2^24 (past it the simplex ranks leave 0..d); 2^22 keeps a margin of four.
MAX_COORDINATE = float(2 ** 22)


#: The blur's layout: None (default) gathers along dim 1 of the transposed values on CUDA and
#: along rows on the CPU (where rows are as fast); True/False force one (tests compare both).
TRANSPOSED_BLUR: Optional[bool] = None
#: The filter's kernels: None (default) runs the fused Triton kernels (permutohedral_triton.py, the same bits as
#: this module on the CPU) on CUDA when MARS_TRITON=1 and triton is installed; True/False force them or not.
#: Opt-in until a GPU has run gpu.sh's 'triton' section: compiled, they are untested for bits and speed.
USE_TRITON: Optional[bool] = None


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """A CSR matrix from indices this module built itself (so not re-checked), without torch's
    "sparse CSR support is in beta" warning on every lattice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


class LatticeTooLarge(ValueError):
    """The lattice would have more than ``max_points`` points (raised before the blur's tables
    are made). ``points``: how many it has; ``limit``: the most allowed; ``num_points``: N."""

    def __init__(self, points: int, limit: int, num_points: int) -> None:
        super().__init__(f"the lattice has {points:,} points, more than max_points = {limit:,}")
        self.points, self.limit, self.num_points = points, limit, num_points


def _lookup(points: torch.Tensor, offset: int, M: int):
    """q -> offset + position of q in the sorted ``points``, or M where q is not there: a dense
    table where the points are dense enough, else a binary search (the same indices)."""
    n = points.numel()
    first, last = int(points[0]), int(points[-1])
    span = last - first + 1
    if span <= min(_TABLE_SPAN_PER_POINT * n + _TABLE_SPAN_MIN, _TABLE_SPAN_MAX):
        table = torch.full((span,), M, dtype=torch.int32 if M < 2 ** 31 - 1 else torch.long, device=points.device)
        table[(points - first).long()] = torch.arange(offset, offset + n, dtype=table.dtype, device=points.device)

        def look(q: torch.Tensor) -> torch.Tensor:
            i = (q - first).long()
            inside = (i >= 0) & (i < span)
            return torch.where(inside, table[i.clamp_(0, span - 1)], M)
        return look

    def search(q: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(points, q).clamp_max_(n - 1)
        return torch.where(points[pos] == q, pos + offset, M)
    return search


class _PackedCodes:
    """The lattice points of each vertex class r as sorted mixed-radix codes of (segment, q), in
    int64, or int32 when they fit (twice as fast to sort; the order, and so every result, is
    the same)."""

    def __init__(self, q0, rank, seg, lo, radix, bits):
        d = rank.shape[0] - 1
        self.d, self.rank = d, rank
        self.ctype = ctype = torch.int32 if bits <= 31 else torch.long
        strides = [1] * d
        for i in range(d - 2, -1, -1):
            strides[i] = strides[i + 1] * radix[i + 1]
        self.strides = strides
        base = torch.zeros(q0.shape[1], dtype=ctype, device=q0.device)
        for i in range(d):
            base += (q0[i].to(ctype) - lo[i]) * strides[i]
        if seg is not None:
            base += seg.to(ctype) * (strides[0] * radix[0])
        self.base = base
        self.points = [None] * (d + 1)

    def sort(self, r):
        """(order, new): the stable order of class r's vertices by code (ties: point order,
        the C++'s splat order), and where a new code starts in that order."""
        d = self.d
        code = self.base
        if r > 0:
            code = code.clone()
            for i in range(d):
                code -= (self.rank[i] > d - r).to(self.ctype) * self.strides[i]
        sorted_code, order = torch.sort(code, stable=True)
        del code
        new = torch.ones(sorted_code.numel(), dtype=torch.bool, device=sorted_code.device)
        torch.ne(sorted_code[1:], sorted_code[:-1], out=new[1:])
        self._sorted = sorted_code
        return order, new

    def keep(self, r, first):
        self.points[r] = self._sorted[first]
        self._sorted = None
        if r == self.d:
            self.base = self.rank = None

    def neighbours(self, g, s, offsets, M, outs):
        """Fill outs[j] (class s's points) with the index of their axis-j neighbour n1, a class
        g point (C++: key - 1 everywhere, key[j] + d): q + e_j for s > 0, q - 1 + e_j for s = 0;
        a constant shift of the code (the margins prevent carries)."""
        d, strides = self.d, self.strides
        look = _lookup(self.points[g], offsets[g], M)
        total = sum(strides)
        for j, out in enumerate(outs):
            shift = (strides[j] if j < d else 0) - (total if s == 0 else 0)
            out.copy_(look(self.points[s] + shift))


class _KeyRows:
    """The same lattice points when the packed code would not fit in int64: (segment, q)
    compared as rows (lexicographic, the order of the packed codes, so both number the lattice
    points alike)."""

    def __init__(self, q0, rank, seg):
        self.d, self.q0, self.rank, self.seg = rank.shape[0] - 1, q0, rank, seg
        self.points = [None] * (self.d + 1)

    def sort(self, r):
        d = self.d
        q = self.q0.long() - (self.rank[:d] > d - r).long()  # (d, N)
        rows = (q if self.seg is None else torch.cat([self.seg[None], q])).t()
        points, inverse = torch.unique(rows, dim=0, return_inverse=True)
        del rows, q
        ids, order = torch.sort(inverse, stable=True)
        new = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
        torch.ne(ids[1:], ids[:-1], out=new[1:])
        self.points[r] = points
        return order, new

    def keep(self, r, first):
        if r == self.d:
            self.q0 = self.rank = None

    def neighbours(self, g, s, offsets, M, outs):
        d = self.d
        target, source = self.points[g], self.points[s]
        n = target.shape[0]
        k = 0 if self.seg is None else 1
        for j, out in enumerate(outs):
            step = torch.zeros(source.shape[1], dtype=torch.long, device=source.device)
            if j < d:
                step[k + j] = 1
            if s == 0:
                step[k:] -= 1
            _, inv = torch.unique(torch.cat([target, source + step]), dim=0, return_inverse=True)
            table = torch.full((int(inv.max()) + 1,), M, dtype=torch.long, device=source.device)
            table[inv[:n]] = torch.arange(offsets[g], offsets[g] + n, device=source.device)
            out.copy_(table[inv[n:]])


def _check_features(features: torch.Tensor) -> None:
    """Refuse features the lattice cannot hold: not (N, d) float32, empty, non-finite, or lifted
    past :data:`MAX_COORDINATE`."""
    if features.ndim != 2 or features.dtype != torch.float32 or features.shape[1] < 1:
        raise ValueError(f"features must be an (N, d) float32 tensor with d >= 1, got {tuple(features.shape)} {features.dtype}")
    if features.shape[0] == 0:
        raise ValueError("features must hold at least one point, got N = 0")
    if not bool(torch.isfinite(features).all()):
        raise ValueError("features contain NaN or Inf values; expected finite positions")
    top = max_lifted_coordinate(features.abs().amax(0).tolist())
    if top > MAX_COORDINATE:
        raise ValueError(f"features are too large for the float32 lattice: lifted coordinates reach up to "
                         f"{top:.4g}, at most {MAX_COORDINATE:.4g} work (MAX_COORDINATE); divide the positions "
                         "by larger standard deviations")


def _segments(features: torch.Tensor, segment: Optional[torch.Tensor],
              simd_padding: bool) -> Tuple[Optional[torch.Tensor], int, int]:
    """(seg, S, P): the checked image index of every point (None for one image), with those of
    the P zero padding points appended, and the number S of images."""
    N, dev = features.shape[0], features.device
    seg = None
    num_segments = 1
    if segment is not None:
        seg = segment.to(dev, torch.long)
        if seg.shape != (N,) or int(seg.min()) < 0:
            raise ValueError(f"segment must be (N,) = ({N},) non-negative image indices, got "
                             f"{tuple(segment.shape)}")
        num_segments = int(seg.max()) + 1
    padded = torch.zeros(0, dtype=torch.long, device=dev)
    if simd_padding:
        # pydensecrf's x86 build lifts the points four at a time and pads the last block
        # with all-zero feature vectors, whose simplex vertices it inserts into the lattice
        # too: they hold no value, but the blur runs through them (near a black top-left
        # pixel in bilateral space). One zero point per image whose count is not a
        # multiple of 4 recreates them.
        per_image = (torch.bincount(seg, minlength=num_segments) if seg is not None
                     else torch.tensor([N], device=dev))
        padded = torch.nonzero(per_image % _SIMD_BLOCK).flatten()
    P = padded.numel()
    if seg is not None and P:
        seg = torch.cat([seg, padded])
    return seg, num_segments, P


def _vertex_keys(q0: torch.Tensor, rank: torch.Tensor, seg: Optional[torch.Tensor], num_segments: int):
    """The vertices' keys: packed integer codes (:class:`_PackedCodes`), or :class:`_KeyRows`
    where a code would need more than ``_MAX_CODE_BITS`` bits."""
    # Key of vertex r of point n, coordinate i < d (C++: rem0[i] + canonical[r][rank[i]]):
    #   key[r, i, n] = rem0[i, n] + r - (d+1) [rank[i, n] > d - r].
    # rem0 is a multiple of d+1, so every coordinate of vertex r is r modulo d+1: the key is
    # (r, q) with q[i] = rem0[i] / (d+1) - [rank[i] > d - r]. Vertices of different r never
    # meet, so the lattice points are found one r at a time (a sort of N codes, not
    # N (d+1)), numbered by (r, segment, q); an axis neighbour of an r-point is an
    # (r-1)-point (r = 0: a d-point), q moved by at most 1: q stays within
    # q0 - 2 .. q0 + 1, the margins of the packed code.
    lo = q0.amin(1).long() - _Q_MARGIN
    radix = [int(x) for x in (q0.amax(1).long() - lo + _Q_MARGIN + 1).tolist()]
    lo = [int(x) for x in lo.tolist()]
    bits = math.log2(num_segments) + sum(math.log2(x) for x in radix)
    if bits <= _MAX_CODE_BITS:
        return _PackedCodes(q0, rank, seg, lo, radix, bits)
    return _KeyRows(q0, rank, seg)


def _number_vertices(groups, bary: torch.Tensor, itype: torch.dtype):
    """Number the lattice points one vertex class r at a time: (splat_col, splat_val, vertex,
    starts, offsets), the splat matrix's columns, weights and row starts per class, every
    vertex's lattice point, and the first point of each class followed by M."""
    # Splat: (M+1) x N, one row per lattice point with its vertices in the C++ order (point
    # by point); row M stays empty: it is the zero "missing neighbour" of the blur. Padding
    # points are column 0 with weight 0. Slice: N x (M+1), vertex r of point n in column
    # ``vertex[n, r]``.
    d1, Np = bary.shape
    dev = bary.device
    splat_col = torch.empty(d1 * Np, dtype=itype, device=dev)
    splat_val = torch.empty(d1 * Np, dtype=torch.float32, device=dev)
    vertex = torch.empty(Np, d1, dtype=itype, device=dev)
    starts, offsets, M = [], [], 0
    for r in range(d1):
        order, new = groups.sort(r)
        ids = torch.cumsum(new, 0, dtype=itype)
        ids += M - 1
        vertex[:, r].index_copy_(0, order, ids)
        del ids
        part = slice(r * Np, (r + 1) * Np)
        splat_col[part] = order
        torch.index_select(bary[r], 0, order, out=splat_val[part])
        del order
        first = torch.nonzero(new).flatten()
        del new
        groups.keep(r, first)
        starts.append((first + r * Np).to(itype))
        offsets.append(M)
        M += first.numel()
        del first
    offsets.append(M)
    return splat_col, splat_val, vertex, starts, offsets


def _axis_neighbours(groups, offsets: List[int], device: torch.device) -> List[torch.Tensor]:
    """Along each axis j, the neighbour n1 (C++: key - 1 everywhere, key[j] + d; the last axis
    has no stored coordinate) of every lattice point, M where there is none."""
    d, M = len(offsets) - 2, offsets[-1]
    btype = torch.int32 if M < 2 ** 31 - 1 else torch.long
    n1 = [torch.full((M + 1,), M, dtype=btype, device=device) for _ in range(d + 1)]
    for g in range(d + 1):
        s = g + 1 if g < d else 0  # the r-points whose neighbours are (r-1)-points (0: d)
        groups.neighbours(g, s, offsets, M, [n[offsets[s]:offsets[s + 1]] for n in n1])
    return n1


def _blur_pairs(n1: List[torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(n1, n2) per axis: n2 (key + 1, key[j] - d) is the inverse of n1 (a + delta = b  <=>
    b - delta = a), M where there is none."""
    M = n1[0].numel() - 1
    idx = torch.arange(M + 1, device=n1[0].device, dtype=n1[0].dtype)
    pairs = []
    for a in n1:
        b = torch.full((M + 1,), M, dtype=a.dtype, device=a.device)
        b[a] = idx  # b[n1[k]] = k; the points without a neighbour all write row M ...
        b[M] = M  # ... which stays the empty one
        pairs.append((a, b))
    return pairs


class PermutohedralLattice:
    """A permutohedral lattice over N points, and the Gaussian filter it approximates.

    Shapes:
        features: (N, d) float32 positions, already divided by the kernel's standard deviations
            (pydensecrf's ``x / sxy, y / sxy, r / srgb, ...``); every lifted coordinate must stay
            below :data:`MAX_COORDINATE` in magnitude (see :func:`max_lifted_coordinate`).
        segment: optional (N,) int64 in 0..S-1, the image each point belongs to; points of
            different segments never share a lattice point (filtering a batch as one lattice
            equals filtering each image alone).

        max_points: refuse (:class:`LatticeTooLarge`) a lattice of more points, before its
            blur tables are made (the dense CRF's memory budget).

    ``filter(values)`` maps (N, L) values to (N, L): splat, blur, slice, without normalisation
    (the dense CRF normalises with the filtered ones, see :mod:`mars_plugin.engines.crf_lattices`).
    Everything lives on the features' device.

    Memory: what is kept is the splat and slice matrices (16 bytes per vertex, d+1 vertices
    per point) and the blur's neighbour tables (8 bytes per lattice point and axis); building
    it takes about 40 bytes per point more for a while (the lifting runs in blocks of points,
    the sort one vertex class at a time).
    """

    def __init__(self, features: torch.Tensor, segment: Optional[torch.Tensor] = None, *,
                 simd_padding: bool = True, max_points: Optional[int] = None) -> None:
        _check_features(features)
        N, d = features.shape
        dev = features.device
        self.num_points, self.dim, self.device = N, d, dev
        seg, num_segments, P = _segments(features, segment, simd_padding)
        Np = N + P
        q0, rank, bary = _lift(features, P)
        groups = _vertex_keys(q0, rank, seg, num_segments)
        nnz = (d + 1) * Np
        itype = torch.int32 if nnz < 2 ** 31 - 1 else torch.long  # MKL's and cuSPARSE's 32-bit indices
        splat_col, splat_val, vertex, starts, offsets = _number_vertices(groups, bary, itype)
        M = offsets[-1]
        del q0, rank
        if max_points is not None and M > max_points:
            raise LatticeTooLarge(M, max_points, N)
        self.num_lattice_points = M
        self.class_starts = offsets  # the first point of each vertex class r, and M
        if P:
            splat_col.masked_fill_(splat_col >= N, 0)
        crow = torch.cat(starts + [torch.full((2,), nnz, dtype=itype, device=dev)])
        del starts
        self._splat = _csr(crow, splat_col, splat_val, (M + 1, N))
        del crow, splat_col, splat_val
        # ... times the C++'s "magic" alpha = 1 / (1 + 2^-d).
        alpha = _f32(1.0 / (1.0 + 2.0 ** -d))
        weights = bary[:, :N].t().mul(alpha).reshape(-1)
        del bary
        crow = torch.arange(0, N * (d + 1) + 1, d + 1, device=dev, dtype=itype)
        self._slice = _csr(crow, vertex[:N].reshape(-1), weights, (N, M + 1))
        del crow, vertex, weights
        n1 = _axis_neighbours(groups, offsets, dev)
        del groups
        self._blur = _blur_pairs(n1)

    # ------------------------------------------------------------ filtering
    @property
    def vertices(self) -> torch.Tensor:
        """(N, d+1) lattice-point index of each point's simplex vertices, vertex r in column r."""
        return self._slice.col_indices().view(self.num_points, self.dim + 1).long()

    def scaled(self, before: torch.Tensor, after: torch.Tensor) -> "PermutohedralLattice":
        """The lattice whose ``filter(v)`` is ``after * K(before * v)`` (before, after: (N,) or
        (N, 1)): the two diagonals folded into the sparse weights once, instead of two
        multiplications of the values at every call. ``self`` is left as it is (the rest is
        shared; :meth:`scale_` does it in place, without a second copy of the weights)."""
        out = copy.copy(self)
        out._splat = _csr(self._splat.crow_indices(), self._splat.col_indices(), self._splat.values().clone(),
                          tuple(self._splat.shape))
        out._slice = _csr(self._slice.crow_indices(), self._slice.col_indices(), self._slice.values().clone(),
                          tuple(self._slice.shape))
        return out.scale_(before, after)

    def scale_(self, before: torch.Tensor, after: torch.Tensor) -> "PermutohedralLattice":
        """In place: ``filter(v)`` becomes ``after * K(before * v)``. Returns ``self``."""
        b = before.reshape(-1).to(self._splat.values().dtype)
        a = after.reshape(-1).to(self._slice.values().dtype)
        self._splat.values().mul_(torch.index_select(b, 0, self._splat.col_indices()))
        self._slice.values().view(self.num_points, self.dim + 1).mul_(a[:, None])
        return self

    def filter(self, values: torch.Tensor, *, add_to: Optional[torch.Tensor] = None,
               scale: float = 1.0) -> torch.Tensor:
        """Shapes: values (N, L) float32 -> (N, L) float32, on the lattice's device.

        With ``add_to`` ((N, L) float32, contiguous), ``scale`` times the result is added into it
        in place and it is returned (one pass over the output instead of two).
        """
        if values.ndim != 2 or values.shape[0] != self.num_points:
            raise ValueError(f"values must be (N, L) with N = {self.num_points}, got {tuple(values.shape)}")
        if USE_TRITON or (USE_TRITON is None and values.is_cuda and os.environ.get("MARS_TRITON", "0") not in ("", "0")
                          and importlib.util.find_spec("triton") is not None):
            from mars_plugin.engines.permutohedral_triton import triton_filter
            return triton_filter(self, values, add_to=add_to, scale=scale)
        v = self._splat @ values.to(torch.float32).contiguous()
        # On CUDA the blur gathers along the columns of the transposed (L, M+1) values: gathering
        # (M+1, L) rows of a few floats runs a kernel 30x slower than the same gather along dim 1
        # (measured on an H200: 2.0 ms vs 0.067 ms per gather at M = 3.3M, L = 4; the blur was 83%
        # of the CRF's GPU time). Same additions in the same order: the same values, bit for bit.
        transposed = v.is_cuda if TRANSPOSED_BLUR is None else TRANSPOSED_BLUR
        if transposed:
            v = v.t().contiguous()
        dim = 1 if transposed else 0
        w = torch.empty_like(v)
        t = torch.empty_like(v)
        for n1, n2 in self._blur:
            # new = old + 0.5 (n1 + n2), in the C++'s float operations
            torch.index_select(v, dim, n1, out=w)
            w.add_(torch.index_select(v, dim, n2, out=t)).mul_(0.5).add_(v)
            v, w = w, v
        del w, t
        if transposed:
            v = v.t().contiguous()
        if add_to is None:
            out = self._slice @ v
            return out if scale == 1.0 else out.mul_(scale)
        return add_to.addmm_(self._slice, v, alpha=scale)
