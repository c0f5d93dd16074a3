"""The dilated MSRA (caffe) ResNet of deeplab-pytorch's DeepLabv2: its building blocks, with
upstream's module names, so that upstream's state dicts load with the identity key map.

Read from kazuto1011/deeplab-pytorch libs/models/resnet.py at
4219467fa5de07985f834f1bd8c04c186dc8f6d8 (line numbers of that file):

* ``_ConvBnReLU`` (L26-46): an ``nn.Sequential`` of ``conv`` (no bias), ``bn``
  (``BatchNorm2d(eps=1e-5, momentum=1 - 0.999)``, L43: the caffe model's moving-average
  fraction 0.999) and, unless ``relu=False``, ``relu`` (``nn.ReLU()``, not in place);
* ``_Bottleneck`` (L49-71): ``reduce`` 1x1 *with the block's stride* (the MSRA/caffe ResNet;
  torchvision's "v1.5" puts it on the 3x3), ``conv3x3`` 3x3 at padding = dilation = the block's
  dilation, ``increase`` 1x1 without ReLU, ``shortcut`` a 1x1 ``_ConvBnReLU`` at the block's
  stride without ReLU in the first block of a layer (``nn.Identity`` in the others); output
  ``relu(increase + shortcut)``; mid channels = out / 4;
* ``_ResLayer`` (L74-98): blocks ``block1..blockN``, the stride in ``block1`` only, every block
  at ``dilation * multi_grids[i]`` (multi_grids None: all 1, as DeepLabV2 builds it, so every
  block of a dilated layer is dilated, the first included);
* ``_Stem`` (L101-110): ``conv1`` a 7x7/2 ``_ConvBnReLU`` at padding 3, then ``pool``
  ``MaxPool2d(3, 2, 1, ceil_mode=True)`` ("different from both MSRA and FAIR ResNet", L104).

Blocks per layer: ResNet-101 [3, 4, 23, 3] (libs/models/__init__.py:36, configs/voc12.yaml:32);
ResNet-50 [3, 4, 6, 3], the same rule with fewer blocks in layer4 (deeplab-pytorch itself has no
ResNet-50 factory: the IRNet row's R50 is this network with ``n_blocks`` [3, 4, 6, 3]).

Random init: PyTorch's defaults (upstream's DeepLabV2 never re-initialises the backbone; it
starts from converted caffe weights). Modules are created in upstream's order, so one seed
gives the same random weights as upstream.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BN_EPS", "BN_MOMENTUM", "N_BLOCKS", "MSRA_BACKBONES"]

#: libs/models/resnet.py:43 ``eps=1e-5, momentum=1 - 0.999``.
BN_EPS = 1e-5
BN_MOMENTUM = 1 - 0.999
#: Bottleneck blocks of layer2..layer5 (upstream's names; torchvision's layer1..layer4).
N_BLOCKS: Dict[str, Tuple[int, int, int, int]] = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}
MSRA_BACKBONES = tuple(N_BLOCKS)
_EXPANSION = 4  # libs/models/resnet.py:23 _BOTTLENECK_EXPANSION


class _ConvBnReLU(nn.Sequential):
    """conv (no bias) -> BN (eps 1e-5, momentum 0.001) -> ReLU (left out when ``relu=False``)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, padding: int, dilation: int,
                 relu: bool = True) -> None:
        super().__init__()
        self.add_module("conv", nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, dilation, bias=False))
        self.add_module("bn", nn.BatchNorm2d(out_ch, eps=BN_EPS, momentum=BN_MOMENTUM))
        if relu:
            self.add_module("relu", nn.ReLU())


class _Bottleneck(nn.Module):
    """The MSRA bottleneck: the stride on the 1x1 ``reduce``; (B, in_ch, H, W) -> (B, out_ch, H', W')."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, dilation: int, downsample: bool) -> None:
        super().__init__()
        mid_ch = out_ch // _EXPANSION
        self.reduce = _ConvBnReLU(in_ch, mid_ch, 1, stride, 0, 1, True)
        self.conv3x3 = _ConvBnReLU(mid_ch, mid_ch, 3, 1, dilation, dilation, True)
        self.increase = _ConvBnReLU(mid_ch, out_ch, 1, 1, 0, 1, False)
        self.shortcut = _ConvBnReLU(in_ch, out_ch, 1, stride, 0, 1, False) if downsample else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.increase(self.conv3x3(self.reduce(x)))
        return F.relu(h + self.shortcut(x))


class _ResLayer(nn.Sequential):
    """``n_layers`` bottlenecks ``block1..``: the stride and the projection shortcut in the first,
    each block dilated by ``dilation * multi_grids[i]`` (all 1 without multi grids)."""

    def __init__(self, n_layers: int, in_ch: int, out_ch: int, stride: int, dilation: int,
                 multi_grids: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        if multi_grids is None:
            multi_grids = [1] * n_layers
        elif len(multi_grids) != n_layers:
            raise ValueError(f"multi_grids must have one entry per block ({n_layers}), got {list(multi_grids)}")
        for i in range(n_layers):
            self.add_module(f"block{i + 1}", _Bottleneck(
                in_ch=in_ch if i == 0 else out_ch, out_ch=out_ch, stride=stride if i == 0 else 1,
                dilation=dilation * multi_grids[i], downsample=i == 0))


class _Stem(nn.Sequential):
    """``conv1`` 7x7/2 conv-BN-ReLU (padding 3), ``pool`` 3x3/2 max pool, padding 1, ceil mode."""

    def __init__(self, out_ch: int) -> None:
        super().__init__()
        self.add_module("conv1", _ConvBnReLU(3, out_ch, 7, 2, 3, 1))
        self.add_module("pool", nn.MaxPool2d(3, 2, 1, ceil_mode=True))
