"""deeplabv2 is deeplab-pytorch's DeepLabV2 (kazuto1011/deeplab-pytorch @ 4219467), MSC included.

Every expectation here is written from the upstream definitions (libs/models/resnet.py,
deeplabv2.py, msc.py, __init__.py, convert.py, main.py): the keys in upstream's order, each
conv's stride, padding and dilation (the stride on the 1x1 ``reduce``; every block of layer4 at
dilation 2 and of layer5 at 4), the ceil-mode max pool, BatchNorm's eps and momentum, which
convs are followed by a ReLU, the ASPP's rates and init; the forward is compared in float64 with
a plain computation written here from F.conv2d / F.batch_norm / F.max_pool2d on the same
weights. ResNet-101 is checked on the meta device (no memory), the forwards run ResNet-50 on
inputs of about 40 pixels.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.networks.deeplab import build_model, load_backbone_weights
from mars_plugin.networks.deeplabv2 import MSC, DeepLabV2, load_deeplab_pytorch_weights
from _weight_views import layout_files_are_views  # noqa: F401 (autouse: the weight files are views)

# libs/models/__init__.py:36 (ResNet-101) and the same rule with ResNet-50's block counts
BLOCKS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}
# deeplabv2.py:48-51: (stride, dilation) of layer2..layer5
STRIDE_DILATION = {"layer2": (1, 1), "layer3": (2, 1), "layer4": (1, 2), "layer5": (1, 4)}
CHANNELS = {"layer2": (64, 256), "layer3": (256, 512), "layer4": (512, 1024), "layer5": (1024, 2048)}
BN_LINE = 'self.add_module("bn", _BATCH_NORM(out_ch, eps=1e-5, momentum=1 - 0.999))'  # resnet.py:43
BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def meta_net(backbone="resnet101", num_classes=20):
    with torch.device("meta"):
        return build_model("deeplabv2", backbone, num_classes)


def small(seed=0, num_classes=3):
    """A ResNet-50 DeepLabV2 in float64 with non-trivial BatchNorm statistics and affines."""
    torch.manual_seed(seed)
    net = build_model("deeplabv2", "resnet50", num_classes).double()
    g = torch.Generator().manual_seed(seed + 1)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64) + 0.5)
            m.bias.data.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64) - 0.5)
    for c in net.aspp.children():  # a head whose output is not near zero
        c.bias.data.normal_(0, 1, generator=g)
    return net


def expected_keys(backbone, num_classes):
    """The state-dict keys of upstream's DeepLabV2 (nn.Sequential layer1..layer5, aspp), in order."""
    keys = ["layer1.conv1.conv.weight"] + [f"layer1.conv1.bn.{k}" for k in BN_KEYS]
    for i, n in enumerate(BLOCKS[backbone], 2):
        for j in range(1, n + 1):
            for part in ("reduce", "conv3x3", "increase") + (("shortcut",) if j == 1 else ()):
                p = f"layer{i}.block{j}.{part}"
                keys += [f"{p}.conv.weight"] + [f"{p}.bn.{k}" for k in BN_KEYS]
    keys += [f"aspp.c{i}.{k}" for i in range(4) for k in ("weight", "bias")]
    return keys


# --- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backbone", ["resnet50", "resnet101"])
def test_keys_are_upstreams_in_order(backbone):
    net = meta_net(backbone, 20)
    assert isinstance(net, DeepLabV2) and isinstance(net, nn.Sequential)  # upstream's class is a Sequential
    assert list(net.state_dict()) == expected_keys(backbone, 20)
    assert [n for n, _ in net.named_children()] == ["layer1", "layer2", "layer3", "layer4", "layer5", "aspp"]
    assert net.config == {"arch": "deeplabv2", "backbone": backbone, "output_stride": 8, "num_classes": 20}


@pytest.mark.parametrize("backbone", ["resnet50", "resnet101"])
def test_every_conv_has_upstreams_stride_padding_dilation_and_shape(backbone):
    net = meta_net(backbone, 20)
    stem = net.layer1
    assert (stem.conv1.conv.kernel_size, stem.conv1.conv.stride, stem.conv1.conv.padding) == ((7, 7), (2, 2), (3, 3))
    assert stem.conv1.conv.weight.shape == (64, 3, 7, 7)
    pool = stem.pool
    assert isinstance(pool, nn.MaxPool2d)
    assert (pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode) == (3, 2, 1, True)
    for i, n in enumerate(BLOCKS[backbone], 2):
        layer = getattr(net, f"layer{i}")
        stride, dilation = STRIDE_DILATION[f"layer{i}"]
        cin, cout = CHANNELS[f"layer{i}"]
        mid = cout // 4
        assert [b for b, _ in layer.named_children()] == [f"block{j}" for j in range(1, n + 1)]
        for j in range(1, n + 1):
            blk = getattr(layer, f"block{j}")
            s = stride if j == 1 else 1
            c_in = cin if j == 1 else cout
            r, c, inc = blk.reduce.conv, blk.conv3x3.conv, blk.increase.conv
            # the stride sits on the 1x1 reduce (the MSRA/caffe ResNet), never on the 3x3
            assert (r.kernel_size, r.stride, r.padding, r.dilation) == ((1, 1), (s, s), (0, 0), (1, 1))
            assert (c.kernel_size, c.stride, c.padding, c.dilation) == ((3, 3), (1, 1), (dilation,) * 2, (dilation,) * 2)
            assert (inc.kernel_size, inc.stride, inc.padding) == ((1, 1), (1, 1), (0, 0))
            assert (r.weight.shape, c.weight.shape, inc.weight.shape) == ((mid, c_in, 1, 1), (mid, mid, 3, 3),
                                                                          (cout, mid, 1, 1))
            if j == 1:  # the projection shortcut, at the block's stride, in every layer's first block
                sc = blk.shortcut.conv
                assert (sc.kernel_size, sc.stride, sc.padding, sc.weight.shape) == ((1, 1), (s, s), (0, 0),
                                                                                    (cout, c_in, 1, 1))
                assert not hasattr(blk.shortcut, "relu")
            else:
                assert isinstance(blk.shortcut, nn.Identity)
            # ReLU after reduce and conv3x3, none after increase (it comes after the sum)
            assert isinstance(blk.reduce.relu, nn.ReLU) and isinstance(blk.conv3x3.relu, nn.ReLU)
            assert not hasattr(blk.increase, "relu")
    assert all(m.bias is None for name, m in net.named_modules() if isinstance(m, nn.Conv2d) and "layer" in name)


def test_batchnorm_eps_and_momentum_are_upstreams():
    eps = float(re.search(r"eps=([0-9.e-]+)", BN_LINE).group(1))
    a, b = (float(v) for v in re.search(r"momentum=([0-9.]+) - ([0-9.]+)", BN_LINE).groups())
    bns = [m for m in meta_net("resnet50").modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 1 + 3 * sum(BLOCKS["resnet50"]) + 4
    assert all(m.eps == eps and m.momentum == a - b and m.affine and m.track_running_stats for m in bns)


def test_aspp_is_four_summed_dilated_convs_with_upstreams_init():
    torch.manual_seed(0)
    net = build_model("deeplabv2", "resnet50", 20).requires_grad_(False)
    convs = [getattr(net.aspp, f"c{i}") for i in range(4)]
    assert len(list(net.aspp.children())) == 4
    for conv, rate in zip(convs, (6, 12, 18, 24)):  # __init__.py:36
        assert (conv.kernel_size, conv.stride, conv.padding, conv.dilation) == ((3, 3), (1, 1), (rate,) * 2, (rate,) * 2)
        assert conv.weight.shape == (21, 2048, 3, 3) and conv.bias is not None
        assert float(conv.bias.abs().max()) == 0.0
        assert abs(float(conv.weight.std()) - 0.01) < 3e-4 and abs(float(conv.weight.mean())) < 3e-4  # N(0, 0.01)
    x = torch.randn(1, 2048, 5, 4)
    with torch.no_grad():
        assert torch.allclose(net.aspp(x), sum(c(x) for c in convs), atol=1e-6)
    # the backbone keeps PyTorch's default init (upstream never re-initialises it)
    w = net.layer2.block1.reduce.conv.weight
    assert float(w.abs().max()) <= 1 / math.sqrt(64) and float(w.std()) > 0.5 / math.sqrt(3 * 64)
    bn = net.layer1.conv1.bn
    assert torch.equal(bn.weight, torch.ones(64)) and torch.equal(bn.bias, torch.zeros(64))


def test_backbones_and_strides_other_than_upstreams_are_refused():
    with pytest.raises(ValueError, match=r"backbone must be one of 'resnet50', 'resnet101' for deeplabv2 .*'resnet18'"):
        build_model("deeplabv2", "resnet18", 3)
    with pytest.raises(ValueError, match=r"output_stride must be 8 for deeplabv2 .* got 16"):
        build_model("deeplabv2", "resnet50", 3, 16)


# --- forward --------------------------------------------------------------------------------------


def _cbr(sd, p, x, stride=1, padding=0, dilation=1, relu=True):
    y = F.conv2d(x, sd[f"{p}.conv.weight"], None, stride, padding, dilation)
    y = F.batch_norm(y, sd[f"{p}.bn.running_mean"], sd[f"{p}.bn.running_var"], sd[f"{p}.bn.weight"],
                     sd[f"{p}.bn.bias"], False, 0.0, 1e-5)
    return y.clamp_min(0) if relu else y


def reference(sd, x, blocks):
    """deeplabv2.py's forward (eval-mode BN) from the upstream definitions, one op at a time."""
    h = _cbr(sd, "layer1.conv1", x, 2, 3)
    h = F.max_pool2d(h, 3, 2, 1, ceil_mode=True)
    for i, n in enumerate(blocks, 2):
        stride, dil = STRIDE_DILATION[f"layer{i}"]
        for j in range(1, n + 1):
            p, s = f"layer{i}.block{j}", (stride if j == 1 else 1)
            y = _cbr(sd, f"{p}.reduce", h, s)
            y = _cbr(sd, f"{p}.conv3x3", y, 1, dil, dil)
            y = _cbr(sd, f"{p}.increase", y, relu=False)
            short = _cbr(sd, f"{p}.shortcut", h, s, relu=False) if j == 1 else h
            h = (y + short).clamp_min(0)
    return sum(F.conv2d(h, sd[f"aspp.c{i}.weight"], sd[f"aspp.c{i}.bias"], 1, r, r)
               for i, r in enumerate((6, 12, 18, 24)))


def test_forward_equals_the_upstream_definition_in_float64():
    net = small().eval()
    # 35 and 43 make the stem's output even (18, 22), where ceil and floor pooling differ
    x = torch.randn(2, 3, 35, 43, dtype=torch.float64)
    with torch.no_grad():
        got = net(x)
        want = reference(net.state_dict(), x, BLOCKS["resnet50"])
    assert got.shape == want.shape == (2, 4, 5, 6)  # stride 8, not up-sampled
    assert float(want.abs().max()) > 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("hw,want", [((321, 321), (41, 41)), ((513, 513), (65, 65)), ((160, 160), (21, 21)),
                                     ((240, 240), (31, 31)), ((35, 43), (5, 6))])
def test_output_size_at_stride_8(hw, want):
    # conv 7x7/2 (p 3), max pool 3/2 (p 1, ceil), the 1x1/2 reduce of layer3
    h = [(v + 6 - 7) // 2 + 1 for v in hw]
    h = [math.ceil((v + 2 - 3) / 2) + 1 for v in h]
    h = [(v - 1) // 2 + 1 for v in h]
    assert tuple(h) == want
    net = meta_net("resnet101", 20).eval()
    assert tuple(net(torch.empty(1, 3, *hw, device="meta")).shape) == (1, 21, *want)


def test_gradients_reach_every_parameter_and_freeze_bn_keeps_statistics():
    net = small().train()
    net.freeze_bn()
    before = net.layer1.conv1.bn.running_mean.clone()
    out = net(torch.randn(2, 3, 35, 35, dtype=torch.float64))
    F.cross_entropy(out, torch.randint(0, 4, (2, *out.shape[-2:]))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    assert torch.equal(net.layer1.conv1.bn.running_mean, before)
    assert all(not m.training for m in net.modules() if isinstance(m, nn.BatchNorm2d))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"x must be a float tensor \(B, 3, H, W\) of BGR mean-subtracted images"):
        meta_net()(torch.zeros(1, 3, 33, 33, dtype=torch.uint8, device="meta"))


# --- MSC --------------------------------------------------------------------------------------------


def test_msc_returns_upstreams_outputs_in_train_and_eval():
    base = small()
    msc = MSC(base)
    assert msc.scales == [0.5, 0.75] and MSC(base, None).scales == [0.5, 0.75]
    assert [n for n, _ in msc.named_children()] == ["base"]
    assert list(msc.state_dict()) == ["base." + k for k in base.state_dict()]
    x = torch.randn(1, 3, 43, 35, dtype=torch.float64)
    base.eval()
    with torch.no_grad():
        one = base(x)
        pyramid = [base(F.interpolate(x, scale_factor=s, mode="bilinear", align_corners=False)) for s in (0.5, 0.75)]
        size = one.shape[-2:]
        up = [F.interpolate(p, size=size, mode="bilinear", align_corners=False) for p in pyramid]
        biggest = torch.maximum(one, torch.maximum(up[0], up[1]))
        msc.train()
        base.freeze_bn()  # as main.py:207-208, so that train mode uses the same statistics
        got = msc(x)
        msc.eval()
        got_eval = msc(x)
    assert [tuple(t.shape[-2:]) for t in got] == [(6, 5), (3, 3), (5, 4), (6, 5)]  # 43x35, 21x17, 32x26
    for g, w in zip(got, [one, *pyramid, biggest]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_eval, biggest, rtol=0, atol=1e-12)
    assert any(not torch.equal(biggest, u) for u in [one, *up])  # the max is taken across scales


# --- weight files ------------------------------------------------------------------------------


def fake_file(tmp_path, keys_shapes, name, prefix="", fc=True, aspp_classes=None, double_stats=True):
    """A weight file of deeplab-pytorch's layout whose tensors are distinct constants expanded to
    each shape (a few kilobytes whatever the network): what convert.py writes, running statistics
    in float64 (it builds them with numpy) and num_batches_tracked a 0-d int64."""
    state, value = {}, {}
    for i, (k, shape) in enumerate(keys_shapes.items()):
        if k.startswith("aspp.") and aspp_classes is None:
            continue
        if k.endswith("num_batches_tracked"):
            state[prefix + k] = torch.tensor(0)
            continue
        if k.startswith("aspp."):
            shape = (aspp_classes,) + tuple(shape[1:])
        dtype = torch.float64 if double_stats and "running" in k else torch.float32
        v = 0.5 + i / 1000 if "running_var" not in k else 1.0 + i / 1000
        state[prefix + k] = torch.tensor(v, dtype=dtype).expand(shape)
        value[k] = v
    if fc:  # DeepLabV1's COCO classifier (deeplabv1.py:31, convert.py "N_CLASSES": 91)
        state[prefix + "fc.weight"] = torch.zeros(()).expand(91, 2048, 1, 1)
        state[prefix + "fc.bias"] = torch.zeros(()).expand(91)
    path = tmp_path / name
    torch.save(state, path)
    return path, value


def layout(backbone):
    return {k: tuple(v.shape) for k, v in meta_net(backbone, 20).state_dict().items()}


def test_the_coco_init_file_loads_as_main_py_loads_it(tmp_path):
    path, value = fake_file(tmp_path, layout("resnet50"), "deeplabv1_resnet50-coco.pth")
    torch.manual_seed(0)
    net = build_model("deeplabv2", "resnet50", 20)
    aspp = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("aspp.")}
    skipped = load_deeplab_pytorch_weights(net, path)
    assert skipped == list(aspp)  # main.py:149-151 "Skip init": the ASPP keeps its random init
    sd = net.state_dict()
    for k, v in value.items():
        assert sd[k].dtype == torch.float32 and torch.all(sd[k] == torch.tensor(v, dtype=torch.float32)), k
    assert all(torch.equal(sd[k], v) for k, v in aspp.items())


def test_an_msc_checkpoint_loads_with_its_aspp_through_load_backbone_weights(tmp_path):
    path, value = fake_file(tmp_path, layout("resnet50"), "deeplabv2_resnet50_msc-vocaug.pth", prefix="base.",
                            fc=False, aspp_classes=21)
    torch.manual_seed(0)
    msc = MSC(build_model("deeplabv2", "resnet50", 20))
    load_backbone_weights(msc, path)  # mars train --weights hands deeplabv2 to the same reader
    sd = msc.base.state_dict()
    assert all(torch.all(sd[k] == torch.tensor(v, dtype=torch.float32)) for k, v in value.items())
    assert any(k.startswith("aspp.") for k in value)


@pytest.mark.parametrize("case,pattern", [
    ("r50_into_r101", r"does not fit deeplabv2 resnet101 \(deeplab-pytorch layout\): \d+ missing "
                      r"\(layer4.block7.*layer4 has another number of blocks"),
    ("aspp_classes", r"of another shape \(aspp.c0.weight \(91, 2048, 3, 3\) != \(21, 2048, 3, 3\).*its ASPP has 91 "
                     r"outputs, the network 21"),
    ("torchvision", r"unexpected \(conv1.weight.*its keys are torchvision's"),
])
def test_wrong_files_are_named_in_one_line(tmp_path, case, pattern):
    if case == "torchvision":
        path = tmp_path / "resnet50-0676ba61.pth"
        torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "layer1.0.conv1.weight": torch.zeros(64, 64, 1, 1)}, path)
    elif case == "r50_into_r101":
        path, _ = fake_file(tmp_path, layout("resnet50"), "r50.pth")
    else:
        path, _ = fake_file(tmp_path, layout("resnet101"), "voc.pth", aspp_classes=91)
    with pytest.raises(ValueError, match=pattern) as info:
        load_deeplab_pytorch_weights(meta_net("resnet101", 20), path)  # refused before any value is read
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_unreadable_missing_and_damaged_files(tmp_path):
    net = build_model("deeplabv2", "resnet50", 2)
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        load_deeplab_pytorch_weights(net, tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"junk.pth: cannot be read as a weights-only torch file"):
        load_deeplab_pytorch_weights(net, tmp_path / "junk.pth")
    torch.save({"state_dict": {"a": 1}}, tmp_path / "ck.pth")
    with pytest.raises(ValueError, match=r"ck.pth: not a state dict of tensors"):
        load_deeplab_pytorch_weights(net, tmp_path / "ck.pth")
    path, _ = fake_file(tmp_path, layout("resnet50"), "nan.pth")
    state = torch.load(path, weights_only=True)
    state["layer2.block1.reduce.conv.weight"] = torch.full((64, 64, 1, 1), float("nan"))
    torch.save(state, path)
    before = net.layer1.conv1.conv.weight.clone()
    with pytest.raises(ValueError, match=r"layer2.block1.reduce.conv.weight holds non-finite values"):
        load_deeplab_pytorch_weights(net, path)
    assert torch.equal(net.layer1.conv1.conv.weight, before)  # nothing loaded
    with pytest.raises(TypeError, match="model must be a deeplabv2 network"):
        load_deeplab_pytorch_weights(nn.Linear(2, 2), path)
