"""Tests of mars_plugin.engines.kmeans (batched K-means used by MARS Sec. 3.2).

Every property is checked against a plain numpy recomputation or scikit-learn on fresh random
data, for several seeds.
"""
import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits

from mars_plugin.engines.kmeans import batched_kmeans, kmeans

SEEDS = [0, 1, 2]


# ----------------------------------------------------------------------------- numpy references
def np_assign(x, c):
    """Nearest centroid (float64, explicit differences) and the resulting inertia."""
    x = np.asarray(x, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    d = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    lab = d.argmin(1)
    return lab, float(d[np.arange(len(x)), lab].sum())


def assert_lloyd_fixed_point(x, c, labels=None, inertia=None):
    """Each centroid is the mean of the points whose nearest centroid it is (and owns >= 1)."""
    x = np.asarray(x, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    lab, ref_inertia = np_assign(x, c)
    for j in range(len(c)):
        owned = x[lab == j]
        assert len(owned) >= 1, f"centroid {j} owns no point"
        np.testing.assert_allclose(c[j], owned.mean(0), rtol=0, atol=1e-5)
    if labels is not None:
        np.testing.assert_array_equal(np.asarray(labels), lab)
    if inertia is not None:
        np.testing.assert_allclose(float(inertia), ref_inertia, rtol=1e-5, atol=1e-8)


def blobs(rng, n, k, d, min_sep=10.0, spread=1.0):
    """Well-separated Gaussian blobs: centres at pairwise distance >= min_sep."""
    centres = []
    while len(centres) < k:
        c = rng.uniform(-25, 25, size=d)
        if all(np.linalg.norm(c - o) >= min_sep for o in centres):
            centres.append(c)
    centres = np.array(centres)
    assign = np.concatenate([np.arange(k), rng.integers(0, k, size=n - k)])
    return centres[assign] + spread * rng.normal(size=(n, d))


def pad(problems):
    """Pad a list of (N_b, D) arrays into a (B, Nmax, D) float64 tensor and a (B, Nmax) mask."""
    n_max = max(len(p) for p in problems)
    d = problems[0].shape[1]
    pts = torch.zeros(len(problems), n_max, d, dtype=torch.float64)
    mask = torch.zeros(len(problems), n_max, dtype=torch.bool)
    for b, p in enumerate(problems):
        pts[b, : len(p)] = torch.from_numpy(p)
        mask[b, : len(p)] = True
    return pts, mask


# ----------------------------------------------------------------------------- quality
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k,d", [(2, 2), (3, 5), (5, 3), (8, 16)])
def test_inertia_matches_sklearn_on_blobs(seed, k, d):
    rng = np.random.default_rng(1000 * seed + 10 * k + d)
    x = blobs(rng, 300, k, d)
    # one OpenMP thread: scikit-learn's and torch's thread pools otherwise fight (100x slower)
    with threadpool_limits(1):
        sk = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x).inertia_
    for dtype in (torch.float64, torch.float32):
        res = batched_kmeans(torch.tensor(x, dtype=dtype)[None], None, k, seeds=seed)
        assert int(res.valid.sum()) == k
        assert float(res.inertia[0]) <= sk * 1.01, (float(res.inertia[0]), sk)
        # a better-than-optimal inertia would mean a wrong inertia computation
        assert float(res.inertia[0]) >= sk * 0.99


# ----------------------------------------------------------------------------- Lloyd fixed point
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k,d,n", [(2, 3, 60), (4, 2, 200), (7, 5, 150)])
def test_result_is_lloyd_fixed_point(seed, k, d, n):
    rng = np.random.default_rng(seed * 7919 + k)
    x = rng.normal(size=(n, d))  # no cluster structure: many Lloyd steps
    res = batched_kmeans(torch.from_numpy(x)[None], None, k, seeds=seed, tol=0.0, max_iter=1000)
    assert res.n_iter < 1000
    assert res.valid[0].all()
    assert_lloyd_fixed_point(x, res.centroids[0].numpy(), res.labels[0].numpy(), res.inertia[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_labels_and_inertia_match_numpy_with_default_tol(seed):
    """Whatever iteration stopped, labels/inertia are those of the returned centroids."""
    rng = np.random.default_rng(seed + 50)
    problems = [rng.normal(size=(n, 3)) for n in (40, 400, 1000)]
    pts, mask = pad(problems)
    res = batched_kmeans(pts, mask, [2, 5, 8], seeds=[seed, seed + 1, seed + 2])
    for b, x in enumerate(problems):
        c = res.centroids[b][res.valid[b]].numpy()
        lab, inertia = np_assign(x, c)
        np.testing.assert_array_equal(res.labels[b, : len(x)].numpy(), lab)
        assert (res.labels[b, len(x):] == -1).all()
        np.testing.assert_allclose(float(res.inertia[b]), inertia, rtol=1e-6)


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("seed", SEEDS)
def test_deterministic_for_a_seed(seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(2, 120, 4)))
    a = batched_kmeans(x, None, [3, 6], seeds=[seed, seed + 9], n_init=2)
    b = batched_kmeans(x.clone(), None, [3, 6], seeds=[seed, seed + 9], n_init=2)
    assert torch.equal(a.centroids, b.centroids)
    assert torch.equal(a.valid, b.valid)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.inertia, b.inertia)
    assert torch.equal(kmeans(x[0], 3, seed=seed), kmeans(x[0].clone(), 3, seed=seed))


# ----------------------------------------------------------------------------- batch == alone
def _alone(x, k, seed, **kw):
    return batched_kmeans(torch.from_numpy(x)[None], None, k, seeds=seed, **kw)


def _check_batch_vs_alone(problems, ks, seeds, **kw):
    pts, mask = pad(problems)
    res = batched_kmeans(pts, mask, ks, seeds=seeds, **kw)
    # Padded to Kmax = min(max K, N): no row for a centroid that cannot exist.
    kmax = min(max(ks), max(len(x) for x in problems))
    assert res.centroids.shape == (len(problems), kmax, problems[0].shape[1])
    for b, (x, k, s) in enumerate(zip(problems, ks, seeds)):
        one = _alone(x, k, s, **kw)
        k_eff = int(one.valid.sum())
        assert k_eff == min(k, len(np.unique(x, axis=0)))
        kk = one.valid.shape[1]  # alone: min(k, len(x)) rows
        assert kk == min(k, len(x))
        np.testing.assert_array_equal(res.valid[b, :kk].numpy(), one.valid[0].numpy())
        assert not res.valid[b, kk:].any()
        assert (res.centroids[b, kk:] == 0).all()
        np.testing.assert_allclose(res.centroids[b, :kk].numpy(), one.centroids[0].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(res.labels[b, : len(x)].numpy(), one.labels[0].numpy())
        assert (res.labels[b, len(x):] == -1).all()
        np.testing.assert_allclose(float(res.inertia[b]), float(one.inertia[0]), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tol", [0.0, 1e-4])
def test_batch_equals_each_problem_alone(seed, tol):
    """Different N and different K per problem: padding and the other problems' K must not
    change any problem's result (k-means++ draws are per problem)."""
    rng = np.random.default_rng(seed + 100)
    ns = [5, 37, 300, 150, 1, 2]
    ks = [2, 8, 3, 6, 2, 5]
    problems = [rng.normal(size=(n, 2)) for n in ns]
    _check_batch_vs_alone(problems, ks, [seed * 31 + b for b in range(len(ns))], tol=tol)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_stopping_rule_is_per_problem(seed):
    """Large N with the default tol: a problem whose centroid shift falls under tol stops, even
    while its batch neighbours keep iterating (otherwise it would drift further than alone)."""
    rng = np.random.default_rng(seed + 200)
    problems = [rng.normal(size=(n, 2)) for n in (1200, 1200, 60)]
    _check_batch_vs_alone(problems, [6, 6, 6], [seed, seed + 1, seed + 2])


@pytest.mark.parametrize("seed", SEEDS)
def test_scattered_mask_equals_compacted_points(seed):
    """Padding may sit anywhere, not only at the end of a row."""
    rng = np.random.default_rng(seed + 7)
    n = 80
    x = rng.normal(size=(n, 3))
    keep = rng.random(n) < 0.6
    garbage = x.copy()
    garbage[~keep] = 1e6  # would dominate every mean if it leaked in
    res = batched_kmeans(torch.from_numpy(garbage)[None], torch.from_numpy(keep)[None], 3, seeds=seed)
    one = _alone(x[keep], 3, seed)
    np.testing.assert_allclose(res.centroids[0].numpy(), one.centroids[0].numpy(), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(res.labels[0, keep].numpy(), one.labels[0].numpy())
    assert (res.labels[0, ~keep] == -1).all()
    np.testing.assert_allclose(float(res.inertia[0]), float(one.inertia[0]), rtol=1e-6)


def test_empty_problem_in_batch():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 2))
    pts, mask = pad([x, x[:1]])
    mask[1] = False
    res = batched_kmeans(pts, mask, 2, seeds=[4, 5])
    assert not res.valid[1].any()
    assert (res.centroids[1] == 0).all()
    assert (res.labels[1] == -1).all()
    assert float(res.inertia[1]) == 0.0
    one = _alone(x, 2, 4)
    np.testing.assert_allclose(res.centroids[0].numpy(), one.centroids[0].numpy(), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- degenerate sets
def _sorted_rows(a):
    a = np.asarray(a, dtype=np.float64)
    return a[np.lexsort(a.T[::-1])]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("m,k", [(1, 2), (2, 2), (3, 5), (4, 9)])
def test_fewer_distinct_points_than_k(seed, m, k):
    rng = np.random.default_rng(seed * 13 + m)
    distinct = rng.normal(size=(m, 3))
    x = distinct[np.concatenate([np.arange(m), rng.integers(0, m, size=25)])]
    rng.shuffle(x)
    uniq = np.unique(x, axis=0)
    assert len(uniq) == m
    for dtype in (torch.float64, torch.float32):
        xt = torch.tensor(x, dtype=dtype)
        c = kmeans(xt, k, seed=seed)
        assert c.shape == (len(uniq), 3)
        np.testing.assert_allclose(_sorted_rows(c.numpy()), _sorted_rows(xt.numpy()[np.unique(x, axis=0, return_index=True)[1]]), atol=1e-6, rtol=0)
        res = batched_kmeans(xt[None], None, k, seeds=seed)
        assert int(res.valid.sum()) == len(uniq)
        # every point sits on its centroid; float32 |x|^2 - 2x.c + |c|^2 leaves rounding only
        tol = 1e-9 if dtype == torch.float64 else 1e-5 * len(x)
        assert float(res.inertia[0]) == pytest.approx(0.0, abs=tol)


@pytest.mark.parametrize("seed", SEEDS)
def test_all_identical_points(seed):
    rng = np.random.default_rng(seed)
    p = rng.normal(size=4)
    x = torch.from_numpy(np.tile(p, (17, 1)))
    c = kmeans(x, 3, seed=seed)
    assert c.shape == (1, 4)
    np.testing.assert_allclose(c[0].numpy(), p, atol=1e-12, rtol=0)
    res = batched_kmeans(x[None], None, 3, seeds=seed)
    assert res.valid[0].tolist() == [True, False, False]
    assert (res.labels[0] == 0).all()
    assert float(res.inertia[0]) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_duplicates_with_more_distinct_points_than_k(seed):
    rng = np.random.default_rng(seed + 77)
    distinct = rng.normal(size=(6, 2))
    x = distinct[rng.integers(0, 6, size=60)]
    x = np.concatenate([distinct, x])
    res = batched_kmeans(torch.from_numpy(x)[None], None, 4, seeds=seed, tol=0.0, max_iter=500)
    assert int(res.valid.sum()) == 4
    assert_lloyd_fixed_point(x, res.centroids[0].numpy(), res.labels[0].numpy(), res.inertia[0])


# ----------------------------------------------------------------------------- n_init
@pytest.mark.parametrize("seed", [1, 5, 12])
@pytest.mark.parametrize("n_init", [2, 4])
def test_n_init_never_worse(seed, n_init):
    rng = np.random.default_rng(seed + 9000)
    problems = [rng.normal(size=(n, 2)) for n in (30, 90, 150)]
    pts, mask = pad(problems)
    seeds = [seed, seed + 1, seed + 2]
    one = batched_kmeans(pts, mask, 5, seeds=seeds)
    many = batched_kmeans(pts, mask, 5, seeds=seeds, n_init=n_init)
    assert (many.inertia <= one.inertia * (1 + 1e-9) + 1e-12).all(), (many.inertia, one.inertia)
    for b, x in enumerate(problems):
        c = many.centroids[b][many.valid[b]].numpy()
        lab, inertia = np_assign(x, c)
        np.testing.assert_array_equal(many.labels[b, : len(x)].numpy(), lab)
        np.testing.assert_allclose(float(many.inertia[b]), inertia, rtol=1e-6)


# ----------------------------------------------------------------------------- argument checks
def test_bad_arguments():
    x = torch.randn(1, 10, 2)
    with pytest.raises(ValueError, match="points"):
        batched_kmeans(x[0], None, 2)
    with pytest.raises(ValueError, match="points"):
        batched_kmeans(x.long(), None, 2)
    with pytest.raises(ValueError, match="mask"):
        batched_kmeans(x, torch.ones(1, 9, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="k"):
        batched_kmeans(x, None, 0)
    with pytest.raises(TypeError, match="k"):
        batched_kmeans(x, None, True)
    with pytest.raises(ValueError, match="k"):
        batched_kmeans(x, None, [2, 2])
    with pytest.raises(ValueError, match="seeds"):
        batched_kmeans(x, None, 2, seeds=[1, 2])
    with pytest.raises(ValueError, match="n_init"):
        batched_kmeans(x, None, 2, n_init=0)
    with pytest.raises(ValueError, match="max_iter"):
        batched_kmeans(x, None, 2, max_iter=0)
    with pytest.raises(ValueError, match="points"):
        kmeans(x, 2)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("seed", SEEDS)
def test_cuda_matches_cpu(seed):
    rng = np.random.default_rng(seed + 4242)
    problems = [blobs(rng, n, 3, 4) for n in (50, 200, 120)]
    pts, mask = pad(problems)
    cpu = batched_kmeans(pts, mask, [2, 3, 4], seeds=[seed, seed + 1, seed + 2], tol=0.0)
    gpu = batched_kmeans(pts.cuda(), mask.cuda(), [2, 3, 4], seeds=[seed, seed + 1, seed + 2], tol=0.0)
    assert gpu.centroids.is_cuda
    np.testing.assert_array_equal(gpu.valid.cpu().numpy(), cpu.valid.numpy())
    np.testing.assert_allclose(gpu.centroids.cpu().numpy(), cpu.centroids.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(gpu.labels.cpu().numpy(), cpu.labels.numpy())
    np.testing.assert_allclose(gpu.inertia.cpu().numpy(), cpu.inertia.numpy(), rtol=1e-5)


# ----------------------------------------------------------------------------- the K = 2 loop
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tol", [0.0, 1e-4])
def test_two_centroid_loop_equals_general_loop(seed, tol):
    """Problems with K = 2 take a dedicated two-centroid loop when the whole batch has K = 2.
    Adding one K = 3 problem sends the same problems through the general loop; since a
    problem's result never depends on its batch, the two must agree."""
    rng = np.random.default_rng(seed + 300)
    probs = [rng.normal(size=(int(rng.integers(3, 60)), 5)) for _ in range(9)]
    probs.append(np.repeat(rng.normal(size=(1, 5)), 4, axis=0))  # one distinct point: 1 centroid
    probs.append(np.concatenate([np.zeros((3, 5)), np.ones((2, 5))]))  # exactly 2 distinct points
    probs.append(blobs(rng, 40, 2, 5))
    seeds = [int(s) for s in rng.integers(0, 1000, size=len(probs))]
    pts, mask = pad(probs)
    two = batched_kmeans(pts, mask, 2, seeds=seeds, tol=tol)
    extra = rng.normal(size=(30, 5))
    pts3, mask3 = pad(probs + [extra])
    general = batched_kmeans(pts3, mask3, [2] * len(probs) + [3], seeds=seeds + [7], tol=tol)
    n = len(probs)
    assert torch.equal(two.valid, general.valid[:n, :2]) and not general.valid[:n, 2].any()
    torch.testing.assert_close(two.centroids, general.centroids[:n, :2], atol=1e-10, rtol=0)
    assert torch.equal(two.labels, general.labels[:n, : two.labels.shape[1]])
    assert two.valid[n - 3].tolist() == [True, False] and two.valid[n - 2].tolist() == [True, True]
    for b, p in enumerate(probs):
        assert_lloyd_fixed_point(p, two.centroids[b][two.valid[b]].numpy())

