"""The stream of samples of :func:`mars_plugin.method.selection.select_centroids` (Eq. 1-3):
its (features, pseudo_label) pairs checked, held (copied when they read the caller's memory)
and clustered batch_size at a time (:func:`_iter_batches`), and one process's running state
(:class:`_Accumulator`): the background sum of Eq. 1 and every class's tagged candidate
centroids, spilled to plain ``.npy`` files beyond a memory budget.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import check_float_tensor, check_label_tensor, describe
from mars_plugin.formats.bounded_load import numpy_load
from mars_plugin.engines.kmeans import l2_norm, l2_normalize
from mars_plugin.method.centroid_pixels import _Workspace
from mars_plugin.method.centroids import GroupCentroids, ImageCentroids, _cluster_groups, check_embedding_size


def _light_pair(s, i: int, ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank and type checks of one (features, pseudo_label) sample; values are checked per batch."""
    if not isinstance(s, (tuple, list)) or len(s) != 2:
        raise TypeError(
            f"samples[{i}] must be a (features, pseudo_label) pair or an ImageCentroids, got {describe(s)}"
        )
    try:
        f = check_float_tensor(s[0], "features", (3,), "(D, H, W) for one image", finite=False)
        check_embedding_size(f, "features")
        y = check_label_tensor(s[1], "pseudo_label", (2,), "(H, W) for one image", ignore_index=ignore_index,
                               values=False)
    except (TypeError, ValueError) as e:
        raise type(e)(f"samples[{i}]: {e}") from None
    return f, y


def _shares_memory(t: torch.Tensor, src: object) -> bool:
    """Whether ``t`` (converted from the caller's ``src``) reads the caller's memory."""
    if isinstance(src, torch.Tensor):
        return t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    if isinstance(src, np.ndarray) and t.device.type == "cpu":
        return bool(np.may_share_memory(t.detach().numpy(), src))
    return False  # built from Python lists: already ours


def _owned(t: torch.Tensor, src: object, workspace: "_Workspace", slot: str) -> torch.Tensor:
    """``t``, or a copy of it when it reads the caller's memory.

    A sample held in a batch past the next ``next()`` must not be the caller's tensor: a
    generator that refills one buffer per image (e.g. a DataLoader-like reader writing in
    place) would change the held images before they are clustered. The copy is one memcpy of
    the image in its own dtype, into a buffer of ``workspace`` reused from batch to batch
    (fresh memory per image would cost page faults on top).
    """
    if not _shares_memory(t, src):
        return t
    return workspace.get(slot, tuple(t.shape), t.dtype, t.device).copy_(t.detach())


def _iter_batches(samples, *, batch_size, progress, total, device, seen, num_classes, **kw):
    """Yield GroupCentroids (on the CPU) of batch_size (features, label) pairs at a time, or an
    ImageCentroids passed through, in stream order. ``device`` (None: the features' device) runs
    the K-means."""
    pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
    first = 0  # stream index of pending[0]
    workspace = _Workspace()  # scratch buffers reused by every batch of this call
    dim: Optional[int] = None
    it = samples
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(samples, total=total, desc="select_centroids", unit="img")

    def flush():
        name = lambda j, first=first: f"samples[{first + j}]"  # noqa: E731
        gc = _cluster_groups([f for f, _ in pending], [y for _, y in pending], device=device, name=name,
                             max_label=num_classes, workspace=workspace, **kw)
        return gc.to("cpu")

    for i, s in enumerate(it):
        if isinstance(s, ImageCentroids):
            s.check(f"samples[{i}]")  # its tensors may have changed (NaN) since it was built
            if dim is not None and s.dim != dim:
                raise ValueError(f"samples[{i}]: features have embedding size D={s.dim}, but the first image has D={dim}")
            dim = s.dim
            seen.setdefault("device", s.bg.device)
            if pending:
                yield flush()
                pending = []
            yield s
            continue
        f, y = _light_pair(s, i, kw["ignore_index"])
        if dim is not None and f.shape[0] != dim:
            raise ValueError(
                f"samples[{i}]: features have embedding size D={f.shape[0]}, but the first image has D={dim}"
            )
        dim = int(f.shape[0])
        seen.setdefault("device", f.device)
        if not pending:
            first = i
        pending.append((f, y))
        if len(pending) >= batch_size:
            yield flush()
            pending = []
        else:
            # Held past the next next(): never the caller's memory (the last image of a batch
            # is clustered before that and needs no copy).
            j = len(pending) - 1
            pending[-1] = (_owned(f, s[0], workspace, f"held_f{j}"), _owned(y, s[1], workspace, f"held_y{j}"))
    if pending:
        yield flush()


class _Accumulator:
    """One process's running state: the background sum and every class's tagged candidates.

    Candidates are kept as chunks ``[tags (M,), centroids (M, D)]`` on the CPU, where a tag is
    the image's global stream index: ordering by (tag, row within the chunk) restores the
    single-process stream order whatever the batching and the number of ranks (the rows of one
    image always sit together, in centroid order, in one chunk).

    With ``spill_dir``, once the centroids held exceed ``spill_bytes``, every class's chunks in
    memory are concatenated and written to one ``.npy`` file per class in a temporary folder
    inside ``spill_dir`` (removed by :meth:`cleanup`); only the tags stay in memory.
    """

    def __init__(self, num_classes: int, ignore_index: int, rank: int, world: int,
                 spill_dir: Optional[str] = None, spill_bytes: int = 0) -> None:
        self.num_classes, self.ignore_index, self.rank, self.world = num_classes, ignore_index, rank, world
        self.bg_sum: Optional[torch.Tensor] = None
        self.n_bg = 0
        self.n_images = 0
        self.dim: Optional[int] = None
        self.candidates: Dict[int, List[list]] = {}
        self.spill_dir, self.spill_bytes = spill_dir, spill_bytes
        self.held_bytes = 0
        self.spilled_files = 0
        self._tmp: Optional[str] = None

    def _spill(self) -> None:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="mars_candidates_", dir=self.spill_dir)
        for c, chunks in self.candidates.items():
            in_memory = [ch for ch in chunks if isinstance(ch[1], torch.Tensor)]
            if not in_memory:
                continue
            # Chunks in memory always follow the spilled ones (stream order), so they merge
            # into one chunk; row order inside it stays the stream order.
            tags = torch.cat([ch[0] for ch in in_memory])
            path = os.path.join(self._tmp, f"class{c}_{self.spilled_files:06d}.npy")
            np.save(path, torch.cat([ch[1] for ch in in_memory]).numpy(), allow_pickle=False)
            self.spilled_files += 1
            self.candidates[c] = [ch for ch in chunks if not isinstance(ch[1], torch.Tensor)] + [[tags, path]]
        self.held_bytes = 0

    @staticmethod
    def vectors(chunk: list) -> torch.Tensor:
        """A chunk's centroids, read back from disk if it was spilled (plain .npy, no pickle)."""
        v = chunk[1]
        return v if isinstance(v, torch.Tensor) else torch.from_numpy(numpy_load(v))

    def cleanup(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _check_classes(self, labels: torch.Tensor, images: torch.Tensor) -> None:
        bad = labels > self.num_classes
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise ValueError(
                f"samples[{self.n_images + int(images[j])}]: pseudo_label holds class {int(labels[j])} but "
                f"num_classes={self.num_classes}; expected ids 0..{self.num_classes} or "
                f"ignore_index={self.ignore_index}"
            )

    def add(self, batch: Union[GroupCentroids, ImageCentroids]) -> None:
        if isinstance(batch, ImageCentroids):
            fg = sorted(batch.fg.items())
            kmax = max([batch.bg.shape[0]] + [v.shape[0] for _, v in fg] + [1])
            rows = [(0, batch.bg)] if batch.bg.shape[0] else []
            rows += fg
            cents = torch.zeros(len(rows), kmax, batch.dim, dtype=batch.bg.dtype)
            for g, (_, v) in enumerate(rows):
                cents[g, : v.shape[0]] = v.detach().cpu()
            batch = GroupCentroids(torch.zeros(len(rows), dtype=torch.long),
                                   torch.tensor([c for c, _ in rows], dtype=torch.long), cents,
                                   torch.tensor([v.shape[0] for _, v in rows], dtype=torch.long), 1)
        self._check_classes(batch.label, batch.image)
        dim = int(batch.centroids.shape[-1])
        if self.dim is None:
            self.dim = dim
        valid = torch.arange(batch.centroids.shape[1])[None, :] < batch.count[:, None]  # (G, Kmax)
        # A zero centroid (from all-zero features) has no direction: it is no centroid, neither
        # a background one in Eq. 1's mean nor a candidate of Eq. 2 (a class whose candidates
        # are all zero gets no centroid, as a plain tensor's zero row means in debias).
        valid &= l2_norm(batch.centroids, dim=-1) > 0
        is_bg = batch.label == 0
        if bool(is_bg.any()):
            bg = l2_normalize(batch.centroids[is_bg].double(), dim=-1) * valid[is_bg][:, :, None]
            s = bg.sum((0, 1))
            self.bg_sum = s if self.bg_sum is None else self.bg_sum + s
            self.n_bg += int(valid[is_bg].sum())
        tags = (self.n_images + batch.image) * self.world + self.rank  # global stream index per group
        # Every valid foreground centroid as one row, then the rows sorted by class (stable:
        # inside a class, stream order: image, then centroid) and cut into one chunk per class.
        fg = ~is_bg
        v = valid[fg]
        row_label = batch.label[fg][:, None].expand_as(v)[v]
        by_class = torch.sort(row_label, stable=True).indices
        row_label = row_label[by_class]
        row_tag = tags[fg][:, None].expand_as(v)[v][by_class]
        row_vec = batch.centroids[fg][v][by_class].detach()
        classes, sizes = torch.unique_consecutive(row_label, return_counts=True)
        sizes = sizes.tolist()
        for c, tag, vec in zip(classes.tolist(), row_tag.split(sizes), row_vec.split(sizes)):
            self.candidates.setdefault(int(c), []).append([tag, vec])
        self.held_bytes += row_vec.numel() * row_vec.element_size()
        self.n_images += batch.num_images
        if self.spill_dir is not None and self.held_bytes > self.spill_bytes:
            self._spill()

    def summary(self) -> Dict[str, object]:
        """What the other ranks need first: sums and counts, never the candidates."""
        return dict(bg_sum=self.bg_sum, n_bg=self.n_bg, n_images=self.n_images, dim=self.dim)

    def _merge_chunks(self) -> None:
        """Join each run of in-memory chunks of a class into one chunk (same rows, same order),
        so that scoring and summing take one tensor operation per run, not one per batch;
        spilled chunks stay apart (one is read at a time)."""
        for c, chunks in self.candidates.items():
            runs: List[List[list]] = []  # consecutive in-memory chunks together, spilled ones alone
            for ch in chunks:
                in_memory = isinstance(ch[1], torch.Tensor)
                if in_memory and runs and isinstance(runs[-1][-1][1], torch.Tensor):
                    runs[-1].append(ch)
                else:
                    runs.append([ch])
            self.candidates[c] = [[torch.cat([ch[0] for ch in run]), torch.cat([ch[1] for ch in run])]
                                  if len(run) > 1 else run[0] for run in runs]

    def distances(self, bg_mean: torch.Tensor, distance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                  ) -> Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per class, Eq. 1 distance, tag and row-in-chunk of every local candidate (in chunk order).

        ``distance(candidates, bg_mean)`` is Eq. 1,
        :func:`mars_plugin.method.selection.background_distance` (passed in: the equation stays
        in its module, which imports this one)."""
        self._merge_chunks()
        out = {}
        for c, chunks in self.candidates.items():
            d = [distance(self.vectors(ch), bg_mean) for ch in chunks]
            rows = [torch.arange(ch[0].numel()) for ch in chunks]
            out[c] = (torch.cat(d), torch.cat([ch[0] for ch in chunks]), torch.cat(rows))
        return out

    def selected_sums(self, chosen: Dict[int, torch.Tensor], dim: int) -> Dict[int, torch.Tensor]:
        """Per class, the float64 sum of the local candidates flagged in ``chosen[c]`` (local order)."""
        out = {}
        for c, flags in chosen.items():
            total = torch.zeros(dim, dtype=torch.float64)
            start = 0
            for ch in self.candidates.get(c, []):
                n = ch[0].numel()
                f = flags[start : start + n]
                if bool(f.any()):
                    total += self.vectors(ch)[f].double().sum(0)
                start += n
            out[c] = total
        return out
