"""Selecting debiased centroids (MARS Sec. 3.2, Eq. 1-3).

Eq. 1 scores every foreground centroid v by its mean cosine distance to *all* background
centroids b_j of the training set: dist(v) = 1/N_bg sum_j (1 - S(v, b_j)) / 2. The cosine is
linear in the normalised background vectors, so

    dist(v) = (1 - v_hat . mean_j(b_hat_j)) / 2                                 (exact)

and only the running sum of normalised background centroids is kept: O(N) time, O(D) memory
for the background, while the foreground keeps only its candidate centroids (never features).
Eq. 2-3 then average, per class, the ceil(alpha * N_fg_c) candidates farthest from the
background (stable descending sort: ties keep the order in which images were seen).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._checks import check_fraction, check_int_param, describe
from .centroids import ImageCentroids, _as_batch, _cluster_images
from .files import atomic_write

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
    v_hat = F.normalize(candidates.double(), dim=1)
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
    """

    centroids: torch.Tensor
    valid: torch.Tensor
    num_candidates: torch.Tensor
    num_selected: torch.Tensor
    cut_distance: torch.Tensor
    background_mean: torch.Tensor
    num_images: int
    config: Dict[str, Union[float, int, bool]] = field(default_factory=dict)

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
        )

    def state_dict(self) -> Dict[str, object]:
        return {
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
        atomic_write(path, lambda tmp: torch.save(state, tmp))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], map_location: Union[str, torch.device] = "cpu") -> "DebiasedCentroids":
        """Read a file written by :meth:`save`. Uses ``torch.load(weights_only=True)``: no
        arbitrary unpickling happens, so the file may come from anyone."""
        d = torch.load(os.fspath(path), map_location=map_location, weights_only=True)
        if not isinstance(d, dict) or d.get("format") != "mars-plugin/debiased-centroids/1":
            raise ValueError(f"{os.fspath(path)!r} is not a mars-plugin centroid file (missing format tag)")
        return cls(
            d["centroids"], d["valid"], d["num_candidates"], d["num_selected"], d["cut_distance"],
            d["background_mean"], int(d["num_images"]), dict(d["config"]),
        )


def _iter_image_centroids(samples, *, batch_size, progress, total, **kw):
    """Yield ImageCentroids from samples, clustering (features, label) pairs batch_size at a time."""
    pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
    ignore_index = kw["ignore_index"]
    it = samples
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(samples, total=total, desc="select_centroids", unit="img")
    for i, s in enumerate(it):
        if isinstance(s, ImageCentroids):
            if pending:
                yield from _cluster_images(pending, **kw)
                pending = []
            yield s
            continue
        if not isinstance(s, (tuple, list)) or len(s) != 2:
            raise TypeError(
                f"samples[{i}] must be a (features, pseudo_label) pair or an ImageCentroids, got {describe(s)}"
            )
        try:
            f, y, single = _as_batch(s[0], s[1], ignore_index)
        except (TypeError, ValueError) as e:
            raise type(e)(f"samples[{i}]: {e}") from None
        if not single:
            raise ValueError(f"samples[{i}] must hold one image ((D, H, W), (H, W)), got a batch of {f.shape[0]}")
        pending.append((f[0], y[0]))
        if len(pending) >= batch_size:
            yield from _cluster_images(pending, **kw)
            pending = []
    if pending:
        yield from _cluster_images(pending, **kw)


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


def _accumulate(samples, num_classes, batch_size, progress, total, kw, rank, world) -> Dict[str, object]:
    """One process's share: the background sum and every class's (image index, centroids)."""
    bg_sum: Optional[torch.Tensor] = None
    n_bg = 0
    candidates: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
    dim: Optional[int] = None
    n_images = 0
    for ic in _iter_image_centroids(samples, batch_size=batch_size, progress=progress, total=total, **kw):
        if dim is None:
            dim = ic.dim
        elif ic.dim != dim:
            raise ValueError(
                f"samples[{n_images}]: features have embedding size D={ic.dim}, but the first image has D={dim}"
            )
        bad = [c for c in ic.fg if c > num_classes]
        if bad:
            raise ValueError(
                f"samples[{n_images}]: pseudo_label holds class {max(bad)} but num_classes={num_classes}; "
                f"expected ids 0..{num_classes} or ignore_index={kw['ignore_index']}"
            )
        if ic.bg.shape[0]:
            s = F.normalize(ic.bg.double(), dim=1).sum(0)
            bg_sum = s if bg_sum is None else bg_sum + s.to(bg_sum.device)
            n_bg += int(ic.bg.shape[0])
        global_index = n_images * world + rank
        for c, v in ic.fg.items():
            candidates.setdefault(int(c), []).append((global_index, v.detach()))
        n_images += 1
    return dict(bg_sum=bg_sum, n_bg=n_bg, n_images=n_images, dim=dim, candidates=candidates)


def _gather_states(state, error, process_group) -> Dict[str, object]:
    """Merge every rank's state on every rank (objects travel through the process group only)."""
    import torch.distributed as dist

    device = None
    if state is not None:
        if state["bg_sum"] is not None:
            device = state["bg_sum"].device
            state["bg_sum"] = state["bg_sum"].cpu()
        state["candidates"] = {c: [(i, v.cpu()) for i, v in lst] for c, lst in state["candidates"].items()}
    payload = {"state": state, "error": None if error is None else f"{type(error).__name__}: {error}"}
    gathered: List[object] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, payload, group=process_group)
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if errors:
        r, msg = errors[0]
        raise ValueError(f"rank {r}: {msg}")
    dims = {g["state"]["dim"] for g in gathered if g["state"]["dim"] is not None}
    if len(dims) > 1:
        raise ValueError(f"ranks hold features of different embedding sizes D: {sorted(dims)}")
    merged: Dict[str, object] = dict(bg_sum=None, n_bg=0, n_images=0, dim=dims.pop() if dims else None, candidates={})
    for g in gathered:
        st = g["state"]
        if st["bg_sum"] is not None:
            merged["bg_sum"] = st["bg_sum"] if merged["bg_sum"] is None else merged["bg_sum"] + st["bg_sum"]
        merged["n_bg"] += st["n_bg"]
        merged["n_images"] += st["n_images"]
        for c, lst in st["candidates"].items():
            merged["candidates"].setdefault(c, []).extend(lst)
    if merged["bg_sum"] is not None and device is not None:
        merged["bg_sum"] = merged["bg_sum"].to(device)
    return merged


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
    batch_size: int = 8,
    max_iter: int = 100,
    tol: float = 1e-4,
    n_init: int = 1,
    progress: bool = False,
    total: Optional[int] = None,
    process_group: Optional[object] = None,
) -> DebiasedCentroids:
    """Debiased centroid of every class from a stream of images (Eq. 1-3).

    Args:
        samples: iterable, consumed once and never stored, of either ``(features (D, H, W),
            pseudo_label (H', W'))`` pairs or :class:`ImageCentroids` (e.g. precomputed by
            :func:`image_centroids` on other workers). Only centroids are kept in memory.
        num_classes: C, the number of foreground classes (labels are 0..C).
        alpha: share of each class's candidates, farthest from the background, that is
            averaged (Eq. 2); in (0, 1], 0.40 in the paper.
        k_fg, k_bg, ignore_index, normalize, seed, max_iter, tol, n_init: see
            :func:`image_centroids`.
        batch_size: (features, label) pairs clustered together in one batched K-means call.
        progress: show a tqdm progress bar (``total`` sizes it when ``samples`` has no len()).
        process_group: under ``torch.distributed`` (initialised; this group or the default one),
            each rank passes its own shard of the image list, split DistributedSampler-style
            without shuffling: rank r holds images r, r + W, r + 2W, ... (see
            :func:`shard_indices`). Ranks cluster their shards, the background sums and the
            per-class candidates are gathered, and every rank returns the identical result,
            equal to one process on the whole list.

    Returns:
        :class:`DebiasedCentroids`.

    Raises:
        ValueError: empty ``samples``, alpha outside (0, 1], no background centroid in any
            image (Eq. 1 is undefined), a label above ``num_classes``, mixed embedding sizes.
    """
    num_classes = check_int_param(num_classes, "num_classes", 1)
    alpha = check_fraction(alpha, "alpha")
    batch_size = check_int_param(batch_size, "batch_size", 1)
    if isinstance(samples, (torch.Tensor, ImageCentroids)) or not hasattr(samples, "__iter__"):
        raise TypeError(f"samples must be an iterable of (features, pseudo_label) pairs or ImageCentroids, got {describe(samples)}")
    if total is None and hasattr(samples, "__len__"):
        total = len(samples)  # type: ignore[arg-type]

    kw = dict(k_fg=check_int_param(k_fg, "k_fg", 1), k_bg=check_int_param(k_bg, "k_bg", 1),
              ignore_index=ignore_index, normalize=normalize, seed=seed, max_iter=max_iter, tol=tol,
              n_init=n_init)
    rank, world = _dist_info(process_group)
    error: Optional[BaseException] = None
    try:
        state = _accumulate(samples, num_classes, batch_size, progress, total, kw, rank, world)
    except (ValueError, TypeError) as e:
        if world == 1:
            raise
        state, error = None, e  # let the other ranks know instead of leaving them waiting
    if world > 1:
        state = _gather_states(state, error, process_group)

    bg_sum, n_bg, n_images, dim, candidates = (
        state["bg_sum"], state["n_bg"], state["n_images"], state["dim"], state["candidates"])
    if n_images == 0:
        raise ValueError("samples is empty: select_centroids needs at least one image")
    if n_bg == 0 or bg_sum is None:
        raise ValueError(
            f"samples: no background centroid in any of the {n_images} images: Eq. 1 measures distances to "
            "the background, so at least one pseudo_label must contain background (0) pixels"
        )
    assert dim is not None
    bg_mean = bg_sum / n_bg
    device = bg_mean.device
    C1 = num_classes + 1
    cents = torch.zeros(C1, dim, dtype=torch.float32, device=device)
    valid = torch.zeros(C1, dtype=torch.bool, device=device)
    n_cand = torch.zeros(C1, dtype=torch.long, device=device)
    n_sel = torch.zeros(C1, dtype=torch.long, device=device)
    cut = torch.full((C1,), float("nan"), dtype=torch.float64, device=device)
    n_cand[0] = n_bg
    for c, tagged in sorted(candidates.items()):
        # Stream order (global image index, then centroid order within the image): the order
        # that decides ties, identical for one process and for any number of ranks.
        tagged.sort(key=lambda t: t[0])
        v = torch.cat([x.to(device) for _, x in tagged])
        dist = background_distance(v, bg_mean)
        order = torch.sort(dist, descending=True, stable=True).indices
        k = num_selected(v.shape[0], alpha)
        cents[c] = v[order[:k]].double().mean(0).float()
        valid[c] = True
        n_cand[c] = v.shape[0]
        n_sel[c] = k
        cut[c] = dist[order[k - 1]]
    config = dict(alpha=alpha, k_fg=kw["k_fg"], k_bg=kw["k_bg"], normalize=bool(normalize), seed=int(seed))
    return DebiasedCentroids(cents, valid, n_cand, n_sel, cut, bg_mean.float(), n_images, config)
