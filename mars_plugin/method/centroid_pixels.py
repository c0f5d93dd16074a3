"""The pixels of a batch grouped by (image, class), the input of Eq. 1's batched K-means
(:func:`mars_plugin.method.centroids.image_centroids`): each label put on its feature grid
(:func:`resize_label`), the labels' and features' values checked per batch, and the pixel
embeddings gathered (L2-normalised) into one reused buffer (:class:`_Workspace`) and sorted by
group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin._checks import MAX_NUM_CLASSES, RESERVED_REASON, _biased_hint, check_finite
from mars_plugin.engines.kmeans import l2_normalize

__all__ = ["resize_label"]


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


def _check_label_values(y: torch.Tensor, name, max_label: Optional[int]) -> None:
    """Batch-level label check: (B, H, W) full-size labels with ignored pixels already set to 0
    hold no negative id and none above ``max_label``; the error names image i by ``name(i)``."""
    flat = y.reshape(y.shape[0], -1)
    if flat.shape[1] == 0:  # images without pixels hold no id
        return
    _check_label_bounds(flat.min(1).values, flat.max(1).values, name, max_label)


def _check_label_bounds(lo, hi, name, max_label: Optional[int]) -> None:
    """:func:`_check_label_values` from each image's smallest and largest id, (B,) tensors or arrays."""
    lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
    bad = (lo < 0) | (hi > max_label) if max_label is not None else lo < 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        if int(lo[i]) < 0:
            raise ValueError(f"{name(i)}: pseudo_label holds the negative value {int(lo[i])}; expected class "
                             "ids >= 0 or ignore_index")
        raise ValueError(f"{name(i)}: pseudo_label holds class {int(hi[i])} but num_classes={max_label}; "
                         f"expected ids 0..{max_label} or ignore_index")


def _check_reserved_ids(y: torch.Tensor, ignore_index: int) -> None:
    """No class id above :data:`~mars_plugin._checks.MAX_NUM_CLASSES` (ignored pixels aside):
    254 and 255 are the biased and ignore bytes, never classes, whatever ``ignore_index`` is."""
    ids = y[y != ignore_index]
    if ids.numel() and int(ids.max()) > MAX_NUM_CLASSES:
        raise ValueError(f"pseudo_label holds class {int(ids.max())} (ignore_index={ignore_index}), but "
                         f"{RESERVED_REASON}{_biased_hint(ids, False)}")


def _check_feature_values(features, probe: torch.Tensor, img: torch.Tensor, name) -> None:
    """Batch-level NaN/Inf check through one number per pixel (its norm or its sum), which is
    non-finite exactly when one of its values is, barring overflow; a flagged image is then
    checked exactly, so an overflow alone raises nothing."""
    bad = ~torch.isfinite(probe.reshape(-1))
    if bool(bad.any()):
        for i in torch.unique(img[bad]).tolist():
            check_finite(features[i], f"{name(i)}: features")


class _Workspace:
    """Grow-only scratch buffers reused from batch to batch of one call.

    On the CPU a fresh tensor of tens of MB is returned to the OS when freed and page-faulted
    in again at the next batch, which costs more than the arithmetic done in it.
    """

    def __init__(self) -> None:
        self._bufs: Dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n + n // 4, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


@dataclass(frozen=True)
class _PixelGroups:
    """The pixels of a batch sorted by (image, class) (:func:`_pixels_by_group`).

    Attributes:
        x: (P + 1, D) the (normalised) pixel embeddings in row-major order per image, followed
            by one zero row (padded points of the K-means problems read it).
        order: (P',) the permutation of the non-ignored pixels that sorts them by group (stable:
            pixel order within a group is row-major, the order a boolean mask gives).
        image, label, start, size: each group's image, class, offset in ``order`` and size.
    """

    x: torch.Tensor
    order: torch.Tensor
    image: List[int]
    label: List[int]
    start: List[int]
    size: List[int]


def _pixels_by_group(features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], *, ignore_index: int,
                     normalize: bool, device: Optional[torch.device], name=None, max_label: Optional[int] = None,
                     workspace: Optional[_Workspace] = None) -> _PixelGroups:
    """Every non-ignored pixel of a batch, sorted by (image, class): a :class:`_PixelGroups`.

    ``name(i)``, when given, turns on the batch-level value checks and names image i in errors;
    ``max_label`` (C) then bounds the class ids.
    """
    # int64 before any comparison: torch compares a uint8 255 equal to ignore_index=-1.
    labels = [y.long() for y in labels]
    dev = torch.device(device) if device is not None else features[0].device
    uniform = all(tuple(f.shape) == tuple(features[0].shape) for f in features)
    n_pix = [int(f.shape[-1] * f.shape[-2]) for f in features]
    x3 = _embedding_rows(features, dev, uniform, workspace if workspace is not None else _Workspace())
    x = x3[:-1]
    y, y_full = _labels_on_grids(features, labels, dev, uniform, ignore_index, name is not None)
    img = torch.repeat_interleave(torch.arange(len(n_pix), device=dev), torch.tensor(n_pix, device=dev))
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True) if normalize else None
    if name is not None:
        if y_full is not None:
            _check_label_values(y_full, name, max_label)
        else:  # labels of different sizes: one by one
            for i, lab in enumerate(labels):
                _check_label_values(lab[None].masked_fill(lab[None] == ignore_index, 0), lambda _, i=i: name(i),
                                    max_label)
        _check_feature_values(features, norms if norms is not None else x.sum(1), img, name)
    if norms is not None:
        _normalize_rows(x, norms)
    return _sort_by_group(x3, y, img, ignore_index, len(n_pix))


def _embedding_rows(features: Sequence[torch.Tensor], dev: torch.device, uniform: bool,
                    ws: _Workspace) -> torch.Tensor:
    """(P + 1, D): every image's (D, h, w) embeddings as (pixels, D) rows on ``dev``, then a zero row."""
    dim = int(features[0].shape[0])
    dtype = functools.reduce(torch.promote_types, {f.dtype for f in features})
    # K-means sums in half precision would lose the centroids' digits: work in float32.
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    if not uniform:
        return torch.cat([f.to(device=dev, dtype=work).reshape(dim, -1).T for f in features] +
                         [torch.zeros(1, dim, dtype=work, device=dev)])
    # The common case (one feature grid for the dataset): every image is transposed to
    # (pixels, D) and converted in one copy into a reused buffer. Fresh tensors of tens of
    # MB cost more in page faults than the copy itself on the CPU.
    B, P = len(features), int(features[0].shape[-1] * features[0].shape[-2])
    x3 = ws.get("x", (B * P + 1, dim), work, dev)
    x3[-1].zero_()  # a zero row: padded points of the K-means problems read it
    if dev.type == "cpu":
        for i, t in enumerate(features):
            x3[i * P : (i + 1) * P].copy_(t.reshape(dim, P).T)
    else:  # one host-to-device copy of the stacked batch, in its own dtype
        f = torch.stack([t.to(dtype) for t in features]).to(dev, non_blocking=True)
        x3[:-1].view(B, P, dim).copy_(f.view(B, dim, P).transpose(1, 2))
    return x3


def _labels_on_grids(features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], dev: torch.device,
                     uniform: bool, ignore_index: int, checked: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Every label on its feature grid, flattened in pixel order; with ``checked``, also the
    (B, H, W) full-size labels (ignored pixels set to 0) when they share a size, else None."""
    if uniform and len({tuple(y.shape) for y in labels}) == 1:
        y_stack = torch.stack(list(labels)).to(dev)
        y_full = y_stack.masked_fill(y_stack == ignore_index, 0) if checked else None
        return resize_label(y_stack, tuple(features[0].shape[-2:])).reshape(-1), y_full
    return torch.cat([resize_label(lab.to(dev), tuple(f.shape[-2:])).reshape(-1)
                      for f, lab in zip(features, labels)]), None


def _normalize_rows(x: torch.Tensor, norms: torch.Tensor) -> None:
    """L2-normalise the rows of ``x`` in place, given their (P, 1) norms (which it overwrites)."""
    # Finite pixels (checked above, or by the caller) whose squared norm overflows the
    # work dtype (values beyond ~1.8e19 in float32) would become zero vectors: those rows
    # alone are normalised through their largest magnitude first.
    over = torch.isinf(norms[:, 0])
    if bool(over.any()):
        x[over] = l2_normalize(x[over], dim=1).to(x.dtype)
        norms[over] = 1.0
    x.div_(norms.clamp_min_(1e-12))  # F.normalize's rule: x / max(|x|, eps), in place


def _sort_by_group(x3: torch.Tensor, y: torch.Tensor, img: torch.Tensor, ignore_index: int,
                   num_images: int) -> _PixelGroups:
    """The kept pixels (class ``y``, image ``img``) sorted by (image, class), and the groups they form."""
    keep = y != ignore_index
    n_labels = int(y.masked_fill(~keep, 0).max()) + 1 if y.numel() else 1
    # One key per pixel, (image, class) in lexicographic order; ignored pixels sort last.
    key = (img * n_labels + y).masked_fill_(~keep, num_images * n_labels)
    sorted_key, order = torch.sort(key, stable=True)
    n_keep = int(keep.sum())
    groups, sizes = torch.unique_consecutive(sorted_key[:n_keep], return_counts=True)
    groups, sizes = groups.tolist(), sizes.tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist() if sizes else []
    return _PixelGroups(x3, order[:n_keep], [g // n_labels for g in groups], [g % n_labels for g in groups], starts,
                        sizes)
