"""Finite features whose squared norm overflows are normalised correctly everywhere.

Values of 1e20 square to 1e40, past float32's 3.4e38; float16 overflows from 256 on. A plain
|x| = sqrt(sum x^2) is then inf and the normalised vector zero. Every place that L2-normalises
(K-means with ``normalize``, Eq. 1 distances, Eq. 4 similarity) must agree with a float64
reference computed on the same values.
"""
import numpy as np
import pytest
import torch

from mars_plugin import debiased_similarity, image_centroids

from mars_plugin.engines import kmeans_compiled
from mars_plugin.engines.kmeans import l2_norm, l2_normalize
from mars_plugin.method.selection import background_distance, select_centroids

from test_debias import make_centroids, np_similarity
from test_select_centroids import assert_same_result, np_eq1, random_pair

BACKENDS = ["torch"] + (["compiled"] if kmeans_compiled.available() else [])


@pytest.mark.parametrize("scale", [1e20, 3e37, 1e-30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_l2_helpers_match_float64_reference(scale, dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 16))
    x[3] = 0.0  # a zero vector stays zero
    t = (torch.from_numpy(x) * scale).to(dtype)
    ref = t.double().numpy()  # the same (rounded) values, in float64 / Python's exact scaling
    m = np.abs(ref).max(1, keepdims=True)
    m[m == 0] = 1
    ref_norm = np.linalg.norm(ref / m, axis=1, keepdims=True) * m
    np.testing.assert_allclose(l2_norm(t, dim=1).double().numpy(), ref_norm[:, 0], rtol=1e-6)
    ref_unit = ref / np.maximum(ref_norm, 1e-12)
    np.testing.assert_allclose(l2_normalize(t, dim=1).double().numpy(), ref_unit, rtol=0, atol=1e-6)
    if scale > 1:
        assert (l2_normalize(t, dim=1).norm(dim=1)[[0, 1, 2, 4, 5, 6]] - 1).abs().max() < 1e-6


def test_l2_normalize_float16_near_max():
    x = torch.full((2, 64), 65504.0, dtype=torch.float16)
    x[1, ::2] = -60000.0
    got = l2_normalize(x, dim=1)
    ref = x.double() / x.double().norm(dim=1, keepdim=True)
    np.testing.assert_allclose(got.double().numpy(), ref.numpy(), atol=1e-6, rtol=0)


def _huge_pairs(seed, scale, n=4, dtype=np.float32):
    rng = np.random.default_rng(seed)
    out = []
    for cs in [(0, 1, 2), (0, 2, 3), (0, 1, 3), (0, 1, 2, 3)][:n]:
        f, y = random_pair(rng, d=8, h=8, w=6, classes=cs)
        out.append((torch.from_numpy((f.astype(np.float64) * scale).astype(dtype)), torch.from_numpy(y)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e20, 1e37])
def test_image_centroids_huge_values_equal_float64_reference(backend, scale):
    pairs = _huge_pairs(0, scale)
    f = torch.stack([p[0] for p in pairs])
    y = torch.stack([p[1] for p in pairs])
    got = image_centroids(f, y, backend=backend)
    # Reference: the same float32 values in float64 (no overflow there), torch backend.
    ref = image_centroids(f.double(), y, backend="torch")
    for g, r in zip(got, ref):
        assert sorted(g.fg) == sorted(r.fg)
        for c in r.fg:
            np.testing.assert_allclose(g.fg[c].double().numpy(), r.fg[c].numpy(), atol=1e-5, rtol=0)
            assert (g.fg[c].norm(dim=1) > 0.1).all()  # not the zero vectors of an overflowed norm
        np.testing.assert_allclose(g.bg.double().numpy(), r.bg.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_centroids_huge_values_equal_float64_reference(backend):
    pairs = _huge_pairs(1, 1e20)
    got = select_centroids(pairs, num_classes=3, backend=backend)
    ref = select_centroids([(f.double(), y) for f, y in pairs], num_classes=3, backend="torch")
    assert_same_result(got, ref, atol=1e-5)
    assert bool(got.valid[1:].all())


def test_select_centroids_huge_float16_near_max():
    # float16 features near 65504: |x|^2 over D overflows float16 but not the float32 work dtype.
    pairs = [(torch.from_numpy(np.clip(f.numpy() * 3e4, -65504, 65504)).half(), y) for f, y in _huge_pairs(2, 1.0)]
    got = select_centroids(pairs, num_classes=3)
    ref = select_centroids([(f.double(), y) for f, y in pairs], num_classes=3, backend="torch")
    assert_same_result(got, ref, atol=1e-5)


def test_background_distance_huge_float64_candidates():
    rng = np.random.default_rng(3)
    v, bg = rng.normal(size=(5, 6)), rng.normal(size=(9, 6))
    bg_mean = torch.from_numpy((bg / np.linalg.norm(bg, axis=1, keepdims=True)).mean(0))
    got = background_distance(torch.from_numpy(v * 1e300), bg_mean)  # |v|^2 overflows float64
    np.testing.assert_allclose(got.numpy(), np_eq1(v, bg), atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", ["float32-1e20", "float32-3e37", "float16-6e4"])
def test_debiased_similarity_huge_features_equal_float64_reference(case):
    dtype, scale = {"float32-1e20": (np.float32, 1e20), "float32-3e37": (np.float32, 3e37),
                    "float16-6e4": (np.float16, 6e4 / 4)}[case]
    rng = np.random.default_rng(5)
    D, C = 16, 3
    V = rng.normal(size=(C + 1, D))
    valid = np.array([False, True, True, True])
    f = np.clip(rng.normal(size=(D, 5, 6)) * scale, -65504 if dtype == np.float16 else -np.inf,
                65504 if dtype == np.float16 else np.inf).astype(dtype)
    got = debiased_similarity(torch.from_numpy(f), make_centroids(V, valid), [1, 3])
    ref = np_similarity(f.astype(np.float64), V.astype(np.float32).astype(np.float64), valid, [1, 3])
    np.testing.assert_allclose(got.double().numpy(), ref, atol=1e-5, rtol=0)
    assert ref.max() > 0.3  # informative: some pixel is similar to a centroid
