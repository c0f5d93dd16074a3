"""Tests for MARS Sec. 3.3 "Generating Debiased Labels" (Eq. 4-5) and the dense-CRF refinement.

Every equation is compared with a plain numpy reference written here, on random inputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _assertions import assert_close
from mars_plugin import BIASED, DebiasedCentroids, DebiasResult, debias_labels, debiased_similarity
from mars_plugin.engines.crf_params import check_crf_params

try:  # the CRF reference (the crf extra); only the tests that compare with it need it
    import pydensecrf.densecrf as pydensecrf
    from pydensecrf.utils import unary_from_softmax
except ImportError:  # pragma: no cover - CI installs the crf extra
    pydensecrf = None
needs_reference = pytest.mark.skipif(pydensecrf is None, reason="pydensecrf (the crf extra) is not installed")

SEEDS = [0, 1, 2, 3]
IGNORE = 255
TOL = 1e-5



# --------------------------------------------------------------------------------------------
# helpers and numpy references
# --------------------------------------------------------------------------------------------
def make_centroids(V: np.ndarray, valid: np.ndarray) -> DebiasedCentroids:
    """A DebiasedCentroids holding exactly V (C+1, D) and valid (C+1,)."""
    C1, D = V.shape
    return DebiasedCentroids(
        centroids=torch.as_tensor(V, dtype=torch.float32),
        valid=torch.as_tensor(valid, dtype=torch.bool),
        num_candidates=torch.ones(C1, dtype=torch.long),
        num_selected=torch.ones(C1, dtype=torch.long),
        cut_distance=torch.zeros(C1, dtype=torch.float64),
        background_mean=torch.zeros(D),
        num_images=1,
        config={},
    )


def multi_hot(ids, C) -> np.ndarray:
    """(C,) multi-hot vector, index k <-> class k+1."""
    v = np.zeros(C, dtype=np.int64)
    for c in ids:
        v[c - 1] = 1
    return v


def np_bilinear(f: np.ndarray, H: int, W: int) -> np.ndarray:
    """Bilinear resize (D, h, w) -> (D, H, W) with align_corners=False (half-pixel centres)."""

    def axis(n_out, n_in):
        src = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        src = np.maximum(src, 0.0)
        i0 = np.minimum(np.floor(src).astype(int), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, src - i0

    y0, y1, ly = axis(H, f.shape[1])
    x0, x1, lx = axis(W, f.shape[2])
    rows0, rows1 = f[:, y0, :], f[:, y1, :]
    top = rows0[:, :, x0] * (1 - lx) + rows0[:, :, x1] * lx
    bot = rows1[:, :, x0] * (1 - lx) + rows1[:, :, x1] * lx
    return top * (1 - ly)[:, None] + bot * ly[:, None]


def np_similarity(f: np.ndarray, V: np.ndarray, valid: np.ndarray, classes, size=None) -> np.ndarray:
    """Eq. 4, pixel by pixel: ReLU(max_{c in C_I, c has a centroid} cos(F[:, y, x], V^c)); 0 if none."""
    f = np.asarray(f, dtype=np.float64)
    if size is not None and f.shape[1:] != tuple(size):
        f = np_bilinear(f, *size)
    D, H, W = f.shape
    usable = [c for c in classes if c >= 1 and valid[c]]
    out = np.zeros((H, W))
    for y in range(H):
        for x in range(W):
            v = f[:, y, x]
            if not usable:
                out[y, x] = 0.0
                continue
            best = max(
                float(v @ V[c]) / (np.linalg.norm(v) * np.linalg.norm(V[c])) for c in usable
            )
            out[y, x] = max(best, 0.0)
    return out


def np_debias(label: np.ndarray, mask: np.ndarray, valid: np.ndarray, ignore=IGNORE) -> np.ndarray:
    """Eq. 5: -1 where label > 0 (not ignore), M = 0 and the label's class has a centroid."""
    out = label.copy()
    for idx in np.ndindex(label.shape):
        lab = int(label[idx])
        if lab != ignore and lab > 0 and not mask[idx] and lab < len(valid) and valid[lab]:
            out[idx] = -1
    return out


def np_untouched(label: np.ndarray, valid: np.ndarray, ignore=IGNORE):
    present = sorted({int(v) for v in np.unique(label) if v != ignore and v > 0})
    return [c for c in present if not valid[c]]


def ref_crf(probs: np.ndarray, rgb: np.ndarray, params=None) -> np.ndarray:
    """A direct pydensecrf call as PSA/SEAM make it: unary_from_softmax, Gaussian + bilateral."""
    p = check_crf_params(params)
    L, H, W = probs.shape
    d = pydensecrf.DenseCRF2D(W, H, L)
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(probs)))
    d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
    d.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"],
                           rgbim=np.ascontiguousarray(rgb), compat=p["bilateral_compat"])
    return np.array(d.inference(int(p["iterations"])), dtype=np.float32).reshape(L, H, W)


def assert_mask_is_crf_argmax(mask: np.ndarray, q_ref: np.ndarray) -> None:
    """M is the argmax of the reference marginals wherever they are not a near tie (the torch
    CRF agrees with pydensecrf to ~1e-5, see test_crf.py)."""
    decided = np.abs(q_ref[1] - q_ref[0]) > 1e-4
    np.testing.assert_array_equal(mask[decided], (q_ref.argmax(0) == 1)[decided])
    assert decided.mean() > 0.95


def random_problem(seed, C=5, D=4, h=6, w=7, H=None, W=None, n_invalid=1, dtype=np.float64):
    """Random features, centroids (some invalid but non-zero), label and image classes."""
    rng = np.random.default_rng(seed)
    H = H or h
    W = W or w
    V = rng.standard_normal((C + 1, D))
    valid = np.ones(C + 1, dtype=bool)
    valid[0] = False
    invalid = rng.choice(np.arange(1, C + 1), size=n_invalid, replace=False)
    valid[invalid] = False  # rows stay non-zero: only DebiasedCentroids.valid excludes them
    feats = rng.standard_normal((D, h, w)).astype(dtype)
    n_cls = int(rng.integers(2, C + 1))
    classes = sorted(int(c) for c in rng.choice(np.arange(1, C + 1), size=n_cls, replace=False))
    label = rng.choice(np.array([0] + classes), size=(H, W)).astype(np.int64)
    label[rng.random((H, W)) < 0.1] = IGNORE
    return rng, V, valid, feats, classes, label


# --------------------------------------------------------------------------------------------
# Eq. 4: debiased_similarity
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_similarity_matches_numpy_reference(seed):
    _, V, valid, feats, classes, _ = random_problem(seed, C=6, D=8, h=7, w=9, n_invalid=2, dtype=np.float32)
    cents = make_centroids(V, valid)
    ref = np_similarity(feats, V.astype(np.float32), valid, classes)
    # the test is informative: some pixels are clipped by the ReLU, some are positive
    assert (ref == 0).any() and (ref > 0.2).any()
    for spelling in (torch.as_tensor(multi_hot(classes, 6)), multi_hot(classes, 6).astype(bool), list(classes)):
        got = debiased_similarity(torch.from_numpy(feats), cents, spelling)
        assert got.shape == (7, 9)
        np.testing.assert_allclose(got.numpy(), ref, atol=TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_similarity_excludes_classes_without_centroid(seed):
    rng, V, valid, feats, classes, _ = random_problem(seed, C=5, D=6, n_invalid=0, dtype=np.float32)
    # the image holds every class; the invalid ones must be ignored even though their rows
    # are non-zero (DebiasedCentroids) ...
    valid = valid.copy()
    valid[[2, 4]] = False
    all_cls = [1, 2, 3, 4, 5]
    ref = np_similarity(feats, V.astype(np.float32), valid, all_cls)
    got = debiased_similarity(feats, make_centroids(V, valid), all_cls)
    np.testing.assert_allclose(got.numpy(), ref, atol=TOL)
    # ... and using them would change the answer (otherwise this test proves nothing)
    with_all = np_similarity(feats, V.astype(np.float32), np.ones(6, bool), all_cls)
    assert np.abs(with_all - ref).max() > 1e-3
    # a plain (C+1, D) tensor marks "no centroid" by an all-zero row
    V0 = V.astype(np.float32).copy()
    V0[[2, 4]] = 0.0
    got_plain = debiased_similarity(torch.from_numpy(feats), torch.from_numpy(V0), all_cls)
    np.testing.assert_allclose(got_plain.numpy(), ref, atol=TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_similarity_zero_when_no_class_has_centroid(seed):
    _, V, valid, feats, _, _ = random_problem(seed, C=5, D=4, n_invalid=0, dtype=np.float32)
    valid = valid.copy()
    valid[[1, 3]] = False
    for classes in ([1, 3], []):
        got = debiased_similarity(feats, make_centroids(V, valid), classes)
        assert got.shape == feats.shape[1:]
        assert torch.equal(got, torch.zeros_like(got))
    V0 = V.astype(np.float32).copy()
    V0[[1, 3]] = 0
    got = debiased_similarity(feats, torch.from_numpy(V0), [1, 3])
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("seed", SEEDS)
def test_similarity_upsamples_features_to_label_size(seed):
    _, V, valid, feats, classes, _ = random_problem(seed, C=4, D=5, h=5, w=6, dtype=np.float32)
    size = (11, 14)
    # the numpy bilinear reference agrees with torch's align_corners=False interpolation
    torch_up = F.interpolate(torch.from_numpy(feats)[None], size=size, mode="bilinear", align_corners=False)[0]
    np.testing.assert_allclose(np_bilinear(feats.astype(np.float64), *size), torch_up.numpy(), atol=1e-6)
    ref = np_similarity(feats, V.astype(np.float32), valid, classes, size=size)
    got = debiased_similarity(feats, make_centroids(V, valid), classes, size=size)
    assert got.shape == size
    np.testing.assert_allclose(got.numpy(), ref, atol=TOL)
    # the cosine is taken after the resize, not the other way round
    naive = np_bilinear(np_similarity(feats, V.astype(np.float32), valid, classes)[None], *size)[0]
    assert np.abs(naive - ref).max() > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_similarity_batch_equals_per_image(seed):
    rng = np.random.default_rng(100 + seed)
    C, D, B = 5, 6, 3
    V = rng.standard_normal((C + 1, D)).astype(np.float32)
    valid = np.array([False, True, True, False, True, True])
    feats = rng.standard_normal((B, D, 5, 4)).astype(np.float32)
    classes = [[1, 3], [2, 4, 5], [3]]
    cents = make_centroids(V, valid)
    batch_list = debiased_similarity(feats, cents, classes, size=(8, 7))
    batch_hot = debiased_similarity(torch.from_numpy(feats), cents,
                                    torch.as_tensor(np.stack([multi_hot(c, C) for c in classes])), size=(8, 7))
    assert batch_list.shape == (B, 8, 7)
    assert_close(batch_list, batch_hot)
    for b in range(B):
        single = debiased_similarity(feats[b], cents, classes[b], size=(8, 7))
        assert_close(batch_list[b], single, atol=TOL)
        ref = np_similarity(feats[b], V, valid, classes[b], size=(8, 7))
        np.testing.assert_allclose(batch_list[b].numpy(), ref, atol=TOL)


# --------------------------------------------------------------------------------------------
# Eq. 5: debias_labels, refine="threshold"
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5])
def test_debias_threshold_matches_numpy_reference(seed, threshold):
    # float64 features so that the library and the reference compare M_hat with the threshold
    # at the same precision; features (5, 6) are upsampled to the (9, 11) label first.
    _, V, valid, feats, classes, label = random_problem(seed, C=5, D=4, h=5, w=6, H=9, W=11, n_invalid=1)
    cents = make_centroids(V, valid)
    Vf = V.astype(np.float32).astype(np.float64)
    m_hat = np_similarity(feats, Vf, valid, classes, size=label.shape)
    ref = np_debias(label, m_hat > threshold, valid)
    assert (ref == -1).any() and ((ref > 0) & (ref != IGNORE)).any(), "uninformative random draw"

    out = debias_labels(torch.from_numpy(feats), torch.from_numpy(label), cents, classes,
                        refine="threshold", threshold=threshold)
    assert out.dtype == torch.long and out.shape == label.shape
    np.testing.assert_array_equal(out.numpy(), ref)
    assert ((out == IGNORE) == torch.from_numpy(label == IGNORE)).all()
    # PNG-style uint8 labels are read the same way
    out_u8 = debias_labels(feats, label.astype(np.uint8), cents, classes, refine="threshold", threshold=threshold)
    np.testing.assert_array_equal(out_u8.numpy(), ref)

    det = debias_labels(feats, label, cents, multi_hot(classes, 5), refine="threshold",
                        threshold=threshold, return_details=True)
    assert isinstance(det, DebiasResult)
    np.testing.assert_array_equal(det.labels.numpy(), ref)
    np.testing.assert_allclose(det.similarity.numpy(), m_hat, atol=TOL)
    assert_close(det.similarity, debiased_similarity(feats, cents, classes, size=label.shape))
    assert det.mask.dtype == torch.bool
    np.testing.assert_array_equal(det.mask.numpy(), det.similarity.numpy() > threshold)
    assert det.untouched == [np_untouched(label, valid)]


@pytest.mark.parametrize("seed", SEEDS)
def test_debias_untouched_classes_are_reported_and_unchanged(seed):
    rng, V, valid, feats, _, _ = random_problem(seed, C=4, D=4, h=6, w=6, n_invalid=0)
    valid = valid.copy()
    valid[2] = False
    classes = [1, 2, 3]
    label = rng.choice(np.array([0, 1, 2, 3]), size=(6, 6)).astype(np.int64)
    label[0, :4] = [1, 2, 3, 0]  # every class present
    # threshold close to 1: every foreground pixel of a class with a centroid becomes -1
    det = debias_labels(feats, label, make_centroids(V, valid), classes, refine="threshold",
                        threshold=0.999, return_details=True)
    assert det.untouched == [[2]]
    lab = det.labels.numpy()
    np.testing.assert_array_equal(lab[label == 2], 2)
    np.testing.assert_array_equal(lab[label == 0], 0)
    assert (lab[(label == 1) | (label == 3)] == -1).all()
    np.testing.assert_array_equal(lab, np_debias(label, det.mask.numpy(), valid))
    # a plain tensor with an all-zero row behaves the same
    V0 = V.copy()
    V0[2] = 0
    det0 = debias_labels(feats, label, torch.from_numpy(V0), classes, refine="threshold",
                         threshold=0.999, return_details=True)
    assert det0.untouched == [[2]]
    assert_close(det0.labels, det.labels)


@pytest.mark.parametrize("seed", SEEDS)
def test_debias_no_foreground_leaves_label_unchanged(seed):
    rng, V, valid, feats, classes, _ = random_problem(seed)
    label = np.where(rng.random(feats.shape[1:]) < 0.3, IGNORE, 0).astype(np.int64)
    for threshold in (0.0, 0.9):
        det = debias_labels(feats, label, make_centroids(V, valid), classes, refine="threshold",
                            threshold=threshold, return_details=True)
        np.testing.assert_array_equal(det.labels.numpy(), label)
        assert det.untouched == [[]]


@pytest.mark.parametrize("seed", SEEDS)
def test_debias_absent_and_extra_classes(seed):
    """An image class absent from the label still contributes its centroid to M_hat; a label
    class outside the image's classes is judged by the image's centroids only (Eq. 4)."""
    rng, V, valid, feats, _, _ = random_problem(seed, C=5, D=4, h=7, w=8, n_invalid=0)
    classes = [1, 4]                       # class 4 never appears in the label
    label = rng.choice(np.array([0, 1, 3]), size=(7, 8)).astype(np.int64)  # 3 is not an image class
    cents = make_centroids(V, valid)
    m_hat = np_similarity(feats, V.astype(np.float32).astype(np.float64), valid, classes)
    ref = np_debias(label, m_hat > 0.2, valid)
    out = debias_labels(feats, label, cents, classes, refine="threshold", threshold=0.2)
    np.testing.assert_array_equal(out.numpy(), ref)
    # class 4's centroid matters: M_hat without it differs
    m_wo = np_similarity(feats, V.astype(np.float32).astype(np.float64), valid, [1])
    assert np.abs(m_wo - m_hat).max() > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_debias_batch_equals_single(seed):
    rng = np.random.default_rng(50 + seed)
    C, D, B, H, W = 5, 4, 3, 8, 9
    V = rng.standard_normal((C + 1, D))
    valid = np.array([False, True, False, True, True, True])
    cents = make_centroids(V, valid)
    feats = rng.standard_normal((B, D, 4, 5))
    classes = [[1, 2], [3, 5], [2, 4, 5]]
    labels = np.stack([rng.choice(np.array([0] + c), size=(H, W)) for c in classes]).astype(np.int64)
    labels[:, 0, 0] = IGNORE
    det = debias_labels(feats, labels, cents, classes, refine="threshold", threshold=0.3, return_details=True)
    assert det.labels.shape == (B, H, W)
    untouched = []
    for b in range(B):
        one = debias_labels(feats[b], labels[b], cents, classes[b], refine="threshold", threshold=0.3,
                            return_details=True)
        assert_close(det.labels[b], one.labels)
        assert_close(det.similarity[b], one.similarity, atol=TOL)
        assert_close(det.mask[b], one.mask)
        untouched += one.untouched
        m_hat = np_similarity(feats[b], V.astype(np.float32).astype(np.float64), valid, classes[b], size=(H, W))
        np.testing.assert_array_equal(det.labels[b].numpy(), np_debias(labels[b], m_hat > 0.3, valid))
    assert det.untouched == untouched
    assert det.untouched == [np_untouched(labels[b], valid) for b in range(B)]


# --------------------------------------------------------------------------------------------
# refine="crf"
# --------------------------------------------------------------------------------------------
def smooth_problem(seed, C=3, D=4, H=20, W=24):
    """Spatially smooth features (so the CRF has structure to keep) and a matching RGB image."""
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((D, 4, 4))
    feats = np_bilinear(coarse, H, W) + 0.3 * rng.standard_normal((D, H, W))
    V = rng.standard_normal((C + 1, D))
    valid = np.ones(C + 1, bool)
    valid[0] = False
    classes = [1, 2]
    label = rng.choice(np.array([0, 1, 2]), size=(H, W)).astype(np.int64)
    label[:2, :2] = IGNORE
    img = rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
    return feats, V, valid, classes, label, img


@needs_reference
@pytest.mark.parametrize("seed", SEEDS)
def test_crf_labels_consistent_with_mask_and_direct_pydensecrf(seed):
    feats, V, valid, classes, label, img = smooth_problem(seed)
    cents = make_centroids(V, valid)
    det = debias_labels(feats, label, cents, classes, image=img, refine="crf", return_details=True)
    assert det.labels.shape == label.shape and det.mask.shape == label.shape
    # Eq. 5 applied to the CRF's binary mask
    np.testing.assert_array_equal(det.labels.numpy(), np_debias(label, det.mask.numpy(), valid))
    assert det.labels.numpy()[label == IGNORE].tolist() == [IGNORE] * int((label == IGNORE).sum())
    # the soft mask is Eq. 4 ...
    m_hat = np_similarity(feats, V.astype(np.float32).astype(np.float64), valid, classes)
    np.testing.assert_allclose(det.similarity.numpy(), m_hat, atol=TOL)
    # ... and the binary mask is the argmax of a 2-label CRF on [1 - M_hat, M_hat]
    p = det.similarity.numpy().astype(np.float64)
    q = ref_crf(np.stack([1 - p, p]), img)
    assert_mask_is_crf_argmax(det.mask.numpy(), q)
    # the plain call returns the same labels
    out = debias_labels(feats, label, cents, classes, image=img)
    assert_close(out, det.labels)
    # and the reference backend gives the reference's mask
    via_ref = debias_labels(feats, label, cents, classes, image=img, crf_backend="pydensecrf", return_details=True)
    np.testing.assert_array_equal(via_ref.mask.numpy(), q.argmax(0) == 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_crf_near_certain_mask_equals_threshold_mask(seed):
    rng = np.random.default_rng(seed)
    H, W = 24, 32
    # centroid of class 1 along e0; M_hat ~ 0.999 in the "object" block, ~ 0.001 elsewhere
    V = np.zeros((3, 2))
    V[1] = [1.0, 0.0]
    V[2] = [0.0, 1.0]
    valid = np.array([False, True, False])
    obj = np.zeros((H, W), bool)
    r0, c0 = int(rng.integers(2, 8)), int(rng.integers(2, 10))
    obj[r0:r0 + 12, c0:c0 + 14] = True
    hi, lo = np.array([0.999, np.sqrt(1 - 0.999 ** 2)]), np.array([0.001, np.sqrt(1 - 0.001 ** 2)])
    feats = np.where(obj[None], hi[:, None, None], lo[:, None, None])
    img = np.where(obj[..., None], np.array([200, 40, 40]), np.array([30, 90, 160])).astype(np.uint8)
    label = np.where(rng.random((H, W)) < 0.7, 1, 0).astype(np.int64)
    label[0, 0] = IGNORE
    cents = make_centroids(V, valid)
    crf = debias_labels(feats, label, cents, [1], image=img, refine="crf", return_details=True)
    thr = debias_labels(feats, label, cents, [1], refine="threshold", threshold=0.5, return_details=True)
    np.testing.assert_array_equal(thr.mask.numpy(), obj)
    assert_close(crf.mask, thr.mask)
    assert_close(crf.labels, thr.labels)
    assert (crf.labels == BIASED).any()


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_crf_image_layouts_give_identical_results(seed):
    feats, V, valid, classes, label, img = smooth_problem(seed, H=18, W=21)
    cents = make_centroids(V, valid)
    ref = debias_labels(feats, label, cents, classes, image=img, return_details=True)
    chw = np.ascontiguousarray(img.transpose(2, 0, 1))
    variants = [
        torch.from_numpy(img),
        chw,
        torch.from_numpy(chw),
        img.astype(np.float32) / 255.0,
        torch.from_numpy(chw).double() / 255.0,
        # float images are scaled by 255 and *rounded*: a perturbation below half a level is lost
        np.clip((img + np.random.default_rng(seed).uniform(-0.45, 0.45, img.shape)) / 255.0, 0.0, 1.0),
    ]
    for v in variants:
        got = debias_labels(feats, label, cents, classes, image=v, return_details=True)
        assert_close(got.labels, ref.labels)
        assert_close(got.mask, ref.mask)
    # with another image the CRF output may change, but the labels stay consistent with Eq. 5
    # (that the image reaches the CRF at all is checked against pydensecrf in the tests above)
    other = debias_labels(feats, label, cents, classes, image=255 - img, return_details=True)
    np.testing.assert_array_equal(other.labels.numpy(), np_debias(label, other.mask.numpy(), valid))


def test_crf_batch_equals_single():
    probs = [smooth_problem(s, H=14, W=15) for s in (7, 8)]
    feats = np.stack([p[0] for p in probs])
    V, valid = probs[0][1], probs[0][2]
    cents = make_centroids(V, valid)
    labels = np.stack([p[4] for p in probs])
    imgs = np.stack([p[5] for p in probs])
    classes = [[1, 2], [2]]
    batch = debias_labels(feats, labels, cents, classes, image=imgs, return_details=True)
    batch_chw = debias_labels(feats, labels, cents, classes, image=imgs.transpose(0, 3, 1, 2), return_details=True)
    assert_close(batch.labels, batch_chw.labels)
    for b in range(2):
        one = debias_labels(feats[b], labels[b], cents, classes[b], image=imgs[b], return_details=True)
        assert_close(batch.labels[b], one.labels)
        assert_close(batch.mask[b], one.mask)


def test_crf_missing_image_raises():
    feats, V, valid, classes, label, _ = smooth_problem(0, H=8, W=8)
    with pytest.raises(ValueError, match="image"):
        debias_labels(feats, label, make_centroids(V, valid), classes, refine="crf")
    with pytest.raises(ValueError, match="image"):
        debias_labels(feats, label, make_centroids(V, valid), classes)  # crf is the default


def test_crf_wrong_image_shape_raises():
    feats, V, valid, classes, label, img = smooth_problem(0, H=8, W=10)
    with pytest.raises(ValueError, match="image"):
        debias_labels(feats, label, make_centroids(V, valid), classes, image=img[:, :9])
    with pytest.raises(ValueError, match="image"):
        debias_labels(feats, label, make_centroids(V, valid), classes, image=img.astype(np.float32))  # > 1


@needs_reference
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("params", [{"iterations": 3, "bilateral_compat": 4, "gaussian_sxy": 2}, "psa", "mars"])
def test_crf_params_override(seed, params):
    feats, V, valid, classes, label, img = smooth_problem(seed, H=16, W=18)
    cents = make_centroids(V, valid)
    det = debias_labels(feats, label, cents, classes, image=img, crf_params=params, return_details=True)
    p = det.similarity.numpy().astype(np.float64)
    q = ref_crf(np.stack([1 - p, p]), img, params)
    assert_mask_is_crf_argmax(det.mask.numpy(), q)
    np.testing.assert_array_equal(det.labels.numpy(), np_debias(label, det.mask.numpy(), valid))


def test_crf_params_rejected():
    feats, V, valid, classes, label, img = smooth_problem(0, H=8, W=8)
    cents = make_centroids(V, valid)
    with pytest.raises(ValueError, match="unknown key 'sigma'"):
        debias_labels(feats, label, cents, classes, image=img, crf_params={"sigma": 3})
    with pytest.raises(ValueError, match="crf_params"):
        debias_labels(feats, label, cents, classes, image=img, crf_params={"iterations": 0})
    with pytest.raises(ValueError, match="crf_params"):
        debias_labels(feats, label, cents, classes, image=img, crf_params={"iterations": 2.5})
    with pytest.raises(TypeError, match="crf_params"):
        debias_labels(feats, label, cents, classes, image=img, crf_params=[("iterations", 3)])
    with pytest.raises(ValueError, match="crf_params 'potts' is not a preset"):
        debias_labels(feats, label, cents, classes, image=img, crf_params="potts")
    with pytest.raises(ValueError, match="crf_backend"):
        debias_labels(feats, label, cents, classes, image=img, crf_backend="numba")


# --------------------------------------------------------------------------------------------
# bad input: every error names the argument
# --------------------------------------------------------------------------------------------
def _good(seed=0):
    _, V, valid, feats, classes, label = random_problem(seed, C=4, D=3, h=5, w=6)
    return dict(features=feats, pseudo_label=label, centroids=make_centroids(V, valid),
                image_classes=classes, refine="threshold")


def _call(**kw):
    args = _good()
    args.update(kw)
    return debias_labels(args.pop("features"), args.pop("pseudo_label"), args.pop("centroids"),
                         args.pop("image_classes"), **args)


def test_good_call_runs():
    assert _call().shape == (5, 6)


def _nan_features():
    f = _good()["features"].copy()
    f[1, 2, 3] = np.nan
    return f


def _label_with(value):
    y = _good()["pseudo_label"].copy()
    y[1, 1] = value
    return y


BAD_DEBIAS = [
    ("features_2d", dict(features=np.zeros((5, 6))), ValueError, "features"),
    ("features_5d", dict(features=np.zeros((1, 1, 3, 5, 6))), ValueError, "features"),
    ("features_nan", dict(features=_nan_features()), ValueError, "features"),
    ("features_complex", dict(features=np.ones((3, 5, 6), dtype=np.complex64)), TypeError, "features"),
    ("features_not_array", dict(features="abc"), TypeError, "features"),
    ("D_mismatch", dict(features=np.ones((4, 5, 6))), ValueError, "centroids"),
    ("label_above_C", dict(pseudo_label=_label_with(5)), ValueError, "pseudo_label"),
    ("label_above_C_plain", dict(pseudo_label=_label_with(5),
                                 centroids=torch.ones(5, 3)), ValueError, "pseudo_label"),
    ("label_minus_one", dict(pseudo_label=_label_with(-1)), ValueError, "pseudo_label"),
    ("label_negative", dict(pseudo_label=_label_with(-3)), ValueError, "pseudo_label"),
    ("label_float", dict(pseudo_label=_label_with(1).astype(np.float32) + 0.5), TypeError, "pseudo_label"),
    ("label_wrong_ndim", dict(pseudo_label=np.zeros((1, 5, 6), np.int64)), ValueError, "pseudo_label"),
    ("classes_wrong_length", dict(image_classes=torch.tensor([1, 0, 1])), ValueError, "image_classes"),
    ("classes_not_binary", dict(image_classes=torch.tensor([2, 0, 1, 0])), ValueError, "image_classes"),
    ("classes_id_out_of_range", dict(image_classes=[1, 5]), ValueError, "image_classes"),
    ("classes_id_zero", dict(image_classes=[0, 2]), ValueError, "image_classes"),
    ("classes_id_float", dict(image_classes=[1.5]), TypeError, "image_classes"),
    ("classes_none", dict(image_classes=None), TypeError, "image_classes"),
    ("centroids_bad", dict(centroids=torch.ones(5)), ValueError, "centroids"),
    ("refine_unknown", dict(refine="bilateral"), ValueError, "refine"),
    ("refine_none", dict(refine=None), ValueError, "refine"),
    ("threshold_one", dict(threshold=1.0), ValueError, "threshold"),
    ("threshold_negative", dict(threshold=-0.1), ValueError, "threshold"),
    ("threshold_nan", dict(threshold=float("nan")), TypeError, "threshold"),
    ("threshold_str", dict(threshold="0.5"), TypeError, "threshold"),
]


@pytest.mark.parametrize("name,kw,exc,match", BAD_DEBIAS, ids=[b[0] for b in BAD_DEBIAS])
def test_debias_labels_bad_input(name, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


def test_debias_labels_bad_batch_input():
    rng = np.random.default_rng(0)
    V = rng.standard_normal((4, 3))
    cents = make_centroids(V, np.array([False, True, True, True]))
    feats = rng.standard_normal((2, 3, 4, 4))
    labels = rng.integers(0, 4, size=(2, 4, 4))
    with pytest.raises(ValueError, match="image_classes"):
        debias_labels(feats, labels, cents, [[1]], refine="threshold")           # 1 list for 2 images
    with pytest.raises(ValueError, match="image_classes"):
        debias_labels(feats, labels, cents, [[1], [4]], refine="threshold")      # id > C in image 1
    with pytest.raises(ValueError, match="image_classes"):
        debias_labels(feats, labels, cents, torch.ones(3), refine="threshold")   # (C,) for a batch
    with pytest.raises(ValueError, match="pseudo_label"):
        debias_labels(feats, labels[:1], cents, [[1], [2]], refine="threshold")  # 1 label, 2 images
    with pytest.raises(ValueError, match="image"):
        debias_labels(feats, labels, cents, [[1], [2]], image=np.zeros((4, 4, 3), np.uint8))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(features=np.zeros((5, 6))), ValueError, "features"),
        (dict(features=_nan_features()), ValueError, "features"),
        (dict(features=np.ones((4, 5, 6))), ValueError, "centroids"),
        (dict(image_classes=[0]), ValueError, "image_classes"),
        (dict(image_classes=[9]), ValueError, "image_classes"),
        (dict(image_classes=np.ones(5)), ValueError, "image_classes"),
    ],
)
def test_debiased_similarity_bad_input(kw, exc, match):
    args = _good()
    args.update(kw)
    with pytest.raises(exc, match=match):
        debiased_similarity(args["features"], args["centroids"], args["image_classes"])


# --------------------------------------------------------------------------------------------
# Eq. 5 in two steps: refine_mask and mark_biased
# --------------------------------------------------------------------------------------------
def test_refine_mask_and_mark_biased_compose_to_debias_labels():
    from mars_plugin.method.debias import mark_biased, refine_mask

    probs = [smooth_problem(s, H=14, W=15 + s) for s in (3, 4)]
    V, valid = probs[0][1], probs[0][2]
    cents = make_centroids(V, valid)
    sims = [debiased_similarity(p[0], cents, [1, 2]) for p in probs]
    masks = refine_mask(sims, [p[5] for p in probs], "psa")  # a list: two sizes, one CRF call
    for p, sim, mask in zip(probs, sims, masks):
        det = debias_labels(p[0], p[4], cents, [1, 2], image=p[5], crf_params="psa", return_details=True)
        assert_close(mask, det.mask)
        assert_close(refine_mask(sim, p[5], "psa"), det.mask)
        assert_close(mark_biased(p[4], mask, cents), det.labels)


def test_mark_biased_rejects_bad_input():
    from mars_plugin.method.debias import mark_biased

    _, V, valid, _, _, label = random_problem(0, C=4, D=3, h=5, w=6)
    cents = make_centroids(V, valid)
    ok = torch.ones(label.shape, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask must be a bool tensor of the pseudo label's shape"):
        mark_biased(label, ok[:, :3], cents)
    with pytest.raises(ValueError, match="mask must be a bool"):
        mark_biased(label, ok.long(), cents)
    bad = label.copy()
    bad[0, 0] = 9
    with pytest.raises(ValueError, match="centroids cover 1..4"):
        mark_biased(bad, ok, cents)
