"""Per-image, per-class centroids (MARS Sec. 3.2, before Eq. 1).

For one image, the pixel embeddings F (D, H, W) are grouped by the WSSS pseudo label Y^b and
each group is clustered: K_fg centroids per foreground class (2: target and biased object) and
K_bg for the background. All groups of all images in a call are solved in one batched K-means.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ._checks import check_float_tensor, check_int_param, check_label_tensor, describe
from .kmeans import batched_kmeans

__all__ = ["ImageCentroids", "image_centroids", "resize_label", "problem_seed"]


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
        for c, v in self.fg.items():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
                raise ValueError(f"ImageCentroids.fg keys must be class ids >= 1, got {c!r}")
            if not isinstance(v, torch.Tensor) or v.ndim != 2 or v.shape[1] != self.dim or v.shape[0] < 1:
                raise ValueError(
                    f"ImageCentroids.fg[{c}] must be a (k>=1, D={self.dim}) tensor, got {describe(v)}"
                )

    def to(self, device: Union[str, torch.device]) -> "ImageCentroids":
        return ImageCentroids({c: v.to(device) for c, v in self.fg.items()}, self.bg.to(device))


def problem_seed(seed: int, class_id: int) -> int:
    """Seed of the K-means problem of one class: independent streams per class, same per image.

    Using the same stream for a class in every image keeps batch == single-image results.
    """
    return int(np.random.SeedSequence([int(seed) % 2**32, int(class_id)]).generate_state(2, np.uint64)[0] >> 1)


def resize_label(label: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """Nearest-neighbour resize of a (H, W) or (B, H, W) integer label map to ``size``.

    Uses the pixel-centre rule (torch ``nearest-exact``): output pixel i reads input pixel
    ``min(floor((i + 0.5) * H_in / H_out), H_in - 1)``, so a down-sampled label stays centred on
    the feature cells of a ViT/CNN feature grid instead of drifting to their top-left corners.
    """
    if tuple(label.shape[-2:]) == tuple(size):
        return label
    h_in, w_in = int(label.shape[-2]), int(label.shape[-1])
    h_out, w_out = int(size[0]), int(size[1])
    # Integer arithmetic, floor((i + 0.5) * n_in / n_out) == ((2i + 1) * n_in) // (2 n_out):
    # F.interpolate's float scale is off by one where that product is an exact integer
    # (e.g. 6 -> 37 rows, i = 18 reads row 2 instead of 3).
    iy = torch.arange(h_out, device=label.device)
    ix = torch.arange(w_out, device=label.device)
    iy = (((2 * iy + 1) * h_in) // (2 * h_out)).clamp_max(h_in - 1)
    ix = (((2 * ix + 1) * w_in) // (2 * w_out)).clamp_max(w_in - 1)
    return label[..., iy[:, None], ix[None, :]].long()


def _as_batch(features, pseudo_label, ignore_index):
    f = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
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


def _cluster_images(
    images: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    *,
    k_fg: int,
    k_bg: int,
    ignore_index: int,
    normalize: bool,
    seed: int,
    max_iter: int,
    tol: float,
    n_init: int,
) -> List[ImageCentroids]:
    """Cluster every class of every (features (D,h,w), label (H,W)) pair in one K-means call.

    The images may differ in size and in D only if the caller allows it; every group becomes one
    padded problem, so sizes never need to match.
    """
    dims = sorted({int(f.shape[0]) for f, _ in images})
    if len(dims) > 1:
        raise ValueError(f"all features in one call must share the embedding size D, got D in {dims}")
    groups: List[torch.Tensor] = []
    keys: List[Tuple[int, int]] = []  # (image index, class id)
    for i, (f, y) in enumerate(images):
        y = resize_label(y, tuple(f.shape[-2:]))
        if normalize:
            f = F.normalize(f, dim=0)
        flat_f = f.reshape(f.shape[0], -1)
        flat_y = y.reshape(-1)
        for c in torch.unique(flat_y).tolist():
            if c == ignore_index:
                continue
            groups.append(flat_f[:, flat_y == c].T)
            keys.append((i, int(c)))

    out = [ImageCentroids({}, images[i][0].new_zeros(0, images[i][0].shape[0])) for i in range(len(images))]
    if not groups:
        return out
    device = groups[0].device
    sizes = [int(g.shape[0]) for g in groups]
    # Problems are padded to the largest of their call: bucket them by size (each bucket's
    # smallest problem at least half its largest) so that padding never doubles the work.
    # Every problem keeps its own seed and stopping rule, so bucketing leaves results unchanged.
    order = sorted(range(len(groups)), key=lambda g: -sizes[g])
    buckets: List[List[int]] = []
    for g in order:
        if buckets and sizes[g] * 2 >= sizes[buckets[-1][0]]:
            buckets[-1].append(g)
        else:
            buckets.append([g])
    for bucket in buckets:
        n_max = sizes[bucket[0]]
        pts = torch.zeros(len(bucket), n_max, dims[0], dtype=groups[0].dtype, device=device)
        mask = torch.zeros(len(bucket), n_max, dtype=torch.bool, device=device)
        for j, g in enumerate(bucket):
            pts[j, : sizes[g]] = groups[g]
            mask[j, : sizes[g]] = True
        ks = [k_bg if keys[g][1] == 0 else k_fg for g in bucket]
        seeds = [problem_seed(seed, keys[g][1]) for g in bucket]
        res = batched_kmeans(pts, mask, ks, seeds=seeds, max_iter=max_iter, tol=tol, n_init=n_init)
        for j, g in enumerate(bucket):
            i, c = keys[g]
            cents = res.centroids[j][res.valid[j]]
            if c == 0:
                out[i].bg = cents
            else:
                out[i].fg[c] = cents
    return out


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
) -> Union[ImageCentroids, List[ImageCentroids]]:
    """K-means centroids of every class region of one image or a batch (Sec. 3.2).

    Shapes:
        features: (D, H, W) or (B, D, H, W) float pixel embeddings of the USS model.
        pseudo_label: (H', W') or (B, H', W') int WSSS label, values 0..C (0 = background) or
            ``ignore_index``. When (H', W') differs from (H, W), the label is resized to the
            feature grid by nearest neighbour (pixel-centre rule, see :func:`resize_label`).

    Args:
        k_fg: clusters per foreground class (the paper's K_fg = 2: target and biased object).
        k_bg: clusters for the background (K_bg, 2 in the paper).
        ignore_index: label value excluded from every group.
        normalize: L2-normalise each pixel embedding first, so that Euclidean K-means follows the
            cosine geometry of Eq. 1 and Eq. 4.
        seed: seed of the k-means++ draws; the same seed gives the same result, whether an image
            is passed alone or inside a batch.
        max_iter, tol, n_init: K-means controls (see :func:`mars_plugin.kmeans.batched_kmeans`).

    Returns:
        :class:`ImageCentroids` for a single image, a list of them for a batch. A class with
        fewer distinct pixels than K gets one centroid per distinct pixel; an image without
        background gets an empty (0, D) ``bg``.
    """
    k_fg = check_int_param(k_fg, "k_fg", 1)
    k_bg = check_int_param(k_bg, "k_bg", 1)
    f, y, single = _as_batch(features, pseudo_label, ignore_index)
    out = _cluster_images(
        [(f[b], y[b]) for b in range(f.shape[0])],
        k_fg=k_fg, k_bg=k_bg, ignore_index=ignore_index, normalize=normalize,
        seed=seed, max_iter=max_iter, tol=tol, n_init=n_init,
    )
    return out[0] if single else out
