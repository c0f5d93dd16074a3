"""mars train's data: augmentation (DHR's numbers), sampling by position, label checks."""
import numpy as np
import pytest
import torch

from mars_plugin.formats.files import write_image, write_label
from mars_plugin.networks.seg_data import (IMAGENET_MEAN, IMAGENET_STD, Augmentation, StepSampler, TrainFolder, augment,
                                  epoch_order, normalize)


def _sample(h=30, w=44, seed=0):
    g = np.random.default_rng(seed)
    rgb = g.integers(0, 256, (h, w, 3), dtype=np.uint8)
    lab = np.zeros((h, w), np.uint8)
    lab[5:20, 10:30] = 3
    lab[0:4, :] = 255
    lab[22:28, 2:8] = 254
    return rgb, lab


def test_normalize_is_imagenet_normalisation():
    rgb = torch.randint(0, 256, (2, 5, 7, 3), dtype=torch.uint8)
    x = normalize(rgb)
    ref = (rgb.permute(0, 3, 1, 2).double() / 255 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1).double()) \
        / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1).double()
    assert x.shape == (2, 3, 5, 7)
    torch.testing.assert_close(x.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("crop", [16, 40, 96])
def test_augment_shapes_values_and_determinism(crop):
    rgb, lab = _sample()
    aug = Augmentation(crop=crop, min_size=24, max_size=80)
    a = augment(rgb, lab, aug, np.random.default_rng([0, 7]))
    b = augment(rgb, lab, aug, np.random.default_rng([0, 7]))
    c = augment(rgb, lab, aug, np.random.default_rng([0, 8]))
    assert a[0].shape == (crop, crop, 3) and a[0].dtype == np.uint8 and a[1].shape == (crop, crop)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not (np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1]))
    # nearest-neighbour resizing and padding with 255 create no new label value
    assert set(np.unique(a[1]).tolist()) <= {0, 3, 254, 255}


def test_crop_of_a_small_image_pads_with_ignore_and_mean_colour():
    rgb, lab = _sample(10, 12)
    aug = Augmentation(crop=64, min_size=12, max_size=12, brightness=0, contrast=0, saturation=0, hue=0, flip=False)
    img, y = augment(rgb, lab, aug, np.random.default_rng(1))
    placed = y != 255
    # the label's 254/0/3 pixels all survive (no resize: longer side 12 = 12), the rest is ignore
    assert placed.sum() == (lab != 255).sum()
    pad = np.all(img == np.array([int(round(255 * m)) for m in IMAGENET_MEAN], np.uint8), axis=-1)
    assert pad[~placed].mean() > 0.95  # where the image is not placed (ignore rows of the label aside)
    # the image is pasted unchanged (no jitter, no flip, no resize)
    ys, xs = np.nonzero(placed)
    top, left = ys.min() - 4, xs.min()  # label rows 0..3 are ignore in the source too
    assert np.array_equal(img[top:top + 10, left:left + 12], rgb)


def test_random_resize_sets_the_longer_side():
    rgb, lab = _sample(30, 44)
    aug = Augmentation(crop=200, min_size=60, max_size=60, brightness=0, contrast=0, saturation=0, hue=0, flip=False)
    _, y = augment(rgb, lab, aug, np.random.default_rng(0))
    ys, xs = np.nonzero(y != 255)
    assert xs.max() - xs.min() + 1 == 60  # 44 -> 60 (longer side), 30 -> 41
    assert ys.max() - ys.min() + 1 <= 41


@pytest.mark.parametrize("bad", [dict(crop=4), dict(min_size=100, max_size=50), dict(hue=0.7), dict(brightness=-1)])
def test_augmentation_parameters_are_checked(bad):
    with pytest.raises(ValueError):
        Augmentation(**bad)


def test_step_sampler_slices_the_global_batch():
    one = list(StepSampler(3, 6, 4))
    two = [list(StepSampler(3, 6, 4, rank=r, world=2)) for r in range(2)]
    assert one == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    assert [a + b for a, b in zip(*two)] == one
    with pytest.raises(ValueError, match="multiple"):
        StepSampler(0, 1, 3, rank=0, world=2)


def test_epoch_order_visits_every_image_once_per_epoch():
    for e in range(3):
        assert sorted(epoch_order(7, 0, e).tolist()) == list(range(7))
    assert epoch_order(50, 0, 0).tolist() != epoch_order(50, 0, 1).tolist()


def _folder(tmp_path, n=3, size=20, value=None):
    img, lab = tmp_path / "img", tmp_path / "lab"
    for i in range(n):
        rgb, y = _sample(size, size, i)
        if value is not None and i == 1:
            y[0, 0] = value
        write_image(img / f"s{i}.png", rgb)
        write_label(lab / f"s{i}.png", torch.from_numpy(y.astype(np.int64)), mode="L")
    return img, lab


def test_train_folder_items_follow_positions(tmp_path):
    img, lab = _folder(tmp_path)
    aug = Augmentation(crop=16, min_size=16, max_size=24)
    ds = TrainFolder(img, lab, ["s0", "s1", "s2"], 5, aug, seed=3)
    a, b = ds[4], ds[4]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert a["image"].shape == (3, 16, 16) and a["rgb"].shape == (16, 16, 3) and a["label"].dtype == torch.long
    assert a["classes"].tolist() == [False, False, True, False, False]  # class 3 (254/255 not classes)
    assert sorted(ds.stem_at(p) for p in range(3)) == ["s0", "s1", "s2"]
    ds2 = TrainFolder(img, lab, ["s0", "s1", "s2"], 5, aug, seed=3, classes={"s0": [1, 3], "s1": [3], "s2": [3]})
    assert any(ds2[p]["classes"][0] for p in range(3))


@pytest.mark.parametrize("value,allow,match", [(254, False, "--loss ce"), (9, True, "value 9"), (6, False, "value 6")])
def test_train_folder_refuses_bad_label_values(tmp_path, value, allow, match):
    img, lab = _folder(tmp_path, value=value)
    # s1 holds the bad value; 254 elsewhere is refused for CE too
    ds = TrainFolder(img, lab, ["s1"], 5, Augmentation(crop=16), seed=0, allow_biased=allow)
    with pytest.raises(ValueError, match=match):
        ds[0]


def test_train_folder_refuses_size_mismatch(tmp_path):
    img, lab = _folder(tmp_path)
    write_image(img / "s0.png", np.zeros((10, 12, 3), np.uint8))
    with pytest.raises(ValueError, match="20x20 but its image is 10x12"):
        TrainFolder(img, lab, ["s0"], 5, Augmentation(crop=16), seed=0)[0]
