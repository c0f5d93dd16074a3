"""Issue 41, class 11: the code does what its docs and its upstream say, where step 2 was compared
with the upstream code as is.

* The dhr recipe's training crop (shjo-april/DHR@94d5189): ``train.py:370`` runs ``Normalize``
  before ``RandomCrop``, and ``tools/transforms.py:219`` pads the *normalised* image with
  ``np.zeros``: the network's input is exactly 0 in the padding (``seg_data``'s docstring says
  so). It used to hold the rounded mean bytes normalised (+0.0056 / -0.0049 / +0.0082). SEAM's
  RandomCrop pads its normalised crop with zeros too (``seam_augment_normalized``).
* DHR keeps a class for an image's CRF when its probability is ``> args.threshold``
  (``produce_wss_masks.py:42``; 0.05 at ``:136``), compared in float32: a class exactly at 0.05
  is left out. ``mars predict`` used ``>=``.

Each test reads DHR's lines from the local mirror where there is one (CI has none: that half is
skipped) and holds the code to a plain reading of them.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin.formats.files import write_image, write_label
from mars_plugin.networks.seg_data import IMAGENET_MEAN, IMAGENET_STD, Augmentation, TrainFolder

from test_recipe_fields import _mirror_file

DHR = "shjo-april/DHR@94d5189"
#: the DHR lines these tests hold the code to ("path:line" -> the line, stripped)
LINES = {
    "train.py:370": "'train_transform': 'RandomResize,RandomHFlip,ColorJitter,Normalize,RandomCrop',",
    "tools/transforms.py:219": "cropped_image = np.zeros(self.shape, output_dict[key].dtype)",
    "tools/transforms.py:247": "norm_image[0, ...] = (image[..., 0] / 255. - self.mean[0]) / self.std[0]",
    "produce_wss_masks.py:42": "class_mask = torch_utils.get_numpy(torch.max(pred_mask.reshape("
                               "test_dataset.dataset.num_classes, -1), dim=1)[0]) > args.threshold",
    "produce_wss_masks.py:136": "'threshold': 0.05, # to reduce inference time related to CRF",
}


@pytest.mark.parametrize("where", sorted(LINES))
def test_the_cited_lines_are_dhrs(where: str) -> None:
    path, line = where.rsplit(":", 1)
    text = _mirror_file(DHR, path)
    if text is None:
        pytest.skip(f"no mirror of {DHR}")
    assert text[int(line) - 1].strip() == LINES[where]


def _dhr_normalize(rgb: np.ndarray) -> np.ndarray:
    """tools/transforms.py:243-249 read plainly: float32, channel by channel, (x / 255 - mean) / std."""
    x = np.asarray(rgb, dtype=np.float32)
    out = np.zeros((3,) + x.shape[:2], np.float32)
    for k in range(3):
        out[k] = (x[..., k] / 255. - IMAGENET_MEAN[k]) / IMAGENET_STD[k]
    return out


def _tree(root: Path, n: int) -> Path:
    for i in range(n):
        r = np.random.default_rng(i)
        h, w = 20 + 3 * i, 34 - i
        write_image(root / "images" / f"s{i}.png", r.integers(0, 256, (h, w, 3), dtype=np.uint8))
        write_label(root / "labels" / f"s{i}.png", torch.from_numpy(r.integers(0, 3, (h, w))))
    return root


def test_the_dhr_crop_is_0_after_normalisation_where_padded(tmp_path: Path) -> None:
    """12 crops of mars train's dhr data (TrainFolder, what the trainer reads): the image placed
    in the crop is normalised as DHR's Normalize (tools/transforms.py:247), the padding is exactly
    0 (tools/transforms.py:219, after Normalize: train.py:370), the label 255 there."""
    root = _tree(tmp_path, 4)
    aug = Augmentation(crop=40, min_size=24, max_size=44)
    ds = TrainFolder(root / "images", root / "labels", [f"s{i}" for i in range(4)], 2, aug, seed=0)
    padded = 0
    for p in range(12):
        item = ds[p]
        image, rgb, label = item["image"].numpy(), item["rgb"].numpy(), item["label"].numpy()
        # where the image lies: the bytes are not the padding colour's, or the label is not 255
        ys, xs = np.nonzero(label != 255)
        placed = np.zeros(label.shape, bool)
        if len(ys):
            placed[ys.min():ys.max() + 1, xs.min():xs.max() + 1] = True
        want = np.where(placed[None], _dhr_normalize(rgb), np.float32(0))
        pad = ~placed
        if pad.any():
            padded += 1
            assert (image[:, pad] == 0).all(), (p, np.unique(image[:, pad]))
        assert np.array_equal(image, want), p
    assert padded >= 6  # most crops are padded: the case the issue found (11 of 12)


def test_the_padding_window_is_where_dhr_places_the_image() -> None:
    """train_sample's window is the box DHR's RandomCrop pastes into: with an all-255 label the
    placed image shows only through the bytes, so compare with augment()'s own crop."""
    from mars_plugin.networks.seg_data import augment, train_sample

    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (18, 30, 3), dtype=np.uint8)
    lab = np.full((18, 30), 255, np.uint8)
    aug = Augmentation(crop=48, min_size=20, max_size=30)
    for seed in range(6):
        image, rgb_c, _ = train_sample(rgb, lab, aug, np.random.default_rng(seed))
        u8, _ = augment(rgb, lab, aug, np.random.default_rng(seed))
        assert np.array_equal(rgb_c, u8)
        zero = (image.numpy() == 0).all(0)
        assert zero.sum() >= 48 * 48 - 30 * 30  # at least the area the (at most 30 x 30) image leaves


def test_the_seam_crop_is_upstreams_normalised_crop() -> None:
    """SEAM's RandomCrop pads its normalised crop with 0 too: mars train's input is
    seam_augment_normalized's (the plain reading, tests/test_seam_augment.py) bit for bit."""
    from mars_plugin.networks.seam_data import SeamAugmentation, seam_augment_normalized
    from mars_plugin.networks.seg_data import train_sample

    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (12, 20, 3)).astype(np.uint8)
    label = np.arange(240, dtype=np.uint8).reshape(12, 20)
    aug = SeamAugmentation(crop=16)
    padded = set()
    for seed in range(12):
        want, want_l = seam_augment_normalized(rgb, label, aug, random.Random(seed))
        image, _, lab = train_sample(rgb, label, aug, random.Random(seed))
        assert np.array_equal(image.numpy(), want.transpose(2, 0, 1)) and np.array_equal(lab, want_l), seed
        padded.add(bool((want_l == 255).any()))
    assert padded == {True, False}


def _kept(probs: torch.Tensor, threshold: float, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The classes labels_from_probs gives the CRF (its ``valid``)."""
    import mars_plugin.networks.inference as inf

    seen = []

    def crf(p, images, params, valid=None, max_bytes=None):
        seen.append(valid.clone())
        return p
    monkeypatch.setattr(inf, "dense_crf", crf)
    inf.labels_from_probs(probs, torch.zeros(probs.shape[0], *probs.shape[2:], 3, dtype=torch.uint8), "mars",
                          threshold)
    return seen[0]


def test_a_class_exactly_at_the_threshold_is_left_out_as_dhr_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """produce_wss_masks.py:42: ``max > args.threshold`` (float32 against 0.05): exactly 0.05 is
    out, the next float32 above it in; the keys equal DHR's reading of the same probabilities."""
    at = np.float32(0.05)
    above = np.nextafter(at, np.float32(1))
    probs = torch.zeros(1, 4, 2, 3)
    probs[0, 0] = 0.6
    probs[0, 1, 0, 0], probs[0, 2, 0, 0], probs[0, 3, 1, 1] = float(at), float(above), 0.3
    probs[0, 0, 0, 0] = 1 - float(at) - float(above)
    kept = _kept(probs, 0.05, monkeypatch)[0].tolist()
    assert kept == [True, False, True, True]
    dhr = np.max(probs[0].numpy().reshape(4, -1), axis=1) > 0.05  # the cited line, on numpy's float32
    assert kept == dhr.tolist()


def test_threshold_0_keeps_every_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 (a recipe without a threshold: deeplab-pytorch, SEAM; --class-threshold 0) keeps every
    class, one whose probability is 0 everywhere too."""
    probs = torch.zeros(1, 3, 2, 2)
    probs[0, 0] = 0.7
    probs[0, 1] = 0.3
    assert _kept(probs, 0.0, monkeypatch)[0].tolist() == [True, True, True]
