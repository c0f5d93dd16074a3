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
