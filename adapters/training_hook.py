"""A drop-in MARS loss for any segmentation training loop (Sec. 3.4, Eq. 6-7).

The WSSS repositories train their segmentation network with
``nn.CrossEntropyLoss(ignore_index=255)(logits, labels)``. With MARS the labels are the
debiased ones (biased pixels stored as 254 on disk), and that one line becomes::

    hook = MARSTrainingHook(model, refine="crf")        # once, after building the model
    ...
    loss = hook(images, logits, labels, image_classes, images_rgb=rgb)  # instead of criterion(logits, labels)
    loss.backward(); optimizer.step()
    hook.update(model)                                  # after optimizer.step()
    ...
    torch.save({"model": model.state_dict(), "hook": hook.state_dict(), ...}, path)  # the teacher too
    hook.load_state_dict(torch.load(path, weights_only=True)["hook"])                # on resume

Inside: the EMA teacher predicts the batch, :func:`mars_plugin.complement_labels` fills the
biased pixels with its label (restricted to the image's classes) and :class:`mars_plugin.WCELoss`
weighs them by its certainty. Like pytorch-grad-cam's ``reshape_transform``, an
``output_transform`` turns whatever the model returns (a list of multi-scale outputs, a dict,
``{"out": ...}``) into the (B, C+1, h, w) logits.

``rgb`` is the batch as (B, H, W, 3) uint8 RGB at the labels' size, before the loader's
normalisation: the dense CRF that refines the teacher (Sec. 3.4) compares raw colours.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin import EMATeacher, WCELoss, complement_labels
from mars_plugin.method.ema import frozen_teacher_warning
from mars_plugin._checks import as_tensor, check_fraction, describe
from mars_plugin.method.centroid_pixels import resize_label
from mars_plugin.engines.crf_params import check_crf_backend, check_crf_params
from mars_plugin.engines.local_crf import check_local_crf_params
from mars_plugin.formats.files import BIASED_VALUE

__all__ = ["MARSTrainingHook", "default_output_transform", "STATE_FORMAT", "MATCHES", "resize_nearest"]

#: ``state_dict()["format"]``: what :meth:`MARSTrainingHook.load_state_dict` accepts.
STATE_FORMAT = "mars-training-hook/1"
#: ``match``: where logits and labels meet (see :class:`MARSTrainingHook`).
MATCHES = ("labels", "logits", "labels_nearest")


def resize_nearest(t: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """(B, H, W) labels or weights -> (B, h, w) by ``F.interpolate(mode="nearest")`` as DHR
    resizes its pseudo masks (train.py:325 through tools/torch_utils.py:45-68: float, the batch
    as channels of one image, back to the input's dtype); the same size is returned as is."""
    if tuple(t.shape[-2:]) == tuple(size):
        return t
    return F.interpolate(t.float().unsqueeze(0), size=tuple(size), mode="nearest")[0].to(t.dtype)


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
        momentum: EMA momentum of the teacher (0.999, Sec. 3.4); 1 (a teacher that never moves
            from ``model``'s weights of now) is taken with a ``UserWarning``.
        ignore_index: ignored label value (255 in every WSSS repository).
        biased_value: how biased pixels are stored in the label files (254); -1 is accepted too.
        match: where logits and labels meet when their sizes differ: ``"labels"`` resizes the
            labels to the logits by nearest neighbour (what deeplab-pytorch does), ``"logits"``
            up-samples the logits (and the teacher's) bilinearly to the labels. With ``refine``
            the teacher is refined on that grid, so a network that predicts below the labels'
            resolution (DeepLab's stride 8) takes ``match="logits"``: the CRF then runs at the
            labels' size on ``images_rgb`` of that size, as the paper refines full images.
            ``"labels_nearest"`` (DHR's loss grid, the ``dhr`` recipe's ``loss_grid="logits"``):
            the loss on the logits' grid, as ``"labels"``, but the teacher is upsampled to the
            labels' size, completes (and refines, on ``images_rgb`` at that size) the labels
            there, and the completed labels and their weights are then brought to the logits'
            grid by ``F.interpolate(mode="nearest")`` (DHR train.py:325
            ``torch_utils.resize(pseudo_masks.float(), logits.shape[2:], mode='nearest')``:
            source pixel ``floor(i * in / out)``, not ``"labels"``' pixel-centre rule).
        output_transform: maps a model output to (B, C+1, h, w) logits.
        refine: teacher refinement, None, ``"crf"`` (the dense CRF, batched on the logits'
            device, :func:`mars_plugin.engines.crf.dense_crf`) or ``"local_crf"`` (its windowed
            approximation); both need ``images_rgb`` in the call (see :meth:`__call__`).
        crf_params: a preset name (``"mars"`` default, ``"psa"``) or a dict of overrides (see
            :func:`mars_plugin.complement_labels`).
        crf_backend: ``"torch"`` or ``"pydensecrf"`` (the reference; CPU, one image at a time).
        multi_scale: when the student returns a list/tuple of logits (multi-scale training),
            sum the MARS loss over all of them, as the repositories sum their CE.
        reduction: the WCE's ``"mean"`` (over the labelled pixels, as the repositories' CE) or
            ``"sum"`` (for a trainer that divides by a global pixel count, e.g. over DDP ranks,
            as ``mars train`` does).
        label_resize: ``(labels (B, H, W), (h, w)) -> (B, h, w)`` for ``match="labels"``; the
            default is the pixel-centre nearest rule. With ``match="labels_nearest"`` it takes
            the completed labels and their (float) weights to each output's grid instead of
            :func:`resize_nearest` (default there: ``resize_nearest``). deeplab-pytorch resizes with PIL's NEAREST,
            which differs at exact ties (not at its 321 crops' 41/21/31 grids):
            ``mars_plugin.networks.deeplab_pytorch.resize_labels_nearest`` is PIL's.
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
        reduction: str = "mean",
        label_resize: Optional[Callable[[torch.Tensor, Tuple[int, int]], torch.Tensor]] = None,
    ) -> None:
        if match not in MATCHES:
            raise ValueError(f"match must be one of {', '.join(map(repr, MATCHES))}, got {match!r}")
        if refine not in (None, "crf", "local_crf"):
            raise ValueError(f"refine must be None, 'crf' or 'local_crf', got {refine!r}")
        self.teacher = EMATeacher(model, momentum=momentum)
        self.loss = WCELoss(ignore_index=ignore_index, reduction=reduction)
        self.ignore_index = int(ignore_index)
        self.biased_value = int(biased_value)
        self.match = match
        self.output_transform = output_transform
        self.refine = refine
        self.crf_params = None if refine is None else (
            check_crf_params(crf_params) if refine == "crf" else check_local_crf_params(crf_params))
        self.crf_backend = check_crf_backend(crf_backend)
        self.multi_scale = bool(multi_scale)
        self.label_resize = label_resize or (resize_nearest if match == "labels_nearest" else resize_label)

    def targets(self, labels: torch.Tensor, size) -> torch.Tensor:
        """Labels as loaded (254 = biased) -> long labels with -1, on the logits grid if asked."""
        y = labels.long()
        y = torch.where(y == self.biased_value, torch.full_like(y, -1), y)
        if self.match == "labels" and tuple(y.shape[-2:]) != tuple(size):
            y = self.label_resize(y, tuple(size))
        return y

    def __call__(
        self,
        images: torch.Tensor,
        logits: torch.Tensor,
        labels: torch.Tensor,
        image_classes: Any,
        *,
        images_rgb: Any = None,
        reduce_outputs: bool = True,
    ) -> Union[torch.Tensor, List[torch.Tensor]]:
        """The MARS loss of one batch.

        Shapes:
            images: (B, 3, H, W) the network input (the teacher sees the same batch).
            logits: (B, C+1, h, w) student logits, a list of them (multi-scale: losses summed),
                or a raw model output (see output_transform).
            labels: (B, H', W') debiased labels as loaded (254 or -1 = biased, 255 = ignore).
            image_classes: (B, C) multi-hot, or a list of 1-based class-id lists.
            images_rgb: only for ``refine="crf"|"local_crf"``: the batch as RGB images before any
                normalisation, (B, G_h, G_w, 3) uint8 (or (B, 3, G_h, G_w), or float in [0, 1]),
                where (G_h, G_w) is the grid the teacher is refined on: the labels' (H', W')
                with ``match="logits"`` or ``"labels_nearest"``, the logits' (h, w) with
                ``match="labels"``. A wrong size, layout or range is refused before the teacher
                runs, with what to pass.
            reduce_outputs: False: the list of each output's loss (a trainer that normalises
                each output by its own pixel count, as deeplab-pytorch's per-output mean).
        """
        scales = self.multi_scale and isinstance(logits, (list, tuple)) and all(
            isinstance(t, torch.Tensor) for t in logits)
        # deeplab-pytorch's MSC in train mode returns [1x, 0.5x, 0.75x, max] (libs/models/msc.py:36-45
        # at 4219467, scales [0.5, 0.75]) and main.py L231-236 sums the CE of every one: sum the
        # MARS loss of every scale the same way.
        outs = list(logits) if scales else [self.output_transform(logits)]
        rgb = None
        if self.refine is not None:
            grids = [tuple(labels.shape[-2:]) if self.match != "labels" else tuple(t.shape[-2:]) for t in outs]
            rgb = self._check_images_rgb(images_rgb, labels, grids, outs[0].device)
        t_out = self.output_transform(self.teacher(images))
        # The teacher's labels depend only on the grid they are made on: compute them (and run
        # the CRF) once per grid, not once per scale.
        cache: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        losses = [self._one_scale(t, labels, image_classes, t_out, rgb, cache) for t in outs]
        return sum(losses) if reduce_outputs else losses

    def _check_images_rgb(self, images_rgb: Any, labels: torch.Tensor, grids: List[Tuple[int, int]],
                          device: torch.device) -> torch.Tensor:
        """``images_rgb`` as a (B, G_h, G_w, 3) uint8 tensor on ``device``, or an error that says
        what to pass. ``grids``: the grid the teacher is refined on, per scale."""
        B = int(labels.shape[0]) if labels.ndim == 3 else 1
        H, W = (int(v) for v in labels.shape[-2:])
        how = ("the RGB batch before your loader's normalisation (a mean/std loader: "
               "((images * std + mean) * 255).round().clamp(0, 255).byte().permute(0, 2, 3, 1); a BGR "
               "mean-subtracting one: (images + mean_bgr).round().clamp(0, 255).byte().flip(1).permute(0, 2, 3, 1))")
        if len(set(grids)) > 1:
            raise ValueError(
                f"refine={self.refine!r} with match='labels' would refine the teacher on every logits size "
                f"{sorted(set(grids))} of this multi-scale output, with images_rgb at each of them; construct the "
                f"hook with match='logits', so the teacher is refined once at the labels' size ({H}, {W}) and "
                f"images_rgb is that size: (B, {H}, {W}, 3) uint8")
        gh, gw = grids[0]
        where = (f"the labels' size ({H}, {W}), where match={self.match!r} refines the teacher"
                 if self.match != "labels"
                 else f"the logits' size ({gh}, {gw}), where match='labels' refines the teacher")
        if images_rgb is None:
            alt = (f" (or construct the hook with match='logits' to refine at the labels' size ({H}, {W}), as the "
                   f"paper does)" if self.match == "labels" and (gh, gw) != (H, W) else "")
            raise ValueError(
                f"refine={self.refine!r} needs images_rgb=: ({B}, {gh}, {gw}, 3) uint8 RGB at {where}{alt}; {how}")
        t = as_tensor(images_rgb, "images_rgb")
        if t.ndim == 3 and B == 1:
            t = t[None]
        if t.ndim != 4 or t.shape[0] != B:
            raise ValueError(f"images_rgb must be a batch of B={B} images, ({B}, {gh}, {gw}, 3) uint8 RGB at "
                             f"{where}, got {describe(images_rgb)}")
        if (gh, gw) == (3, 3) and tuple(t.shape[1:]) == (3, 3, 3):
            raise ValueError("images_rgb of 3x3 images reads both as (B, 3, H, W) and (B, H, W, 3); 3x3 is refused")
        if tuple(t.shape[1:]) == (3, gh, gw):
            t = t.permute(0, 2, 3, 1)
        elif tuple(t.shape[1:]) != (gh, gw, 3):
            if self.match == "labels" and tuple(t.shape[1:]) in ((H, W, 3), (3, H, W)) and (H, W) != (gh, gw):
                raise ValueError(
                    f"images_rgb {describe(images_rgb)} is at the labels' size ({H}, {W}), but with match='labels' "
                    f"the teacher is refined at the logits' size ({gh}, {gw}); construct the hook with "
                    f"MARSTrainingHook(model, refine={self.refine!r}, match='logits') so the teacher is upsampled to "
                    f"the labels and refined there (as the paper does)")
            raise ValueError(
                f"images_rgb must be ({B}, {gh}, {gw}, 3) uint8 RGB (or ({B}, 3, {gh}, {gw})) at {where}, got "
                f"{describe(images_rgb)}; pass {how}, at that size")
        if t.is_floating_point():
            lo, hi = (float(v) for v in t.aminmax()) if t.numel() else (0.0, 0.0)
            if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or hi > 1:
                hint = ("float in 0..255: convert with .round().byte()" if lo >= 0 and hi <= 255
                        else f"this looks like the normalised network input; pass {how}")
                raise ValueError(f"images_rgb must be uint8 0..255 or float in [0, 1], got {describe(images_rgb)} "
                                 f"with values in [{lo:.4g}, {hi:.4g}] ({hint})")
            t = (t.detach() * 255).round().to(torch.uint8)
        elif t.dtype != torch.uint8:
            raise TypeError(f"images_rgb must be uint8 0..255 (or float in [0, 1]), got {describe(images_rgb)}; "
                            f"convert with .to(torch.uint8) if it holds 0..255")
        return t.detach().to(device)

    def _one_scale(self, logits, labels, image_classes, t_logits, images_rgb, cache) -> torch.Tensor:
        if self.match == "logits":
            grid = tuple(labels.shape[-2:])
            if tuple(logits.shape[-2:]) != grid:
                logits = F.interpolate(logits, size=grid, mode="bilinear", align_corners=False)
        elif self.match == "labels_nearest":
            grid = tuple(labels.shape[-2:])  # the teacher completes the labels at their own size
        else:
            grid = tuple(logits.shape[-2:])
        if grid not in cache:
            y = self.targets(labels, grid)
            t = t_logits
            if tuple(t.shape[-2:]) != grid:  # the teacher straight to the grid, never through another scale
                t = F.interpolate(t, size=grid, mode="bilinear", align_corners=False)
            cache[grid] = complement_labels(
                y, t.float().softmax(1), image_classes, refine=self.refine, image=images_rgb,
                ignore_index=self.ignore_index, crf_params=self.crf_params, crf_backend=self.crf_backend,
            )
        y_co, w = cache[grid]
        if self.match == "labels_nearest":  # then to the logits' grid, DHR's nearest
            size = tuple(logits.shape[-2:])
            if size != grid:
                y_co, w = self.label_resize(y_co, size), self.label_resize(w, size)
        return self.loss(logits, y_co, w)

    def update(self, model: nn.Module) -> None:
        """EMA step of the teacher; call after ``optimizer.step()``."""
        self.teacher.update(model)

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to continue the EMA instead of restarting it from the student.

        ``{"format": STATE_FORMAT, "teacher": the teacher network's state_dict (parameters and
        buffers, the student's keys), "momentum": float}``: tensors, numbers and strings only,
        so ``torch.load(path, weights_only=True)`` reads a saved one back. As with
        ``nn.Module.state_dict``, the tensors are the teacher's own (detached, not copies): save
        them, or clone them to keep a snapshot. Everything else the hook holds is what its
        constructor took (refine, match, crf_params, ...): build the resumed hook the same way.
        """
        return {"format": STATE_FORMAT, "teacher": self.teacher.module.state_dict(),
                "momentum": float(self.teacher.momentum)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the teacher (and its momentum, as ``optimizer.load_state_dict`` restores its
        hyper-parameters) from :meth:`state_dict`. Every key and shape is checked first: a
        mismatch raises a ValueError naming it, and nothing is loaded."""
        if not isinstance(state, Mapping) or "teacher" not in state:
            got = sorted(map(str, state))[:5] if isinstance(state, Mapping) else describe(state)
            raise ValueError(f"state must be a MARSTrainingHook.state_dict() (keys 'format', 'teacher', 'momentum'), "
                             f"got {got}")
        if state.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise ValueError(f"state['format'] is {state['format']!r}, expected {STATE_FORMAT!r}")
        src = state["teacher"]
        if not isinstance(src, Mapping):
            raise TypeError(f"state['teacher'] must be a state dict, got {describe(src)}")
        dst = self.teacher.module.state_dict()
        if src.keys() != dst.keys():
            missing, unexpected = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
            hint = ""
            if {k[len("module."):] for k in src if k.startswith("module.")} == set(dst) or \
                    {"module." + k for k in src} == set(dst):
                hint = ("; the keys differ by a 'module.' prefix: build the hook on the same (DataParallel or "
                        "plain) model that was saved")
            raise ValueError(f"state['teacher'] does not match the teacher: missing keys {missing[:5]}, unexpected "
                             f"keys {unexpected[:5]}{hint}")
        for k, v in src.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state['teacher'][{k!r}] must be a tensor, got {describe(v)}")
            if v.shape != dst[k].shape:
                raise ValueError(f"state['teacher'][{k!r}] has shape {tuple(v.shape)}, the teacher's is "
                                 f"{tuple(dst[k].shape)}")
        momentum = check_fraction(state.get("momentum", self.teacher.momentum), "state['momentum']", low_open=False)
        frozen_teacher_warning(momentum)  # a restored momentum of 1 freezes the teacher from here on
        with torch.no_grad():
            for k, v in src.items():
                dst[k].copy_(v)
        self.teacher.momentum = momentum
