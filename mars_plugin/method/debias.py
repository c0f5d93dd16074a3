"""Generating debiased labels (MARS Sec. 3.3, Eq. 4-5).

Eq. 4: M_hat(y, x) = ReLU(max_{c in C_I} S(F[:, y, x], V^c)), the similarity of every pixel to
the closest debiased centroid among the image's classes. After refinement (dense CRF or a
threshold) it becomes the binary mask M, and Eq. 5 marks as biased (-1) every foreground pixel
of the pseudo label where M = 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from mars_plugin._checks import (
    MAX_NUM_CLASSES,
    RESERVED_REASON,
    _biased_hint,
    as_tensor,
    check_float_tensor,
    check_fraction,
    check_image_classes,
    check_label_tensor,
    check_varying_features,
    describe,
)
from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES, check_crf_backend, check_crf_params
from mars_plugin.engines.kmeans import l2_norm, l2_normalize
from mars_plugin.method.selection import DebiasedCentroids

__all__ = ["BIASED", "DebiasResult", "check_pseudo_label", "debiased_similarity", "debias_labels", "mark_biased",
           "refine_mask"]

#: Label value of biased pixels in debiased labels (Eq. 5).
BIASED = -1


def _centroid_matrix(centroids: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(C+1, D) centroids and (C+1,) validity from a DebiasedCentroids or a plain tensor.

    A row is valid when it is not all zeros (for a DebiasedCentroids, also when flagged
    valid); row 0 is never used. A NaN/Inf centroid is refused: it would compare as
    dissimilar to every pixel and remove its whole class (Eq. 5).
    """
    if isinstance(centroids, DebiasedCentroids):
        V, valid, name = centroids.centroids, centroids.valid.clone(), "centroids.centroids"
        if not isinstance(V, torch.Tensor) or V.ndim != 2 or V.shape[0] < 2 or not V.is_floating_point() \
                or not isinstance(valid, torch.Tensor) or tuple(valid.shape) != (V.shape[0],):
            raise ValueError(f"centroids.centroids must be a (C+1, D) float tensor with a (C+1,) valid mask, got "
                             f"{describe(V)} and valid {describe(valid)}")
        valid = valid.bool()
    else:
        V, name = as_tensor(centroids, "centroids"), "centroids"
        if V.ndim != 2 or V.shape[0] < 2 or not V.is_floating_point():
            raise ValueError(f"centroids must be a DebiasedCentroids or a (C+1, D) float tensor, got {describe(V)}")
        valid = torch.ones(V.shape[0], dtype=torch.bool, device=V.device)
    if V.shape[0] - 1 > MAX_NUM_CLASSES:
        raise ValueError(f"{name} has {V.shape[0]} rows = background + C = {V.shape[0] - 1} classes, but "
                         f"{RESERVED_REASON}")
    if not bool(torch.isfinite(V).all()):
        rows = torch.nonzero(~torch.isfinite(V).all(1)).flatten().tolist()
        raise ValueError(f"{name}: got NaN or Inf values in the centroid row(s) of class {rows[:8]}"
                         f"{'...' if len(rows) > 8 else ''}; expected finite centroids")
    # A zero row has no direction: no centroid, whatever the flag says.
    valid = valid & (l2_norm(V, dim=1) > 0)
    valid[0] = False
    return V, valid


def _prepare(features, centroids, image_classes, size: Optional[Tuple[int, int]]):
    f = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
    single = f.ndim == 3
    if single:
        f = f[None]
    V, valid = _centroid_matrix(centroids)
    if V.shape[1] != f.shape[1]:
        raise ValueError(
            f"features have D={f.shape[1]} channels but centroids have D={V.shape[1]}; "
            "use the same USS model for select_centroids and debias_labels"
        )
    for i in range(f.shape[0]):  # values after shapes: a constant map marks all or none of its image biased
        check_varying_features(f[i], "features" if single else f"features[{i}]")
    C = V.shape[0] - 1
    cls = check_image_classes(image_classes, "image_classes", C, None if single else f.shape[0])
    if single:
        cls = cls[None]
    if size is not None and tuple(f.shape[-2:]) != tuple(size):
        # Eq. 4 is per label pixel: bring the embeddings to the label grid first (STEGO's own
        # bilinear, align_corners=False up-sampling of its code maps).
        f = F.interpolate(f, size=tuple(size), mode="bilinear", align_corners=False)
    # Eq. 4 in float32 at least: float16 features (what ``mars features`` writes) overflow
    # their own dtype in |f|^2 from values of 256 on.
    work = torch.float64 if f.dtype == torch.float64 else torch.float32
    return f, V.to(f.device, work), valid.to(f.device), cls.to(f.device), single


def _similarity(f: torch.Tensor, V: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """Eq. 4 on a batch: f (B, D, H, W), V (C+1, D), usable (B, C+1) -> (B, H, W).

    cos = (f . v_hat) / |f|: the pixels are never divided themselves, and only the centroids
    some image of the batch can use are compared (an image has a few of VOC's 20 classes).
    """
    B, _, H, W = f.shape
    used = torch.nonzero(usable.any(0)).flatten()
    if used.numel() == 0:
        # No image has a class with a centroid: no similarity, nothing is kept.
        return f.new_zeros(B, H, W)
    vn = l2_normalize(V[used], dim=1).to(V.dtype)
    f = f.to(V.dtype)
    dots = torch.einsum("bdhw,cd->bchw", f, vn)
    # |f| as a contraction: 2-3x faster than vector_norm over the channel axis on the CPU.
    norm = torch.einsum("bdhw,bdhw->bhw", f, f).sqrt_()[:, None]
    if not bool(torch.isfinite(norm).all()):
        # Finite features (checked) whose |f|^2 overflows (values beyond ~1.8e19 in float32):
        # the plain norm would make their cosine 0. Normalise them stably instead.
        dots = torch.einsum("bdhw,cd->bchw", l2_normalize(f, dim=1).to(V.dtype), vn)
        norm = torch.ones_like(norm)
    cos = dots / norm.clamp_min(1e-12)  # F.normalize's eps
    cos = cos.masked_fill(~usable[:, used, None, None], float("-inf"))
    best = cos.max(1).values
    # An image none of whose classes has a centroid has no similarity: 0 (nothing is kept).
    return torch.relu(best.nan_to_num(neginf=0.0))


def _check_covered(y: torch.Tensor, C: int, ignore_index: int) -> None:
    fg_vals = y[y != ignore_index]
    if fg_vals.numel() and int(fg_vals.max()) > C:
        raise ValueError(f"pseudo_label holds class {int(fg_vals.max())} but the centroids cover 1..{C}"
                         f"{_biased_hint(y, False)}")


def _mark(y: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Eq. 5 on checked tensors: foreground pixels of a class with a valid centroid where M = 0
    become -1."""
    touched = valid.clone()
    touched[0] = False
    C = valid.shape[0] - 1
    safe = y.clamp(0, C).masked_fill(y == ignore_index, 0)
    biased = (y != ignore_index) & (y > 0) & ~mask & touched[safe]
    return y.masked_fill(biased, BIASED)


def mark_biased(
    pseudo_label: Any,
    mask: Any,
    centroids: Union[DebiasedCentroids, torch.Tensor],
    *,
    ignore_index: int = 255,
) -> torch.Tensor:
    """Eq. 5 alone: Y^db from the pseudo label and a binary mask M (see :func:`refine_mask`).

    Shapes:
        pseudo_label: (H, W) or (B, H, W), 0..C or ``ignore_index``.
        mask: bool, same shape; True = keep.

    Returns:
        long Y^db: pixels with a class > 0 that has a valid centroid and M = False become -1.
    """
    y = check_pseudo_label(pseudo_label, centroids, ignore_index=ignore_index)
    m = as_tensor(mask, "mask")
    if m.dtype != torch.bool or tuple(m.shape) != tuple(y.shape):
        raise ValueError(f"mask must be a bool tensor of the pseudo label's shape {tuple(y.shape)}, got {describe(m)}")
    _, valid = _centroid_matrix(centroids)
    return _mark(y, m.to(y.device), valid.to(y.device), ignore_index)


def check_pseudo_label(
    pseudo_label: Any, centroids: Union[DebiasedCentroids, torch.Tensor], *, ignore_index: int = 255
) -> torch.Tensor:
    """The checks of :func:`mark_biased` on the label alone: an integer (H, W) or (B, H, W) map
    of 0..C (C from the centroids) and ``ignore_index``; returned as long."""
    y = check_label_tensor(pseudo_label, "pseudo_label", (2, 3), "(H, W) or (B, H, W)", ignore_index=ignore_index)
    _check_covered(y, _centroid_matrix(centroids)[0].shape[0] - 1, ignore_index)
    return y


def refine_mask(
    similarity: Any,
    image: Any,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """The binary mask M of Eq. 5 from the soft mask M_hat by the dense CRF (``max_bytes``:
    its memory budget, :func:`mars_plugin.engines.crf.dense_crf`'s).

    Shapes:
        similarity: M_hat, (H, W), (B, H, W) or a list of (H_i, W_i) (images of different
            sizes, refined as one batch).
        image: RGB images in the same form ((H, W, 3) or (3, H, W) each, uint8 or [0, 1]).

    Returns:
        bool M (True = keep) in the form of ``similarity``: argmax of the 2-label CRF
        marginals over [1 - M_hat, M_hat] (computed in float64 and clipped at 1e-5, as
        pydensecrf's ``unary_from_softmax`` receives them); a tie keeps nothing.
    """
    def two_labels(m: Any, name: str) -> torch.Tensor:
        m = as_tensor(m, name).double()
        return torch.stack([1.0 - m, m], -3)

    # argmax over the two labels with ties to the first (as numpy's and torch's argmax) is
    # Q[1] > Q[0], written out: torch's argmax over a leading axis of 2 is slow on the CPU.
    if isinstance(similarity, (list, tuple)):
        probs = [two_labels(m, f"similarity[{i}]") for i, m in enumerate(similarity)]
        return [q[1] > q[0] for q in dense_crf(probs, image, crf_params, backend=crf_backend, max_bytes=max_bytes)]
    q = dense_crf(two_labels(similarity, "similarity"), image, crf_params, backend=crf_backend, max_bytes=max_bytes)
    return q[..., 1, :, :] > q[..., 0, :, :]


def debiased_similarity(
    features: Any,
    centroids: Union[DebiasedCentroids, torch.Tensor],
    image_classes: Any,
    *,
    size: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """The soft debiased mask M_hat of Eq. 4.

    Shapes:
        features: (D, H, W) or (B, D, H, W) pixel embeddings; a map whose every value is 0, or
            whose every pixel holds the same vector, is a ValueError (it carries no per-pixel
            information: :func:`mars_plugin._checks.degenerate_features`).
        centroids: :class:`DebiasedCentroids` or a (C+1, D) tensor (all-zero rows = no centroid).
        image_classes: (C,) / (B, C) multi-hot tensor, or a list of 1-based class ids (a list of
            lists for a batch); see :func:`mars_plugin._checks.check_image_classes`.
        size: optional (H', W'); the embeddings are bilinearly resized to it first.

    Returns:
        (H, W) or (B, H, W) similarities in [0, 1]: ReLU of the best cosine to a debiased
        centroid of one of the image's classes that has a centroid; 0 where none has.
    """
    f, V, valid, cls, single = _prepare(features, centroids, image_classes, size)
    usable = torch.cat([torch.zeros_like(cls[:, :1]), cls], 1) & valid[None]
    m = _similarity(f, V, usable)
    return m[0] if single else m


@dataclass
class DebiasResult:
    """Everything :func:`debias_labels` computed, for reports and plots.

    Attributes:
        labels: debiased labels Y^db, (H, W) or (B, H, W) long with -1 for biased pixels.
        similarity: the soft mask M_hat (Eq. 4), same spatial shape, float.
        mask: the binary mask M after refinement, bool.
        untouched: per image, the foreground classes of the pseudo label that have no debiased
            centroid and were therefore left unchanged.
    """

    labels: torch.Tensor
    similarity: torch.Tensor
    mask: torch.Tensor
    untouched: List[List[int]]


def debias_labels(
    features: Any,
    pseudo_label: Any,
    centroids: Union[DebiasedCentroids, torch.Tensor],
    image_classes: Any,
    *,
    image: Any = None,
    refine: str = "crf",
    threshold: float = 0.5,
    ignore_index: int = 255,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
    return_details: bool = False,
) -> Union[torch.Tensor, DebiasResult]:
    """Debiased labels Y^db (Eq. 4-5): foreground pixels unlike every debiased centroid become -1.

    Shapes:
        features: (D, h, w) or (B, D, h, w) USS embeddings; resized bilinearly to the label grid
            when (h, w) differs from it. A map whose every value is 0, or whose every pixel
            holds the same vector (a failed extractor's), is a ValueError naming it: it would
            mark all or none of its image's foreground biased.
        pseudo_label: (H, W) or (B, H, W) WSSS label, 0..C or ``ignore_index``.
        centroids: from :func:`select_centroids` (or a (C+1, D) tensor, C <= 253).
        image_classes: image-level labels: (C,) / (B, C) multi-hot tensor, or a list of 1-based
            class ids (list of lists for a batch).
        image: RGB image (H, W, 3) or (3, H, W), uint8 or float in [0, 1] (batch: a leading B);
            required by ``refine="crf"``.

    Args:
        refine: ``"crf"``: M = argmax of a 2-label dense CRF whose unary is -log[1 - M_hat,
            M_hat] (clipped at 1e-5), the whole batch at once on the features' device;
            ``"threshold"``: M = M_hat > ``threshold``.
        threshold: used by ``refine="threshold"``; in [0, 1).
        crf_params: a preset name (``"mars"``, the default, or ``"psa"``) or a dict overriding
            the default's keys; see :data:`mars_plugin.engines.crf_params.CRF_PRESETS`.
        crf_backend: ``"torch"`` (:func:`mars_plugin.engines.crf.dense_crf`) or ``"pydensecrf"`` (the
            reference, CPU, one image at a time; the ``crf`` extra).
        return_details: return a :class:`DebiasResult` (labels, M_hat, M, untouched classes)
            instead of the labels alone.

    Returns:
        Long tensor like ``pseudo_label`` where pixels with label > 0 (not ignore) and M = 0
        are -1; ignore pixels stay ignore; classes without a valid centroid stay untouched.
    """
    if refine not in ("crf", "threshold"):
        raise ValueError(f"refine must be 'crf' or 'threshold', got {refine!r}")
    params = check_crf_params(crf_params)
    check_crf_backend(crf_backend)
    threshold = check_fraction(threshold, "threshold", low_open=False)
    if threshold >= 1.0:
        raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
    f_in = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
    single = f_in.ndim == 3
    y = check_label_tensor(
        pseudo_label, "pseudo_label", (2,) if single else (3,), "(H, W)" if single else "(B, H, W)",
        ignore_index=ignore_index,
        num_classes=(centroids.num_classes if isinstance(centroids, DebiasedCentroids) else None),
    )
    yb = y[None] if single else y
    if yb.shape[0] != (1 if single else f_in.shape[0]):
        raise ValueError(f"features and pseudo_label must hold the same number of images, got {f_in.shape[0]} and {yb.shape[0]}")
    H, W = yb.shape[-2:]
    f, V, valid, cls, _ = _prepare(f_in, centroids, image_classes, (H, W))
    _check_covered(yb, V.shape[0] - 1, ignore_index)
    yb = yb.to(f.device)

    usable = torch.cat([torch.zeros_like(cls[:, :1]), cls], 1) & valid[None]
    m_hat = _similarity(f, V, usable)

    if refine == "threshold":
        mask = m_hat > threshold
    else:
        mask = _crf_mask(m_hat, image, single, params, crf_backend)

    out = _mark(yb, mask, valid, ignore_index)
    if not return_details:
        return out[0] if single else out
    untouched = _untouched_classes(yb, valid, ignore_index)
    if single:
        return DebiasResult(out[0], m_hat[0], mask[0], untouched)
    return DebiasResult(out, m_hat, mask, untouched)


def _crf_mask(m_hat: torch.Tensor, image: Any, single: bool, params: Mapping[str, Any],
              crf_backend: str) -> torch.Tensor:
    """M of :func:`debias_labels`'s ``refine="crf"``: (B, H, W) M_hat and the images -> (B, H, W) bool."""
    if image is None:
        raise ValueError("refine='crf' needs the RGB image: pass image=..., or use refine='threshold'")
    imgs = as_tensor(image, "image")
    if not single and (imgs.ndim != 4 or imgs.shape[0] != m_hat.shape[0]):
        raise ValueError(f"image must be a batch (B, H, W, 3) or (B, 3, H, W) with B={m_hat.shape[0]}, got {describe(imgs)}")
    mask = refine_mask(m_hat if not single else m_hat[0], imgs, params, crf_backend)
    return mask[None] if single else mask


def _untouched_classes(y: torch.Tensor, valid: torch.Tensor, ignore_index: int) -> List[List[int]]:
    """Per image of (B, H, W) labels, its foreground classes that have no valid centroid."""
    untouched = []
    for b in range(y.shape[0]):
        present = torch.unique(y[b][(y[b] > 0) & (y[b] != ignore_index)]).tolist()
        untouched.append([int(c) for c in present if not bool(valid[int(c)])])
    return untouched
