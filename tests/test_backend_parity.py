"""The compiled and torch K-means backends accept and refuse the same inputs.

One table of inputs, run through image_centroids and select_centroids with backend="torch"
and backend="compiled": the outcome must be the same, i.e. both raise the same exception type
with the same message, or both return the same centroids (to float32 rounding, as documented
in :mod:`mars_plugin.engines.kmeans_compiled`). The one documented difference, ``n_init > 1``
(the compiled kernel runs one seeding per problem), is checked to raise a clear error.

Memory follows the pixels, never K: K = 10**7 on a 16-pixel image allocates no table of K
rows, and each class gets one centroid per distinct pixel (the documented rule).
"""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from mars_plugin import ImageCentroids, batched_kmeans, image_centroids, select_centroids  # noqa: E402

from test_select_centroids import assert_same_result  # noqa: E402

G = torch.Generator().manual_seed(0)
F = torch.randn(3, 4, 4, generator=G)
Y = torch.tensor([[0, 0, 1, 1], [0, 2, 1, 1], [0, 2, 2, 1], [0, 0, 2, 255]])
FIRST = torch.arange(16).view(4, 4) == 0

CASES = {
    # features
    "requires_grad": lambda b: image_centroids(F.clone().requires_grad_(), Y, backend=b),
    "requires_grad_select": lambda b: select_centroids([(F.clone().requires_grad_(), Y)], 2, backend=b),
    "float64": lambda b: image_centroids(F.double(), Y, backend=b),
    "float16": lambda b: image_centroids(F.half(), Y, backend=b),
    "bfloat16": lambda b: image_centroids(F.bfloat16(), Y, backend=b),
    "integer_features": lambda b: image_centroids((F * 10).long(), Y, backend=b),
    "numpy_features": lambda b: image_centroids(F.numpy(), Y.numpy(), backend=b),
    "non_contiguous": lambda b: image_centroids(F.transpose(1, 2), Y.T, backend=b),
    "nan_features": lambda b: image_centroids(F.masked_fill(F > 1.5, float("nan")), Y, backend=b),
    "inf_in_ignored_pixel": lambda b: select_centroids([(F.masked_fill(FIRST, float("inf")), Y.masked_fill(FIRST, 255))],
                                                       2, backend=b),
    "zero_channels": lambda b: image_centroids(torch.zeros(0, 4, 4), Y, backend=b),
    "zero_channels_select": lambda b: select_centroids([(torch.zeros(0, 4, 4), Y)], 2, backend=b),
    "huge_values": lambda b: image_centroids(F * 1e30, Y, backend=b),
    "zero_features": lambda b: image_centroids(torch.zeros(3, 4, 4), Y, backend=b),
    # empty images
    "no_pixels": lambda b: image_centroids(torch.zeros(3, 0, 0), torch.zeros(0, 0, dtype=torch.long), backend=b),
    "no_pixels_in_batch": lambda b: select_centroids([(torch.zeros(3, 0, 0), torch.zeros(0, 0, dtype=torch.long)),
                                                      (F, Y)], 2, backend=b),
    "all_ignored": lambda b: image_centroids(F, torch.full((4, 4), 255), backend=b),
    "all_ignored_in_batch": lambda b: select_centroids([(F, torch.full((4, 4), 255)), (F, Y)], 2, backend=b),
    "only_ignored_stream": lambda b: select_centroids([(F, torch.full((4, 4), 255))], 2, backend=b),
    # class ids
    "huge_class_id": lambda b: image_centroids(F, Y.masked_fill(Y == 2, 10**9), backend=b),
    "huge_class_id_select": lambda b: select_centroids([(F, Y.masked_fill(Y == 2, 10**9))], 2, backend=b),
    "class_beyond_num_classes": lambda b: select_centroids([(F, Y)], 1, backend=b),
    "negative_class": lambda b: image_centroids(F, Y - 1, backend=b),
    "ignore_index_minus_1": lambda b: image_centroids(F, Y.masked_fill(Y == 255, -1), ignore_index=-1, backend=b),
    "ignore_index_0": lambda b: image_centroids(F, Y, ignore_index=0, backend=b),
    # label dtypes
    "int32_labels": lambda b: image_centroids(F, Y.int(), backend=b),
    "uint8_labels": lambda b: image_centroids(F, Y.to(torch.uint8), backend=b),
    "int16_labels": lambda b: image_centroids(F, Y.short(), backend=b),
    "float_labels": lambda b: image_centroids(F, Y.float(), backend=b),
    "fractional_labels": lambda b: image_centroids(F, Y.float() + 0.5, backend=b),
    "bool_labels": lambda b: image_centroids(F, Y > 0, backend=b),
    "numpy_uint8_labels": lambda b: select_centroids([(F.numpy(), Y.numpy().astype(np.uint8))], 2, backend=b),
    "labels_twice_the_grid": lambda b: image_centroids(F, Y.repeat_interleave(2, 0).repeat_interleave(2, 1), backend=b),
    # K
    "k_one": lambda b: image_centroids(F, Y, k_fg=1, k_bg=1, backend=b),
    "k_beyond_pixels": lambda b: image_centroids(F, Y, k_fg=10**7, k_bg=10**7, backend=b),
    "k_beyond_pixels_select": lambda b: select_centroids([(F, Y)], 2, k_fg=10**7, backend=b),
    "k_zero": lambda b: image_centroids(F, Y, k_fg=0, backend=b),
    "duplicate_pixels": lambda b: image_centroids(torch.ones(3, 4, 4), Y, k_fg=3, backend=b),
}


def _outcome(fn, backend):
    try:
        return "ok", fn(backend)
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return type(e).__name__, str(e)


def _assert_same_centroids(a, b):
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_centroids(x, y)
    elif isinstance(a, ImageCentroids):
        assert sorted(a.fg) == sorted(b.fg)
        for c in a.fg:
            np.testing.assert_allclose(a.fg[c].double().numpy(), b.fg[c].double().numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(a.bg.double().numpy(), b.bg.double().numpy(), atol=1e-5, rtol=0)
    else:
        assert_same_result(a, b, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_same_outcome(case):
    kind_t, got_t = _outcome(CASES[case], "torch")
    kind_c, got_c = _outcome(CASES[case], "compiled")
    assert kind_t == kind_c, (got_t, got_c)
    if kind_t == "ok":
        _assert_same_centroids(got_c, got_t)
    else:
        assert got_t == got_c


def test_n_init_is_the_documented_difference():
    assert isinstance(image_centroids(F, Y, n_init=2, backend="torch"), ImageCentroids)
    with pytest.raises(ValueError, match=r"backend='compiled' runs one seeding per problem, got n_init=2"):
        image_centroids(F, Y, n_init=2, backend="compiled")


@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_k_beyond_pixels_gives_each_distinct_pixel(backend):
    # The documented rule: a class with fewer distinct pixels than K gets one centroid per
    # distinct pixel. Reference: the distinct normalised pixels of each class.
    f = F.clone()
    f[:, 3, 1] = f[:, 3, 0]  # two identical background pixels
    got = image_centroids(f, Y, k_fg=10**7, k_bg=10**7, backend=backend)
    unit = f / f.norm(dim=0, keepdim=True)
    for c, cents in [(0, got.bg)] + sorted(got.fg.items()):
        ref = torch.unique(unit[:, Y == c].T, dim=0)
        mine = cents[torch.from_numpy(np.lexsort(cents.T.numpy()[::-1]).copy())]
        ref = ref[torch.from_numpy(np.lexsort(ref.T.numpy()[::-1]).copy())]
        np.testing.assert_allclose(mine.numpy(), ref.numpy(), atol=1e-6, rtol=0)


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, tracemalloc
    import torch
    from mars_plugin import batched_kmeans, image_centroids, select_centroids
    torch.manual_seed(0)
    f, y = torch.randn(8, 4, 4), torch.randint(0, 3, (4, 4))
    for b in ("torch", "compiled"):  # compile and warm up with a small K first
        image_centroids(f, y, backend=b)
        select_centroids([(f, y)], 2, backend=b)
    batched_kmeans(torch.randn(1, 16, 8), None, 2, n_init=2)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    for b in ("torch", "compiled"):
        image_centroids(f, y, k_fg=10**7, k_bg=10**7, backend=b)
        select_centroids([(f, y)], 2, k_fg=10**7, k_bg=10**7, backend=b)
        image_centroids(f, y, k_fg=10**7, n_init=2, backend="torch")
    batched_kmeans(torch.randn(2, 16, 8), None, 10**7, n_init=2)
    peak = tracemalloc.get_traced_memory()[1]
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"tracemalloc_peak": peak, "maxrss_growth_kb": rss1 - rss0}))
""")


@pytest.mark.slow
def test_k_of_ten_million_on_sixteen_pixels_allocates_little():
    # In a fresh process: the peak resident size may only grow by what K-means of 16 pixels
    # needs (a (10**7, 18) float64 draw table alone would be 1.4 GB), and the Python/numpy
    # allocations traced stay under a few MB. Allocation sizes, not time, are asserted.
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["tracemalloc_peak"] < 4 * 2**20, m
    assert m["maxrss_growth_kb"] < 64 * 2**10, m


def test_batched_kmeans_pads_to_the_points_not_k():
    x = torch.randn(3, 16, 4, dtype=torch.float64)
    res = batched_kmeans(x, None, 10**7)
    assert res.centroids.shape == (3, 16, 4) and bool(res.valid.all())
    ref = batched_kmeans(x, None, 16)
    # Every point is its own centroid either way (16 distinct points); the rows come in the
    # order of each K's own k-means++ draws, so compare them sorted.
    for b in range(3):
        s = lambda t: t[torch.from_numpy(np.lexsort(t.T.numpy()[::-1]).copy())]  # noqa: E731
        assert torch.equal(s(res.centroids[b]), s(ref.centroids[b]))
