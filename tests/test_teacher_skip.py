"""The teacher's CRF runs only where its labels are used (issue 32: most of a MARS step's
teacher is its dense CRF): images without a biased pixel, and images with a single allowed
label, skip it, and every label the caller uses is the same as refining the whole batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mars_plugin.method.complement as complement_module
from mars_plugin import complement_labels
from mars_plugin.method.complement import teacher_labels

IGNORE = 255
C, H, W = 5, 12, 14


def batch(seed, B=4):
    """B images: teacher probabilities, RGB, labels with biased pixels, and 2 classes each."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((B, C + 1, H, W))
    probs = torch.from_numpy(logits).softmax(1).float()
    rgb = torch.from_numpy(rng.integers(0, 256, size=(B, H, W, 3), dtype=np.uint8))
    classes = torch.zeros(B, C, dtype=torch.bool)
    for b in range(B):
        classes[b, rng.choice(C, size=2, replace=False)] = True
    y = torch.from_numpy(rng.choice(np.array([-1, 0, 1, 2, IGNORE]), size=(B, H, W))).long()
    return probs, rgb, classes, y


def refined_alone(probs, rgb, classes, b, refine="crf"):
    """Image b's teacher labels from the CRF run on that image alone (no skipping)."""
    allowed = torch.cat([torch.ones(1, 1, dtype=torch.bool), classes[b:b + 1]], 1)
    return teacher_labels(probs[b:b + 1], allowed, refine=refine, image=rgb[b:b + 1])[0]


@pytest.fixture
def crf_images(monkeypatch):
    """How many images each dense CRF call of the teacher was given."""
    calls = []
    real = complement_module.dense_crf

    def counting(p, imgs, *args, **kw):
        calls.append(int(p.shape[0]))
        return real(p, imgs, *args, **kw)

    monkeypatch.setattr(complement_module, "dense_crf", counting)
    return calls


@pytest.mark.parametrize("seed", [0, 1])
def test_images_without_a_biased_pixel_skip_the_crf(seed, crf_images):
    probs, rgb, classes, y = batch(seed)
    y[1][y[1] == -1] = 0  # images 1 and 3 have no biased pixel
    y[3][y[3] == -1] = IGNORE
    y_co, w = complement_labels(y, probs, classes, refine="crf", image=rgb)
    assert crf_images == [2]
    for b in range(4):
        biased = y[b] == -1
        expect = torch.where(biased, refined_alone(probs, rgb, classes, b), y[b])
        assert torch.equal(y_co[b], expect), b
    _, w_plain = complement_labels(y, probs, classes)
    assert torch.equal(w, w_plain)


def test_a_batch_without_biased_pixels_runs_no_crf(crf_images):
    probs, rgb, classes, y = batch(2)
    y[y == -1] = 0
    y_co, w = complement_labels(y, probs, classes, refine="crf", image=rgb)
    assert crf_images == []
    assert torch.equal(y_co, y) and bool((w == 1).all())


def test_a_single_allowed_label_is_not_refined(crf_images):
    probs, rgb, classes, y = batch(3, B=3)
    classes[1] = False  # image 1: background only; its biased pixels can only become background
    y_co, _ = complement_labels(y, probs, classes, refine="crf", image=rgb)
    assert crf_images == [2]
    biased = y[1] == -1
    assert bool(biased.any()) and bool((y_co[1][biased] == 0).all())
    for b in (0, 2):
        expect = torch.where(y[b] == -1, refined_alone(probs, rgb, classes, b), y[b])
        assert torch.equal(y_co[b], expect)


@pytest.mark.parametrize("refine", ["crf", "local_crf"])
def test_teacher_labels_needed(refine):
    probs, rgb, classes, _ = batch(4)
    allowed = torch.cat([torch.ones(4, 1, dtype=torch.bool), classes], 1)
    needed = torch.tensor([True, False, True, False])
    out = teacher_labels(probs, allowed, refine=refine, image=rgb, needed=needed)
    full = teacher_labels(probs, allowed, refine=refine, image=rgb)
    assert torch.equal(out[needed], full[needed])
    plain = probs.masked_fill(~allowed[:, :, None, None], float("-inf")).argmax(1)
    assert torch.equal(out[~needed], plain[~needed])


@pytest.mark.parametrize("needed, match", [
    (torch.tensor([True, False]), r"needed must be a \(B,\) = \(4,\) bool tensor, got .*2"),
    (torch.ones(4, dtype=torch.long), r"needed must be a \(B,\) = \(4,\) bool tensor, got .*int64"),
])
def test_bad_needed_is_named(needed, match):
    probs, rgb, classes, _ = batch(5)
    allowed = torch.cat([torch.ones(4, 1, dtype=torch.bool), classes], 1)
    with pytest.raises(ValueError, match=match):
        teacher_labels(probs, allowed, refine="crf", image=rgb, needed=needed)
