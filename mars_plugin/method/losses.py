"""Weighted cross-entropy (MARS Eq. 7): per-pixel CE scaled by the certainty mask W."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import MAX_NUM_CLASSES, RESERVED_REASON, check_finite, check_ndim, describe

__all__ = ["weighted_cross_entropy", "WCELoss"]

_REDUCTIONS = ("mean", "sum", "none")


def weighted_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor = None,
    *,
    ignore_index: int = 255,
    reduction: str = "mean",
) -> torch.Tensor:
    """Eq. 7: W(y, x) * CE(P(y, x), Y^co(y, x)).

    Shapes:
        logits: (B, C+1, H, W) raw student scores (softmax is applied here, like
            ``F.cross_entropy``); C <= 253 (254 and 255 are the biased and ignore bytes).
        target: (B, H, W) long complemented labels in 0..C or ``ignore_index``; a -1 left over
            is an error (call :func:`complement_labels` first).
        weight: (B, H, W) non-negative certainty W (None: all ones, i.e. plain CE).

    Args:
        reduction: ``"mean"`` (sum over non-ignored pixels divided by their count, the
            convention of ``nn.CrossEntropyLoss(ignore_index=255)`` that the WSSS segmentation
            stages use; 0 when every pixel is ignored), ``"sum"``, or ``"none"`` ((B, H, W),
            0 at ignored pixels).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {describe(logits)}")
    check_ndim(logits, "logits", (4,), "(B, C+1, H, W)")
    if logits.shape[1] - 1 > MAX_NUM_CLASSES:
        raise ValueError(f"logits have {logits.shape[1]} channels = background + C = {logits.shape[1] - 1} classes, "
                         f"but {RESERVED_REASON}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor, got {describe(target)}")
    check_ndim(target, "target", (3,), "(B, H, W)")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer label tensor, got {describe(target)}")
    want = (logits.shape[0],) + tuple(logits.shape[2:])
    if tuple(target.shape) != want:
        raise ValueError(f"target must have shape (B, H, W) = {want} to match logits, got {tuple(target.shape)}")
    target = target.long()
    valid = target != ignore_index
    if bool((target == -1).any()):
        raise ValueError("target still holds -1 (biased) pixels: fill them with complement_labels before the loss")
    vals = target[valid]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= logits.shape[1]):
        raise ValueError(
            f"target holds class ids in [{int(vals.min())}, {int(vals.max())}] but logits have "
            f"{logits.shape[1]} channels; expected 0..{logits.shape[1] - 1} or ignore_index={ignore_index}"
        )
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a tensor, got {describe(weight)}")
        if tuple(weight.shape) != want:
            raise ValueError(f"weight must have shape (B, H, W) = {want}, got {tuple(weight.shape)}")
        check_finite(weight, "weight")
        if bool((weight < 0).any()):
            raise ValueError("weight must be non-negative (a certainty in [0, 1])")

    ce = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
    if weight is not None:
        ce = ce * weight.to(ce.dtype).detach()
    if reduction == "none":
        return ce
    total = ce.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp_min(1).to(total.dtype)


class WCELoss(nn.Module):
    """Module form of :func:`weighted_cross_entropy` (Eq. 7).

    Example:
        >>> loss = WCELoss()(student(x), y_co, w)  # doctest: +SKIP
    """

    def __init__(self, ignore_index: int = 255, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = int(ignore_index)
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor = None) -> torch.Tensor:
        return weighted_cross_entropy(logits, target, weight, ignore_index=self.ignore_index, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"
