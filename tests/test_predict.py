"""`mars predict` (mars_plugin.predict): multi-scale + flip inference against a plain loop written
from the definition, the CRF step against dense_crf per image, the label files (P mode, VOC
palette), resume, bad files, bad flags, bad checkpoints, DHR's WSS layout, `mars evaluate` on the
output, and two torchrun ranks against one process."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from mars_plugin.crf import dense_crf
from mars_plugin.files import read_label, voc_palette
from mars_plugin.predict import (CLASS_THRESHOLD, DEFAULT_SCALES, labels_from_probs, multiscale_probs,
                                 predict_job, predict_labels)


class Net(nn.Module):
    """A tiny network whose classes follow the colours (random weights, large enough to vary
    across the image); ``stride=2`` gives logits at half the input size, as a network that does
    not upsample them itself."""

    def __init__(self, labels: int = 4, stride: int = 1, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, labels, 3, padding=1, stride=stride)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 1.5
        self.stride = stride

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _images(n, h, w, seed=0):
    """(n, H, W, 3) uint8: smooth colour blobs (so that the classes form regions) and noise."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for _ in range(n):
        img = np.zeros((h, w, 3))
        for c in range(3):
            img[..., c] = 128 + 100 * np.sin(xx * r.uniform(0.1, 0.4) + r.uniform(0, 6)) * np.cos(yy * r.uniform(0.1, 0.4))
        out.append(np.clip(img + r.normal(0, 8, img.shape), 0, 255).astype(np.uint8))
    return torch.from_numpy(np.stack(out))


def _normalize(rgb):
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, roughly zero-centred (the tests' stand-in for
    ImageNet's)."""
    return rgb.permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.25)


def _reference_probs(model, image, scales, flip):
    """One (3, H, W) normalised image, written from the definition: for every scale and flip,
    bilinear resize (align_corners=False) to (int(H s), int(W s)), the network, its logits resized
    to that input, softmax, flipped back, resized to H x W; the mean of all of them."""
    H, W = image.shape[-2:]
    maps = []
    for s in scales:
        size = (int(H * s), int(W * s))
        x = image[None]
        if size != (H, W):
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        for f in ([False, True] if flip else [False]):
            xi = x.flip(-1) if f else x
            with torch.no_grad():
                logits = model(xi)
            if tuple(logits.shape[-2:]) != size:
                logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
            p = torch.softmax(logits, 1)
            if f:
                p = p.flip(-1)
            if size != (H, W):
                p = F.interpolate(p, size=(H, W), mode="bilinear", align_corners=False)
            maps.append(p[0])
    return torch.stack(maps).mean(0)


@pytest.mark.parametrize("scales,flip,stride", [
    (DEFAULT_SCALES, True, 1), (DEFAULT_SCALES, False, 1), ((0.5, 1.25), True, 1), ((1.0,), True, 2),
    (DEFAULT_SCALES, True, 2)])
def test_multiscale_probs_equal_a_loop_from_the_definition(scales, flip, stride):
    torch.manual_seed(0)
    model = Net(5, stride=stride).eval()
    x = _normalize(_images(3, 26, 37))
    got = multiscale_probs(model, x, scales, flip)
    want = torch.stack([_reference_probs(model, xi, scales, flip) for xi in x])
    assert got.shape == (3, 5, 26, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the reference itself is not trivial: scales and flips each change the result
    assert not torch.allclose(want, torch.stack([_reference_probs(model, xi, (1.0,), False) for xi in x]), atol=1e-3)


def _probs_with_absent_classes(seed=0):
    """(3, 5, 24, 30) probabilities in which image 0 has class 4 below the threshold everywhere,
    image 1 only class 2 above it, image 2 every class: the CRF label sets differ per image."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 24, 30, generator=g) * 2
    logits[0, 4] -= 8  # never reaches 0.05
    logits[1] = torch.randn(5, 24, 30, generator=g) - 12
    logits[1, 2] = 5.0  # class 2 fills image 1
    return torch.softmax(logits, 1)


@pytest.mark.parametrize("crf", ["none", "mars", "psa"])
@pytest.mark.parametrize("threshold", [CLASS_THRESHOLD, 0.0, 0.5])
def test_labels_equal_dense_crf_per_image_on_the_kept_classes(crf, threshold):
    probs = _probs_with_absent_classes()
    rgb = _images(3, 24, 30, seed=1)
    got = labels_from_probs(probs, rgb, crf, threshold)
    assert got.shape == (3, 24, 30) and got.dtype == torch.int64
    for i in range(3):
        p = probs[i]
        if crf == "none":
            want = p.argmax(0)
        else:
            keys = torch.nonzero(p.amax(dim=(1, 2)) >= threshold)[:, 0]
            if keys.numel() == 0:
                keys = torch.arange(p.shape[0])
            q = dense_crf(p[keys], rgb[i], crf)
            want = keys[q.argmax(0)]
        assert torch.equal(got[i], want), (crf, threshold, i)
    if crf != "none" and threshold == CLASS_THRESHOLD:
        assert torch.equal(got[1], torch.full((24, 30), 2))  # one class kept: that class (not background)
        assert not bool((got[0] == 4).any())


def _below_threshold_argmax():
    """(1, 21, 24, 30): VOC's 21 labels; class 20 has 0.049 and the other 20 share the rest
    (0.04755 each): class 20 is the argmax of every pixel but a corner without reaching 0.05."""
    p = torch.full((1, 21, 24, 30), 0.0)
    p[0, :20] = (1 - 0.049) / 20
    p[0, 20] = 0.049
    p[0, :, :2, :2] = 0.5 / 20  # a corner where class 3 reaches 0.5: the one class kept
    p[0, 3, :2, :2] = 0.5
    return p


@pytest.mark.parametrize("crf", ["mars", "psa"])
def test_a_class_below_the_threshold_is_no_label_of_the_crf(crf):
    """Upstream's subset matters: class 20, the argmax of the image but never 0.05, is not a
    label of its CRF; over every class (threshold 0) it is."""
    probs = _below_threshold_argmax()
    rgb = _images(1, 24, 30, seed=1)
    assert bool((labels_from_probs(probs, rgb, "none") == 20).any())
    kept = labels_from_probs(probs, rgb, crf, CLASS_THRESHOLD)
    every = labels_from_probs(probs, rgb, crf, 0.0)
    assert not bool((kept == 20).any()) and bool((every == 20).any())
    keys = torch.nonzero(probs[0].amax(dim=(1, 2)) >= CLASS_THRESHOLD)[:, 0]
    assert keys.tolist() == [3] and bool((kept == 3).all())


def test_when_no_class_reaches_the_threshold_every_class_takes_part():
    """Beyond 20 classes every probability can stay below 0.05 (upstream's CRF would get no
    label): the CRF then runs over every class."""
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(1, 30, 24, 24, generator=g) * 0.1, 1)  # all about 1/30
    assert float(probs.max()) < CLASS_THRESHOLD
    rgb = _images(1, 24, 24, seed=4)
    got = labels_from_probs(probs, rgb, "mars")
    assert torch.equal(got[0], dense_crf(probs[0], rgb[0], "mars").argmax(0))


def test_predict_labels_is_multiscale_then_labels():
    model = Net(4).eval()
    rgb = _images(2, 24, 24, seed=3)
    x = _normalize(rgb)
    want = labels_from_probs(multiscale_probs(model, x), rgb, "mars")
    assert torch.equal(predict_labels(model, x, rgb), want)
    assert len(want.unique()) > 1  # the test images give several classes


@pytest.mark.parametrize("bad,match", [
    (dict(scales=()), "at least one scale"), (dict(scales=(0.0,)), r"scales\[0\]"), (dict(scales="1"), "scales"),
    (dict(crf="dense"), "crf must be one of"), (dict(class_threshold=1.5), "class_threshold"),
])
def test_bad_arguments_name_the_parameter(bad, match):
    model = Net(3).eval()
    rgb = _images(1, 24, 24)
    x = _normalize(rgb)
    with pytest.raises((ValueError, TypeError), match=match):
        predict_labels(model, x, rgb, **bad)


# --------------------------------------------------------------------------------------------
# the folder job
# --------------------------------------------------------------------------------------------

SIZES = [(24, 32), (32, 24), (24, 32), (40, 28), (24, 32)]


def _write_images(folder: Path, sizes=SIZES, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    stems = []
    for i, (h, w) in enumerate(sizes):
        img = _images(1, h, w, seed=seed + i)[0].numpy()
        Image.fromarray(img).save(folder / f"im{i}.png")
        stems.append(f"im{i}")
    return stems


def test_job_writes_p_mode_pngs_with_the_voc_palette_equal_to_predict_labels(tmp_path):
    stems = _write_images(tmp_path / "images")
    model = Net(4).eval()
    s = predict_job(model, tmp_path / "images", tmp_path / "out", batch_size=2, preprocess=_normalize,
                    progress=False)
    assert (s.done, s.existing, s.failed) == (5, 0, [])
    for i, stem in enumerate(stems):
        with Image.open(tmp_path / "out" / f"{stem}.png") as im:
            assert im.mode == "P" and im.size == (SIZES[i][1], SIZES[i][0])
            assert im.getpalette()[:3 * 256] == voc_palette()[:3 * 256]
            got = torch.from_numpy(np.asarray(im).astype(np.int64))
        rgb = torch.from_numpy(np.array(Image.open(tmp_path / "images" / f"{stem}.png")))[None]
        want = predict_labels(model, _normalize(rgb), rgb)[0]
        assert torch.equal(got, want), stem
