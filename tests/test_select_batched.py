"""The batched selection path: one sort per batch, value checks per batch, device=, half inputs.

Each test compares the batched path with an independent route to the same numbers (one image
at a time, float32 inputs, another bucketing) or checks that a bad value deep in a batch is
reported with the index of its sample.
"""
import numpy as np
import pytest
import torch

from mars_plugin import select_centroids
from mars_plugin.method.centroids import _cluster_groups, image_centroids

from test_select_centroids import assert_same_result, random_pairs

KW = dict(k_fg=2, k_bg=2, ignore_index=255, normalize=True, seed=0, max_iter=100, tol=1e-4, n_init=1)


def _pairs(seed, n=12):
    rng = np.random.default_rng(seed)
    return [(torch.from_numpy(f), torch.from_numpy(y)) for f, y in random_pairs(rng, n=n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_centroids_equal_image_centroids_one_by_one(seed):
    pairs = _pairs(seed)
    gc = _cluster_groups([f for f, _ in pairs], [y for _, y in pairs], **KW)
    # groups come in (image, class) order
    keys = list(zip(gc.image.tolist(), gc.label.tolist()))
    assert keys == sorted(keys)
    for i, ic in enumerate(gc.per_image()):
        alone = image_centroids(pairs[i][0], pairs[i][1], k_fg=2, k_bg=2)
        assert sorted(ic.fg) == sorted(alone.fg)
        torch.testing.assert_close(ic.bg, alone.bg, atol=1e-6, rtol=0)
        for c in alone.fg:
            torch.testing.assert_close(ic.fg[c], alone.fg[c], atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ratio", [1.0, 1.5, float("inf")])
def test_bucketing_changes_nothing(seed, ratio):
    pairs = _pairs(seed + 10)
    f, y = [p[0] for p in pairs], [p[1] for p in pairs]
    # bucketing is a torch-backend concern (the compiled kernel never pads)
    ref = _cluster_groups(f, y, **KW, bucket_ratio=2, backend="torch")
    got = _cluster_groups(f, y, **KW, bucket_ratio=ratio, backend="torch")
    assert torch.equal(got.image, ref.image) and torch.equal(got.label, ref.label)
    assert torch.equal(got.count, ref.count)
    torch.testing.assert_close(got.centroids, ref.centroids, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_half_precision_features_are_clustered_in_float32(seed):
    pairs = _pairs(seed + 20)
    half = [(f.half(), y) for f, y in pairs]
    as_float = [(f.half().float(), y) for f, y in pairs]
    a = select_centroids(half, num_classes=6, batch_size=5)
    b = select_centroids(as_float, num_classes=6, batch_size=5)
    assert a.centroids.dtype == torch.float32
    assert_same_result(a, b, atol=1e-6)


def test_numpy_and_uint8_inputs_equal_tensors():
    pairs = _pairs(3)
    np_pairs = [(f.numpy(), y.numpy().astype(np.uint8)) for f, y in pairs]
    assert_same_result(select_centroids(np_pairs, num_classes=6), select_centroids(pairs, num_classes=6))


def test_explicit_cpu_device_and_result_device():
    pairs = _pairs(4)
    a = select_centroids(pairs, num_classes=6, device="cpu")
    b = select_centroids(pairs, num_classes=6)
    assert a.centroids.device.type == "cpu"
    assert_same_result(a, b, atol=0)


@pytest.mark.parametrize("batch_size", [1, 4, 64])
@pytest.mark.parametrize("where", [0, 5, 11])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_non_finite_feature_is_named_by_its_sample(batch_size, where, bad_value):
    pairs = _pairs(5)
    f = pairs[where][0].clone()
    f[0, 1, 1] = bad_value
    pairs[where] = (f, pairs[where][1])
    with pytest.raises(ValueError, match=rf"samples\[{where}\]: features contains 1 NaN or Inf"):
        select_centroids(pairs, num_classes=6, batch_size=batch_size)
    # also without normalisation (a different probe of the values)
    with pytest.raises(ValueError, match=rf"samples\[{where}\]: features contains 1 NaN or Inf"):
        select_centroids(pairs, num_classes=6, batch_size=batch_size, normalize=False)


@pytest.mark.parametrize("batch_size", [1, 4, 64])
@pytest.mark.parametrize("where", [0, 7, 11])
def test_negative_label_is_named_by_its_sample(batch_size, where):
    pairs = _pairs(6)
    y = pairs[where][1].clone()
    y[-1, -1] = -3  # also where the down-sampled label would never look
    pairs[where] = (pairs[where][0], y)
    with pytest.raises(ValueError, match=rf"samples\[{where}\]: pseudo_label holds the negative value -3"):
        select_centroids(pairs, num_classes=6, batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [1, 64])
def test_class_above_num_classes_is_named_by_its_sample(batch_size):
    pairs = _pairs(7)
    y = pairs[9][1].clone()
    y[0, 0] = 9
    pairs[9] = (pairs[9][0], y)
    big = [(f, y) for f, y in pairs]
    with pytest.raises(ValueError, match=r"samples\[9\]: pseudo_label holds class 9 but num_classes=6"):
        select_centroids(big, num_classes=6, batch_size=batch_size, ignore_index=255)


def test_ignore_index_may_be_negative():
    pairs = _pairs(8)
    neg = [(f, torch.where(y == 255, torch.full_like(y, -100), y)) for f, y in pairs]
    assert_same_result(select_centroids(neg, num_classes=6, ignore_index=-100), select_centroids(pairs, num_classes=6),
                       atol=0)


def test_huge_finite_features_are_not_called_non_finite():
    # |x|^2 overflows float32 for values ~1e20: the cheap per-pixel probe is non-finite, the
    # exact check then finds every value finite, so no error is raised.
    pairs = _pairs(9)
    f = pairs[2][0].clone()
    f[:, 0, 0] = 1e20
    pairs[2] = (f, pairs[2][1])
    V = select_centroids(pairs, num_classes=6)
    assert bool(V.valid.any())


# ----------------------------------------------------------------------------- spilling to disk
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch_size", [1, 5])
def test_spilled_candidates_give_the_same_result(tmp_path, seed, batch_size):
    pairs = _pairs(seed + 40, n=14)
    ref = select_centroids(pairs, num_classes=6, batch_size=batch_size)
    # spill_mb=0: every batch's candidates go to disk as soon as they are made
    got = select_centroids(pairs, num_classes=6, batch_size=batch_size, spill_dir=tmp_path, spill_mb=0)
    assert_same_result(got, ref, atol=1e-6)
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone


@pytest.mark.parametrize("spill_kb", [0.3, 1.0])
def test_spilled_and_in_memory_chunks_mixed_give_the_same_result(tmp_path, spill_kb, monkeypatch):
    # A budget of a few batches: spilled chunks alternate with runs of in-memory ones, which
    # are joined before scoring; ties keep the stream order through both.
    import mars_plugin.method.selection_stream as sel

    kinds = []
    merge = sel._Accumulator._merge_chunks

    def spy(self):
        kinds.append({isinstance(ch[1], torch.Tensor) for chunks in self.candidates.values() for ch in chunks})
        merge(self)

    monkeypatch.setattr(sel._Accumulator, "_merge_chunks", spy)
    pairs = _pairs(45, n=30)
    ref = select_centroids(pairs, num_classes=6, batch_size=2)
    got = select_centroids(pairs, num_classes=6, batch_size=2, spill_dir=tmp_path, spill_mb=spill_kb / 1024)
    assert_same_result(got, ref, atol=1e-6)
    assert kinds[1] == {True, False}  # the spilled run had both kinds of chunk


def test_spill_files_are_plain_npy_and_removed_on_error(tmp_path, monkeypatch):
    import mars_plugin.method.selection_stream as sel

    pairs = _pairs(50, n=10)
    seen = []
    real_load = np.load

    def spy(path, *a, **kw):
        assert kw.get("allow_pickle") is False  # never unpickled
        seen.append(str(path))
        return real_load(path, *a, **kw)

    monkeypatch.setattr(sel.np, "load", spy)
    select_centroids(pairs, num_classes=6, batch_size=3, spill_dir=tmp_path, spill_mb=0)
    assert seen and all(p.endswith(".npy") and str(tmp_path) in p for p in seen)
    bad = list(pairs)
    bad[7] = (bad[7][0], torch.full_like(bad[7][1], 9))
    with pytest.raises(ValueError, match=r"samples\[7\]"):
        select_centroids(bad, num_classes=6, batch_size=3, spill_dir=tmp_path, spill_mb=0)
    assert list(tmp_path.iterdir()) == []


def test_spill_arguments_are_checked(tmp_path):
    pairs = _pairs(51, n=3)
    with pytest.raises(ValueError, match="spill_dir"):
        select_centroids(pairs, num_classes=6, spill_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="spill_mb"):
        select_centroids(pairs, num_classes=6, spill_dir=tmp_path, spill_mb=-1)
