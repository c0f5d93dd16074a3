"""The compiled (numba) K-means backend against the batched torch backend.

The torch path is the reference: it is tested against scikit-learn and a plain Lloyd in
test_kmeans.py. Here the compiled kernel must give the same groups, the same number of
centroids and the same centroids (to float32 rounding: the torch side runs in float64) on the
same problems, including the degenerate ones; and its own invariances (batch == one by one,
thread count, float16 == float32 holding the same values) must hold bit for bit. The helpers
that feed it (grouping the labels, their range, the NaN check of ignored pixels) are compared
with plain numpy references.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from mars_plugin import select_centroids  # noqa: E402

from mars_plugin.engines import kmeans_compiled
from mars_plugin.method.centroids import _cluster_groups, check_backend, image_centroids  # noqa: E402
from mars_plugin.engines.kmeans import seeding_trials  # noqa: E402

from test_select_centroids import assert_same_result, random_pairs  # noqa: E402

KW = dict(ignore_index=255, normalize=True, seed=0, max_iter=100, tol=1e-4, n_init=1)


def _pairs(seed, n=12):
    rng = np.random.default_rng(seed)
    return [(torch.from_numpy(f), torch.from_numpy(y)) for f, y in random_pairs(rng, n=n)]


def _blobs(seed, n_images=3, d=8, grid=40):
    """Images of two overlapping Gaussian blobs per class: Lloyd takes several steps, and
    after the first few only a handful of points move (the kernel's incremental update)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_images):
        y = rng.integers(0, 3, size=(grid, grid))
        centres = rng.normal(size=(3, 2, d))
        pick = rng.integers(0, 2, size=(grid, grid))
        f = centres[y, pick] + 0.8 * rng.normal(size=(grid, grid, d))
        out.append((torch.from_numpy(f.transpose(2, 0, 1).astype(np.float32)), torch.from_numpy(y)))
    return out


def _both(pairs, **kw):
    """The compiled result on float32 features and the torch result in float64."""
    f = [p[0] for p in pairs]
    y = [p[1] for p in pairs]
    args = dict(KW, **kw)
    got = _cluster_groups(f, y, backend="compiled", **args)
    ref = _cluster_groups([t.double() for t in f], y, backend="torch", **args)
    return got, ref


def _assert_groups_match(got, ref, atol=1e-5):
    assert torch.equal(got.image, ref.image) and torch.equal(got.label, ref.label)
    assert torch.equal(got.count, ref.count)
    assert got.centroids.dtype == torch.float32
    np.testing.assert_allclose(got.centroids.double().numpy(), ref.centroids.numpy(), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- same as torch
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k_fg,k_bg", [(2, 2), (3, 2), (1, 4)])
@pytest.mark.parametrize("max_iter", [1, 100])
def test_compiled_equals_torch_on_random_groups(seed, k_fg, k_bg, max_iter):
    # max_iter=1 isolates the k-means++ seeding and one Lloyd step; images of three grid sizes
    # and labels at twice the feature resolution go through the same paths as in MARS.
    got, ref = _both(_pairs(seed), k_fg=k_fg, k_bg=k_bg, max_iter=max_iter)
    _assert_groups_match(got, ref)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3])
def test_compiled_equals_torch_when_few_points_move(seed, k):
    pairs = _blobs(seed)
    got, ref = _both(pairs, k_fg=k, k_bg=k)
    _assert_groups_match(got, ref, atol=1e-5)
    # the problems did take several steps, so the incremental update was exercised
    x = pairs[0][0].reshape(8, -1).numpy()
    y = pairs[0][1].reshape(-1).numpy()
    cols = np.flatnonzero(y == 1)
    _, _, n_iter, _ = kmeans_compiled.kmeans_groups(
        np.ascontiguousarray(x), cols, np.array([0]), np.array([len(cols)]), np.array([k]),
        np.full((1, k, 3), 0.37), np.array([seeding_trials(k)]), normalize=True, max_iter=100, tol=1e-4)
    assert n_iter[0] >= 3


def test_compiled_equals_torch_without_normalisation():
    got, ref = _both(_pairs(7), k_fg=2, k_bg=2, normalize=False)
    _assert_groups_match(got, ref)


@pytest.mark.parametrize("k", [2, 3])
def test_degenerate_groups(k):
    # one pixel; every pixel identical; two distinct values for K = 3; a class present only at
    # ignored pixels: each gets min(K, distinct) centroids, as on the torch path.
    f = np.random.default_rng(0).normal(size=(4, 6, 6)).astype(np.float32)
    y = np.zeros((6, 6), dtype=np.int64)
    y[0, 0] = 1  # one pixel
    y[1, :] = 2
    f[:, 1, :] = f[:, 1, :1]  # class 2: six identical pixels
    y[2, :] = 3
    f[:, 2, ::2] = f[:, 2, :1]
    f[:, 2, 1::2] = f[:, 2, 1:2]  # class 3: two distinct pixels
    y[5, 5] = 255
    pairs = [(torch.from_numpy(f), torch.from_numpy(y))]
    got, ref = _both(pairs, k_fg=k, k_bg=2)
    _assert_groups_match(got, ref)
    counts = dict(zip(got.label.tolist(), got.count.tolist()))
    assert counts[1] == 1 and counts[2] == 1 and counts[3] == min(k, 2)


def test_image_with_only_ignored_pixels_has_no_group():
    pairs = _pairs(8, n=4)
    pairs[2] = (pairs[2][0], torch.full_like(pairs[2][1], 255))
    got, ref = _both(pairs, k_fg=2, k_bg=2)
    _assert_groups_match(got, ref)
    assert 2 not in got.image.tolist()


def test_select_centroids_compiled_equals_torch():
    pairs = _blobs(11, n_images=6) + _blobs(12, n_images=6)
    a = select_centroids(pairs, num_classes=2, backend="compiled", batch_size=5)
    b = select_centroids(pairs, num_classes=2, backend="torch", batch_size=5)
    assert_same_result(a, b, atol=1e-5)


# ----------------------------------------------------------------------------- invariances
def test_batch_and_threads_change_nothing():
    pairs = _pairs(20, n=14)
    f, y = [p[0] for p in pairs], [p[1] for p in pairs]
    ref = _cluster_groups(f, y, backend="compiled", k_fg=2, k_bg=2, **KW)
    # one image at a time
    alone = [_cluster_groups([f[i]], [y[i]], backend="compiled", k_fg=2, k_bg=2, **KW) for i in range(len(f))]
    assert torch.equal(torch.cat([a.centroids for a in alone]), ref.centroids)
    # one thread
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _cluster_groups(f, y, backend="compiled", k_fg=2, k_bg=2, **KW)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.centroids, ref.centroids)


def test_seed_changes_the_draws():
    pairs = _blobs(30, n_images=2)
    f, y = [p[0] for p in pairs], [p[1] for p in pairs]
    a = _cluster_groups(f, y, backend="compiled", k_fg=3, k_bg=3, **dict(KW, seed=0))
    b = _cluster_groups(f, y, backend="compiled", k_fg=3, k_bg=3, **dict(KW, seed=1))
    a2 = _cluster_groups(f, y, backend="compiled", k_fg=3, k_bg=3, **dict(KW, seed=0))
    assert torch.equal(a.centroids, a2.centroids)
    assert not torch.equal(a.centroids, b.centroids)


# ----------------------------------------------------------------------------- values checked
@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("ignored", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_feature_is_named_on_both_backends(backend, ignored, dtype):
    pairs = [(f.to(dtype), y) for f, y in _pairs(40, n=9)]
    f, y = pairs[6][0].clone(), pairs[6][1].clone()
    f[2, 3, 4] = np.nan
    if ignored:  # the pixel is clustered by nobody, but NaN is still an error
        y = y.clone()
        scale = y.shape[0] // f.shape[1]
        y[3 * scale : 4 * scale, 4 * scale : 5 * scale] = 255
    pairs[6] = (f, y)
    with pytest.raises(ValueError, match=r"samples\[6\]: features contains 1 NaN or Inf"):
        select_centroids(pairs, num_classes=6, batch_size=4, backend=backend)


# ----------------------------------------------------------------------------- choosing a backend
def test_backend_argument_is_checked(monkeypatch):
    pairs = _pairs(50, n=3)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'compiled', 'torch'\), got 'numba'"):
        select_centroids(pairs, num_classes=6, backend="numba")
    with pytest.raises(ValueError, match="backend='compiled' runs one seeding per problem, got n_init=3"):
        image_centroids(pairs[0][0], pairs[0][1], backend="compiled", n_init=3)
    with pytest.raises(ValueError, match="backend='compiled' runs on the CPU"):
        _cluster_groups([pairs[0][0]], [pairs[0][1]], backend="compiled", device="cuda", k_fg=2, k_bg=2, **KW)
    monkeypatch.setenv("MARS_NO_NUMBA", "1")
    with pytest.raises(ValueError, match=r"backend='compiled' needs numba"):
        check_backend("compiled")
    assert check_backend("auto") is None and check_backend("torch") == "torch"


@pytest.mark.parametrize("case,expect", [("float32", True), ("float64", False), ("n_init", False),
                                         ("no_numba", False)])
def test_auto_picks_compiled_only_where_it_applies(case, expect, monkeypatch):
    calls = []
    real = kmeans_compiled.kmeans_groups

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(kmeans_compiled, "kmeans_groups", spy)
    pairs = _pairs(60, n=3)
    kw = {}
    if case == "float64":
        pairs = [(f.double(), y) for f, y in pairs]
    if case == "n_init":
        kw["n_init"] = 2
    if case == "no_numba":
        monkeypatch.setenv("MARS_NO_NUMBA", "1")
    select_centroids(pairs, num_classes=6, **kw)
    assert bool(calls) == expect


def _kernel_args(n_groups=1, k=2, t=2):
    return dict(ks=np.full(n_groups, k), uniforms=np.full((n_groups, k, t), 0.4), trials=np.full(n_groups, t))


def test_kernel_checks_its_inputs():
    kw = dict(_kernel_args(), normalize=True, max_iter=10, tol=1e-4)
    x = np.zeros((3, 4), dtype=np.float32)
    one = (np.arange(4), np.array([0]), np.array([4]))
    msg = r"images\[0\] must be a \(D, P\) float32 or float16 array, got "
    with pytest.raises(ValueError, match=msg + r"float64 \(3, 4\)"):
        kmeans_compiled.kmeans_groups(np.zeros((3, 4)), *one, **kw)
    with pytest.raises(ValueError, match=msg + r"float32 \(12,\)"):
        kmeans_compiled.kmeans_groups(np.zeros(12, dtype=np.float32), *one, **kw)
    with pytest.raises(ValueError, match=r"images\[1\] is float16 \(D=3\), but images\[0\] is float32 \(D=3\)"):
        kmeans_compiled.kmeans_groups([x, x.astype(np.float16)], *one, **kw)
    with pytest.raises(ValueError, match=r"images\[1\] is float32 \(D=2\), but images\[0\] is float32 \(D=3\)"):
        kmeans_compiled.kmeans_groups([x, x[:2]], *one, **kw)
    with pytest.raises(ValueError, match="images must hold at least one"):
        kmeans_compiled.kmeans_groups([], *one, **kw)
    # every index the kernel will follow into raw memory is checked first
    with pytest.raises(ValueError, match="order holds a column outside its group's image"):
        kmeans_compiled.kmeans_groups(x, np.array([0, 1, 2, 4]), np.array([0]), np.array([4]), **kw)
    with pytest.raises(ValueError, match="order holds a column outside its group's image"):
        kmeans_compiled.kmeans_groups(x, np.array([0, -1, 2, 3]), np.array([0]), np.array([4]), **kw)
    with pytest.raises(ValueError, match=r"order holds a column outside"):  # fits images[0], not images[1]
        kmeans_compiled.kmeans_groups([x, x[:, :2].copy()], np.arange(4), np.array([0]), np.array([4]),
                                      image=np.array([1]), **kw)
    with pytest.raises(ValueError, match=r"image must index the 1 images, got values in \[1, 1\]"):
        kmeans_compiled.kmeans_groups(x, *one, image=np.array([1]), **kw)
    with pytest.raises(ValueError, match=r"image must have shape \(1,\), got \(2,\)"):
        kmeans_compiled.kmeans_groups(x, *one, image=np.array([0, 0]), **kw)
    with pytest.raises(ValueError, match=r"starts and sizes must describe slices of order \(length 4\)"):
        kmeans_compiled.kmeans_groups(x, np.arange(4), np.array([1]), np.array([4]), **kw)
    with pytest.raises(ValueError, match=r"starts and sizes must describe slices"):
        kmeans_compiled.kmeans_groups(x, np.arange(4), np.array([0]), np.array([0]), **kw)
    msg = r"ks must be in 1..2 and trials in 1..2 \(the uniforms' shape\), got ks in \[3, 3\]"
    with pytest.raises(ValueError, match=msg):
        kmeans_compiled.kmeans_groups(x, *one, **dict(kw, ks=np.array([3])))
    with pytest.raises(ValueError, match=r"ks and trials must have shape \(1,\) and uniforms \(1, Kmax, Tmax\)"):
        kmeans_compiled.kmeans_groups(x, *one, **dict(kw, uniforms=np.full((2, 2, 2), 0.4)))


def test_list_of_images_equals_one_call_per_image():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 30)).astype(np.float32)
    b = rng.normal(size=(5, 17)).astype(np.float32)
    # group 0 reads image 1 and group 1 image 0: groups need not come in image order
    order = np.concatenate([np.arange(17), np.arange(0, 30, 2)])
    kw = dict(normalize=True, max_iter=100, tol=1e-4)
    got = kmeans_compiled.kmeans_groups([a, b], order, np.array([0, 17]), np.array([17, 15]), image=np.array([1, 0]),
                                        **_kernel_args(2), **kw)
    one = kmeans_compiled.kmeans_groups(b, order[:17], np.array([0]), np.array([17]), **_kernel_args(), **kw)
    two = kmeans_compiled.kmeans_groups(a, order[17:], np.array([0]), np.array([15]), **_kernel_args(), **kw)
    for i in range(4):
        assert np.array_equal(got[i], np.concatenate([one[i], two[i]]))
    # a non-contiguous image is read as its contiguous copy
    wide = np.zeros((5, 60), dtype=np.float32)
    wide[:, ::2] = a
    view = kmeans_compiled.kmeans_groups(wide[:, ::2], order[17:], np.array([0]), np.array([15]), **_kernel_args(),
                                         **kw)
    assert np.array_equal(view[0], two[0])


@pytest.mark.parametrize("seed", range(3))
def test_float16_features_equal_float32_holding_the_same_values(seed):
    # The kernel widens float16 as it gathers; the result must be that of float32 input with the
    # same values, bit for bit, on the kernel and through select_centroids. Both dtypes run one
    # compiled specialisation without fastmath reassociation, so this holds also when the kernel
    # was compiled by an earlier process and loaded from numba's cache (test_determinism.py:
    # that case once failed here by ~3e-8 after `mars demo`).
    rng = np.random.default_rng(seed)
    half = [rng.normal(size=(6, n)).astype(np.float16) for n in (40, 25)]
    half[0][2, 5] = np.float16(6.0e-8)  # a subnormal half
    half[1][0, 3] = np.float16(-65504.0)  # the largest half
    order = np.concatenate([rng.permutation(40)[:30], rng.permutation(25)])
    args = (order, np.array([0, 30]), np.array([30, 25]))
    kw = dict(image=np.array([0, 1]), normalize=True, max_iter=100, tol=1e-4, **_kernel_args(2, k=3, t=3))
    got = kmeans_compiled.kmeans_groups(half, *args, **kw)
    ref = kmeans_compiled.kmeans_groups([h.astype(np.float32) for h in half], *args, **kw)
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)
    pairs = [(f.half(), y) for f, y in _pairs(seed + 60, n=8)]
    a = select_centroids(pairs, num_classes=6, batch_size=3, backend="compiled")
    b = select_centroids([(f.float(), y) for f, y in pairs], num_classes=6, batch_size=3, backend="compiled")
    assert_same_result(a, b, atol=0)


def test_nonfinite_pixels_matches_numpy():
    rng = np.random.default_rng(9)
    imgs = [rng.normal(size=(4, n)).astype(np.float16) for n in (12, 7)]
    imgs[0][1, 3] = np.nan
    imgs[1][3, 6] = np.inf
    imgs[1][0, 0] = -np.inf
    image = np.array([0, 0, 1, 1, 1, 0])
    pixel = np.array([3, 4, 6, 0, 5, 3])
    got = kmeans_compiled.nonfinite_pixels(imgs, image, pixel)
    ref = np.array([not np.isfinite(imgs[b][:, p]).all() for b, p in zip(image, pixel)])
    assert np.array_equal(got, ref) and ref.sum() == 4
    with pytest.raises(ValueError, match="pixel holds a column outside its image"):
        kmeans_compiled.nonfinite_pixels(imgs, np.array([1]), np.array([7]))


@pytest.mark.parametrize("seed", range(5))
def test_group_pixels_and_label_range_match_a_sort(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, size=6)  # an image may have no pixel at all
    sizes[2] = 0
    y = [rng.integers(0, 5, size=n) for n in sizes]
    y[1][:] = 255  # an image with only ignored pixels
    y[3][rng.random(sizes[3]) < 0.3] = 255
    flat = np.concatenate(y).astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    counts, order, ignored = kmeans_compiled.group_pixels(flat, offs, 255, 5)
    # reference: a stable sort of the (image, class) key, ignored pixels apart
    img = np.repeat(np.arange(len(sizes)), sizes)
    keep = flat != 255
    key = img[keep] * 5 + flat[keep]
    perm = np.argsort(key, kind="stable")
    local = (np.arange(flat.size) - offs[img])[keep]
    assert np.array_equal(order, local[perm])
    assert np.array_equal(ignored, np.flatnonzero(~keep))
    assert np.array_equal(counts, np.bincount(key, minlength=len(sizes) * 5).reshape(len(sizes), 5))
    flat[offs[4]] = -3  # label_range: min and max over each image's ids and 0
    lo, hi = kmeans_compiled.label_range(flat, offs, 255)
    for b in range(len(sizes)):
        ids = np.append(flat[offs[b] : offs[b + 1]], 0)
        ids = ids[ids != 255]
        assert (lo[b], hi[b]) == (ids.min(), ids.max())
    # ids outside the counts and bad offsets raise instead of writing or reading out of bounds
    with pytest.raises(ValueError, match=r"labels\[\d+\] is -3: expected 0..4 or ignore_index=255"):
        kmeans_compiled.group_pixels(flat, offs, 255, 5)
    flat[offs[4]] = 5
    with pytest.raises(ValueError, match=r"labels\[\d+\] is 5: expected 0..4"):
        kmeans_compiled.group_pixels(flat, offs, 255, 5)
    for bad in (offs[:-1], offs + 1, offs[::-1]):
        with pytest.raises(ValueError, match="offsets must rise from 0 to len"):
            kmeans_compiled.group_pixels(flat, bad, 255, 6)
        with pytest.raises(ValueError, match="offsets must rise from 0 to len"):
            kmeans_compiled.label_range(flat, bad, 255)
    with pytest.raises(ValueError, match=r"labels must be a \(P,\) integer array, got float64"):
        kmeans_compiled.label_range(flat.astype(float), offs, 255)


def test_mixed_dtypes_in_a_batch_are_widened_not_narrowed():
    # One float16 image among float32 ones: all are clustered in float32 (the float32 values
    # are not rounded to half precision).
    pairs = _pairs(70, n=5)
    pairs[2] = (pairs[2][0].half(), pairs[2][1])
    got, ref = _both(pairs, k_fg=2, k_bg=2)
    _assert_groups_match(got, ref)


@pytest.mark.parametrize("backend", ["compiled", "torch"])
def test_uint8_labels_compare_as_integers(backend):
    # torch compares a uint8 255 equal to -1; as an id it is class 255 on both backends.
    pairs = [(f, y.masked_fill(y == 255, 0).to(torch.uint8)) for f, y in _pairs(80, n=3)]
    ref = select_centroids([(f, y.long()) for f, y in pairs], num_classes=6, backend=backend, ignore_index=-1)
    got = select_centroids(pairs, num_classes=6, backend=backend, ignore_index=-1)
    assert_same_result(got, ref, atol=0)
    y = pairs[1][1].clone()
    y[0, 0] = 255
    pairs[1] = (pairs[1][0], y)
    with pytest.raises(ValueError, match=r"samples\[1\]: pseudo_label holds class 255 but num_classes=6"):
        select_centroids(pairs, num_classes=6, backend=backend, ignore_index=-1)
