"""A drop-in MARS loss for any segmentation training loop (Sec. 3.4, Eq. 6-7).

The WSSS repositories train their segmentation network with
``nn.CrossEntropyLoss(ignore_index=255)(logits, labels)``. With MARS the labels are the
debiased ones (biased pixels stored as 254 on disk), and that one line becomes::

    hook = MARSTrainingHook(model)                      # once, after building the model
    ...
    loss = hook(images, logits, labels, image_classes)  # instead of criterion(logits, labels)
    loss.backward(); optimizer.step()
    hook.update(model)                                  # after optimizer.step()

Inside: the EMA teacher predicts the batch, :func:`mars_plugin.complement_labels` fills the
biased pixels with its label (restricted to the image's classes) and :class:`mars_plugin.WCELoss`
weighs them by its certainty. Like pytorch-grad-cam's ``reshape_transform``, an
``output_transform`` turns whatever the model returns (a list of multi-scale outputs, a dict,
``{"out": ...}``) into the (B, C+1, h, w) logits.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin import EMATeacher, WCELoss, complement_labels
from mars_plugin.centroids import resize_label
from mars_plugin.crf import check_crf_backend, check_crf_params
from mars_plugin.local_crf import check_local_crf_params
from mars_plugin.files import BIASED_VALUE

__all__ = ["MARSTrainingHook", "default_output_transform"]


def default_output_transform(out: Any) -> torch.Tensor:
    """Logits from common model outputs: a tensor, torchvision's ``{"out": t}``, or a
    list/tuple whose first item is the full-scale logits (deeplab-pytorch's MSC in train mode)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "out" in out:
        return out["out"]
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"cannot find logits in a model output of type {type(out).__name__}; pass output_transform=..."
    )


class MARSTrainingHook:
    """EMA teacher + complement + WCE in one call.

    Args:
        model: the segmentation network being trained (the student); deep-copied as the teacher.
        momentum: EMA momentum of the teacher (0.999, Sec. 3.4).
        ignore_index: ignored label value (255 in every WSSS repository).
        biased_value: how biased pixels are stored in the label files (254); -1 is accepted too.
        match: where logits and labels meet when their sizes differ: ``"labels"`` resizes the
            labels to the logits by nearest neighbour (what deeplab-pytorch does), ``"logits"``
            up-samples the logits bilinearly to the labels.
        output_transform: maps a model output to (B, C+1, h, w) logits.
        refine: teacher refinement, None, ``"crf"`` (the dense CRF, batched on the logits'
            device, :func:`mars_plugin.crf.dense_crf`) or ``"local_crf"`` (its windowed
            approximation); both need ``images_rgb`` in the call.
        crf_params: a preset name (``"mars"`` default, ``"psa"``) or a dict of overrides (see
            :func:`mars_plugin.complement_labels`).
        crf_backend: ``"torch"`` or ``"pydensecrf"`` (the reference; CPU, one image at a time).
        multi_scale: when the student returns a list/tuple of logits (multi-scale training),
            sum the MARS loss over all of them, as the repositories sum their CE.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        momentum: float = 0.999,
        ignore_index: int = 255,
        biased_value: int = BIASED_VALUE,
        match: str = "labels",
        output_transform: Callable[[Any], torch.Tensor] = default_output_transform,
        refine: Optional[str] = None,
        multi_scale: bool = True,
        crf_params: Union[None, str, Mapping[str, Any]] = None,
        crf_backend: str = "torch",
    ) -> None:
        if match not in ("labels", "logits"):
            raise ValueError(f"match must be 'labels' or 'logits', got {match!r}")
        if refine not in (None, "crf", "local_crf"):
            raise ValueError(f"refine must be None, 'crf' or 'local_crf', got {refine!r}")
        self.teacher = EMATeacher(model, momentum=momentum)
        self.loss = WCELoss(ignore_index=ignore_index)
        self.ignore_index = int(ignore_index)
        self.biased_value = int(biased_value)
        self.match = match
        self.output_transform = output_transform
        self.refine = refine
        self.crf_params = None if refine is None else (
            check_crf_params(crf_params) if refine == "crf" else check_local_crf_params(crf_params))
        self.crf_backend = check_crf_backend(crf_backend)
        self.multi_scale = bool(multi_scale)

    def targets(self, labels: torch.Tensor, size) -> torch.Tensor:
        """Labels as loaded (254 = biased) -> long labels with -1, on the logits grid if asked."""
        y = labels.long()
        y = torch.where(y == self.biased_value, torch.full_like(y, -1), y)
        if self.match == "labels" and tuple(y.shape[-2:]) != tuple(size):
            y = resize_label(y, tuple(size))
        return y

    def __call__(
        self,
        images: torch.Tensor,
        logits: torch.Tensor,
        labels: torch.Tensor,
        image_classes: Any,
        *,
        images_rgb: Any = None,
    ) -> torch.Tensor:
        """The MARS loss of one batch.

        Shapes:
            images: (B, 3, H, W) the network input (the teacher sees the same batch).
            logits: (B, C+1, h, w) student logits, a list of them (multi-scale: losses summed),
                or a raw model output (see output_transform).
            labels: (B, H', W') debiased labels as loaded (254 or -1 = biased, 255 = ignore).
            image_classes: (B, C) multi-hot, or a list of 1-based class-id lists.
            images_rgb: (B, H', W', 3) uint8 images, only for ``refine="crf"|"local_crf"``.
        """
        t_out = self.output_transform(self.teacher(images))
        if self.multi_scale and isinstance(logits, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in logits):
            # deeplab-pytorch's MSC in train mode returns [1x, 0.75x, 0.5x, max] and sums the
            # CE of every scale (main.py L231-236): sum the MARS loss of every scale the same way.
            return sum(self._one_scale(images, t, labels, image_classes, t_out, images_rgb) for t in logits)
        return self._one_scale(images, self.output_transform(logits), labels, image_classes, t_out, images_rgb)

    def _one_scale(self, images, logits, labels, image_classes, t_logits, images_rgb) -> torch.Tensor:
        y = self.targets(labels, logits.shape[-2:])
        if tuple(t_logits.shape[-2:]) != tuple(logits.shape[-2:]):
            t_logits = F.interpolate(t_logits, size=logits.shape[-2:], mode="bilinear", align_corners=False)
        if self.match == "logits" and tuple(y.shape[-2:]) != tuple(logits.shape[-2:]):
            logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
            t_logits = F.interpolate(t_logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
        y_co, w = complement_labels(
            y, t_logits.float().softmax(1), image_classes, refine=self.refine, image=images_rgb,
            ignore_index=self.ignore_index, crf_params=self.crf_params, crf_backend=self.crf_backend,
        )
        return self.loss(logits, y_co, w)

    def update(self, model: nn.Module) -> None:
        """EMA step of the teacher; call after ``optimizer.step()``."""
        self.teacher.update(model)
