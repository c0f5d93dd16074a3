"""The permutohedral lattice against a plain, point-at-a-time reference written here.

The reference follows the lattice of Adams et al. (2010) as pydensecrf's x86 build computes it
(float32 lifting, round half to even, the ranking loop, a dictionary of vertex keys, blur along
each axis in order, slice with 1 / (1 + 2^-d), and the zero padding points of its blocks of
four), one point and one lattice point at a time, so that every trick of the batched torch
version (packed codes, table or binary-search neighbours, CSR products, segments) is checked.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mars_plugin.engines.permutohedral as perm
from mars_plugin.engines.permutohedral import PermutohedralLattice

f32 = np.float32


def reference_filter(features: np.ndarray, values: np.ndarray, simd_padding: bool = True) -> np.ndarray:
    """(N, d) float32 features, (N, L) values -> (N, L), one point at a time."""
    N, d = features.shape
    inv_std = f32(np.sqrt(2.0 / 3.0) * (d + 1))
    scale = [f32(1.0 / np.sqrt((i + 2) * (i + 1)) * float(inv_std)) for i in range(d)]
    down = f32(1.0) / f32(d + 1)
    points = [features[n] for n in range(N)]
    if simd_padding and N % 4:
        points += [np.zeros(d, np.float32)] * (4 - N % 4)
    index = {}
    vertices = []  # per point: [(lattice index, weight)] * (d+1)
    for p in points:
        elev = [f32(0)] * (d + 1)
        sm = f32(0)
        for j in range(d, 0, -1):
            cf = f32(p[j - 1] * scale[j - 1])
            elev[j] = f32(sm - f32(j) * cf)
            sm = f32(sm + cf)
        elev[0] = sm
        rem0, total = [], 0
        for i in range(d + 1):
            v = float(np.round(f32(down * elev[i])))  # numpy rounds half to even
            rem0.append(f32(v * (d + 1)))
            total += int(v)
        rank = [0] * (d + 1)
        for i in range(d):
            for j in range(i + 1, d + 1):
                if f32(elev[i] - rem0[i]) < f32(elev[j] - rem0[j]):
                    rank[i] += 1
                else:
                    rank[j] += 1
        for i in range(d + 1):
            rank[i] += total
            if rank[i] < 0:
                rank[i] += d + 1
                rem0[i] = f32(rem0[i] + (d + 1))
            elif rank[i] > d:
                rank[i] -= d + 1
                rem0[i] = f32(rem0[i] - (d + 1))
        bary = [f32(0)] * (d + 2)
        for i in range(d + 1):
            v = f32(f32(elev[i] - rem0[i]) * down)
            bary[d - rank[i]] = f32(bary[d - rank[i]] + v)
            bary[d - rank[i] + 1] = f32(bary[d - rank[i] + 1] - v)
        bary[0] = f32(bary[0] + f32(1 + bary[d + 1]))
        vs = []
        for r in range(d + 1):
            key = tuple(int(rem0[i]) + (r if rank[i] <= d - r else r - (d + 1)) for i in range(d))
            vs.append((index.setdefault(key, len(index)), bary[r]))
        vertices.append(vs)
    M, L = len(index), values.shape[1]
    lattice = np.zeros((M, L), np.float32)
    for n in range(N):  # the padding points splat nothing
        for m, w in vertices[n]:
            lattice[m] += w * values[n]
    keys = list(index)
    for j in range(d + 1):
        new = lattice.copy()
        for key, m in index.items():
            n1 = [k - 1 for k in key]
            n2 = [k + 1 for k in key]
            if j < d:
                n1[j] = key[j] + d
                n2[j] = key[j] - d
            a = lattice[index[tuple(n1)]] if tuple(n1) in index else 0
            b = lattice[index[tuple(n2)]] if tuple(n2) in index else 0
            new[m] = lattice[m] + f32(0.5) * (a + b)
        lattice = new
    assert len(keys) == M
    alpha = f32(1.0) / (f32(1.0) + f32(2.0 ** -d))
    out = np.zeros((N, L), np.float32)
    for n in range(N):
        for m, w in vertices[n]:
            out[n] += w * alpha * lattice[m]
    return out


def grid_features(H, W, sxy):
    ys, xs = np.mgrid[0:H, 0:W]
    return np.stack([xs.ravel() / f32(sxy), ys.ravel() / f32(sxy)], 1).astype(np.float32)


def filtered(features, values, **kw):
    lat = PermutohedralLattice(torch.from_numpy(features), **kw)
    return lat.filter(torch.from_numpy(values)).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("d", [1, 2, 3, 5])
@pytest.mark.parametrize("N", [1, 7, 30, 41])
def test_random_features_match_reference(seed, d, N):
    rng = np.random.default_rng(seed * 100 + d * 10 + N)
    features = (rng.standard_normal((N, d)) * 2).astype(np.float32)
    values = rng.random((N, 3)).astype(np.float32)
    np.testing.assert_allclose(filtered(features, values), reference_filter(features, values), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sxy", [1, 3, 0.7])
def test_pixel_grid_with_boundary_points_matches_reference(sxy):
    # Integer positions put many points exactly on simplex faces: the ranking's tie rule and the
    # rounding decide which vertices exist, and so what the blur passes through.
    features = grid_features(5, 7, sxy)
    values = np.random.default_rng(0).random((35, 2)).astype(np.float32)
    np.testing.assert_allclose(filtered(features, values), reference_filter(features, values), rtol=1e-5, atol=1e-6)


def test_bilateral_features_of_an_image_match_reference():
    rng = np.random.default_rng(3)
    H, W = 6, 5  # 30 pixels: two padding points in the last block of four
    rgb = rng.integers(0, 256, (H * W, 3)).astype(np.float32)
    features = np.concatenate([grid_features(H, W, 67), rgb / f32(3)], 1).astype(np.float32)
    values = rng.random((H * W, 4)).astype(np.float32)
    np.testing.assert_allclose(filtered(features, values), reference_filter(features, values), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(filtered(features, values, simd_padding=False),
                               reference_filter(features, values, simd_padding=False), rtol=1e-5, atol=1e-6)


def test_padding_points_change_the_result_only_when_they_add_vertices():
    # Dark pixels near the top-left corner in bilateral space sit next to the padding simplex.
    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 60, (13, 3)).astype(np.float32)
    features = np.concatenate([np.zeros((13, 2), np.float32), rgb / f32(3)], 1)
    values = rng.random((13, 1)).astype(np.float32)
    with_pad, without = filtered(features, values), filtered(features, values, simd_padding=False)
    assert not np.allclose(with_pad, without, atol=1e-6)  # the quirk is real and reproduced
    np.testing.assert_allclose(with_pad, reference_filter(features, values), rtol=1e-5, atol=1e-6)
    # 12 points: no padding, both agree exactly.
    np.testing.assert_array_equal(filtered(features[:12], values[:12]),
                                  filtered(features[:12], values[:12], simd_padding=False))


def test_segments_filter_like_separate_lattices():
    rng = np.random.default_rng(1)
    parts = [(rng.standard_normal((n, 3)) * 1.5).astype(np.float32) for n in (9, 14, 1)]
    vals = [rng.random((p.shape[0], 2)).astype(np.float32) for p in parts]
    seg = torch.cat([torch.full((p.shape[0],), i) for i, p in enumerate(parts)])
    lat = PermutohedralLattice(torch.from_numpy(np.concatenate(parts)), seg)
    together = lat.filter(torch.from_numpy(np.concatenate(vals))).numpy()
    alone = np.concatenate([filtered(p, v) for p, v in zip(parts, vals)])
    np.testing.assert_allclose(together, alone, rtol=1e-6, atol=1e-7)


def test_neighbour_table_and_binary_search_agree(monkeypatch):
    rng = np.random.default_rng(2)
    features = (rng.standard_normal((50, 5)) * 3).astype(np.float32)
    values = rng.random((50, 2)).astype(np.float32)
    table = filtered(features, values)
    monkeypatch.setattr(perm, "_TABLE_SPAN_PER_POINT", 0)
    monkeypatch.setattr(perm, "_TABLE_SPAN_MIN", 0)
    np.testing.assert_array_equal(filtered(features, values), table)


def test_key_rows_fallback_equals_packed_codes(monkeypatch):
    rng = np.random.default_rng(4)
    features = (rng.standard_normal((40, 5)) * 4).astype(np.float32)
    seg = torch.arange(40) % 3
    values = torch.from_numpy(rng.random((40, 3)).astype(np.float32))
    packed = PermutohedralLattice(torch.from_numpy(features), seg)
    monkeypatch.setattr(perm, "_MAX_CODE_BITS", 0)
    rows = PermutohedralLattice(torch.from_numpy(features), seg)
    assert rows.num_lattice_points == packed.num_lattice_points
    assert torch.equal(rows.vertices, packed.vertices)
    assert torch.equal(rows.filter(values), packed.filter(values))


def test_huge_coordinates_take_the_row_path_and_stay_right():
    # Features spread so widely that the packed code would need more than 62 bits.
    rng = np.random.default_rng(6)
    features = (rng.standard_normal((20, 5)) * 4000).astype(np.float32)
    values = rng.random((20, 1)).astype(np.float32)
    np.testing.assert_allclose(filtered(features, values), reference_filter(features, values), rtol=1e-5, atol=1e-6)


def test_filter_is_linear_and_scaled_folds_diagonals():
    rng = np.random.default_rng(7)
    features = torch.from_numpy((rng.standard_normal((33, 2)) * 2).astype(np.float32))
    lat = PermutohedralLattice(features)
    a, b = torch.rand(33, 2), torch.rand(33, 2)
    torch.testing.assert_close(lat.filter(a + 2 * b), lat.filter(a) + 2 * lat.filter(b), rtol=1e-5, atol=1e-6)
    before, after = torch.rand(33), torch.rand(33)
    plain = lat.filter(a)
    expected = after[:, None] * lat.filter(before[:, None] * a)
    scaled = lat.scaled(before, after)
    torch.testing.assert_close(scaled.filter(a), expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(lat.filter(a), plain)  # the original is untouched
    acc = torch.ones(33, 2)
    assert scaled.filter(a, add_to=acc) is acc
    torch.testing.assert_close(acc, 1 + expected, rtol=1e-5, atol=1e-6)


def test_constant_features_put_every_point_on_one_simplex():
    lat = PermutohedralLattice(torch.full((8, 3), 2.5))
    assert lat.num_lattice_points == 4
    out = lat.filter(torch.ones(8, 1))
    assert torch.allclose(out, out[0].expand_as(out))


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(0, 2), "at least one point"),
    (torch.zeros(4, 2, dtype=torch.float64), "float32"),
    (torch.zeros(4), r"\(N, d\)"),
    (torch.tensor([[0.0, float("nan")]]), "NaN"),
])
def test_bad_features_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        PermutohedralLattice(bad)


def test_bad_values_and_segments_are_refused():
    lat = PermutohedralLattice(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="N = 5"):
        lat.filter(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="segment"):
        PermutohedralLattice(torch.zeros(5, 2), torch.tensor([0, 0, -1, 0, 0]))


def test_the_transposed_blur_equals_the_row_blur_bit_for_bit(monkeypatch):
    """CUDA blurs along dim 1 of the transposed values (30x faster gathers there); the CPU along
    rows. Forced both ways here, the filter is the same to the bit, and the dense CRF too."""
    import mars_plugin.engines.permutohedral as P
    from mars_plugin.engines.crf import dense_crf
    from mars_plugin.engines.crf_params import CRF_PRESETS

    g = torch.Generator().manual_seed(3)
    feats = torch.randn(500, 5, generator=g) * 3
    vals = torch.rand(500, 3, generator=g)
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(P, "TRANSPOSED_BLUR", flag)
        out[flag] = P.PermutohedralLattice(feats).filter(vals)
    assert torch.equal(out[False], out[True])
    img = torch.randint(0, 256, (2, 30, 41, 3), dtype=torch.uint8, generator=g)
    probs = torch.rand(2, 4, 30, 41, generator=g).softmax(1)
    q = {}
    for flag in (False, True):
        monkeypatch.setattr(P, "TRANSPOSED_BLUR", flag)
        q[flag] = dense_crf(probs, img, CRF_PRESETS["mars"])
    assert torch.equal(q[False], q[True])
