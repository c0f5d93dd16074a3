"""Selecting debiased centroids (MARS Sec. 3.2, Eq. 1-3).

Eq. 1 scores every foreground centroid v by its mean cosine distance to *all* background
centroids b_j of the training set: dist(v) = 1/N_bg sum_j (1 - S(v, b_j)) / 2. The cosine is
linear in the normalised background vectors, so

    dist(v) = (1 - v_hat . mean_j(b_hat_j)) / 2                                 (exact)

and only the running sum of normalised background centroids is kept: O(N) time, O(D) memory
for the background, while the foreground keeps only its candidate centroids (never features).
Eq. 2-3 then average, per class, the ceil(alpha * N_fg_c) candidates farthest from the
background (stable descending sort: ties keep the order in which images were seen).

The stream itself (batches clustered, the running state, candidates spilled to disk) is
:mod:`mars_plugin.method.selection_stream`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from mars_plugin._checks import (
    MAX_NUM_CLASSES,
    RESERVED_REASON,
    check_fraction,
    check_int_param,
    check_num_classes,
    check_real_param,
    check_seed,
    describe,
)
from mars_plugin.method.centroids import ImageCentroids, check_backend
from mars_plugin.formats.files import atomic_write, save_torch
from mars_plugin.formats.bounded_load import torch_load
from mars_plugin.engines.kmeans import l2_normalize
from mars_plugin.method.selection_stream import _Accumulator, _iter_batches

__all__ = ["DebiasedCentroids", "select_centroids", "background_distance", "num_selected", "shard_indices"]


def num_selected(n_candidates: int, alpha: float) -> int:
    """ceil(n * alpha) of Eq. 2, immune to float noise (0.7 * 10 = 7.000000000000001 -> 7)."""
    if n_candidates <= 0:
        return 0
    return max(1, math.ceil(round(n_candidates * alpha, 9)))


def background_distance(candidates: torch.Tensor, background_mean: torch.Tensor) -> torch.Tensor:
    """Eq. 1 through the mean-direction identity.

    Shapes:
        candidates: (N, D) foreground centroids v.
        background_mean: (D,) mean of the L2-normalised background centroids, mean_j b_hat_j.

    Returns:
        (N,) float64 distances (1 - v_hat . mean_j b_hat_j) / 2, in [0, 1].
    """
    v_hat = l2_normalize(candidates.double(), dim=1)
    return (1.0 - v_hat @ background_mean.double().to(v_hat.device)) / 2.0


@dataclass
class DebiasedCentroids:
    """Result of :func:`select_centroids`.

    Attributes (C = number of foreground classes):
        centroids: (C+1, D) debiased centroid V^c per class (Eq. 2); row 0 (background) and
            classes never seen are zeros.
        valid: (C+1,) bool, True where a class has a centroid (never for row 0).
        num_candidates: (C+1,) long, N_fg_c candidate centroids per class (row 0: N_bg).
        num_selected: (C+1,) long, ceil(alpha * N_fg_c) averaged centroids.
        cut_distance: (C+1,) float64, Eq. 1 distance of the last selected candidate (NaN where
            invalid): candidates closer to the background than this were treated as biased.
        background_mean: (D,) mean of the normalised background centroids (Eq. 1).
        num_images: images consumed.
        config: the hyper-parameters used (alpha, k_fg, k_bg, normalize, seed).
        candidate_distances: (sum of num_candidates[1:],) float64 or None: every foreground
            candidate's Eq. 1 distance to the background, class 1's first, each class's sorted
            farthest first (its first num_selected[c] were averaged): the ranking that
            ``report.html`` draws. None in files written before it was stored.
    """

    centroids: torch.Tensor
    valid: torch.Tensor
    num_candidates: torch.Tensor
    num_selected: torch.Tensor
    cut_distance: torch.Tensor
    background_mean: torch.Tensor
    num_images: int
    config: Dict[str, Union[float, int, bool]] = field(default_factory=dict)
    candidate_distances: Optional[torch.Tensor] = None

    def class_distances(self, c: int) -> Optional[torch.Tensor]:
        """Class ``c``'s candidates' Eq. 1 distances, farthest first (None: not stored)."""
        if self.candidate_distances is None or not 1 <= c <= self.num_classes:
            return None
        start = int(self.num_candidates[1:c].sum())
        return self.candidate_distances[start : start + int(self.num_candidates[c])]

    @property
    def num_classes(self) -> int:
        """C, the number of foreground classes."""
        return int(self.centroids.shape[0]) - 1

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    def to(self, device: Union[str, torch.device]) -> "DebiasedCentroids":
        t = lambda x: x.to(device)  # noqa: E731
        return DebiasedCentroids(
            t(self.centroids), t(self.valid), t(self.num_candidates), t(self.num_selected),
            t(self.cut_distance), t(self.background_mean), self.num_images, dict(self.config),
            None if self.candidate_distances is None else t(self.candidate_distances),
        )

    def state_dict(self) -> Dict[str, object]:
        extra = {} if self.candidate_distances is None else {"candidate_distances": self.candidate_distances.cpu()}
        return {**extra,
            "format": "mars-plugin/debiased-centroids/1",
            "centroids": self.centroids.cpu(),
            "valid": self.valid.cpu(),
            "num_candidates": self.num_candidates.cpu(),
            "num_selected": self.num_selected.cpu(),
            "cut_distance": self.cut_distance.cpu(),
            "background_mean": self.background_mean.cpu(),
            "num_images": int(self.num_images),
            "config": dict(self.config),
        }

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write to ``path`` atomically (temporary file in the same folder, then rename)."""
        state = self.state_dict()
        atomic_write(path, lambda tmp: save_torch(state, tmp))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], map_location: Union[str, torch.device] = "cpu") -> "DebiasedCentroids":
        """Read a file written by :meth:`save`. Uses ``torch.load(weights_only=True)``: no
        arbitrary unpickling happens, so the file may come from anyone."""
        d = torch_load(path, map_location=map_location, what="a centroid file's tensor")
        if not isinstance(d, dict) or d.get("format") != "mars-plugin/debiased-centroids/1":
            raise ValueError(f"{os.fspath(path)!r} is not a mars-plugin centroid file (missing format tag)")
        rows = d["centroids"].shape[0] if isinstance(d.get("centroids"), torch.Tensor) and d["centroids"].ndim else 0
        if rows - 1 > MAX_NUM_CLASSES:
            raise ValueError(f"{os.fspath(path)!r} holds centroids of C = {rows - 1} classes, but {RESERVED_REASON}")
        return cls(
            d["centroids"], d["valid"], d["num_candidates"], d["num_selected"], d["cut_distance"],
            d["background_mean"], int(d["num_images"]), dict(d["config"]),
            d.get("candidate_distances"),  # absent in files written before it was stored
        )


def shard_indices(n: int, rank: int, world_size: int) -> List[int]:
    """Indices of rank ``rank``'s shard of ``n`` images: rank, rank + W, ... (no padding)."""
    return list(range(rank, n, world_size))


def _dist_info(process_group) -> Tuple[int, int]:
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group was given but torch.distributed is not initialised")
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_gather(obj, process_group) -> List[object]:
    import torch.distributed as dist

    gathered: List[object] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _merge_summaries(summary, error, world, process_group) -> Dict[str, object]:
    """Every rank's background sum and counts, added in rank order (the same on every rank).

    An error on any rank is raised on every rank, so that none is left waiting.
    """
    if world == 1:
        return summary
    payload = {"state": summary, "error": None if error is None else f"{type(error).__name__}: {error}"}
    gathered = _all_gather(payload, process_group)
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if errors:
        r, msg = errors[0]
        raise ValueError(f"rank {r}: {msg}")
    dims = {g["state"]["dim"] for g in gathered if g["state"]["dim"] is not None}
    if len(dims) > 1:
        raise ValueError(f"ranks hold features of different embedding sizes D: {sorted(dims)}")
    merged: Dict[str, object] = dict(bg_sum=None, n_bg=0, n_images=0, dim=dims.pop() if dims else None)
    for g in gathered:
        st = g["state"]
        if st["bg_sum"] is not None:
            merged["bg_sum"] = st["bg_sum"] if merged["bg_sum"] is None else merged["bg_sum"] + st["bg_sum"]
        merged["n_bg"] += st["n_bg"]
        merged["n_images"] += st["n_images"]
    return merged


def _stream_order(dist: torch.Tensor, tags: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Candidates sorted by descending distance, ties in stream order (tag, then row)."""
    idx = torch.sort(rows, stable=True).indices
    idx = idx[torch.sort(tags[idx], stable=True).indices]
    return idx[torch.sort(dist[idx], descending=True, stable=True).indices]


def select_centroids(
    samples: Iterable[Union[Tuple[object, object], ImageCentroids]],
    num_classes: int,
    *,
    alpha: float = 0.4,
    k_fg: int = 2,
    k_bg: int = 2,
    ignore_index: int = 255,
    normalize: bool = True,
    seed: int = 0,
    batch_size: int = 64,
    max_iter: int = 100,
    tol: float = 1e-4,
    n_init: int = 1,
    progress: bool = False,
    total: Optional[int] = None,
    process_group: Optional[object] = None,
    device: Optional[Union[str, torch.device]] = None,
    spill_dir: Optional[Union[str, os.PathLike]] = None,
    spill_mb: float = 1024,
    backend: str = "auto",
) -> DebiasedCentroids:
    """Debiased centroid of every class from a stream of images (Eq. 1-3).

    Args:
        samples: iterable, consumed once and never stored, of either ``(features (D, H, W),
            pseudo_label (H', W'))`` pairs or :class:`ImageCentroids` (e.g. precomputed by
            :func:`image_centroids` on other workers). Only centroids are kept in memory.
        num_classes: C, the number of foreground classes (labels are 0..C), 1..253: 254 and 255
            are the biased and ignore bytes of label files, never classes.
        alpha: share of each class's candidates, farthest from the background, that is
            averaged (Eq. 2); in (0, 1], 0.40 in the paper.
        k_fg, k_bg, ignore_index, normalize, seed, max_iter, tol, n_init: see
            :func:`image_centroids`.
        batch_size: (features, label) pairs clustered together in one batched K-means call.
        progress: show a tqdm progress bar (``total`` sizes it when ``samples`` has no len()).
        process_group: under ``torch.distributed`` (initialised; this group or the default one),
            each rank passes its own shard of the image list, split DistributedSampler-style
            without shuffling: rank r holds images r, r + W, r + 2W, ... (see
            :func:`shard_indices`). Ranks cluster their shards; the background sums, then one
            (distance, tag, row) triple per candidate, then the per-class sums of the selected
            candidates are gathered (candidate vectors never travel), and every rank returns the
            identical result, equal to one process on the whole list.
        device: where the K-means runs, e.g. ``"cuda"`` for features read on the CPU (each
            batch is moved there in one copy). Default: where each batch's features are. The
            result lives on this device (default: the first sample's).
        spill_dir: an existing folder; when given, candidate centroids beyond ``spill_mb`` MB
            held in memory are written to a temporary folder inside it (plain ``.npy``, read
            back without unpickling, removed at the end). Use it when the candidates of a data
            set do not fit in memory (Open Images: ~4 per image x D floats).
        backend: K-means implementation, see :func:`image_centroids` ("auto": the compiled
            kernel on the CPU when numba is installed, batched torch otherwise).

    Returns:
        :class:`DebiasedCentroids`.

    Raises:
        ValueError: empty ``samples``, alpha outside (0, 1], no background centroid in any
            image (Eq. 1 is undefined), a label above ``num_classes``, mixed embedding sizes.
    """
    num_classes = check_num_classes(num_classes)
    alpha = check_fraction(alpha, "alpha")
    seed = check_seed(seed)
    batch_size = check_int_param(batch_size, "batch_size", 1)
    if isinstance(samples, (torch.Tensor, ImageCentroids)) or not hasattr(samples, "__iter__"):
        raise TypeError(f"samples must be an iterable of (features, pseudo_label) pairs or ImageCentroids, got {describe(samples)}")
    if total is None and hasattr(samples, "__len__"):
        total = len(samples)  # type: ignore[arg-type]

    kw = dict(k_fg=check_int_param(k_fg, "k_fg", 1), k_bg=check_int_param(k_bg, "k_bg", 1),
              ignore_index=ignore_index, normalize=normalize, seed=seed, max_iter=max_iter, tol=tol,
              n_init=n_init, backend=check_backend(backend))
    if device is not None:
        device = torch.device(device)
    rank, world = _dist_info(process_group)
    if spill_dir is not None and not os.path.isdir(spill_dir):
        raise ValueError(f"spill_dir must be an existing folder, got {os.fspath(spill_dir)!r}")
    spill_mb = check_real_param(spill_mb, "spill_mb", 0.0, math.inf)  # 0: spill every batch
    error: Optional[BaseException] = None
    acc = _Accumulator(num_classes, ignore_index, rank, world,
                       None if spill_dir is None else os.fspath(spill_dir), int(spill_mb * 2**20))
    seen: Dict[str, torch.device] = {}
    try:
        try:
            for batch in _iter_batches(samples, batch_size=batch_size, progress=progress, total=total,
                                       device=device, seen=seen, num_classes=num_classes, **kw):
                acc.add(batch)
        except (ValueError, TypeError) as e:
            if world == 1:
                raise
            error = e  # let the other ranks know instead of leaving them waiting
        state = _merge_summaries(acc.summary(), error, world, process_group)
        out = _select(acc, state, num_classes, alpha, world, process_group)
    finally:
        acc.cleanup()
    out.config = dict(alpha=alpha, k_fg=kw["k_fg"], k_bg=kw["k_bg"], normalize=bool(normalize), seed=int(seed))
    return out.to(device if device is not None else seen.get("device", "cpu"))


def _select(acc: _Accumulator, state, num_classes, alpha, world, process_group) -> DebiasedCentroids:
    """Eq. 1-3 from every rank's candidates, without moving a candidate between ranks.

    Each rank scores its own candidates (Eq. 1); only (distance, tag, row) triples are gathered,
    every rank sorts them the same way and flags its own top-alpha candidates; the per-class
    sums of the flagged vectors are gathered and added in rank order. Memory per class: a few
    numbers per candidate, plus one spilled chunk at a time.
    """
    n_bg, n_images, dim, bg_sum = state["n_bg"], state["n_images"], state["dim"], state["bg_sum"]
    if n_images == 0:
        raise ValueError("samples is empty: select_centroids needs at least one image")
    if n_bg == 0 or bg_sum is None:
        raise ValueError(
            f"samples: no background centroid in any of the {n_images} images: Eq. 1 measures distances to "
            "the background, so at least one pseudo_label must contain background (0) pixels"
        )
    bg_mean = bg_sum / n_bg
    local = acc.distances(bg_mean, background_distance)
    per_rank = [local] if world == 1 else _all_gather(local, process_group)
    C1 = num_classes + 1
    n_cand = torch.zeros(C1, dtype=torch.long)
    n_sel = torch.zeros(C1, dtype=torch.long)
    cut = torch.full((C1,), float("nan"), dtype=torch.float64)
    n_cand[0] = n_bg
    chosen: Dict[int, torch.Tensor] = {}
    ranked: List[torch.Tensor] = []  # each class's distances, farthest first (report.html)
    for c in sorted({c for part in per_rank for c in part}):
        parts = [part.get(c, (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
                              torch.zeros(0, dtype=torch.long))) for part in per_rank]
        dist = torch.cat([p[0] for p in parts])
        order = _stream_order(dist, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
        k = num_selected(dist.numel(), alpha)
        flags = torch.zeros(dist.numel(), dtype=torch.bool)
        flags[order[:k]] = True
        start = sum(p[0].numel() for p in parts[:acc.rank])  # this rank's slice of the concatenation
        chosen[c] = flags[start : start + parts[acc.rank][0].numel()]
        n_cand[c], n_sel[c], cut[c] = dist.numel(), k, dist[order[k - 1]]
        ranked.append(dist[order].to(torch.float64))
    sums = acc.selected_sums(chosen, dim)
    per_rank_sums = [sums] if world == 1 else _all_gather(sums, process_group)
    cents = torch.zeros(C1, dim, dtype=torch.float32)
    valid = torch.zeros(C1, dtype=torch.bool)
    for c in chosen:
        total = sum(s[c] for s in per_rank_sums)  # rank order: the same float sum on every rank
        cents[c] = (total / int(n_sel[c])).float()
        valid[c] = True
    distances = torch.cat(ranked) if ranked else torch.zeros(0, dtype=torch.float64)
    return DebiasedCentroids(cents, valid, n_cand, n_sel, cut, bg_mean.float(), n_images, {}, distances.cpu())
