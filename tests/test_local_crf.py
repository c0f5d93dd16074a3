"""Tests of mars_plugin.engines.local_crf, the batched windowed mean-field CRF of the teacher.

The numpy reference below is the update written out pixel by pixel and offset by offset, in
float64, with no unfold and no vectorisation: Q_0 = softmax(log p), then
Q_t(i) = softmax(log p(i) + sum over j in the window, j != i, of k(i, j) Q_{t-1}(j)).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin import complement_labels
from mars_plugin.method.complement import teacher_labels
from mars_plugin.engines.local_crf import LOCAL_CRF_DEFAULTS, local_crf

SEEDS = [0, 1, 2]


def np_local_crf(p, rgb, prm, valid=None):
    """p (L, h, w) probabilities, rgb (3, h, w) in 0..255, on the grid the CRF runs on (scale 1)."""
    L, h, w = p.shape
    r = int(prm["window"]) // 2
    ok = np.ones(L, bool) if valid is None else np.asarray(valid)
    log_p = np.where(ok[:, None, None], np.log(np.maximum(p, 1e-5)), -np.inf)

    def softmax(e):
        e = e - e.max(0, keepdims=True)
        x = np.exp(e)
        return x / x.sum(0, keepdims=True)

    def k(y, x, yy, xx):
        pos2 = float((y - yy) ** 2 + (x - xx) ** 2)
        col2 = float(((rgb[:, y, x] - rgb[:, yy, xx]) ** 2).sum())
        return (prm["gaussian_compat"] * np.exp(-pos2 / (2 * prm["gaussian_sxy"] ** 2))
                + prm["bilateral_compat"] * np.exp(-pos2 / (2 * prm["bilateral_sxy"] ** 2)
                                                   - col2 / (2 * prm["bilateral_srgb"] ** 2)))

    q = softmax(log_p)
    for _ in range(int(prm["iterations"])):
        msg = np.zeros_like(q)
        for y in range(h):
            for x in range(w):
                for yy in range(max(0, y - r), min(h, y + r + 1)):
                    for xx in range(max(0, x - r), min(w, x + r + 1)):
                        if (yy, xx) != (y, x):
                            msg[:, y, x] += k(y, x, yy, xx) * q[:, yy, xx]
        q = softmax(log_p + msg)
    return q


def random_inputs(rng, B=2, L=3, h=6, w=7):
    logits = rng.normal(size=(B, L, h, w)) * 2
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    rgb = rng.integers(0, 256, size=(B, h, w, 3)).astype(np.uint8)
    return p, rgb


def small_params(rng, **kw):
    prm = dict(LOCAL_CRF_DEFAULTS, iterations=int(rng.integers(1, 5)), gaussian_sxy=float(rng.uniform(1, 3)),
               gaussian_compat=float(rng.uniform(0.5, 3)), bilateral_sxy=float(rng.uniform(2, 10)),
               bilateral_srgb=float(rng.uniform(10, 60)), bilateral_compat=float(rng.uniform(0.5, 5)), scale=1)
    prm.update(kw)
    return prm


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("window", [3, 5, 15])
def test_matches_numpy_reference(seed, window):
    rng = np.random.default_rng(seed)
    p, rgb = random_inputs(rng)
    prm = small_params(rng, window=window)
    got = local_crf(torch.from_numpy(p).float(), torch.from_numpy(rgb), prm)
    for b in range(p.shape[0]):
        ref = np_local_crf(p[b], rgb[b].transpose(2, 0, 1).astype(np.float64), prm)
        np.testing.assert_allclose(got[b].numpy(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_invalid_labels_equal_running_on_the_valid_ones(seed):
    rng = np.random.default_rng(seed + 10)
    p, rgb = random_inputs(rng, B=2, L=4)
    valid = np.array([[True, False, True, True], [True, True, False, False]])
    p = np.where(valid[:, :, None, None], p, 0)
    p = p / p.sum(1, keepdims=True)
    prm = small_params(rng, window=5)
    got = local_crf(torch.from_numpy(p).float(), torch.from_numpy(rgb), prm, valid=torch.from_numpy(valid))
    for b in range(2):
        assert bool((got[b][~torch.from_numpy(valid[b])] == 0).all())
        alone = local_crf(torch.from_numpy(p[b][valid[b]][None]).float(), torch.from_numpy(rgb[b][None]), prm)
        torch.testing.assert_close(got[b][torch.from_numpy(valid[b])], alone[0], atol=1e-6, rtol=0)
        ref = np_local_crf(p[b], rgb[b].transpose(2, 0, 1).astype(np.float64), prm, valid[b])
        np.testing.assert_allclose(got[b].numpy(), ref, atol=1e-5, rtol=0)


def test_vanishing_pairwise_weights_give_the_clipped_input():
    rng = np.random.default_rng(3)
    p, rgb = random_inputs(rng)
    prm = {"iterations": 3, "gaussian_compat": 1e-12, "bilateral_compat": 1e-12, "scale": 1}
    got = local_crf(torch.from_numpy(p).float(), torch.from_numpy(rgb), prm)
    clipped = np.maximum(p, 1e-5)
    np.testing.assert_allclose(got.numpy(), clipped / clipped.sum(1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_scale_runs_on_the_pooled_grid_and_upsamples(seed):
    rng = np.random.default_rng(seed + 20)
    p, rgb = random_inputs(rng, h=12, w=16)
    prm = small_params(rng, window=3, scale=4)
    got = local_crf(torch.from_numpy(p).float(), torch.from_numpy(rgb), prm)
    assert got.shape == p.shape
    pooled = F.avg_pool2d(torch.from_numpy(p).float(), 4, ceil_mode=True).double().numpy()
    rgb_pooled = F.avg_pool2d(torch.from_numpy(rgb).permute(0, 3, 1, 2).float(), 4, ceil_mode=True).double().numpy()
    for b in range(p.shape[0]):
        ref = np_local_crf(pooled[b], rgb_pooled[b], dict(prm, gaussian_sxy=prm["gaussian_sxy"] / 4,
                                                          bilateral_sxy=prm["bilateral_sxy"] / 4))
        up = F.interpolate(torch.from_numpy(ref)[None], size=p.shape[-2:], mode="bilinear", align_corners=False)[0]
        np.testing.assert_allclose(got[b].numpy(), up.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_equals_one_by_one_and_image_layouts_agree(seed):
    rng = np.random.default_rng(seed + 30)
    p, rgb = random_inputs(rng, B=3, h=9, w=10)
    prm = small_params(rng, window=5, scale=2)
    pt, it = torch.from_numpy(p).float(), torch.from_numpy(rgb)
    got = local_crf(pt, it, prm)
    for b in range(3):
        torch.testing.assert_close(local_crf(pt[b : b + 1], it[b : b + 1], prm), got[b : b + 1], atol=1e-6, rtol=0)
    chw_float = it.permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(local_crf(pt, chw_float, prm), got, atol=1e-6, rtol=0)


def test_smooths_a_noisy_label_along_colour_edges():
    # Left half dark, right half bright; the probabilities favour the correct side only weakly
    # and are flipped on a few pixels: the CRF restores the colour-consistent labelling.
    g = torch.Generator().manual_seed(0)
    h, w = 16, 16
    truth = torch.zeros(h, w, dtype=torch.long)
    truth[:, w // 2 :] = 1
    rgb = torch.where(truth[..., None].bool(), torch.tensor([220, 220, 220]), torch.tensor([30, 30, 30])).to(torch.uint8)
    p1 = torch.where(truth.bool(), 0.6, 0.4)
    flip = torch.rand(h, w, generator=g) < 0.2
    p1 = torch.where(flip, 1 - p1, p1)
    p = torch.stack([1 - p1, p1])[None]
    q = local_crf(p, rgb[None], {"scale": 1, "window": 5, "bilateral_sxy": 10})
    assert bool((p.argmax(1)[0] != truth).any())
    assert torch.equal(q.argmax(1)[0], truth)


def test_bad_inputs_and_parameters():
    p = torch.full((1, 2, 4, 4), 0.5)
    rgb = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="probs"):
        local_crf(p[0], rgb)
    with pytest.raises(ValueError, match="image"):
        local_crf(p, rgb[:, :3])
    with pytest.raises(ValueError, match="image"):
        local_crf(p, torch.full((1, 4, 4, 3), 2.0))
    with pytest.raises(ValueError, match="window"):
        local_crf(p, rgb, {"window": 4})
    with pytest.raises(ValueError, match="scale"):
        local_crf(p, rgb, {"scale": 1.5})
    with pytest.raises(ValueError, match="unknown key"):
        local_crf(p, rgb, {"windows": 3})
    with pytest.raises(ValueError, match="valid"):
        local_crf(p, rgb, valid=torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid"):
        local_crf(p, rgb, valid=torch.ones(1, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------- in the teacher
@pytest.mark.parametrize("seed", SEEDS)
def test_teacher_local_crf_uses_only_the_image_classes(seed):
    rng = np.random.default_rng(seed + 40)
    B, C, h, w = 3, 5, 10, 12
    logits = torch.from_numpy(rng.normal(size=(B, C + 1, h, w)) * 2).float()
    probs = logits.softmax(1)
    rgb = torch.from_numpy(rng.integers(0, 256, size=(B, h, w, 3)).astype(np.uint8))
    classes = [[2], [1, 4, 5], [3, 5]]
    allowed = torch.zeros(B, C + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for b, ids in enumerate(classes):
        allowed[b, ids] = True
    prm = {"window": 5, "scale": 2}
    got = teacher_labels(probs, allowed, refine="local_crf", image=rgb, crf_params=prm)
    for b in range(B):
        idx = torch.nonzero(allowed[b]).flatten()
        p = probs[b, idx] / probs[b, idx].sum(0, keepdim=True)
        q = local_crf(p[None], rgb[b : b + 1], prm)[0]
        assert torch.equal(got[b], idx[q.argmax(0)])
        assert bool(allowed[b][got[b]].all())


def test_complement_labels_with_local_crf():
    rng = np.random.default_rng(5)
    B, C, h, w = 2, 4, 8, 8
    probs = torch.from_numpy(rng.normal(size=(B, C + 1, h, w))).float().softmax(1)
    y = torch.from_numpy(rng.integers(0, C + 1, size=(B, h, w)))
    y[:, :3] = -1
    rgb = torch.from_numpy(rng.integers(0, 256, size=(B, h, w, 3)).astype(np.uint8))
    classes = [[1, 2], [3]]
    y_co, cert = complement_labels(y, probs, classes, refine="local_crf", image=rgb, crf_params={"scale": 1})
    assert bool((y_co[y != -1] == y[y != -1]).all()) and not bool((y_co == -1).any())
    plain, cert0 = complement_labels(y, probs, classes)
    assert torch.equal(cert, cert0)
    with pytest.raises(ValueError, match="local_crf"):
        complement_labels(y, probs, classes, refine="local_crf")
    with pytest.raises(ValueError, match="refine"):
        complement_labels(y, probs, classes, refine="dense")
