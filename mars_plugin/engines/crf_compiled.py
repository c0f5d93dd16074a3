"""The dense CRF's CPU path compiled with numba: one image's lattice and mean field without a
barrier per operation, the images of a batch in parallel threads.

The torch path (:mod:`mars_plugin.engines.permutohedral`, :func:`mars_plugin.engines.crf_mean_field._mean_field_chunk`)
runs hundreds of small tensor operations per mean-field iteration; on the CPU each one is a
parallel region of torch's OpenMP threads, so each ends in a barrier, and on a machine whose
cores are shared with other processes every barrier waits for a time slice (5-9x slower under
load, measured). Here the lattice of one image (or of a run of small images) is built and its
mean field solved by compiled calls that touch no thread pool (one per mean-field iteration:
a Ctrl-C is checked between them, :func:`mars_plugin._interrupt.check`); the images of a batch run
in ``threads`` Python threads (the calls release the GIL), each image start to finish in one
thread, with one wait at the end. When there are fewer images than threads (one image), the
threads share each iteration instead: the two kernels' filters as separate tasks (their labels
in blocks with four threads or more), then the pixels of the softmax: two waits per iteration.

It computes what the torch path computes, with the same float32 operations where they decide
something: the lifting onto the lattice and the simplex of each point (the operations and
their order of :func:`mars_plugin.engines.permutohedral_lift._elevate` and ``_simplex``, no fused
multiply-add), hence the same lattice points and barycentric weights as pydensecrf; the blur's
``old + 0.5 (n1 + n2)`` per axis in the same axis order; splatting in point order. The lattice
points are found with a hash table in the order pixels first touch them (as pydensecrf's
``HashTable``), not by sorting: the numbering differs from the torch path's, the filtered
values do not (the splat and slice sums may round differently in the last bit, as MKL's and
the C++'s do). Vertex keys are packed into one int64 code (the image, then q' in mixed radix,
as the torch path packs them), so that the table compares one integer, and a neighbour's code
is the point's plus a constant; where the codes would not fit, the keys are compared as rows.

numba is optional (the ``fast`` extra); :func:`available` says whether this path can be used
(``MARS_NO_NUMBA=1`` turns it off, as for the compiled K-means).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

import mars_plugin._interrupt as _interrupt
from mars_plugin.engines import kmeans_compiled
from mars_plugin.engines.kmeans_compiled import available
from mars_plugin.engines.permutohedral import LatticeTooLarge

__all__ = ["available", "CompiledLattice", "mean_field"]

numba = kmeans_compiled.numba

# pydensecrf's SSE code lifts points in blocks of four and pads the last block with zero
# feature vectors, whose vertices join the lattice (see PermutohedralLattice's simd_padding).
_SIMD_BLOCK = 4
# Vertex keys are packed into one int64 code while their range stays below this; past it (very
# fine kernels on large images) they are compared as rows of int32, with the same lattice.
_MAX_CODE = 1 << 62


def _f32(x: float) -> np.float32:
    return np.float32(x)


if numba is not None:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    _CACHE = kmeans_compiled._CACHE
    # The filter and the softmax: "contract" (fused multiply-add) and "nsz" only, as the
    # compiled K-means (no reassociation: sums run in source order in every build). The
    # lifting uses no fast-math flag at all: a fused multiply-add there would move points
    # that lie on a simplex boundary.
    _FM = {"contract", "nsz"}

    @intrinsic
    def _float32_from_bits(typingctx, bits):
        """The float32 whose IEEE bits are the int32 ``bits`` (one register move)."""
        if bits != types.int32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.int32), codegen

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, inline="always")
    def _exp_nonpositive(x):
        """exp(x) for float32 x <= 0 (-inf included) within about 1 ulp, 0 below -87.3 (where
        float32 turns subnormal): Cephes' expf, written so that LLVM vectorises the softmax's
        loop over labels (libm's expf is one call per value: the softmax took 14 ms of the 67
        of a 21-label iteration)."""
        if x < np.float32(-87.33654):
            return np.float32(0.0)
        n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        r = x - n * np.float32(0.693359375)
        r = r - n * np.float32(-2.12194440e-4)
        z = r * r
        y = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        y = y * r + np.float32(8.3334519073e-3)
        y = y * r + np.float32(4.1665795894e-2)
        y = y * r + np.float32(1.6666665459e-1)
        y = y * r + np.float32(5.0000001201e-1)
        y = y * z + r + np.float32(1.0)
        return y * _float32_from_bits(np.int32((np.int32(n) + 127) << 23))

    @njit(cache=_CACHE, nogil=True)
    def _hash_slot(key, cap_mask):
        h = np.uint64(0)
        for i in range(key.shape[0]):
            h = (h + np.uint64(np.int64(key[i]) & 0xFFFFFFFF)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(31)
        return np.int64(h & np.uint64(cap_mask))

    @njit(cache=_CACHE, nogil=True)
    def _same_key(keys, p, key):
        """Whether row ``p`` of ``keys`` equals ``key`` (the probe of _insert and _find)."""
        for i in range(key.shape[0]):
            if keys[p, i] != key[i]:
                return False
        return True

    @njit(cache=_CACHE, nogil=True)
    def _insert(key, keys, slots, cap_mask, count):
        """The index of ``key`` in ``keys[:count]``, added as point ``count`` if new; returns
        (index, new count)."""
        kd = key.shape[0]
        s = _hash_slot(key, cap_mask)
        while True:
            p = slots[s]
            if p < 0:
                slots[s] = count
                for i in range(kd):
                    keys[count, i] = key[i]
                return count, count + 1
            if _same_key(keys, p, key):
                return p, count
            s = (s + 1) & cap_mask

    @njit(cache=_CACHE, nogil=True)
    def _grown(keys, count, cap):
        """A table of ``cap`` slots holding keys[:count] (the table is kept at most half full)."""
        slots = np.full(cap, -1, np.int32)
        for p in range(count):
            s = _hash_slot(keys[p], cap - 1)
            while slots[s] >= 0:
                s = (s + 1) & (cap - 1)
            slots[s] = p
        return slots

    @njit(cache=_CACHE, nogil=True)
    def _find(key, keys, slots, cap_mask, missing):
        s = _hash_slot(key, cap_mask)
        while True:
            p = slots[s]
            if p < 0:
                return missing
            if _same_key(keys, p, key):
                return p
            s = (s + 1) & cap_mask

    @njit(cache=_CACHE, nogil=True)
    def _lift_one(f, scale, d, cf, el, diff, rank, rem0, by_rank, bary):
        """One point f (d,) -> its simplex: rem0 (d+1,) int64 (the nearest 0-coloured point,
        wrapped), rank (d+1,) int64 and bary (d+1,) float32, with the float32 operations of
        permutohedral_lift._elevate and _simplex in their order."""
        d1 = d + 1
        down = scale[d]  # the caller's float32(1 / (d+1)), as the torch path rounds it
        for i in range(d):
            cf[i] = f[i] * scale[i]
        running = np.float32(0.0)
        for j in range(d, 0, -1):
            el[j] = running - np.float32(j) * cf[j - 1]
            running = running + cf[j - 1]
        el[0] = running
        shift = 0
        for i in range(d1):
            v = np.rint(el[i] * down)
            r0 = v * np.float32(d1)
            shift += np.int64(v)
            diff[i] = el[i] - r0
            rem0[i] = np.int64(r0)
            rank[i] = 0
        for i in range(d1):
            for j in range(i + 1, d1):
                if diff[i] < diff[j]:
                    rank[i] += 1
                else:
                    rank[j] += 1
        for i in range(d1):
            r = rank[i] + shift
            if r < 0:
                r += d1
                rem0[i] += d1
            elif r > d:
                r -= d1
                rem0[i] -= d1
            rank[i] = r
        for i in range(d1):
            by_rank[d - rank[i]] = (el[i] - np.float32(rem0[i])) * down
        for i in range(1, d1):
            bary[i] = by_rank[i] - by_rank[i - 1]
        bary[0] = by_rank[0] + (np.float32(1.0) - by_rank[d])

    @njit(cache=_CACHE, nogil=True)
    def _build_points_rows(features, starts, pad, scale, keys, slots, vert, bary_out):
        """The fallback where packed codes would not fit in int64. Lift every point of the
        images [starts[b], starts[b+1]) and insert its d+1 vertices
        (C++ key: rem0[i] + r - (d+1) [rank[i] > d - r], i < d, after the image index when
        there are several images), pixel by pixel, then one zero point for each image b with
        pad[b]. Fills vert (N, d+1), bary_out (N, d+1); returns the number of lattice points,
        the hash table and the keys (grown from ``slots`` and ``keys`` as needed)."""
        N, d = features.shape
        d1 = d + 1
        B = starts.shape[0] - 1
        lead = 1 if B > 1 else 0
        kd = lead + d
        cf = np.empty(d, np.float32)
        el = np.empty(d1, np.float32)
        diff = np.empty(d1, np.float32)
        by_rank = np.empty(d1, np.float32)
        bary = np.empty(d1, np.float32)
        rank = np.empty(d1, np.int64)
        rem0 = np.empty(d1, np.int64)
        last_rank = np.full(d1, -1, np.int64)
        last_rem0 = np.zeros(d1, np.int64)
        key = np.empty(kd, np.int32)
        zero = np.zeros(d, np.float32)
        count = 0
        for b in range(B + B):
            image = b if b < B else b - B
            if b >= B and not pad[image]:
                continue
            if lead:
                key[0] = image
            first, last = (starts[image], starts[image + 1]) if b < B else (0, 1)
            last_rank[0] = -1  # no reuse across images
            for n in range(first, last):
                _lift_one(features[n] if b < B else zero, scale, d, cf, el, diff, rank, rem0, by_rank, bary)
                if b < B:
                    for r in range(d1):
                        bary_out[n, r] = bary[r]
                    # Neighbouring pixels often share their simplex: then they share its
                    # vertices, and the table is not asked again.
                    same = n > first
                    for i in range(d1):
                        if rank[i] != last_rank[i] or rem0[i] != last_rem0[i]:
                            same = False
                            break
                    if same:
                        for r in range(d1):
                            vert[n, r] = vert[n - 1, r]
                        continue
                    for i in range(d1):
                        last_rank[i] = rank[i]
                        last_rem0[i] = rem0[i]
                for r in range(d1):
                    for i in range(d):
                        key[lead + i] = rem0[i] + r - (d1 if rank[i] > d - r else 0)
                    p, count = _insert(key, keys, slots, slots.shape[0] - 1, count)
                    if b < B:
                        vert[n, r] = p
                if count + d1 > keys.shape[0]:  # room for the next point's vertices
                    more = np.empty((2 * keys.shape[0], kd), np.int32)
                    more[:count] = keys[:count]
                    keys = more
                if 2 * (count + d1) > slots.shape[0]:
                    slots = _grown(keys, count, 2 * slots.shape[0])
        return count, slots, keys

    @njit(cache=_CACHE, nogil=True)
    def _build_neighbours_rows(keys, M, lead, slots, n1, n2):
        """Blur neighbours along each axis j (C++: n1 = key - 1, key[j] + d; n2 = key + 1,
        key[j] - d; the last axis has no stored coordinate), M where there is none. n2 is the
        inverse of n1."""
        d = keys.shape[1] - lead
        cap_mask = slots.shape[0] - 1
        key = np.empty(keys.shape[1], np.int32)
        for j in range(d + 1):
            for m in range(M + 1):
                n1[j, m] = M
                n2[j, m] = M
            for m in range(M):
                for i in range(lead):
                    key[i] = keys[m, i]
                for i in range(d):
                    key[lead + i] = keys[m, lead + i] - 1
                if j < d:
                    key[lead + j] += d + 1
                a = _find(key, keys, slots, cap_mask, M)
                n1[j, m] = a
                if a != M:
                    n2[j, a] = m

    @njit(cache=_CACHE, nogil=True)
    def _lift_points(features, starts, pad, scale, q, rank_out, bary_out):
        """Pass 1: every point's simplex. Points 0..N-1 are the pixels, then one zero point per
        image b with pad[b]. q (N+P, d) int32: the nearest 0-coloured point divided by d+1;
        rank_out (N+P, d+1) int8; bary_out (N, d+1) float32."""
        N, d = features.shape
        d1 = d + 1
        cf = np.empty(d, np.float32)
        el = np.empty(d1, np.float32)
        diff = np.empty(d1, np.float32)
        by_rank = np.empty(d1, np.float32)
        bary = np.empty(d1, np.float32)
        rank = np.empty(d1, np.int64)
        rem0 = np.empty(d1, np.int64)
        zero = np.zeros(d, np.float32)
        row = N
        for n in range(N + pad.shape[0]):
            if n >= N:
                if not pad[n - N]:
                    continue
                _lift_one(zero, scale, d, cf, el, diff, rank, rem0, by_rank, bary)
                out = row
                row += 1
            else:
                _lift_one(features[n], scale, d, cf, el, diff, rank, rem0, by_rank, bary)
                out = n
                for r in range(d1):
                    bary_out[n, r] = bary[r]
            for i in range(d):
                q[out, i] = rem0[i] // d1
            for i in range(d1):
                rank_out[out, i] = rank[i]

    @njit(cache=_CACHE, nogil=True)
    def _code_slot(code, shift):
        return np.int64((np.uint64(code) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(shift))

    @njit(cache=_CACHE, nogil=True)
    def _codes_grown(codes, count, bits):
        """A table of 2^bits slots holding codes[:count]."""
        slots = np.full(1 << bits, -1, np.int32)
        shift = 64 - bits
        mask = (1 << bits) - 1
        for p in range(count):
            s = _code_slot(codes[p], shift)
            while slots[s] >= 0:
                s = (s + 1) & mask
            slots[s] = p
        return slots

    @njit(cache=_CACHE, nogil=True)
    def _insert_codes(q, rank, starts, pad_images, lo, strides, vert, codes, bits):
        """Pass 2: the vertices of every point as packed codes, (image, q' - lo) in mixed radix
        times d+1 plus r, where q'[i] = q[i] - [rank[i] > d - r] (the C++ key is
        (d+1) q' + r), inserted pixel by pixel in a hash table of 2^bits slots: vertex r of
        pixel n is lattice point vert[n, r], numbered in the order pixels first touch them;
        then the padding points (row N + k belongs to image pad_images[k]). Returns the number
        of points, their codes, the table and its bits (grown as needed)."""
        Np, d = q.shape
        d1 = d + 1
        N = vert.shape[0]
        slots = np.full(1 << bits, -1, np.int32)
        pos = np.empty(d1, np.int64)
        count = 0
        image = 0
        for n in range(Np):
            if n < N:
                while n >= starts[image + 1]:
                    image += 1
                seg = image
            else:
                seg = pad_images[n - N]
            base = np.int64(seg) * strides[d]
            for i in range(d):
                base += (np.int64(q[n, i]) - lo[i]) * strides[i]
            for i in range(d1):
                pos[rank[n, i]] = i
            shift = 64 - bits
            mask = (1 << bits) - 1
            for r in range(d1):
                # vertex r: q' drops by one where rank > d - r, i.e. at the coordinate ranked
                # d - r + 1 on top of vertex r - 1's (none when that is the unstored last one)
                if r > 0 and pos[d - r + 1] < d:
                    base -= strides[pos[d - r + 1]]
                code = base * d1 + r
                sl = _code_slot(code, shift)
                while True:
                    p = slots[sl]
                    if p < 0:
                        slots[sl] = count
                        codes[count] = code
                        p = count
                        count += 1
                        break
                    if codes[p] == code:
                        break
                    sl = (sl + 1) & mask
                if n < N:
                    vert[n, r] = p
            if 2 * (count + d1) > slots.shape[0]:
                bits += 1
                slots = _codes_grown(codes, count, bits)
            if count + d1 > codes.shape[0]:
                more = np.empty(2 * codes.shape[0], np.int64)
                more[:count] = codes[:count]
                codes = more
        return count, codes, slots, bits

    @njit(cache=_CACHE, nogil=True)
    def _neighbours_codes(codes, M, strides, slots, bits, n1, n2, m0, m1):
        """Pass 3 for lattice points m0..m1-1: the neighbour n1 along axis j of the point (r, q')
        is (r-1, q' + e_j) for r > 0 and (d, q' - 1 + e_j) for r = 0 (C++: key - 1 everywhere,
        key[j] + d; e_d = 0), a constant step of the code (the margins of lo prevent carries);
        n2 is its inverse. n1 and n2 must hold M everywhere first."""
        d1 = n1.shape[0]
        d = d1 - 1
        shift = 64 - bits
        mask = (1 << bits) - 1
        total = np.int64(0)
        for i in range(d):
            total += strides[i]
        for m in range(m0, m1):
            c = codes[m]
            r = c % d1
            base = c // d1
            for j in range(d1):
                b = base + (strides[j] if j < d else 0)
                if r > 0:
                    code = b * d1 + (r - 1)
                else:
                    code = (b - total) * d1 + d
                s = _code_slot(code, shift)
                a = M
                while True:
                    p = slots[s]
                    if p < 0:
                        break
                    if codes[p] == code:
                        a = p
                        break
                    s = (s + 1) & mask
                n1[j, m] = a
                if a != M:
                    n2[j, a] = m

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _filter(vert, sw, lw, n1, n2, x, vbuf, wbuf, out, scale, k0, k1):
        """out[:, k0:k1] += scale * slice(blur(splat(x[:, k0:k1]))): splat with the weights sw
        (N, d+1) onto the vertices vert (N, d+1), blur the d+1 axes in order, slice with the
        weights lw. vbuf, wbuf: scratch of at least (M+1) (k1-k0) floats."""
        N, d1 = vert.shape
        M = n1.shape[1] - 1
        nl = k1 - k0
        v = vbuf[: (M + 1) * nl].reshape((M + 1, nl))
        w = wbuf[: (M + 1) * nl].reshape((M + 1, nl))
        for m in range(M + 1):
            for k in range(nl):
                v[m, k] = 0.0
        for k in range(nl):
            w[M, k] = 0.0  # row M is the missing neighbour: 0 in both arrays
        for n in range(N):  # pixel order: each lattice point sums its vertices in point order
            for r in range(d1):
                c = vert[n, r]
                a = sw[n, r]
                for k in range(nl):
                    v[c, k] += a * x[n, k0 + k]
        half = np.float32(0.5)
        for j in range(d1):
            for m in range(M):
                a = n1[j, m]
                b = n2[j, m]
                for k in range(nl):
                    w[m, k] = v[m, k] + half * (v[a, k] + v[b, k])
            v, w = w, v
        tmp = np.empty(nl, np.float32)
        for n in range(N):
            c = vert[n, 0]
            a = lw[n, 0]
            for k in range(nl):
                tmp[k] = a * v[c, k]
            for r in range(1, d1):
                c = vert[n, r]
                a = lw[n, r]
                for k in range(nl):
                    tmp[k] += a * v[c, k]
            for k in range(nl):
                out[n, k0 + k] += scale * tmp[k]

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _softmax_rows(x, n0, n1):
        """Rows n0..n1-1 of x (N, L) in place: exp(x - max) / sum (pydensecrf's expAndNormalize;
        each row's sum runs over its labels in order). The exponentials in one pass over the
        rows' values as a flat array, which vectorises whole (row by row, a short row's tail
        ran one value at a time: 7 of the 8 ms at 21 labels)."""
        L = x.shape[1]
        for n in range(n0, n1):
            mx = x[n, 0]
            for k in range(1, L):
                if x[n, k] > mx:
                    mx = x[n, k]
            for k in range(L):
                x[n, k] = x[n, k] - mx
        flat = x[n0:n1].reshape((n1 - n0) * L)
        for i in range(flat.shape[0]):
            flat[i] = _exp_nonpositive(flat[i])
        for n in range(n0, n1):
            s = np.float32(0.0)
            for k in range(L):
                s += x[n, k]
            for k in range(L):
                x[n, k] = x[n, k] / s

    @njit(cache=_CACHE, nogil=True, boundscheck=False)
    def _copy_cols(src, dst, k0, k1):
        for n in range(src.shape[0]):
            for k in range(k0, k1):
                dst[n, k] = src[n, k]

    @njit(cache=_CACHE, nogil=True, boundscheck=False)
    def _zero_cols(x, k0, k1):
        for n in range(x.shape[0]):
            for k in range(k0, k1):
                x[n, k] = 0.0

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _add_scaled_rows(e, m, scale, n0, n1):
        """e[n0:n1] += scale * m[n0:n1]: the serial path's last slice step (m holds the slice)."""
        for n in range(n0, n1):
            for k in range(e.shape[1]):
                e[n, k] += scale * m[n, k]

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _solve_start(neg_u, q):
        """The mean field's start: Q = softmax(-U)."""
        N, L = neg_u.shape
        _copy_cols(neg_u, q, 0, L)
        _softmax_rows(q, 0, N)

    @njit(cache=_CACHE, nogil=True, fastmath=_FM, boundscheck=False)
    def _solve_step(neg_u, q, e, gv, gsw, glw, gn1, gn2, cg, bv, bsw, blw, bn1, bn2, cb, vbuf, wbuf):
        """One mean-field iteration of one lattice pair: e = softmax(-U + cg Kg(q) + cb Kb(q))
        (the normalisers are in the weights)."""
        N, L = neg_u.shape
        _copy_cols(neg_u, e, 0, L)
        _filter(gv, gsw, glw, gn1, gn2, q, vbuf, wbuf, e, cg, 0, L)
        _filter(bv, bsw, blw, bn1, bn2, q, vbuf, wbuf, e, cb, 0, L)
        _softmax_rows(e, 0, N)

    @njit(cache=_CACHE, nogil=True)
    def _normalise(k1, bary, alpha, sw, lw):
        """pydensecrf's NORMALIZE_SYMMETRIC folded into the weights: n = 1 / sqrt(K 1 + 1e-20)
        in double; splat weights bary n, slice weights (bary alpha) n."""
        N, d1 = bary.shape
        for i in range(N):
            nrm = np.float32(1.0 / math.sqrt(np.float64(k1[i, 0]) + 1e-20))
            for r in range(d1):
                sw[i, r] = bary[i, r] * nrm
                lw[i, r] = (bary[i, r] * alpha) * nrm


class CompiledLattice:
    """The normalised permutohedral lattice of one image or of a run of images (their points
    never mix), as arrays for the compiled filter.

    Shapes:
        features: (N, d) float32 positions already divided by the standard deviations (checked
            by the caller: finite, lifted coordinates within
            :data:`mars_plugin.engines.permutohedral.MAX_COORDINATE`).
        sizes: the pixel counts of the images, in order (sum N).

    ``filter(x)`` maps (N, L) float32 to n K(n x), the symmetric-normalised Gaussian filter of
    pydensecrf (``n = 1 / sqrt(K 1)``); with ``normalise=False``, the plain K(x) (the general CRF,
    :mod:`mars_plugin.engines.crf_terms`, folds its own normalisers into ``sw`` and ``lw``).
    ``max_points`` refuses a lattice of more points before
    its neighbour tables are made (``LatticeTooLarge``).
    """

    def __init__(self, features: np.ndarray, sizes: Sequence[int], max_points: Optional[int] = None,
                 normalise: bool = True) -> None:
        features = np.ascontiguousarray(features, dtype=np.float32)
        N, d = features.shape
        sizes = [int(s) for s in sizes]
        vert = np.empty((N, d + 1), dtype=np.int32)
        bary = np.empty((N, d + 1), dtype=np.float32)
        M, n1, n2 = _build_lattice(features, sizes, vert, bary, max_points)
        self.num_points, self.dim, self.num_lattice_points = N, d, M
        self.vert, self.n1, self.n2 = vert, n1, n2
        alpha = _f32(1.0 / (1.0 + 2.0 ** -d))
        # the unnormalised filter of ones, then the normaliser folded into both weights
        self.sw, self.lw = bary, bary * alpha
        if not normalise:  # the plain filter K(x), for callers that normalise otherwise
            return
        k1 = self.filter(np.ones((N, 1), dtype=np.float32))
        sw, lw = np.empty_like(bary), np.empty_like(bary)
        _normalise(k1, bary, alpha, sw, lw)
        self.sw, self.lw = sw, lw

    def filter(self, x: np.ndarray, out: Optional[np.ndarray] = None, scale: float = 1.0) -> np.ndarray:
        """(N, L) float32 -> (N, L) float32; with ``out``, ``scale`` times the result is added
        into it (in place) and it is returned."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        L = x.shape[1]
        if out is None:
            out = np.zeros_like(x)
        size = (self.num_lattice_points + 1) * L
        _filter(self.vert, self.sw, self.lw, self.n1, self.n2, x, np.empty(size, np.float32),
                np.empty(size, np.float32), out, _f32(scale), 0, L)
        return out


# A unit of work: rows [start, stop) of the (N, L) arrays, its position lattice, and a function
# that builds its bilateral lattice (called in the thread that solves the unit).
Unit = Tuple[int, int, CompiledLattice, Callable[[], CompiledLattice]]


def _solve_whole(neg_u: np.ndarray, q: np.ndarray, unit: Unit, compats: Tuple[float, float], iterations: int) -> None:
    """Mean field of one unit in this thread: Q = softmax(-U), then ``iterations`` times
    Q = softmax(-U + cg Kg(Q) + cb Kb(Q)), one compiled call per iteration, with a Ctrl-C checked
    between them (:func:`mars_plugin._interrupt.check`): a kernel never runs the whole solve."""
    a, b, gaussian, build = unit
    _interrupt.check()
    bilateral = build()
    L = neg_u.shape[1]
    size = (max(gaussian.num_lattice_points, bilateral.num_lattice_points) + 1) * L
    u, cur = neg_u[a:b], q[a:b]
    other = np.empty_like(u)
    g, bl = gaussian, bilateral
    cg, cb = _f32(compats[0]), _f32(compats[1])
    vbuf, wbuf = np.empty(size, np.float32), np.empty(size, np.float32)
    _solve_start(u, cur)
    for _ in range(int(iterations)):
        _interrupt.check()
        _solve_step(u, cur, other, g.vert, g.sw, g.lw, g.n1, g.n2, cg, bl.vert, bl.sw, bl.lw, bl.n1, bl.n2, cb,
                    vbuf, wbuf)
        cur, other = other, cur
    if not np.shares_memory(cur, q):
        q[a:b] = cur


def _split(n: int, parts: int) -> List[Tuple[int, int]]:
    step = -(-n // parts)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _solve_split(neg_u: np.ndarray, q: np.ndarray, unit: Unit, compats: Tuple[float, float], iterations: int,
                 pool: ThreadPoolExecutor, threads: int) -> None:
    """One unit with every thread. Each iteration: the two kernels' messages as separate tasks
    (the bilateral one into a second array; with four threads or more, each kernel's labels in
    blocks), then the pixels in blocks, one per thread: the bilateral message added, the
    softmax. Two waits per iteration; the additions are the serial path's, in its order."""
    a, b, g, build = unit
    bl = build()
    u = neg_u[a:b]
    N, L = u.shape
    labels = _split(L, max(1, min(threads // 2, L)))
    rows = _split(N, threads)
    width = max(k1 - k0 for k0, k1 in labels)
    scratch = [(np.empty((k.num_lattice_points + 1) * width, np.float32),
                np.empty((k.num_lattice_points + 1) * width, np.float32)) for k in (bl, g) for _ in labels]
    cg, cb = _f32(compats[0]), _f32(compats[1])
    cur = q[a:b]
    other = np.empty_like(u)
    message = np.empty_like(u)  # the bilateral kernel's, added after the position kernel's

    def run(calls):
        for f in [pool.submit(*c) for c in calls]:
            f.result()

    def gaussian(x, e, k0, k1, vbuf, wbuf):  # e = -U + cg Kg(x), as the serial path
        _copy_cols(u, e, k0, k1)
        _filter(g.vert, g.sw, g.lw, g.n1, g.n2, x, vbuf, wbuf, e, cg, k0, k1)

    def bilateral(x, k0, k1, vbuf, wbuf):  # message = Kb(x)
        _zero_cols(message, k0, k1)
        _filter(bl.vert, bl.sw, bl.lw, bl.n1, bl.n2, x, vbuf, wbuf, message, _f32(1.0), k0, k1)

    def normalise(e, r0, r1):  # e += cb Kb(x), then the softmax
        _add_scaled_rows(e, message, cb, r0, r1)
        _softmax_rows(e, r0, r1)

    run([(_copy_cols, u[r0:r1], cur[r0:r1], 0, L) for r0, r1 in rows])
    run([(_softmax_rows, cur, r0, r1) for r0, r1 in rows])
    for _ in range(int(iterations)):
        _interrupt.check()  # between iterations (see _solve_whole)
        tasks = [(bilateral, cur, k0, k1, vb, wb) for (k0, k1), (vb, wb) in zip(labels, scratch)]
        tasks += [(gaussian, cur, other, k0, k1, vb, wb) for (k0, k1), (vb, wb) in zip(labels, scratch[len(labels):])]
        run(tasks)
        run([(normalise, other, r0, r1) for r0, r1 in rows])
        cur, other = other, cur
    if not np.shares_memory(cur, q):
        q[a:b] = cur


def mean_field(neg_u: np.ndarray, units: Sequence[Unit], compats: Tuple[float, float], iterations: int,
               threads: int) -> np.ndarray:
    """The dense CRF's mean field for (N, L) float32 -U (``-inf``: label not allowed), whose
    rows are cut into ``units`` (one lattice pair each, see :data:`Unit`). Returns Q (N, L).

    With ``threads`` > 1, whole units run in parallel threads (each built and solved start to
    finish by one thread); units left over when there are fewer than threads run one at a time
    with every thread (the two kernels, then the pixels split). Results do not depend on
    ``threads``.
    """
    neg_u = np.ascontiguousarray(neg_u, dtype=np.float32)
    q = np.empty_like(neg_u)
    threads = max(1, int(threads))
    with _interrupt.polled():  # a Ctrl-C is taken between the compiled calls, in every thread
        if threads == 1:
            for unit in units:
                _solve_whole(neg_u, q, unit, compats, iterations)
            return q
        whole = len(units) // threads * threads
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mars-crf") as pool:
            futures = [pool.submit(_solve_whole, neg_u, q, unit, compats, iterations) for unit in units[:whole]]
            wait(futures)
            for f in futures:
                f.result()  # the first failure (e.g. LatticeTooLarge), once every thread has stopped
            for unit in units[whole:]:
                _solve_split(neg_u, q, unit, compats, iterations, pool, threads)
    return q


def _build_lattice(features: np.ndarray, sizes: List[int], vert: np.ndarray, bary: np.ndarray,
                   max_points: Optional[int]) -> Tuple[int, np.ndarray, np.ndarray]:
    """Lift the (N, d) points (filling ``vert`` and ``bary``) and number their lattice points:
    (M, n1, n2), the two neighbour tables along each of the d+1 axes."""
    N, d = features.shape
    d1 = d + 1
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    starts[1:] = np.cumsum(sizes)
    pad = np.array([s % _SIMD_BLOCK != 0 for s in sizes], dtype=np.bool_)
    # The torch path's float32 constants: scale factors sqrt(2/3) (d+1) / sqrt((i+1)(i+2))
    # rounded from double, and 1 / (d+1) last.
    inv_std_dev = float(np.float32(math.sqrt(2.0 / 3.0) * d1))
    scale = np.array([1.0 / math.sqrt((i + 2) * (i + 1)) * inv_std_dev for i in range(d)] + [1.0 / d1],
                     dtype=np.float32)
    pad_images = np.nonzero(pad)[0].astype(np.int64)
    Np = N + pad_images.shape[0]
    q = np.empty((Np, d), dtype=np.int32)
    rank = np.empty((Np, d1), dtype=np.int8)
    _lift_points(features, starts, pad, scale, q, rank, bary)
    # The packed code of a vertex: (image, q' - lo) in mixed radix, times d+1, plus r; q'
    # runs over q - 1 .. q and its neighbours one further: margins of 2 below, 1 above.
    lo = q.min(0).astype(np.int64) - 2
    radix = [int(x) for x in q.max(0).astype(np.int64) - lo + 2]
    strides = [1] * (d + 1)
    for i in range(d - 2, -1, -1):
        strides[i] = strides[i + 1] * radix[i + 1]
    strides[d] = strides[0] * radix[0]
    # About one lattice point per pixel on photographs (up to d+1 on noise): the table
    # (2-4 slots per pixel) and the codes (one per pixel) at first, both doubled while
    # filling, so that memory follows the lattice.
    bits = max(4, int(math.ceil(math.log2(2 * (N + d1)))))
    if strides[d] * len(sizes) * d1 < _MAX_CODE:
        return _number_by_codes(q, rank, starts, pad_images, lo, np.array(strides, dtype=np.int64), vert, bits,
                                max_points)
    del q, rank  # very fine kernels on large images: the keys compared as rows
    return _number_by_rows(features, starts, pad, scale, vert, bary, bits, max_points)


def _number_by_codes(q: np.ndarray, rank: np.ndarray, starts: np.ndarray, pad_images: np.ndarray, lo: np.ndarray,
                     strides: np.ndarray, vert: np.ndarray, bits: int,
                     max_points: Optional[int]) -> Tuple[int, np.ndarray, np.ndarray]:
    """The lattice points numbered by their packed codes in a hash table (the usual case)."""
    N, d1 = vert.shape
    M, codes, slots, bits = _insert_codes(q, rank, starts, pad_images, lo, strides, vert,
                                          np.empty(N + d1, dtype=np.int64), bits)
    M = int(M)
    if max_points is not None and M > max_points:
        raise LatticeTooLarge(M, max_points, N)
    n1 = np.full((d1, M + 1), M, dtype=np.int32)
    n2 = np.full((d1, M + 1), M, dtype=np.int32)
    _neighbours_codes(codes, M, strides, slots, bits, n1, n2, 0, M)
    return M, n1, n2


def _number_by_rows(features: np.ndarray, starts: np.ndarray, pad: np.ndarray, scale: np.ndarray,
                    vert: np.ndarray, bary: np.ndarray, bits: int,
                    max_points: Optional[int]) -> Tuple[int, np.ndarray, np.ndarray]:
    """The lattice points numbered by their keys compared as rows (no packed code fits)."""
    N, d1 = vert.shape
    lead = 1 if len(starts) > 2 else 0  # the image index leads the key when there are several
    slots = np.full(1 << bits, -1, dtype=np.int32)
    keys = np.empty((N + d1, lead + d1 - 1), dtype=np.int32)
    M, slots, keys = _build_points_rows(features, starts, pad, scale, keys, slots, vert, bary)
    M = int(M)
    if max_points is not None and M > max_points:
        raise LatticeTooLarge(M, max_points, N)
    n1 = np.empty((d1, M + 1), dtype=np.int32)
    n2 = np.empty((d1, M + 1), dtype=np.int32)
    _build_neighbours_rows(keys[:M], M, lead, slots, n1, n2)
    return M, n1, n2
