"""mars_plugin.densecrf, the pydensecrf drop-in: the same API, refusals and results as
pydensecrf itself (the ``crf`` extra) on random inputs and on scikit-learn's photographs, for
every normalisation, label compatibility, kernel type and custom feature dimension, on the
compiled (numba) path and on the torch path."""
import numpy as np
import pytest
import torch

import mars_plugin.densecrf as dcrf
from mars_plugin.densecrf.utils import create_pairwise_bilateral, create_pairwise_gaussian, unary_from_softmax

Q_TOL = 1e-4
LABEL_AGREEMENT = 0.9999


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    """Each test on both CPU paths: numba's CompiledLattice, and torch's PermutohedralLattice
    (forced with MARS_NO_NUMBA=1, read when a CRF object is made)."""
    if request.param == "compiled":
        pytest.importorskip("numba")
        monkeypatch.delenv("MARS_NO_NUMBA", raising=False)
    else:
        monkeypatch.setenv("MARS_NO_NUMBA", "1")
    monkeypatch.delenv(dcrf.DEVICE_ENV, raising=False)
    return request.param


@pytest.fixture
def ref():
    return pytest.importorskip("pydensecrf.densecrf")


def _photo(which: int, H: int, W: int) -> np.ndarray:
    from sklearn.datasets import load_sample_images
    img = load_sample_images().images[which]
    return img[100:100 + H, 150:150 + W].copy()  # sklearn's arrays are read-only


def _probs(L: int, H: int, W: int, seed: int = 0) -> np.ndarray:
    """Smooth random probabilities (L, H, W) float32, as a network's upsampled softmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, L, max(2, H // 8), max(2, W // 8), generator=g) * 3
    logits = torch.nn.functional.interpolate(logits, (H, W), mode="bilinear", align_corners=False)[0]
    return np.ascontiguousarray(torch.softmax(logits, 0).numpy())


def _compat(kind: str, L: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    if kind == "potts":
        return 4.0
    if kind == "diagonal":
        return -rng.uniform(1, 5, L).astype(np.float32)
    m = rng.uniform(-3, 3, (L, L)).astype(np.float32)
    return (m + m.T).astype(np.float32) if kind == "symmetric" else m


def _run(module, build, n: int, make):
    d = make(module)
    build(d)
    return np.array(d.inference(n))


def _assert_close(q_ours: np.ndarray, q_ref: np.ndarray) -> None:
    assert q_ours.dtype == np.float32 and q_ours.shape == q_ref.shape
    assert np.abs(q_ours - q_ref).max() <= Q_TOL
    assert (q_ours.argmax(0) == q_ref.argmax(0)).mean() >= LABEL_AGREEMENT


def _compare(ref, build, n: int, make) -> np.ndarray:
    q_ref = _run(ref, build, n, make)
    q = _run(dcrf, build, n, make)
    _assert_close(q, q_ref)
    return q


# ---------------------------------------------------------------- the constants and the paths
def test_constants_have_pydensecrfs_values(ref):
    for name in ("CONST_KERNEL", "DIAG_KERNEL", "FULL_KERNEL", "NO_NORMALIZATION", "NORMALIZE_BEFORE",
                 "NORMALIZE_AFTER", "NORMALIZE_SYMMETRIC"):
        assert int(getattr(dcrf, name)) == int(getattr(ref, name)), name


def test_the_path_fixture_picks_the_lattice(path):
    d = dcrf.DenseCRF2D(4, 3, 2)
    assert d._engine.compiled == (path == "compiled")
    assert d.device == torch.device("cpu")


# ---------------------------------------------------------------- equality with pydensecrf
@pytest.mark.parametrize("normalization", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["potts", "diagonal", "symmetric", "asymmetric"])
def test_photo_every_normalisation_and_compat(path, ref, normalization, kind):
    H, W, L = 40, 56, 4
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W))
    compat = _compat(kind, L)

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(sxy=(3, 2), compat=compat, normalization=normalization)
        d.addPairwiseBilateral(sxy=(30, 20), srgb=(13, 10, 8), rgbim=img, compat=compat, normalization=normalization)
    _compare(ref, build, 5, lambda m: m.DenseCRF2D(W, H, L))


@pytest.mark.parametrize("preset", [(1, 3, 67, 3, 4), (3, 3, 80, 13, 10)])
def test_flower_photo_the_codebases_settings(path, ref, preset):
    """deeplab-pytorch's / RS+EPM's (sxy 1, bilateral 67/3) and PSA's / SEAM's (3; 80/13) kernels
    at 96x128 with 21 labels, 10 iterations: scalar sxy (the kept position lattice)."""
    gs, gc, bs, bc_rgb, bc = preset
    H, W, L = 96, 128, 21
    img, u = _photo(1, H, W), unary_from_softmax(_probs(L, H, W, seed=3))

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(sxy=gs, compat=gc)
        d.addPairwiseBilateral(sxy=bs, srgb=bc_rgb, rgbim=img, compat=bc)
    _compare(ref, build, 10, lambda m: m.DenseCRF2D(W, H, L))


def test_several_terms_and_kernel_types(path, ref):
    H, W, L = 32, 40, 3
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W, seed=5))

    def build(d, kernels=(dcrf.CONST_KERNEL, dcrf.DIAG_KERNEL, dcrf.FULL_KERNEL)):
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(1, 3, kernels[0], dcrf.NORMALIZE_SYMMETRIC)
        d.addPairwiseGaussian((5, 7), _compat("diagonal", L), kernels[1], dcrf.NORMALIZE_AFTER)
        d.addPairwiseBilateral(20, 10, img, _compat("asymmetric", L), kernels[2], dcrf.NORMALIZE_BEFORE)
        d.addPairwiseBilateral(50, 20, img, 5, kernels[0], dcrf.NO_NORMALIZATION)
    q = _compare(ref, build, 5, lambda m: m.DenseCRF2D(W, H, L))
    # the kernel type changes nothing (pydensecrf's kernel parameters start at the identity)
    for k in (dcrf.CONST_KERNEL, dcrf.DIAG_KERNEL, dcrf.FULL_KERNEL):
        d = dcrf.DenseCRF2D(W, H, L)
        build(d, (k, k, k))
        np.testing.assert_array_equal(d.inference(5), q)


@pytest.mark.parametrize("D", [1, 2, 3, 5])
def test_custom_features(path, ref, D):
    N, L = 700, 3
    rng = np.random.default_rng(D)
    feats = np.ascontiguousarray(rng.uniform(0, 6, (D, N)).astype(np.float32))
    u = np.ascontiguousarray(rng.uniform(0, 3, (L, N)).astype(np.float32))

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseEnergy(feats, compat=2.0)
        d.addPairwiseEnergy(feats * np.float32(0.5), compat=_compat("symmetric", L), normalization=dcrf.NORMALIZE_AFTER)
    _compare(ref, build, 5, lambda m: m.DenseCRF(N, L))


@pytest.mark.slow
def test_too_many_dimensions_for_the_compiled_lattice(path):
    from mars_plugin.engines.crf_terms import COMPILED_MAX_DIM
    feats = np.zeros((COMPILED_MAX_DIM + 1, 4), np.float32)
    d = dcrf.DenseCRF(4, 2)
    if path == "compiled":
        with pytest.raises(ValueError, match=f"features: got D = {COMPILED_MAX_DIM + 1} dimensions"):
            d.addPairwiseEnergy(feats, 3)
    else:
        d.addPairwiseEnergy(feats, 3)
        assert d.inference(1).shape == (2, 4)


def test_utils_features_through_add_pairwise_energy(path, ref):
    H, W, L = 30, 36, 3
    img, u = _photo(1, H, W), unary_from_softmax(_probs(L, H, W, seed=7))

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseEnergy(create_pairwise_gaussian((3, 3), (H, W)), compat=3)
        d.addPairwiseEnergy(create_pairwise_bilateral((40, 40), (13, 13, 13), img, chdim=2), compat=6)
    _compare(ref, build, 5, lambda m: m.DenseCRF(H * W, L))


def test_logistic_unary(path, ref):
    N, L, K = 300, 3, 4
    rng = np.random.default_rng(2)
    Lmat = rng.normal(size=(L, K)).astype(np.float32)
    f = rng.uniform(0, 1, (K, N)).astype(np.float32)
    feats = rng.uniform(0, 4, (2, N)).astype(np.float32)

    def build(d):
        d.setUnary(d_module(d).LogisticUnary(Lmat, f))
        d.addPairwiseEnergy(feats, compat=3)

    def d_module(d):
        return dcrf if isinstance(d, dcrf.DenseCRF) else ref
    _compare(ref, build, 4, lambda m: m.DenseCRF(N, L))


def test_step_inference_and_kl_divergence(path, ref):
    H, W, L = 24, 30, 3
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W, seed=9))
    results = []
    for m in (ref, dcrf):
        d = m.DenseCRF2D(W, H, L)
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(3, _compat("asymmetric", L))
        d.addPairwiseBilateral(20, 13, img, 10, normalization=m.NORMALIZE_BEFORE)
        Q, tmp1, tmp2 = d.startInference()
        kls, qs = [], []
        for _ in range(3):
            kls.append(d.klDivergence(Q))
            d.stepInference(Q, tmp1, tmp2)  # Q updated in place, as upstream's loop expects
            qs.append(np.array(Q))
        qs.append(np.array(d.inference(3)))
        results.append((kls, qs))
    (kl_ref, q_ref), (kl, q) = results
    np.testing.assert_allclose(kl, kl_ref, rtol=1e-4)
    for a, b in zip(q, q_ref):
        _assert_close(a, b)
    np.testing.assert_array_equal(q[2], q[3])  # three steps are inference(3)


def test_start_inference_without_unary_is_zero_as_pydensecrf(ref):
    d = dcrf.DenseCRF(6, 3)
    np.testing.assert_array_equal(d.startInference()[0], np.array(ref.DenseCRF(6, 3).startInference()[0]))
    np.testing.assert_array_equal(d.inference(0), np.full((3, 6), 1 / 3, np.float32))


@pytest.mark.parametrize("case", ["zero iterations", "one label", "one pixel"])
def test_edge_cases(path, ref, case):
    H, W, L, n = {"zero iterations": (8, 9, 3, 0), "one label": (8, 9, 1, 3), "one pixel": (1, 1, 3, 3)}[case]
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W)) if L > 1 else np.zeros((1, H * W), np.float32)

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(3, 3)
        d.addPairwiseBilateral(50, 13, img, 10)
    q = _compare(ref, build, n, lambda m: m.DenseCRF2D(W, H, L))
    assert q.shape == (L, H * W) and q.reshape(L, H, W).shape == (L, H, W)


@pytest.mark.slow
def test_full_size_photo(ref):
    """One 375x500 photograph, 21 labels, 10 iterations, PSA's / SEAM's settings."""
    H, W, L = 375, 500, 21
    from sklearn.datasets import load_sample_images
    img = np.ascontiguousarray(load_sample_images().images[0][:H, :W])
    u = unary_from_softmax(_probs(L, H, W, seed=11))

    def build(d):
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian(sxy=3, compat=3)
        d.addPairwiseBilateral(sxy=80, srgb=13, rgbim=img, compat=10)
    _compare(ref, build, 10, lambda m: m.DenseCRF2D(W, H, L))


# ---------------------------------------------------------------- refusals
def _crf():
    return dcrf.DenseCRF2D(4, 3, 2)


GOOD_U = np.zeros((2, 12), np.float32)
GOOD_IM = np.zeros((3, 4, 3), np.uint8)
REFUSALS = {
    "unary of the wrong shape": (lambda: _crf().setUnaryEnergy(np.zeros((3, 12), np.float32)), ValueError, r"u: got shape \(3, 12\); expected \(2, 12\)"),
    "float64 unary": (lambda: _crf().setUnaryEnergy(np.zeros((2, 12))), ValueError, "u: got dtype float64; expected"),
    "non-C-contiguous unary": (lambda: _crf().setUnaryEnergy(np.asfortranarray(GOOD_U)), ValueError, "u: .*not C-contiguous"),
    "unary None": (lambda: _crf().setUnaryEnergy(None), TypeError, "u: got None"),
    "unary list": (lambda: _crf().setUnaryEnergy([[0.0] * 12] * 2), TypeError, "u: got a list"),
    "NaN unary": (lambda: _crf().setUnaryEnergy(np.full((2, 12), np.nan, np.float32)), ValueError, "u: contains NaN"),
    "non-C-contiguous rgbim": (lambda: _crf().addPairwiseBilateral(3, 3, np.zeros((4, 3, 3), np.uint8).transpose(1, 0, 2), 3), ValueError, "rgbim: .*not C-contiguous"),
    "rgbim of the wrong size": (lambda: _crf().addPairwiseBilateral(3, 3, np.zeros((4, 3, 3), np.uint8), 3), ValueError, r"rgbim: got shape \(4, 3, 3\); expected \(3, 4, 3\)"),
    "rgbim with 4 channels": (lambda: _crf().addPairwiseBilateral(3, 3, np.zeros((3, 4, 4), np.uint8), 3), ValueError, "rgbim: got 4 channels; expected 3"),
    "float rgbim": (lambda: _crf().addPairwiseBilateral(3, 3, GOOD_IM.astype(np.float32), 3), ValueError, "rgbim: got dtype float32; expected"),
    "compat with 3 dims": (lambda: _crf().addPairwiseGaussian(3, np.zeros((2, 2, 2), np.float32)), ValueError, "compat: got 3 dimensions"),
    "compat of the wrong length": (lambda: _crf().addPairwiseGaussian(3, np.ones(3, np.float32)), ValueError, r"compat: got shape \(3,\); expected \(2,\)"),
    "compat matrix of the wrong size": (lambda: _crf().addPairwiseGaussian(3, np.ones((3, 3), np.float32)), ValueError, r"compat: got shape \(3, 3\); expected \(2, 2\)"),
    "float64 compat": (lambda: _crf().addPairwiseGaussian(3, np.ones(2)), ValueError, "compat: got dtype float64"),
    "compat list": (lambda: _crf().addPairwiseGaussian(3, [1.0, 2.0]), TypeError, "compat: got a list"),
    "features with the wrong N": (lambda: dcrf.DenseCRF(12, 2).addPairwiseEnergy(np.zeros((2, 11), np.float32), 3), ValueError, r"features: got shape \(2, 11\); expected \(D, 12\)"),
    "NaN features": (lambda: dcrf.DenseCRF(12, 2).addPairwiseEnergy(np.full((2, 12), np.nan, np.float32), 3), ValueError, "features: contain NaN"),
    "unknown normalisation": (lambda: _crf().addPairwiseGaussian(3, 3, normalization=7), ValueError, "normalization: got 7; expected one of"),
    "unknown kernel": (lambda: _crf().addPairwiseGaussian(3, 3, kernel=5), ValueError, "kernel: got 5"),
    "sxy of three values": (lambda: _crf().addPairwiseGaussian((1, 2, 3), 3), ValueError, "sxy: got 3 values"),
    "zero srgb": (lambda: _crf().addPairwiseBilateral(3, 0, GOOD_IM, 3), ValueError, "srgb: got 0"),
    "zero width": (lambda: dcrf.DenseCRF2D(0, 3, 2), ValueError, "w: got 0; expected a positive integer"),
    "Q of the wrong shape": (lambda: _crf().stepInference(np.zeros((2, 11), np.float32), None, None), TypeError, r"Q: got float32 \(2, 11\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_argument(case):
    call, kind, message = REFUSALS[case]
    with pytest.raises(kind, match=message):
        call()


@pytest.mark.parametrize("case", ["unary of the wrong shape", "float64 unary", "non-C-contiguous unary", "unary None",
                                  "unary list", "non-C-contiguous rgbim", "rgbim of the wrong size",
                                  "rgbim with 4 channels", "compat with 3 dims", "float64 compat", "compat list",
                                  "features with the wrong N"])
def test_refusals_are_pydensecrfs_kind(ref, monkeypatch, case):
    """Where pydensecrf refuses too, the same exception class (its code may catch it)."""
    monkeypatch.setattr(dcrf, "DenseCRF2D", ref.DenseCRF2D)
    monkeypatch.setattr(dcrf, "DenseCRF", ref.DenseCRF)
    call, kind, _ = REFUSALS[case]
    with pytest.raises(kind):
        call()


def test_read_only_inputs_are_accepted(path):
    """pydensecrf's memoryviews refuse read-only arrays (sklearn's images are); nothing here
    writes to its inputs, so they are taken as they are."""
    H, W, L = 10, 12, 3
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W))
    qs = []
    for writeable in (True, False):
        im, un = img.copy(), u.copy()
        im.flags.writeable = un.flags.writeable = writeable
        d = dcrf.DenseCRF2D(W, H, L)
        d.setUnaryEnergy(un)
        d.addPairwiseBilateral(20, 13, im, 5)
        qs.append(d.inference(3))
    np.testing.assert_array_equal(qs[0], qs[1])


# ---------------------------------------------------------------- devices
def test_device_setting(monkeypatch):
    monkeypatch.delenv(dcrf.DEVICE_ENV, raising=False)
    assert dcrf.DenseCRF(4, 2).device == torch.device("cpu")
    monkeypatch.setenv(dcrf.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="MARS_DENSECRF_DEVICE: got 'tpu'"):
        dcrf.DenseCRF(4, 2)
    try:
        dcrf.set_default_device("cpu")  # overrides the environment
        assert dcrf.DenseCRF(4, 2).device == torch.device("cpu")
    finally:
        dcrf.set_default_device(None)
    with pytest.raises(ValueError, match="device: got 'bogus'"):
        dcrf.DenseCRF(4, 2, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            dcrf.DenseCRF2D(4, 3, 2, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("normalization", [dcrf.NO_NORMALIZATION, dcrf.NORMALIZE_BEFORE, dcrf.NORMALIZE_AFTER,
                                           dcrf.NORMALIZE_SYMMETRIC])
@pytest.mark.parametrize("kind", ["potts", "diagonal", "asymmetric"])
def test_cuda_equals_cpu(kind, normalization):
    # no pydensecrf needed: the CPU drop-in (checked against it above) is the reference here,
    # so this runs on a GPU machine without the crf extra
    H, W, L = 48, 64, 5
    img, u = _photo(0, H, W), unary_from_softmax(_probs(L, H, W))
    qs = []
    for device in ("cpu", "cuda"):
        d = dcrf.DenseCRF2D(W, H, L, device=device)
        d.setUnaryEnergy(u)
        d.addPairwiseGaussian((3, 4), _compat(kind, L), normalization=normalization)
        d.addPairwiseBilateral(30, 13, img, 10, normalization=normalization)
        qs.append(d.inference(5))
    assert isinstance(qs[1], np.ndarray)
    _assert_close(qs[1], qs[0])
