"""Tests for MARS Sec. 3.4 "Complementing Debiased Labels" (Eq. 6): complement_labels.

Compared with a plain numpy reference written here, on random inputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _assertions import assert_close
from mars_plugin import complement_labels
from mars_plugin.engines.crf_params import check_crf_params

try:  # the CRF reference (the crf extra); only the tests that compare with it need it
    import pydensecrf.densecrf as dcrf
    from pydensecrf.utils import unary_from_softmax
except ImportError:  # pragma: no cover - CI installs the crf extra
    dcrf = None
needs_reference = pytest.mark.skipif(dcrf is None, reason="pydensecrf (the crf extra) is not installed")

SEEDS = [0, 1, 2, 3]
IGNORE = 255
TOL = 1e-5



# --------------------------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------------------------
def np_softmax(z, axis=0):
    e = np.exp(z - z.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def multi_hot(ids, C):
    v = np.zeros(C, dtype=np.int64)
    for c in ids:
        v[c - 1] = 1
    return v


def np_complement(debiased, probs, classes, ignore=IGNORE):
    """Eq. 6 pixel by pixel.

    Y^te = argmax over {0} u C_I of the teacher's probabilities; Y^co = Y^te where Y^db = -1,
    Y^db elsewhere; W = max_{c in C_I} P(c) where Y^db = -1 (0 if C_I is empty), 1 elsewhere.
    """
    allowed = [0] + sorted(classes)
    H, W = debiased.shape
    y_co = debiased.copy()
    w = np.ones((H, W))
    for y in range(H):
        for x in range(W):
            if debiased[y, x] != -1:
                continue
            scores = [probs[c, y, x] for c in allowed]
            y_co[y, x] = allowed[int(np.argmax(scores))]
            w[y, x] = max((probs[c, y, x] for c in classes), default=0.0)
    return y_co, w


def random_problem(seed, C=6, H=8, W=10, n_cls=None):
    """Teacher probabilities where a class *outside* the image is often the most probable."""
    rng = np.random.default_rng(seed)
    n_cls = int(rng.integers(1, 4)) if n_cls is None else n_cls
    classes = sorted(int(c) for c in rng.choice(np.arange(1, C + 1), size=n_cls, replace=False))
    outside = [c for c in range(1, C + 1) if c not in classes]
    logits = 2.0 * rng.standard_normal((C + 1, H, W))
    logits[outside[0]] += 2.0  # an excluded class dominates many pixels
    probs = np_softmax(logits, 0)
    debiased = rng.choice(np.array([-1, 0] + classes + [IGNORE]), size=(H, W)).astype(np.int64)
    return rng, classes, probs, debiased


# --------------------------------------------------------------------------------------------
# Eq. 6
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_complement_matches_numpy_reference(seed, dtype):
    _, classes, probs, debiased = random_problem(seed)
    probs = probs.astype(dtype)
    ref_y, ref_w = np_complement(debiased, probs, classes)
    # the exclusion of non-image classes is exercised: an unrestricted argmax would differ
    biased = debiased == -1
    assert (~np.isin(probs.argmax(0)[biased], [0] + classes)).any()
    for spelling in (list(classes), torch.as_tensor(multi_hot(classes, 6)), multi_hot(classes, 6).astype(bool)):
        y_co, w = complement_labels(torch.from_numpy(debiased), torch.from_numpy(probs), spelling)
        assert y_co.dtype == torch.long and y_co.shape == debiased.shape
        assert w.shape == debiased.shape and w.is_floating_point()
        np.testing.assert_array_equal(y_co.numpy(), ref_y)
        np.testing.assert_allclose(w.numpy(), ref_w, atol=TOL)
        # untouched pixels (ignore included) are copied; no -1 remains
        np.testing.assert_array_equal(y_co.numpy()[~biased], debiased[~biased])
        assert not (y_co == -1).any()
        assert set(np.unique(y_co.numpy()[biased]).tolist()) <= set([0] + classes)
    # numpy inputs are accepted too
    y_np, w_np = complement_labels(debiased, probs, classes)
    np.testing.assert_array_equal(y_np.numpy(), ref_y)


@pytest.mark.parametrize("seed", SEEDS)
def test_image_with_no_class(seed):
    _, _, probs, debiased = random_problem(seed)
    debiased = np.where(debiased > 0, 0, debiased)  # no foreground class at all
    for spelling in ([], torch.zeros(6)):
        y_co, w = complement_labels(debiased, probs, spelling)
        ref_y, ref_w = np_complement(debiased, probs, [])
        np.testing.assert_array_equal(y_co.numpy(), ref_y)
        np.testing.assert_allclose(w.numpy(), ref_w, atol=TOL)
        biased = debiased == -1
        assert (y_co.numpy()[biased] == 0).all()   # only background is allowed
        assert (w.numpy()[biased] == 0).all()
        assert (w.numpy()[~biased] == 1).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_no_biased_pixel_is_identity(seed):
    _, classes, probs, debiased = random_problem(seed)
    debiased = np.where(debiased == -1, 0, debiased)
    y_co, w = complement_labels(debiased, probs, classes)
    np.testing.assert_array_equal(y_co.numpy(), debiased)
    assert (w == 1).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_equals_single(seed):
    rng = np.random.default_rng(1000 + seed)
    B, C, H, W = 3, 5, 6, 7
    classes = [[1, 3], [2], [4, 5, 1]]
    probs = np_softmax(3 * rng.standard_normal((B, C + 1, H, W)), 1).astype(np.float32)
    debiased = np.stack([rng.choice(np.array([-1, 0, IGNORE] + c), size=(H, W)) for c in classes]).astype(np.int64)
    y_b, w_b = complement_labels(torch.from_numpy(debiased), torch.from_numpy(probs), classes)
    hot = torch.as_tensor(np.stack([multi_hot(c, C) for c in classes]))
    y_h, w_h = complement_labels(debiased, probs, hot)
    assert y_b.shape == (B, H, W) and w_b.shape == (B, H, W)
    assert_close(y_b, y_h)
    assert_close(w_b, w_h)
    for b in range(B):
        y1, w1 = complement_labels(debiased[b], probs[b], classes[b])
        assert_close(y_b[b], y1)
        assert_close(w_b[b], w1, atol=TOL)
        ref_y, ref_w = np_complement(debiased[b], probs[b], classes[b])
        np.testing.assert_array_equal(y_b[b].numpy(), ref_y)
        np.testing.assert_allclose(w_b[b].numpy(), ref_w, atol=TOL)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_outputs_carry_no_grad(seed):
    _, classes, probs, debiased = random_problem(seed)
    logits = torch.from_numpy(np.log(probs)).requires_grad_(True)
    p = logits.softmax(0)
    assert p.requires_grad
    y_co, w = complement_labels(torch.from_numpy(debiased), p, classes)
    assert not y_co.requires_grad and y_co.grad_fn is None
    assert not w.requires_grad and w.grad_fn is None
    ref_y, ref_w = np_complement(debiased, p.detach().numpy(), classes)
    np.testing.assert_array_equal(y_co.numpy(), ref_y)
    np.testing.assert_allclose(w.numpy(), ref_w, atol=TOL)


def test_custom_ignore_index():
    _, classes, probs, debiased = random_problem(0)
    debiased = np.where(debiased == IGNORE, 100, debiased)  # 100 > C would be invalid unless ignored
    y_co, _ = complement_labels(debiased, probs, classes, ignore_index=100)
    assert (y_co.numpy()[debiased == 100] == 100).all()
    with pytest.raises(ValueError, match="debiased"):
        complement_labels(debiased, probs, classes)


# --------------------------------------------------------------------------------------------
# refine="crf"
# --------------------------------------------------------------------------------------------
def ref_crf_labels(probs, classes, rgb, params=None):
    """Direct pydensecrf on the allowed channels renormalised to 1 (float64, as PSA/SEAM hand
    them over), mapped back to class ids; also returns where the reference is not a near tie."""
    p = check_crf_params(params)
    allowed = np.array([0] + sorted(classes))
    sub = probs[allowed].astype(np.float64)
    sub = sub / np.maximum(sub.sum(0, keepdims=True), 1e-12)
    L, H, W = sub.shape
    d = dcrf.DenseCRF2D(W, H, L)
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(sub)))
    d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
    d.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"],
                           rgbim=np.ascontiguousarray(rgb), compat=p["bilateral_compat"])
    q = np.array(d.inference(int(p["iterations"]))).reshape(L, H, W)
    top2 = np.sort(q, 0)[-2:]
    decided = top2[1] - top2[0] > 1e-4 if L > 1 else np.ones((H, W), bool)
    return allowed[q.argmax(0)], decided


@pytest.mark.parametrize("seed", SEEDS)
def test_crf_fills_only_biased_pixels_with_allowed_classes(seed):
    rng, classes, probs, debiased = random_problem(seed, H=14, W=16, n_cls=2)
    img = rng.integers(0, 256, size=(14, 16, 3), dtype=np.uint8)
    y_co, w = complement_labels(debiased, probs, classes, refine="crf", image=img)
    biased = debiased == -1
    np.testing.assert_array_equal(y_co.numpy()[~biased], debiased[~biased])
    assert set(np.unique(y_co.numpy()[biased]).tolist()) <= set([0] + classes)
    assert not (y_co == -1).any()
    # W does not depend on the refinement
    _, w_plain = complement_labels(debiased, probs, classes)
    assert_close(w, w_plain)
    # image layouts and a batch of one agree
    chw = np.ascontiguousarray(img.transpose(2, 0, 1))
    for im in (chw, torch.from_numpy(img).float() / 255):
        y2, _ = complement_labels(debiased, probs, classes, refine="crf", image=im)
        assert_close(y2, y_co)
    yb, _ = complement_labels(debiased[None], probs[None], [classes], refine="crf", image=img[None],
                              crf_params={"iterations": 10})
    assert_close(yb[0], y_co)


def test_crf_batch_with_different_classes_equals_one_by_one():
    rng = np.random.default_rng(9)
    problems = [random_problem(s, H=12, W=13, n_cls=n) for s, n in ((1, 1), (2, 3), (3, 2))]
    imgs = np.stack([rng.integers(0, 256, size=(12, 13, 3), dtype=np.uint8) for _ in problems])
    debiased = np.stack([p[3] for p in problems])
    probs = np.stack([p[2] for p in problems])
    classes = [p[1] for p in problems]
    y_batch, _ = complement_labels(debiased, probs, classes, refine="crf", image=imgs)
    for b, (_, cls, pr, db) in enumerate(problems):
        y_one, _ = complement_labels(db, pr, cls, refine="crf", image=imgs[b])
        assert_close(y_batch[b], y_one)


@needs_reference
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("params", [None, "psa", {"iterations": 2, "bilateral_compat": 3}])
def test_crf_teacher_label_is_the_reference_argmax(seed, params):
    rng, classes, probs, debiased = random_problem(seed, H=14, W=16, n_cls=2)
    img = rng.integers(0, 256, size=(14, 16, 3), dtype=np.uint8)
    y_co, _ = complement_labels(debiased, probs, classes, refine="crf", image=img, crf_params=params)
    te, decided = ref_crf_labels(probs, classes, img, params)
    check = (debiased == -1) & decided
    np.testing.assert_array_equal(y_co.numpy()[check], te[check])
    y_ref, _ = complement_labels(debiased, probs, classes, refine="crf", image=img, crf_params=params,
                                 crf_backend="pydensecrf")
    np.testing.assert_array_equal(y_ref.numpy()[debiased == -1], te[debiased == -1])


def test_crf_params_and_missing_image():
    rng, classes, probs, debiased = random_problem(3, H=10, W=12, n_cls=2)
    img = rng.integers(0, 256, size=(10, 12, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="unknown key"):
        complement_labels(debiased, probs, classes, refine="crf", image=img, crf_params={"sxy": 1})
    with pytest.raises(ValueError, match="image"):
        complement_labels(debiased, probs, classes, refine="crf")
    with pytest.raises(ValueError, match="crf_backend"):
        complement_labels(debiased, probs, classes, refine="crf", image=img, crf_backend="c++")


# --------------------------------------------------------------------------------------------
# bad input: every error names the argument
# --------------------------------------------------------------------------------------------
def _good():
    _, classes, probs, debiased = random_problem(0, C=4, H=5, W=6, n_cls=2)
    return dict(debiased=debiased, teacher_probs=probs, image_classes=classes)


def _call(**kw):
    a = _good()
    a.update(kw)
    return complement_labels(a.pop("debiased"), a.pop("teacher_probs"), a.pop("image_classes"), **a)


def _deb_with(v):
    d = _good()["debiased"].copy()
    d[0, 0] = v
    return d


def _probs_with(v):
    p = _good()["teacher_probs"].copy()
    p[1, 0, 0] = v
    return p


def test_good_call_runs():
    y, w = _call()
    assert y.shape == w.shape == (5, 6)


BAD_COMPLEMENT = [
    ("debiased_minus_two", dict(debiased=_deb_with(-2)), ValueError, "debiased"),
    ("debiased_above_C", dict(debiased=_deb_with(5)), ValueError, "debiased"),
    ("debiased_float", dict(debiased=_deb_with(1).astype(np.float64) + 0.25), TypeError, "debiased"),
    ("debiased_wrong_shape", dict(debiased=np.zeros((5, 7), np.int64)), ValueError, "debiased"),
    ("debiased_wrong_ndim", dict(debiased=np.zeros((1, 1, 5, 6), np.int64)), ValueError, "debiased"),
    ("debiased_two_labels_one_image", dict(debiased=np.zeros((2, 5, 6), np.int64)), ValueError, "one label per image"),
    ("debiased_raw_254", dict(debiased=_deb_with(254)), ValueError, "read_label"),
    ("probs_other_size", dict(teacher_probs=np.full((5, 10, 12), 0.2)), ValueError, "F.interpolate"),
    ("probs_above_one", dict(teacher_probs=_probs_with(1.5)), ValueError, "teacher_probs"),
    ("probs_negative", dict(teacher_probs=_probs_with(-0.1)), ValueError, "teacher_probs"),
    ("probs_nan", dict(teacher_probs=_probs_with(np.nan)), ValueError, "teacher_probs"),
    ("probs_int", dict(teacher_probs=np.ones((5, 5, 6), np.int64)), TypeError, "teacher_probs"),
    ("probs_wrong_ndim", dict(teacher_probs=np.ones((5, 6))), ValueError, "teacher_probs"),
    ("probs_one_channel", dict(teacher_probs=np.ones((1, 5, 6)), debiased=np.zeros((5, 6), np.int64)),
     ValueError, "teacher_probs"),
    ("classes_wrong_length", dict(image_classes=torch.tensor([1, 0, 0])), ValueError, "image_classes"),
    ("classes_out_of_range", dict(image_classes=[2, 5]), ValueError, "image_classes"),
    ("classes_id_zero", dict(image_classes=[0]), ValueError, "image_classes"),
    ("classes_string", dict(image_classes="1,2"), TypeError, "image_classes"),
    ("refine_unknown", dict(refine="threshold"), ValueError, "refine"),
]


@pytest.mark.parametrize("name,kw,exc,match", BAD_COMPLEMENT, ids=[b[0] for b in BAD_COMPLEMENT])
def test_complement_bad_input(name, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


def test_complement_bad_batch_input():
    rng = np.random.default_rng(0)
    probs = np_softmax(rng.standard_normal((2, 4, 3, 3)), 1)
    deb = rng.integers(-1, 4, size=(2, 3, 3))
    with pytest.raises(ValueError, match="image_classes"):
        complement_labels(deb, probs, [[1]])
    with pytest.raises(ValueError, match="image_classes"):
        complement_labels(deb, probs, [[1], [0]])
    with pytest.raises(ValueError, match="debiased"):
        complement_labels(deb[:1], probs, [[1], [2]])


# --------------------------------------------------------------------------------------------
# one image in the shapes a training loop has at hand (the README's "Three calls")
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_one_image_in_any_spelling_equals_the_reference(seed):
    """(H, W) label + (1, C+1, H, W) teacher output of a batch of one + (C,) multi-hot or a flat
    id list: all the same problem, answered in the label's shape."""
    _, classes, probs, debiased = random_problem(seed)
    ref_y, ref_w = np_complement(debiased, probs, classes)
    hot = torch.from_numpy(multi_hot(classes, probs.shape[0] - 1))
    spellings = [
        (debiased, probs, classes),
        (debiased, probs[None], classes),
        (debiased, probs[None], hot),
        (debiased, probs[None], hot[None]),
        (debiased, probs[None], [classes]),
        (debiased, probs, hot),
        (debiased[None], probs, classes),
        (debiased[None], probs[None], hot),
        (debiased[None], probs[None], [classes]),
    ]
    for i, (d, p, c) in enumerate(spellings):
        y, w = complement_labels(d, p, c)
        assert tuple(y.shape) == tuple(np.shape(d)) == tuple(w.shape), i
        assert np.array_equal(y.reshape(ref_y.shape).numpy(), ref_y), i
        assert_close(w.reshape(ref_w.shape).double().numpy(), ref_w, atol=TOL)


def test_a_batch_still_needs_one_class_row_per_image():
    rng = np.random.default_rng(1)
    probs = np_softmax(rng.standard_normal((2, 4, 3, 3)), 1)
    deb = rng.integers(-1, 4, size=(2, 3, 3))
    with pytest.raises(ValueError, match=r"image_classes.*\(B, C\)"):
        complement_labels(deb, probs, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="one class-id list per image"):
        complement_labels(deb, probs, [1, 2])
    with pytest.raises(ValueError, match="debiased holds 1 label"):
        complement_labels(deb[0], probs, [[1], [2]])


def test_a_raw_254_in_a_pseudo_label_says_what_it_is():
    """The core's label check explains 254 wherever a label is taken (here: debias)."""
    from mars_plugin import debias_labels
    from mars_plugin._checks import BIASED_PNG_VALUE
    from mars_plugin.formats.files import BIASED_VALUE

    assert BIASED_PNG_VALUE == BIASED_VALUE
    y = np.zeros((4, 4), np.int64)
    y[0, 0] = 254
    with pytest.raises(ValueError, match="not a debiased one"):
        debias_labels(torch.randn(3, 4, 4), y, torch.randn(3, 3), [1, 2], refine="threshold")
