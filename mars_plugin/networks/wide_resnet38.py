"""The wide ResNet-38 ("WR38") of the SEAM row, as SEAM's segmentation codebase builds it, and
its ImageNet weights.

Read from YudeWang/semantic-segmentation-codebase at a40f6c6, lib/net/backbone/resnet38d.py
(``Net``, ``ResBlock``, ``ResBlock_bot``, ``convert_mxnet_to_torch``, ``resnet38``); the module
and parameter names are upstream's, so a state dict moves between the two unchanged (the key map
is the identity).

* ``conv1a``: 3x3 conv 3 -> 64, stride 1, padding 1, no bias, with no BN or ReLU of its own
  (the next block's ``bn_branch2a`` is its BN).
* ``ResBlock`` (pre-activation; ``b2`` .. ``b5_2``): ``bn_branch2a`` -> ReLU, which feeds both
  branches; branch 2: ``conv_branch2a`` 3x3 with the block's stride, padding = dilation =
  ``first_dilation`` -> ``bn_branch2b1`` -> ReLU -> ``conv_branch2b1`` 3x3, stride 1, padding =
  dilation = ``dilation``; branch 1: the block's input itself when in == out channels and the
  stride is 1, else ``conv_branch1`` 1x1 with the stride **on the BN-ReLU'd input**. No conv
  has a bias.
* ``ResBlock_bot`` (``b6``, ``b7``): ``bn_branch2a`` -> ReLU; branch 2: ``conv_branch2a`` 1x1
  (out/4) -> ``bn_branch2b1`` -> ReLU -> ``dropout_2b1`` -> ``conv_branch2b1`` 3x3 (out/2),
  padding = dilation -> ``bn_branch2b2`` -> ReLU -> ``dropout_2b2`` -> ``conv_branch2b2`` 1x1
  (out); branch 1 always ``conv_branch1`` 1x1. ``Dropout2d`` with p 0.3 (``b6``) and 0.5 (``b7``).
* Stages: ``b2`` 64 -> 128 (mid 128) stride 2, ``b2_1``, ``b2_2``; ``b3`` -> 256 stride 2, two
  more; ``b4`` -> 512 stride 2, five more; ``b5`` 512 -> 1024 (mid 512) stride 1, first
  dilation 1 then dilation 2, ``b5_1``, ``b5_2`` dilation 2; ``b6`` 1024 -> 2048 dilation 4;
  ``b7`` 2048 -> 4096 dilation 4; ``bn7`` -> ReLU. Output stride 8.
* Every BN: ``nn.BatchNorm2d(c, momentum=0.0003, affine=True)`` (``bn_mom``, resnet38d.py:8),
  eps 1e-5 (PyTorch's default); every conv PyTorch's default init (``pretrained=False``).
* ``forward`` returns ``(conv4, conv5, conv6)``: ``b5``'s BN-ReLU'd input, ``b6``'s BN-ReLU'd
  input and ``ReLU(bn7(b7(...)))`` (4096 channels); DeepLabv1 uses the last.
* ``train(mode)``: upstream overrides it (resnet38d.py:192-214): after ``nn.Module.train``
  every BN goes back to eval mode with its weight and bias frozen, and ``conv1a``'s weight is
  frozen. The override is kept here as it is. Note that upstream's ``train.py`` never calls
  ``train()`` (a module is built in training mode), so what it trains is *not* this state:
  see :func:`mars_plugin.networks.deeplabv1.seam_train_mode`.

Extension (not upstream): ``width_div`` divides every channel count (1 is upstream's network);
the tests run the same code at a sixteenth of the width.

Weights (:func:`load_wr38_weights`): upstream's ``resnet38(pretrained=True)`` converts the
MXNet file ``ilsvrc-cls_rna-a1_cls1000_ep-0001.params`` (resnet38d.py:7) with
``convert_mxnet_to_torch`` and loads it with ``strict=False`` (:269-271); SEAM's README
distributes that file, and SEAM's own trainer also takes the converted dict saved as ``.pth``.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import describe
from mars_plugin.formats.bounded_load import ReadRefused, torch_load
from mars_plugin.formats.mxnet_params import LIST_MAGIC, read_mxnet_params
from mars_plugin.networks.weight_files import state_mismatch

__all__ = ["WideResNet38", "BN_MOMENTUM", "WR38_WEIGHTS_FILE", "wr38_key", "load_wr38_weights"]

#: ``bn_mom`` of resnet38d.py:8, every backbone BN's momentum.
BN_MOMENTUM = 0.0003
#: The ImageNet file upstream starts from (resnet38d.py:7).
WR38_WEIGHTS_FILE = "ilsvrc-cls_rna-a1_cls1000_ep-0001.params"


class ResBlock(nn.Module):
    """Upstream's ``ResBlock`` (see the module docstring)."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1, first_dilation: Optional[int] = None,
                 dilation: int = 1) -> None:
        super().__init__()
        self.same_shape = cin == cout and stride == 1
        first = dilation if first_dilation is None else first_dilation
        # registration order is upstream's: state-dict order and the random init draws follow it
        self.bn_branch2a = nn.BatchNorm2d(cin, momentum=BN_MOMENTUM, affine=True)
        self.conv_branch2a = nn.Conv2d(cin, mid, 3, stride, padding=first, dilation=first, bias=False)
        self.bn_branch2b1 = nn.BatchNorm2d(mid, momentum=BN_MOMENTUM, affine=True)
        self.conv_branch2b1 = nn.Conv2d(mid, cout, 3, padding=dilation, dilation=dilation, bias=False)
        if not self.same_shape:
            self.conv_branch1 = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor, get_x_bn_relu: bool = False):
        act = F.relu(self.bn_branch2a(x))
        branch1 = x if self.same_shape else self.conv_branch1(act)
        branch2 = self.conv_branch2b1(F.relu(self.bn_branch2b1(self.conv_branch2a(act))))
        out = branch1 + branch2
        return (out, act) if get_x_bn_relu else out


class ResBlockBot(nn.Module):
    """Upstream's ``ResBlock_bot``: the bottleneck blocks b6, b7 (see the module docstring)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, dilation: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.same_shape = cin == cout and stride == 1
        self.bn_branch2a = nn.BatchNorm2d(cin, momentum=BN_MOMENTUM, affine=True)
        self.conv_branch2a = nn.Conv2d(cin, cout // 4, 1, stride, bias=False)
        self.bn_branch2b1 = nn.BatchNorm2d(cout // 4, momentum=BN_MOMENTUM, affine=True)
        self.dropout_2b1 = nn.Dropout2d(dropout)
        self.conv_branch2b1 = nn.Conv2d(cout // 4, cout // 2, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn_branch2b2 = nn.BatchNorm2d(cout // 2, momentum=BN_MOMENTUM, affine=True)
        self.dropout_2b2 = nn.Dropout2d(dropout)
        self.conv_branch2b2 = nn.Conv2d(cout // 2, cout, 1, bias=False)
        if not self.same_shape:
            self.conv_branch1 = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor, get_x_bn_relu: bool = False):
        act = F.relu(self.bn_branch2a(x))
        branch1 = self.conv_branch1(act)  # upstream takes branch 1 unconditionally (b6, b7 change shape)
        y = self.dropout_2b1(F.relu(self.bn_branch2b1(self.conv_branch2a(act))))
        y = self.dropout_2b2(F.relu(self.bn_branch2b2(self.conv_branch2b1(y))))
        out = branch1 + self.conv_branch2b2(y)
        return (out, act) if get_x_bn_relu else out


class WideResNet38(nn.Module):
    """Upstream's ``Net`` (resnet38d.py:125-214): x (B, 3, H, W) normalised RGB ->
    ``(conv4, conv5, conv6)``, (B, 512, H/8, W/8), (B, 1024, ...), (B, 4096, ...) at full width.

    Args:
        width_div: divides every channel count (an extension for tests; 1 is upstream's).
    """

    name = "wr38"
    output_stride = 8

    def __init__(self, width_div: int = 1) -> None:
        super().__init__()
        if isinstance(width_div, bool) or not isinstance(width_div, int) or width_div not in (1, 2, 4, 8, 16):
            raise ValueError(f"width_div must be 1, 2, 4, 8 or 16, got {width_div!r}")
        self.width_div = width_div

        def c(n: int) -> int:
            return n // width_div

        self.conv1a = nn.Conv2d(3, c(64), 3, padding=1, bias=False)
        self.b2 = ResBlock(c(64), c(128), c(128), stride=2)
        self.b2_1 = ResBlock(c(128), c(128), c(128))
        self.b2_2 = ResBlock(c(128), c(128), c(128))
        self.b3 = ResBlock(c(128), c(256), c(256), stride=2)
        self.b3_1 = ResBlock(c(256), c(256), c(256))
        self.b3_2 = ResBlock(c(256), c(256), c(256))
        self.b4 = ResBlock(c(256), c(512), c(512), stride=2)
        for i in range(1, 6):
            self.add_module(f"b4_{i}", ResBlock(c(512), c(512), c(512)))
        self.b5 = ResBlock(c(512), c(512), c(1024), stride=1, first_dilation=1, dilation=2)
        self.b5_1 = ResBlock(c(1024), c(512), c(1024), dilation=2)
        self.b5_2 = ResBlock(c(1024), c(512), c(1024), dilation=2)
        self.b6 = ResBlockBot(c(1024), c(2048), stride=1, dilation=4, dropout=0.3)
        self.b7 = ResBlockBot(c(2048), c(4096), dilation=4, dropout=0.5)
        self.bn7 = nn.BatchNorm2d(c(4096), momentum=BN_MOMENTUM, affine=True)
        self.channels = c(4096)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.conv1a(x)
        for name in ("b2", "b2_1", "b2_2", "b3", "b3_1", "b3_2", "b4", "b4_1", "b4_2", "b4_3", "b4_4", "b4_5"):
            x = getattr(self, name)(x)
        x, conv4 = self.b5(x, get_x_bn_relu=True)
        x = self.b5_2(self.b5_1(x))
        x, conv5 = self.b6(x, get_x_bn_relu=True)
        conv6 = F.relu(self.bn7(self.b7(x)))
        return conv4, conv5, conv6

    def train(self, mode: bool = True) -> "WideResNet38":
        """Upstream's override (resnet38d.py:192-214): BN always in eval mode with frozen affine
        parameters, ``conv1a`` frozen. (Upstream returns None; here the module, as torch's.)"""
        super().train(mode)
        self.conv1a.weight.requires_grad = False
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
                m.weight.requires_grad = False
                m.bias.requires_grad = False
        return self


def wr38_key(mxnet_name: str) -> Optional[str]:
    """The backbone's state-dict key of one name of the MXNet file (None: the ImageNet classifier,
    dropped), by the rules of upstream's ``convert_mxnet_to_torch`` (resnet38d.py:216-264):

    split at ``_``; a first token holding ``conv1a`` is ``conv1a.weight``; one holding
    ``linear1000`` is dropped; when the second token holds ``branch`` the block is ``b<S>`` for
    a first token ending in ``<S>a`` and ``b<S>_<k>`` for one ending in ``<S>b<k>``, the layer
    ``conv_<second token>.weight`` if the first token holds ``res`` else ``bn_<second
    token>.<p>``; anything else is ``bn7.<p>``; ``<p>`` maps the last token beta, gamma, mean,
    var to bias, weight, running_mean, running_var. E.g. ``res4b3_branch2b1_weight`` ->
    ``b4_3.conv_branch2b1.weight``, ``aux:bn7_moving_var`` -> ``bn7.running_var``.

    Raises:
        ValueError: a name these rules do not cover, naming it.
    """
    bn = {"beta": "bias", "gamma": "weight", "mean": "running_mean", "var": "running_var"}
    toks = mxnet_name.split("_")
    first = toks[0]
    if "conv1a" in first:
        return "conv1a.weight"
    if "linear1000" in first:
        return None
    if len(toks) < 2 or len(first) < 3:
        raise ValueError(f"the MXNet name {mxnet_name!r} is not one of the WR38 file's")
    if "branch" in toks[1]:
        block = f"b{first[-2]}" if first[-1] == "a" else f"b{first[-3]}_{first[-1]}"
        if "res" in first:
            return f"{block}.conv_{toks[1]}.weight"
        layer = f"{block}.bn_{toks[1]}"
    else:
        layer = "bn7"
    if toks[-1] not in bn:
        raise ValueError(f"the MXNet name {mxnet_name!r} ends in {toks[-1]!r}; expected one of {', '.join(bn)}")
    return f"{layer}.{bn[toks[-1]]}"


def _read_state(path: str) -> Dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and int.from_bytes(head, "little") == LIST_MAGIC:
        state: Dict[str, torch.Tensor] = {}
        for name, arr in read_mxnet_params(path).items():
            key = wr38_key(name)
            if key is not None:
                if key in state:
                    raise ValueError(f"{path}: two MXNet arrays map to {key}")
                state[key] = torch.from_numpy(np.ascontiguousarray(arr))
        return state
    try:
        state = torch_load(path, what="WR38 weights")
    except ReadRefused:
        raise
    except Exception as e:  # not a torch file, truncated, or pickled Python objects
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path}: neither an MXNet .params file nor a readable torch file of WR38 weights "
                         f"({type(e).__name__}: {first[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{path}: not a state dict of tensors (WR38 weights), got {describe(state)}")
    return state


def load_wr38_weights(model: nn.Module, path: Union[str, os.PathLike]) -> None:
    """Load the WR38 ImageNet weights into ``model`` (a :class:`WideResNet38` or a network that
    holds one as ``.backbone``, possibly wrapped in DDP/DataParallel).

    ``path``: upstream's MXNet file (:data:`WR38_WEIGHTS_FILE`, read by
    :func:`mars_plugin.formats.mxnet_params.read_mxnet_params`, names mapped by :func:`wr38_key`,
    ``linear1000`` dropped), or that dict saved as a torch file (read with ``weights_only=True``).
    Upstream loads with ``strict=False``; here every backbone key (BN's
    ``num_batches_tracked`` aside) must be in the file with its shape and no other key may be,
    so a wrong file is refused in one line instead of leaving the network at random. Nothing is
    loaded unless all of it fits.

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file and what does not fit.
    """
    net = model
    while isinstance(getattr(net, "module", None), nn.Module):
        net = net.module
    backbone = getattr(net, "backbone", net)
    if not isinstance(backbone, WideResNet38):
        raise TypeError(f"model must be a WideResNet38 or a network built on one, got {describe(net)}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (the WR38 ImageNet weights, {WR38_WEIGHTS_FILE})")
    state = _read_state(path)
    expected = backbone.state_dict()
    parts = state_mismatch(state, expected)
    if parts:
        raise ValueError(f"{path}: does not fit the wr38 backbone (width 1/{backbone.width_div}): "
                         f"{'; '.join(parts)}")
    for k, v in state.items():
        if not k.endswith("num_batches_tracked") and (not v.is_floating_point() or not torch.isfinite(v).all()):
            raise ValueError(f"{path}: {k} holds {v.dtype} values that are not finite floats (a damaged weight file)")
    full = dict(state)
    for k in expected:
        full.setdefault(k, torch.zeros_like(expected[k]))  # num_batches_tracked: start counting from 0
    backbone.load_state_dict(full, strict=True)
