"""NaN/Inf centroids are refused at every entry point; a zero-norm centroid is no centroid.

A NaN centroid compares as dissimilar to every pixel, so debias_labels would mark its whole
class biased; an all-zero centroid (a class whose features are zero) has no direction. The
first must raise an error naming the argument; the second must behave exactly as if that
centroid did not exist (the reference: the same call without it).
"""
import numpy as np
import pytest
import torch

from mars_plugin import DebiasedCentroids, ImageCentroids, batched_kmeans, debias_labels, debiased_similarity, kmeans
from mars_plugin.engines import kmeans_compiled
from mars_plugin.method.centroids import image_centroids
from mars_plugin.method.debias import check_pseudo_label, mark_biased
from mars_plugin.method.selection import select_centroids

from test_debias import make_centroids, random_problem
from test_select_centroids import assert_same_result, random_pair

BACKENDS = ["torch"] + (["compiled"] if kmeans_compiled.available() else [])


# ----------------------------------------------------------------------------- NaN refused
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_image_centroids_refuses_nonfinite(bad):
    fg = torch.zeros(2, 4)
    fg[1, 2] = bad
    with pytest.raises(ValueError, match=r"ImageCentroids\.fg\[3\] contains 1 NaN or Inf value\(s\); expected finite"):
        ImageCentroids({3: fg}, torch.ones(1, 4))
    bg = torch.ones(2, 4)
    bg[0, 0] = bad
    with pytest.raises(ValueError, match=r"ImageCentroids\.bg contains 1 NaN or Inf"):
        ImageCentroids({}, bg)


def test_select_centroids_refuses_image_centroids_turned_nan():
    ok = ImageCentroids({1: torch.ones(1, 4)}, torch.ones(2, 4))
    late = ImageCentroids({1: torch.ones(1, 4), 2: torch.ones(2, 4)}, torch.ones(1, 4))
    late.fg[2][1, 0] = float("nan")  # after construction
    with pytest.raises(ValueError, match=r"samples\[1\]\.fg\[2\] contains 1 NaN or Inf"):
        select_centroids([ok, late], num_classes=2)


def _debias_calls(V, shape=(4, 3)):
    rng = np.random.default_rng(0)
    f = torch.from_numpy(rng.normal(size=(shape[1], 5, 6)))
    y = torch.from_numpy(rng.integers(0, shape[0], size=(5, 6)))
    return {
        "debias_labels": lambda: debias_labels(f, y, V, [1, 2], refine="threshold"),
        "debiased_similarity": lambda: debiased_similarity(f, V, [1, 2]),
        "mark_biased": lambda: mark_biased(y, torch.ones(5, 6, dtype=torch.bool), V),
        "check_pseudo_label": lambda: check_pseudo_label(y, V),
    }


@pytest.mark.parametrize("entry", ["debias_labels", "debiased_similarity", "mark_biased", "check_pseudo_label"])
@pytest.mark.parametrize("kind", ["tensor", "numpy", "DebiasedCentroids", "DebiasedCentroids-invalid-row"])
def test_debias_refuses_nonfinite_centroids(entry, kind):
    V = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    V[2, 1] = np.nan
    if kind == "tensor":
        arg, name = torch.from_numpy(V), "centroids"
    elif kind == "numpy":
        arg, name = V, "centroids"
    else:
        valid = np.array([False, True, kind == "DebiasedCentroids", True])
        arg, name = make_centroids(V, valid), "centroids.centroids"
    with pytest.raises(ValueError, match=rf"^{name}: got NaN or Inf values in the centroid row\(s\) of class \[2\]; "
                                         "expected finite centroids"):
        _debias_calls(arg)[entry]()


# ----------------------------------------------------------------------------- zero = none
@pytest.mark.parametrize("seed", range(3))
def test_debias_zero_centroid_flagged_valid_is_no_centroid(seed):
    rng, V, valid, feats, classes, label = random_problem(seed, C=4, D=4, n_invalid=0)
    classes = [1, 2, 3]
    label[0, :3] = [1, 2, 3]
    V[2] = 0.0
    flagged = make_centroids(V, valid)  # row 2 flagged valid, but zero
    reference = make_centroids(V, np.array([False, True, False, True, True]))  # row 2 invalid
    kw = dict(refine="threshold", threshold=0.3, return_details=True)
    got = debias_labels(feats, label, flagged, classes, **kw)
    ref = debias_labels(feats, label, reference, classes, **kw)
    assert got.untouched == ref.untouched and 2 in got.untouched[0]
    assert torch.equal(got.labels, ref.labels) and torch.equal(got.similarity, ref.similarity)
    assert torch.equal(debiased_similarity(feats, flagged, classes), debiased_similarity(feats, reference, classes))


def _zero_class(pairs, cls, images):
    """The pairs with the features of class ``cls`` zeroed in the given images."""
    out = []
    for i, (f, y) in enumerate(pairs):
        f = f.copy()
        if i in images:
            f[:, y == cls] = 0.0
        out.append((f, y))
    return out


def _without_zero_rows(ics):
    """The same ImageCentroids with every all-zero centroid removed (the plain reference)."""
    out = []
    for ic in ics:
        keep = lambda v: v[v.abs().sum(1) > 0]  # noqa: E731
        fg = {c: keep(v) for c, v in ic.fg.items() if keep(v).shape[0]}
        out.append(ImageCentroids(fg, keep(ic.bg)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_select_zero_candidates_are_no_candidates(backend, normalize):
    rng = np.random.default_rng(11)
    # 8 x 1 labels: the resize is the identity, so zeroing a class's pixels zeroes its group.
    pairs = [random_pair(rng, h=8, w=6, classes=cs) for cs in [(0, 1, 2), (0, 2, 3), (0, 1, 3), (1, 2), (0, 3)]]
    # class 3: zero in every image (no centroid at all); class 2: zero in two images only;
    # background: zero in one image (it leaves Eq. 1's mean and N_bg).
    pairs = _zero_class(_zero_class(_zero_class(pairs, 3, range(5)), 2, {0, 1}), 0, {4})
    pairs = [(torch.from_numpy(f), torch.from_numpy(y)) for f, y in pairs]
    kw = dict(k_fg=2, k_bg=2, normalize=normalize, backend=backend)
    got = select_centroids(pairs, num_classes=3, **kw)
    ics = image_centroids(torch.stack([f for f, _ in pairs]), torch.stack([y for _, y in pairs]), **kw)
    assert any((v.abs().sum(1) == 0).any() for ic in ics for v in list(ic.fg.values()) + [ic.bg])
    ref = select_centroids(_without_zero_rows(ics), num_classes=3)
    # Same centroids; the float64 background sum is added per batch there and per image here:
    # the cut distances may differ in the last float64 bit.
    assert_same_result(got, ref, atol=1e-12)
    assert not bool(got.valid[3]) and bool(got.valid[1]) and bool(got.valid[2])
    assert int(got.num_candidates[3]) == 0


def test_select_image_centroids_zero_rows_are_dropped():
    rng = np.random.default_rng(2)
    ics = [ImageCentroids({1: torch.tensor(rng.normal(size=(2, 4)), dtype=torch.float32),
                           2: torch.zeros(1, 4)},
                          torch.tensor(rng.normal(size=(2, 4)), dtype=torch.float32)) for _ in range(4)]
    ics[1].fg[1][0] = 0.0
    ics[2].bg[1] = 0.0
    got = select_centroids(ics, num_classes=2)
    assert_same_result(got, select_centroids(_without_zero_rows(ics), num_classes=2), atol=0)
    assert not bool(got.valid[2]) and int(got.num_candidates[0]) == 7


# ----------------------------------------------------------------------------- K-means input
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kmeans_refuses_nonfinite_points(bad):
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    x[1, 4, 2] = bad
    with pytest.raises(ValueError, match=r"^points: got 1 point\(s\) with a NaN or Inf value \(first: points\[1, 4\]\); "
                                         "expected finite values"):
        batched_kmeans(x, None, 2)
    with pytest.raises(ValueError, match=r"^points: got 1 point\(s\) with a NaN or Inf value \(first: points\[0, 4\]\)"):
        kmeans(x[1], 2)
    # A padded point (mask False) is never read: it may hold anything.
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4] = False
    res = batched_kmeans(x, mask, 2)
    assert torch.isfinite(res.centroids).all()
    ref = batched_kmeans(x.masked_fill(~mask[:, :, None], 0.0), mask, 2)
    assert torch.equal(res.centroids, ref.centroids)
