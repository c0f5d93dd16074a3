"""deeplab-pytorch's training pieces (mars_plugin.networks.deeplab_pytorch) against a plain
reading of kazuto1011/deeplab-pytorch @ 4219467: libs/datasets/base.py's ``_augmentation`` and
``__getitem__``, main.py's ``get_params``, ``resize_labels`` and loss, libs/utils/
lr_scheduler.py's ``PolynomialLR``, configs/voc12.yaml's numbers. The expectations are computed
here from those definitions (PIL for the label, a float64 bilinear with cv2's half-pixel rule
for the image); images of 30-60 pixels."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from mars_plugin.networks.deeplab import build_model
from mars_plugin.networks.deeplab_pytorch import (MEAN_BGR, DeeplabAugmentation, augment, augment_bgr, msc_loss,
                                                  normalize, param_groups, poly_lr, resize_labels_nearest)
from mars_plugin.networks.deeplabv2 import MSC

VOC12_MEAN = {"R": 122.675, "G": 116.669, "B": 104.008}  # configs/voc12.yaml:21-24
SCALES = [0.5, 0.75, 1.0, 1.25, 1.5]  # configs/voc12.yaml:11


def bilinear_half_pixel(img, h, w):
    """cv2.INTER_LINEAR in float64: source (d + 0.5) * in / out - 0.5, clamped to the edge pixels."""
    def axis(n_in, n_out):
        f = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        f = np.clip(f, 0, n_in - 1)
        i0 = np.floor(f).astype(int)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, f - i0
    y0, y1, fy = axis(img.shape[0], h)
    x0, x1, fx = axis(img.shape[1], w)
    img = img.astype(np.float64)
    rows = img[:, x0] * (1 - fx)[None, :, None] + img[:, x1] * fx[None, :, None]
    return rows[y0] * (1 - fy)[:, None, None] + rows[y1] * fy[:, None, None]


def plain_augmentation(rgb, label, seed, crop):
    """base.py:60-113 read plainly, with Python's random seeded as upstream draws."""
    r = random.Random(seed)
    mean_bgr = np.array([VOC12_MEAN["B"], VOC12_MEAN["G"], VOC12_MEAN["R"]])
    image = rgb[:, :, ::-1].astype(np.float64)
    h, w = label.shape
    s = r.choice(SCALES)
    h, w = int(h * s), int(w * s)
    image = bilinear_half_pixel(image, h, w)
    lab = np.asarray(Image.fromarray(label.astype(np.int32)).resize((w, h), resample=Image.NEAREST), dtype=np.int64)
    ph, pw = max(crop - h, 0), max(crop - w, 0)
    image = np.concatenate([image, np.broadcast_to(mean_bgr, (ph, w, 3))], 0)
    image = np.concatenate([image, np.broadcast_to(mean_bgr, (h + ph, pw, 3))], 1)
    lab = np.pad(lab, ((0, ph), (0, pw)), constant_values=255)
    top = r.randint(0, lab.shape[0] - crop)
    left = r.randint(0, lab.shape[1] - crop)
    image, lab = image[top:top + crop, left:left + crop], lab[top:top + crop, left:left + crop]
    if r.random() < 0.5:
        image, lab = image[:, ::-1], lab[:, ::-1]
    return (image - mean_bgr).transpose(2, 0, 1), lab, (s, top, left)


@pytest.mark.parametrize("seed", range(12))
def test_augmentation_is_base_py_for_the_same_draws(seed):
    rng = np.random.default_rng(seed)
    H, W = int(rng.integers(30, 60)), int(rng.integers(30, 60))
    rgb = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    label = rng.integers(0, 21, (H, W)).astype(np.uint8)
    label[rng.random((H, W)) < 0.05] = 255
    crop = 41
    params = DeeplabAugmentation(crop=crop)
    want_img, want_lab, _ = plain_augmentation(rgb, label, seed, crop)
    img, lab = augment_bgr(rgb, label, params, random.Random(seed))
    assert img.dtype == np.float32 and img.shape == (3, crop, crop) and lab.dtype == np.int64
    np.testing.assert_array_equal(lab, want_lab)
    np.testing.assert_allclose(img, want_img, rtol=0, atol=2e-4)
    # the uint8 RGB twin: the same crop, rounded to bytes
    rgb_c, lab_c = augment(rgb, label, params, random.Random(seed))
    assert rgb_c.dtype == np.uint8 and rgb_c.shape == (crop, crop, 3) and lab_c.dtype == np.uint8
    np.testing.assert_array_equal(lab_c, want_lab)
    back = normalize(rgb_c[None])[0].numpy()
    assert np.abs(back - want_img).max() <= 0.5 + 1e-3


def test_padding_is_bottom_right_mean_colour_and_ignore():
    rgb = np.full((20, 24, 3), 7, np.uint8)
    label = np.ones((20, 24), np.uint8)
    params = DeeplabAugmentation(crop=40, scales=(1.0,), flip=False)
    img, lab = augment_bgr(rgb, label, params, random.Random(0))
    assert (lab[:20, :24] == 1).all() and (lab[20:] == 255).all() and (lab[:, 24:] == 255).all()
    # the mean colour as the float32 image holds it (cv2 pads a float32 image), minus the float64 mean
    pad = np.array([VOC12_MEAN[c] for c in "BGR"])
    pad = (pad.astype(np.float32).astype(np.float64) - pad).astype(np.float32)[:, None, None]
    assert np.all(img[:, 20:] == pad) and np.all(img[:, :, 24:] == pad) and np.abs(pad).max() < 1e-5
    np.testing.assert_allclose(img[:, 0, 0], [7 - VOC12_MEAN["B"], 7 - VOC12_MEAN["G"], 7 - VOC12_MEAN["R"]],
                               atol=1e-4)


def test_numpy_generator_draws_in_upstreams_order():
    """A numpy Generator (how mars train seeds its samples) draws the scale, the top, the left
    and the flip in that order; the result is a pure function of its state."""
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (50, 30, 3), dtype=np.uint8)
    label = rng.integers(0, 5, (50, 30)).astype(np.uint8)
    params = DeeplabAugmentation(crop=33)
    a = augment(rgb, label, params, np.random.default_rng(5))
    b = augment(rgb, label, params, np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    g = np.random.default_rng(5)
    s = SCALES[int(g.integers(5))]
    h, w = int(50 * s), int(30 * s)
    top = int(g.integers(0, max(h, 33) - 33 + 1))
    left = int(g.integers(0, max(w, 33) - 33 + 1))
    flip = g.random() < 0.5
    lab = np.asarray(Image.fromarray(label.astype(np.int32)).resize((w, h), resample=Image.NEAREST))
    lab = np.pad(lab, ((0, max(33 - h, 0)), (0, max(33 - w, 0))), constant_values=255)[top:top + 33, left:left + 33]
    np.testing.assert_array_equal(a[1], lab[:, ::-1] if flip else lab)


def test_bad_augmentation_arguments_are_named():
    rgb, lab = np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8), np.uint8)
    with pytest.raises(ValueError, match="crop must be an integer >= 8, got 4"):
        DeeplabAugmentation(crop=4)
    with pytest.raises(ValueError, match=r"rgb must be a \(H, W, 3\) uint8 array"):
        augment(rgb.astype(np.float32), lab, DeeplabAugmentation(), random.Random(0))
    with pytest.raises(ValueError, match="label must be an .* of the image's size"):
        augment(rgb, lab[:4], DeeplabAugmentation(), random.Random(0))
    with pytest.raises(TypeError, match="rng must be a random.Random or a numpy Generator"):
        augment(rgb, lab, DeeplabAugmentation(), 0)


def test_normalize_is_bgr_minus_the_caffe_mean_without_std():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (2, 5, 6, 3), dtype=np.uint8)
    want = np.empty((2, 3, 5, 6), np.float64)
    for c, name in enumerate("BGR"):  # channel 0 is blue (cv2.imread), minus its mean, no division
        want[:, c] = images[..., 2 - c].astype(np.float64) - VOC12_MEAN[name]
    got = normalize(torch.from_numpy(images))
    assert got.dtype == torch.float32 and got.shape == (2, 3, 5, 6)
    np.testing.assert_allclose(got.numpy(), want.astype(np.float32), rtol=0, atol=0)
    assert MEAN_BGR == (VOC12_MEAN["B"], VOC12_MEAN["G"], VOC12_MEAN["R"])
    with pytest.raises(ValueError, match=r"images must be uint8 RGB \(B, H, W, 3\)"):
        normalize(torch.zeros(2, 3, 5, 5))


# --- optimizer and schedule ---------------------------------------------------------------------


def test_param_groups_are_main_py_get_params():
    with torch.device("meta"):
        model = MSC(build_model("deeplabv2", "resnet50", 20))
    groups = param_groups(model, 2.5e-4, 5e-4)
    assert [g["name"] for g in groups] == ["1x", "10x", "20x"]
    assert [g["lr"] for g in groups] == [2.5e-4, 10 * 2.5e-4, 20 * 2.5e-4]
    assert [g["weight_decay"] for g in groups] == [5e-4, 5e-4, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    got = [[names[id(p)] for p in g["params"]] for g in groups]
    convs = [n for n, _ in model.named_parameters() if n.endswith("conv.weight")]
    assert got[0] == convs  # every backbone conv, in module order; they have no bias
    assert got[1] == [f"base.aspp.c{i}.weight" for i in range(4)]
    assert got[2] == [f"base.aspp.c{i}.bias" for i in range(4)]
    in_groups = {n for g in got for n in g}
    assert {n for n in names.values() if ".bn." in n}.isdisjoint(in_groups)  # BatchNorm is never stepped
    assert in_groups | {n for n in names.values() if ".bn." in n} == set(names.values())
    with pytest.raises(TypeError, match="model must be a deeplabv2 network"):
        param_groups(nn.Conv2d(3, 3, 1), 0.1, 0.0)


@pytest.mark.parametrize("iter_max", [20000, 95, 30])
def test_poly_lr_changes_every_10_iterations_as_polynomiallr(iter_max):
    """lr_scheduler.py get_lr, driven as main.py drives it: step(epoch=iteration) after the
    optimizer step of each iteration 1..ITER_MAX; the lr changes only at multiples of 10."""
    base, lr, used = 2.5e-4, 2.5e-4, []
    for it in range(1, iter_max + 6):
        used.append(lr)
        if it != 0 and it % 10 == 0 and it <= iter_max:
            lr = base * (1 - float(it) / iter_max) ** 0.9
    got = [poly_lr(base, it, iter_max) for it in range(1, iter_max + 6)]
    assert got == used
    assert got[:10] == [base] * 10 and got[10] == base * (1 - 10 / iter_max) ** 0.9 and got[10] == got[19]
    with pytest.raises(ValueError, match="iteration must be an integer >= 1"):
        poly_lr(base, 0, iter_max)


# --- loss --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hw", [(41, 41), (21, 21), (31, 31), (7, 5), (16, 12), (24, 40)])
def test_labels_are_resized_by_pil_nearest(hw):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 256, (2, 32, 48))
    want = [np.asarray(Image.fromarray(l.astype(np.float32)).resize((hw[1], hw[0]), resample=Image.NEAREST))
            for l in labels]
    got = resize_labels_nearest(torch.from_numpy(labels), hw)
    assert got.dtype == torch.long
    np.testing.assert_array_equal(got.numpy(), np.stack(want).astype(np.int64))


def test_msc_loss_is_the_sum_over_outputs_over_iter_size():
    torch.manual_seed(0)
    outs = [torch.randn(2, 4, s, s) for s in (41, 21, 31, 41)]
    labels = torch.randint(0, 4, (2, 321, 321))
    labels[:, :50] = 255
    want = 0
    for t in outs:
        y = torch.stack([torch.from_numpy(np.array(Image.fromarray(l.float().numpy()).resize(
            t.shape[-2:][::-1], resample=Image.NEAREST))).long() for l in labels])
        want = want + F.cross_entropy(t, y, ignore_index=255)
    torch.testing.assert_close(msc_loss(outs, labels, iter_size=2), want / 2)


def test_the_mars_hook_on_msc_outputs_is_upstreams_loss_at_321():
    """mars_plugin.adapters.training_hook with match="labels" and multi_scale=True (its defaults) on labels
    without biased pixels and no refinement: its mean WCE over the four outputs is main.py's
    loss (before / ITER_SIZE, the trainer's accumulation) at upstream's crop, 321 -> 41, 21, 31."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    torch.manual_seed(0)
    net = nn.Conv2d(3, 4, 1)
    hook = MARSTrainingHook(net, refine=None)
    outs = [torch.randn(2, 4, s, s) for s in (41, 21, 31, 41)]
    labels = torch.randint(0, 4, (2, 321, 321))
    labels[:, :40] = 255
    images = torch.randn(2, 3, 8, 8)
    got = hook(images, outs, labels, torch.ones(2, 3, dtype=torch.bool))
    torch.testing.assert_close(got, msc_loss(outs, labels), rtol=1e-5, atol=1e-6)


def test_the_hook_takes_pils_label_resize_where_ties_differ():
    """Labels of 16 on grids of 12, 9 and 15 hit PIL's rounding at exact ties: the hook's default
    pixel-centre rule then differs from main.py; label_resize=resize_labels_nearest is main.py's."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    torch.manual_seed(1)
    outs = [torch.randn(2, 4, s, s) for s in (12, 9, 15, 12)]
    labels = torch.randint(0, 4, (2, 16, 16))
    images, classes = torch.randn(2, 3, 8, 8), torch.ones(2, 3, dtype=torch.bool)
    sizes = [(12, 12), (9, 9), (15, 15)]
    from mars_plugin.method.centroid_pixels import resize_label
    assert any(not torch.equal(resize_label(labels, s), resize_labels_nearest(labels, s)) for s in sizes)
    pil = MARSTrainingHook(nn.Conv2d(3, 4, 1), refine=None, label_resize=resize_labels_nearest)
    torch.testing.assert_close(pil(images, outs, labels, classes), msc_loss(outs, labels), rtol=1e-5, atol=1e-6)
    plain = MARSTrainingHook(nn.Conv2d(3, 4, 1), refine=None)
    assert not torch.allclose(plain(images, outs, labels, classes), msc_loss(outs, labels), rtol=1e-5, atol=1e-6)
