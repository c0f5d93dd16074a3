"""MARSTrainingHook(match="labels_nearest"): DHR's loss grid (the dhr recipe's loss_grid="logits").

DHR train.py:325: ``seg_loss_fn(logits, torch_utils.resize(pseudo_masks.float(), logits.shape[2:],
mode='nearest').long())``: the loss on the logits' grid, the labels (completed at the crop's
size) brought there by F.interpolate's nearest rule, source index floor(i * in / out). The
reference below is that reading by hand: the teacher upsampled to the labels, completed (and
refined on the crop's RGB) there, then both the labels and the weights picked by that index.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin import WCELoss, complement_labels
from mars_plugin.adapters import training_hook
from mars_plugin.adapters.training_hook import MARSTrainingHook, resize_nearest


class Net(nn.Module):  # logits at stride 2, as DeepLab's are below the crop's size
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, stride=2)

    def forward(self, x):
        return self.conv(x)


def _pick(t: torch.Tensor, size) -> torch.Tensor:
    # F.interpolate's nearest read plainly: output i takes input floor(i * in / out)
    iy = np.floor(np.arange(size[0]) * (t.shape[-2] / size[0])).astype(int)
    ix = np.floor(np.arange(size[1]) * (t.shape[-1] / size[1])).astype(int)
    return t[..., iy[:, None], ix[None, :]]


def _batch(seed, H=12, W=10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, H, W, generator=g)
    y = torch.randint(0, 4, (2, H, W), generator=g)
    y[torch.rand(2, H, W, generator=g) < 0.3] = 254
    y[torch.rand(2, H, W, generator=g) < 0.05] = 255
    rgb = torch.randint(0, 256, (2, H, W, 3), generator=g, dtype=torch.uint8)
    return x, y, [[1, 2], [3]], rgb


def test_resize_nearest_is_floor_of_i_times_in_over_out():
    t = torch.arange(2 * 13 * 11).reshape(2, 13, 11)
    for size in [(7, 6), (4, 3), (13, 11), (20, 17)]:
        assert torch.equal(resize_nearest(t, size), _pick(t, size)), size
    w = torch.rand(2, 13, 11)
    assert torch.equal(resize_nearest(w, (7, 6)), _pick(w, (7, 6)))


@pytest.mark.parametrize("refine", [None, "crf"])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_on_logits_grid_with_labels_completed_at_crop_size(refine, seed, monkeypatch):
    torch.manual_seed(seed)
    net = Net()
    hook = MARSTrainingHook(net, match="labels_nearest", refine=refine)
    x, y, classes, rgb = _batch(seed)
    seen = []
    real = training_hook.complement_labels

    def spy(y_, p, *a, **k):
        seen.append((tuple(y_.shape[-2:]), tuple(p.shape[-2:]), k.get("image")))
        return real(y_, p, *a, **k)

    monkeypatch.setattr(training_hook, "complement_labels", spy)
    logits = net(x)
    loss = hook(x, logits, y, classes, images_rgb=rgb if refine else None)
    with torch.no_grad():
        t = F.interpolate(hook.teacher.module(x), size=(12, 10), mode="bilinear", align_corners=False)
    y_co, w = complement_labels(torch.where(y == 254, torch.full_like(y, -1), y), t.softmax(1), classes,
                                refine=refine, image=rgb if refine else None)
    ref = WCELoss()(logits, _pick(y_co, (6, 5)), _pick(w, (6, 5)))
    torch.testing.assert_close(loss, ref)
    # the teacher ran at the crop's size, on the crop's RGB
    assert seen[0][:2] == ((12, 10), (12, 10))
    if refine:
        assert tuple(seen[0][2].shape) == (2, 12, 10, 3)
    loss.backward()
    assert net.conv.weight.grad is not None


def test_labels_nearest_differs_from_the_pixel_centre_rule_and_refuses_rgb_at_the_logits_size():
    torch.manual_seed(0)
    net = Net()
    x, y, classes, rgb = _batch(3)
    a = MARSTrainingHook(net, match="labels_nearest")(x, net(x), y, classes)
    b = MARSTrainingHook(net, match="labels")(x, net(x), y, classes)
    assert not torch.allclose(a, b)  # floor(i * 2) vs floor((i + 0.5) * 2): other pixels
    hook = MARSTrainingHook(net, match="labels_nearest", refine="crf")
    with pytest.raises(ValueError, match=r"\(2, 12, 10, 3\).*labels' size \(12, 10\)"):
        hook(x, net(x), y, classes, images_rgb=rgb[:, ::2, ::2])
    with pytest.raises(ValueError, match="match must be one of 'labels', 'logits', 'labels_nearest', got 'both'"):
        MARSTrainingHook(net, match="both")
