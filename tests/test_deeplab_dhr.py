"""arch "deeplabv3+dhr": DHR's DeepLabv3+ (shjo-april/DHR@94d5189) as it is.

The expectations are written from DHR's definitions (core/backbones/resnet/__init__.py
``build_resnet``: strides (2, 2, 1, last_stride=1) and dilations (1, 1, 2, 4) at OS 8, (2, 2, 2, 1)
and (1, 1, 1, 1) at OS 16, the first block of each layer at dilation 1; core/layers.py: ASPP
rates 12/24/36 (OS 8) and 6/12/18 (OS 16), 48-channel low block on C2, a 1x1 classifier
without bias; core/networks.py: logits at C2's grid), never from its code: a functional float64
forward by those numbers is compared with the module's.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mars_plugin.networks.deeplab import ARCHS, build_model, load_backbone_weights, param_groups
from mars_plugin.networks.deeplab_dhr import load_upstream_state_dict, to_upstream_state_dict
from mars_plugin.networks.memory import inference_memory_bytes, train_memory_bytes
from mars_plugin.networks.resnet import ResNet

# DHR's build_resnet, read as (stride, dilation of the blocks after the first) per layer1..4
DHR_LAYERS = {8: [(1, 1), (2, 1), (1, 2), (1, 4)], 16: [(1, 1), (2, 1), (2, 1), (1, 1)]}
ASPP_RATES = {8: (12, 24, 36), 16: (6, 12, 18)}
BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3)}


def _bn(x, sd, p):
    return F.batch_norm(x, sd[p + "running_mean"], sd[p + "running_var"], sd[p + "weight"], sd[p + "bias"],
                        False, 0.0, 1e-5)


def _cbr(x, sd, p, pad=0, dil=1):
    # DHR's ConvBlock in eval mode: conv (no bias), BN, ReLU (dropout off)
    return F.relu(_bn(F.conv2d(x, sd[p + "conv.weight"], None, 1, pad, dil), sd, p + "bn."))


def _reference(sd, x, backbone, os_):
    """The network by DHR's numbers, on DHR's state-dict names (model.*, seg_decoder.*)."""
    x = F.relu(_bn(F.conv2d(x, sd["model.conv1.weight"], None, 2, 3), sd, "model.bn1."))
    x = F.max_pool2d(x, 3, 2, 1)
    feats = []
    for li, (stride, dil) in enumerate(DHR_LAYERS[os_], 1):
        for b in range(BLOCKS[backbone][li - 1]):
            p = f"model.layer{li}.{b}."
            s, d = (stride, 1) if b == 0 else (1, dil)  # the first block: the stride, dilation 1
            if backbone == "resnet18":  # BasicBlock: stride on conv1, dilation never used
                out = F.relu(_bn(F.conv2d(x, sd[p + "conv1.weight"], None, s, 1), sd, p + "bn1."))
                out = _bn(F.conv2d(out, sd[p + "conv2.weight"], None, 1, 1), sd, p + "bn2.")
            else:  # Bottleneck: stride and dilation on the 3x3 conv2
                out = F.relu(_bn(F.conv2d(x, sd[p + "conv1.weight"]), sd, p + "bn1."))
                out = F.relu(_bn(F.conv2d(out, sd[p + "conv2.weight"], None, s, d, d), sd, p + "bn2."))
                out = _bn(F.conv2d(out, sd[p + "conv3.weight"]), sd, p + "bn3.")
            if p + "downsample.0.weight" in sd:
                x = _bn(F.conv2d(x, sd[p + "downsample.0.weight"], None, s), sd, p + "downsample.1.")
            x = F.relu(out + x)
        feats.append(x)
    c2, c5 = feats[0], feats[3]
    a = "seg_decoder.aspp."
    r = ASPP_RATES[os_]
    branches = [_cbr(c5, sd, a + "aspp1.")] + [_cbr(c5, sd, a + f"aspp{i + 2}.", r[i], r[i]) for i in range(3)]
    g = _cbr(c5.mean((2, 3), keepdim=True), sd, a + "gap.1.")
    branches.append(g.expand(-1, -1, *c5.shape[2:]))  # bilinear from 1x1: a constant map
    y = _cbr(torch.cat(branches, 1), sd, a + "block.")
    low = _cbr(c2, sd, "seg_decoder.low_block.")
    y = F.interpolate(y, size=low.shape[2:], mode="bilinear", align_corners=False)
    y = _cbr(torch.cat([y, low], 1), sd, "seg_decoder.mid_block.0.", 1)
    y = _cbr(y, sd, "seg_decoder.mid_block.1.", 1)
    return F.conv2d(y, sd["seg_decoder.classifier.weight"])  # 1x1, no bias: at C2's grid


def _randomised(backbone, os_, classes=3, seed=0):
    torch.manual_seed(seed)
    m = build_model("deeplabv3+dhr", backbone, classes, os_).double().eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):  # BN that is not the identity
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
                mod.running_mean.uniform_(-0.3, 0.3)
                mod.running_var.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("backbone,os_", [("resnet50", 8), ("resnet50", 16), ("resnet18", 8)])
def test_forward_equals_dhr_definition_float64(backbone, os_):
    m = _randomised(backbone, os_)
    x = torch.randn(2, 3, 33, 41, dtype=torch.float64)
    with torch.no_grad():
        got = m(x)
        want = _reference(to_upstream_state_dict(m), x, backbone, os_)
    # stride 4, ceil of each halving, not upsampled to the input
    assert got.shape == (2, 4, 9, 11)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_keys_map_one_to_one_both_ways():
    m = _randomised("resnet18", 8)
    up = to_upstream_state_dict(m)
    ours = m.state_dict()
    assert len(up) == len(ours)
    assert all(k.startswith(("model.", "seg_decoder.")) for k in up)
    for k in ("model.conv1.weight", "model.layer2.0.downsample.0.weight", "seg_decoder.aspp.gap.1.conv.weight",
              "seg_decoder.aspp.block.bn.running_var", "seg_decoder.low_block.conv.weight",
              "seg_decoder.mid_block.1.bn.weight", "seg_decoder.classifier.weight"):
        assert k in up, k
    assert tuple(up["seg_decoder.classifier.weight"].shape) == (4, 256, 1, 1)
    assert "seg_decoder.classifier.bias" not in up
    # back: a second network takes DHR's dict (plus DHR's CAM classifier, under DDP's prefix)
    other = build_model("deeplabv3+dhr", "resnet18", 3, 8).double()
    extra = {"module." + k: v for k, v in up.items()}
    extra["module.classifier.weight"] = torch.zeros(20, 512, 1, 1, dtype=torch.float64)
    load_upstream_state_dict(other, extra)
    for k, v in other.state_dict().items():
        assert torch.equal(v, ours[k]), k
    bad = dict(up)
    bad.pop("seg_decoder.classifier.weight")
    with pytest.raises(ValueError, match="seg_decoder.classifier.weight"):
        load_upstream_state_dict(other, bad)


def _conv(layer, block, name):
    return getattr(getattr(layer, str(block)), name)


@pytest.mark.parametrize("os_", [8, 16])
def test_backbone_strides_and_dilations_are_dhr(os_):
    with torch.device("meta"):
        net = ResNet("resnet101", os_, rule="dhr")
    for li, (stride, dil) in enumerate(DHR_LAYERS[os_], 1):
        layer = getattr(net, f"layer{li}")
        first = _conv(layer, 0, "conv2")
        assert (first.stride[0], first.dilation[0], first.padding[0]) == (stride, 1, 1)
        for b in range(1, len(layer)):
            c = _conv(layer, b, "conv2")
            assert (c.stride[0], c.dilation[0], c.padding[0]) == (1, dil, dil)
        assert layer[0].downsample[0].stride[0] == stride
    assert len(net.layer3) == 23


def test_torchvision_imagenet_file_loads(tmp_path):
    m = build_model("deeplabv3+dhr", "resnet18", 3)
    with torch.device("meta"):
        layout = ResNet("resnet18").state_dict()
    state = {k: torch.randn(v.shape) if v.is_floating_point() else torch.zeros((), dtype=torch.long)
             for k, v in layout.items()}
    state.update({"fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)})
    torch.save(state, tmp_path / "resnet18-5c106cde.pth")
    load_backbone_weights(m, tmp_path / "resnet18-5c106cde.pth")
    assert torch.equal(m.backbone.layer4[1].conv2.weight, state["layer4.1.conv2.weight"])


def test_init_is_pytorch_default_not_torchvision():
    # DHR's ResNet has no init loop: conv weights are U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    torch.manual_seed(0)
    w = build_model("deeplabv3+dhr", "resnet18", 3).backbone.conv1.weight
    assert float(w.abs().max()) <= 1 / math.sqrt(3 * 7 * 7) + 1e-7


def test_arch_defaults_memory_and_groups():
    assert "deeplabv3+dhr" in ARCHS
    m = build_model("deeplabv3+dhr", "resnet18", 3)
    assert m.config == {"arch": "deeplabv3+dhr", "backbone": "resnet18", "output_stride": 8, "num_classes": 3}
    groups = {g["name"]: g for g in param_groups(m, 0.01, 1e-4)}
    assert sum(len(g["params"]) for g in groups.values()) == len(list(m.parameters()))
    assert any(p is m.seg_decoder.classifier.weight for p in groups["head_weight"]["params"])
    assert inference_memory_bytes(m.config, 64, 48, scales=(1.0, 0.5)) > 0
    assert train_memory_bytes(m.config, 64, 2) > 0
    m.train()
    with pytest.raises(ValueError, match="at least 2 images"):
        m(torch.randn(1, 3, 32, 32))
