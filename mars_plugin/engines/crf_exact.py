"""The general dense CRF's compiled CPU arithmetic in pydensecrf's float32 order, operation for
operation, so that the drop-in (:mod:`mars_plugin.densecrf`) gives pydensecrf's Q bit for bit
where the lattice is the same (measured: every value of Q equal, see docs/crf.md).

The fixed-pair CRF (:mod:`mars_plugin.engines.crf_compiled`) folds the normaliser into the
splat and slice weights and lets LLVM fuse multiply-adds: each operation is off by at most an
ulp, but 65% of Q's values then differ in their last bits after every step, and the mean field
amplifies those bits near label ties (x4 per iteration at the end: 1.2e-4 after 10, measured on
noise). Here every rounding happens where pydensecrf's x86 build (SSE2, no FMA; Eigen 3.3)
makes it (``densecrf/src/permutohedral.cpp``, ``pairwise.cpp``, ``densecrf.cpp``):

* the filter's input is multiplied by the normaliser first (``in * norm``), then splatted with
  the barycentric weights (``w * x``), blurred (``old + 0.5 (n1 + n2)``), sliced with
  ``(w alpha) * v`` (``sseCompute``, more than 2 labels) or ``(w * v) * alpha``
  (``seqCompute``, 1 or 2 labels: the normaliser's filter of ones too), then multiplied by the
  normaliser again; the Potts message ``-(-w m)`` is added as ``e + w m``, two roundings;
* the softmax (``expAndNormalize``) takes Eigen's vectorised exp (Cephes' polynomial, no FMA)
  for the labels in whole packets of 4 and the C library's ``expf`` for the rest, and sums a
  pixel's labels in Eigen's order (two packet accumulators, then lanes (0+2)+(1+3), then the
  tail), then divides.

Arrays are (N, L) float32 C-contiguous, one row per point. numba is optional, as for
:mod:`mars_plugin.engines.crf_compiled`; without it the drop-in runs the torch lattice.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mars_plugin.engines import crf_compiled, kmeans_compiled

__all__ = ["ExactLattice", "softmax_rows"]

numba = kmeans_compiled.numba
# Eigen's packets of 4 floats (SSE): exp and the sum treat whole packets and the tail apart.
_PACKET = 4

if numba is not None:
    from numba import njit

    _CACHE = kmeans_compiled._CACHE
    # "nsz" only: no fused multiply-add, no reassociation (pydensecrf's build has neither).
    _FM = {"nsz"}

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, inline="always")
    def _eigen_exp(x):
        """Eigen 3.3's pexp<Packet4f> for x <= 0: Cephes' expf, each multiply and add rounded."""
        if x < np.float32(-88.3762626647949):
            x = np.float32(-88.3762626647949)
        fx = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        x = x - fx * np.float32(0.693359375)
        x = x - fx * np.float32(-2.12194440e-4)
        z = x * x
        y = np.float32(1.9875691500e-4) * x + np.float32(1.3981999507e-3)
        y = y * x + np.float32(8.3334519073e-3)
        y = y * x + np.float32(4.1665795894e-2)
        y = y * x + np.float32(1.6666665459e-1)
        y = y * x + np.float32(5.0000001201e-1)
        y = (y * z + x) + np.float32(1.0)
        return y * crf_compiled._float32_from_bits(np.int32((np.int32(fx) + 127) << 23))

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, inline="always")
    def _eigen_sum(x, n, L):
        """Eigen 3.3's redux of row n's L values (linear vectorised traversal, SSE): lanes
        summed in two packet accumulators, then (0+2)+(1+3), then the tail in order."""
        P = L // 4 * 4
        if P == 0:
            s = x[n, 0]
            for k in range(1, L):
                s += x[n, k]
            return s
        a0, a1, a2, a3 = x[n, 0], x[n, 1], x[n, 2], x[n, 3]
        if P > 4:
            b0, b1, b2, b3 = x[n, 4], x[n, 5], x[n, 6], x[n, 7]
            P2 = L // 8 * 8
            for i in range(8, P2, 8):
                a0, a1, a2, a3 = a0 + x[n, i], a1 + x[n, i + 1], a2 + x[n, i + 2], a3 + x[n, i + 3]
                b0, b1, b2, b3 = b0 + x[n, i + 4], b1 + x[n, i + 5], b2 + x[n, i + 6], b3 + x[n, i + 7]
            a0, a1, a2, a3 = a0 + b0, a1 + b1, a2 + b2, a3 + b3
            if P > P2:
                a0, a1, a2, a3 = a0 + x[n, P2], a1 + x[n, P2 + 1], a2 + x[n, P2 + 2], a3 + x[n, P2 + 3]
        s = (a0 + a2) + (a1 + a3)
        for k in range(P, L):
            s += x[n, k]
        return s

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def softmax_rows(x):
        """x (N, L) in place: exp(x - max) / sum per row, as pydensecrf's expAndNormalize. The
        packets' exponentials in one pass over the values as a flat array (it vectorises), the
        tail's (L mod 4 per row) saved first and taken from the C library's expf."""
        N, L = x.shape
        P = L // _PACKET * _PACKET
        tail = np.empty((N, L - P), np.float32)
        for n in range(N):
            mx = x[n, 0]
            for k in range(1, L):
                if x[n, k] > mx:
                    mx = x[n, k]
            for k in range(L):
                x[n, k] = x[n, k] - mx
            for k in range(P, L):
                tail[n, k - P] = x[n, k]
        flat = x.reshape(N * L)
        for i in range(N * L):
            flat[i] = _eigen_exp(flat[i])
        for n in range(N):
            for k in range(P, L):
                x[n, k] = np.exp(tail[n, k - P])
            s = _eigen_sum(x, n, L)
            for k in range(L):
                x[n, k] = x[n, k] / s

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _splat(vert, bary, before, x, v):
        """v[vert[n, r]] += bary[n, r] * (x[n] * before[n]), pixel by pixel (no ``before``: x)."""
        N, d1 = vert.shape
        L = x.shape[1]
        v[:] = 0.0
        if before.shape[0]:
            xs = np.empty(L, np.float32)
            for n in range(N):
                for k in range(L):
                    xs[k] = x[n, k] * before[n]
                for r in range(d1):
                    c, a = vert[n, r], bary[n, r]
                    for k in range(L):
                        v[c, k] += a * xs[k]
        else:
            for n in range(N):
                for r in range(d1):
                    c, a = vert[n, r], bary[n, r]
                    for k in range(L):
                        v[c, k] += a * x[n, k]

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _blur(n1, n2, v, w):
        """Each axis in order: new = old + 0.5 (n1 + n2); returns the array holding the result."""
        M = n1.shape[1] - 1
        w[M, :] = 0.0  # the missing neighbour: 0 in both arrays
        half = np.float32(0.5)
        for j in range(n1.shape[0]):
            for m in range(M):
                a, b = n1[j, m], n2[j, m]
                for k in range(v.shape[1]):
                    w[m, k] = v[m, k] + half * (v[a, k] + v[b, k])
            v, w = w, v
        return v

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _slice(vert, bary, lw, alpha, after, v, out, scale):
        """out[n] += scale * (after[n] * sum_r lw[n, r] v[vert[n, r]]), lw = bary alpha
        (sseCompute), or sum_r (bary v) alpha for 1 or 2 labels (seqCompute)."""
        N, d1 = vert.shape
        L = v.shape[1]
        acc = np.zeros(L, np.float32)
        for n in range(N):  # the sum starts at its first term: 0 + t = t
            if L <= 2:
                c, a = vert[n, 0], bary[n, 0]
                for k in range(L):
                    acc[k] = (a * v[c, k]) * alpha
                for r in range(1, d1):
                    c, a = vert[n, r], bary[n, r]
                    for k in range(L):
                        acc[k] += (a * v[c, k]) * alpha
            else:
                c, a = vert[n, 0], lw[n, 0]
                for k in range(L):
                    acc[k] = a * v[c, k]
                for r in range(1, d1):
                    c, a = vert[n, r], lw[n, r]
                    for k in range(L):
                        acc[k] += a * v[c, k]
            if after.shape[0]:
                for k in range(L):
                    acc[k] = acc[k] * after[n]
            for k in range(L):
                out[n, k] += scale * acc[k]

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _filter_exact(vert, bary, lw, n1, n2, before, after, alpha, x, vbuf, wbuf, out, scale):
        """out += scale * (after * slice(blur(splat(before * x)))), in pydensecrf's order:
        ``before``/``after`` (N,) or empty (no factor). vbuf, wbuf: (M+1) L floats or more."""
        M = n1.shape[1] - 1
        L = x.shape[1]
        v = vbuf[: (M + 1) * L].reshape((M + 1, L))
        w = wbuf[: (M + 1) * L].reshape((M + 1, L))
        _splat(vert, bary, before, x, v)
        _slice(vert, bary, lw, alpha, after, _blur(n1, n2, v, w), out, scale)


class ExactLattice:
    """A Gaussian kernel's lattice for :func:`_filter_exact`: the compiled lattice of (N, D)
    float32 ``features`` (:class:`~mars_plugin.engines.crf_compiled.CompiledLattice`, its
    weights not folded). ``filter`` is the plain K(x) until :meth:`set_normalisers` gives the
    factors (the caller computes them from ``filter`` of ones, as pydensecrf's initLattice)."""

    def __init__(self, features: np.ndarray) -> None:
        lat = crf_compiled.CompiledLattice(features, [features.shape[0]], normalise=False)
        self.num_points, self.dim, self.num_lattice_points = lat.num_points, lat.dim, lat.num_lattice_points
        self.vert, self.bary, self.n1, self.n2 = lat.vert, lat.sw, lat.n1, lat.n2
        self.alpha = np.float32(1.0 / (1.0 + 2.0 ** -self.dim))
        self.lw = self.bary * self.alpha  # sseCompute's per-vertex weight (float32 product)
        self.before = self.after = np.zeros(0, np.float32)

    def set_normalisers(self, before: Optional[np.ndarray], after: Optional[np.ndarray]) -> None:
        """The (N,) float32 factors of the values before and after the filter (None: none)."""
        none = np.zeros(0, np.float32)
        self.before = none if before is None else np.ascontiguousarray(before, dtype=np.float32)
        self.after = none if after is None else np.ascontiguousarray(after, dtype=np.float32)

    def filter(self, x: np.ndarray, out: Optional[np.ndarray] = None, scale: float = 1.0,
               vbuf: Optional[np.ndarray] = None, wbuf: Optional[np.ndarray] = None) -> np.ndarray:
        """(N, L) float32 -> out += scale Kn(x) (out: zeros when None); vbuf, wbuf: scratch of
        at least (M+1) L floats (made here when None)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if out is None:
            out = np.zeros_like(x)
        size = (self.num_lattice_points + 1) * x.shape[1]
        if vbuf is None or vbuf.shape[0] < size:
            vbuf, wbuf = np.empty(size, np.float32), np.empty(size, np.float32)
        _filter_exact(self.vert, self.bary, self.lw, self.n1, self.n2, self.before, self.after, self.alpha, x,
                      vbuf, wbuf, out, np.float32(scale))
        return out
