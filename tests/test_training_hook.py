"""MARSTrainingHook equals complement_labels + WCELoss computed by hand."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin import WCELoss, complement_labels
from mars_plugin.adapters.training_hook import MARSTrainingHook, default_output_transform


class Net(nn.Module):
    def __init__(self, c=4, stride=1, wrap=None):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1, stride=stride)
        self.bn = nn.BatchNorm2d(c)
        self.wrap = wrap

    def forward(self, x):
        y = self.bn(self.conv(x))
        if self.wrap == "list":
            return [y, y * 0.5]
        if self.wrap == "dict":
            return {"out": y, "aux": y}
        return y


def _batch(seed, H=12, W=10, C=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, H, W, generator=g)
    y = torch.randint(0, C + 1, (2, H, W), generator=g)
    y[torch.rand(2, H, W, generator=g) < 0.3] = 254
    y[torch.rand(2, H, W, generator=g) < 0.05] = 255
    classes = [[1, 2], [3]]
    return x, y, classes


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("wrap", [None, "dict"])
def test_hook_equals_complement_plus_wce_by_hand(seed, wrap):
    torch.manual_seed(seed)
    net = Net(wrap=wrap)
    hook = MARSTrainingHook(net, momentum=0.9)
    x, y, classes = _batch(seed)
    out = net(x)
    loss = hook(x, out, y, classes)
    logits = default_output_transform(out)
    with torch.no_grad():
        t = default_output_transform(hook.teacher.module(x))
    y_ref = torch.where(y == 254, torch.full_like(y, -1), y)
    y_co, w = complement_labels(y_ref, t.softmax(1), classes)
    ref = WCELoss()(logits, y_co, w)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert net.conv.weight.grad is not None


@pytest.mark.parametrize("seed", [0, 1])
def test_reduction_sum_is_the_wce_sum_over_the_labelled_pixels(seed):
    # mars train divides this sum by the global pixel count of all DDP ranks.
    torch.manual_seed(seed)
    net = Net()
    hook = MARSTrainingHook(net, momentum=0.9, reduction="sum")
    x, y, classes = _batch(seed)
    out = net(x)
    loss = hook(x, out, y, classes)
    with torch.no_grad():
        t = hook.teacher.module(x)
    y_ref = torch.where(y == 254, torch.full_like(y, -1), y)
    y_co, w = complement_labels(y_ref, t.softmax(1), classes)
    torch.testing.assert_close(loss, WCELoss(reduction="sum")(out, y_co, w))
    with pytest.raises(ValueError, match="reduction"):
        MARSTrainingHook(net, reduction="total")


def test_labels_resized_to_logits_like_deeplab_pytorch():
    torch.manual_seed(0)
    net = Net(stride=2)
    hook = MARSTrainingHook(net)
    x, y, classes = _batch(3, H=12, W=10)
    logits = net(x)
    assert logits.shape[-2:] == (6, 5)
    loss = hook(x, logits, y, classes)
    # Reference: nearest (pixel-centre) label resize to the logits grid, then the two calls.
    iy = ((2 * torch.arange(6) + 1) * 12) // 12
    ix = ((2 * torch.arange(5) + 1) * 10) // 10
    y_small = y[:, iy[:, None], ix[None, :]]
    y_small = torch.where(y_small == 254, torch.full_like(y_small, -1), y_small)
    with torch.no_grad():
        t = hook.teacher.module(x)
    y_co, w = complement_labels(y_small, t.softmax(1), classes)
    torch.testing.assert_close(loss, WCELoss()(logits, y_co, w))


def test_match_logits_upsamples_logits_to_labels():
    torch.manual_seed(0)
    net = Net(stride=2)
    hook = MARSTrainingHook(net, match="logits")
    x, y, classes = _batch(4)
    logits = net(x)
    loss = hook(x, logits, y, classes)
    up = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
    with torch.no_grad():
        t = F.interpolate(hook.teacher.module(x), size=y.shape[-2:], mode="bilinear", align_corners=False)
    y_ref = torch.where(y == 254, torch.full_like(y, -1), y)
    y_co, w = complement_labels(y_ref, t.softmax(1), classes)
    torch.testing.assert_close(loss, WCELoss()(up, y_co, w))


def test_update_moves_the_teacher_by_the_ema_formula():
    torch.manual_seed(0)
    net = Net()
    hook = MARSTrainingHook(net, momentum=0.8)
    before = hook.teacher.module.conv.weight.clone()
    with torch.no_grad():
        net.conv.weight.add_(1.0)
    hook.update(net)
    torch.testing.assert_close(hook.teacher.module.conv.weight, 0.8 * before + 0.2 * net.conv.weight)


def test_bad_arguments():
    with pytest.raises(ValueError, match="match"):
        MARSTrainingHook(Net(), match="both")
    with pytest.raises(ValueError, match="refine"):
        MARSTrainingHook(Net(), refine="threshold")
    with pytest.raises(TypeError, match="output_transform"):
        default_output_transform({"logits": torch.zeros(1)})
    with pytest.raises(ValueError, match="crf_backend"):
        MARSTrainingHook(Net(), refine="crf", crf_backend="cuda")
    with pytest.raises(ValueError, match="crf_params"):
        MARSTrainingHook(Net(), refine="crf", crf_params="potts")


def test_multi_scale_list_sums_the_loss_of_every_scale():
    torch.manual_seed(0)
    net = Net()
    hook = MARSTrainingHook(net, momentum=0.9)
    x, y, classes = _batch(7)
    full = net(x)
    half = F.interpolate(full, scale_factor=0.5, mode="bilinear", align_corners=False)
    loss = hook(x, [full, half], y, classes)
    single = MARSTrainingHook(net, momentum=0.9)
    single.teacher = hook.teacher
    torch.testing.assert_close(loss, single(x, full, y, classes) + single(x, half, y, classes))
    off = MARSTrainingHook(net, multi_scale=False)
    off.teacher = hook.teacher
    torch.testing.assert_close(off(x, [full, half], y, classes), single(x, full, y, classes))


@pytest.mark.parametrize("seed, refine, prm", [
    (0, "local_crf", {"window": 5, "scale": 2}),
    (1, "local_crf", {"window": 5, "scale": 2}),
    (3, "crf", "mars"),
    (3, "crf", {"iterations": 3}),
])
def test_refined_teacher_equals_complement_by_hand(seed, refine, prm):
    torch.manual_seed(seed)
    net = Net()
    hook = MARSTrainingHook(net, momentum=0.9, refine=refine, crf_params=prm)
    x, y, classes = _batch(seed)
    g = torch.Generator().manual_seed(seed)
    rgb = torch.randint(0, 256, (2, 12, 10, 3), generator=g, dtype=torch.uint8)
    loss = hook(x, net(x), y, classes, images_rgb=rgb)
    with torch.no_grad():
        t = hook.teacher.module(x)
    y_ref = torch.where(y == 254, torch.full_like(y, -1), y)
    y_co, w = complement_labels(y_ref, t.softmax(1), classes, refine=refine, image=rgb, crf_params=prm)
    torch.testing.assert_close(loss, WCELoss()(net(x), y_co, w))
    plain = MARSTrainingHook(net, momentum=0.9)(x, net(x), y, classes)
    assert not torch.equal(loss, plain)  # the refinement changed some teacher labels


# ------------------------------------------------------------------ images_rgb: what the CRF sees
def _no_teacher(hook):
    """Make the teacher fail loudly if it runs: a bad images_rgb must be refused before it."""
    def boom(*a, **k):
        raise AssertionError("the teacher ran before images_rgb was checked")
    hook.teacher.forward = boom
    return hook


def _rgb(B=2, H=12, W=10, seed=0):
    return torch.randint(0, 256, (B, H, W, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


BAD_RGB = {
    # name: (hook kwargs, net stride, multi-scale output, images_rgb maker, error type, words the message must hold)
    "missing": ({}, 1, False, lambda x, rgb: None, ValueError, ["images_rgb=", "(2, 12, 10, 3) uint8"]),
    "labels size, match=labels, stride 2": ({}, 2, False, lambda x, rgb: rgb, ValueError,
                                            ["match='logits'", "(6, 5)", "(12, 10)"]),
    "multi-scale, match=labels": ({}, 1, True, lambda x, rgb: rgb, ValueError, ["match='logits'", "(6, 5)"]),
    "wrong size": ({}, 1, False, lambda x, rgb: rgb[:, :8], ValueError, ["(2, 12, 10, 3)", "(2, 8, 10, 3)"]),
    "wrong layout": ({}, 1, False, lambda x, rgb: rgb.permute(0, 1, 3, 2), ValueError,
                     ["(2, 12, 10, 3)", "(2, 12, 3, 10)"]),
    "wrong batch": ({}, 1, False, lambda x, rgb: rgb[:1], ValueError, ["B=2", "(1, 12, 10, 3)"]),
    "one image for a batch": ({}, 1, False, lambda x, rgb: rgb[0], ValueError, ["B=2", "(12, 10, 3)"]),
    "normalised input": ({}, 1, False, lambda x, rgb: x, ValueError, ["normalis", "* std + mean", "mean_bgr"]),
    "float 0..255": ({}, 1, False, lambda x, rgb: rgb.float(), ValueError, [".round().byte()"]),
    "int64": ({}, 1, False, lambda x, rgb: rgb.long(), TypeError, ["uint8", "int64"]),
}


@pytest.mark.parametrize("refine", ["crf", "local_crf"])
@pytest.mark.parametrize("case", sorted(BAD_RGB))
def test_bad_images_rgb_is_refused_before_the_teacher_with_what_to_pass(case, refine):
    kw, stride, multi, make, err, words = BAD_RGB[case]
    torch.manual_seed(0)
    net = Net(stride=stride)
    hook = _no_teacher(MARSTrainingHook(net, refine=refine, **kw))
    x, y, classes = _batch(5)
    logits = net(x)
    if multi:
        logits = [logits, F.interpolate(logits, scale_factor=0.5, mode="bilinear", align_corners=False)]
    with pytest.raises(err) as e:
        hook(x, logits, y, classes, images_rgb=make(x, _rgb()))
    msg = str(e.value)
    assert "images_rgb" in msg or "match=" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_images_rgb_layouts_and_ranges_that_are_accepted_give_the_same_loss():
    torch.manual_seed(0)
    net = Net()
    hook = MARSTrainingHook(net, refine="crf")
    x, y, classes = _batch(6)
    rgb = _rgb(seed=6)
    ref = hook(x, net(x), y, classes, images_rgb=rgb)
    for other in (rgb.permute(0, 3, 1, 2), rgb.float() / 255, rgb.numpy()):
        torch.testing.assert_close(hook(x, net(x), y, classes, images_rgb=other), ref)


def test_match_logits_refines_once_at_the_labels_size_for_every_scale(monkeypatch):
    """deeplab-pytorch's case: stride-2 logits at three sizes, the CRF at the labels' size, once."""
    import mars_plugin.method.complement as complement_module

    calls = []
    real = complement_module.dense_crf

    def counting(p, image, *a, **k):
        calls.append(tuple(image.shape))
        return real(p, image, *a, **k)

    monkeypatch.setattr(complement_module, "dense_crf", counting)
    torch.manual_seed(0)
    net = Net(stride=2)
    hook = MARSTrainingHook(net, refine="crf", match="logits", momentum=0.9)
    x, y, classes = _batch(8)
    rgb = _rgb(seed=8)
    full = net(x)
    half = F.interpolate(full, scale_factor=0.5, mode="bilinear", align_corners=False)
    loss = hook(x, [half, full, full], y, classes, images_rgb=rgb)  # the smallest first: no detour through it
    assert calls == [(2, 12, 10, 3)]
    with torch.no_grad():  # the teacher straight to the labels' size, whatever the scale
        t = F.interpolate(hook.teacher.module(x), size=(12, 10), mode="bilinear", align_corners=False)
    y_ref = torch.where(y == 254, torch.full_like(y, -1), y)
    y_co, w = complement_labels(y_ref, t.softmax(1), classes, refine="crf", image=rgb)
    up = [F.interpolate(s, size=(12, 10), mode="bilinear", align_corners=False) for s in (half, full, full)]
    torch.testing.assert_close(loss, sum(WCELoss()(u, y_co, w) for u in up))


# ------------------------------------------------------------------ state_dict: the teacher in checkpoints
def _train(hook, net, opt, steps, seed=0):
    for k in range(steps):
        x, y, classes = _batch(100 + k + seed)
        loss = hook(x, net(x), y, classes, images_rgb=_rgb(seed=k) if hook.refine else None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.update(net)


def test_state_dict_round_trip_resumes_the_same_teacher(tmp_path):
    """Saved mid-way with the student and the optimizer, loaded into fresh objects: the same
    teacher, bit for bit, as one uninterrupted run (no CRF here, for speed: the recipes' tests
    resume with it)."""
    def fresh():
        torch.manual_seed(0)
        net = Net()
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), None

    net, opt, _ = fresh()
    hook = MARSTrainingHook(net, momentum=0.7)
    _train(hook, net, opt, 4)
    ref = {k: v.clone() for k, v in hook.teacher.module.state_dict().items()}

    net, opt, _ = fresh()
    hook = MARSTrainingHook(net, momentum=0.7)
    _train(hook, net, opt, 2)
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()}, tmp_path / "c.pth")
    torch.manual_seed(1)  # a different student init: everything must come from the file
    net2 = Net()
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    hook2 = MARSTrainingHook(net2, momentum=0.5)
    state = torch.load(tmp_path / "c.pth", weights_only=True)
    net2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    hook2.load_state_dict(state["hook"])
    assert hook2.teacher.momentum == 0.7 and not hook2.teacher.training
    assert all(not p.requires_grad for p in hook2.teacher.parameters())
    _train(hook2, net2, opt2, 2, seed=2)
    got = hook2.teacher.module.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_state_dict_layout():
    net = Net()
    hook = MARSTrainingHook(net, momentum=0.9)
    s = hook.state_dict()
    assert set(s) == {"format", "teacher", "momentum"} and s["momentum"] == 0.9
    assert s["teacher"].keys() == net.state_dict().keys()


@pytest.mark.parametrize("bad, err, words", [
    (lambda s: [1, 2], ValueError, ["state_dict()", "list"]),
    (lambda s: {"model": s["teacher"]}, ValueError, ["'teacher'", "model"]),
    (lambda s: dict(s, format="mars-train/1"), ValueError, ["mars-train/1", "mars-training-hook/1"]),
    (lambda s: dict(s, teacher={k: v for k, v in s["teacher"].items() if k != "bn.running_var"}), ValueError,
     ["missing keys ['bn.running_var']"]),
    (lambda s: dict(s, teacher=dict(s["teacher"], extra=torch.zeros(1))), ValueError, ["unexpected keys ['extra']"]),
    (lambda s: dict(s, teacher={"module." + k: v for k, v in s["teacher"].items()}), ValueError, ["'module.' prefix"]),
    # late keys: a loader that copied as it checked would have changed the keys before them
    (lambda s: dict(s, teacher=dict(s["teacher"], **{"bn.running_mean": torch.zeros(3)})), ValueError,
     ["'bn.running_mean'", "(3,)", "(4,)"]),
    (lambda s: dict(s, teacher=dict(s["teacher"], **{"bn.running_var": [1.0] * 4})), TypeError,
     ["'bn.running_var'", "list"]),
    (lambda s: dict(s, momentum=1.5), ValueError, ["momentum", "1.5"]),
])
def test_load_state_dict_refuses_a_mismatch_and_loads_nothing(bad, err, words):
    torch.manual_seed(0)
    hook = MARSTrainingHook(Net(), momentum=0.9)
    torch.manual_seed(1)
    other = MARSTrainingHook(Net(), momentum=0.9)  # other weights: a partial load would show
    state = bad({"format": "mars-training-hook/1", "teacher": {k: v.clone() for k, v in
                                                                other.teacher.module.state_dict().items()},
                 "momentum": 0.9})
    before = {k: v.clone() for k, v in hook.teacher.module.state_dict().items()}
    with pytest.raises(err) as e:
        hook.load_state_dict(state)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    after = hook.teacher.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and hook.teacher.momentum == 0.9
