"""concatenate_lattices: the images' own lattices joined equal the batch's lattice built at once
(the same point numbering, splat/slice/blur tables and filter, bit for bit on the CPU), and the
dense CRF's kept position lattices are joined for a batch instead of rebuilt."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mars_plugin.engines import crf_lattices
from mars_plugin.engines.crf_lattices import _features, _gaussian_lattice, _lattice, _segments, clear_lattice_cache
from mars_plugin.engines.lattice_concat import concatenate_lattices
from mars_plugin.engines.permutohedral import PermutohedralLattice

# sizes whose pixel counts are and are not multiples of 4 (pydensecrf's SIMD padding points)
SHAPES = [(7, 9), (8, 6), (5, 11)]


def features(shapes, seed, colour=True):
    rng = np.random.default_rng(seed)
    rgbs = [torch.from_numpy(rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)) for H, W in shapes]
    return _features(shapes, 3.0, rgbs if colour else None, 13.0, torch.device("cpu"))


def split(f, shapes):
    out, start = [], 0
    for H, W in shapes:
        out.append(f[start:start + H * W])
        start += H * W
    return out


def assert_same_lattice(joined, built, padding_columns=()):
    assert joined.num_points == built.num_points
    assert joined.num_lattice_points == built.num_lattice_points
    assert joined.class_starts == built.class_starts
    a, b = joined._splat, built._splat
    assert torch.equal(a.crow_indices(), b.crow_indices())
    assert torch.equal(a.values(), b.values())
    keep = torch.ones(a.values().numel(), dtype=torch.bool)
    keep[list(padding_columns)] = False
    assert torch.equal(a.col_indices()[keep], b.col_indices()[keep])
    assert torch.equal(joined._slice.col_indices(), built._slice.col_indices())
    assert torch.equal(joined._slice.values(), built._slice.values())
    for (a1, a2), (b1, b2) in zip(joined._blur, built._blur):
        assert torch.equal(a1, b1) and torch.equal(a2, b2)


def padding_entries(built):
    """Splat entries of the SIMD padding points (weight 0, column 0 in the built lattice)."""
    sp = built._splat
    return torch.nonzero((sp.col_indices() == 0) & (sp.values() == 0)).flatten().tolist()


@pytest.mark.parametrize("colour", [False, True])
@pytest.mark.parametrize("shapes", [SHAPES, [(6, 8)] * 3, SHAPES[:1] + SHAPES[:1]])
def test_joined_equals_built(colour, shapes):
    f = features(shapes, 0, colour)
    seg = _segments([H * W for H, W in shapes], f.device)
    built = PermutohedralLattice(f, seg)
    joined = concatenate_lattices([PermutohedralLattice(x) for x in split(f, shapes)])
    assert_same_lattice(joined, built, padding_entries(built))
    for L in (1, 3):
        v = torch.rand(f.shape[0], L, generator=torch.Generator().manual_seed(L))
        assert torch.equal(joined.filter(v), built.filter(v))
        acc1, acc2 = torch.ones(f.shape[0], L), torch.ones(f.shape[0], L)
        assert torch.equal(joined.filter(v, add_to=acc1, scale=0.5), built.filter(v, add_to=acc2, scale=0.5))


def test_normalised_lattices_join_into_the_normalised_batch():
    f = features(SHAPES, 1)
    built = _lattice(f, _segments([H * W for H, W in SHAPES], f.device))
    joined = concatenate_lattices([_lattice(x, None) for x in split(f, SHAPES)])
    v = torch.rand(f.shape[0], 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(joined.filter(v), built.filter(v))


def test_inputs_are_left_alone_and_one_lattice_is_itself():
    f = features(SHAPES, 2)
    parts = [PermutohedralLattice(x) for x in split(f, SHAPES)]
    before = [(p._splat.values().clone(), p._slice.col_indices().clone(), p._blur[0][0].clone()) for p in parts]
    concatenate_lattices(parts)
    for p, (vals, cols, n1) in zip(parts, before):
        assert torch.equal(p._splat.values(), vals) and torch.equal(p._slice.col_indices(), cols)
        assert torch.equal(p._blur[0][0], n1)
    assert concatenate_lattices(parts[:1]) is parts[0]


def test_bad_lattices_are_named():
    f = features(SHAPES[:1], 3)
    a = PermutohedralLattice(f)
    b = PermutohedralLattice(f[:, :2].contiguous())
    with pytest.raises(ValueError, match=r"lattices\[1\] has dimension 2 on cpu, but lattices\[0\] has dimension 5"):
        concatenate_lattices([a, b])
    with pytest.raises(ValueError, match="at least one lattice"):
        concatenate_lattices([])
    with pytest.raises(TypeError, match=r"lattices\[0\] must be a PermutohedralLattice, got ndarray"):
        concatenate_lattices([np.zeros(3)])


def test_the_crf_joins_kept_position_lattices(monkeypatch):
    """A batch's position lattice is the kept single-image ones joined: built once per size."""
    clear_lattice_cache()
    built = []
    real = crf_lattices._lattice
    monkeypatch.setattr(crf_lattices, "_lattice", lambda f, s, *a: built.append(f.shape[0]) or real(f, s, *a))
    cpu = torch.device("cpu")
    shapes = ((6, 8), (5, 7), (6, 8))
    first = _gaussian_lattice(shapes, 3.0, cpu)
    assert sorted(built) == [35, 48]  # each size once, not the batch
    again = _gaussian_lattice(((5, 7), (6, 8)), 3.0, cpu)
    assert sorted(built) == [35, 48]  # a different batch of the same sizes: nothing built
    reference = real(_features(shapes, 3.0, None, 1.0, cpu), _segments([48, 35, 48], cpu))
    v = torch.rand(first.num_points, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first.filter(v), reference.filter(v))
    assert again.num_points == 83
    clear_lattice_cache()
