"""The ``dhr`` recipe's loss grid in ``mars train``: where the logits and the labels meet.

DHR's DeepLabv3+ (``deeplabv3+dhr``) returns its logits at stride 4, and DHR's ``train.py:325``
(shjo-april/DHR at 94d5189) takes the loss there: ``seg_loss_fn(logits,
torch_utils.resize(pseudo_masks.float(), logits.shape[2:], mode='nearest').long())``, the labels
brought to the logits' grid by ``F.interpolate(mode="nearest")``
(:func:`mars_plugin.adapters.training_hook.resize_nearest`). The recipe's ``loss_grid``:

* ``"logits"``: the loss on the logits' grid. ``loss="mars"``: :class:`MARSTrainingHook` with
  ``match="labels_nearest"`` (the teacher completes and refines the labels at the crop's size, on
  the crop's RGB, then the completed labels and their weights are brought to the logits' grid as
  DHR brings its masks); ``loss="ce"``: CE on the labels resized the same way.
* ``"input"``: the loss at the crop's size (the logits up-sampled bilinearly,
  ``align_corners=False``, where they are coarser; the hook's ``match="logits"``): what ``mars
  train`` did before recipes, and SEAM's network, whose logits are at the input size already.

The loss of a step is a sum divided by the global count of the pixels it sums over (see
:mod:`mars_plugin.commands.train`); that count is taken on the loss grid
(:func:`loss_labels`), before the forward, from the grid the network gives a crop
(:func:`logits_size`, one trace on the ``meta`` device per input size).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Tuple

import torch
import torch.nn.functional as F

from mars_plugin.adapters.training_hook import resize_nearest
from mars_plugin.formats.files import IGNORE_VALUE

__all__ = ["HOOK_MATCH", "hook_match", "logits_size", "loss_labels", "ce_loss_sum", "check_logits"]

#: :class:`~mars_plugin.adapters.training_hook.MARSTrainingHook`'s ``match`` for each ``loss_grid``.
HOOK_MATCH = {"logits": "labels_nearest", "input": "logits"}


def hook_match(s: Any) -> str:
    """The hook's ``match`` for the settings ``s`` (a :class:`~mars_plugin.commands.train_settings.TrainSettings`)."""
    return HOOK_MATCH[s.loss_grid]


@functools.lru_cache(maxsize=None)
def _traced_size(arch: str, backbone: str, output_stride: int, num_classes: int,
                 size: Tuple[int, int]) -> Tuple[int, int]:
    from mars_plugin.networks.deeplab import build_model

    # shapes only: no memory, no arithmetic, and no draw from the random generator
    with torch.device("meta"):
        net = build_model(arch, backbone, num_classes, output_stride).eval()
        with torch.no_grad():
            out = net(torch.empty(1, 3, *size))
    return int(out.shape[-2]), int(out.shape[-1])


def logits_size(model: Mapping[str, Any], size: Tuple[int, int]) -> Tuple[int, int]:
    """The (h, w) of the logits the network of ``model`` (``TrainSettings.model``: the arguments
    of :func:`~mars_plugin.networks.deeplab.build_model`) gives an input of ``size`` (H, W):
    ``deeplabv3+dhr``: ``ceil(ceil(H / 2) / 2)``; ``deeplabv3+``: (H, W)."""
    return _traced_size(str(model["arch"]), str(model["backbone"]), int(model["output_stride"]),
                        int(model["num_classes"]), (int(size[0]), int(size[1])))


def loss_labels(s: Any, y: torch.Tensor) -> torch.Tensor:
    """Labels (B, H, W) on the grid the loss of ``s.loss_grid`` sums over: the logits' grid
    (:func:`logits_size`, DHR's nearest resize) for ``"logits"``, the crop's for ``"input"``.
    Their non-ignored pixels are the count the loss is divided by."""
    if s.loss_grid == "logits":
        return resize_nearest(y, logits_size(s.model, tuple(y.shape[-2:])))
    return y


def check_logits(s: Any, logits: Any, y: torch.Tensor) -> None:
    """The network's output is what :func:`loss_labels` counted on: one tensor (B, C + 1, h, w)
    at :func:`logits_size`'s grid, no larger than the labels (B, H, W); else a one-line error
    naming the network and ``loss_grid``."""
    size = tuple(y.shape[-2:])
    want = logits_size(s.model, size)
    got = tuple(logits.shape[-2:]) if isinstance(logits, torch.Tensor) and logits.ndim == 4 else None
    if got != want or want[0] > size[0] or want[1] > size[1]:
        what = f"logits {got}" if got is not None else f"an output of type {type(logits).__name__}"
        raise ValueError(f"mars train: {s.arch} {s.backbone} gives {what} on labels {size} (expected logits {want}, "
                         f"at most the labels' size); loss_grid {s.loss_grid!r} cannot meet them")


def ce_loss_sum(s: Any, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``loss="ce"``: the summed CE on the loss grid (``"logits"``: DHR train.py:325,
    ``ignore_index=255``; ``"input"``: the logits up-sampled bilinearly to the labels)."""
    logits = logits.float()
    if s.loss_grid == "logits":
        y = resize_nearest(y, tuple(logits.shape[-2:]))
    elif tuple(logits.shape[-2:]) != tuple(y.shape[-2:]):
        logits = F.interpolate(logits, size=tuple(y.shape[-2:]), mode="bilinear", align_corners=False)
    return F.cross_entropy(logits, y.long(), ignore_index=IGNORE_VALUE, reduction="sum")
