"""The segmentation networks of ``mars train``: DeepLabv3+ and DeepLabv2 on ResNet-18/50/101.

The ResNet backbone (torchvision's layout, dilated to the output stride) is
:class:`mars_plugin.networks.resnet.ResNet`; its module docstring gives its upstream numbers.

Torch only (torchvision does not import beside the pinned CPU wheel). Every number below is
read from the upstream code the paper's rows were trained with:

DeepLabv3+ -- RS+EPM (shjo-april/RecurSeed_and_EdgePredictMix, core/layers.py and
core/networks.py ``DeepLabv3_Plus``, read at df538e2a2b7b0cd2a01e6a8c3e1ea37421167100):
  * ASPP on layer4 (2048 channels; 512 for ResNet-18): 1x1 conv plus three 3x3 convs at rates
    6, 12, 18 for OS 16 and 12, 24, 36 for OS 8, each conv (no bias) + BN + ReLU to 256
    channels; image pooling = global average pool, 1x1 conv + BN + ReLU, bilinear up-sampling;
    concatenation (5 x 256) -> 1x1 conv + BN + ReLU to 256 -> Dropout(0.5);
  * decoder on layer1 (256 channels; 64 for ResNet-18): 1x1 conv + BN + ReLU to 48 channels;
    ASPP output up-sampled to layer1's size, concatenated (304) -> 3x3 conv + BN + ReLU (256)
    -> Dropout(0.5) -> 3x3 conv + BN + ReLU (256) -> Dropout(0.1) -> 3x3 conv to C + 1, no
    bias;
  * every resize is bilinear with ``align_corners=False`` (tools/ai/torch_utils.py ``resize``),
    the logits too, up-sampled to the input size (``same=True``);
  * norm layer: ``nn.BatchNorm2d``, trained (``norm_fn='bn'``; FixedBatchNorm is only used by
    RS+EPM's AffinityNet); ``nn.SyncBatchNorm.convert_sync_batchnorm`` gives SyncBN;
  * head init: PyTorch's default (RS+EPM never calls its ``initialize`` on these layers).
  The head's module names are RS+EPM's (``aspp.aspp1.conv``, ``aspp.global_avg_pool.1``,
  ``aspp.block.0``, ``decoder.low_block``, ``decoder.classifier.{0,2,4}``); RS+EPM's released
  DeepLabv3+ weights differ from ours only in the backbone prefix (``model.`` for ``backbone.``).
  (PuzzleCAM's older core/deeplab_utils.py, same author, ends with a 1x1 conv with bias and
  resizes with ``align_corners=True``; RS+EPM, the paper's row, is what we follow.)

DeepLabv2 -- the IRNet/AdvCAM rows' network: deeplab-pytorch's own DeepLabV2 on its MSRA ResNet-50/101,
output stride 8, logits at stride 8 (not up-sampled), its module names and keys
(:class:`mars_plugin.networks.deeplabv2.DeepLabV2`, every number in that module's docstring);
``--weights`` for it reads deeplab-pytorch's caffe-converted files
(:func:`mars_plugin.networks.deeplabv2.load_deeplab_pytorch_weights`).

Training groups (:func:`param_groups`): RS+EPM's ``get_parameter_groups`` (core/abc_modules.py)
splits parameters into backbone weights, backbone biases, new weights, new biases by name
("weight" in the name: conv *and* BN weights), and the lr/decay of each group come from the
same author's released segmentation trainer, PuzzleCAM's train_segmentation.py
(shjo-april/PuzzleCAM @ 16a920c): lr x1 with decay, x2 without, x10 with, x20 without. RS+EPM's
own segmentation trainer is unreleased ("under review"). deeplab-pytorch's main.py gives the
same x1 / x10 / x20-no-decay multipliers to its conv weights and ASPP biases (it freezes BN).

Normalization: ImageNet mean/std on [0, 1] RGB (RS+EPM tools/ai/augment_utils.py
``Normalize``), see :func:`normalize`.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_num_classes, check_real_param, describe
from mars_plugin.formats.bounded_load import ReadRefused, torch_load
from mars_plugin.networks.deeplabv2 import MSC, DeepLabV2, load_deeplab_pytorch_weights
from mars_plugin.networks.msra_resnet import MSRA_BACKBONES
from mars_plugin.networks.resnet import BACKBONES, ResNet
from mars_plugin.networks.weight_files import check_weight_values, state_mismatch

__all__ = [
    "ARCHS",
    "OUTPUT_STRIDES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DeepLabV3Plus",
    "DeepLabV2",
    "build_model",
    "load_backbone_weights",
    "param_groups",
    "normalize",
]

ARCHS = ("deeplabv3+", "deeplabv2", "deeplabv3+dhr", "deeplabv1-wr38")
OUTPUT_STRIDES = (8, 16)
#: The output stride each arch is trained with upstream (RS+EPM: 16; deeplab-pytorch: 8; DHR's
#: train.py and produce_wss_masks.py: 8, core/networks.py ``DeepLabv3plus(output_stride=8)``).
DEFAULT_OUTPUT_STRIDE = {"deeplabv3+": 16, "deeplabv2": 8, "deeplabv3+dhr": 8, "deeplabv1-wr38": 8}

#: ImageNet statistics of RGB in [0, 1] (torchvision's, used by RS+EPM's ``Normalize``).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

PathLike = Union[str, os.PathLike]


class _ConvBNReLU(nn.Module):
    """conv (no bias) + BN + ReLU; the names are RS+EPM's ``ConvBlock`` (conv, bn, relu)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, padding: int = 0, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, padding=padding, dilation=dilation, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def _resize(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    # RS+EPM's torch_utils.resize: bilinear, align_corners=False, skipped when the size is equal
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)


class _ASPPv3(nn.Module):
    def __init__(self, cin: int, cout: int, rates: Sequence[int]) -> None:
        super().__init__()
        self.aspp1 = _ConvBNReLU(cin, cout, 1)
        self.aspp2 = _ConvBNReLU(cin, cout, 3, padding=rates[0], dilation=rates[0])
        self.aspp3 = _ConvBNReLU(cin, cout, 3, padding=rates[1], dilation=rates[1])
        self.aspp4 = _ConvBNReLU(cin, cout, 3, padding=rates[2], dilation=rates[2])
        self.global_avg_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), _ConvBNReLU(cin, cout, 1))
        self.block = nn.Sequential(_ConvBNReLU(5 * cout, cout, 1), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = _resize(self.global_avg_pool(x), x.shape[-2:])
        return self.block(torch.cat([self.aspp1(x), self.aspp2(x), self.aspp3(x), self.aspp4(x), pooled], 1))


class _Decoder(nn.Module):
    def __init__(self, low_channels: int, channels: int, num_outputs: int, projected: int = 48) -> None:
        super().__init__()
        self.low_block = _ConvBNReLU(low_channels, projected, 1)
        self.classifier = nn.Sequential(
            _ConvBNReLU(channels + projected, channels, 3, padding=1),
            nn.Dropout(0.5),
            _ConvBNReLU(channels, channels, 3, padding=1),
            nn.Dropout(0.1),
            nn.Conv2d(channels, num_outputs, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        low = self.low_block(low)
        return self.classifier(torch.cat([_resize(x, low.shape[-2:]), low], 1))


class _SegNet(nn.Module):
    """What both archs share: the backbone, the description, the input check and the resize."""

    arch = ""
    #: how the backbone is dilated (:data:`mars_plugin.networks.resnet.RULES`)
    resnet_rule = "torchvision"

    def __init__(self, backbone: str, num_classes: int, output_stride: int) -> None:
        super().__init__()
        _, backbone, num_classes, output_stride = _check_model_args(self.arch, backbone, num_classes, output_stride)
        self.backbone = ResNet(backbone, output_stride, rule=self.resnet_rule)
        self.num_classes = num_classes

    @property
    def config(self) -> Dict[str, Any]:
        """The arguments of :func:`build_model` that rebuild this network (a checkpoint's
        ``"model"`` entry, :data:`mars_plugin.networks.seg_checkpoint.MODEL_KEYS`)."""
        return {"arch": self.arch, "backbone": self.backbone.name,
                "output_stride": self.backbone.output_stride, "num_classes": self.num_classes}

    def _check_input(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor (B, 3, H, W) of normalized RGB images, got {describe(x)}")

    def _head(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes + 1, H, W) (background first) for images x (B, 3, H, W)."""
        self._check_input(x)
        return _resize(self._head(self.backbone(x)), x.shape[-2:])

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class DeepLabV3Plus(_SegNet):
    """DeepLabv3+ as RS+EPM builds it (see the module docstring for every number)."""

    arch = "deeplabv3+"

    def __init__(self, backbone: str, num_classes: int, output_stride: int = 16) -> None:
        super().__init__(backbone, num_classes, output_stride)
        rates = {16: (6, 12, 18), 8: (12, 24, 36)}[output_stride]
        c = self.backbone.channels
        self.aspp = _ASPPv3(c[3], 256, rates)
        self.decoder = _Decoder(c[0], 256, num_classes + 1)

    def _head(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        pool_bn = self.aspp.global_avg_pool[1].bn
        if self.training and feats[3].shape[0] < 2 and type(pool_bn) is nn.BatchNorm2d:
            # BatchNorm on the pooled 1x1 map sees one value per channel per image
            raise ValueError("deeplabv3+ trains on at least 2 images per batch (its image-pooling BatchNorm "
                             f"needs 2 values per channel), got a batch of {feats[3].shape[0]}; "
                             "use a larger batch, SyncBatchNorm across processes, or eval mode")
        return self.decoder(self.aspp(feats[3]), feats[0])


def _check_model_args(arch: Any, backbone: Any, num_classes: Any, output_stride: Any) -> Tuple[str, str, int, int]:
    """The arguments of :func:`build_model`, checked (None output stride: the arch's own)."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {describe(arch)}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {arch!r}")
    backbones, strides = (BACKBONES, OUTPUT_STRIDES) if arch != "deeplabv2" else (MSRA_BACKBONES, (8,))
    if not isinstance(backbone, str):
        raise TypeError(f"backbone must be one of {', '.join(map(repr, backbones))}, got {describe(backbone)}")
    if backbone not in backbones:
        which = "" if arch != "deeplabv2" else " for deeplabv2 (deeplab-pytorch's MSRA ResNet)"
        raise ValueError(f"backbone must be one of {', '.join(map(repr, backbones))}{which}, got {backbone!r}")
    num_classes = check_num_classes(num_classes)
    if output_stride is None:
        output_stride = DEFAULT_OUTPUT_STRIDE[arch]
    said = " or ".join(map(str, strides)) + ("" if arch != "deeplabv2" else " for deeplabv2 (deeplab-pytorch's, fixed)")
    if isinstance(output_stride, bool) or not isinstance(output_stride, (int, np.integer)):
        raise TypeError(f"output_stride must be {said}, got {describe(output_stride)}")
    if int(output_stride) not in strides:
        raise ValueError(f"output_stride must be {said}, got {output_stride}")
    return arch, backbone, num_classes, int(output_stride)


def build_model(arch: str, backbone: str, num_classes: int, output_stride: Optional[int] = None) -> nn.Module:
    """The segmentation network of ``mars train``, randomly initialised.

    Args:
        arch: ``"deeplabv3+"`` (RS+EPM's network), ``"deeplabv3+dhr"`` (DHR's DeepLabv3+, the RS+EPM
            row's trainer: :mod:`mars_plugin.networks.deeplab_dhr`; its logits are at stride 4),
            ``"deeplabv2"`` (the IRNet/AdvCAM rows) or ``"deeplabv1-wr38"`` (the SEAM row, backbone
            ``"wr38"``, output stride 8: :mod:`mars_plugin.networks.deeplabv1`).
        backbone: deeplabv3+ and deeplabv3+dhr: ``"resnet18"``, ``"resnet50"`` or ``"resnet101"``
            (torchvision layout); deeplabv2: ``"resnet50"`` or ``"resnet101"`` (deeplab-pytorch's
            MSRA ResNet). Load pretrained weights with :func:`load_backbone_weights`.
        num_classes: C, the number of foreground classes (1..253); the network outputs C + 1
            channels, background first.
        output_stride: deeplabv3+ and deeplabv3+dhr: 8 or 16; deeplabv2: 8 only; None takes the
            arch's upstream value (16 for deeplabv3+, 8 for deeplabv2 and deeplabv3+dhr).

    Returns:
        A module whose ``forward(x)``, x (B, 3, H, W) float, gives logits (B, C + 1, h, w);
        ``model.config`` is the dict of these arguments. deeplabv3+: x normalized with
        :func:`normalize`, logits at the input size (h, w) = (H, W); deeplabv3+dhr: the same input,
        logits at stride 4. deeplabv2: x BGR minus the
        caffe mean (:func:`mars_plugin.networks.deeplab_pytorch.normalize`), logits at stride 8
        as upstream returns them (the caller resizes); wrap it in
        :class:`mars_plugin.networks.deeplabv2.MSC` for deeplab-pytorch's multi-scale outputs.
    """
    if arch == "deeplabv1-wr38":  # the SEAM row: its own module (WR38 backbone, output stride 8)
        from mars_plugin.networks.deeplabv1 import build_deeplabv1_wr38

        return build_deeplabv1_wr38(backbone, num_classes, output_stride)
    arch, backbone, num_classes, output_stride = _check_model_args(arch, backbone, num_classes, output_stride)
    if arch == "deeplabv3+dhr":
        from mars_plugin.networks.deeplab_dhr import DeepLabV3PlusDHR  # it builds on _SegNet, defined here

        return DeepLabV3PlusDHR(backbone, num_classes, output_stride)
    cls = DeepLabV3Plus if arch == "deeplabv3+" else DeepLabV2
    return cls(backbone, num_classes, output_stride)


def _unwrap(model: Any) -> nn.Module:
    # DistributedDataParallel / DataParallel / EMATeacher keep the network in .module
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _backbone_of(model: Any, name: str = "model") -> ResNet:
    net = _unwrap(model)
    if isinstance(net, ResNet):
        return net
    if isinstance(net, _SegNet):
        return net.backbone
    raise TypeError(f"{name} must be a network of mars_plugin.networks.deeplab.build_model (or its ResNet), "
                    f"got {describe(net)}")


def _is_deeplabv2(model: Any) -> bool:
    net = _unwrap(model)
    return isinstance(net.base if isinstance(net, MSC) else net, DeepLabV2)


def _layout(name: str) -> Dict[str, Tuple[int, ...]]:
    # key -> shape of a backbone, built on the meta device (no memory, no init cost)
    with torch.device("meta"):
        net = ResNet(name)
    return {k: tuple(v.shape) for k, v in net.state_dict().items()}


def load_backbone_weights(model: nn.Module, path: PathLike) -> None:
    """Load torchvision ImageNet weights (e.g. ``resnet101-63fe2227.pth``) into the backbone
    (a ``deeplabv1-wr38`` network: :func:`mars_plugin.networks.wide_resnet38.load_wr38_weights`).

    A deeplabv2 network takes deeplab-pytorch's files instead (its caffe-converted
    ``deeplabv1_resnet101-coco.pth``, its released checkpoints): this hands it to
    :func:`mars_plugin.networks.deeplabv2.load_deeplab_pytorch_weights`.

    The file is read with ``torch.load(weights_only=True)``; its ``fc.*`` entries are ignored
    and every other key must match the backbone's name and shape (BatchNorm's
    ``num_batches_tracked``, absent from torchvision's older files, may be missing). Keys with a
    ``module.``/``backbone.``/``model.`` prefix are refused with a hint: torchvision's files and
    the upstream recipes (RS+EPM and deeplab-pytorch download those URLs) have none, and a
    prefixed file is a training checkpoint of some other network. Nothing is loaded unless all
    of it fits.

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file and what does not fit (missing, unexpected and
            shape-mismatched keys; the backbone the file would fit, if any).
    """
    if getattr(_unwrap(model), "arch", None) == "deeplabv1-wr38":  # the SEAM row: WR38's MXNet file
        from mars_plugin.networks.wide_resnet38 import load_wr38_weights

        return load_wr38_weights(model, path)
    if _is_deeplabv2(model):
        load_deeplab_pytorch_weights(model, path)
        return
    backbone = _backbone_of(model)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (ImageNet weights in torchvision layout, e.g. "
                                f"{backbone.name}-*.pth from download.pytorch.org/models)")
    try:
        state = torch_load(path, what="ImageNet weights")
    except ReadRefused:
        raise
    except Exception as e:  # corrupt, truncated, not a torch file, or pickled Python objects
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path}: not a readable torch file of ImageNet weights ({type(e).__name__}: "
                         f"{first[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        hint = ""
        if isinstance(state, dict) and "format" in state and "student" in state:
            hint = "; it is a mars train checkpoint (give it to mars predict --model or mars train --resume)"
        elif isinstance(state, dict) and any(k in state for k in ("state_dict", "model")):
            hint = "; it is a training checkpoint holding a state dict, not a torchvision weight file"
        got = "a dict with other entries" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: not a state dict of tensors (a torchvision ImageNet file), got {got}{hint}")
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    expected = backbone.state_dict()
    parts = state_mismatch(state, expected)
    if parts:
        hint = ""
        prefixes = [p for p in ("module.", "backbone.", "model.") if state and all(k.startswith(p) for k in state)]
        if prefixes:
            hint = (f"; its keys start with {prefixes[0]!r}: a training checkpoint of another network, "
                    "not torchvision's ImageNet file (keys conv1.weight, bn1.*, layer1.0...)")
        else:
            file_layout = {k: tuple(v.shape) for k, v in state.items() if not k.endswith("num_batches_tracked")}
            for other in BACKBONES:
                lay = {k: s for k, s in _layout(other).items() if not k.endswith("num_batches_tracked")}
                if other != backbone.name and lay == file_layout:
                    hint = f"; the file fits {other} (choose that backbone, or the {backbone.name} file)"
        raise ValueError(f"{path}: does not fit the {backbone.name} backbone (torchvision layout): "
                         f"{'; '.join(parts)}{hint}")
    check_weight_values(state, path)
    full = dict(state)
    for k in expected:
        if k not in full:  # num_batches_tracked of older files: start counting from 0
            full[k] = torch.zeros_like(expected[k])
    backbone.load_state_dict(full, strict=True)


_GROUPS = (  # name, lr multiplier, decay?  (RS+EPM's grouping, PuzzleCAM's multipliers)
    ("backbone_weight", 1.0, True),
    ("backbone_bias", 2.0, False),
    ("head_weight", 10.0, True),
    ("head_bias", 20.0, False),
)


def param_groups(model: nn.Module, lr: float, weight_decay: float) -> List[Dict[str, Any]]:
    """SGD parameter groups: the pretrained backbone at ``lr``, the new layers at 10x.

    Four groups, in this order (RS+EPM's ``get_parameter_groups`` split, PuzzleCAM's
    train_segmentation.py multipliers):

    ==================  =========  ============  ====================================
    name                lr         weight decay  parameters
    ==================  =========  ============  ====================================
    ``backbone_weight`` lr         weight_decay  backbone conv and BN weights
    ``backbone_bias``   2 lr       0             backbone BN biases
    ``head_weight``     10 lr      weight_decay  ASPP/decoder/classifier conv and BN weights
    ``head_bias``       20 lr      0             their BN and conv biases
    ==================  =========  ============  ====================================

    BN weights count as weights and are decayed, as upstream. Each group carries ``name`` and
    ``lr_mult`` (lr = base lr x lr_mult) so a poly schedule can rescale it; frozen parameters
    (``requires_grad=False``) are left out. ``model`` may be wrapped in DDP. For deeplabv2,
    deeplab-pytorch's own three groups are
    :func:`mars_plugin.networks.deeplab_pytorch.param_groups`.
    """
    lr = check_real_param(lr, "lr", 0.0, float("inf"), low_open=True)
    weight_decay = check_real_param(weight_decay, "weight_decay", 0.0, float("inf"))
    net = _unwrap(model)
    if getattr(net, "arch", None) == "deeplabv1-wr38":  # SEAM's codebase groups its convs only
        from mars_plugin.networks.deeplabv1 import seam_param_groups

        return seam_param_groups(model, lr, weight_decay)
    if isinstance(net, MSC):
        net = net.base
    if not isinstance(net, (_SegNet, DeepLabV2)):
        raise TypeError(f"model must be a network of mars_plugin.networks.deeplab.build_model, got {describe(net)}")
    buckets: Dict[str, List[nn.Parameter]] = {g[0]: [] for g in _GROUPS}
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        # deeplabv2 (upstream's names): layer1..layer5 are the backbone, aspp the head
        part = "backbone" if name.startswith(("backbone.", "layer")) else "head"
        kind = "weight" if name.rsplit(".", 1)[-1] == "weight" else "bias"
        buckets[f"{part}_{kind}"].append(p)
    return [{"params": buckets[n], "name": n, "lr_mult": m, "lr": lr * m,
             "weight_decay": weight_decay if decay else 0.0}
            for n, m, decay in _GROUPS if buckets[n]]


def normalize(images: Any) -> torch.Tensor:
    """uint8 RGB images (B, H, W, 3) -> float32 (B, 3, H, W), ``(x / 255 - mean) / std``.

    Accepts a tensor (kept on its device) or a numpy array; the arithmetic is RS+EPM's
    ``Normalize`` in float32 with :data:`IMAGENET_MEAN` and :data:`IMAGENET_STD`.
    """
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8:
            raise TypeError(f"images must be uint8 RGB (B, H, W, 3), got {describe(images)}")
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a uint8 tensor or array (B, H, W, 3), got {describe(images)}")
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8 RGB (B, H, W, 3), got {describe(images)}")
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be (B, H, W, 3) RGB, got {describe(images)}")
    x = images.permute(0, 3, 1, 2).to(torch.float32)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return ((x / 255.0 - mean) / std).contiguous()
