"""The Triton kernels of the lattice filter (mars_plugin/engines/permutohedral_triton.py) against
the torch filter, bit for bit, on the CPU through Triton's interpreter (no GPU needed).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function (triton 3.x:
``knobs.runtime.interpret`` in ``triton.jit``) and while an interpreted kernel runs. Triton's own
jit'd helpers (``tl.zeros``, ``tl.max``, ...) are decorated when triton is imported, so they are
interpreted only if the variable was set before that; the kernels call none of them (``tl.full``,
``tl.reduce`` with their own combine function). So the fixture below sets the variable and
reloads the kernel module, which works wherever this file runs in the suite, whoever imported
triton first (``pytest.importorskip`` below does, without the variable), and no subprocess is
needed. Every comparison is of the float32 bit patterns (``view(torch.int32)``: -0.0 and 0.0
differ), since the kernels do the torch CPU path's multiplications and additions in its order.
"""
from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import mars_plugin.engines.crf_lattices as crf_lattices  # noqa: E402
import mars_plugin.engines.permutohedral as perm  # noqa: E402
from mars_plugin.engines.crf import dense_crf  # noqa: E402
from mars_plugin.engines.permutohedral import PermutohedralLattice  # noqa: E402

from test_crf import make_image, make_probs  # noqa: E402


@pytest.fixture(scope="module")
def pt():
    """The kernel module, its kernels interpreted (on CPU tensors). The variable stays set while
    this file's tests run (the interpreter consults it when a kernel runs, too)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import mars_plugin.engines.permutohedral_triton as mod
        mod = importlib.reload(mod)  # decorated again, under the interpreter
        assert mod.interpreted()
        yield mod
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
        # Decorated again as the environment says, so that later tests on a GPU get compiled kernels.
        importlib.reload(mod)


@pytest.fixture
def forced(monkeypatch):
    """USE_TRITON = True/False for one test."""
    def set_(on):
        monkeypatch.setattr(perm, "USE_TRITON", on)
    return set_


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    diff = bits(a) != bits(b)
    assert not bool(diff.any()), f"{int(diff.sum())} of {diff.numel()} values differ, max |a - b| = " \
                                 f"{float((a - b).abs().max()):.3g}"


def stored_order_product(sp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The plain reference of a CSR product: each row's products summed in stored order, one
    float32 rounding per multiply and per add (no fused multiply-add), rows without entries 0."""
    crow, col, val = sp.crow_indices().tolist(), sp.col_indices().numpy(), sp.values().numpy()
    xs = x.numpy()
    out = np.zeros((len(crow) - 1, xs.shape[1]), np.float32)
    for r in range(len(crow) - 1):
        for k in range(crow[r], crow[r + 1]):
            out[r] = out[r] + val[k] * xs[col[k]]  # float32 * float32 row, then float32 add
    return torch.from_numpy(out)


@functools.lru_cache(maxsize=None)
def torch_sums_in_stored_order() -> bool:
    """Whether this machine's torch CPU CSR product is the stored-order sum, bit for bit. It is
    where torch runs its own kernel; with MKL's sparse routines on AVX-512 (seen on a Xeon with
    torch 2.13's wheel) it sums in another order, a few ulp apart. The kernels follow the stored
    order (the tests below hold them to :func:`stored_order_product`); they equal the torch filter
    bit for bit only where torch does too, and within float32 reordering elsewhere."""
    lat = PermutohedralLattice(_features(97, 5, 5), simd_padding=True)
    x = _values(97, 21, 21)
    return torch.equal(lat._splat @ x, stored_order_product(lat._splat, x))


def assert_equals_the_torch_path(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
    """Bit for bit where torch's CPU product sums in stored order (:func:`torch_sums_in_stored_order`);
    elsewhere equal up to the reordering of float32 sums."""
    if torch_sums_in_stored_order():
        assert_same_bits(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


def _features(N: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N, d, generator=g) * 3


def _values(N: int, L: int, seed: int) -> torch.Tensor:
    return torch.randn(N, L, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ one kernel at a time
@pytest.mark.parametrize("L", [1, 2, 4, 21, 40])
def test_blur_axis_is_the_torch_blur_bit_for_bit(pt, L):
    """(v[n1] + v[n2]) * 0.5 + v on 131 rows (past one block of 128), 40 labels crossing the
    32-label tile, neighbours missing (M) here and there, row M zero."""
    M = 130
    g = torch.Generator().manual_seed(L)
    v = torch.randn(M + 1, L, generator=g)
    v[M] = 0
    n1 = torch.randint(0, M + 1, (M + 1,), generator=g, dtype=torch.int32)
    n2 = torch.randint(0, M + 1, (M + 1,), generator=g, dtype=torch.int32)
    n1[::7] = M
    n1[M] = n2[M] = M
    want = torch.index_select(v, 0, n1).add_(torch.index_select(v, 0, n2)).mul_(0.5).add_(v)
    got = pt.blur_axis(v, n1, n2, torch.empty_like(v))
    assert_same_bits(got, want)
    assert not bool(got[M].any())


@pytest.mark.parametrize("d", [1, 2, 5])
@pytest.mark.parametrize("L", [1, 4, 21])
def test_splat_is_the_csr_product_bit_for_bit(pt, d, L):
    """Each lattice point's CSR row summed in stored order; the empty row M gives 0."""
    lat = PermutohedralLattice(_features(97, d, d), simd_padding=True)
    x = _values(97, L, L)
    sp = lat._splat
    got = pt.splat(sp.crow_indices(), sp.col_indices(), sp.values(), x)
    assert_same_bits(got, stored_order_product(sp, x))
    assert_equals_the_torch_path(got, sp @ x)
    assert got.shape == (lat.num_lattice_points + 1, L) and not bool(got[-1].any())


@pytest.mark.parametrize("d", [1, 5])
@pytest.mark.parametrize("scale", [1.0, 3.0, -0.5])
def test_slice_adds_scale_times_the_product_as_addmm(pt, d, scale):
    """add_to += scale * (S v), vertices r = 0..d in order; and without add_to, scale * (S v)."""
    lat = PermutohedralLattice(_features(133, d, 7))
    L = 5
    v = _values(lat.num_lattice_points + 1, L, 3)
    base = _values(133, L, 4)
    sl = lat._slice
    vertex, w = sl.col_indices().view(133, d + 1), sl.values().view(133, d + 1)
    product = stored_order_product(sl, v)
    got = pt.slice_into(vertex, w, v, base.clone(), accumulate=True, scale=scale)
    assert_same_bits(got, base + (product if scale == 1.0 else product * scale))
    assert_equals_the_torch_path(got, base.clone().addmm_(sl, v, alpha=scale))
    got = pt.slice_into(vertex, w, v, torch.empty(133, L), accumulate=False, scale=scale)
    assert_same_bits(got, product if scale == 1.0 else product * scale)
    want = sl @ v
    assert_equals_the_torch_path(got, want if scale == 1.0 else want.mul_(scale))


def test_slice_writes_into_a_strided_add_to(pt):
    """add_to may be a column block of a wider array (the mean field's label blocks)."""
    lat = PermutohedralLattice(_features(50, 2, 1))
    v = _values(lat.num_lattice_points + 1, 3, 2)
    wide = _values(50, 7, 3)
    want = wide.clone()
    want[:, 2:5].addmm_(lat._slice, v, alpha=2.0)
    got = wide.clone()
    sl = lat._slice
    pt.slice_into(sl.col_indices().view(50, 3), sl.values().view(50, 3), v, got[:, 2:5], accumulate=True, scale=2.0)
    plain = wide.clone()
    plain[:, 2:5] += stored_order_product(sl, v) * 2.0
    assert_same_bits(got, plain)
    assert_equals_the_torch_path(got, want)


# ------------------------------------------------------------------ the whole filter
@pytest.mark.parametrize("d,N", [(1, 301), (2, 151), (5, 61)])
@pytest.mark.parametrize("L", [1, 2, 4, 21])
def test_filter_equals_the_torch_filter(pt, forced, d, N, L):
    """filter(v), filter(v, add_to, scale) through USE_TRITON = True equal the torch path's bits,
    three images as segments (their counts not multiples of 4: padding points)."""
    f = _features(N, d, 10 * d + L)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor([N // 3, N // 3, N - 2 * (N // 3)]))
    lat = PermutohedralLattice(f, seg)
    v, base = _values(N, L, 1), _values(N, L, 2)
    forced(False)
    want, want_add = lat.filter(v), lat.filter(v, add_to=base.clone(), scale=-3.0)
    forced(True)
    got, got_add = lat.filter(v), lat.filter(v, add_to=base.clone(), scale=-3.0)
    assert_equals_the_torch_path(got, want)
    assert_equals_the_torch_path(got_add, want_add)


def test_filter_on_a_dense_crf_lattice(pt, forced):
    """The dense CRF's own normalised lattices (position d=2, bilateral d=5) of three images of
    different sizes, 4 labels: the Triton filter equals the torch filter bit for bit."""
    shapes = ((9, 12), (7, 10), (5, 9))
    rgbs = [torch.from_numpy(make_image("edges", H, W, i)) for i, (H, W) in enumerate(shapes)]
    sizes = [H * W for H, W in shapes]
    N = sum(sizes)
    forced(False)  # the normalisers computed by the torch path for both
    pos = crf_lattices._lattice(crf_lattices._features(shapes, 3.0, None, 1.0, torch.device("cpu")),
                                crf_lattices._segments(sizes, torch.device("cpu")))
    bil = crf_lattices._lattice(crf_lattices._features(shapes, 10.0, rgbs, 13.0, torch.device("cpu")),
                                crf_lattices._segments(sizes, torch.device("cpu")))
    q = torch.softmax(_values(N, 4, 5), 1)
    for lat, compat in ((pos, 3.0), (bil, 10.0)):
        forced(False)
        want = lat.filter(q, add_to=q.clone(), scale=compat)
        forced(True)
        assert_equals_the_torch_path(lat.filter(q, add_to=q.clone(), scale=compat), want)


@pytest.mark.slow
def test_dense_crf_with_the_triton_filter_equals_the_torch_one(pt, forced, monkeypatch):
    """crf.dense_crf (torch mean field, 10 iterations) on two small images of different sizes:
    the same marginals, bit for bit, with the Triton filter forced."""
    monkeypatch.setenv("MARS_NO_NUMBA", "1")  # the torch mean field on the CPU, not numba's
    shapes = ((10, 14), (8, 12))
    probs = [torch.from_numpy(make_probs(3, H, W, i)) for i, (H, W) in enumerate(shapes)]
    images = [make_image("edges", H, W, i) for i, (H, W) in enumerate(shapes)]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return filter_(*args, **kwargs)

    filter_ = pt.triton_filter
    monkeypatch.setattr(pt, "triton_filter", counted)
    out = {}
    for on in (False, True):
        crf_lattices.clear_lattice_cache()  # the kept position lattice is built (normalised) by each path
        forced(on)
        out[on] = dense_crf(probs, images, "mars")
    for a, b in zip(out[True], out[False]):
        assert_equals_the_torch_path(a, b)
    # two kernels' messages per iteration; the normalisers: each image size's kept position lattice
    # (joined for the batch) and the bilateral lattice once
    assert len(calls) == 2 * 10 + len(shapes) + 1
    assert not torch.equal(out[True][0], probs[0])  # the CRF did something


# ------------------------------------------------------------------ the switch
class _LooksCuda(torch.Tensor):
    """CPU values that say they are on CUDA: the default switch's choice without a GPU."""

    @property
    def is_cuda(self):
        return True


def test_the_default_switch_takes_triton_on_cuda_only_and_obeys_mars_no_triton(pt, monkeypatch):
    calls = []

    def record(lattice, values, *, add_to=None, scale=1.0):
        calls.append(values.shape)
        return "triton"

    monkeypatch.setattr(pt, "triton_filter", record)
    monkeypatch.setattr(perm, "USE_TRITON", None)
    monkeypatch.delenv("MARS_TRITON", raising=False)
    lat = PermutohedralLattice(_features(20, 2, 0))
    v = _values(20, 2, 0)
    assert isinstance(lat.filter(v), torch.Tensor) and calls == []  # the CPU: torch
    # opt-in on CUDA (untested compiled until a GPU runs gpu.sh's triton section)
    assert isinstance(lat.filter(v.as_subclass(_LooksCuda)), torch.Tensor) and calls == []
    for off in ("", "0"):
        monkeypatch.setenv("MARS_TRITON", off)
        assert isinstance(lat.filter(v.as_subclass(_LooksCuda)), torch.Tensor) and calls == []
    monkeypatch.setenv("MARS_TRITON", "1")
    assert isinstance(lat.filter(v), torch.Tensor) and calls == []  # the CPU still: torch
    assert lat.filter(v.as_subclass(_LooksCuda)) == "triton"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert isinstance(lat.filter(v.as_subclass(_LooksCuda)), torch.Tensor)  # triton not installed: torch
    monkeypatch.undo()
    monkeypatch.setattr(pt, "triton_filter", record)
    monkeypatch.setattr(perm, "USE_TRITON", False)
    assert isinstance(lat.filter(v.as_subclass(_LooksCuda)), torch.Tensor)
    monkeypatch.setattr(perm, "USE_TRITON", True)
    assert lat.filter(v) == "triton"
    assert len(calls) == 2


def test_compiled_kernels_refuse_cpu_tensors_by_name(pt, monkeypatch):
    """Outside the interpreter, CPU values get a clear error naming the switch, not a crash."""
    monkeypatch.setattr(pt, "interpreted", lambda: False)
    lat = PermutohedralLattice(_features(20, 2, 0))
    with pytest.raises(ValueError, match="USE_TRITON = False"):
        pt.triton_filter(lat, _values(20, 2, 0))


class _Broken:
    """A kernel whose compile or launch fails (no C compiler for Triton's launcher, an old GPU)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise OSError("cc not found")
        return launch


def test_a_forced_kernel_that_fails_names_the_way_back_to_torch(pt, forced, monkeypatch):
    """USE_TRITON = True: the failure is an error that says how to turn the kernels off; add_to
    is left as it was."""
    monkeypatch.setattr(pt, "_blur_kernel", _Broken())
    forced(True)
    lat = PermutohedralLattice(_features(20, 2, 0))
    base = _values(20, 2, 1)
    add_to = base.clone()
    with pytest.raises(RuntimeError, match="failed on cpu .OSError: cc not found.; set mars_plugin.engines.permutohedral.USE_TRITON = False"):
        lat.filter(_values(20, 2, 0), add_to=add_to)
    assert torch.equal(add_to, base)


def test_the_default_choice_falls_back_to_torch_once_with_a_warning(pt, forced, monkeypatch):
    """USE_TRITON = None (Triton chosen by MARS_TRITON=1 where it is installed): a
    failing kernel warns once, and this call and the later ones run the torch filter."""
    monkeypatch.setattr(pt, "_blur_kernel", _Broken())
    forced(None)
    lat = PermutohedralLattice(_features(20, 2, 0))
    v, base = _values(20, 2, 0), _values(20, 2, 1)
    with pytest.warns(UserWarning, match="cc not found.; the torch filter runs instead in this process"):
        got = pt.triton_filter(lat, v, add_to=base.clone(), scale=2.0)
    assert perm.USE_TRITON is False
    forced(False)
    assert_same_bits(got, lat.filter(v, add_to=base.clone(), scale=2.0))


def test_without_triton_the_kernel_module_says_which_extra(monkeypatch):
    """USE_TRITON = True without triton installed: an ImportError naming the 'gpu' extra."""
    monkeypatch.setitem(sys.modules, "triton", None)  # what an absent package looks like to import
    path = os.path.join(os.path.dirname(perm.__file__), "permutohedral_triton.py")
    spec = importlib.util.spec_from_file_location("_permutohedral_triton_without_triton", path)
    with pytest.raises(ImportError, match=r"needs triton: pip install 'mars-plugin\[gpu\]'"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_add_to_of_another_shape_is_refused(pt):
    lat = PermutohedralLattice(_features(20, 2, 0))
    with pytest.raises(ValueError, match=r"add_to must be \(20, 2\) float32"):
        pt.triton_filter(lat, _values(20, 2, 0), add_to=torch.zeros(20, 3))


def test_every_launch_keeps_multiplications_and_additions_apart(pt, monkeypatch):
    """The interpreter rounds every operation on its own whatever the flag; on a GPU an FMA would
    round once where torch rounds twice: every kernel is launched with enable_fp_fusion=False."""
    seen = []

    class Launcher:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs.get("enable_fp_fusion"))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_splat_kernel", "_blur_kernel", "_slice_kernel"):
        monkeypatch.setattr(pt, name, Launcher(getattr(pt, name)))
    lat = PermutohedralLattice(_features(30, 2, 0))
    pt.triton_filter(lat, _values(30, 2, 0), add_to=_values(30, 2, 1), scale=2.0)
    assert seen == [False] * (1 + 3 + 1)


def _moved_to_cuda(lat: PermutohedralLattice) -> PermutohedralLattice:
    """The same lattice (indices, weights) on the GPU: the kernels compared, not two builds."""
    out = copy.copy(lat)
    out._splat, out._slice = lat._splat.to("cuda"), lat._slice.to("cuda")
    out._blur = [(a.cuda(), b.cuda()) for a, b in lat._blur]
    out.device = torch.device("cuda")
    return out


# Last in the file: it reloads the kernel module compiled (the interpreted tests above are done).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_compiled_on_cuda_gives_the_torch_cpu_filters_bits(monkeypatch):
    """On a GPU the compiled kernels (FMA contraction off) give the torch CPU filter's bits, on
    the dense CRF's normalised lattices of two images, 1 to 81 labels, with add_to and scale."""
    import mars_plugin.engines.permutohedral_triton as mod
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mod = importlib.reload(mod)
    assert not mod.interpreted()
    monkeypatch.setattr(perm, "USE_TRITON", None)  # the default with MARS_TRITON=1: Triton on CUDA
    monkeypatch.setenv("MARS_TRITON", "1")
    shapes = ((48, 64), (40, 56))
    rgbs = [torch.from_numpy(make_image("edges", H, W, i)) for i, (H, W) in enumerate(shapes)]
    sizes = [H * W for H, W in shapes]
    cpu = torch.device("cpu")
    seg = crf_lattices._segments(sizes, cpu)
    for feats in (crf_lattices._features(shapes, 3.0, None, 1.0, cpu),
                  crf_lattices._features(shapes, 80.0, rgbs, 13.0, cpu)):
        lat = crf_lattices._lattice(feats, seg)
        on_gpu = _moved_to_cuda(lat)
        for L in (1, 4, 21, 81):
            q, base = torch.softmax(_values(sum(sizes), L, L), 1), _values(sum(sizes), L, L + 1)
            want = lat.filter(q, add_to=base.clone(), scale=10.0)
            got = on_gpu.filter(q.cuda(), add_to=base.cuda(), scale=10.0)
            assert_same_bits(got.cpu(), want)
            assert_same_bits(on_gpu.filter(q.cuda()).cpu(), lat.filter(q))
