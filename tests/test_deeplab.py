"""Tests for mars_plugin.networks.deeplab and .resnet: the DeepLabv3+/DeepLabv2 networks of ``mars train``.

The expected layouts are written from torchvision's resnet.py (key counts, sample keys and
shapes, parameter counts of resnet18/50/101 with fc: 11689512 / 25557032 / 44549160) and from
RS+EPM's core/layers.py (the head's names); the big backbones are built on the meta device so
that the layout tests cost nothing, the forward tests run ResNet-18 on 65x65 images.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.networks import deeplab
from mars_plugin.networks.deeplab import (IMAGENET_MEAN, IMAGENET_STD, build_model, load_backbone_weights, normalize,
                                 param_groups)
from mars_plugin.networks.resnet import ResNet
from mars_plugin.networks.seg_checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from _weight_views import layout_files_are_views  # noqa: F401 (autouse: the weight files are views)

# torchvision's state dicts have 122 / 320 / 626 entries and these parameter counts, fc included
TORCHVISION = {
    "resnet18": {"keys": 122, "params": 11689512, "fc_in": 512, "blocks": (2, 2, 2, 2)},
    "resnet50": {"keys": 320, "params": 25557032, "fc_in": 2048, "blocks": (3, 4, 6, 3)},
    "resnet101": {"keys": 626, "params": 44549160, "fc_in": 2048, "blocks": (3, 4, 23, 3)},
}
# sample keys and shapes, read off torchvision's definition
SAMPLES = {
    "resnet18": {
        "conv1.weight": (64, 3, 7, 7), "bn1.running_var": (64,), "bn1.num_batches_tracked": (),
        "layer1.0.conv1.weight": (64, 64, 3, 3), "layer1.1.bn2.bias": (64,),
        "layer2.0.conv1.weight": (128, 64, 3, 3), "layer2.0.downsample.0.weight": (128, 64, 1, 1),
        "layer2.0.downsample.1.running_mean": (128,), "layer3.1.conv2.weight": (256, 256, 3, 3),
        "layer4.0.downsample.0.weight": (512, 256, 1, 1), "layer4.1.bn2.weight": (512,),
    },
    "resnet50": {
        "conv1.weight": (64, 3, 7, 7), "layer1.0.conv1.weight": (64, 64, 1, 1),
        "layer1.0.conv2.weight": (64, 64, 3, 3), "layer1.0.conv3.weight": (256, 64, 1, 1),
        "layer1.0.downsample.0.weight": (256, 64, 1, 1), "layer1.2.bn3.running_var": (256,),
        "layer2.0.conv1.weight": (128, 256, 1, 1), "layer2.0.downsample.0.weight": (512, 256, 1, 1),
        "layer3.5.conv2.weight": (256, 256, 3, 3), "layer4.0.downsample.1.weight": (2048,),
        "layer4.2.conv3.weight": (2048, 512, 1, 1),
    },
    "resnet101": {
        "layer3.0.downsample.0.weight": (1024, 512, 1, 1), "layer3.22.conv2.weight": (256, 256, 3, 3),
        "layer3.22.bn3.num_batches_tracked": (), "layer4.2.bn3.bias": (2048,),
    },
}
ABSENT = {
    "resnet18": ["fc.weight", "layer1.0.downsample.0.weight", "layer1.0.conv3.weight", "layer1.2.conv1.weight"],
    "resnet50": ["fc.bias", "layer3.6.conv1.weight", "layer2.1.downsample.0.weight"],
    "resnet101": ["fc.weight", "layer3.23.conv1.weight", "layer4.3.conv1.weight"],
}
# RS+EPM's DeepLabv3_Plus head (core/layers.py: ASPP_For_DeepLabv3 and Decoder), parameters only
RSEPM_V3P_HEAD = (
    [f"aspp.aspp{i}.{p}" for i in range(1, 5) for p in ("conv.weight", "bn.weight", "bn.bias")]
    + ["aspp.global_avg_pool.1.conv.weight", "aspp.global_avg_pool.1.bn.weight", "aspp.global_avg_pool.1.bn.bias",
       "aspp.block.0.conv.weight", "aspp.block.0.bn.weight", "aspp.block.0.bn.bias",
       "decoder.low_block.conv.weight", "decoder.low_block.bn.weight", "decoder.low_block.bn.bias"]
    + [f"decoder.classifier.{i}.{p}" for i in (0, 2) for p in ("conv.weight", "bn.weight", "bn.bias")]
    + ["decoder.classifier.4.weight"]
)


def meta_model(arch="deeplabv3+", backbone="resnet101", num_classes=20, output_stride=None):
    with torch.device("meta"):
        return build_model(arch, backbone, num_classes, output_stride)


def tiny(arch="deeplabv3+", output_stride=None, num_classes=3, seed=0):
    torch.manual_seed(seed)
    # deeplabv2 is deeplab-pytorch's MSRA ResNet-50/101 only
    return build_model(arch, "resnet18" if arch == "deeplabv3+" else "resnet50", num_classes, output_stride)


def torchvision_state(name, seed=0, with_fc=True, with_tracked=True):
    """A state dict in torchvision's layout (our ResNet plus fc), random values."""
    torch.manual_seed(seed)
    net = ResNet(name)
    for m in net.modules():  # non-trivial BN statistics so that loading them is seen
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.bias.data.uniform_(-1, 1)
            m.num_batches_tracked.fill_(7)
    state = dict(net.state_dict())
    if not with_tracked:
        state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    if with_fc:
        fc_in = TORCHVISION[name]["fc_in"]
        state["fc.weight"] = torch.randn(1000, fc_in)
        state["fc.bias"] = torch.randn(1000)
    return state


def layout_file(tmp_path, name, fname=None, prefix=""):
    """A torchvision-layout file of ``name`` whose tensors are one stored zero expanded to each
    shape (torch.save keeps the view), so even ResNet-101's layout costs a few kilobytes."""
    with torch.device("meta"):
        net = ResNet(name)
    z = torch.zeros(())
    state = {prefix + k: z.expand(v.shape) for k, v in net.state_dict().items()}
    path = tmp_path / (fname or f"{name}-layout.pth")
    torch.save(state, path)
    return path


# --- backbone layout -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101"])
def test_backbone_keys_and_shapes_are_torchvisions(name):
    with torch.device("meta"):
        net = ResNet(name)
    state = net.state_dict()
    tv = TORCHVISION[name]
    assert len(state) == tv["keys"] - 2  # torchvision's minus fc.weight and fc.bias
    n_params = sum(p.numel() for p in net.parameters())
    assert n_params + tv["fc_in"] * 1000 + 1000 == tv["params"]
    for key, shape in SAMPLES[name].items():
        assert key in state, key
        assert tuple(state[key].shape) == shape, (key, tuple(state[key].shape), shape)
    for key in ABSENT[name]:
        assert key not in state, key
    for i, n in enumerate(tv["blocks"], 1):
        assert f"layer{i}.{n - 1}.conv1.weight" in state and f"layer{i}.{n}.conv1.weight" not in state


@pytest.mark.parametrize("name", ["resnet50", "resnet101"])
def test_bottleneck_is_v1_5(name):
    """ResNet v1.5: the stride of a down-sampling block sits on the 3x3 conv2, not the 1x1 conv1."""
    with torch.device("meta"):
        net = ResNet(name)
    for layer in (net.layer2, net.layer3, net.layer4):
        assert layer[0].conv1.stride == (1, 1)
        assert layer[0].conv2.stride == (2, 2)
        assert layer[0].downsample[0].stride == (2, 2)


# (layer, block) -> (stride, dilation) of the 3x3 conv that carries the stride, torchvision's
# replace_stride_with_dilation: [F, F, T] for OS 16 and [F, T, T] for OS 8
DILATIONS = {
    32: {(3, 0): (2, 1), (3, 1): (1, 1), (4, 0): (2, 1), (4, 1): (1, 1)},
    16: {(3, 0): (2, 1), (3, 1): (1, 1), (4, 0): (1, 1), (4, 1): (1, 2), (4, 2): (1, 2)},
    8: {(2, 0): (2, 1), (3, 0): (1, 1), (3, 1): (1, 2), (3, 5): (1, 2), (4, 0): (1, 2), (4, 1): (1, 4), (4, 2): (1, 4)},
}


@pytest.mark.parametrize("os_", [32, 16, 8])
def test_dilation_follows_torchvision(os_):
    with torch.device("meta"):
        net = ResNet("resnet50", os_)
    for (layer, block), (stride, dil) in DILATIONS[os_].items():
        conv = getattr(net, f"layer{layer}")[block].conv2
        assert conv.stride == (stride, stride) and conv.dilation == (dil, dil), (layer, block, conv)
        assert conv.padding == (dil, dil)
    down4 = net.layer4[0].downsample[0]
    assert down4.stride == ((2, 2) if os_ == 32 else (1, 1))


@pytest.mark.parametrize("os_", [16, 8])
def test_resnet18_dilation(os_):
    """BasicBlock (torchvision refuses dilation there): conv1 of a dilated layer's first block at
    the previous dilation, its conv2 and later blocks at the new one."""
    net = ResNet("resnet18", os_)
    b0, b1 = net.layer4[0], net.layer4[1]
    first = 1 if os_ == 16 else 2
    new = 2 if os_ == 16 else 4
    assert b0.conv1.stride == (1, 1) and b0.conv1.dilation == (first, first)
    assert b0.conv2.dilation == (new, new) and b1.conv1.dilation == (new, new) and b1.conv2.dilation == (new, new)
    assert net.layer3[0].conv1.stride == ((2, 2) if os_ == 16 else (1, 1))


@pytest.mark.parametrize("os_,hw,sizes", [
    (16, (64, 48), [(16, 12), (8, 6), (4, 3), (4, 3)]),
    (8, (64, 48), [(16, 12), (8, 6), (8, 6), (8, 6)]),
    (16, (65, 65), [(17, 17), (9, 9), (5, 5), (5, 5)]),
    (8, (65, 65), [(17, 17), (9, 9), (9, 9), (9, 9)]),
    (32, (64, 48), [(16, 12), (8, 6), (4, 3), (2, 2)]),
])
def test_feature_strides(os_, hw, sizes):
    net = ResNet("resnet18", os_).eval()
    with torch.no_grad():
        feats = net(torch.randn(1, 3, *hw))
    assert [tuple(f.shape[-2:]) for f in feats] == sizes
    assert [f.shape[1] for f in feats] == [64, 128, 256, 512]


# --- heads ----------------------------------------------------------------------------------


def test_deeplabv3plus_head_is_rsepms():
    model = meta_model("deeplabv3+", "resnet101", 20, 16)
    head = [k for k, _ in model.named_parameters() if not k.startswith("backbone.")]
    assert head == RSEPM_V3P_HEAD
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    assert shapes["aspp.aspp1.conv.weight"] == (256, 2048, 1, 1)
    assert shapes["aspp.aspp2.conv.weight"] == (256, 2048, 3, 3)
    assert shapes["aspp.block.0.conv.weight"] == (256, 1280, 1, 1)
    assert shapes["decoder.low_block.conv.weight"] == (48, 256, 1, 1)
    assert shapes["decoder.classifier.0.conv.weight"] == (256, 304, 3, 3)
    assert shapes["decoder.classifier.4.weight"] == (21, 256, 3, 3)
    drops = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops == [0.5, 0.5, 0.1]


@pytest.mark.parametrize("os_,rates", [(16, (6, 12, 18)), (8, (12, 24, 36))])
def test_deeplabv3plus_aspp_rates(os_, rates):
    model = meta_model("deeplabv3+", "resnet50", 20, os_)
    got = tuple(getattr(model.aspp, f"aspp{i}").conv.dilation[0] for i in (2, 3, 4))
    assert got == rates
    assert tuple(getattr(model.aspp, f"aspp{i}").conv.padding[0] for i in (2, 3, 4)) == rates
    assert model.aspp.aspp1.conv.kernel_size == (1, 1)


def test_default_output_stride_per_arch():
    assert meta_model("deeplabv3+").config["output_stride"] == 16
    assert meta_model("deeplabv2").config["output_stride"] == 8


# --- forward --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deeplabv3+"])  # deeplabv2: tests/test_deeplabv2_upstream.py
@pytest.mark.parametrize("os_", [8, 16])
@pytest.mark.parametrize("hw", [(65, 65), (25, 38)])
def test_output_shape(arch, os_, hw):
    model = tiny(arch, os_, num_classes=4).train()  # eval mode: test_logits_are_bilinear_upsampling...
    out = model(torch.randn(2, 3, *hw))
    assert tuple(out.shape) == (2, 5, *hw) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_logits_are_bilinear_upsampling_of_the_head():
    """forward = bilinear (align_corners=False) up-sampling of the stride-4 decoder output."""
    model = tiny("deeplabv3+", 16).eval()
    x = torch.randn(2, 3, 65, 65)
    with torch.no_grad():
        feats = model.backbone(x)
        low = model.decoder(model.aspp(feats[3]), feats[0])
        assert tuple(low.shape[-2:]) == (17, 17)
        want = F.interpolate(low, size=(65, 65), mode="bilinear", align_corners=False)
        assert torch.allclose(model(x), want, atol=1e-6)


def test_batch_of_one_in_training_is_a_clear_error():
    model = tiny("deeplabv3+", 16).train()
    with pytest.raises(ValueError, match="at least 2 images"):
        model(torch.randn(1, 3, 33, 33))
    model.eval()
    assert tuple(model(torch.randn(1, 3, 33, 33)).shape) == (1, 4, 33, 33)


@pytest.mark.parametrize("bad", [torch.randn(2, 1, 33, 33), torch.randn(3, 33, 33),
                                 torch.zeros(2, 3, 33, 33, dtype=torch.uint8), np.zeros((2, 3, 33, 33), np.float32)])
def test_bad_input_is_a_clear_error(bad):
    model = tiny().eval()
    with pytest.raises(ValueError, match=r"x must be a float tensor \(B, 3, H, W\)"):
        model(bad)


def test_determinism_for_a_seed():
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    x = torch.randn(2, 3, 33, 33)
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("arch", ["deeplabv3+"])  # deeplabv2: tests/test_deeplabv2_upstream.py
def test_gradients_reach_every_parameter(arch):
    model = tiny(arch, 16).train()
    x = torch.randn(2, 3, 33, 33)
    y = torch.randint(0, 4, (2, 33, 33))
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


# --- build_model arguments ------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,exc,pattern", [
    ({"arch": "deeplabv3"}, ValueError, r"arch must be one of 'deeplabv3\+', 'deeplabv2', 'deeplabv3\+dhr', 'deeplabv1-wr38', got 'deeplabv3'"),
    ({"arch": "DeepLabv3+"}, ValueError, r"arch must be one of .* got 'DeepLabv3\+'"),
    ({"arch": ""}, ValueError, r"arch must be one of .* got ''"),
    ({"arch": None}, TypeError, r"arch must be one of .* got NoneType"),
    ({"backbone": "resnet34"}, ValueError,
     r"backbone must be one of 'resnet18', 'resnet50', 'resnet101', got 'resnet34'"),
    ({"backbone": "resnet152"}, ValueError, r"backbone must be one of .* got 'resnet152'"),
    ({"backbone": "vgg16"}, ValueError, r"backbone must be one of .* got 'vgg16'"),
    ({"backbone": 101}, TypeError, r"backbone must be one of .* got int 101"),
    ({"output_stride": 4}, ValueError, r"output_stride must be 8 or 16, got 4"),
    ({"output_stride": 32}, ValueError, r"output_stride must be 8 or 16, got 32"),
    ({"output_stride": 0}, ValueError, r"output_stride must be 8 or 16, got 0"),
    ({"output_stride": 16.0}, TypeError, r"output_stride must be 8 or 16, got float 16.0"),
    ({"output_stride": True}, TypeError, r"output_stride must be 8 or 16, got bool True"),
    ({"output_stride": "16"}, TypeError, r"output_stride must be 8 or 16, got str '16'"),
    ({"num_classes": 0}, ValueError, r"num_classes must be an integer in 1..253, got 0"),
    ({"num_classes": -1}, ValueError, r"num_classes must be an integer in 1..253, got -1"),
    ({"num_classes": 254}, ValueError, r"num_classes must be an integer in 1..253, got 254 \(labels are 0..C"),
    ({"num_classes": 1000}, ValueError, r"num_classes must be an integer in 1..253, got 1000"),
    ({"num_classes": 20.0}, TypeError, r"num_classes must be an integer in 1..253, got float 20.0"),
    ({"num_classes": "20"}, TypeError, r"num_classes must be an integer in 1..253, got str '20'"),
    ({"num_classes": True}, TypeError, r"num_classes must be an integer in 1..253, got bool True"),
])
def test_build_model_refuses_bad_arguments(kwargs, exc, pattern):
    args = dict(arch="deeplabv3+", backbone="resnet18", num_classes=20, output_stride=16)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        build_model(**args)


@pytest.mark.parametrize("num_classes", [1, 253])
def test_build_model_class_count_edges(num_classes):
    model = meta_model("deeplabv2", "resnet50", num_classes)
    assert model.aspp.c0.out_channels == num_classes + 1
    assert model.config == {"arch": "deeplabv2", "backbone": "resnet50", "output_stride": 8,
                            "num_classes": num_classes}


def test_numpy_integers_are_accepted():
    model = meta_model("deeplabv3+", "resnet18", np.int64(5), np.int32(8))
    assert model.config == {"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 8, "num_classes": 5}
    assert all(type(v) in (str, int) for v in model.config.values())  # JSON-able, weights_only-able


# --- ImageNet weights -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch,with_tracked", [("deeplabv3+", True), ("deeplabv3+", False)])
def test_load_backbone_weights_round_trip(tmp_path, arch, with_tracked):
    state = torchvision_state("resnet18", seed=1, with_tracked=with_tracked)
    path = tmp_path / "resnet18-f37072fd.pth"
    torch.save(state, path)
    model = tiny(arch, 8, seed=2)
    for m in model.backbone.modules():  # a count from before: loading ImageNet weights restarts it
        if isinstance(m, nn.BatchNorm2d):
            m.num_batches_tracked.fill_(5)
    head_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("backbone.")}
    load_backbone_weights(model, path)
    got = model.backbone.state_dict()
    for k, v in got.items():
        if k.endswith("num_batches_tracked"):
            assert int(v) == (7 if with_tracked else 0), k
        else:
            assert torch.equal(v, state[k]), k
    for k, v in model.state_dict().items():  # the head is untouched
        if not k.startswith("backbone."):
            assert torch.equal(v, head_before[k]), k
    # the same network as a torchvision ResNet with these weights: same features
    ref = ResNet("resnet18", 8)
    ref.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")}, strict=False)
    x = torch.randn(2, 3, 33, 33)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model.backbone(x), ref(x)))


def test_load_backbone_weights_into_a_wrapped_model_and_a_bare_resnet(tmp_path):
    state = torchvision_state("resnet18", seed=1)
    path = tmp_path / "r18.pth"
    torch.save(state, path)

    class Wrapper(nn.Module):  # what DDP looks like: the network in .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    model = tiny()
    load_backbone_weights(Wrapper(model), path)
    assert torch.equal(model.backbone.conv1.weight, state["conv1.weight"])
    bare = ResNet("resnet18")
    load_backbone_weights(bare, path)
    assert torch.equal(bare.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])
    with pytest.raises(TypeError, match="model must be a network of mars_plugin.networks.deeplab.build_model"):
        load_backbone_weights(nn.Linear(2, 2), path)


@pytest.mark.parametrize("file_net,model_net,pattern", [
    ("resnet50", "resnet101", r"resnet50-layout.pth: does not fit the resnet101 backbone \(torchvision layout\): "
                              r"\d+ missing \(layer3.6.conv1.weight.*; the file fits resnet50"),
    ("resnet101", "resnet50", r"does not fit the resnet50 backbone.*unexpected \(layer3.6.*; the file fits resnet101"),
    ("resnet18", "resnet50", r"does not fit the resnet50 backbone.*165 missing.*23 of another shape "
                             r"\(layer1.0.conv1.weight \(64, 64, 3, 3\) != \(64, 64, 1, 1\).*fits resnet18"),
    ("resnet50", "resnet18", r"does not fit the resnet18 backbone.*fits resnet50"),
])
def test_wrong_backbone_file_is_named(tmp_path, file_net, model_net, pattern):
    path = layout_file(tmp_path, file_net)
    model = meta_model("deeplabv3+", model_net)  # the errors come before any value is read
    with pytest.raises(ValueError, match=pattern) as info:
        load_backbone_weights(model, path)
    assert "\n" not in str(info.value)


def test_wrong_backbone_file_loads_nothing(tmp_path):
    state = torchvision_state("resnet18")
    state.pop("layer4.1.conv2.weight")
    path = tmp_path / "r18-cut.pth"
    torch.save(state, path)
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"r18-cut.pth: does not fit the resnet18 backbone.*1 missing "
                                         r"\(layer4.1.conv2.weight\)"):
        load_backbone_weights(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def r18_state():
    return torchvision_state("resnet18", with_fc=False)


@pytest.fixture(scope="module")
def r18_model():
    return tiny()


def _write_bad(tmp_path, kind, state):
    path = tmp_path / f"{kind}.pth"
    good = {k: v.clone() for k, v in state.items()}
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("not weights\n")
    elif kind == "truncated":
        torch.save(good, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "pickled_object":
        torch.save({"conv1.weight": good["conv1.weight"], "extra": nn.Linear(2, 2)}, path)
    elif kind == "list":
        torch.save(list(good.values()), path)
    elif kind == "mars_checkpoint":
        torch.save({"format": "mars-train/1", "student": good, "model": {}}, path)
    elif kind == "nested_state_dict":
        torch.save({"state_dict": good, "epoch": 3}, path)
    elif kind in ("module_prefix", "backbone_prefix"):
        prefix = kind.split("_")[0] + "."
        torch.save({prefix + k: v for k, v in good.items()}, path)
    elif kind == "nonfinite":
        good["layer2.0.conv1.weight"][0, 0, 0, 0] = float("nan")
        torch.save(good, path)
    elif kind == "integer_weights":
        good["layer1.0.bn1.weight"] = good["layer1.0.bn1.weight"].long()
        torch.save(good, path)
    return path


BAD_FILES = {
    "empty": r"not a readable torch file of ImageNet weights",
    "text": r"not a readable torch file of ImageNet weights",
    "truncated": r"not a readable torch file of ImageNet weights",
    "pickled_object": r"not a readable torch file of ImageNet weights \(UnpicklingError",
    "list": r"not a state dict of tensors \(a torchvision ImageNet file\), got list",
    "mars_checkpoint": r"not a state dict of tensors.*it is a mars train checkpoint",
    "nested_state_dict": r"not a state dict of tensors.*a training checkpoint holding a state dict",
    "module_prefix": r"does not fit the resnet18 backbone.*its keys start with 'module.'",
    "backbone_prefix": r"does not fit the resnet18 backbone.*its keys start with 'backbone.'",
    "nonfinite": r"layer2.0.conv1.weight holds non-finite values",
    "integer_weights": r"layer1.0.bn1.weight has dtype torch.int64, expected floating weights",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_weight_files_are_one_line_errors(tmp_path, kind, r18_state, r18_model):
    path = _write_bad(tmp_path, kind, r18_state)
    model = r18_model  # shared: a test that loads anything into it fails below
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=BAD_FILES[kind]) as info:
        load_backbone_weights(model, path)
    msg = str(info.value)
    assert msg.startswith(str(path) + ": ") and "\n" not in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_missing_weight_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.pth: no such file \(ImageNet weights in torchvision layout"):
        load_backbone_weights(tiny(), tmp_path / "nope.pth")


# --- optimizer groups -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deeplabv3+", "deeplabv2"])
def test_param_groups(arch):
    model = tiny(arch)
    groups = param_groups(model, 0.01, 1e-4)
    assert [g["name"] for g in groups] == ["backbone_weight", "backbone_bias", "head_weight", "head_bias"]
    assert [g["lr"] for g in groups] == pytest.approx([0.01, 0.02, 0.1, 0.2])
    assert [g["lr_mult"] for g in groups] == [1.0, 2.0, 10.0, 20.0]
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0, 1e-4, 0.0]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    by_name = {id(p): n for n, p in model.named_parameters()}
    names = {g["name"]: [by_name[id(p)] for p in g["params"]] for g in groups}
    first = "backbone.conv1.weight" if arch == "deeplabv3+" else "layer1.conv1.conv.weight"
    bn = "backbone.bn1" if arch == "deeplabv3+" else "layer1.conv1.bn"
    part = "backbone." if arch == "deeplabv3+" else "layer"
    assert first in names["backbone_weight"]
    assert f"{bn}.weight" in names["backbone_weight"]  # BN weights are decayed, as upstream
    assert f"{bn}.bias" in names["backbone_bias"]
    assert all(n.startswith(part) for n in names["backbone_weight"] + names["backbone_bias"])
    assert not any(n.startswith(part) for n in names["head_weight"] + names["head_bias"])
    if arch == "deeplabv2":
        assert names["head_bias"] == [f"aspp.c{i}.bias" for i in range(4)]
    else:
        assert "decoder.classifier.4.weight" in names["head_weight"]
        assert "aspp.aspp1.bn.bias" in names["head_bias"]
    opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02, 0.1, 0.2])


def test_param_groups_leave_out_frozen_and_accept_wrapped():
    model = tiny()
    for p in model.backbone.parameters():
        p.requires_grad_(False)

    class Wrapper(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m

    groups = param_groups(Wrapper(model), 0.1, 0.0)
    assert [g["name"] for g in groups] == ["head_weight", "head_bias"]


@pytest.mark.parametrize("lr,wd,exc,pattern", [
    (0.0, 1e-4, ValueError, r"lr must be a finite number in \(0, inf\), got 0.0"),
    (-0.01, 1e-4, ValueError, r"lr must be a finite number in \(0, inf\), got -0.01"),
    (float("nan"), 1e-4, ValueError, r"lr must be .* got nan"),
    ("0.01", 1e-4, TypeError, r"lr must be .* got str '0.01'"),
    (0.01, -1e-4, ValueError, r"weight_decay must be a finite number in \[0, inf\), got -0.0001"),
    (0.01, float("inf"), ValueError, r"weight_decay must be .* got inf"),
])
def test_param_groups_refuse_bad_numbers(lr, wd, exc, pattern):
    with pytest.raises(exc, match=pattern):
        param_groups(meta_model("deeplabv2", "resnet50"), lr, wd)


def test_param_groups_refuse_other_networks():
    with pytest.raises(TypeError, match="model must be a network of mars_plugin.networks.deeplab.build_model"):
        param_groups(nn.Conv2d(3, 3, 1), 0.01, 0.0)


# --- normalization --------------------------------------------------------------------------


def test_normalize_is_rsepms():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(2, 7, 5, 3), dtype=np.uint8)
    # RS+EPM tools/ai/augment_utils.py Normalize, per image, float32
    want = np.empty(images.shape, np.float32)
    img = images.astype(np.float32)
    for c in range(3):
        want[..., c] = (img[..., c] / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
    want = want.transpose(0, 3, 1, 2)
    for given in (images, torch.from_numpy(images)):
        got = normalize(given)
        assert got.dtype == torch.float32 and tuple(got.shape) == (2, 3, 7, 5) and got.is_contiguous()
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)
    assert IMAGENET_MEAN == (0.485, 0.456, 0.406) and IMAGENET_STD == (0.229, 0.224, 0.225)


@pytest.mark.parametrize("bad,exc,pattern", [
    (np.zeros((2, 5, 5, 3), np.float32), TypeError, r"images must be uint8 RGB \(B, H, W, 3\), got array"),
    (torch.zeros(2, 5, 5, 3), TypeError, r"images must be uint8 RGB \(B, H, W, 3\), got tensor"),
    (torch.zeros(2, 3, 5, 5, dtype=torch.uint8), ValueError,
     r"images must be \(B, H, W, 3\) RGB, got tensor of shape \(2, 3, 5, 5\)"),
    (np.zeros((5, 5, 3), np.uint8), ValueError, r"images must be \(B, H, W, 3\) RGB, got tensor of shape \(5, 5, 3\)"),
    ([[1, 2, 3]], TypeError, r"images must be a uint8 tensor or array"),
])
def test_normalize_refuses_bad_images(bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        normalize(bad)


# --- checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deeplabv3+", "deeplabv2"])
def test_checkpoint_round_trip(tmp_path, arch):
    model = tiny(arch, 8, num_classes=5, seed=5)
    opt = torch.optim.SGD(param_groups(model, 0.01, 1e-4), lr=0.01, momentum=0.9)
    model.train()
    x = torch.randn(2, 3, 33, 33)
    out = model(x)  # deeplabv2: at stride 8, as upstream
    F.cross_entropy(out, torch.randint(0, 6, (2, *out.shape[-2:]))).backward()
    opt.step()
    path = tmp_path / "ck.pth"
    # the optimizer's groups carry strings (name): they too must read back with weights_only
    save_checkpoint(path, {"model": model.config, "iteration": 1, "student": model.state_dict(), "teacher": None,
                           "optimizer": opt.state_dict() if arch == "deeplabv2" else None})
    back, meta = model_from_checkpoint(path)
    assert back.config == model.config and not back.training
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), back(x))
    assert meta["iteration"] == 1
    if arch == "deeplabv2":
        ck = load_checkpoint(path)
        assert [g["name"] for g in ck["optimizer"]["param_groups"]] == [g["name"] for g in opt.param_groups]


@pytest.mark.parametrize("cls,args,exc,pattern", [
    (deeplab.DeepLabV3Plus, ("resnet18", 5, 32), ValueError, r"output_stride must be 8 or 16, got 32"),
    (deeplab.DeepLabV2, ("resnet34", 5, 8), ValueError, r"backbone must be one of .* got 'resnet34'"),
    (deeplab.DeepLabV2, ("resnet50", 0, 8), ValueError, r"num_classes must be an integer in 1..253, got 0"),
    (deeplab.DeepLabV2, ("resnet18", 5, 8), ValueError, r"backbone must be one of 'resnet50', 'resnet101' for deeplabv2"),
    (deeplab.DeepLabV2, ("resnet50", 5, 16), ValueError, r"output_stride must be 8 for deeplabv2"),
])
def test_classes_check_their_arguments_too(cls, args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        with torch.device("meta"):
            cls(*args)


def _reference_resnet(x, sd, name, os_):
    """torchvision's ResNet forward written out with torch.nn.functional from a state dict (eval
    mode): stem, then per block conv-BN-ReLU ... BN, + identity (or downsample), ReLU; the stride
    of a dilated layer becomes dilation, its first block keeping the previous dilation."""
    def bn(t, p):
        return F.batch_norm(t, sd[p + ".running_mean"], sd[p + ".running_var"], sd[p + ".weight"], sd[p + ".bias"],
                            False, 0.0, 1e-5)

    def conv(t, p, stride=1, dil=1):
        w = sd[p + ".weight"]
        return F.conv2d(t, w, stride=stride, padding=dil * (w.shape[-1] // 2), dilation=dil)

    x = F.max_pool2d(F.relu(bn(conv(x, "conv1", 2), "bn1")), 3, 2, 1)
    dilate = {16: [False, False, False, True], 8: [False, False, True, True]}[os_]
    dilation = 1
    for li, n in enumerate(TORCHVISION[name]["blocks"], 1):
        stride = 1 if li == 1 else 2
        previous = dilation
        if dilate[li - 1]:
            dilation, stride = dilation * stride, 1
        for b in range(n):
            p = f"layer{li}.{b}."
            s, d1 = (stride, previous) if b == 0 else (1, dilation)
            if name == "resnet18":
                out = F.relu(bn(conv(x, p + "conv1", s, d1), p + "bn1"))
                out = bn(conv(out, p + "conv2", 1, dilation), p + "bn2")
            else:
                out = F.relu(bn(conv(x, p + "conv1"), p + "bn1"))
                out = F.relu(bn(conv(out, p + "conv2", s, d1), p + "bn2"))
                out = bn(conv(out, p + "conv3"), p + "bn3")
            idt = bn(conv(x, p + "downsample.0", s), p + "downsample.1") if p + "downsample.0.weight" in sd else x
            x = F.relu(out + idt)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("name,os_", [("resnet18", 16), ("resnet18", 8), ("resnet50", 8)])
def test_backbone_forward_is_torchvisions(name, os_):
    state = torchvision_state(name, seed=4, with_fc=False)
    net = ResNet(name, os_).eval()
    net.load_state_dict(state)
    x = torch.randn(2, 3, 37, 29)
    with torch.no_grad():
        got = net(x)[3]
        want = _reference_resnet(x, state, name, os_)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
