"""Tests for the weighted cross-entropy of MARS Eq. 7 (weighted_cross_entropy / WCELoss)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin import WCELoss, weighted_cross_entropy

SEEDS = [0, 1, 2, 3]
IGNORE = 255
TOL = 1e-5


def np_log_softmax(z, axis=1):
    m = z.max(axis, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis, keepdims=True))


def np_wce(logits, target, weight, ignore=IGNORE, reduction="mean"):
    """Eq. 7 by hand: per pixel -W * log softmax(logits)[target], 0 at ignored pixels."""
    B, C1, H, W = logits.shape
    logp = np_log_softmax(logits.astype(np.float64), 1)
    per = np.zeros((B, H, W))
    count = 0
    for b in range(B):
        for y in range(H):
            for x in range(W):
                t = int(target[b, y, x])
                if t == ignore:
                    continue
                count += 1
                w = 1.0 if weight is None else float(weight[b, y, x])
                per[b, y, x] = -w * logp[b, t, y, x]
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / max(count, 1)


def np_wce_grad(logits, target, weight, ignore=IGNORE, reduction="mean"):
    """d loss / d logits = (softmax - onehot(target)) * W / N at non-ignored pixels, 0 elsewhere."""
    p = np.exp(np_log_softmax(logits.astype(np.float64), 1))
    C1 = logits.shape[1]
    valid = target != ignore
    onehot = np.zeros_like(p)
    for c in range(C1):
        onehot[:, c] = (target == c)
    w = np.ones(target.shape) if weight is None else weight.astype(np.float64)
    scale = w * valid
    if reduction == "mean":
        scale = scale / max(int(valid.sum()), 1)
    return (p - onehot) * scale[:, None]


def random_problem(seed, B=2, C1=5, H=6, W=7, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((B, C1, H, W))
    target = rng.integers(0, C1, size=(B, H, W)).astype(np.int64)
    target[rng.random((B, H, W)) < 0.25] = IGNORE
    weight = rng.random((B, H, W))
    return (torch.tensor(logits, dtype=dtype, requires_grad=True), torch.from_numpy(target),
            torch.tensor(weight, dtype=dtype), logits, target, weight)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_matches_numpy(seed, reduction, dtype):
    lt, tt, wt, l, t, w = random_problem(seed, dtype=dtype)
    ref = np_wce(l.astype(np.float32) if dtype == torch.float32 else l, t, w, reduction=reduction)
    got = weighted_cross_entropy(lt, tt, wt, reduction=reduction)
    module = WCELoss(reduction=reduction)(lt, tt, wt)
    if reduction == "none":
        assert got.shape == t.shape
        assert (got.detach().numpy()[t == IGNORE] == 0).all()
    else:
        assert got.ndim == 0
    rtol = 0 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(got.detach().numpy(), ref, atol=TOL, rtol=rtol)
    np.testing.assert_allclose(module.detach().numpy(), got.detach().numpy(), atol=0, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_matches_analytic(seed, reduction):
    lt, tt, wt, l, t, w = random_problem(seed)
    loss = weighted_cross_entropy(lt, tt, wt, reduction=reduction)
    loss.backward()
    ref = np_wce_grad(l, t, w, reduction=reduction)
    np.testing.assert_allclose(lt.grad.numpy(), ref, atol=TOL, rtol=0)
    assert (lt.grad.numpy().transpose(0, 2, 3, 1)[t == IGNORE] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_gradient_of_none_reduction(seed):
    lt, tt, wt, l, t, w = random_problem(seed)
    rng = np.random.default_rng(seed + 10)
    g = rng.standard_normal(t.shape)
    weighted_cross_entropy(lt, tt, wt, reduction="none").backward(torch.from_numpy(g))
    ref = np_wce_grad(l, t, w * g, reduction="sum")
    np.testing.assert_allclose(lt.grad.numpy(), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_weight_none_equals_cross_entropy(seed):
    lt, tt, _, l, t, _ = random_problem(seed)
    for reduction in ("mean", "sum", "none"):
        got = weighted_cross_entropy(lt, tt, None, reduction=reduction)
        ref = F.cross_entropy(lt, tt, ignore_index=IGNORE, reduction=reduction)
        np.testing.assert_allclose(got.detach().numpy(), ref.detach().numpy(), atol=TOL, rtol=0)
        np.testing.assert_allclose(got.detach().numpy(), np_wce(l, t, None, reduction=reduction), atol=TOL, rtol=0)
    ones = weighted_cross_entropy(lt, tt, torch.ones(t.shape, dtype=lt.dtype))
    np.testing.assert_allclose(ones.item(), weighted_cross_entropy(lt, tt).item(), atol=TOL, rtol=0)
    (g1,) = torch.autograd.grad(weighted_cross_entropy(lt, tt), lt)
    (g2,) = torch.autograd.grad(F.cross_entropy(lt, tt, ignore_index=IGNORE), lt)
    np.testing.assert_allclose(g1.numpy(), g2.numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_weight_is_not_differentiated(seed):
    lt, tt, wt, l, t, w = random_problem(seed)
    wt = wt.clone().requires_grad_(True)
    loss = weighted_cross_entropy(lt, tt, wt)
    loss.backward()
    assert wt.grad is None or bool((wt.grad == 0).all())
    np.testing.assert_allclose(lt.grad.numpy(), np_wce_grad(l, t, w), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_custom_ignore_index(seed):
    lt, tt, wt, l, t, w = random_problem(seed)
    t2 = np.where(t == IGNORE, 7, t)  # 7 >= C+1 channels: valid only as the ignore index
    got = weighted_cross_entropy(lt, torch.from_numpy(t2), wt, ignore_index=7)
    np.testing.assert_allclose(got.item(), np_wce(l, t2, w, ignore=7), atol=TOL, rtol=0)
    assert WCELoss(ignore_index=7)(lt, torch.from_numpy(t2), wt).item() == got.item()


def test_all_pixels_ignored_gives_zero_and_backward_works():
    lt, tt, wt, _, _, _ = random_problem(0)
    target = torch.full_like(tt, IGNORE)
    for reduction in ("mean", "sum"):
        lt.grad = None
        loss = weighted_cross_entropy(lt, target, wt, reduction=reduction)
        assert loss.item() == 0.0 and bool(torch.isfinite(loss))
        loss.backward()
        assert lt.grad is not None and bool((lt.grad == 0).all())
    none = weighted_cross_entropy(lt, target, wt, reduction="none")
    assert bool((none == 0).all())


def test_target_with_biased_pixels_rejected():
    lt, tt, wt, _, _, _ = random_problem(0)
    t = tt.clone()
    t[0, 1, 1] = -1
    with pytest.raises(ValueError, match=r"complement_labels"):
        weighted_cross_entropy(lt, t, wt)
    with pytest.raises(ValueError, match=r"-1"):
        WCELoss()(lt, t, wt)


@pytest.mark.parametrize("bad", [5, 6, 254, -2])
def test_target_class_out_of_range_rejected(bad):
    lt, tt, wt, _, _, _ = random_problem(0, C1=5)
    t = tt.clone()
    t[1, 2, 3] = bad
    with pytest.raises(ValueError, match="target"):
        weighted_cross_entropy(lt, t, wt)


def test_target_type_and_shape_rejected():
    lt, tt, wt, _, _, _ = random_problem(0)
    with pytest.raises(TypeError, match="target"):
        weighted_cross_entropy(lt, tt.double(), wt)
    with pytest.raises(TypeError, match="target"):
        weighted_cross_entropy(lt, tt.numpy(), wt)
    with pytest.raises(ValueError, match="target"):
        weighted_cross_entropy(lt, tt[:, :-1], wt)
    with pytest.raises(ValueError, match="target"):
        weighted_cross_entropy(lt, tt[0], wt)


def test_logits_rejected():
    lt, tt, wt, _, _, _ = random_problem(0)
    with pytest.raises(TypeError, match="logits"):
        weighted_cross_entropy(lt.detach().long(), tt, wt)
    with pytest.raises(ValueError, match="logits"):
        weighted_cross_entropy(lt[0], tt, wt)


@pytest.mark.parametrize("kind", ["shape", "negative", "nan", "inf", "not_tensor"])
def test_bad_weight_rejected(kind):
    lt, tt, wt, _, _, _ = random_problem(0)
    w = wt.clone()
    exc = ValueError
    if kind == "shape":
        w = w[:, :, :-1]
    elif kind == "negative":
        w[0, 0, 0] = -0.5
    elif kind == "nan":
        w[1, 2, 2] = float("nan")
    elif kind == "inf":
        w[1, 2, 2] = float("inf")
    else:
        w, exc = w.numpy(), TypeError
    with pytest.raises(exc, match="weight"):
        weighted_cross_entropy(lt, tt, w)
    with pytest.raises(exc, match="weight"):
        WCELoss()(lt, tt, w)


def test_bad_reduction_rejected():
    lt, tt, wt, _, _, _ = random_problem(0)
    with pytest.raises(ValueError, match="reduction"):
        weighted_cross_entropy(lt, tt, wt, reduction="avg")
    with pytest.raises(ValueError, match="reduction"):
        WCELoss(reduction="batchmean")


def test_module_repr():
    assert "ignore_index=7" in repr(WCELoss(ignore_index=7, reduction="sum"))
    assert "'sum'" in repr(WCELoss(ignore_index=7, reduction="sum"))
