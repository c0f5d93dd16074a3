"""select_centroids gives the same bits whatever the thread counts and the numba cache's history.

The compiled backend (the CPU default) solves each (image, class) group sequentially in one
thread, in source order (no fastmath reassociation): thread counts, float16 vs float32 input
and whether the kernel was compiled now or loaded from numba's cache must not change a bit.
The float16 test of test_kmeans_compiled once failed only after ``mars demo`` had filled the
cache with the float16 kernel: the cached code summed in another order than a fresh build.

The torch backend is bit-identical across batches, but not across torch thread counts on the
CPU: ATen splits a single problem's matrix-vector products (batch of one, e.g. the last live
problem of a bucket) across threads, which changes float32 rounding; its tolerance is stated.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import numba  # noqa: E402

from mars_plugin import select_centroids  # noqa: E402

from mars_plugin.engines import kmeans_compiled
from mars_plugin.engines.kmeans import seeding_trials  # noqa: E402

from test_kmeans_compiled import _blobs  # noqa: E402
from test_select_centroids import assert_same_result  # noqa: E402


def _data():
    # Groups of ~1200 points (Lloyd takes many steps, the incremental update runs) and small ones.
    return _blobs(4, n_images=6, d=8, grid=60)


def _with_torch_threads(n, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_select_bit_identical_across_thread_counts(dtype):
    pairs = [(f.to(dtype), y) for f, y in _data()]
    run = lambda: select_centroids(pairs, num_classes=2, batch_size=4, backend="compiled")  # noqa: E731
    one, two = _with_torch_threads(1, run), _with_torch_threads(2, run)
    assert_same_result(one, two, atol=0)


def test_compiled_kernel_bit_identical_across_numba_thread_counts():
    rng = np.random.default_rng(0)
    imgs = [rng.normal(size=(8, 900)).astype(np.float32) for _ in range(3)]
    sizes = np.array([900, 500, 400, 900, 7, 893])
    image = np.array([0, 1, 1, 2, 0, 0])
    order = np.concatenate([rng.permutation(900)[:n] for n in sizes])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ks = np.array([2, 3, 2, 5, 2, 4])
    kmax, tmax = int(ks.max()), seeding_trials(int(ks.max()))
    u = rng.random((len(sizes), kmax, tmax))
    trials = np.array([seeding_trials(int(k)) for k in ks])
    kw = dict(image=image, normalize=True, max_iter=100, tol=1e-4)
    outs = [kmeans_compiled.kmeans_groups(imgs, order, starts, sizes, ks, u, trials, num_threads=n, **kw)
            for n in sorted({1, 2, numba.config.NUMBA_NUM_THREADS})]
    for out in outs[1:]:
        for a, b in zip(out, outs[0]):
            assert np.array_equal(a, b)


def test_torch_select_across_thread_counts_within_float32_rounding():
    pairs = _data()
    run = lambda: select_centroids(pairs, num_classes=2, batch_size=4, backend="torch")  # noqa: E731
    one, two = _with_torch_threads(1, run), _with_torch_threads(2, run)
    # Same selection, centroids within float32 rounding of the matrix products (see above).
    assert_same_result(one, two, atol=1e-5)


COLD_WARM_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from mars_plugin import select_centroids
    from test_kmeans_compiled import _pairs
    pairs = [(f.half(), y) for f, y in _pairs(60, n=8)]
    out = {}
    for dtype in sys.argv[2].split(","):
        p = pairs if dtype == "16" else [(f.float(), y) for f, y in pairs]
        r = select_centroids(p, num_classes=6, batch_size=3, backend="compiled")
        out[dtype] = [r.centroids.numpy().tobytes().hex(), r.cut_distance.numpy().tobytes().hex()]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_cold_and_warm_numba_cache_give_the_same_bits(tmp_path):
    # The reproduction of the flaky float16 test: a first process compiles (and caches) the
    # float16 call only; a second one loads it from the cache and also runs float32.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"))
    tests_dir = os.path.dirname(os.path.abspath(__file__))

    def run(which):
        proc = subprocess.run([sys.executable, "-c", COLD_WARM_SCRIPT, tests_dir, which], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = run("16")
    assert any((tmp_path / "numba_cache").rglob("*.nbi")), "the first process cached nothing"
    warm = run("16,32")
    assert cold["16"] == warm["16"] == warm["32"]
