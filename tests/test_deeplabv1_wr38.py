"""The SEAM row's DeepLabv1 on the wide ResNet-38 against expectations written from the upstream
definitions (YudeWang/semantic-segmentation-codebase a40f6c6: lib/net/backbone/resnet38d.py,
lib/net/deeplabv1.py, experiment/seamv1-pseudovoc/{config,train,test}.py): layout, keys,
strides, dilations, paddings, biases, BN settings, init, a float64 forward against a plain
F.conv2d / F.batch_norm composition, the weights reader, the training pieces and inference."""
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.networks.deeplab import build_model, load_backbone_weights, param_groups
from mars_plugin.networks.deeplabv1 import (DeepLabV1WR38, seam_crf_image, seam_loss, seam_multiscale_logits,
                                            seam_param_groups, seam_poly_lr, seam_train_mode)
from mars_plugin.networks.wide_resnet38 import WideResNet38, load_wr38_weights, wr38_key

# name, in, mid, out, stride, first dilation, dilation (resnet38d.py:132-149)
RES = [("b2", 64, 128, 128, 2, 1, 1), ("b2_1", 128, 128, 128, 1, 1, 1), ("b2_2", 128, 128, 128, 1, 1, 1),
       ("b3", 128, 256, 256, 2, 1, 1), ("b3_1", 256, 256, 256, 1, 1, 1), ("b3_2", 256, 256, 256, 1, 1, 1),
       ("b4", 256, 512, 512, 2, 1, 1)] + [(f"b4_{i}", 512, 512, 512, 1, 1, 1) for i in range(1, 6)] + [
       ("b5", 512, 512, 1024, 1, 1, 2), ("b5_1", 1024, 512, 1024, 1, 2, 2), ("b5_2", 1024, 512, 1024, 1, 2, 2)]
# name, in, out, stride, dilation, dropout (resnet38d.py:151-153)
BOT = [("b6", 1024, 2048, 1, 4, 0.3), ("b7", 2048, 4096, 1, 4, 0.5)]


def _expected_convs(div=1):
    """{key: (cin, cout, k, stride, padding, dilation)} of every conv, from the tables above."""
    c = {"backbone.conv1a": (3, 64 // div, 3, 1, 1, 1)}
    for n, i, m, o, s, fd, d in RES:
        i, m, o = i // div, m // div, o // div
        c[f"backbone.{n}.conv_branch2a"] = (i, m, 3, s, fd, fd)
        c[f"backbone.{n}.conv_branch2b1"] = (m, o, 3, 1, d, d)
        if i != o or s != 1:
            c[f"backbone.{n}.conv_branch1"] = (i, o, 1, s, 0, 1)
    for n, i, o, s, d, _ in BOT:
        i, o = i // div, o // div
        c[f"backbone.{n}.conv_branch2a"] = (i, o // 4, 1, s, 0, 1)
        c[f"backbone.{n}.conv_branch2b1"] = (o // 4, o // 2, 3, 1, d, d)
        c[f"backbone.{n}.conv_branch2b2"] = (o // 2, o, 1, 1, 0, 1)
        c[f"backbone.{n}.conv_branch1"] = (i, o, 1, s, 0, 1)
    c["conv_fov"] = (4096 // div, 512 // div, 3, 1, 12, 12)
    c["conv_fov2"] = (512 // div, 512 // div, 1, 1, 0, 1)
    c["cls_conv"] = (512 // div, 21, 1, 1, 0, 1)
    return c


def _expected_bns(div=1):
    b = {}
    for n, i, m, o, *_ in RES:
        b[f"backbone.{n}.bn_branch2a"], b[f"backbone.{n}.bn_branch2b1"] = i // div, m // div
    for n, i, o, *_ in BOT:
        b[f"backbone.{n}.bn_branch2a"] = i // div
        b[f"backbone.{n}.bn_branch2b1"], b[f"backbone.{n}.bn_branch2b2"] = o // 4 // div, o // 2 // div
    b["backbone.bn7"] = 4096 // div
    b["bn_fov"] = b["bn_fov2"] = 512 // div
    return b


@pytest.fixture(scope="module")
def meta_net():
    with torch.device("meta"):
        return build_model("deeplabv1-wr38", "wr38", 20)


def test_layout_keys_and_settings_match_upstream_definitions(meta_net):
    convs = {n: m for n, m in meta_net.named_modules() if isinstance(m, nn.Conv2d)}
    assert convs.keys() == _expected_convs().keys()
    for n, (cin, cout, k, s, p, d) in _expected_convs().items():
        m = convs[n]
        assert (m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation) == \
            (cin, cout, (k, k), (s, s), (p, p), (d, d)), n
        assert (m.bias is not None) == (n == "cls_conv"), n  # only the classifier has a bias
    bns = {n: m for n, m in meta_net.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert {n: m.num_features for n, m in bns.items()} == _expected_bns()
    for n, m in bns.items():
        assert (m.momentum, m.eps, m.affine, m.track_running_stats) == (0.0003, 1e-5, True, True), n
    drops = {n: (type(m), m.p) for n, m in meta_net.named_modules() if isinstance(m, (nn.Dropout, nn.Dropout2d))}
    assert drops == {"backbone.b6.dropout_2b1": (nn.Dropout2d, 0.3), "backbone.b6.dropout_2b2": (nn.Dropout2d, 0.3),
                     "backbone.b7.dropout_2b1": (nn.Dropout2d, 0.5), "backbone.b7.dropout_2b2": (nn.Dropout2d, 0.5),
                     "dropout1": (nn.Dropout, 0.5)}
    # state-dict keys: upstream's (identity map), BN buffers included
    keys = set(meta_net.state_dict())
    want = {f"{n}.{p}" for n in _expected_convs() for p in ("weight",)} | {"cls_conv.bias"}
    want |= {f"{n}.{p}" for n in _expected_bns()
             for p in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    assert keys == want
    assert meta_net.config == {"arch": "deeplabv1-wr38", "backbone": "wr38", "output_stride": 8, "num_classes": 20}


def test_build_model_refuses_other_backbones_and_strides():
    with pytest.raises(ValueError, match="backbone must be 'wr38'"):
        build_model("deeplabv1-wr38", "resnet101", 20)
    with pytest.raises(ValueError, match="output_stride must be 8.*got 16"):
        build_model("deeplabv1-wr38", "wr38", 20, 16)


def _bn(x, sd, k):
    return F.batch_norm(x, sd[k + ".running_mean"], sd[k + ".running_var"], sd[k + ".weight"], sd[k + ".bias"],
                        training=False, eps=1e-5)


def _reference(x, sd, div):
    """Eval-mode forward composed from the definitions (pre-activation blocks, branch 1 on the
    BN-ReLU'd input, bilinear align_corners=True up-sampling)."""
    conv = _expected_convs(div)

    def c(h, name):
        _, _, _, s, p, d = conv[name]
        return F.conv2d(h, sd[name + ".weight"], sd.get(name + ".bias"), stride=s, padding=p, dilation=d)

    h = c(x, "backbone.conv1a")
    for n, i, m, o, s, fd, d in RES:
        pre = f"backbone.{n}"
        a = F.relu(_bn(h, sd, pre + ".bn_branch2a"))
        short = c(a, pre + ".conv_branch1") if pre + ".conv_branch1" in conv else h
        h = short + c(F.relu(_bn(c(a, pre + ".conv_branch2a"), sd, pre + ".bn_branch2b1")), pre + ".conv_branch2b1")
    for n, *_ in BOT:
        pre = f"backbone.{n}"
        a = F.relu(_bn(h, sd, pre + ".bn_branch2a"))
        y = F.relu(_bn(c(a, pre + ".conv_branch2a"), sd, pre + ".bn_branch2b1"))
        y = F.relu(_bn(c(y, pre + ".conv_branch2b1"), sd, pre + ".bn_branch2b2"))
        h = c(a, pre + ".conv_branch1") + c(y, pre + ".conv_branch2b2")
    h = F.relu(_bn(h, sd, "backbone.bn7"))
    h = F.relu(_bn(c(h, "conv_fov"), sd, "bn_fov"))
    h = F.relu(_bn(c(h, "conv_fov2"), sd, "bn_fov2"))
    return F.interpolate(c(h, "cls_conv"), x.shape[-2:], mode="bilinear", align_corners=True)


def test_forward_float64_equals_plain_composition():
    torch.manual_seed(0)
    net = DeepLabV1WR38(20, width_div=16).double()
    for m in net.modules():  # non-trivial BN statistics and affine parameters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    net.eval()
    x = torch.randn(2, 3, 37, 45, dtype=torch.float64)
    out = net(x)
    assert out.shape == (2, 21, 37, 45)
    ref = _reference(x, {k: v for k, v in net.state_dict().items()}, 16)
    assert torch.allclose(out, ref, rtol=0, atol=1e-10)
    conv4, conv5, conv6 = net.backbone(x)  # resnet38d.py:181-190: b5's and b6's BN-ReLU'd inputs
    assert conv4.shape[1:] == (512 // 16, 5, 6) and conv5.shape[1] == 1024 // 16 and conv6.shape[1] == 4096 // 16


def test_head_init_is_kaiming_fan_out_and_bn_ones_zeros():
    torch.manual_seed(1)
    net = DeepLabV1WR38(20, width_div=4)
    for name in ("conv_fov", "conv_fov2", "cls_conv"):
        w = getattr(net, name).weight
        fan_out = w.shape[0] * w.shape[2] * w.shape[3]
        assert abs(w.std().item() / math.sqrt(2.0 / fan_out) - 1) < 0.05, name
    bound = 1 / math.sqrt(net.cls_conv.weight.shape[1])  # PyTorch's default bias init, kept upstream
    assert net.cls_conv.bias.abs().max() <= bound and net.cls_conv.bias.abs().max() > bound / 4
    for bn in (net.bn_fov, net.bn_fov2):
        assert (bn.weight == 1).all() and (bn.bias == 0).all()
    w = net.backbone.b2.conv_branch2a.weight  # PyTorch's default (kaiming_uniform a=sqrt(5)): bound 1/sqrt(fan_in)
    assert w.abs().max() <= 1 / math.sqrt(w[0].numel())


def test_train_override_and_train_py_state():
    net = DeepLabV1WR38(20, width_div=16)
    net.train()  # resnet38d.py:192-214: BN eval and frozen, conv1a frozen
    bns = [m for m in net.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(not m.training and not m.weight.requires_grad and not m.bias.requires_grad for m in bns)
    assert not net.backbone.conv1a.weight.requires_grad and net.bn_fov.training
    seam_train_mode(net)  # train.py never calls train(): all modules train, nothing frozen
    assert all(m.training for m in net.modules())
    assert all(p.requires_grad for p in net.parameters())


def test_param_groups_are_train_py_groups():
    net = DeepLabV1WR38(20, width_div=16)
    groups = param_groups(net, 1e-3, 5e-4)  # dispatches to seam_param_groups
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("backbone_weight", 1e-3, 5e-4), ("head_weight", 1e-2, 5e-4), ("head_bias", 2e-2, 0.0)]
    ids = [{id(p) for p in g["params"]} for g in groups]
    convs = [m for m in net.backbone.modules() if isinstance(m, nn.Conv2d)]
    assert ids[0] == {id(m.weight) for m in convs}  # conv1a included: train.py never froze it
    assert ids[1] == {id(net.conv_fov.weight), id(net.conv_fov2.weight), id(net.cls_conv.weight)}
    assert ids[2] == {id(net.cls_conv.bias)}
    bn_params = {id(p) for m in net.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    assert not bn_params & set().union(*ids)  # BN weights and biases are never optimised
    with pytest.raises(TypeError, match="deeplabv1-wr38"):
        seam_param_groups(nn.Conv2d(1, 1, 1), 1e-3, 0)


def test_poly_lr_uses_max_itr_plus_one():
    # train.py:139 `now_lr = lr_init * (1 - itr/(max_itr+1)) ** power`
    assert seam_poly_lr(1e-3, 0, 20000) == 1e-3
    assert seam_poly_lr(1e-3, 10000, 20000) == pytest.approx(1e-3 * (10001 / 20001) ** 0.9, rel=1e-12)
    assert seam_poly_lr(1e-3, 19999, 20000) == pytest.approx(1e-3 * (2 / 20001) ** 0.9, rel=1e-12)


def test_loss_is_mean_ce_over_labelled_pixels():
    torch.manual_seed(2)
    logits = torch.randn(2, 21, 5, 6, dtype=torch.float64)
    labels = torch.randint(0, 21, (2, 5, 6))
    labels[0, :2] = 255
    logp = logits.log_softmax(1)
    keep = labels != 255
    want = -logp.permute(0, 2, 3, 1)[keep].gather(1, labels[keep][:, None]).mean()
    assert torch.allclose(seam_loss(logits, labels), want)


def test_multiscale_averages_logits_then_softmax_align_corners():
    torch.manual_seed(3)
    net = nn.Conv2d(3, 4, 1).double().eval()
    img = torch.randn(1, 3, 9, 11, dtype=torch.float64)
    scaled = [F.interpolate(img, (5, 6), mode="bilinear"), img]
    got = seam_multiscale_logits(net, scaled, (9, 11), flip=True)
    maps = []
    for x in scaled:
        maps.append(F.interpolate(net(x), (9, 11), mode="bilinear", align_corners=True))
        maps.append(F.interpolate(net(x.flip(3)), (9, 11), mode="bilinear", align_corners=True).flip(3))
    want = torch.softmax(sum(maps) / 4, 1)[0]
    assert torch.allclose(got, want, atol=1e-12)
    assert not torch.allclose(got, torch.stack([torch.softmax(m, 1)[0] for m in maps]).mean(0), atol=1e-6)


def test_crf_image_truncates_the_denormalised_image():
    rgb = np.arange(3 * 4 * 5 * 7, dtype=np.int64).reshape(4, 5 * 7, 3) % 256
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    x = ((rgb.astype(np.float32) / np.float32(255) - mean) / std).transpose(2, 0, 1)
    got = seam_crf_image(torch.from_numpy(x))
    want = np.clip((x.transpose(1, 2, 0) * std + mean) * np.float32(255), 0, 255).astype(np.uint8)
    assert (got == want).all() and (got != rgb).any() and (got <= rgb).all()


# --- weights -----------------------------------------------------------------------------------

def _mx_name(key):
    """The MXNet file's name of a backbone key (the inverse of resnet38d.py:216-264's renaming)."""
    bn = {"bias": "beta", "weight": "gamma", "running_mean": "moving_mean", "running_var": "moving_var"}
    if key == "conv1a.weight":
        return "conv1a_weight"
    layer, _, p = key.rpartition(".")
    if layer == "bn7":
        return f"bn7_{bn[p]}"
    block, kind = layer.split(".")
    stage, _, k = block[1:].partition("_")
    unit = f"{stage}b{k}" if k else f"{stage}a"
    typ, branch = kind.split("_", 1)
    return f"res{unit}_{branch}_weight" if typ == "conv" else f"bn{unit}_{branch}_{bn[p]}"


def _write_params(path, arrays, legacy=False):
    with open(path, "wb") as f:
        f.write(struct.pack("<QQQ", 0x112, 0, len(arrays)))
        for a in arrays.values():
            a = np.ascontiguousarray(a, np.float32)
            if legacy:
                f.write(struct.pack(f"<I{a.ndim}I", a.ndim, *a.shape))
            else:
                f.write(struct.pack(f"<Ii I{a.ndim}q", 0xF993FAC9, 0, a.ndim, *a.shape))
            f.write(struct.pack("<iii", 1, 0, 0) + a.tobytes())
        f.write(struct.pack("<Q", len(arrays)))
        for n in arrays:
            f.write(struct.pack("<Q", len(n)) + n.encode())


def test_wr38_key_rules():
    assert wr38_key("res4b3_branch2b1_weight") == "b4_3.conv_branch2b1.weight"
    assert wr38_key("arg:res2a_branch1_weight") == "b2.conv_branch1.weight"
    assert wr38_key("aux:bn5b2_branch2a_moving_var") == "b5_2.bn_branch2a.running_var"
    assert wr38_key("bn7_beta") == "bn7.bias"
    assert wr38_key("linear1000_weight") is None
    for key in WideResNet38(16).state_dict():
        if not key.endswith("num_batches_tracked"):
            assert wr38_key(_mx_name(key)) == key


@pytest.mark.parametrize("legacy", [False, True])
def test_load_mxnet_params_file(tmp_path, legacy):
    torch.manual_seed(4)
    src = WideResNet38(16)
    state = {k: v.float().numpy() + np.float32(0.5) for k, v in src.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    arrays = {("aux:" if "running" in k else "arg:") + _mx_name(k): v for k, v in state.items()}
    arrays["arg:linear1000_weight"] = np.zeros((1000, 4), np.float32)
    path = tmp_path / "ilsvrc-cls_rna-a1_cls1000_ep-0001.params"
    _write_params(path, arrays, legacy)
    net = DeepLabV1WR38(20, width_div=16).double()
    load_wr38_weights(net, path)
    got = net.backbone.state_dict()
    for k, v in state.items():
        assert torch.equal(got[k], torch.from_numpy(v).double()), k
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "converted.pth")
    net2 = DeepLabV1WR38(20, width_div=16)
    load_backbone_weights(net2, tmp_path / "converted.pth")  # dispatches to load_wr38_weights
    assert torch.equal(net2.backbone.b7.conv_branch2b2.weight, torch.from_numpy(state["b7.conv_branch2b2.weight"]))


def test_wrong_weight_files_are_refused_in_one_line(tmp_path):
    net = DeepLabV1WR38(20, width_div=16)
    before = net.backbone.conv1a.weight.clone()
    state = {k: v for k, v in WideResNet38(8).state_dict().items()}
    torch.save(state, tmp_path / "wide.pth")
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, tmp_path / "torchvision.pth")
    (tmp_path / "junk.params").write_bytes(b"\x12\x01" + b"\0" * 6 + b"\0" * 8 + struct.pack("<Q", 3) + b"\1\2")
    (tmp_path / "text.pth").write_text("not weights")
    cases = {"wide.pth": "of another shape", "torchvision.pth": "missing", "junk.params": "ends early",
             "text.pth": "neither an MXNet .params file nor a readable torch file"}
    for name, msg in cases.items():
        with pytest.raises(ValueError, match=msg) as e:
            load_wr38_weights(net, tmp_path / name)
        assert "\n" not in str(e.value) and name in str(e.value)
    with pytest.raises(FileNotFoundError, match="ilsvrc-cls_rna-a1_cls1000_ep-0001.params"):
        load_wr38_weights(net, tmp_path / "absent.params")
    assert torch.equal(net.backbone.conv1a.weight, before)


def test_memory_trace_runs_on_the_meta_network():
    from mars_plugin.networks.memory import inference_memory_bytes, train_memory_bytes
    cfg = {"arch": "deeplabv1-wr38", "backbone": "wr38", "output_stride": 8, "num_classes": 20}
    assert 0 < inference_memory_bytes(cfg, 64, 64) < train_memory_bytes(cfg, 64, 2)


def test_same_seed_same_weights_as_upstream_construction_order():
    # upstream builds backbone, conv_fov, bn_fov, conv_fov2, bn_fov2, dropout1, cls_conv, then
    # re-initialises the head convs in modules() order: the draws of one seed follow that order
    torch.manual_seed(5)
    a = DeepLabV1WR38(20, width_div=16)
    torch.manual_seed(5)
    WideResNet38(16)
    conv_fov = nn.Conv2d(256, 32, 3, padding=12, dilation=12, bias=False)
    conv_fov2 = nn.Conv2d(32, 32, 1, bias=False)
    cls = nn.Conv2d(32, 21, 1)
    for m in (conv_fov, conv_fov2, cls):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    assert torch.equal(a.cls_conv.bias, cls.bias) and torch.equal(a.conv_fov2.weight, conv_fov2.weight)
