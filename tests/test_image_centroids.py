"""Tests of mars_plugin.method.centroids: per-image, per-class K-means centroids (MARS Sec. 3.2).

References are plain numpy: the class pixel sets are gathered by hand, the label resize uses
exact rational arithmetic of the documented pixel-centre rule, and K-means results are checked
as Lloyd fixed points of exactly those pixel sets.
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mars_plugin.method.centroid_pixels import resize_label
from mars_plugin.method.centroids import ImageCentroids, image_centroids, problem_seed

SEEDS = [0, 1, 2]
IGNORE = 255


# ----------------------------------------------------------------------------- numpy references
def np_resize_index(n_in, n_out):
    """src = min(floor((i + 0.5) * n_in / n_out), n_in - 1), in exact rational arithmetic."""
    return np.array(
        [min(math.floor((Fraction(i) + Fraction(1, 2)) * n_in / n_out), n_in - 1) for i in range(n_out)]
    )


def np_resize(label, size):
    label = np.asarray(label)
    iy = np_resize_index(label.shape[-2], size[0])
    ix = np_resize_index(label.shape[-1], size[1])
    return label[..., iy[:, None], ix[None, :]]


def np_class_pixels(features, label, c, normalize):
    """(n, D) float64 embeddings of the pixels of class c (label already on the feature grid)."""
    f = np.asarray(features, dtype=np.float64)
    pts = f[:, np.asarray(label) == c].T
    if normalize:
        pts = pts / np.maximum(np.linalg.norm(pts, axis=1, keepdims=True), 1e-12)
    return pts


def assert_lloyd_fixed_point(x, c, atol=1e-5):
    x = np.asarray(x, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    d = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    lab = d.argmin(1)
    for j in range(len(c)):
        owned = x[lab == j]
        assert len(owned) >= 1, f"centroid {j} owns no pixel"
        np.testing.assert_allclose(c[j], owned.mean(0), atol=atol, rtol=0)


def random_image(rng, d=6, h=12, w=10, classes=(0, 1, 3), ignore_frac=0.1, dtype=np.float64):
    """Random features and a blocky label using ``classes`` plus some ignore pixels."""
    f = rng.normal(size=(d, h, w)).astype(dtype)
    coarse = rng.choice(np.array(classes), size=(h // 2 + 1, w // 2 + 1))
    y = np.kron(coarse, np.ones((2, 2), dtype=np.int64))[:h, :w].astype(np.int64)
    for i, c in enumerate(classes):  # make sure every requested class is present
        y[i % h, (3 * i) % w] = c
    y[rng.random((h, w)) < ignore_frac] = IGNORE
    for i, c in enumerate(classes):
        y[i % h, (3 * i) % w] = c
    return f, y


def check_image(f, y, ic, *, k_fg, k_bg, normalize, atol=1e-5):
    """Every class of the (grid-sized) label has Lloyd-fixed-point centroids of its own pixels."""
    d = f.shape[0]
    present = set(np.unique(y).tolist()) - {IGNORE}
    assert set(ic.fg) == present - {0}
    assert ic.dim == d
    for c in present:
        pts = np_class_pixels(f, y, c, normalize)
        cents = (ic.bg if c == 0 else ic.fg[c]).numpy()
        k = k_bg if c == 0 else k_fg
        assert cents.shape == (min(k, len(np.unique(pts, axis=0))), d)
        assert_lloyd_fixed_point(pts, cents, atol=atol)
    if 0 not in present:
        assert tuple(ic.bg.shape) == (0, d)


# ----------------------------------------------------------------------------- resize_label
@pytest.mark.parametrize(
    "h_in,w_in,h_out,w_out",
    [(8, 8, 4, 4), (4, 4, 8, 8), (7, 5, 3, 2), (3, 2, 7, 5), (6, 12, 37, 23), (37, 23, 6, 12),
     (14, 14, 23, 9), (10, 33, 10, 7), (1, 1, 5, 3), (5, 3, 1, 1), (512, 384, 32, 24), (500, 375, 33, 25)],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_resize_label_pixel_centre_rule(h_in, w_in, h_out, w_out, seed):
    rng = np.random.default_rng(seed)
    lab = rng.integers(0, 21, size=(h_in, w_in))
    lab[rng.random((h_in, w_in)) < 0.1] = IGNORE
    out = resize_label(torch.from_numpy(lab), (h_out, w_out))
    assert out.shape == (h_out, w_out)
    np.testing.assert_array_equal(out.numpy(), np_resize(lab, (h_out, w_out)))
    batch = rng.integers(0, 21, size=(3, h_in, w_in))
    out_b = resize_label(torch.from_numpy(batch), (h_out, w_out))
    assert out_b.shape == (3, h_out, w_out)
    np.testing.assert_array_equal(out_b.numpy(), np_resize(batch, (h_out, w_out)))


def test_resize_label_exhaustive_small_sizes():
    """Every pair of sizes 1..40, including ratios where (i + 0.5) * n_in / n_out is an exact
    integer (a float scale rounds those down, e.g. 6 -> 37)."""
    for n_in in range(1, 41):
        lab = torch.arange(n_in)[:, None] * 100 + torch.arange(n_in)[None, :]
        for n_out in range(1, 41):
            ref = np_resize_index(n_in, n_out)
            out = resize_label(lab, (n_out, n_out)).numpy()
            np.testing.assert_array_equal(out, ref[:, None] * 100 + ref[None, :], err_msg=f"{n_in}->{n_out}")


# ----------------------------------------------------------------------------- clustering
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k_fg,k_bg", [(2, 2), (3, 1), (1, 4)])
def test_centroids_are_lloyd_fixed_points_of_class_pixels(seed, normalize, k_fg, k_bg):
    rng = np.random.default_rng(seed * 101 + k_fg * 10 + k_bg)
    f, y = random_image(rng, classes=(0, 2, 5, 7))
    # ignored pixels get huge features: any leak into a class would move its centroids
    f[:, y == IGNORE] = 1e3 * np.sign(f[:, y == IGNORE])
    ic = image_centroids(torch.from_numpy(f), torch.from_numpy(y), k_fg=k_fg, k_bg=k_bg,
                         normalize=normalize, seed=seed, tol=0.0, max_iter=1000)
    assert isinstance(ic, ImageCentroids)
    check_image(f, y, ic, k_fg=k_fg, k_bg=k_bg, normalize=normalize)


@pytest.mark.parametrize("seed", SEEDS)
def test_float32_features(seed):
    rng = np.random.default_rng(seed + 5)
    f, y = random_image(rng, classes=(0, 1, 4), dtype=np.float32)
    ic = image_centroids(torch.from_numpy(f), torch.from_numpy(y), seed=seed, tol=0.0, max_iter=1000)
    assert ic.bg.dtype == torch.float32
    check_image(f, y, ic, k_fg=2, k_bg=2, normalize=True)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_single_cluster_is_class_mean(seed, normalize):
    """k = 1 has a closed form: the mean of the (normalised) class pixels."""
    rng = np.random.default_rng(seed + 17)
    f, y = random_image(rng, d=4, classes=(0, 1, 2, 3))
    ic = image_centroids(f, y, k_fg=1, k_bg=1, normalize=normalize, seed=seed)
    for c in (0, 1, 2, 3):
        ref = np_class_pixels(f, y, c, normalize).mean(0)
        got = (ic.bg if c == 0 else ic.fg[c]).numpy()
        assert got.shape == (1, 4)
        np.testing.assert_allclose(got[0], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_normalize_false_uses_raw_features(seed):
    """With normalize=False, scaling the features scales the centroids (and not otherwise)."""
    rng = np.random.default_rng(seed + 3)
    f, y = random_image(rng, classes=(0, 1, 2))
    a = image_centroids(f, y, normalize=False, seed=seed, tol=0.0, max_iter=1000)
    b = image_centroids(7.0 * f, y, normalize=False, seed=seed, tol=0.0, max_iter=1000)
    c = image_centroids(7.0 * f, y, normalize=True, seed=seed, tol=0.0, max_iter=1000)
    n = image_centroids(f, y, normalize=True, seed=seed, tol=0.0, max_iter=1000)
    np.testing.assert_allclose(b.bg.numpy(), 7.0 * a.bg.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(c.bg.numpy(), n.bg.numpy(), atol=1e-5, rtol=0)
    for k in a.fg:
        np.testing.assert_allclose(b.fg[k].numpy(), 7.0 * a.fg[k].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(c.fg[k].numpy(), n.fg[k].numpy(), atol=1e-5, rtol=0)
    # raw centroids are not unit-norm means: at least one has norm > 1 for these features
    assert max(float(v.norm(dim=1).max()) for v in [a.bg, *a.fg.values()]) > 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(24, 20), (37, 23), (13, 11)])
def test_label_larger_than_feature_grid_is_resized(seed, shape):
    rng = np.random.default_rng(seed + 11)
    f = rng.normal(size=(5, 12, 10))
    big = rng.choice(np.array([0, 1, 2, 6, IGNORE]), size=shape)
    small = np_resize(big, (12, 10))
    a = image_centroids(f, big, seed=seed, tol=0.0, max_iter=1000)
    b = image_centroids(f, small, seed=seed, tol=0.0, max_iter=1000)
    assert set(a.fg) == set(b.fg) == set(np.unique(small).tolist()) - {0, IGNORE}
    assert torch.equal(a.bg, b.bg)
    for k in a.fg:
        assert torch.equal(a.fg[k], b.fg[k])
    check_image(f, small, a, k_fg=2, k_bg=2, normalize=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_image_without_background(seed):
    rng = np.random.default_rng(seed + 23)
    f, y = random_image(rng, d=5, classes=(3, 4))
    assert not (y == 0).any()
    ic = image_centroids(f, y, seed=seed)
    assert tuple(ic.bg.shape) == (0, 5)
    assert set(ic.fg) == {3, 4}


@pytest.mark.parametrize("seed", SEEDS)
def test_absent_class_and_single_pixel_class(seed):
    rng = np.random.default_rng(seed + 29)
    f, y = random_image(rng, classes=(0, 2), ignore_frac=0.0)
    y[4, 5] = 9  # class 9 has exactly one pixel
    ic = image_centroids(f, y, k_fg=2, seed=seed)
    assert set(ic.fg) == {2, 9}
    assert 1 not in ic.fg and 3 not in ic.fg
    ref = f[:, 4, 5] / np.linalg.norm(f[:, 4, 5])
    assert ic.fg[9].shape == (1, f.shape[0])
    np.testing.assert_allclose(ic.fg[9][0].numpy(), ref, atol=1e-6, rtol=0)


def test_only_ignore_pixels():
    f = np.random.default_rng(0).normal(size=(3, 4, 4))
    ic = image_centroids(f, np.full((4, 4), IGNORE))
    assert ic.fg == {}
    assert tuple(ic.bg.shape) == (0, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_duplicate_pixels_give_one_centroid_per_distinct_pixel(seed):
    rng = np.random.default_rng(seed + 31)
    f, y = random_image(rng, d=4, classes=(0, 1))
    vec = rng.normal(size=4)
    ones = y == 1
    f[:, ones] = vec[:, None]  # class 1: every pixel identical
    ic = image_centroids(f, y, k_fg=2, seed=seed)
    assert ic.fg[1].shape == (1, 4)
    np.testing.assert_allclose(ic.fg[1][0].numpy(), vec / np.linalg.norm(vec), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_equals_one_by_one(seed):
    rng = np.random.default_rng(seed + 37)
    images = [random_image(rng, d=6, h=14, w=12, classes=cls)
              for cls in [(0, 1, 2), (3,), (0, 2, 4, 5), (0,)]]
    f = np.stack([im[0] for im in images])
    y = np.stack([im[1] for im in images])
    batch = image_centroids(torch.from_numpy(f), torch.from_numpy(y), k_fg=2, k_bg=3, seed=seed)
    assert isinstance(batch, list) and len(batch) == len(images)
    for (fi, yi), got in zip(images, batch):
        one = image_centroids(torch.from_numpy(fi), torch.from_numpy(yi), k_fg=2, k_bg=3, seed=seed)
        assert set(got.fg) == set(one.fg)
        assert got.bg.shape == one.bg.shape
        np.testing.assert_allclose(got.bg.numpy(), one.bg.numpy(), atol=1e-5, rtol=0)
        for k in one.fg:
            np.testing.assert_allclose(got.fg[k].numpy(), one.fg[k].numpy(), atol=1e-5, rtol=0)
    # and the batch result is itself correct per image
    batch0 = image_centroids(torch.from_numpy(f), torch.from_numpy(y), k_fg=2, k_bg=3, seed=seed,
                             tol=0.0, max_iter=1000)
    for (fi, yi), got in zip(images, batch0):
        check_image(fi, yi, got, k_fg=2, k_bg=3, normalize=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_deterministic_by_seed_and_numpy_inputs(seed):
    rng = np.random.default_rng(seed + 41)
    f, y = random_image(rng, classes=(0, 1, 2, 3))
    a = image_centroids(torch.from_numpy(f), torch.from_numpy(y), seed=seed)
    b = image_centroids(torch.from_numpy(f.copy()), torch.from_numpy(y.copy()), seed=seed)
    c = image_centroids(f, y, seed=seed)  # numpy inputs
    c32 = image_centroids(f.astype(np.float32), y.astype(np.uint8), seed=seed)
    for other in (b, c):
        assert torch.equal(a.bg, other.bg)
        assert set(a.fg) == set(other.fg)
        for k in a.fg:
            assert torch.equal(a.fg[k], other.fg[k])
    assert c32.bg.dtype == torch.float32
    assert set(c32.fg) == set(a.fg)


def test_problem_seed_depends_on_seed_and_class():
    assert problem_seed(3, 1) == problem_seed(3, 1)
    assert len({problem_seed(s, c) for s in range(5) for c in range(5)}) == 25
    assert all(0 <= problem_seed(s, c) < 2**63 for s in range(5) for c in range(5))


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument():
    f = np.random.default_rng(0).normal(size=(3, 4, 4))
    y = np.zeros((4, 4), dtype=np.int64)
    y[0, 0] = 1
    with pytest.raises(ValueError, match="features"):
        image_centroids(f[0], y)
    with pytest.raises(ValueError, match="features"):
        image_centroids(f[None, None], y)
    with pytest.raises(ValueError, match="pseudo_label"):
        image_centroids(f, y[None])
    with pytest.raises(ValueError, match="pseudo_label"):
        image_centroids(f[None].repeat(2, 0), y[None])  # 2 images, 1 label
    bad = f.copy()
    bad[0, 1, 1] = np.nan
    with pytest.raises(ValueError, match="features"):
        image_centroids(bad, y)
    bad[0, 1, 1] = np.inf
    with pytest.raises(ValueError, match="features"):
        image_centroids(bad, y)
    neg = y.copy()
    neg[2, 2] = -1
    with pytest.raises(ValueError, match="pseudo_label"):
        image_centroids(f, neg)
    with pytest.raises(TypeError, match="pseudo_label"):
        image_centroids(f, y + 0.5)
    with pytest.raises(TypeError, match="features"):
        image_centroids("features", y)
    with pytest.raises(ValueError, match="k_fg"):
        image_centroids(f, y, k_fg=0)
    with pytest.raises(ValueError, match="k_bg"):
        image_centroids(f, y, k_bg=0)
    with pytest.raises(TypeError, match="k_fg"):
        image_centroids(f, y, k_fg=True)
    with pytest.raises(TypeError, match="k_bg"):
        image_centroids(f, y, k_bg=2.0)
