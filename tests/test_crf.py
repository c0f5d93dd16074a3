"""The torch dense CRF against pydensecrf (the reference the WSSS repositories call), batching,
label masks, the label unary, presets and bad input.

The conformance tests call pydensecrf directly here, exactly as PSA/SEAM/RS+EPM/DHR call it,
and are skipped where the ``crf`` extra is not installed; everything else runs without it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mars_plugin.engines.crf import DenseCRF, dense_crf, dense_crf_from_unary, unary_from_labels
from mars_plugin.engines.crf_params import CRF_PRESETS, DEFAULT_CRF_PARAMS, check_crf_params

try:  # the reference; optional
    import pydensecrf.densecrf as dcrf
    from pydensecrf.utils import unary_from_labels as ref_unary_from_labels
    from pydensecrf.utils import unary_from_softmax
except ImportError:  # pragma: no cover - CI installs the crf extra
    dcrf = None
needs_reference = pytest.mark.skipif(dcrf is None, reason="pydensecrf (the crf extra) is not installed")

# What the issue asks of the conformance, and what we measure (far below it).
MAX_ABS_DIFF = 1e-3
MIN_AGREEMENT = 0.999


def reference(unary: np.ndarray, img: np.ndarray, p) -> np.ndarray:
    """pydensecrf's DenseCRF2D as the WSSS repositories call it: (L, H, W) energy -> Q."""
    L, H, W = unary.shape
    d = dcrf.DenseCRF2D(W, H, L)
    d.setUnaryEnergy(np.ascontiguousarray(unary.reshape(L, -1), dtype=np.float32))
    d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
    d.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"], rgbim=np.ascontiguousarray(img),
                           compat=p["bilateral_compat"])
    return np.asarray(d.inference(int(p["iterations"])), dtype=np.float32).reshape(L, H, W)


def reference_probs(probs: np.ndarray, img: np.ndarray, p) -> np.ndarray:
    L, H, W = probs.shape
    return reference(unary_from_softmax(probs).reshape(L, H, W), img, p)


def make_image(kind: str, H: int, W: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:H, 0:W]
    if kind == "random":
        return rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    if kind == "smooth":
        img = np.stack([128 + 100 * np.sin(xs / 7.0 + c) * np.cos(ys / 5.0) for c in range(3)], -1)
        return np.clip(img, 0, 255).astype(np.uint8)
    assert kind == "edges"
    img = np.zeros((H, W, 3), np.uint8)
    img[:, : W // 3] = (200, 30, 30)
    img[H // 2:, W // 3:] = (20, 200, 60)
    img[: H // 2, W // 3:] = (10, 10, 240)
    img[(ys - H / 2) ** 2 + (xs - W / 2) ** 2 < (min(H, W) / 4) ** 2] = (250, 250, 0)
    return img


def make_probs(L: int, H: int, W: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1000)
    logits = rng.normal(0, 2, (L, H, W)).astype(np.float32)
    p = np.exp(logits - logits.max(0))
    return (p / p.sum(0)).astype(np.float32)


def agreement(q: np.ndarray, q_ref: np.ndarray) -> float:
    return float((q.argmax(0) == q_ref.argmax(0)).mean())


# --------------------------------------------------------------------------------------------
# conformance with pydensecrf
# --------------------------------------------------------------------------------------------
@needs_reference
@pytest.mark.parametrize("preset", ["mars", "psa"])
@pytest.mark.parametrize("L", [2, 21])
@pytest.mark.parametrize("iterations", [1, 10])
@pytest.mark.parametrize("kind, size", [("random", (37, 53)), ("smooth", (45, 31)), ("edges", (29, 61)),
                                        ("random", (64, 45))])
def test_marginals_match_pydensecrf(preset, L, iterations, kind, size):
    H, W = size
    seed = H * W + L
    img, probs = make_image(kind, H, W, seed), make_probs(L, H, W, seed)
    p = dict(CRF_PRESETS[preset], iterations=iterations)
    q = dense_crf(torch.from_numpy(probs), img, p)
    assert q.dtype == torch.float32 and q.shape == (L, H, W)
    q_ref = reference_probs(probs, img, p)
    diff = float(np.abs(q.numpy() - q_ref).max())
    # measured: at most ~5e-5 (float32 summation order and exp); the issue asks for 1e-3
    assert diff <= 1e-4, diff
    assert diff <= MAX_ABS_DIFF and agreement(q.numpy(), q_ref) >= MIN_AGREEMENT


@needs_reference
@pytest.mark.parametrize("size", [(1, 1), (1, 9), (7, 1), (3, 5)])
def test_tiny_images_match_pydensecrf(size):
    H, W = size
    img, probs = make_image("random", H, W, 1), make_probs(3, H, W, 1)
    q = dense_crf(probs, img, "mars")
    np.testing.assert_allclose(q.numpy(), reference_probs(probs, img, DEFAULT_CRF_PARAMS), atol=1e-5)


@needs_reference
@pytest.mark.parametrize("zero_unsure", [False, True])
def test_label_unary_matches_pydensecrf(zero_unsure):
    rng = np.random.default_rng(3)
    H, W, n = 23, 19, 4
    labels = rng.integers(0 if not zero_unsure else 0, n if not zero_unsure else n + 1, (H, W))
    u = unary_from_labels(torch.from_numpy(labels), n, 0.7, zero_unsure=zero_unsure)
    u_ref = ref_unary_from_labels(labels, n, gt_prob=0.7, zero_unsure=zero_unsure)
    np.testing.assert_array_equal(u.numpy().reshape(n, -1), u_ref)
    # IRNet/AdvCAM's crf_inference_label: sxy 3 / compat 3, bilateral 50 / 5 / 10
    p = dict(iterations=10, gaussian_sxy=3, gaussian_compat=3, bilateral_sxy=50, bilateral_srgb=5, bilateral_compat=10)
    img = make_image("edges", H, W, 0)
    q = dense_crf_from_unary(u, img, p)
    q_ref = reference(u_ref.reshape(n, H, W), img, p)
    assert float(np.abs(q.numpy() - q_ref).max()) <= 1e-4
    assert agreement(q.numpy(), q_ref) == 1.0


@needs_reference
def test_pydensecrf_backend_is_the_reference():
    img, probs = make_image("smooth", 20, 30, 0), make_probs(3, 20, 30, 0)
    q = dense_crf(probs, img, "psa", backend="pydensecrf")
    # the same library on the same unary (up to numpy's and torch's log in the last bit)
    np.testing.assert_allclose(q.numpy(), reference_probs(probs, img, CRF_PRESETS["psa"]), rtol=0, atol=1e-6)


@needs_reference
def test_float64_probabilities_are_clipped_in_float64_as_upstream():
    # debias_labels hands [1 - M_hat, M_hat] in float64 to the CRF, as it handed it to pydensecrf.
    probs = make_probs(2, 17, 23, 4).astype(np.float64)
    probs[0, :3] = 0.0
    img = make_image("random", 17, 23, 4)
    np.testing.assert_allclose(dense_crf(probs, img).numpy(), reference_probs(probs, img, DEFAULT_CRF_PARAMS),
                               atol=1e-5)


# --------------------------------------------------------------------------------------------
# batching: equal to one image at a time
# --------------------------------------------------------------------------------------------
SIZES = [(21, 34), (40, 17), (5, 5), (33, 33)]


def test_list_of_different_sizes_equals_one_by_one():
    imgs = [make_image("random", H, W, i) for i, (H, W) in enumerate(SIZES)]
    probs = [torch.from_numpy(make_probs(3, H, W, i)) for i, (H, W) in enumerate(SIZES)]
    together = dense_crf(probs, imgs, "psa", chunk_pixels=10 ** 6)
    assert isinstance(together, list) and len(together) == len(SIZES)
    for q, p, img in zip(together, probs, imgs):
        torch.testing.assert_close(q, dense_crf(p, img, "psa"), rtol=0, atol=1e-6)


def test_batch_tensor_equals_one_by_one_and_chunking_changes_nothing():
    B, L, H, W = 5, 4, 18, 26  # 468 pixels: no image is a multiple of 4 in its last block
    imgs = torch.from_numpy(np.stack([make_image("smooth", H, W, i) for i in range(B)]))
    probs = torch.from_numpy(np.stack([make_probs(L, H, W, i) for i in range(B)]))
    one_lattice = dense_crf(probs, imgs, chunk_pixels=10 ** 6)
    per_image = dense_crf(probs, imgs, chunk_pixels=1)
    assert one_lattice.shape == (B, L, H, W)
    torch.testing.assert_close(one_lattice, per_image, rtol=0, atol=1e-6)
    for b in range(B):
        torch.testing.assert_close(one_lattice[b], dense_crf(probs[b], imgs[b]), rtol=0, atol=1e-6)


def test_channel_first_and_float_images_equal_uint8():
    img = make_image("edges", 16, 20, 0)
    probs = torch.from_numpy(make_probs(2, 16, 20, 0))
    q = dense_crf(probs, img)
    assert torch.equal(dense_crf(probs, torch.from_numpy(img).permute(2, 0, 1)), q)
    assert torch.equal(dense_crf(probs, torch.from_numpy(img).float() / 255), q)


def test_kept_position_lattices_give_the_fresh_result_and_stay_bounded():
    import mars_plugin.engines.crf_lattices as crf_lattices

    img, probs = make_image("edges", 19, 23, 0), torch.from_numpy(make_probs(3, 19, 23, 0))
    crf_lattices.clear_lattice_cache()
    fresh = dense_crf(probs, img)
    assert len(crf_lattices._GAUSSIAN_CACHE) == 1
    assert torch.equal(dense_crf(probs, img), fresh)  # from the kept lattice
    # other sxy, other size: other entries; never more than GAUSSIAN_CACHE_ENTRIES
    assert not torch.equal(dense_crf(probs, img, {"gaussian_sxy": 2}), fresh)
    for w in range(5, 5 + crf_lattices.GAUSSIAN_CACHE_ENTRIES + 3):
        dense_crf(torch.rand(2, 4, w), make_image("random", 4, w, w))
    assert len(crf_lattices._GAUSSIAN_CACHE) == crf_lattices.GAUSSIAN_CACHE_ENTRIES
    crf_lattices.clear_lattice_cache()
    assert len(crf_lattices._GAUSSIAN_CACHE) == 0
    assert torch.equal(dense_crf(probs, img), fresh)


# --------------------------------------------------------------------------------------------
# label masks
# --------------------------------------------------------------------------------------------
def test_valid_mask_equals_running_on_the_valid_labels_only():
    H, W = 24, 19
    img = make_image("smooth", H, W, 2)
    probs = torch.from_numpy(make_probs(5, H, W, 2))
    valid = torch.tensor([True, False, True, True, False])
    sub = probs[valid] / probs[valid].sum(0, keepdim=True)
    full = probs.clone()
    full[valid] = sub
    q = dense_crf(full, img, valid=valid)
    assert torch.all(q[~valid] == 0)
    torch.testing.assert_close(q[valid], dense_crf(sub, img), rtol=0, atol=1e-6)


def test_per_image_masks_in_a_batch():
    B, L, H, W = 3, 4, 12, 15
    imgs = torch.from_numpy(np.stack([make_image("random", H, W, i) for i in range(B)]))
    probs = torch.from_numpy(np.stack([make_probs(L, H, W, i) for i in range(B)]))
    valid = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    q = dense_crf(probs, imgs, valid=valid)
    for b in range(B):
        torch.testing.assert_close(q[b], dense_crf(probs[b], imgs[b], valid=valid[b]), rtol=0, atol=1e-6)
        assert torch.all(q[b][~valid[b]] == 0)


def test_one_label_gives_certainty():
    q = dense_crf(torch.rand(1, 6, 7), make_image("random", 6, 7, 0))
    assert torch.equal(q, torch.ones(1, 6, 7))


# --------------------------------------------------------------------------------------------
# parameters, the module, bad input
# --------------------------------------------------------------------------------------------
def test_presets_and_aliases():
    assert check_crf_params(None) == CRF_PRESETS["mars"] == DEFAULT_CRF_PARAMS
    assert check_crf_params("deeplab") == CRF_PRESETS["mars"]
    assert check_crf_params("seam") == check_crf_params("psa") == CRF_PRESETS["psa"]
    assert CRF_PRESETS["mars"] == dict(iterations=10, gaussian_sxy=1, gaussian_compat=3, bilateral_sxy=67,
                                       bilateral_srgb=3, bilateral_compat=4)
    assert CRF_PRESETS["psa"] == dict(iterations=10, gaussian_sxy=3, gaussian_compat=3, bilateral_sxy=80,
                                      bilateral_srgb=13, bilateral_compat=10)
    assert check_crf_params({"iterations": 3}) == dict(CRF_PRESETS["mars"], iterations=3)


def test_module_equals_function():
    img, probs = make_image("edges", 10, 12, 0), torch.from_numpy(make_probs(3, 10, 12, 0))
    crf = DenseCRF("psa")
    assert torch.equal(crf(probs, img), dense_crf(probs, img, "psa"))
    assert "bilateral_srgb=13" in repr(crf)


@pytest.mark.parametrize("params, err, match", [
    ("potts", ValueError, "preset"),
    ({"sigma": 3}, ValueError, "unknown key"),
    ({"iterations": 0}, ValueError, "positive"),
    ({"iterations": 2.5}, ValueError, "integer"),
    ({"bilateral_srgb": float("nan")}, ValueError, "positive"),
    ({"gaussian_sxy": True}, ValueError, "positive"),
    ({"bilateral_srgb": 1e-40}, ValueError, "overflow"),
    ([("iterations", 3)], TypeError, "preset name or a dict"),
])
def test_bad_params_are_refused(params, err, match):
    with pytest.raises(err, match=match):
        dense_crf(torch.rand(2, 4, 4), make_image("random", 4, 4, 0), params)


def test_bad_inputs_are_refused():
    img = make_image("random", 4, 5, 0)
    p = torch.rand(2, 4, 5)
    with pytest.raises(ValueError, match=r"image must be an RGB image .* \(4, 5\)"):
        dense_crf(p, make_image("random", 5, 4, 0))
    with pytest.raises(ValueError, match="NaN"):
        dense_crf(torch.full((2, 4, 5), float("nan")), img)
    with pytest.raises(ValueError, match="floating"):
        dense_crf(torch.ones(2, 4, 5, dtype=torch.long), img)
    with pytest.raises(ValueError, match="same number of labels"):
        dense_crf([p, torch.rand(3, 4, 5)], [img, img])
    with pytest.raises(ValueError, match="form of unary"):
        dense_crf([p], img)
    with pytest.raises(ValueError, match="empty"):
        dense_crf([], [])
    with pytest.raises(ValueError, match="allows no label"):
        dense_crf(p, img, valid=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid must be a bool tensor"):
        dense_crf(p, img, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dense_crf(p, img.astype(np.float32))
    with pytest.raises(ValueError, match="crf_backend"):
        dense_crf(p, img, backend="cuda")
    with pytest.raises(ValueError, match="chunk_pixels"):
        dense_crf(p, img, chunk_pixels=0)
    with pytest.raises(ValueError, match="-Inf"):
        dense_crf_from_unary(torch.full((2, 4, 5), float("-inf")), img)
    with pytest.raises(ValueError, match="forbids every label"):
        dense_crf_from_unary(torch.full((2, 4, 5), float("inf")), img)


def test_bad_label_unary_inputs():
    with pytest.raises(ValueError, match="n_labels"):
        unary_from_labels(torch.zeros(3, 3, dtype=torch.long), 1, 0.7)
    with pytest.raises(ValueError, match="gt_prob"):
        unary_from_labels(torch.zeros(3, 3, dtype=torch.long), 3, 1.0)
    with pytest.raises(ValueError, match="0..2"):
        unary_from_labels(torch.full((3, 3), 3), 3, 0.7, zero_unsure=False)
    with pytest.raises(TypeError, match="integer"):
        unary_from_labels(torch.zeros(3, 3), 3, 0.7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_equals_cpu():
    imgs = [make_image("random", H, W, i) for i, (H, W) in enumerate(SIZES)]
    probs = [torch.from_numpy(make_probs(3, H, W, i)) for i, (H, W) in enumerate(SIZES)]
    cpu = dense_crf(probs, imgs)
    gpu = dense_crf([p.cuda() for p in probs], [torch.from_numpy(i).cuda() for i in imgs])
    for a, b in zip(gpu, cpu):
        assert a.device.type == "cuda"
        # the CPU runs the numba lattice, CUDA the torch one: their float32 sums differ in order
        # (on these inputs the CPU's numba and torch paths differ by up to 2.1e-5 themselves; on an
        # H100 CUDA vs the numba CPU was 4.1e-5 on 2 of 3,267 values), so the tolerance is the one
        # the CRF keeps against pydensecrf
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-4)
        assert (a.cpu().argmax(0) == b.argmax(0)).float().mean() >= 0.9999
