"""The dense CRF's compiled CPU path (mars_plugin.engines.crf_compiled) against the point-at-a-time
reference lattice, the torch path and pydensecrf; its results do not depend on the thread count
(whole images per thread, or one image's labels and pixels split); without numba (or with
MARS_NO_NUMBA=1) the torch path runs and still matches pydensecrf."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import mars_plugin.engines.crf_lattices as crf_lattices  # noqa: E402
import mars_plugin.engines.crf_mean_field as crf_mean_field  # noqa: E402
from mars_plugin.engines import crf_compiled  # noqa: E402
from mars_plugin.engines.crf import dense_crf, dense_crf_from_unary, unary_from_labels  # noqa: E402
from mars_plugin.engines.crf_params import CRF_PRESETS  # noqa: E402
from mars_plugin.engines.crf_compiled import CompiledLattice  # noqa: E402
from mars_plugin.engines.permutohedral import LatticeTooLarge, PermutohedralLattice  # noqa: E402

from test_crf import dcrf, make_image, make_probs, needs_reference, reference_probs  # noqa: E402
from test_permutohedral import grid_features, reference_filter  # noqa: E402


@pytest.fixture()
def threads():
    """Set torch's thread count for one test (the compiled path's thread count), then restore."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def normalised_reference(features: np.ndarray, values: np.ndarray) -> np.ndarray:
    """n K(n x) with n = 1 / sqrt(K 1 + 1e-20) (pydensecrf's NORMALIZE_SYMMETRIC), K the
    point-at-a-time reference filter."""
    k1 = reference_filter(features, np.ones((features.shape[0], 1), np.float32))
    n = (1.0 / np.sqrt(k1.astype(np.float64) + 1e-20)).astype(np.float32)
    return n * reference_filter(features, n * values)


def _bilateral(kind, H, W, seed, sxy=67.0, srgb=3.0):
    img = make_image(kind, H, W, seed).astype(np.float32)
    return np.concatenate([grid_features(H, W, sxy), img.reshape(-1, 3) / np.float32(srgb)], 1).astype(np.float32)


rng = np.random.default_rng(7)
FEATURES = {  # the kinds of positions a lattice meets, point counts with and without padding
    "random d=1": rng.normal(size=(9, 1)).astype(np.float32) * 2,
    "random d=2": rng.normal(size=(41, 2)).astype(np.float32) * 3,
    "random d=3": rng.normal(size=(30, 3)).astype(np.float32),
    "random d=5": rng.normal(size=(64, 5)).astype(np.float32) * 4,
    "pixel grid sxy=1 (boundary points)": grid_features(9, 11, 1.0),
    "pixel grid sxy=3": grid_features(12, 7, 3.0),
    "bilateral, edges": _bilateral("edges", 13, 17, 0),
    "bilateral, noise": _bilateral("random", 10, 9, 1),
    "one point": np.array([[0.3, -1.2]], np.float32),
    "constant": np.full((10, 3), 2.5, np.float32),
    "huge coordinates": np.array([[1e5, -3e5], [1e5 + 1, -3e5], [2e5, 1e5]], np.float32),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_compiled_lattice_matches_the_reference_and_the_torch_lattice(name):
    f = FEATURES[name]
    x = np.random.default_rng(0).random((f.shape[0], 3)).astype(np.float32)
    got = CompiledLattice(f, [f.shape[0]]).filter(x)
    np.testing.assert_allclose(got, normalised_reference(f, x), rtol=1e-5, atol=1e-6)
    lat = PermutohedralLattice(torch.from_numpy(f))
    norm = crf_lattices._normaliser(lat, f.shape[0], torch.device("cpu"))
    torch_filtered = lat.scale_(norm, norm).filter(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, torch_filtered, rtol=1e-6, atol=1e-7)
    assert CompiledLattice(f, [f.shape[0]]).num_lattice_points == lat.num_lattice_points


@pytest.mark.parametrize("name", ["random d=5", "pixel grid sxy=1 (boundary points)", "bilateral, noise",
                                  "huge coordinates"])
def test_the_row_keys_fallback_builds_the_same_lattice(name, monkeypatch):
    f = FEATURES[name]
    packed = CompiledLattice(f, [f.shape[0]])
    monkeypatch.setattr(crf_compiled, "_MAX_CODE", 0)  # no packed code fits: keys compared as rows
    rows = CompiledLattice(f, [f.shape[0]])
    for a in ("vert", "n1", "n2", "sw", "lw"):
        np.testing.assert_array_equal(getattr(rows, a), getattr(packed, a))


def test_images_in_one_compiled_lattice_filter_as_alone():
    a, b, c = _bilateral("edges", 9, 6, 0), _bilateral("smooth", 5, 11, 1), _bilateral("random", 3, 3, 2)
    x = np.random.default_rng(1).random((a.shape[0] + b.shape[0] + c.shape[0], 2)).astype(np.float32)
    together = CompiledLattice(np.concatenate([a, b, c]), [54, 55, 9]).filter(x)
    alone = np.concatenate([CompiledLattice(a, [54]).filter(x[:54]), CompiledLattice(b, [55]).filter(x[54:109]),
                            CompiledLattice(c, [9]).filter(x[109:])])
    np.testing.assert_allclose(together, alone, rtol=1e-6, atol=1e-7)


def test_a_lattice_over_max_points_is_refused_before_its_tables():
    f = FEATURES["bilateral, noise"]
    M = CompiledLattice(f, [90]).num_lattice_points
    with pytest.raises(LatticeTooLarge) as e:
        CompiledLattice(f, [90], max_points=M - 1)
    assert (e.value.points, e.value.limit, e.value.num_points) == (M, M - 1, 90)
    assert CompiledLattice(f, [90], max_points=M).num_lattice_points == M


def _torch_path(monkeypatch, fn):
    monkeypatch.setenv("MARS_NO_NUMBA", "1")
    try:
        assert not crf_compiled.available()
        return fn()
    finally:
        monkeypatch.delenv("MARS_NO_NUMBA")


def _probs_images(shapes, L, seed=0, kind="edges"):
    return ([torch.from_numpy(make_probs(L, H, W, seed + i)) for i, (H, W) in enumerate(shapes)],
            [make_image(kind, H, W, seed + i) for i, (H, W) in enumerate(shapes)])


CALLS = {  # every input form the CRF takes, through the compiled and the torch path
    "one image, mars, 2 labels": lambda: dense_crf(*[v[0] for v in _probs_images([(23, 37)], 2)], "mars"),
    "one image, psa, 21 labels": lambda: dense_crf(*[v[0] for v in _probs_images([(19, 26)], 21)], "psa"),
    "one label": lambda: dense_crf(*[v[0] for v in _probs_images([(8, 9)], 1)]),
    "batch": lambda: dense_crf(*[torch.stack(v) if i == 0 else np.stack(v)
                                 for i, v in enumerate(_probs_images([(12, 14)] * 3, 3))]),
    "list of sizes": lambda: dense_crf(*_probs_images([(5, 7), (16, 12), (1, 1), (9, 4)], 4)),
    "valid labels": lambda: dense_crf(*_probs_images([(11, 13), (10, 10)], 5), valid=torch.tensor(
        [[True, False, True, True, False], [True, True, False, False, False]])),
    "label unary": lambda: dense_crf_from_unary(unary_from_labels(torch.from_numpy(
        np.random.default_rng(2).integers(0, 5, (17, 15))), 4, 0.7), make_image("smooth", 17, 15, 0), {
        "iterations": 10, "gaussian_sxy": 3, "gaussian_compat": 3, "bilateral_sxy": 50, "bilateral_srgb": 5,
        "bilateral_compat": 10}),
    "float image": lambda: dense_crf(torch.from_numpy(make_probs(3, 10, 8, 3)),
                                     torch.from_numpy(make_image("random", 10, 8, 3)).float() / 255),
    "noise image": lambda: dense_crf(*[v[0] for v in _probs_images([(24, 20)], 3, kind="random")]),
    "tiny images": lambda: dense_crf(*_probs_images([(1, 9), (7, 1), (3, 5)], 3)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_compiled_path_equals_the_torch_path(name, monkeypatch):
    compiled = CALLS[name]()
    torch_path = _torch_path(monkeypatch, CALLS[name])
    for a, b in zip(compiled if isinstance(compiled, list) else [compiled],
                    torch_path if isinstance(torch_path, list) else [torch_path]):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if name == "valid labels":  # forbidden labels: exactly 0
        assert float(compiled[0][[1, 4]].abs().max()) == 0.0 and float(compiled[1][2:].abs().max()) == 0.0


@needs_reference
@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("preset, L", [("mars", 2), ("psa", 21)])
def test_both_paths_match_pydensecrf(path, preset, L, monkeypatch):
    probs, img = make_probs(L, 33, 41, L), make_image("smooth", 33, 41, L)

    def run():
        return dense_crf(torch.from_numpy(probs), img, preset).numpy()

    q = run() if path == "compiled" else _torch_path(monkeypatch, run)
    assert float(np.abs(q - reference_probs(probs, img, CRF_PRESETS[preset])).max()) <= 1e-4


@pytest.mark.parametrize("n_threads", [2, 3, 5])
@pytest.mark.parametrize("shapes, L", [([(40, 30)], 2),  # one image: labels and pixels split
                                       ([(40, 30)], 7),
                                       ([(20, 25), (31, 18), (9, 40)], 3),  # whole images, one left over
                                       ([(16, 16)] * 6, 21)])
def test_results_do_not_depend_on_the_thread_count(shapes, L, n_threads, threads):
    probs, imgs = _probs_images(shapes, L, seed=5)
    threads(1)
    one = dense_crf(probs, imgs, chunk_pixels=700)  # several lattices even for small images
    threads(n_threads)
    many = dense_crf(probs, imgs, chunk_pixels=700)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def test_batch_images_run_in_parallel_threads(threads, monkeypatch):
    import threading

    seen = []
    both_in = threading.Barrier(2, timeout=30)  # the first two lattices wait for each other
    real = crf_compiled._solve_whole

    def record(*args):
        seen.append(threading.get_ident())
        if len(seen) <= 2:
            both_in.wait()  # breaks (BrokenBarrierError) unless two threads run at once
        return real(*args)

    monkeypatch.setattr(crf_compiled, "_solve_whole", record)
    threads(2)
    probs, imgs = _probs_images([(30, 30)] * 4, 2)
    dense_crf(probs, imgs, chunk_pixels=900)
    assert len(seen) == 4 and len(set(seen[:2])) == 2  # four lattices, two threads at once


def test_a_failure_in_a_thread_is_raised_by_the_call(threads, monkeypatch):
    threads(2)
    real = crf_compiled.CompiledLattice.__init__

    def fail_bilateral(self, features, sizes, max_points=None):
        if features.shape[1] == 5:  # the bilateral lattices, built in the worker threads
            raise RuntimeError("simulated failure while building a lattice")
        real(self, features, sizes, max_points)

    monkeypatch.setattr(crf_compiled.CompiledLattice, "__init__", fail_bilateral)
    probs, imgs = _probs_images([(10, 10)] * 4, 2)
    with pytest.raises(RuntimeError, match="simulated failure"):
        dense_crf(probs, imgs, chunk_pixels=100)


def test_the_compiled_path_is_used_on_the_cpu_only_when_available(monkeypatch):
    probs, img = _probs_images([(6, 7)], 2)
    used = []
    real = crf_mean_field._mean_field_compiled
    monkeypatch.setattr(crf_mean_field, "_mean_field_compiled", lambda *a: used.append(1) or real(*a))
    dense_crf(probs[0], img[0])
    assert used == [1]
    _torch_path(monkeypatch, lambda: dense_crf(probs[0], img[0]))
    assert used == [1]


@pytest.mark.skipif(dcrf is None or not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_runs_the_torch_path(monkeypatch):  # pragma: no cover - GPU machines only
    probs, img = _probs_images([(6, 7)], 2)
    monkeypatch.setattr(crf_mean_field, "_mean_field_compiled", lambda *a: pytest.fail("compiled path on CUDA"))
    dense_crf(probs[0].cuda(), torch.from_numpy(img[0]).cuda())
