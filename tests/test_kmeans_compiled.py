"""The compiled (numba) K-means backend against the batched torch backend.

The torch path is the reference: it is tested against scikit-learn and a plain Lloyd in
test_kmeans.py. Here the compiled kernel must give the same groups, the same number of
centroids and the same centroids (to float32 rounding: the torch side runs in float64) on the
same problems, including the degenerate ones; and its own invariances (batch == one by one,
thread count, chunking) must hold bit for bit.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import mars_plugin.centroids as centroids_mod  # noqa: E402
from mars_plugin import kmeans_compiled, select_centroids  # noqa: E402
from mars_plugin.centroids import _cluster_groups, check_backend, image_centroids  # noqa: E402
from mars_plugin.kmeans import seeding_trials  # noqa: E402

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
def test_batch_threads_and_chunks_change_nothing(monkeypatch):
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
    # one image per kernel call
    monkeypatch.setattr(centroids_mod, "_COMPILED_CHUNK_BYTES", 1)
    chunked = _cluster_groups(f, y, backend="compiled", k_fg=2, k_bg=2, **KW)
    assert torch.equal(chunked.centroids, ref.centroids) and torch.equal(chunked.count, ref.count)


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
def test_non_finite_feature_is_named_on_both_backends(backend, ignored, monkeypatch):
    monkeypatch.setattr(centroids_mod, "_COMPILED_CHUNK_BYTES", 2000)  # several chunks
    pairs = _pairs(40, n=9)
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


def test_kernel_rejects_other_dtypes_and_layouts():
    args = (np.arange(4), np.array([0]), np.array([4]), np.array([2]), np.zeros((1, 2, 2)), np.array([2]))
    kw = dict(normalize=True, max_iter=10, tol=1e-4)
    msg = r"x must be a \(D, P\) float32 array, or a flat one with bases/strides/dim, got "
    with pytest.raises(ValueError, match=msg + r"float64 \(3, 4\)"):
        kmeans_compiled.kmeans_groups(np.zeros((3, 4)), *args, **kw)
    with pytest.raises(ValueError, match=msg + r"float32 \(12,\)"):  # flat, but no bases
        kmeans_compiled.kmeans_groups(np.zeros(12, dtype=np.float32), *args, **kw)


def test_flat_buffer_equals_the_two_dimensional_layout():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 30)).astype(np.float32)
    b = rng.normal(size=(5, 17)).astype(np.float32)
    flat = np.concatenate([a.ravel(), b.ravel()])
    cols = np.concatenate([np.arange(0, 30, 2), np.arange(17)])
    common = (np.array([0, 15]), np.array([15, 17]), np.array([2, 2]), np.full((2, 2, 2), 0.4), np.array([2, 2]))
    kw = dict(normalize=True, max_iter=100, tol=1e-4)
    got = kmeans_compiled.kmeans_groups(flat, cols, *common, bases=np.array([0, a.size]), strides=np.array([30, 17]),
                                        dim=5, **kw)
    one = kmeans_compiled.kmeans_groups(a, cols[:15], np.array([0]), *(c[:1] for c in common[1:]), **kw)
    two = kmeans_compiled.kmeans_groups(b, cols[15:], np.array([0]), *(c[1:] for c in common[1:]), **kw)
    assert np.array_equal(got[0], np.concatenate([one[0], two[0]]))
    assert np.array_equal(got[1], np.concatenate([one[1], two[1]]))
