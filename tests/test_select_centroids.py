"""Tests of mars_plugin.method.selection: debiased centroids, MARS Sec. 3.2 Eq. 1-3.

The numpy reference below implements Eq. 1-3 literally: the pairwise mean of cosine distances
to ALL background centroids (no mean-direction shortcut), a stable descending sort and the
average of the first ceil(alpha * N) candidates, with ceil taken in exact rational arithmetic.
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mars_plugin.method.centroids import ImageCentroids, image_centroids
from mars_plugin.method.selection import DebiasedCentroids, background_distance, num_selected, select_centroids

SEEDS = [0, 1, 2, 3]
IGNORE = 255


# ----------------------------------------------------------------------------- numpy reference
def np_ceil_alpha(n, alpha):
    """ceil(n * alpha) of Eq. 2, alpha read as the decimal the user typed."""
    return math.ceil(Fraction(str(alpha)) * n)


def np_unit(a):
    a = np.asarray(a, dtype=np.float64)
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def np_eq1(v, bg):
    """Eq. 1: dist(v_k) = 1/N_bg sum_j (1 - cos(v_k, b_j)) / 2, explicit over all pairs."""
    v = np.asarray(v, dtype=np.float64)
    bg = np.asarray(bg, dtype=np.float64)
    out = np.zeros(len(v))
    for k in range(len(v)):
        total = 0.0
        for j in range(len(bg)):
            cos = v[k] @ bg[j] / (np.linalg.norm(v[k]) * np.linalg.norm(bg[j]))
            total += (1.0 - cos) / 2.0
        out[k] = total / len(bg)
    return out


def np_select(ics, num_classes, alpha):
    """Eq. 1-3 from a list of ImageCentroids (stream order kept)."""
    d = ics[0].dim
    bg = np.concatenate([ic.bg.double().numpy() for ic in ics if ic.bg.shape[0]])
    cands = {}
    for ic in ics:
        for c, v in ic.fg.items():
            cands.setdefault(int(c), []).extend(v.double().numpy())
    out = dict(
        centroids=np.zeros((num_classes + 1, d)),
        valid=np.zeros(num_classes + 1, dtype=bool),
        num_candidates=np.zeros(num_classes + 1, dtype=np.int64),
        num_selected=np.zeros(num_classes + 1, dtype=np.int64),
        cut_distance=np.full(num_classes + 1, np.nan),
        background_mean=np_unit(bg).mean(0),
    )
    out["num_candidates"][0] = len(bg)
    for c, rows in cands.items():
        v = np.array(rows)
        dist = np_eq1(v, bg)
        order = np.argsort(-dist, kind="stable")  # descending, ties in stream order (Eq. 3)
        k = np_ceil_alpha(len(v), alpha)
        out["centroids"][c] = v[order[:k]].mean(0)  # Eq. 2
        out["valid"][c] = True
        out["num_candidates"][c] = len(v)
        out["num_selected"][c] = k
        out["cut_distance"][c] = dist[order[k - 1]]
    return out


def assert_matches(res, ref, atol=1e-5):
    assert isinstance(res, DebiasedCentroids)
    np.testing.assert_allclose(res.centroids.numpy(), ref["centroids"], atol=atol, rtol=0)
    np.testing.assert_array_equal(res.valid.numpy(), ref["valid"])
    np.testing.assert_array_equal(res.num_candidates.numpy(), ref["num_candidates"])
    np.testing.assert_array_equal(res.num_selected.numpy(), ref["num_selected"])
    np.testing.assert_allclose(res.cut_distance.numpy(), ref["cut_distance"], atol=atol, rtol=0)
    np.testing.assert_allclose(res.background_mean.numpy(), ref["background_mean"], atol=atol, rtol=0)


def assert_same_result(a, b, atol=1e-5):
    np.testing.assert_allclose(a.centroids.numpy(), b.centroids.numpy(), atol=atol, rtol=0)
    np.testing.assert_array_equal(a.valid.numpy(), b.valid.numpy())
    np.testing.assert_array_equal(a.num_candidates.numpy(), b.num_candidates.numpy())
    np.testing.assert_array_equal(a.num_selected.numpy(), b.num_selected.numpy())
    np.testing.assert_allclose(a.cut_distance.numpy(), b.cut_distance.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(a.background_mean.numpy(), b.background_mean.numpy(), atol=atol, rtol=0)
    assert a.num_images == b.num_images


def random_image_centroids(rng, n_images=9, d=5, used_classes=(1, 2, 3, 4, 5), p_bg=0.7):
    """Random precomputed centroids: random counts per class, some images without background."""
    ics = []
    for i in range(n_images):
        has_bg = i == 0 or rng.random() < p_bg
        bg = rng.normal(size=(int(rng.integers(1, 4)) if has_bg else 0, d))
        fg = {}
        for c in used_classes:
            if rng.random() < 0.6:
                fg[c] = torch.tensor(rng.normal(size=(int(rng.integers(1, 4)), d)), dtype=torch.float32)
        ics.append(ImageCentroids(fg, torch.tensor(bg, dtype=torch.float32)))
    rng.shuffle(ics)  # the image with background is not always first
    return ics


def random_pair(rng, d=6, h=10, w=8, classes=(0, 1, 2), label_scale=1):
    f = rng.normal(size=(d, h, w)).astype(np.float32)
    y = rng.choice(np.array(classes), size=(h * label_scale, w * label_scale))
    y[rng.random(y.shape) < 0.05] = IGNORE
    return f, y


def random_pairs(rng, n=7):
    class_sets = [(0, 1, 2), (0, 3), (2, 4), (0, 1, 4, 5), (0,), (1, 3), (0, 2, 5)]
    sizes = [(10, 8), (12, 12), (9, 11)]
    out = []
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        out.append(random_pair(rng, h=h, w=w, classes=class_sets[i % len(class_sets)], label_scale=1 + i % 2))
    return out


# ----------------------------------------------------------------------------- Eq. 1
@pytest.mark.parametrize("seed", SEEDS)
def test_eq1_mean_direction_identity(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(2, 9))
    v = rng.normal(size=(int(rng.integers(1, 12)), d)) * rng.uniform(0.1, 10, size=(1, 1))
    bg = rng.normal(size=(int(rng.integers(1, 30)), d)) * rng.uniform(0.01, 100, size=(1, 1))
    bg_mean = torch.from_numpy(np_unit(bg).mean(0))
    got = background_distance(torch.from_numpy(v), bg_mean)
    assert got.dtype == torch.float64 and got.shape == (len(v),)
    np.testing.assert_allclose(got.numpy(), np_eq1(v, bg), atol=1e-5, rtol=0)
    assert (got >= 0).all() and (got <= 1).all()
    # float32 inputs too
    got32 = background_distance(torch.from_numpy(v).float(), bg_mean.float())
    np.testing.assert_allclose(got32.numpy(), np_eq1(v, bg), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- Eq. 1-3 reference
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.4, 0.25, 0.7, 1.0, 0.01, 0.999])
def test_matches_numpy_reference(seed, alpha):
    rng = np.random.default_rng(seed * 100 + int(alpha * 1000))
    # 7 classes: 1..5 used at random, 6 and 7 absent everywhere
    ics = random_image_centroids(rng, n_images=int(rng.integers(4, 12)))
    res = select_centroids(iter(ics), num_classes=7, alpha=alpha)
    ref = np_select(ics, 7, alpha)
    assert_matches(res, ref)
    assert res.num_images == len(ics)
    assert not res.valid[0] and not res.valid[6] and not res.valid[7]
    assert res.num_classes == 7 and res.dim == 5
    assert res.config["alpha"] == alpha


@pytest.mark.parametrize("seed", SEEDS)
def test_pairs_match_numpy_reference(seed):
    """From (features, label) pairs: Eq. 1-3 over the centroids image_centroids gives."""
    rng = np.random.default_rng(seed + 500)
    pairs = random_pairs(rng)
    res = select_centroids(pairs, num_classes=6, alpha=0.4, seed=seed)
    ics = [image_centroids(f, y, seed=seed) for f, y in pairs]
    assert_matches(res, np_select(ics, 6, 0.4))
    assert not res.valid[6]


# ----------------------------------------------------------------------------- ceil(alpha N)
def test_num_selected_exact_ceil():
    assert num_selected(10, 0.7) == 7  # 10 * 0.7 == 7.000000000000001 in floats
    assert num_selected(10, 1.0) == 10
    assert num_selected(0, 0.4) == 0
    for n in range(1, 61):
        for tenths in range(1, 11):
            alpha = tenths / 10
            assert num_selected(n, alpha) == np_ceil_alpha(n, alpha), (n, alpha)
        for alpha in (0.05, 0.15, 0.33, 0.35, 0.45, 0.55, 0.65, 0.85, 0.95, 0.001):
            assert num_selected(n, alpha) == np_ceil_alpha(n, alpha), (n, alpha)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha,expected", [(0.7, 7), (1.0, 10), (0.1, 1), (0.3, 3), (0.35, 4)])
def test_ceil_through_select_centroids(seed, alpha, expected):
    rng = np.random.default_rng(seed + 900)
    ics = [ImageCentroids({1: torch.tensor(rng.normal(size=(2, 4)), dtype=torch.float32)},
                          torch.tensor(rng.normal(size=(2, 4)), dtype=torch.float32)) for _ in range(5)]
    res = select_centroids(ics, num_classes=1, alpha=alpha)
    assert int(res.num_candidates[1]) == 10
    assert int(res.num_selected[1]) == expected
    ref = np_select(ics, 1, alpha)
    assert ref["num_selected"][1] == expected
    assert_matches(res, ref)
    if alpha == 1.0:
        all_v = np.concatenate([ic.fg[1].double().numpy() for ic in ics])
        np.testing.assert_allclose(res.centroids[1].numpy(), all_v.mean(0), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- ties
def _tie_stream():
    """Background direction e0. A, B, C all have cos 0.6 with e0 (distance 0.2, exactly tied)
    but differ elsewhere; FAR has distance 0.8, NEAR distance 0."""
    e0 = [1.0, 0.0, 0.0, 0.0]
    A = [3.0, 4.0, 0.0, 0.0]
    B = [3.0, 0.0, 4.0, 0.0]
    C = [3.0, 0.0, 0.0, 4.0]
    FAR = [-3.0, 4.0, 0.0, 0.0]
    NEAR = [5.0, 0.0, 0.0, 0.0]
    t = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    images = [
        ImageCentroids({1: t([A, FAR])}, t([e0, [2.0, 0, 0, 0]])),
        ImageCentroids({1: t([B])}, t([[0.5, 0, 0, 0]])),
        ImageCentroids({1: t([C, NEAR])}, t([[7.0, 0, 0, 0]])),
    ]
    return images, dict(A=A, B=B, C=C, FAR=FAR, NEAR=NEAR)


@pytest.mark.parametrize("alpha,forward,backward", [
    (0.6, ["FAR", "A", "B"], ["FAR", "C", "B"]),
    (0.4, ["FAR", "A"], ["FAR", "C"]),
    (0.8, ["FAR", "A", "B", "C"], ["FAR", "C", "B", "A"]),
])
def test_ties_keep_stream_order(alpha, forward, backward):
    images, v = _tie_stream()
    d = background_distance(torch.tensor([v["A"], v["B"], v["C"]]), torch.tensor([1.0, 0, 0, 0]))
    assert d[0] == d[1] == d[2]  # the construction really ties
    for stream, chosen in ((images, forward), (images[::-1], backward)):
        res = select_centroids(stream, num_classes=1, alpha=alpha)
        assert int(res.num_selected[1]) == len(chosen)
        expected = np.mean([v[name] for name in chosen], axis=0)
        np.testing.assert_allclose(res.centroids[1].numpy(), expected, atol=1e-6, rtol=0)
        assert_matches(res, np_select(list(stream), 1, alpha))
    # forward and backward differ exactly where the tie is broken
    if set(forward) != set(backward):
        a = select_centroids(images, num_classes=1, alpha=alpha).centroids[1]
        b = select_centroids(images[::-1], num_classes=1, alpha=alpha).centroids[1]
        assert not torch.allclose(a, b)


# ----------------------------------------------------------------------------- streaming
class CountingIterable:
    """An iterable without len(): counts how often it is iterated and how many items it gave."""

    def __init__(self, items):
        self.items = items
        self.iter_calls = 0
        self.yielded = 0

    def __iter__(self):
        self.iter_calls += 1
        for x in self.items:
            self.yielded += 1
            yield x


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_generator_consumed_exactly_once(seed):
    rng = np.random.default_rng(seed + 40)
    pairs = random_pairs(rng, n=6)
    ref = select_centroids(list(pairs), num_classes=6, seed=seed)

    src = CountingIterable(pairs)
    res = select_centroids(src, num_classes=6, seed=seed)
    assert src.iter_calls == 1 and src.yielded == len(pairs)
    assert_same_result(res, ref)

    pulled = []

    def gen():
        for p in pairs:
            pulled.append(1)
            yield p

    g = gen()
    res = select_centroids(g, num_classes=6, seed=seed, batch_size=4)
    assert len(pulled) == len(pairs)
    assert next(g, None) is None  # exhausted, nothing left for a second pass
    assert_same_result(res, ref)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_pairs_precomputed_and_mixed_streams_agree(seed):
    rng = np.random.default_rng(seed + 60)
    pairs = random_pairs(rng)
    kw = dict(k_fg=2, k_bg=3, seed=seed)
    ics = [image_centroids(torch.from_numpy(f), torch.from_numpy(y), **kw) for f, y in pairs]
    mixed = [ics[i] if i % 2 else pairs[i] for i in range(len(pairs))]
    a = select_centroids(pairs, num_classes=6, alpha=0.5, **kw)
    b = select_centroids(ics, num_classes=6, alpha=0.5, **kw)
    c = select_centroids((s for s in mixed), num_classes=6, alpha=0.5, batch_size=2, **kw)
    assert_same_result(a, b)
    assert_same_result(a, c)
    assert a.num_images == len(pairs)
    assert a.config == dict(alpha=0.5, k_fg=2, k_bg=3, normalize=True, seed=seed)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_batch_size_does_not_change_result(seed):
    rng = np.random.default_rng(seed + 80)
    pairs = random_pairs(rng)
    results = [select_centroids(pairs, num_classes=6, batch_size=bs, seed=seed) for bs in (1, 2, 3, 100)]
    for r in results[1:]:
        assert_same_result(results[0], r)


# ----------------------------------------------------------------------------- result object
def test_never_seen_class_is_invalid():
    rng = np.random.default_rng(5)
    pairs = [random_pair(rng, classes=(0, 1, 2)) for _ in range(3)]
    res = select_centroids(pairs, num_classes=5)
    assert res.valid.tolist() == [False, True, True, False, False, False]
    for c in (0, 3, 4, 5):
        assert (res.centroids[c] == 0).all()
        assert math.isnan(float(res.cut_distance[c]))
    assert res.num_candidates[3:].tolist() == [0, 0, 0]
    assert res.num_selected.tolist()[3:] == [0, 0, 0] and int(res.num_selected[0]) == 0
    assert int(res.num_candidates[0]) == 3 * 2  # 3 images x K_bg = 2 background centroids
    assert res.centroids.dtype == torch.float32 and res.cut_distance.dtype == torch.float64


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_save_load_round_trip(tmp_path, seed):
    rng = np.random.default_rng(seed + 70)
    res = select_centroids(random_image_centroids(rng), num_classes=7, alpha=0.3, seed=seed)
    path = tmp_path / "nested" / "centroids.pt"
    res.save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["centroids.pt"]  # no temp file left
    back = DebiasedCentroids.load(path)
    for name in ("centroids", "valid", "num_candidates", "num_selected", "cut_distance", "background_mean"):
        x, y = getattr(res, name), getattr(back, name)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.numpy(), y.numpy())  # NaN == NaN here
    assert back.num_images == res.num_images
    assert back.config == res.config
    res.save(str(path))  # overwrite through a str path
    assert DebiasedCentroids.load(str(path)).num_classes == 7


def test_load_refuses_foreign_files(tmp_path):
    p1 = tmp_path / "other.pt"
    torch.save({"format": "something-else", "centroids": torch.zeros(2, 2)}, p1)
    with pytest.raises(ValueError, match="not a mars-plugin centroid file"):
        DebiasedCentroids.load(p1)
    p2 = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), p2)
    with pytest.raises(ValueError, match="not a mars-plugin centroid file"):
        DebiasedCentroids.load(p2)


# ----------------------------------------------------------------------------- bad input
def _ok_pair(d=4, h=6, w=5):
    rng = np.random.default_rng(0)
    f = rng.normal(size=(d, h, w)).astype(np.float32)
    y = np.zeros((h, w), dtype=np.int64)
    y[:2] = 1
    return f, y


def test_bad_feature_and_label_inputs():
    f, y = _ok_pair()
    with pytest.raises(ValueError, match="features"):
        select_centroids([(f[0], y)], num_classes=3)
    with pytest.raises(ValueError, match="features"):
        select_centroids([(f[None, None], y)], num_classes=3)
    with pytest.raises(ValueError, match="pseudo_label"):
        select_centroids([(f, y[None])], num_classes=3)
    with pytest.raises(ValueError, match="pseudo_label"):
        select_centroids([(f, y[0])], num_classes=3)
    for bad_value in (np.nan, np.inf, -np.inf):
        bad = f.copy()
        bad[1, 2, 3] = bad_value
        with pytest.raises(ValueError, match=r"samples\[1\].*features"):
            select_centroids([(f, y), (bad, y)], num_classes=3)
    big = y.copy()
    big[3, 3] = 4
    with pytest.raises(ValueError, match="num_classes"):
        select_centroids([(f, big)], num_classes=3)
    neg = y.copy()
    neg[3, 3] = -1  # -1 (biased) exists only in debiased labels, never in pseudo labels
    with pytest.raises(ValueError, match="pseudo_label"):
        select_centroids([(f, neg)], num_classes=3)


def test_bad_samples():
    f, y = _ok_pair()
    with pytest.raises(ValueError, match="samples"):
        select_centroids([], num_classes=3)
    with pytest.raises(ValueError, match="samples"):
        select_centroids(iter(()), num_classes=3)
    with pytest.raises(TypeError, match=r"samples\[1\]"):
        select_centroids([(f, y), (f, y, y)], num_classes=3)
    with pytest.raises(TypeError, match=r"samples\[0\]"):
        select_centroids([f], num_classes=3)
    with pytest.raises(TypeError, match="samples"):
        select_centroids(torch.zeros(3), num_classes=3)
    with pytest.raises(TypeError, match="samples"):
        select_centroids(5, num_classes=3)
    no_bg = np.ones_like(y)
    with pytest.raises(ValueError, match="background"):
        select_centroids([(f, no_bg), (f, np.full_like(y, IGNORE))], num_classes=3)
    with pytest.raises(ValueError, match="samples"):
        select_centroids([(f, no_bg)], num_classes=3)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_mismatched_embedding_size(batch_size):
    f, y = _ok_pair(d=4)
    g, _ = _ok_pair(d=5)
    with pytest.raises(ValueError, match="features"):
        select_centroids([(f, y), (g, y)], num_classes=3, batch_size=batch_size)
    ic4 = image_centroids(f, y)
    with pytest.raises(ValueError, match=r"samples\[1\]"):
        select_centroids([ic4, (g, y)], num_classes=3, batch_size=batch_size)


def test_bad_parameters():
    pairs = [_ok_pair()]
    for alpha in (0, 0.0, -0.1, 1.5, 1.0000001):
        with pytest.raises(ValueError, match="alpha"):
            select_centroids(pairs, num_classes=3, alpha=alpha)
    for alpha in (float("nan"), float("inf"), "0.4", None, True):
        with pytest.raises(TypeError, match="alpha"):
            select_centroids(pairs, num_classes=3, alpha=alpha)
    with pytest.raises(ValueError, match="k_fg"):
        select_centroids(pairs, num_classes=3, k_fg=0)
    with pytest.raises(ValueError, match="k_bg"):
        select_centroids(pairs, num_classes=3, k_bg=0)
    with pytest.raises(ValueError, match="num_classes"):
        select_centroids(pairs, num_classes=0)
    with pytest.raises(ValueError, match="batch_size"):
        select_centroids(pairs, num_classes=3, batch_size=0)
    for name, kw in [("num_classes", dict(num_classes=True)), ("k_fg", dict(num_classes=3, k_fg=True)),
                     ("k_bg", dict(num_classes=3, k_bg=False)), ("batch_size", dict(num_classes=3, batch_size=True)),
                     ("num_classes", dict(num_classes=3.0)), ("k_fg", dict(num_classes=3, k_fg=2.0))]:
        with pytest.raises(TypeError, match=name):
            select_centroids(pairs, **kw)
