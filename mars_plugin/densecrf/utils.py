"""pydensecrf's ``utils``: unaries from labels or probabilities and the features of the two
kernels for images of any number of dimensions, as arrays equal bit for bit to pydensecrf's
(same float32 / float64 steps; the input's dtype decides the precision as there).

Shapes: probabilities (L, ...) -> unary (L, N) float32; labels (...) -> (n_labels, N);
features (D, N) float32 with N the product of the image's sizes, in C order.
"""
from __future__ import annotations

import warnings
from numbers import Number
from typing import Optional, Sequence, Union

import numpy as np

__all__ = ["unary_from_labels", "unary_from_softmax", "create_pairwise_gaussian", "create_pairwise_bilateral",
           "compute_unary", "softmax_to_unary"]


def unary_from_labels(labels: np.ndarray, n_labels: int, gt_prob: float, zero_unsure: bool = True) -> np.ndarray:
    """(n_labels, N) float32 energies from a label map: -log(gt_prob) for the annotated label,
    -log((1 - gt_prob) / (n_labels - 1)) for the others. With ``zero_unsure`` label 0 means
    "unknown" (uniform energy -log(1 / n_labels)) and labels 1..n_labels map to rows 0..n_labels-1."""
    if not 0 < gt_prob < 1:
        raise ValueError(f"gt_prob: got {gt_prob!r}; expected a probability in (0, 1)")
    flat = np.ravel(labels)
    rows = flat - 1 if zero_unsure else flat
    other = -np.log((1.0 - gt_prob) / (n_labels - 1))
    unary = np.full((n_labels, flat.size), other, dtype=np.float32)
    unary[rows, np.arange(flat.size)] = -np.log(gt_prob)
    if zero_unsure:  # written last: the unknown pixels' column (row -1 was set above) made uniform
        unary[:, flat == 0] = -np.log(1.0 / n_labels)
    return unary


def unary_from_softmax(sm: np.ndarray, scale: Optional[float] = None, clip: Optional[float] = 1e-5) -> np.ndarray:
    """(L, N) float32 -log p of probabilities ``sm`` (L, ...): with ``scale`` first mixed with
    the uniform distribution (p scale + (1 - scale) / L), with ``clip`` clipped to [clip, 1]."""
    num = sm.shape[0]
    p = sm
    if scale is not None:
        if not 0 < scale <= 1:
            raise ValueError(f"scale: got {scale!r}; expected a value in (0, 1]")
        # the uniform part in double, as pydensecrf adds it (it widens float32 probabilities)
        p = scale * p + (1 - scale) * np.full(p.shape, 1.0) / num
    if clip is not None:
        p = np.clip(p, clip, 1.0)
    return np.negative(np.log(p)).reshape(num, -1).astype(np.float32)


def compute_unary(labels: np.ndarray, M: int, GT_PROB: float = 0.5) -> np.ndarray:
    """pydensecrf's deprecated name of :func:`unary_from_labels` (kept for old code)."""
    warnings.warn("compute_unary is deprecated, use unary_from_labels instead", DeprecationWarning, stacklevel=2)
    return unary_from_labels(labels, M, GT_PROB)


def softmax_to_unary(sm: np.ndarray, GT_PROB: float = 1) -> np.ndarray:
    """pydensecrf's deprecated name of :func:`unary_from_softmax` without clipping (GT_PROB 1: no scale)."""
    warnings.warn("softmax_to_unary is deprecated, use unary_from_softmax instead", DeprecationWarning, stacklevel=2)
    return unary_from_softmax(sm, None if GT_PROB == 1 else GT_PROB, clip=None)


def _grid(shape: Sequence[int], scales: Sequence[float]) -> np.ndarray:
    """(len(shape), *shape) float32 index of every element along each axis, the first
    len(scales) axes divided in place by their scale (float32 division of a float32 index)."""
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")).astype(np.float32)
    for axis, s in enumerate(scales):
        grid[axis] /= s
    return grid


def create_pairwise_gaussian(sdims: Sequence[float], shape: Sequence[int]) -> np.ndarray:
    """(len(sdims), N) float32 features of the position kernel of an image of ``shape``: each
    coordinate divided by its standard deviation (``DenseCRF2D.addPairwiseGaussian`` with
    sdims = (sy, sx) for an (H, W) image, whose features it lists y first)."""
    return _grid(shape, sdims).reshape(len(sdims), -1)


def create_pairwise_bilateral(sdims: Sequence[float], schan: Union[float, Sequence[float]], img: np.ndarray,
                              chdim: int = -1) -> np.ndarray:
    """(len(shape) + C, N) float32 features of the bilateral kernel: the coordinates over
    ``sdims``, then the channels of ``img`` over ``schan`` (one number for all, or one per
    channel). ``chdim``: the channel axis of ``img``, -1 for a single-channel image without one."""
    if chdim == -1:
        chans = img[None].astype(np.float32)
    else:
        chans = np.moveaxis(img, chdim, 0).astype(np.float32)
    if isinstance(schan, Number):
        chans /= schan
    else:
        for c, s in enumerate(schan):
            chans[c] /= s
    both = np.concatenate([_grid(chans.shape[1:], sdims), chans])
    return both.reshape(both.shape[0], -1)
