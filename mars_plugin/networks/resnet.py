"""The ResNet backbone of the segmentation networks of ``mars train``
(:mod:`mars_plugin.networks.deeplab`): ResNet-18/50/101 in torchvision's layout, dilated to an
output stride.

Torch only (torchvision does not import beside the pinned CPU wheel). Every number below is
read from the upstream code:

Backbone -- torchvision's ResNet (pytorch/vision, torchvision/models/resnet.py, read at
054e54c573ba46e5b9c63f1eea3ad4d103afbea2; the layout is unchanged in later releases):
  * state-dict keys and shapes exactly torchvision's (``conv1.weight``, ``bn1.*``,
    ``layer1.0.conv1.weight``, ..., ``layerN.0.downsample.0/1.*``) minus ``fc.*``, so its
    ImageNet files (``resnet101-63fe2227.pth``, ``resnet50-0676ba61.pth``,
    ``resnet18-f37072fd.pth`` and the older ``-5d3b4d8f``/``-19c8e357``/``-5c106cde``) load
    strictly; blocks [2, 2, 2, 2] (BasicBlock) for ResNet-18, [3, 4, 6, 3] and [3, 4, 23, 3]
    (Bottleneck, stride on the 3x3 conv2: "ResNet v1.5") for ResNet-50/101;
  * stem 7x7/2 conv, BN, ReLU, 3x3/2 max pool (padding 1, floor mode);
  * output stride: ``replace_stride_with_dilation`` = [False, False, True] for 16 and
    [False, True, True] for 8. A dilated layer's first block keeps the previous dilation (on
    the conv that would have carried the stride) and its other blocks use the doubled one, so
    at OS 8 layer3 is 1, 2, 2, ... and layer4 is 2, 4, 4; the 1x1 downsample loses its stride.
    torchvision refuses dilation in BasicBlock; for ResNet-18 we apply the same rule to its
    two 3x3 convs (conv1, which would carry the stride, at the previous dilation in a layer's
    first block; conv2 and later blocks at the new one), which keeps each conv's receptive
    field on the image what it is at output stride 32;
  * random init (no ``--weights``): torchvision's, kaiming-normal fan_out convs, BN 1 and 0.
  Upstream differences, kept out on purpose: RS+EPM's own ResNet (core/backbones/resnet,
  df538e2) builds OS 16 with layer4 at stride 1 and *no* dilation, and gives every first block
  dilation 1; deeplab-pytorch dilates all blocks of a layer (2 and 4) and uses caffe-converted
  MSRA weights with other key names. We follow torchvision, as the task and the ImageNet files
  do; ``--arch deeplabv2`` is deeplab-pytorch's own network (``msra_resnet.py``, ``deeplabv2.py``).

DHR's rule (``ResNet(name, os, rule="dhr")``, for the ``deeplabv3+dhr`` network of
:mod:`mars_plugin.networks.deeplab_dhr`) -- shjo-april/DHR at 94d5189,
core/backbones/resnet/__init__.py ``build_resnet`` and model.py ``ResNet._make_layer``, built
by core/layers.py ``Backbone`` with ``last_stride=1``:
  * the same keys, shapes, stem and v1.5 bottleneck (stride on conv2) as torchvision, so its
    ImageNet files load (DHR downloads torchvision's ``-5d3b4d8f``/``-19c8e357`` files and loads
    them with ``strict=False``, dropping ``fc.*``);
  * layer strides (1, 2, 2, 1) at output stride 16 (layer4 at stride 1 and *no* dilation) and
    (1, 2, 1, 1) at 8, with layer dilations (1, 1, 1, 1) and (1, 1, 2, 4); a layer's first
    block always has dilation 1 (``block(..., dilation=1)``), its other blocks the layer's; the
    1x1 downsample carries the layer's stride (1 where a layer is dilated);
  * BasicBlock (ResNet-18) ignores its ``dilation`` argument: both 3x3 convs undilated. (DHR's
    ``Backbone`` states ResNet-18's channels as ResNet-50's, so its DeepLabv3+ cannot build on
    ResNet-18 at all; we take the real channels so that tests stay small.)
  * no init of its own: PyTorch's default conv init (DHR always loads ImageNet weights over it).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

__all__ = [
    "BACKBONES",
    "ResNet",
    "RULES",
]

#: How a ResNet is dilated to its output stride: torchvision's ``replace_stride_with_dilation``
#: or DHR's ``build_resnet`` (see the module docstring).
RULES = ("torchvision", "dhr")

# DHR's build_resnet (last_stride=1): (stride, dilation) of layer1..layer4 per output stride
_DHR_LAYERS = {16: ((1, 1), (2, 1), (2, 1), (1, 1)), 8: ((1, 1), (2, 1), (1, 2), (1, 4))}

BACKBONES = ("resnet18", "resnet50", "resnet101")

# block type and blocks per layer (torchvision's resnet18/50/101)
_RESNETS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


def _conv3x3(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> nn.Conv2d:
    # padding = dilation keeps the size (at stride 1) for every dilation
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, dilation=dilation, bias=False)


class _BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: Optional[nn.Module],
                 first_dilation: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride, first_dilation)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes, 1, dilation)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: Optional[nn.Module],
                 first_dilation: int, dilation: int) -> None:
        super().__init__()
        # v1.5: the stride (or, dilated, the previous dilation) sits on the 3x3 conv2; a
        # bottleneck has one 3x3 conv, so only first_dilation is used (dilation is the same
        # number for every block but a dilated layer's first)
        del dilation
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride, first_dilation)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A torchvision-layout ResNet without ``avgpool``/``fc``, dilated to an output stride.

    ``forward(x)`` with x (B, 3, H, W) returns the outputs of layer1..layer4, of strides
    4, 8, min(16, os) and os (sizes as torchvision's convs give them: ceil of each halving).

    Args:
        name: ``"resnet18"``, ``"resnet50"`` or ``"resnet101"``.
        output_stride: 8, 16 or 32 (32: torchvision's classifier, no dilation; not with
            ``rule="dhr"``).
        rule: ``"torchvision"`` or ``"dhr"`` (DHR's strides, dilations and init; module docstring).
    """

    def __init__(self, name: str, output_stride: int = 32, rule: str = "torchvision") -> None:
        super().__init__()
        if name not in _RESNETS:
            raise ValueError(f"backbone must be one of {', '.join(map(repr, BACKBONES))}, got {name!r}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(map(repr, RULES))}, got {rule!r}")
        strides = (8, 16, 32) if rule == "torchvision" else (8, 16)
        if output_stride not in strides:
            raise ValueError(f"output_stride must be {', '.join(map(str, strides))} for rule {rule!r}, "
                             f"got {output_stride!r}")
        kind, blocks = _RESNETS[name]
        block = _BasicBlock if kind == "basic" else _Bottleneck
        self.name = name
        self.output_stride = output_stride
        self.rule = rule
        if rule == "dhr":
            self._build_dhr(block, blocks)
            return
        # torchvision's replace_stride_with_dilation for layer2, layer3, layer4
        dilate = {32: (False, False, False), 16: (False, False, True), 8: (False, True, True)}[output_stride]
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self._inplanes, self._dilation = 64, 1
        self.layer1 = self._make_layer(block, 64, blocks[0], 1, False)
        self.layer2 = self._make_layer(block, 128, blocks[1], 2, dilate[0])
        self.layer3 = self._make_layer(block, 256, blocks[2], 2, dilate[1])
        self.layer4 = self._make_layer(block, 512, blocks[3], 2, dilate[2])
        del self._inplanes, self._dilation
        #: channels of layer1..layer4
        self.channels = tuple(p * block.expansion for p in (64, 128, 256, 512))
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _build_dhr(self, block: type, blocks: Tuple[int, ...]) -> None:
        """DHR's ``ResNet`` (core/backbones/resnet/model.py): its strides and dilations, no init."""
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, n, (stride, dilation)) in enumerate(zip((64, 128, 256, 512), blocks,
                                                                 _DHR_LAYERS[self.output_stride]), 1):
            if block is _BasicBlock:
                dilation = 1  # DHR's BasicBlock takes dilation and never uses it
            downsample = None
            if stride != 1 or inplanes != planes * block.expansion:
                downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes * block.expansion, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes * block.expansion),
                )
            # the first block at dilation 1 (DHR passes dilation=1 to it), the others at the layer's
            layers = [block(inplanes, planes, stride, downsample, 1, 1)]
            inplanes = planes * block.expansion
            layers += [block(inplanes, planes, 1, None, dilation, dilation) for _ in range(1, n)]
            self.add_module(f"layer{i}", nn.Sequential(*layers))
        self.channels = tuple(p * block.expansion for p in (64, 128, 256, 512))

    def _make_layer(self, block: type, planes: int, blocks: int, stride: int, dilate: bool) -> nn.Sequential:
        previous = self._dilation
        if dilate:  # trade the stride for dilation from this layer on
            self._dilation *= stride
            stride = 1
        downsample = None
        if stride != 1 or self._inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self._inplanes, planes * block.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self._inplanes, planes, stride, downsample, previous, self._dilation)]
        self._inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self._inplanes, planes, 1, None, self._dilation, self._dilation))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c1 = self.layer1(x)
        c2 = self.layer2(c1)
        c3 = self.layer3(c2)
        c4 = self.layer4(c3)
        return c1, c2, c3, c4
