"""DeepLabv2 as the IRNet/AdvCAM rows trained it: deeplab-pytorch's ``DeepLabV2``, its ``MSC``
wrapper and a reader for its weight files.

Read from kazuto1011/deeplab-pytorch at 4219467fa5de07985f834f1bd8c04c186dc8f6d8:

* ``DeepLabV2`` (libs/models/deeplabv2.py:38-57): an ``nn.Sequential`` of ``layer1`` (the stem),
  ``layer2`` (stride 1, dilation 1), ``layer3`` (stride 2, dilation 1), ``layer4`` (stride 1,
  dilation 2), ``layer5`` (stride 1, dilation 4) -- the blocks of
  :mod:`mars_plugin.networks.msra_resnet` -- and ``aspp``; output stride fixed at 8 (L41).
  ``forward`` returns the ASPP's logits at stride 8, *not* up-sampled (the callers resize:
  main.py:381 for the test, :235 resizes the labels for the loss); ``freeze_bn`` puts every
  BatchNorm in eval mode (L54-57).
* ``_ASPP`` (L17-35): ``c0..c3``, 3x3 convs with bias from 2048 channels straight to the
  classes, stride 1, padding = dilation = rate (6, 12, 18, 24: libs/models/__init__.py:36,
  configs/voc12.yaml:33), weights N(0, 0.01) and biases 0, outputs summed.
* ``MSC`` (libs/models/msc.py:13-47): the base network on the image and on the image resized
  bilinearly (``align_corners=False``) by ``scale_factor`` 0.5 and 0.75 (the order of
  ``scales``, libs/models/__init__.py:38); the smaller logits resized bilinearly to the first's
  size and the pixel-wise max of the three taken. Train mode returns the list
  ``[logits, logits_0.5, logits_0.75, max]`` (the pyramid at its own sizes), eval mode the max
  alone. Its one child is ``base``: released checkpoints (``deeplabv2_resnet101_msc-*.pth``,
  hubconf.py) carry ``base.`` keys.

Our additions, none changing the forward: ``DeepLabV2`` takes ``backbone`` (``"resnet50"`` or
``"resnet101"``, see :data:`~mars_plugin.networks.msra_resnet.N_BLOCKS`) and ``num_classes`` C
(C + 1 outputs, background first), carries ``config`` (the arguments of ``build_model``) and
checks its input; the module names and the state-dict keys are upstream's (identity key map).

Weights (:func:`load_deeplab_pytorch_weights`): the files convert.py writes (a plain state dict
of the keys above, no ``module.``), as main.py:147-152 loads them into ``model.base`` with
``strict=False``: ``deeplabv1_resnet101-coco.pth`` (DeepLabV1's keys: the backbone plus ``fc``,
a 1x1 conv to COCO's 91 classes, which matches no key and is skipped; the ASPP keys it lacks
keep their random init), ``deeplabv2_resnet101_msc-vocaug*.pth`` (``base.``-prefixed, ASPP
included).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_num_classes, describe
from mars_plugin.formats.bounded_load import ReadRefused, torch_load
from mars_plugin.networks.msra_resnet import MSRA_BACKBONES, N_BLOCKS, _ResLayer, _Stem
from mars_plugin.networks.weight_files import check_weight_values, state_mismatch

__all__ = ["ATROUS_RATES", "MSC_SCALES", "DeepLabV2", "MSC", "load_deeplab_pytorch_weights"]

#: libs/models/__init__.py:36 / configs/voc12.yaml:33.
ATROUS_RATES = (6, 12, 18, 24)
#: libs/models/__init__.py:38 (and msc.py:24's default).
MSC_SCALES = (0.5, 0.75)
_CH = tuple(64 * 2 ** p for p in range(6))  # deeplabv2.py:46


class _ASPP(nn.Module):
    """``c0..c3``: dilated 3x3 convs with bias, summed; (B, in_ch, h, w) -> (B, out_ch, h, w)."""

    def __init__(self, in_ch: int, out_ch: int, rates: Sequence[int]) -> None:
        super().__init__()
        for i, rate in enumerate(rates):
            self.add_module(f"c{i}", nn.Conv2d(in_ch, out_ch, 3, 1, padding=rate, dilation=rate, bias=True))
        for m in self.children():  # after all are built, as upstream: the same random draws
            nn.init.normal_(m.weight, mean=0, std=0.01)
            nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(stage(x) for stage in self.children())


class DeepLabV2(nn.Sequential):
    """deeplab-pytorch's DeepLabV2 (see the module docstring for every number).

    Args:
        backbone: ``"resnet50"`` ([3, 4, 6, 3] blocks) or ``"resnet101"`` ([3, 4, 23, 3]).
        num_classes: C foreground classes; the network outputs C + 1 channels.
        output_stride: 8 only (upstream's is fixed).

    ``forward(x)``: x (B, 3, H, W) float, BGR minus the caffe mean
    (:func:`mars_plugin.networks.deeplab_pytorch.normalize`) -> logits (B, C + 1, h, w) at
    stride 8: h = ceil(ceil(H / 2) / 2) halved once more, rounding up (conv 7x7/2, ceil-mode
    pool, the 1x1/2 reduce of layer3), e.g. 321 -> 41.
    """

    arch = "deeplabv2"

    def __init__(self, backbone: str, num_classes: int, output_stride: int = 8) -> None:
        super().__init__()
        if backbone not in N_BLOCKS:
            raise ValueError(f"backbone must be one of {', '.join(map(repr, MSRA_BACKBONES))} for deeplabv2 "
                             f"(deeplab-pytorch's MSRA ResNet), got {backbone!r}")
        if output_stride != 8:
            raise ValueError(f"output_stride must be 8 for deeplabv2 (deeplab-pytorch's is fixed at 8), "
                             f"got {output_stride!r}")
        num_classes = check_num_classes(num_classes)
        n_blocks = N_BLOCKS[backbone]
        self.add_module("layer1", _Stem(_CH[0]))
        self.add_module("layer2", _ResLayer(n_blocks[0], _CH[0], _CH[2], 1, 1))
        self.add_module("layer3", _ResLayer(n_blocks[1], _CH[2], _CH[3], 2, 1))
        self.add_module("layer4", _ResLayer(n_blocks[2], _CH[3], _CH[4], 1, 2))
        self.add_module("layer5", _ResLayer(n_blocks[3], _CH[4], _CH[5], 1, 4))
        self.add_module("aspp", _ASPP(_CH[5], num_classes + 1, ATROUS_RATES))
        self.backbone_name = backbone
        self.num_classes = num_classes

    @property
    def config(self) -> Dict[str, Any]:
        """The arguments of ``build_model`` that rebuild this network."""
        return {"arch": self.arch, "backbone": self.backbone_name, "output_stride": 8,
                "num_classes": self.num_classes}

    def freeze_bn(self) -> None:
        """Every BatchNorm to eval mode (running statistics), as main.py:208 before training."""
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor (B, 3, H, W) of BGR mean-subtracted images, got {describe(x)}")
        return super().forward(x)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class MSC(nn.Module):
    """Multi-scale inputs around ``base`` (libs/models/msc.py).

    ``forward(x)``, x (B, 3, H, W): train mode -> ``[logits, *pyramid, max]`` (the base's logits
    at scale 1, at each of ``scales`` at their own sizes, and the pixel-wise max of all, the
    pyramid resized bilinearly to the first's size); eval mode -> the max (B, L, h, w).
    """

    def __init__(self, base: nn.Module, scales: Sequence[float] = MSC_SCALES) -> None:
        super().__init__()
        self.base = base
        self.scales = list(scales) if scales else list(MSC_SCALES)  # msc.py:21-24: empty or None: the default

    @property
    def config(self) -> Dict[str, Any]:
        return self.base.config

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, List[torch.Tensor]]:
        logits = self.base(x)
        size = tuple(logits.shape[-2:])
        pyramid = [self.base(F.interpolate(x, scale_factor=p, mode="bilinear", align_corners=False))
                   for p in self.scales]
        every = [logits] + [F.interpolate(p, size=size, mode="bilinear", align_corners=False) for p in pyramid]
        logits_max = torch.max(torch.stack(every), dim=0)[0]
        if self.training:
            return [logits] + pyramid + [logits_max]
        return logits_max


PathLike = Union[str, os.PathLike]


def _net_of(model: Any) -> DeepLabV2:
    net = model
    while isinstance(getattr(net, "module", None), nn.Module):  # DDP / DataParallel / EMATeacher
        net = net.module
    if isinstance(net, MSC):
        net = net.base
    if not isinstance(net, DeepLabV2):
        raise TypeError(f"model must be a deeplabv2 network (DeepLabV2 or MSC around one), got {describe(net)}")
    return net


def load_deeplab_pytorch_weights(model: nn.Module, path: PathLike) -> List[str]:
    """Load a deeplab-pytorch weight file into a :class:`DeepLabV2` (or an ``MSC`` around one).

    As main.py:147-152 (``model.base.load_state_dict(state_dict, strict=False)``): keys are
    upstream's; a ``base.`` prefix on every key (an ``MSC`` checkpoint) is removed; ``fc.*``
    (DeepLabv1's COCO classifier, an ImageNet classifier) is skipped; the ASPP is loaded when the
    file has it and keeps its random init when it has none (the COCO file). Stricter than
    upstream, so that a wrong file fails here instead of training from random weights: every
    backbone key (``layer1``..``layer5``) must be in the file with its shape (BatchNorm's
    ``num_batches_tracked`` may be missing), and no other key may be. Floating tensors of any
    precision are accepted (convert.py stores the running statistics as float64) and copied
    into the network's dtype. Read with ``torch.load(weights_only=True)``; nothing is loaded
    unless all of it fits.

    Returns:
        The network keys the file did not set (the ASPP's, where the file has none).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file and what does not fit.
    """
    net = _net_of(model)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        state = torch_load(path, what="deeplab-pytorch weights")
    except ReadRefused:
        raise
    except Exception as e:  # noqa: BLE001 -- any unreadable file is refused with one line
        raise ValueError(f"{path}: cannot be read as a weights-only torch file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    if not isinstance(state, dict) or not state or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                          for k, v in state.items()):
        got = "a dict with other entries" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: not a state dict of tensors (a deeplab-pytorch weight file), got {got}")
    if all(k.startswith("base.") for k in state):
        state = {k[len("base."):]: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    expected = net.state_dict()
    head = [k for k in expected if k.startswith("aspp.")]
    has_head = any(k.startswith("aspp.") for k in state)
    required = [k for k in expected if not k.endswith("num_batches_tracked") and (has_head or k not in head)]
    parts = state_mismatch(state, expected, required)
    if parts:
        reshaped = [k for k in expected if k in state and state[k].shape != expected[k].shape]
        hint = ""
        if "conv1.weight" in state or any(k.startswith("layer1.0.") for k in state):
            hint = ("; its keys are torchvision's (conv1.weight, layer1.0.conv1...): deeplabv2 takes deeplab-pytorch's "
                    "caffe-converted files (layer1.conv1.conv.weight, layer2.block1.reduce...)")
        elif reshaped and all(k.startswith("aspp.") for k in reshaped):
            hint = (f"; its ASPP has {int(state['aspp.c0.weight'].shape[0])} outputs, the network "
                    f"{net.num_classes + 1} (--num-classes C gives C + 1)")
        elif len([k for k in state if k.startswith("layer4.")]) != len([k for k in expected if k.startswith("layer4.")]):
            hint = f"; the file's layer4 has another number of blocks (not the {net.backbone_name} file)"
        raise ValueError(f"{path}: does not fit deeplabv2 {net.backbone_name} (deeplab-pytorch layout): "
                         f"{'; '.join(parts)}{hint}")
    check_weight_values(state, path)
    full = {k: state.get(k, expected[k]) for k in expected}  # absent: the network's own (random ASPP, counters)
    net.load_state_dict(full, strict=True)
    return [k for k in expected if k not in state]
