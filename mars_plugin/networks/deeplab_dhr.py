"""DHR's DeepLabv3+ as it is: arch ``"deeplabv3+dhr"`` of :func:`mars_plugin.networks.deeplab.build_model`,
the network of the ``dhr`` recipe (the paper's RS+EPM row, trained with DHR's ``train.py``).

Read from shjo-april/DHR at 94d5189: core/networks.py ``DeepLabv3plus`` (not
``DeepLabv3plus_with_DHR``, whose extra ``classifier`` on C5 is DHR's own CAM loss, not MARS),
core/layers.py ``Backbone``, ``ConvBlock``, ``DeepLabv3_ASPP``, ``DeepLabv3plus_Head``, and
core/backbones/resnet (``build_resnet``). ``train.py`` and ``produce_wss_masks.py`` build it with
the defaults: ``output_stride=8``, ``last_stride=1``, ``feature_size=256``, ``low_channels=48``.

* Backbone: :class:`mars_plugin.networks.resnet.ResNet` with ``rule="dhr"`` (layer4 at stride 1;
  at OS 8 layer3/layer4 dilated 2/4 except their first block; OS 16: layer4 undilated; the
  resnet module docstring gives each number). torchvision's ImageNet files load into it
  (:func:`mars_plugin.networks.deeplab.load_backbone_weights`), as DHR loads them.
* ASPP on C5 (layer4): 1x1 ``ConvBlock`` and three 3x3 at rates 6, 12, 18 (OS 16) or 12, 24, 36
  (OS 8), padding = rate; image pooling ``gap`` = AdaptiveAvgPool2d(1) -> 1x1 ConvBlock, resized
  bilinearly (``align_corners=False``) to the ASPP's size; concatenation (5 x 256) -> 1x1
  ConvBlock with Dropout(0.5) (``block``).
* Decoder on C2 (layer1): ``low_block`` 1x1 ConvBlock to 48; ASPP output resized bilinearly
  (``align_corners=False``) to C2's size, concatenated (304) -> ``mid_block``: 3x3 ConvBlock
  (Dropout 0.5), 3x3 ConvBlock (Dropout 0.1) -> ``classifier``: a **1x1 conv without bias** to
  C + 1 (RS+EPM's is 3x3).
* ConvBlock: conv (no bias) -> BatchNorm2d (PyTorch's eps 1e-5, momentum 0.1) -> ReLU ->
  Dropout (an Identity when 0). No init of its own anywhere: PyTorch's defaults.
* **Output**: the classifier's logits at C2's grid (stride 4: ``ceil`` of each halving of the
  input), *not* upsampled to the input (DHR's ``forward`` returns ``{'logits': logits}`` at that
  grid; its loss resizes the labels to it, its ``apply_ms`` resizes the probabilities).
  ``forward`` returns the tensor itself, not a dict.

ResNet-18 (tests only): DHR's ``Backbone`` gives every ResNet ResNet-50's channel list, so its
DeepLabv3+ cannot build on ResNet-18; here the ASPP and the decoder take ResNet-18's real
channels (512 on C5, 64 on C2). ResNet-50/101 are DHR's exactly. Another depth: add its blocks
to ``resnet._RESNETS``; the head needs nothing.

Key map, one to one both ways (:func:`to_upstream_state_dict`, :func:`load_upstream_state_dict`):
DHR's module names are kept, only the backbone's prefix differs --
``backbone.<k>`` here is ``model.<k>`` in DHR, ``seg_decoder.<k>`` is ``seg_decoder.<k>`` in
both (e.g. ``seg_decoder.aspp.gap.1.conv.weight``, ``seg_decoder.mid_block.0.bn.running_mean``,
``seg_decoder.classifier.weight``). A checkpoint of DHR's ``DeepLabv3plus_with_DHR`` (what its
``train.py`` saves) holds one key more, ``classifier.weight`` (DHR's CAM classifier), which
:func:`load_upstream_state_dict` drops as DHR's ``produce_wss_masks.py`` does (``strict=False``);
keys wrapped by DataParallel/DDP (``module.``) are unwrapped.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import describe
from mars_plugin.networks.deeplab import _SegNet, _unwrap

__all__ = [
    "DeepLabV3PlusDHR",
    "to_upstream_state_dict",
    "load_upstream_state_dict",
    "UPSTREAM_PREFIX",
    "IGNORED_UPSTREAM_KEYS",
]

#: DHR's name of the backbone module (``Backbone.model``); ours is ``backbone``.
UPSTREAM_PREFIX = "model."
#: Keys of DHR's training checkpoints that are not the segmentation network (DHR's CAM head).
IGNORED_UPSTREAM_KEYS = ("classifier.weight",)


class _ConvBlock(nn.Module):
    """DHR's ``ConvBlock``: conv (no bias) -> BN -> ReLU -> Dropout (Identity at 0); its names."""

    def __init__(self, cin: int, cout: int, kernel_size: int, padding: int = 0, dilation: int = 1,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=1, padding=padding, dilation=dilation, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.act(self.bn(self.conv(x))))


class _ASPP(nn.Module):
    """DHR's ``DeepLabv3_ASPP``."""

    def __init__(self, cin: int, cout: int, rates: Sequence[int]) -> None:
        super().__init__()
        self.aspp1 = _ConvBlock(cin, cout, 1)
        self.aspp2 = _ConvBlock(cin, cout, 3, padding=rates[0], dilation=rates[0])
        self.aspp3 = _ConvBlock(cin, cout, 3, padding=rates[1], dilation=rates[1])
        self.aspp4 = _ConvBlock(cin, cout, 3, padding=rates[2], dilation=rates[2])
        self.gap = nn.Sequential(nn.AdaptiveAvgPool2d((1, 1)), _ConvBlock(cin, cout, 1))
        self.block = _ConvBlock(5 * cout, cout, 1, dropout=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x4 = self.aspp4(x)
        x5 = F.interpolate(self.gap(x), size=x4.shape[2:], mode="bilinear", align_corners=False)
        return self.block(torch.cat((self.aspp1(x), self.aspp2(x), self.aspp3(x), x4, x5), dim=1))


class _Head(nn.Module):
    """DHR's ``DeepLabv3plus_Head`` (returns only the logits; DHR also returns ``x_dec``)."""

    def __init__(self, cin: int, cout: int, low_cin: int, low_cout: int, rates: Sequence[int],
                 num_outputs: int) -> None:
        super().__init__()
        self.aspp = _ASPP(cin, cout, rates)
        self.low_block = _ConvBlock(low_cin, low_cout, 1)
        self.mid_block = nn.Sequential(
            _ConvBlock(cout + low_cout, cout, 3, padding=1, dropout=0.5),
            _ConvBlock(cout, cout, 3, padding=1, dropout=0.1),
        )
        self.classifier = nn.Conv2d(cout, num_outputs, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, x_low: torch.Tensor) -> torch.Tensor:
        x = self.aspp(x)
        x_low = self.low_block(x_low)
        x = F.interpolate(x, size=x_low.shape[2:], mode="bilinear", align_corners=False)
        return self.classifier(self.mid_block(torch.cat((x, x_low), dim=1)))


class DeepLabV3PlusDHR(_SegNet):
    """DHR's ``DeepLabv3plus`` (module docstring): ``forward(x)`` maps (B, 3, H, W) normalised
    images to (B, C + 1, h, w) logits at stride 4 (h = ceil(ceil(H / 2) / 2), likewise w), not
    upsampled to the input."""

    arch = "deeplabv3+dhr"
    resnet_rule = "dhr"

    def __init__(self, backbone: str, num_classes: int, output_stride: int = 8) -> None:
        super().__init__(backbone, num_classes, output_stride)
        rates = {16: (6, 12, 18), 8: (12, 24, 36)}[output_stride]
        c = self.backbone.channels
        self.seg_decoder = _Head(c[3], 256, c[0], 48, rates, num_classes + 1)

    def _head(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        bn = self.seg_decoder.aspp.gap[1].bn
        if self.training and feats[3].shape[0] < 2 and type(bn) is nn.BatchNorm2d:
            # BatchNorm on the pooled 1x1 map sees one value per channel per image
            raise ValueError("deeplabv3+dhr trains on at least 2 images per batch (its image-pooling BatchNorm "
                             f"needs 2 values per channel), got a batch of {feats[3].shape[0]}; "
                             "use a larger batch, SyncBatchNorm across processes, or eval mode")
        return self.seg_decoder(feats[3], feats[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes + 1, h, w) at stride 4 (background first) for images x (B, 3, H, W)."""
        self._check_input(x)
        return self._head(self.backbone(x))


def _dhr_net(model: nn.Module, name: str = "model") -> DeepLabV3PlusDHR:
    net = _unwrap(model)
    if not isinstance(net, DeepLabV3PlusDHR):
        raise TypeError(f"{name} must be a deeplabv3+dhr network (build_model('deeplabv3+dhr', ...)), "
                        f"got {describe(net)}")
    return net


def to_upstream_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict of ``model`` under DHR's names (``backbone.`` -> ``model.``, the rest the
    same): what DHR's ``DeepLabv3plus.load_state_dict`` takes (strictly)."""
    net = _dhr_net(model)
    return {(UPSTREAM_PREFIX + k[len("backbone."):] if k.startswith("backbone.") else k): v
            for k, v in net.state_dict().items()}


def load_upstream_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a DHR state dict (``DeepLabv3plus``'s, or a ``train.py`` checkpoint of
    ``DeepLabv3plus_with_DHR``: its ``classifier.weight`` is dropped) into ``model``, strictly
    otherwise: a missing or unexpected key is a ValueError naming it. ``module.`` prefixes (DDP)
    are removed."""
    net = _dhr_net(model)
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a state dict (name -> tensor), got {describe(state)}")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    ours = {}
    for k, v in state.items():
        if k in IGNORED_UPSTREAM_KEYS:
            continue
        ours["backbone." + k[len(UPSTREAM_PREFIX):] if k.startswith(UPSTREAM_PREFIX) else k] = v
    expected = net.state_dict()
    missing = [k for k in expected if k not in ours]
    unexpected = [k for k in ours if k not in expected]
    if missing or unexpected:
        back = lambda k: UPSTREAM_PREFIX + k[len("backbone."):] if k.startswith("backbone.") else k  # noqa: E731
        raise ValueError(f"state does not fit {net.config}: missing {[back(k) for k in missing][:4]} "
                         f"({len(missing)}), unexpected {[back(k) for k in unexpected][:4]} ({len(unexpected)})")
    net.load_state_dict(ours, strict=True)
