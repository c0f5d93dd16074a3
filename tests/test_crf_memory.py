"""The dense CRF's memory is bounded by construction (issue 22, class 3).

* Peak RSS growth, measured in a fresh process (the peak counter reset right before the call,
  /proc/self/clear_refs), is at most twice pydensecrf's on the same image, and at most
  ``crf_memory_bytes`` (what ``max_bytes`` is compared with).
* An image whose CRF needs more than ``max_bytes`` (default 6 GiB: a 4000x3000 image with 21
  labels) is refused before any lattice is built, with the number of pixels that fit; an image
  whose colours make a denser lattice than assumed is refused before its blur tables are made;
  the images of a batch are grouped within the budget, with the same result.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import mars_plugin.engines.crf_lattices as crf_lattices
import mars_plugin.engines.crf_mean_field as crf_mean_field
from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_memory import check_crf_image, crf_memory_bytes
from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MEASURE = r"""
import json, sys
import numpy as np, torch
sys.path.insert(0, {bench!r})
from bench_crf import natural_image, smooth_probs
from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_memory import crf_memory_bytes
torch.set_num_threads(1)
backend = sys.argv[1]
H, W = 600, 800
img = natural_image(H, W, 0)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

out = {{}}
for L in (2, 21):
    p = torch.from_numpy(smooth_probs(L, H, W, 0))
    dense_crf(p[:, :8, :8].contiguous(), img[:8, :8].copy(), backend=backend)
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
    before = status("VmRSS")
    q = dense_crf(p, img, backend=backend)
    out[L] = (status("VmHWM") - before, crf_memory_bytes(H, W, L))
    del q, p
print(json.dumps(out))
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _measure(backend):
    code = _MEASURE.format(bench=os.path.join(ROOT, "benchmarks"))
    r = subprocess.run([sys.executable, "-c", code, backend], capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_peak_memory_is_within_twice_pydensecrf_and_within_the_model():
    ours = _measure("torch")
    ref = _measure("pydensecrf") if importlib.util.find_spec("pydensecrf") else None
    for L, (grow, model) in ours.items():
        N = 600 * 800
        assert grow <= model, (L, grow / N, model / N)  # what max_bytes is compared with bounds it
        if ref is not None:
            assert grow <= 2 * ref[L][0], (L, grow / N, ref[L][0] / N)


def test_default_budget_runs_4000x3000_with_two_labels_and_refuses_21_with_the_size_that_fits():
    check_crf_image(None, 3000, 4000, 2)  # about 4.5 GiB: runs (measured 3.5 GB, docs/crf.md)
    assert crf_memory_bytes(3000, 4000, 2) < DEFAULT_MAX_BYTES == 6 << 30
    with pytest.raises(ValueError) as e:
        check_crf_image(None, 3000, 4000, 21)
    msg = str(e.value)
    assert msg.startswith("the dense CRF of a 3000x4000 image with 21 labels needs about ") and "more than " \
        "max_bytes = 6.00 GiB" in msg, msg
    fit = int(re.search(r"at most ([0-9,]+) pixels fit", msg).group(1).replace(",", ""))
    h, w = map(int, re.search(r"\(e\.g\. (\d+)x(\d+)\)", msg).groups())
    check_crf_image(None, h, w, 21)  # the size it names fits
    assert h * w <= fit < 3000 * 4000 and crf_memory_bytes(h, w, 21) <= DEFAULT_MAX_BYTES


def _inputs(H, W, L=2, noise=False, seed=0):
    rng = np.random.default_rng(seed)
    if noise:
        img = rng.integers(0, 256, (H, W, 3)).astype(np.uint8)
    else:  # four flat colour blocks: a sparse lattice, as photographs give
        yy, xx = np.mgrid[0:H, 0:W]
        block = (yy >= H // 2) * 2 + (xx >= W // 2)
        img = rng.integers(0, 256, (4, 3))[block].astype(np.uint8)
    return torch.from_numpy(rng.random((L, H, W)).astype(np.float32)), img


def test_an_image_over_max_bytes_is_refused_before_any_lattice(monkeypatch):
    built = []
    real = crf_lattices.PermutohedralLattice
    monkeypatch.setattr(crf_lattices, "PermutohedralLattice", lambda *a, **k: built.append(1) or real(*a, **k))
    probs, img = _inputs(300, 400)
    budget = 20 << 20
    with pytest.raises(ValueError) as e:
        dense_crf(probs, img, max_bytes=budget)
    assert built == []
    msg = str(e.value)
    assert "300x400 image with 2 labels needs about" in msg and "max_bytes = 0.02 GiB" in msg, msg
    with pytest.raises(ValueError, match="needs about"):  # refused on its size alone: no value was read
        dense_crf(torch.full((2, 300, 400), float("nan")), img, max_bytes=budget)
    h, w = map(int, re.search(r"\(e\.g\. (\d+)x(\d+)\)", msg).groups())
    probs, img = _inputs(h, w)
    q = dense_crf(probs, img, max_bytes=budget)  # the size it names runs within the same budget
    assert q.shape == (2, h, w)
    assert torch.equal(q, dense_crf(probs, img, max_bytes=None))


def test_a_denser_lattice_than_assumed_is_refused_before_its_tables(monkeypatch):
    # noise makes about 6 bilateral points per pixel (a photograph about 0.8): the budget check
    # before any work lets it in, the lattice refuses itself once its size is known.
    probs, img = _inputs(200, 240, noise=True)
    budget = crf_memory_bytes(200, 240, 2) + (1 << 20)
    with pytest.raises(ValueError) as e:
        dense_crf(probs, img, max_bytes=budget)
    msg = str(e.value)
    assert re.search(r"its colours make a bilateral lattice of [0-9,]+ points \(5\.\d\d per pixel", msg), msg
    assert "at most" in msg and "pixels fit" in msg
    q = dense_crf(probs, img, max_bytes=None)
    assert bool(torch.isfinite(q).all())


def test_a_batch_is_grouped_within_the_budget_with_the_same_result(monkeypatch):
    shapes = [(40, 50), (30, 70), (45, 45), (20, 90), (50, 40)]
    probs, imgs = zip(*[_inputs(h, w, 3, seed=i) for i, (h, w) in enumerate(shapes)])
    together = dense_crf(list(probs), list(imgs), chunk_pixels=10 ** 6, max_bytes=None)
    calls = []
    real = crf_mean_field._mean_field_chunk
    monkeypatch.setattr(crf_mean_field, "_mean_field_chunk", lambda s, *a: calls.append(len(s)) or real(s, *a))
    budget = crf_memory_bytes(50, 90, 3)  # room for about two of these images at a time
    grouped = dense_crf(list(probs), list(imgs), chunk_pixels=10 ** 6, max_bytes=budget)
    assert len(calls) >= 2 and max(calls) >= 2 and sum(calls) == len(shapes), calls
    for a, b in zip(grouped, together):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # images denser than assumed in a group: run one at a time, same result
    noisy = [_inputs(h, w, 3, noise=True, seed=i) for i, (h, w) in enumerate(shapes[:3])]
    calls.clear()
    budget = crf_memory_bytes(40, 50, 3) * 2 + crf_memory_bytes(30, 70, 3)
    out = dense_crf([p for p, _ in noisy], [i for _, i in noisy], chunk_pixels=10 ** 6, max_bytes=budget)
    ref = dense_crf([p for p, _ in noisy], [i for _, i in noisy], max_bytes=None)
    assert 1 in calls
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "6GB", True])
def test_bad_max_bytes(bad):
    probs, img = _inputs(4, 5)
    with pytest.raises(ValueError, match="max_bytes must be a positive number of bytes or None"):
        dense_crf(probs, img, max_bytes=bad)


def test_local_crf_window_is_bounded_by_the_budget():
    from mars_plugin.engines.local_crf import local_crf

    probs, img = _inputs(64, 80, 3)
    p = probs[None].softmax(1)
    budget = 64 << 20
    with pytest.raises(ValueError) as e:
        local_crf(p, img[None], {"window": 1001, "scale": 1}, max_bytes=budget)
    msg = str(e.value)
    assert msg.startswith("crf_params['window'] = 1001 needs about ") and "max_bytes = 0.06 GiB" in msg, msg
    fit = int(re.search(r"at most window = (\d+) fits", msg).group(1))
    assert fit % 2 == 1 and fit >= 3
    q = local_crf(p, img[None], {"window": fit, "scale": 1, "iterations": 1}, max_bytes=budget)  # it runs
    assert q.shape == p.shape and bool(torch.isfinite(q).all())
    with pytest.raises(ValueError, match=f"window'\\] = {fit + 2} needs"):
        local_crf(p, img[None], {"window": fit + 2, "scale": 1}, max_bytes=budget)
