"""Batched K-means in torch: many small clustering problems in one call.

MARS clusters the pixels of every (image, class) pair separately (Sec. 3.2): thousands of tiny
problems with K = 2. Running scikit-learn once per problem is dominated by Python overhead, so
this module pads the problems into one (B, N, D) tensor and runs greedy k-means++ seeding and
Lloyd iterations for all of them at once, on whatever device the points live.

Determinism: the random numbers of problem ``b`` come from its own CPU generator seeded with
``seeds[b]``, so a problem's result does not depend on which other problems share the batch
(batch == one-by-one) nor on the device the arithmetic runs on, up to float rounding.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from mars_plugin._checks import check_int_param, describe

__all__ = ["KMeansResult", "batched_kmeans", "kmeans", "l2_norm", "l2_normalize", "seeding_trials"]


def l2_norm(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """L2 norm of finite vectors along ``dim``, in float32 at least (float64 stays float64).

    The plain sum of squares overflows float32 for values beyond ~1.8e19 (and float16 already
    past 256), which turns a perfectly finite vector into one of infinite norm, i.e. a zero
    vector once normalised; it underflows to 0 for values below ~1e-23, which makes a nonzero
    vector look like "no centroid". Such vectors (found after the fast pass, so the common
    case costs one scan of the norms) are measured again scaled by their largest magnitude:
    |x| = m |x / m|. A norm beyond the dtype's range stays inf; use :func:`l2_normalize`,
    which never forms it.
    """
    work = x if x.dtype == torch.float64 else x.float()
    n = torch.linalg.vector_norm(work, dim=dim, keepdim=True)
    over = torch.isinf(n) | (n == 0)
    if bool(over.any()):
        m = work.abs().amax(dim, keepdim=True)
        safe = torch.where(over & (m > 0), m, torch.ones_like(m))
        n = torch.where(over, torch.linalg.vector_norm(work / safe, dim=dim, keepdim=True) * safe, n)
    return n if keepdim else n.squeeze(dim)


def l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize``'s rule x / max(|x|, eps), without its overflow (see :func:`l2_norm`).

    Computed in float32 at least (float64 stays float64). A vector whose squared norm overflows
    is divided by its largest magnitude m first, then by |x / m| (in [1, sqrt(D)]): no
    intermediate leaves the range, even for values near the dtype's maximum.
    """
    work = x if x.dtype == torch.float64 else x.float()
    n = torch.linalg.vector_norm(work, dim=dim, keepdim=True)
    over = torch.isinf(n)
    if not bool(over.any()):
        return work / n.clamp_min(eps)
    m = work.abs().amax(dim, keepdim=True)
    scaled = work / torch.where(over & (m > 0), m, torch.ones_like(m))
    n = torch.where(over, torch.linalg.vector_norm(scaled, dim=dim, keepdim=True), n)
    return torch.where(over, scaled, work) / n.clamp_min(eps)


@dataclass
class KMeansResult:
    """Result of :func:`batched_kmeans` for B problems padded to ``Kmax`` centroids.

    Attributes:
        centroids: (B, Kmax, D) cluster means, Kmax = min(max K, N); rows with
            ``valid == False`` are zeros.
        valid: (B, Kmax) bool, True for the ``k_eff = min(K, distinct points)`` real centroids.
        labels: (B, N) long, index of the closest centroid per point (-1 at padded points).
        inertia: (B,) sum of squared distances of the points to their centroid.
        n_iter: number of Lloyd iterations run (the maximum over the batch).
    """

    centroids: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    inertia: torch.Tensor
    n_iter: int


@functools.lru_cache(maxsize=4096)
def _problem_uniforms(seed: int, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) float64 uniforms of one problem, from its own generator (cached).

    MARS gives every image's problem of one class the same seed, so a batch holds only a few
    distinct (seed, K, trials) triples: drawing each once saves a generator per problem.
    The cached tensor is never written to.
    """
    g = torch.Generator().manual_seed(int(seed) % (2**63))
    return torch.rand(rows, cols, generator=g, dtype=torch.float64)


def _uniforms(seeds: Sequence[int], rows: Sequence[int], cols: Sequence[int], device: torch.device) -> torch.Tensor:
    """(B, max rows, max cols) uniforms in [0, 1), drawn per problem from its own generator.

    Problem b draws exactly its own (rows[b], cols[b]) block (its K and its number of seeding
    candidates), so its stream does not depend on the K of the other problems in the batch.
    """
    keys = list(zip(seeds, rows, cols))
    distinct = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    table = torch.full((len(distinct), max(rows), max(cols)), 0.5, dtype=torch.float64)
    for (s, r, c), i in distinct.items():
        table[i, :r, :c] = _problem_uniforms(int(s), int(r), int(c))
    index = torch.tensor([distinct[key] for key in keys], dtype=torch.long)
    return table[index].to(device)


def seeding_trials(k: int) -> int:
    """Candidates per k-means++ step, 2 + floor(ln K) (scikit-learn's greedy rule)."""
    return 2 + int(math.log(k))


def _sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw indices with probability proportional to ``weights`` (B, N) for uniforms u (B, T).

    Points of zero weight (padding, already chosen centroids) are never drawn: the inverse CDF
    picks the first index whose cumulative weight exceeds u * total.
    """
    cum = weights.double().cumsum(1)
    target = u * cum[:, -1:]
    idx = torch.searchsorted(cum, target, right=True).clamp_max(weights.shape[1] - 1)
    # Guard against rounding at the upper end: fall back to the last positive-weight point.
    positive = weights > 0
    last_positive = (torch.arange(weights.shape[1], device=weights.device) * positive).argmax(1)
    bad = ~positive.gather(1, idx)
    return torch.where(bad, last_positive[:, None].expand_as(idx), idx)


def _sq_dist_exact(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Squared distances (B, N, T) computed from differences, so identical points give exactly 0."""
    return torch.cdist(x, c, compute_mode="donot_use_mm_for_euclid_dist").square()


def _sq_dist_fast(x: torch.Tensor, x2: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Squared distances (B, N, K) through the |x|^2 - 2 x.c + |c|^2 expansion (one bmm)."""
    c2 = c.square().sum(-1)
    return torch.baddbmm(x2[:, :, None] + c2[:, None, :], x, c.transpose(1, 2), alpha=-2.0).clamp_min_(0)


def _kmeanspp(x: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, u: torch.Tensor, trials: torch.Tensor):
    """Greedy k-means++ seeding (as scikit-learn: 2 + ln K candidates per step, keep the best).

    ``trials`` (B,) holds each problem's own number of candidates, 2 + int(ln K_b).

    Stops early for a problem whose remaining points all coincide with chosen centroids: this is
    how a problem with fewer distinct points than K ends with fewer centroids.
    """
    B, N, D = x.shape
    kmax = u.shape[1]
    bidx = torch.arange(B, device=x.device)
    w = mask.to(x.dtype)
    centers = x.new_zeros(B, kmax, D)
    valid = torch.zeros(B, kmax, dtype=torch.bool, device=x.device)

    first = _sample(w, u[:, 0, :1])[:, 0]
    valid[:, 0] = mask.any(1) & (k >= 1)
    centers[:, 0] = torch.where(valid[:, 0, None], x[bidx, first], 0)
    closest = _sq_dist_exact(x, centers[:, :1])[..., 0] * w
    t_max = u.shape[2]
    extra = torch.arange(t_max, device=x.device)[None, :] >= trials[:, None]  # (B, T) unused draws
    for j in range(1, kmax):
        active = (k > j) & (closest.sum(1) > 0)
        if not bool(active.any()):
            break
        cand = _sample(closest, u[:, j, :t_max])  # (B, T)
        cand_pts = x[bidx[:, None], cand]  # (B, T, D)
        d_cand = _sq_dist_exact(x, cand_pts)  # (B, N, T)
        pot = (torch.minimum(closest[:, :, None], d_cand) * w[:, :, None]).sum(1)  # (B, T)
        pot = pot.masked_fill(extra, float("inf"))  # a problem only weighs its own candidates
        best = pot.argmin(1)  # first candidate on ties
        chosen = cand[bidx, best]
        centers[:, j] = torch.where(active[:, None], x[bidx, chosen], 0)
        valid[:, j] = active
        new_closest = torch.minimum(closest, d_cand[bidx, :, best] * w)
        closest = torch.where(active[:, None], new_closest, closest)
    return centers, valid


def batched_kmeans(
    points: torch.Tensor,
    mask: Optional[torch.Tensor],
    k: Union[int, Sequence[int], torch.Tensor],
    *,
    seeds: Union[int, Sequence[int]] = 0,
    max_iter: int = 100,
    tol: float = 1e-4,
    n_init: int = 1,
) -> KMeansResult:
    """Euclidean K-means with greedy k-means++ seeding on B padded problems at once.

    Args:
        points: (B, N, D) float points; padded rows are ignored through ``mask``.
        mask: (B, N) bool, True for real points (None: all real).
        k: clusters per problem, an int or (B,) ints >= 1. A problem with fewer distinct points
            than its K gets one centroid per distinct point (``valid`` tells which); memory
            follows the points, never K (Kmax below is at most N).
        seeds: one seed for all problems or (B,) seeds, one per problem.
        max_iter: cap on Lloyd iterations.
        tol: stop when every problem's total squared centroid shift is at most
            ``tol * mean(per-dimension variance)`` of its points (scikit-learn's rule), or when no
            label changes.
        n_init: independent seedings per problem; the run with the lowest inertia is kept.

    Returns:
        :class:`KMeansResult`, padded to Kmax = min(max K, N) centroids.

    Raises:
        ValueError: a NaN or Inf value in a real point (``mask`` True), bad shapes or K.
    """
    if not isinstance(points, torch.Tensor) or points.ndim != 3 or not points.is_floating_point():
        raise ValueError(f"points must be a (B, N, D) floating tensor, got {describe(points)}")
    B, N, D = points.shape
    if mask is None:
        mask = torch.ones(B, N, dtype=torch.bool, device=points.device)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, N):
        raise ValueError(f"mask must be a (B, N) = {(B, N)} bool tensor, got {describe(mask)}")
    mask = mask.bool().to(points.device)
    # A NaN point makes every centroid it touches NaN, silently: refuse it as the rest of the
    # API does. Padded rows (mask False) are never read, so they may hold anything.
    bad = ~torch.isfinite(points).all(-1) & mask
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"points: got {int(bad.sum())} point(s) with a NaN or Inf value (first: points[{b}, {i}]); "
                         "expected finite values")
    if isinstance(k, torch.Tensor):
        k_t = k.to(device=points.device, dtype=torch.long).reshape(-1)
    elif isinstance(k, (list, tuple)):
        k_t = torch.tensor([check_int_param(v, "k", 1) for v in k], dtype=torch.long, device=points.device)
    else:
        k_t = torch.full((B,), check_int_param(k, "k", 1), dtype=torch.long, device=points.device)
    if k_t.numel() != B or bool((k_t < 1).any()):
        raise ValueError(f"k must be an int >= 1 or B = {B} ints >= 1, got {describe(k)}")
    max_iter = check_int_param(max_iter, "max_iter", 1)
    n_init = check_int_param(n_init, "n_init", 1)
    if isinstance(seeds, (list, tuple)):
        if len(seeds) != B:
            raise ValueError(f"seeds must be one int or B = {B} ints, got {len(seeds)}")
        seed_list = [int(s) for s in seeds]
    else:
        seed_list = [int(seeds)] * B
    # Trials come from each problem's own K (its random stream must not change), but no
    # problem can have more centroids than points: K beyond N would only allocate rows that
    # are never filled (k = 10**7 on 16 points must not cost gigabytes).
    trial_list = [seeding_trials(v) for v in k_t.tolist()]
    k_t = k_t.clamp_max(max(N, 1))

    if n_init > 1:
        # Replicate every problem n_init times with derived seeds and keep the best run.
        rep = lambda t: t.repeat_interleave(n_init, 0)  # noqa: E731
        # Run 0 uses the problem's own seed, so n_init > 1 is never worse than n_init = 1.
        seeds_r = [s if r == 0 else s * 1_000_003 + r for s in seed_list for r in range(n_init)]
        res = _batched_kmeans_checked(rep(points), rep(mask), rep(k_t), [t for t in trial_list for _ in range(n_init)],
                                      seeds_r, max_iter, tol)
        best = res.inertia.view(B, n_init).argmin(1) + torch.arange(B, device=points.device) * n_init
        return KMeansResult(res.centroids[best], res.valid[best], res.labels[best], res.inertia[best], res.n_iter)

    return _batched_kmeans_checked(points, mask, k_t, trial_list, seed_list, max_iter, tol)


def _batched_kmeans_checked(points, mask, k_t, trial_list, seed_list, max_iter, tol) -> KMeansResult:
    """:func:`batched_kmeans` with n_init = 1 on checked arguments, K already at most N."""
    B, N, D = points.shape
    kmax = int(k_t.max()) if B else 1
    if B == 0 or N == 0:
        return KMeansResult(
            points.new_zeros(B, kmax, D),
            torch.zeros(B, kmax, dtype=torch.bool, device=points.device),
            torch.full((B, N), -1, dtype=torch.long, device=points.device),
            points.new_zeros(B),
            0,
        )
    x = points if bool(mask.all()) else points.masked_fill(~mask[:, :, None], 0)
    centers, valid, n_iter = _kmeans_padded(x, mask, [int(v) for v in k_t.tolist()], seed_list, max_iter, tol,
                                            trial_list)
    x2 = x.square().sum(-1)
    d = _sq_dist_fast(x, x2, centers).masked_fill_(~valid[:, None, :], float("inf"))
    dmin, labels = d.min(-1)
    inertia = (dmin.nan_to_num(posinf=0.0) * mask.to(x.dtype)).sum(1)
    labels = labels.masked_fill(~mask, -1)
    return KMeansResult(centers, valid, labels, inertia, n_iter)


def _freeze(centers, act, ca, done, fz, n_recorded):
    """Bookkeeping of one Lloyd step shared by both loops.

    Records the centres ``ca`` of the problems that converged in this step (``done`` and not
    yet frozen ``fz``) into ``centers`` at their rows ``act``: a problem may ride along a few
    more steps until the next compaction, but its result is never read again. Returns
    ``(fz, n_recorded, finished, keep)``: ``finished`` when every problem has converged, and
    ``keep`` (the mask of live problems) when a quarter or more has, so the caller compacts.
    """
    newly = done & ~fz
    fz = fz | done
    n_frozen = int(fz.sum())
    if n_frozen > n_recorded:
        centers[act[newly]] = ca[newly]
    if n_frozen == fz.numel():
        return fz, n_frozen, True, None
    return fz, n_frozen, False, (~fz if n_frozen * 4 >= fz.numel() else None)


def _kmeans_padded(
    x: torch.Tensor,
    mask: torch.Tensor,
    k_list: Sequence[int],
    seed_list: Sequence[int],
    max_iter: int,
    tol: float,
    trial_list: Optional[Sequence[int]] = None,
):
    """The unchecked core of :func:`batched_kmeans` (one seeding per problem).

    ``x`` (B, N, D) must already be zero at padded points (``mask`` False) and B, N >= 1.
    ``trial_list``: seeding candidates per problem (default: from ``k_list``); a caller that
    lowered a K to the number of points passes those of the original K, so that the problem's
    random draws, hence its result, stay those of the original K (the k-means++ rows past
    the points are never drawn: the stream of a K x T block starts with that of n x T).
    Returns ``(centroids (B, Kmax, D), valid (B, Kmax), n_iter)``; invalid rows are zeros.
    """
    kmax = max(k_list)
    k_t = torch.tensor(k_list, dtype=torch.long, device=x.device)
    # Per-problem K and number of seeding candidates: a problem's draws do not depend on the K
    # of the other problems in the batch.
    if trial_list is None:
        trial_list = [seeding_trials(v) for v in k_list]
    u = _uniforms(seed_list, k_list, trial_list, x.device)
    trials = torch.tensor(trial_list, dtype=torch.long, device=x.device)
    centers, valid = _kmeanspp(x, mask, k_t, u, trials)
    tol_b, mean, n_pts = _tolerances(x, mask, tol)

    # A problem stops for good once it meets its own criterion, so its result never depends on
    # which other problems share the batch (batch == one-by-one, exactly). Finished problems
    # are dropped from the working set (once a quarter of it has finished), so the batch costs
    # the sum of its problems' iterations rather than B times the slowest one.
    act = torch.nonzero(mask.any(1)).flatten()
    if kmax == 2 and min(k_list) == 2:
        # MARS's own case (K_fg = K_bg = 2): a two-centroid Lloyd with half the arithmetic.
        n_iter = _lloyd_two(x, mask, act, centers, valid, tol_b, mean * n_pts[:, None], max_iter)
    else:
        n_iter = _lloyd(x, mask, act, centers, valid, tol_b, kmax, max_iter)
    return centers * valid[:, :, None], valid, n_iter


def _tolerances(x: torch.Tensor, mask: torch.Tensor, tol: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tol_b (B,), mean (B, D), n_pts (B,)): each problem's stopping threshold on the centres'
    squared shift, its mean point and its number of points (at least 1)."""
    # Mean per-dimension variance of each problem (scikit-learn's tolerance scale), as
    # E|x|^2 - |E x|^2 over D: no (B, N, D) temporary. Padded points are zeros.
    D = x.shape[2]
    w = mask.to(x.dtype)
    x2 = torch.linalg.vector_norm(x, dim=-1).square()  # no (B, N, D) temporary
    n_pts = w.sum(1).clamp_min(1)
    mean = x.sum(1) / n_pts[:, None]
    var = ((x2.sum(1) / n_pts - mean.square().sum(1)) / D).clamp_min(0)
    return tol * var, mean, n_pts


def _lloyd(x, mask, act, centers, valid, tol_b, kmax, max_iter) -> int:
    """Lloyd iterations for any K of the problems ``act`` (those with points), writing the final
    centres into ``centers``; returns the number of iterations run."""
    B = x.shape[0]
    if act.numel() == B:  # the usual case: no empty problem, no copy of the points
        xa, pad, va, ca, tola = x, ~mask, valid, centers, tol_b
    else:
        xa, pad, va, ca, tola = x[act], ~mask[act], valid[act], centers[act], tol_b[act]
    la = torch.full(pad.shape, -1, dtype=torch.long, device=x.device)
    fz = torch.zeros(act.numel(), dtype=torch.bool, device=x.device)
    n_recorded = 0
    kidx = torch.arange(kmax, device=x.device)
    n_iter = 0
    for n_iter in range(1, max_iter + 1) if act.numel() else ():
        # argmin_k |x - c_k|^2 = argmin_k (|c_k|^2 - 2 x.c_k): |x|^2 is the same for every k.
        # An invalid centroid gets |c|^2 = inf, so no point is ever assigned to it.
        c2 = ca.square().sum(-1).masked_fill_(~va, float("inf"))
        new_labels = torch.baddbmm(c2[:, None, :], xa, ca.transpose(1, 2), alpha=-2.0).argmin(-1)
        # Padded points get the label Kmax, which no cluster has: they never count, and their
        # label never changes, so "no label changed" needs no mask.
        new_labels.masked_fill_(pad, kmax)
        # Per-cluster sums as one batched matrix product with a (B, N, K) one-hot (K is tiny):
        # BLAS beats scatter-add by ~3x here.
        onehot = (new_labels[:, :, None] == kidx).to(x.dtype)
        counts = onehot.sum(1)
        sums = torch.bmm(onehot.transpose(1, 2), xa)
        # An emptied cluster keeps its previous centre (it cannot happen on the first step:
        # every seed owns at least the distinct point it was drawn from).
        new_c = torch.where(counts[:, :, None] > 0, sums / counts.clamp_min(1)[:, :, None], ca)
        shift = (new_c - ca).square().sum((1, 2))
        done = (new_labels == la).all(1) | (shift <= tola)
        ca, la = new_c, new_labels
        fz, n_recorded, finished, keep = _freeze(centers, act, ca, done, fz, n_recorded)
        if finished:
            break
        if keep is not None:
            act, xa, pad, va = act[keep], xa[keep], pad[keep], va[keep]
            ca, la, tola, fz = ca[keep], la[keep], tola[keep], fz[keep]
            n_recorded = 0
    else:
        live = ~fz
        centers[act[live]] = ca[live]  # problems that hit max_iter
    return n_iter


def _lloyd_two(x, mask, act, centers, valid, tol_b, total, max_iter) -> int:
    """Lloyd iterations when every problem has K = 2, writing the final centres into ``centers``.

    Same iterations, stopping rule and results as the general loop, :func:`_lloyd`,
    with the two-centroid algebra: a point joins centroid 1 exactly when
    ``|c1|^2 - |c0|^2 - 2 x.(c1 - c0) < 0`` (ties go to centroid 0, as argmin does), which is one
    matrix-vector product per problem instead of two; and cluster 0's sum is the problem's total
    minus cluster 1's, so the sums need one more matrix-vector product instead of a one-hot
    product. Both products read the points through a (B, D, N) view, their fastest form.
    """
    # A (B, D, N) view: BLAS reads it in place, and a transposed copy costs more than it saves.
    xt = x.transpose(1, 2)
    n_all = mask.sum(1).to(x.dtype)
    B = x.shape[0]
    if act.numel() == B:
        xa, ra, va, ca, tola, ta, na = xt, mask, valid, centers, tol_b, total, n_all
    else:
        xa, ra, va, ca, tola = xt[act], mask[act], valid[act], centers[act], tol_b[act]
        ta, na = total[act], n_all[act]
    prev: Optional[torch.Tensor] = None  # cluster-1 membership of the previous step
    fz = torch.zeros(act.numel(), dtype=torch.bool, device=x.device)
    n_recorded = 0
    n_iter = 0
    for n_iter in range(1, max_iter + 1) if act.numel() else ():
        c2 = ca.square().sum(-1)  # (A, 2)
        # An invalid centroid 1 (one distinct point only) gets an infinite bias: nobody joins it.
        bias = (c2[:, 1] - c2[:, 0]).masked_fill(~va[:, 1], float("inf"))[:, None, None]
        in1 = (torch.baddbmm(bias, (ca[:, 1] - ca[:, 0])[:, None, :], xa, alpha=-2.0)[:, 0] < 0) & ra
        n1 = in1.sum(1).to(x.dtype)
        # (A, 1, N) @ (A, N, D) with the second operand a transposed view: BLAS reads it in
        # place, ~3x faster here than the same product against an (A, N, 1) column.
        s1 = torch.bmm(in1.to(x.dtype)[:, None, :], xa.transpose(1, 2))[:, 0]  # (A, D)
        sums = torch.stack([ta - s1, s1], 1)
        counts = torch.stack([na - n1, n1], 1)
        # An emptied cluster keeps its previous centre, as in the general loop.
        new_c = torch.where(counts[:, :, None] > 0, sums / counts.clamp_min(1)[:, :, None], ca)
        shift = (new_c - ca).square().sum((1, 2))
        done = shift <= tola
        if prev is not None:
            done |= (in1 == prev).all(1)
        ca, prev = new_c, in1
        fz, n_recorded, finished, keep = _freeze(centers, act, ca, done, fz, n_recorded)
        if finished:
            break
        if keep is not None:
            act, xa, ra, va, ta, na = act[keep], xa[keep], ra[keep], va[keep], ta[keep], na[keep]
            ca, prev, tola, fz = ca[keep], prev[keep], tola[keep], fz[keep]
            n_recorded = 0
    else:
        live = ~fz
        centers[act[live]] = ca[live]  # problems that hit max_iter
    return n_iter


def kmeans(
    points: torch.Tensor,
    k: int,
    *,
    seed: int = 0,
    max_iter: int = 100,
    tol: float = 1e-4,
    n_init: int = 1,
) -> torch.Tensor:
    """K-means of one (N, D) point set; returns the (k_eff, D) centroids, k_eff = min(k, distinct)."""
    if not isinstance(points, torch.Tensor) or points.ndim != 2:
        raise ValueError(f"points must be an (N, D) tensor, got {describe(points)}")
    res = batched_kmeans(points[None], None, k, seeds=seed, max_iter=max_iter, tol=tol, n_init=n_init)
    return res.centroids[0][res.valid[0]]
