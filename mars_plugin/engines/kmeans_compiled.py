"""The K-means of every (image, class) group compiled with numba, for the CPU.

On the CPU the batched torch K-means (:mod:`mars_plugin.engines.kmeans`) spends most of its time in
per-operation overhead and in passes over padded (B, N, D) blocks that do not fit the cache.
This kernel solves one group at a time per thread instead (groups handed out one by one, as
their sizes differ tenfold): the group's pixels are gathered once into a (D, n) block that
stays in the core's cache for the seeding and every Lloyd step, with no padding and no Python
in the loop; once few points move, the cluster sums are updated by the moved points only.
The pixels are gathered from each image's features where they already are, float16 (what
``mars features`` writes) widened exactly on the way: nothing is copied beforehand. The labels
are grouped by a counting sort (:func:`group_pixels`), also compiled.

It is the same algorithm as :func:`mars_plugin.engines.kmeans._kmeans_padded`, step for step: the
same k-means++ draws (the uniforms of each problem are passed in), the same candidate choice,
Lloyd updates, empty-cluster rule and stopping rule, in float32 like the torch path. The
order of the float additions differs, so the two agree to float32 rounding; a point tied
between two centroids to the last bit may go either way and then move a centroid. On the
bench_select data that happens to ~0.3% of the groups, as often as between the torch path in
float32 and in float64.

numba is optional (``pip install 'mars-plugin[fast]'``): :func:`available` says whether it can
be used, and callers fall back to the torch path when it cannot.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

try:  # numba is an optional extra; the torch path is used without it
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - exercised on machines without numba
    numba = None

__all__ = ["available", "kmeans_groups", "group_pixels", "label_range", "nonfinite_pixels"]


def available() -> bool:
    """True when numba is installed and ``MARS_NO_NUMBA`` is not set (a switch for comparisons)."""
    return numba is not None and not os.environ.get("MARS_NO_NUMBA")


def _cache_usable() -> bool:
    """Whether numba can cache this module's compiled functions.

    ``cache=True`` makes numba look for a writable folder (``NUMBA_CACHE_DIR``, the package's
    ``__pycache__``, then the user's cache folder) when a function is *decorated*, and raise
    when there is none: a read-only install run by a user without a home folder could not even
    ``import mars_plugin``. A throw-away dispatcher with ``cache=True`` asks the same question
    (nothing is compiled); without a folder, the kernels are compiled in memory on first use,
    in every process.
    """
    def probe():  # pragma: no cover - never called, only located
        return 0

    try:
        numba.njit(cache=True)(probe)
    except (RuntimeError, OSError):
        return False
    return True


if numba is not None:
    _CACHE = _cache_usable()

    # No "reassoc": it let LLVM vectorise the float sums over pixels in an order of its own
    # choosing, and that order differed between the code numba compiles in memory and the code
    # it loads from its cache, so the same input gave centroids ~3e-8 apart depending on the
    # cache's history: float16 input compiled in an earlier process (``mars demo``) no longer
    # matched float32 input compiled now. Without it the sums run in source order, the same in
    # every build, for ~3% more CPU time in select_centroids (measured single-threaded, D = 64,
    # 96 images of 40 x 40). "contract" (fused multiply-add) was checked to give the same bits
    # cached and fresh. No-NaN/no-Inf flags stay off because an invalid centroid is kept out
    # of the assignment by an infinite bias.
    _FM = {"contract", "nsz"}

    @intrinsic
    def _half_bits_to_float32(typingctx, bits):
        """IEEE binary16 bits (uint16) to float32: LLVM's fpext, one F16C instruction on x86.
        Exact (every half value is a float32 value), so reading float16 features here gives
        the same numbers as widening them in torch first, without the copy."""
        if bits != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(types.uint16), codegen

    def _as_float32(v):  # pragma: no cover - replaced by the overload inside compiled code
        raise NotImplementedError

    @overload(_as_float32)
    def _as_float32_impl(v):
        # A uint16 buffer holds float16 bits (numba has no float16 type on the CPU).
        if v == types.uint16:
            return lambda v: _half_bits_to_float32(v)
        if isinstance(v, types.Float):
            return lambda v: np.float32(v)
        return None

    @intrinsic
    def _pointer_to(typingctx, address, like):
        """The int64 ``address`` as a pointer to ``like``'s element type, for ``numba.carray``.

        The kernel reads each image's (D, pixels) block where the caller's array already is,
        instead of copying every image into one buffer first (the copy alone took ~10% of
        select_centroids). Sound only while the arrays live and ``address`` points inside
        one: :func:`kmeans_groups` holds them and checks every index before the call.
        """
        if not isinstance(like, types.Array) or address != types.int64:
            return None
        ptr = types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(types.int64, like), codegen

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _sample(weights, n, u):
        """Inverse-CDF draw as ``kmeans._sample``: the first i with cumsum(w)[i] > u * total
        (float64 running sum), clamped to n - 1; a draw on a zero weight falls back to the last
        positive weight."""
        total = 0.0
        for i in range(n):
            total += np.float64(weights[i])
        target = u * total
        cum = 0.0
        idx = n - 1
        for i in range(n):
            cum += np.float64(weights[i])
            if cum > target:
                idx = i
                break
        if weights[idx] > 0:
            return idx
        for i in range(n - 1, -1, -1):
            if weights[i] > 0:
                return i
        return idx

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _sq_dist_to(xt, n, col, out):
        """out[i] = |x_i - x_col|^2 from the differences (identical points give exactly 0)."""
        D = xt.shape[0]
        for i in range(n):
            out[i] = 0.0
        d = 0
        while d + 4 <= D:  # four dimensions per pass over ``out``, as _project
            r0, r1, r2, r3 = xt[d], xt[d + 1], xt[d + 2], xt[d + 3]
            c0, c1, c2, c3 = r0[col], r1[col], r2[col], r3[col]
            for i in range(n):
                e0 = r0[i] - c0
                e1 = r1[i] - c1
                e2 = r2[i] - c2
                e3 = r3[i] - c3
                out[i] += e0 * e0 + e1 * e1 + e2 * e2 + e3 * e3
            d += 4
        while d < D:
            row = xt[d]
            c = row[col]
            for i in range(n):
                diff = row[i] - c
                out[i] += diff * diff
            d += 1

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _seed(xt, n, k, u, trials, centers, valid, closest, cand_d, best_d):
        """Greedy k-means++ (``kmeans._kmeanspp``) of one problem, into centers (k, D) / valid (k,)."""
        D = xt.shape[0]
        for i in range(n):  # the first draw has unit weights
            closest[i] = 1.0
        first = _sample(closest, n, u[0, 0])
        for d in range(D):
            centers[0, d] = xt[d, first]
        valid[0] = True
        _sq_dist_to(xt, n, first, closest)
        for j in range(1, k):
            total = 0.0
            for i in range(n):
                total += closest[i]
            if not total > 0:
                break  # every remaining point coincides with a chosen centroid
            best_pot = np.inf
            best = -1
            for t in range(trials):
                c = _sample(closest, n, u[j, t])
                _sq_dist_to(xt, n, c, cand_d)
                pot = np.float32(0.0)
                for i in range(n):
                    pot += min(closest[i], cand_d[i])
                if pot < best_pot:  # strict: the first candidate wins ties, as argmin
                    best_pot = pot
                    best = c
                    for i in range(n):
                        best_d[i] = cand_d[i]
            for d in range(D):
                centers[j, d] = xt[d, best]
            valid[j] = True
            for i in range(n):
                closest[i] = min(closest[i], best_d[i])

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _project(xt, n, w, out):
        """out[i] = x_i . w for the (D, n) block, four dimensions per pass over ``out``."""
        D = xt.shape[0]
        for i in range(n):
            out[i] = 0.0
        d = 0
        while d + 4 <= D:
            r0, r1, r2, r3 = xt[d], xt[d + 1], xt[d + 2], xt[d + 3]
            w0, w1, w2, w3 = w[d], w[d + 1], w[d + 2], w[d + 3]
            for i in range(n):
                out[i] += r0[i] * w0 + r1[i] * w1 + r2[i] * w2 + r3[i] * w3
            d += 4
        while d < D:
            row = xt[d]
            wd = w[d]
            for i in range(n):
                out[i] += row[i] * wd
            d += 1

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _lloyd(xt, n, k, centers, valid, max_iter, tol, labels, prev, score, member, sums, counts, new_c):
        """Lloyd iterations of one problem in place on centers (k, D); returns the iterations run.

        Stopping rule of ``kmeans._kmeans_padded``: the total squared centroid shift is at most
        ``tol * mean per-dimension variance``, or no label changed (from the second step on).
        Cluster sums are float32 reductions over all points, as the torch path's matrix
        products, while many points move; once fewer than n / 8 move in a step, the float64
        sums are updated by the moved points only (the same sums, to rounding).
        """
        D = xt.shape[0]
        # scikit-learn's tolerance scale: mean over dimensions of the points' variance. The
        # per-dimension totals also give cluster 0's sum when K = 2 (total minus cluster 1).
        total = np.empty(D, dtype=np.float32)
        var = 0.0
        for d in range(D):
            row = xt[d]
            s = np.float32(0.0)
            s2 = np.float32(0.0)
            for i in range(n):
                s += row[i]
                s2 += row[i] * row[i]
            total[d] = s
            m = np.float64(s) / n
            var += np.float64(s2) / n - m * m
        tol_b = tol * max(var / D, 0.0)
        w = np.empty(D, dtype=np.float32)
        c2 = np.empty(k, dtype=np.float32)
        it = 0
        for it in range(1, max_iter + 1):
            # Assignment: argmin_c |c|^2 - 2 x.c (the |x|^2 term is common), first c on ties.
            # K = 2 uses the sign of one product, as the torch two-centroid loop does.
            for c in range(k):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += centers[c, d] * centers[c, d]
                c2[c] = acc if valid[c] else np.float32(np.inf)
            if k == 2:
                bias = c2[1] - c2[0] if valid[1] else np.float32(np.inf)
                for d in range(D):
                    w[d] = centers[1, d] - centers[0, d]
                sc = score[0]
                _project(xt, n, w, sc)
                for i in range(n):
                    labels[i] = 1 if bias - np.float32(2.0) * sc[i] < 0 else 0
            else:
                for c in range(k):
                    if valid[c]:
                        for d in range(D):
                            w[d] = centers[c, d]
                        _project(xt, n, w, score[c])
                for i in range(n):
                    lab = 0
                    low = np.float32(np.inf)
                    for c in range(k):
                        v = c2[c] - np.float32(2.0) * score[c, i]
                        if v < low:
                            low = v
                            lab = c
                    labels[i] = lab
            moved = n
            if it > 1:
                moved = 0
                for i in range(n):
                    moved += labels[i] != prev[i]
            if moved * 8 > n:
                # Update from scratch: masked reductions over all points (a scatter-add by
                # label would serialise on the accumulators).
                for c in range(k):
                    counts[c] = 0
                for i in range(n):
                    counts[labels[i]] += 1
                for c in range(1 if k == 2 else 0, k):
                    mc = member[c]
                    for i in range(n):
                        mc[i] = 1.0 if labels[i] == c else 0.0
                    for d in range(D):
                        row = xt[d]
                        acc = np.float32(0.0)
                        for i in range(n):
                            acc += row[i] * mc[i]
                        sums[c, d] = acc
            else:  # few points moved: move their coordinates between the sums
                for i in range(n):
                    a, b = prev[i], labels[i]
                    if a != b:
                        counts[a] -= 1
                        counts[b] += 1
                        for d in range(D):
                            v = np.float64(xt[d, i])
                            sums[a, d] -= v
                            sums[b, d] += v
            if k == 2:
                for d in range(D):
                    sums[0, d] = np.float64(total[d]) - sums[1, d]
            # New centres; an emptied cluster keeps its previous centre.
            shift = 0.0
            for c in range(k):
                for d in range(D):
                    v = centers[c, d]
                    if counts[c] > 0:
                        v = np.float32(sums[c, d] / counts[c])
                    new_c[c, d] = v
                    diff = np.float64(v) - np.float64(centers[c, d])
                    shift += diff * diff
            for c in range(k):
                for d in range(D):
                    centers[c, d] = new_c[c, d]
            for i in range(n):
                prev[i] = labels[i]
            if shift <= tol_b or moved == 0:
                break
        return it

    @njit(cache=_CACHE, fastmath=_FM, error_model="numpy")
    def _widen(image, stride, cols, xt):
        """Gather the columns ``cols`` of a (D, stride) block read as ``image`` into the float32
        (D, n) block ``xt``. Each row is gathered in its own dtype, then widened in a second,
        vectorised loop: widening float16 inside the gather doubled its cost. No arithmetic
        happens here (widening is exact), so both dtypes give the same ``xt``, bit for bit."""
        D, n = xt.shape
        raw = np.empty(n, dtype=image.dtype)
        for d in range(D):
            src = image[d * stride : (d + 1) * stride]
            for i in range(n):
                raw[i] = src[cols[i]]
            dst = xt[d]
            for i in range(n):
                dst[i] = _as_float32(raw[i])

    # nogil: other Python threads of the caller (e.g. one reading the next images) run meanwhile.
    # One specialisation for float16 and float32 images (``half`` picks the reader at run
    # time): two would be optimised separately, and under fastmath their float sums could
    # round differently, so float16 input would not give float32's result bit for bit.
    @njit(cache=_CACHE, parallel=True, nogil=True, fastmath=_FM, error_model="numpy")
    def _kmeans_groups(addresses, strides, half, like16, like32, D, normalize, order, starts, sizes, ks, u, trials,
                       max_iter, tol, out_c, out_valid, out_iter, out_bad):
        G = sizes.shape[0]
        kmax = out_c.shape[1]
        for g in prange(G):
            n = sizes[g]
            k = ks[g]
            # The group's points as a (D, n) block that stays in this core's cache for the
            # seeding and every Lloyd step, gathered once from its image's (D, strides[g])
            # block at addresses[g], in the image's own dtype.
            cols = order[starts[g] : starts[g] + n]
            xt = np.empty((D, n), dtype=np.float32)
            if half:
                _widen(numba.carray(_pointer_to(addresses[g], like16), (D * strides[g],)), strides[g], cols, xt)
            else:
                _widen(numba.carray(_pointer_to(addresses[g], like32), (D * strides[g],)), strides[g], cols, xt)
            sq = np.zeros(n, dtype=np.float32)
            for d in range(D):
                row = xt[d]
                for i in range(n):
                    sq[i] += row[i] * row[i]
            # A non-finite squared norm means a NaN/Inf value (flag the group, the caller names
            # the image) or finite values whose squares overflow float32 (beyond ~1.8e19):
            # those pixels are normalised through their largest magnitude m, x / m / |x / m|,
            # so that no intermediate leaves float32 (else they would become zero vectors).
            bad = False
            for i in range(n):
                if not np.isfinite(sq[i]):
                    m = np.float32(0.0)
                    finite = True
                    for d in range(D):
                        v = xt[d, i]
                        if not np.isfinite(v):
                            finite = False
                        m = max(m, abs(v))
                    if not finite:
                        bad = True
                    elif normalize:
                        s = np.float32(0.0)
                        for d in range(D):
                            r = xt[d, i] / m
                            xt[d, i] = r
                            s += r * r
                        r = np.sqrt(s)
                        for d in range(D):
                            xt[d, i] = xt[d, i] / r
                        sq[i] = 1.0  # already unit: the division below leaves it
            out_bad[g] = bad
            if normalize:  # F.normalize's rule, x / max(|x|, 1e-12)
                for i in range(n):
                    sq[i] = max(np.sqrt(sq[i]), np.float32(1e-12))
                for d in range(D):
                    row = xt[d]
                    for i in range(n):
                        row[i] = row[i] / sq[i]
            closest = np.empty(n, dtype=np.float32)
            cand_d = np.empty(n, dtype=np.float32)
            best_d = np.empty(n, dtype=np.float32)
            centers = np.zeros((kmax, D), dtype=np.float32)
            valid = np.zeros(kmax, dtype=np.bool_)
            _seed(xt, n, k, u[g], trials[g], centers, valid, closest, cand_d, best_d)
            labels = np.empty(n, dtype=np.int64)
            prev = np.empty(n, dtype=np.int64)
            score = np.empty((kmax, n), dtype=np.float32)
            member = np.zeros((kmax, n), dtype=np.float32)
            sums = np.zeros((kmax, D), dtype=np.float64)
            counts = np.empty(kmax, dtype=np.int64)
            new_c = np.empty((kmax, D), dtype=np.float32)
            out_iter[g] = _lloyd(xt, n, k, centers, valid, max_iter, tol, labels, prev, score, member, sums,
                                 counts, new_c)
            for c in range(kmax):
                out_valid[g, c] = valid[c]
                for d in range(D):
                    out_c[g, c, d] = centers[c, d] if valid[c] else 0.0

    @njit(cache=_CACHE, nogil=True)
    def _columns_inside(order, starts, sizes, widths):
        for g in range(sizes.shape[0]):
            for j in range(starts[g], starts[g] + sizes[g]):
                if order[j] < 0 or order[j] >= widths[g]:
                    return False
        return True

    @njit(cache=_CACHE, nogil=True)
    def _nonfinite_in(image, stride, D, col):
        for d in range(D):
            if not np.isfinite(_as_float32(image[d * stride + col])):
                return True
        return False

    @njit(cache=_CACHE, nogil=True)
    def _nonfinite_pixels(addresses, strides, half, like16, like32, D, cols, out):
        for j in range(cols.shape[0]):
            if half:
                out[j] = _nonfinite_in(numba.carray(_pointer_to(addresses[j], like16), (D * strides[j],)),
                                       strides[j], D, cols[j])
            else:
                out[j] = _nonfinite_in(numba.carray(_pointer_to(addresses[j], like32), (D * strides[j],)),
                                       strides[j], D, cols[j])

    @njit(cache=_CACHE, nogil=True)
    def _label_range(y, offs, ignore_index, lo, hi):
        for b in range(offs.shape[0] - 1):
            low, high = 0, 0
            for p in range(offs[b], offs[b + 1]):
                v = y[p]
                if v != ignore_index:
                    low = min(low, v)
                    high = max(high, v)
            lo[b] = low
            hi[b] = high

    @njit(cache=_CACHE, nogil=True)
    def _group_pixels(y, offs, ignore_index, counts, order, ignored):
        B = offs.shape[0] - 1
        n_labels = counts.shape[1]
        n_ignored = 0
        for b in range(B):
            for p in range(offs[b], offs[b + 1]):
                v = y[p]
                if v == ignore_index:
                    n_ignored += 1
                elif v < 0 or v >= n_labels:
                    return -1 - p  # an id outside the counts: the caller raises
                else:
                    counts[b, v] += 1
        # Groups in (image, class) order; a counting sort keeps each group's pixels in
        # row-major order (what a stable sort of the key, or a boolean mask, gives).
        pos = np.empty((B, n_labels), dtype=np.int64)
        start = 0
        for b in range(B):
            for c in range(n_labels):
                pos[b, c] = start
                start += counts[b, c]
        k = 0
        for b in range(B):
            for p in range(offs[b], offs[b + 1]):
                v = y[p]
                if v == ignore_index:
                    ignored[k] = p
                    k += 1
                else:
                    order[pos[b, v]] = p - offs[b]
                    pos[b, v] += 1
        return n_ignored


def label_range(labels: np.ndarray, offsets: np.ndarray, ignore_index: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per image, min and max over its class ids and 0 (ignored pixels skipped): negative ids and
    ids above C show in them, as in the torch path's check of the full-size labels.

    Shapes:
        labels: (P,) integer labels of B images, one after the other.
        offsets: (B + 1,) int64; image b is ``labels[offsets[b] : offsets[b + 1]]``.

    Returns:
        ``(lo (B,), hi (B,))`` int64.
    """
    offsets = _check_offsets(labels, offsets)
    B = int(offsets.shape[0]) - 1
    lo, hi = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
    _label_range(labels, offsets, int(ignore_index), lo, hi)
    return lo, hi


def _check_offsets(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if not isinstance(labels, np.ndarray) or labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be a (P,) integer array, got {getattr(labels, 'dtype', type(labels).__name__)} "
                         f"{getattr(labels, 'shape', '')}")
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != labels.shape[0] \
            or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must rise from 0 to len(labels)={labels.shape[0]}, got {offsets.tolist()[:8]}"
                         f"{'...' if offsets.size > 8 else ''}")
    return offsets


def group_pixels(labels: np.ndarray, offsets: np.ndarray, ignore_index: int, num_labels: int):
    """The (image, class) groups of B images' labels: a counting sort of their pixels.

    Shapes:
        labels: (P,) integer labels, each in 0..num_labels - 1 or ``ignore_index`` (another
            value raises).
        offsets: (B + 1,) int64; image b is ``labels[offsets[b] : offsets[b + 1]]``.

    Returns:
        ``(counts (B, num_labels) int64, order (P',) int64, ignored (P - P',) int64)``: pixel
        counts per (image, class); the non-ignored pixels grouped by (image, class) in that
        order, each as its index within its own image, row-major inside a group; the ignored
        pixels as indices into ``labels``, in increasing order.
    """
    offsets = _check_offsets(labels, offsets)
    B, P = int(offsets.shape[0]) - 1, int(labels.shape[0])
    counts = np.zeros((B, int(num_labels)), dtype=np.int64)
    order = np.empty(P, dtype=np.int64)
    ignored = np.empty(P, dtype=np.int64)
    n_ignored = _group_pixels(labels, offsets, int(ignore_index), counts, order, ignored)
    if n_ignored < 0:
        p = -1 - n_ignored
        raise ValueError(f"labels[{p}] is {labels[p]}: expected 0..{num_labels - 1} or ignore_index={ignore_index}")
    return counts, order[: P - n_ignored], ignored[:n_ignored]


class _threads:
    """Run a block with numba's thread count set to ``n`` (None: leave it), then restore it."""

    def __init__(self, n: Optional[int]) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.previous = numba.get_num_threads()
        if self.n is not None:
            numba.set_num_threads(max(1, min(int(self.n), numba.config.NUMBA_NUM_THREADS)))
        # Groups differ in size by 10x or more: hand them out one at a time, not in equal
        # contiguous blocks per thread.
        self.chunk = numba.set_parallel_chunksize(1)

    def __exit__(self, *exc) -> None:
        numba.set_parallel_chunksize(self.chunk)
        numba.set_num_threads(self.previous)


def _image_blocks(images) -> Tuple[list, np.ndarray, np.ndarray, np.ndarray, int]:
    """Checked (D, P_b) C-contiguous blocks of one dtype, their addresses, pixel counts,
    whether they are float16 (read as their uint16 bits) and D."""
    blocks = [images] if isinstance(images, np.ndarray) else list(images)
    if not blocks:
        raise ValueError("images must hold at least one (D, P) array, got none")
    for b, a in enumerate(blocks):
        if not isinstance(a, np.ndarray) or a.dtype not in (np.float32, np.float16) or a.ndim != 2:
            raise ValueError(f"images[{b}] must be a (D, P) float32 or float16 array, got "
                             f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
        if a.dtype != blocks[0].dtype or a.shape[0] != blocks[0].shape[0]:
            raise ValueError(f"images[{b}] is {a.dtype} (D={a.shape[0]}), but images[0] is {blocks[0].dtype} "
                             f"(D={blocks[0].shape[0]}): every image must share the dtype and D")
    blocks = [np.ascontiguousarray(a) for a in blocks]
    addresses = np.array([a.ctypes.data for a in blocks], dtype=np.int64)
    pixels = np.array([a.shape[1] for a in blocks], dtype=np.int64)
    half = bool(blocks[0].dtype == np.float16)
    return blocks, addresses, pixels, half, int(blocks[0].shape[0])


# Typing stand-ins of the two image element types (float16 read as its uint16 bits): both are
# passed to every call, so that float16 and float32 images run the same compiled code.
_LIKE16, _LIKE32 = np.empty(0, dtype=np.uint16), np.empty(0, dtype=np.float32)


def _image_index(image, count: int, n: int, name: str) -> np.ndarray:
    image = np.zeros(count, dtype=np.int64) if image is None else np.asarray(image, dtype=np.int64)
    if image.shape != (count,):
        raise ValueError(f"{name} must have shape ({count},), got {image.shape}")
    if count and (image.min() < 0 or image.max() >= n):
        raise ValueError(f"{name} must index the {n} images, got values in [{image.min()}, {image.max()}]")
    return image


def kmeans_groups(
    images,
    order: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    ks: np.ndarray,
    uniforms: np.ndarray,
    trials: np.ndarray,
    *,
    normalize: bool,
    max_iter: int,
    tol: float,
    image: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """K-means of G groups of pixels, one group per thread at a time.

    Shapes:
        images: one (D, P) array, or a sequence of (D, P_b) arrays (one per image), float32 or
            float16, all of one dtype; one column per pixel. They are read where they are (a
            non-contiguous one is copied first); float16 is widened exactly as each pixel is
            gathered, which gives the same result as float32 input holding the same values.
        order: (M,) int64 column indices; group g is
            ``images[image[g]][:, order[starts[g] : starts[g] + sizes[g]]]``.
        starts, sizes, ks, trials: (G,) int64; sizes >= 1, ks >= 1.
        uniforms: (G, Kmax, Tmax) float64 k-means++ draws of each problem (see ``kmeans._uniforms``).
        image: (G,) int64 image of each group (default: all 0).

    Args:
        normalize: divide each gathered pixel by max(its L2 norm, 1e-12) first.
        max_iter, tol: Lloyd controls, as :func:`mars_plugin.engines.kmeans.batched_kmeans`.
        num_threads: threads for this call (default: numba's current setting).

    Returns:
        ``(centroids (G, Kmax, D) float32, valid (G, Kmax) bool, n_iter (G,) int64,
        non_finite (G,) bool)``; invalid centroid rows are zeros, and ``non_finite`` flags the
        groups holding a NaN or Inf value (their centroids are meaningless).
    """
    if not available():
        raise RuntimeError("kmeans_groups needs numba: pip install 'mars-plugin[fast]'")
    blocks, addresses, pixels, half, dim = _image_blocks(images)
    order, starts, sizes = (np.asarray(a, dtype=np.int64) for a in (order, starts, sizes))
    G = int(sizes.shape[0])
    image = _image_index(image, G, len(blocks), "image")
    # The kernel reads raw memory: every column it will touch must lie inside its image.
    if G and (starts.min() < 0 or sizes.min() < 1 or (starts + sizes).max() > order.shape[0]):
        raise ValueError(f"starts and sizes must describe slices of order (length {order.shape[0]}) of at least "
                         "one pixel each")
    if G and not _columns_inside(order, starts, sizes, pixels[image]):
        raise ValueError("order holds a column outside its group's image")
    ks, trials = np.asarray(ks, dtype=np.int64), np.asarray(trials, dtype=np.int64)
    uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
    if ks.shape != (G,) or trials.shape != (G,) or uniforms.ndim != 3 or uniforms.shape[0] != G:
        raise ValueError(f"ks and trials must have shape ({G},) and uniforms ({G}, Kmax, Tmax), got {ks.shape}, "
                         f"{trials.shape} and {uniforms.shape}")
    if G and (ks.min() < 1 or ks.max() > uniforms.shape[1] or trials.min() < 1 or trials.max() > uniforms.shape[2]):
        raise ValueError(f"ks must be in 1..{uniforms.shape[1]} and trials in 1..{uniforms.shape[2]} (the uniforms' "
                         f"shape), got ks in [{ks.min()}, {ks.max()}] and trials in [{trials.min()}, {trials.max()}]")
    kmax = int(uniforms.shape[1]) if G else 1
    out_c = np.zeros((G, kmax, dim), dtype=np.float32)
    out_valid = np.zeros((G, kmax), dtype=np.bool_)
    out_iter = np.zeros(G, dtype=np.int64)
    out_bad = np.zeros(G, dtype=np.bool_)
    if G == 0:
        return out_c, out_valid, out_iter, out_bad
    with _threads(num_threads):
        _kmeans_groups(addresses[image], pixels[image], half, _LIKE16, _LIKE32, dim, bool(normalize), order, starts, sizes, ks, uniforms,
                       trials, int(max_iter), float(tol), out_c, out_valid, out_iter, out_bad)
    del blocks  # held until here: the kernel read them through their addresses
    return out_c, out_valid, out_iter, out_bad


def nonfinite_pixels(images, image: np.ndarray, pixel: np.ndarray) -> np.ndarray:
    """Which of the listed pixels hold a NaN or Inf value in any dimension.

    Shapes:
        images: as in :func:`kmeans_groups`.
        image, pixel: (M,) int64; pixel j is column ``pixel[j]`` of ``images[image[j]]``.

    Returns:
        (M,) bool.
    """
    blocks, addresses, pixels, half, dim = _image_blocks(images)
    pixel = np.asarray(pixel, dtype=np.int64)
    image = _image_index(image, int(pixel.shape[0]), len(blocks), "image")
    if pixel.size and (pixel.min() < 0 or (pixel >= pixels[image]).any()):
        raise ValueError("pixel holds a column outside its image")
    out = np.zeros(pixel.shape[0], dtype=np.bool_)
    _nonfinite_pixels(addresses[image], pixels[image], half, _LIKE16, _LIKE32, dim, pixel, out)
    del blocks
    return out
