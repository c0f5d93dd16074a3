"""Per-image, per-class centroids (MARS Sec. 3.2, before Eq. 1).

For one image, the pixel embeddings F (D, H, W) are grouped by the WSSS pseudo label Y^b and
each group is clustered: K_fg centroids per foreground class (2: target and biased object) and
K_bg for the background. All groups of all images in a call are solved in one batched K-means
(torch, or the compiled kernel); the pixels are grouped by :mod:`mars_plugin.method.centroid_pixels`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import (
    check_finite,
    check_float_tensor,
    check_int_param,
    check_label_tensor,
    check_seed,
    describe,
)
import mars_plugin._interrupt as _interrupt
from mars_plugin.engines import kmeans_compiled
from mars_plugin.engines.kmeans import _kmeans_padded, _uniforms, batched_kmeans, seeding_trials
from mars_plugin.method.centroid_pixels import (
    _check_label_bounds,
    _check_reserved_ids,
    _PixelGroups,
    _pixels_by_group,
    _Workspace,
    resize_label,
)

__all__ = ["BACKENDS", "GroupCentroids", "ImageCentroids", "check_backend", "check_embedding_size", "image_centroids",
           "problem_seed"]

#: K-means implementations: "compiled" (numba kernel, CPU), "torch" (batched torch, any
#: device), "auto" (compiled on the CPU when numba is installed, else torch).
BACKENDS = ("auto", "compiled", "torch")


def check_backend(backend: str) -> Optional[str]:
    """Validate a ``backend`` argument; returns None for "auto" (decided per batch)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "compiled" and not kmeans_compiled.available():
        raise ValueError("backend='compiled' needs numba (pip install 'mars-plugin[fast]'); "
                         "it is not installed, or MARS_NO_NUMBA is set")
    return None if backend == "auto" else backend


@dataclass
class ImageCentroids:
    """Centroids of one image.

    Attributes:
        fg: foreground class id (1..C) -> (k, D) centroids, k = min(k_fg, distinct pixels).
        bg: (k, D) background centroids, k = min(k_bg, distinct pixels); (0, D) when the image
            has no background pixel.
    """

    fg: Dict[int, torch.Tensor]
    bg: torch.Tensor
    dim: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.bg, torch.Tensor) or self.bg.ndim != 2:
            raise ValueError(f"ImageCentroids.bg must be a (k, D) tensor, got {describe(self.bg)}")
        self.dim = int(self.bg.shape[1])
        self.check()

    def check(self, name: str = "ImageCentroids") -> None:
        """Validate the shapes and values (again: the tensors may have changed since); ``name``
        prefixes the errors.

        A NaN/Inf centroid would pass for a valid one and then remove its whole class in
        :func:`mars_plugin.debias_labels`: it is refused here. An all-zero centroid (a class
        whose features are zero) is allowed but counts as no centroid downstream.
        """
        if not isinstance(self.bg, torch.Tensor) or self.bg.ndim != 2 or self.bg.shape[1] != self.dim:
            raise ValueError(f"{name}.bg must be a (k, D) tensor, got {describe(self.bg)}")
        check_finite(self.bg, f"{name}.bg")
        for c, v in self.fg.items():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
                raise ValueError(f"{name}.fg keys must be class ids >= 1, got {c!r}")
            if not isinstance(v, torch.Tensor) or v.ndim != 2 or v.shape[1] != self.dim or v.shape[0] < 1:
                raise ValueError(
                    f"{name}.fg[{c}] must be a (k>=1, D={self.dim}) tensor, got {describe(v)}"
                )
            check_finite(v, f"{name}.fg[{c}]")

    def to(self, device: Union[str, torch.device]) -> "ImageCentroids":
        return ImageCentroids({c: v.to(device) for c, v in self.fg.items()}, self.bg.to(device))


@functools.lru_cache(maxsize=65536)
def problem_seed(seed: int, class_id: int) -> int:
    """Seed of the K-means problem of one class: independent streams per class, same per image.

    Using the same stream for a class in every image keeps batch == single-image results.
    """
    return int(np.random.SeedSequence([int(seed) % 2**32, int(class_id)]).generate_state(2, np.uint64)[0] >> 1)


def check_embedding_size(f: torch.Tensor, name: str) -> None:
    """Refuse D = 0 (no channel: nothing to cluster or compare) with the house error."""
    if f.shape[-3] < 1:
        raise ValueError(f"{name}: got {describe(f)}, expected at least one channel (D >= 1)")


def _as_batch(features, pseudo_label, ignore_index):
    f = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
    check_embedding_size(f, "features")
    single = f.ndim == 3
    y = check_label_tensor(
        pseudo_label, "pseudo_label", (2,) if single else (3,),
        "(H, W)" if single else "(B, H, W)", ignore_index=ignore_index,
    )
    if single:
        f, y = f[None], y[None]
    if y.shape[0] != f.shape[0]:
        raise ValueError(
            f"features and pseudo_label must hold the same number of images, got {f.shape[0]} and {y.shape[0]}"
        )
    return f, y.to(f.device), single


@dataclass
class GroupCentroids:
    """Centroids of every (image, class) group of a batch of images, in one padded block.

    Groups are ordered by image, then by class id (background 0 first).

    Attributes:
        image: (G,) long, index of the group's image within the batch.
        label: (G,) long, class id of the group (0 = background).
        centroids: (G, Kmax, D) float; rows past a group's ``count`` are zeros.
        count: (G,) long, number of centroids of each group, min(K, distinct pixels).
        num_images: images in the batch (some may have no group: only ignored pixels).
    """

    image: torch.Tensor
    label: torch.Tensor
    centroids: torch.Tensor
    count: torch.Tensor
    num_images: int

    def to(self, device: Union[str, torch.device]) -> "GroupCentroids":
        return GroupCentroids(self.image.to(device), self.label.to(device), self.centroids.to(device),
                              self.count.to(device), self.num_images)

    def per_image(self) -> List[ImageCentroids]:
        """The same centroids as one :class:`ImageCentroids` per image."""
        dim = int(self.centroids.shape[-1])
        out = [ImageCentroids({}, self.centroids.new_zeros(0, dim)) for _ in range(self.num_images)]
        for g, (i, c, n) in enumerate(zip(self.image.tolist(), self.label.tolist(), self.count.tolist())):
            cents = self.centroids[g, :n]
            if c == 0:
                out[i].bg = cents
            else:
                out[i].fg[c] = cents
        return out


def _cluster_groups(
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    *,
    k_fg: int,
    k_bg: int,
    ignore_index: int,
    normalize: bool,
    seed: int,
    max_iter: int,
    tol: float,
    n_init: int,
    device: Optional[torch.device] = None,
    name=None,
    max_label: Optional[int] = None,
    bucket_ratio: Optional[float] = None,
    workspace: Optional[_Workspace] = None,
    backend: Optional[str] = None,
) -> GroupCentroids:
    """Cluster every class of every (features (D,h,w), label (H,W)) pair in batched K-means.

    All images must share D; their grids may differ. Runs on ``device`` (default: where the
    features are). Every group keeps its own seed and stopping rule, so the result of an image
    does not depend on the other images of the batch. ``name(i)`` turns on batch-level checks
    of the values (negative labels, NaN/Inf features) and names image i in their errors.
    ``bucket_ratio`` (default: 2 on the CPU, one bucket on a GPU) bounds the ratio of the largest
    to the smallest group padded together; it changes the speed, never the result.
    ``workspace`` keeps scratch buffers from one call to the next (see
    :class:`~mars_plugin.method.centroid_pixels._Workspace`).
    ``backend``: "compiled" (the numba kernel of :mod:`mars_plugin.engines.kmeans_compiled`, CPU,
    float32), "torch" (batched torch K-means, any device), or None: compiled when numba is
    installed, the K-means runs on the CPU, n_init == 1 and no feature is float64 (those keep
    the torch path, which runs n_init seedings and float64 arithmetic).
    """
    dims = sorted({int(f.shape[0]) for f in features})
    if len(dims) > 1:
        raise ValueError(f"all features in one call must share the embedding size D, got D in {dims}")
    # K-means is not differentiable: both backends read the values only (the torch path's
    # out= copies would refuse a tensor that requires grad).
    features = [f.detach() for f in features]
    ws = workspace if workspace is not None else _Workspace()
    if _choose_backend(features, backend, device, n_init) == "compiled":
        with _interrupt.polled():  # a Ctrl-C waits for the kernel's return (it became a SystemError)
            return _cluster_compiled(features, labels, k_fg=k_fg, k_bg=k_bg, ignore_index=ignore_index,
                                     normalize=normalize, seed=seed, max_iter=max_iter, tol=tol, name=name,
                                     max_label=max_label)
    groups = _pixels_by_group(features, labels, ignore_index=ignore_index, normalize=normalize, device=device,
                              name=name, max_label=max_label, workspace=ws)
    return _cluster_torch(groups, len(features), k_fg=k_fg, k_bg=k_bg, seed=seed, max_iter=max_iter, tol=tol,
                          n_init=n_init, bucket_ratio=bucket_ratio, workspace=ws)


def _choose_backend(features: Sequence[torch.Tensor], backend: Optional[str], device, n_init: int) -> str:
    """The K-means backend of one :func:`_cluster_groups` call: None resolved, the choice checked."""
    if backend is None:
        on_cpu = (torch.device(device) if device is not None else features[0].device).type == "cpu"
        backend = "compiled" if (on_cpu and n_init == 1 and kmeans_compiled.available()
                                 and all(f.dtype != torch.float64 for f in features)) else "torch"
    if backend not in ("compiled", "torch"):
        raise ValueError(f"backend must be 'compiled', 'torch' or None, got {backend!r}")
    if backend == "compiled":
        if n_init != 1:
            raise ValueError(f"backend='compiled' runs one seeding per problem, got n_init={n_init}; "
                             "use backend='torch' or 'auto' for n_init > 1")
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"backend='compiled' runs on the CPU, got device={device!r}; use 'torch' or 'auto'")
    return backend


def _cluster_torch(groups: _PixelGroups, num_images: int, *, k_fg: int, k_bg: int, seed: int, max_iter: int, tol: float,
                   n_init: int, bucket_ratio: Optional[float], workspace: _Workspace) -> GroupCentroids:
    """:func:`_cluster_groups` through the batched torch K-means, one padded call per size bucket."""
    x, g_lab, g_size = groups.x, groups.label, groups.size
    G, D = len(g_size), int(x.shape[1])
    ks_asked = [k_bg if c == 0 else k_fg for c in g_lab]
    # A group has at most one centroid per pixel: K past its size would only allocate rows
    # never filled (memory follows the pixels, never K). Its draws stay those of the K asked
    # (same trials; the rows past n are never read), so the result does not change.
    trials = [seeding_trials(k) for k in ks_asked]
    ks = [min(k, n) for k, n in zip(ks_asked, g_size)]
    kmax = max(ks, default=1)
    img_t, lab_t = torch.tensor(groups.image, dtype=torch.long), torch.tensor(g_lab, dtype=torch.long)
    cents = x.new_zeros(G, kmax, D)
    count = torch.zeros(G, dtype=torch.long)
    # On a GPU the padding is nearly free and every kernel launch costs: one bucket.
    ratio = bucket_ratio if bucket_ratio is not None else (2 if x.device.type == "cpu" else float("inf"))
    for bucket in _size_buckets(g_size, ratio):
        idx = torch.tensor(bucket, dtype=torch.long)
        pts, mask = _bucket_points(groups, bucket, workspace)
        b_seeds = [problem_seed(seed, g_lab[g]) for g in bucket]
        if n_init > 1:
            # batched_kmeans bounds K by the bucket's size itself and keeps each K's trials.
            res = batched_kmeans(pts, mask, [ks_asked[g] for g in bucket], seeds=b_seeds, max_iter=max_iter,
                                 tol=tol, n_init=n_init)
            c, v = res.centroids[:, :kmax], res.valid[:, :kmax]  # past kmax: never valid
        else:
            c, v, _ = _kmeans_padded(pts, mask, [ks[g] for g in bucket], b_seeds, max_iter, tol,
                                     [trials[g] for g in bucket])
        # k-means++ fills the valid centroids first, so each group's centroids are a prefix.
        cents[idx.to(x.device), : c.shape[1]] = c
        count[idx] = v.sum(1).cpu()
    return GroupCentroids(img_t, lab_t, cents, count, num_images)


def _size_buckets(g_size: Sequence[int], ratio: float) -> List[List[int]]:
    """The groups, largest first, cut into buckets whose smallest is at least 1/ratio of their largest."""
    # Problems are padded to the largest of their call: bucket them by size (each bucket's
    # smallest problem at least half its largest) so that padding never doubles the work.
    buckets: List[List[int]] = []
    for g in sorted(range(len(g_size)), key=lambda g: -g_size[g]):
        if buckets and g_size[g] * ratio >= g_size[buckets[-1][0]]:
            buckets[-1].append(g)
        else:
            buckets.append([g])
    return buckets


def _bucket_points(groups: _PixelGroups, bucket: List[int], workspace: _Workspace) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (G_b, n_max, D) padded points of a bucket's groups (padding reads the zero row) and their mask."""
    x, order = groups.x, groups.order
    n_max, D, zero_row = groups.size[bucket[0]], int(x.shape[1]), x.shape[0] - 1
    start = torch.tensor([groups.start[g] for g in bucket], device=x.device)
    size = torch.tensor([groups.size[g] for g in bucket], device=x.device)
    offs = torch.arange(n_max, device=x.device)
    mask = offs[None, :] < size[:, None]
    rows = order[(start[:, None] + offs[None, :]).clamp_max_(max(order.numel() - 1, 0))]
    rows = torch.where(mask, rows, zero_row)  # padded points read the zero row
    pts = workspace.get("pts", (len(bucket), n_max, D), x.dtype, x.device)
    torch.index_select(x, 0, rows.reshape(-1), out=pts.view(-1, D))
    return pts, mask


def _cluster_compiled(features, labels, *, k_fg, k_bg, ignore_index, normalize, seed, max_iter, tol, name,
                      max_label) -> GroupCentroids:
    """:func:`_cluster_groups` through the compiled kernels of :mod:`mars_plugin.engines.kmeans_compiled`.

    The labels are grouped by a counting sort (no key sort, no padding); the kernel reads each
    image's features where they are, in their own dtype when every image is float16 or every
    one float32 (it widens float16 exactly as it gathers a pixel; anything else is widened to
    float32 here first). With ``name``, bad values raise: labels through their per-image range;
    NaN/Inf features through the kernel's flag on the pixels it clusters and a check of the
    ignored pixels, then ``check_finite`` names the image.
    """
    B, D = len(features), int(features[0].shape[0])
    n_pix = np.array([int(f.shape[-1] * f.shape[-2]) for f in features], dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(n_pix)])
    # Labels on their feature grids, one after the other; the range check reads the full-size
    # labels (a class can vanish in the resize), the grouping the resized ones.
    grid = [resize_label(y, tuple(f.shape[-2:])) for f, y in zip(features, labels)]
    y_flat = torch.cat([y.reshape(-1) for y in grid]).numpy()
    if all(g is y for g, y in zip(grid, labels)):
        full_flat, full_offs = y_flat, offs
    else:
        full_flat = torch.cat([y.reshape(-1) for y in labels]).numpy()
        full_offs = np.concatenate([[0], np.cumsum([y.numel() for y in labels])])
    lo, hi = kmeans_compiled.label_range(full_flat, full_offs, ignore_index)
    # Without ``name`` (callers that checked the labels already) the bound C is not known, but
    # a negative id is still refused: the counting sort could not place it.
    _check_label_bounds(lo, hi, name or (lambda i: f"pseudo_label[{i}]"), max_label if name else None)
    n_labels = int(hi.max(initial=0)) + 1
    ids = None
    if n_labels > max(256, y_flat.size):
        # Class ids far beyond the pixel count (not from the public functions, which bound ids by 253):
        # group the ranks of the ids present instead, so that the (B, ids) count table
        # follows the pixels; ignored pixels get the rank past the last.
        keep = y_flat != ignore_index
        ids = np.unique(y_flat[keep])
        y_flat = np.where(keep, np.searchsorted(ids, y_flat), ids.size).astype(np.int64)
        n_labels, ignore_index = ids.size, ids.size
    counts, order, ignored = kmeans_compiled.group_pixels(y_flat, offs, ignore_index, n_labels)
    g_img, g_lab = np.nonzero(counts)  # row-major: groups in (image, class) order
    g_size = counts[g_img, g_lab]
    if ids is not None:
        g_lab = ids[g_lab]  # ranks back to class ids (ranks keep the ids' order)
    g_start = np.concatenate([[0], np.cumsum(g_size)[:-1]]).astype(np.int64)
    G = len(g_size)
    # At most one centroid per pixel, with the draws (trials) of the K asked: as the torch path.
    ks = np.minimum(np.where(g_lab == 0, k_bg, k_fg), g_size).astype(np.int64)
    trials = np.where(g_lab == 0, seeding_trials(k_bg), seeding_trials(k_fg)).astype(np.int64)
    u = (_uniforms([problem_seed(seed, int(c)) for c in g_lab], ks.tolist(), trials.tolist(),
                   torch.device("cpu")).numpy() if G else np.zeros((0, 1, 1)))
    dtypes = {f.dtype for f in features}
    dtype = dtypes.pop() if len(dtypes) == 1 and features[0].dtype in (torch.float16, torch.float32) else torch.float32
    images = [f.detach().reshape(D, -1).to(dtype).numpy() for f in features]
    cents, valid, _, bad = kmeans_compiled.kmeans_groups(
        images, order, g_start, g_size, ks, u, trials, image=g_img, normalize=normalize, max_iter=max_iter, tol=tol,
        num_threads=torch.get_num_threads())
    if name is not None:
        flagged = set(g_img[bad].tolist())
        if ignored.size:
            # Ignored pixels are clustered by nobody, but the rule is the torch path's: every
            # value of every image must be finite.
            b_of = np.searchsorted(offs, ignored, side="right") - 1
            flagged.update(b_of[kmeans_compiled.nonfinite_pixels(images, b_of, ignored - offs[b_of])].tolist())
        for i in sorted(flagged):
            check_finite(features[i], f"{name(i)}: features")
    return GroupCentroids(torch.from_numpy(g_img), torch.from_numpy(g_lab), torch.from_numpy(cents),
                          torch.from_numpy(valid.sum(1)).long(), B)


def _cluster_images(images: Sequence[Tuple[torch.Tensor, torch.Tensor]], **kw) -> List[ImageCentroids]:
    """:func:`_cluster_groups` on (features, label) pairs, one :class:`ImageCentroids` each."""
    return _cluster_groups([f for f, _ in images], [y for _, y in images], **kw).per_image()


def image_centroids(
    features,
    pseudo_label,
    *,
    k_fg: int = 2,
    k_bg: int = 2,
    ignore_index: int = 255,
    normalize: bool = True,
    seed: int = 0,
    max_iter: int = 100,
    tol: float = 1e-4,
    n_init: int = 1,
    backend: str = "auto",
) -> Union[ImageCentroids, List[ImageCentroids]]:
    """K-means centroids of every class region of one image or a batch (Sec. 3.2).

    Shapes:
        features: (D, H, W) or (B, D, H, W) float pixel embeddings of the USS model.
        pseudo_label: (H', W') or (B, H', W') int WSSS label, values 0..C (0 = background, C <=
            253: 254 and 255 are the biased and ignore bytes, never classes) or ``ignore_index``. When (H', W') differs from (H, W), the label is resized to the
            feature grid by nearest neighbour (pixel-centre rule, see
            :func:`~mars_plugin.method.centroid_pixels.resize_label`).

    Args:
        k_fg: clusters per foreground class (the paper's K_fg = 2: target and biased object).
        k_bg: clusters for the background (K_bg, 2 in the paper).
        ignore_index: label value excluded from every group.
        normalize: L2-normalise each pixel embedding first, so that Euclidean K-means follows the
            cosine geometry of Eq. 1 and Eq. 4.
        seed: seed of the k-means++ draws; the same seed gives the same result, whether an image
            is passed alone or inside a batch.
        max_iter, tol, n_init: K-means controls (see :func:`mars_plugin.engines.kmeans.batched_kmeans`).
        backend: "compiled" runs each K-means problem in the numba kernel of
            :mod:`mars_plugin.engines.kmeans_compiled` (CPU, float32, one seeding: the fast path on a
            CPU); "torch" runs them batched in torch on the features' device; "auto" picks
            compiled when numba is installed, the features are on the CPU, n_init == 1 and not
            float64, else torch. Both are the same algorithm with the same random draws; they
            agree to float32 rounding (a point tied between two centroids to the last bit may
            go either way, which can move a centroid: see the README).

    Returns:
        :class:`ImageCentroids` for a single image, a list of them for a batch. A class with
        fewer distinct pixels than K gets one centroid per distinct pixel; an image without
        background gets an empty (0, D) ``bg``.
    """
    k_fg = check_int_param(k_fg, "k_fg", 1)
    k_bg = check_int_param(k_bg, "k_bg", 1)
    seed = check_seed(seed)
    f, y, single = _as_batch(features, pseudo_label, ignore_index)
    _check_reserved_ids(y, ignore_index)
    out = _cluster_images(
        [(f[b], y[b]) for b in range(f.shape[0])],
        k_fg=k_fg, k_bg=k_bg, ignore_index=ignore_index, normalize=normalize,
        seed=seed, max_iter=max_iter, tol=tol, n_init=n_init, backend=check_backend(backend),
    )
    return out[0] if single else out
