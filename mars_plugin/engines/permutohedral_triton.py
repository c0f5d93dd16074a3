"""The permutohedral lattice's filter (splat, blur, slice) as Triton kernels: the GPU path of
:meth:`mars_plugin.engines.permutohedral.PermutohedralLattice.filter` (the ``gpu`` extra).

The torch path runs the filter as a CSR product, then per blur axis two ``index_select``s, an
add, a multiplication and an add (five kernels and five passes over the (M+1, L) values), then a
second CSR product and its addition; on a GPU the dense CRF's mean field is made of these. Here
each step is one kernel that reads its inputs once and writes its output once: the whole filter
is d+3 launches and two (M+1, L) buffers (and the (N, L) output where there is no ``add_to``).

The same float operations in the same order as the torch path on the CPU, so the results are the
same bits (``tests/test_permutohedral_triton.py`` checks it under ``TRITON_INTERPRET=1``):

* splat: row m of the CSR (M+1) x N matrix, its entries in stored order, ``acc = acc + w * x``
  from 0 (what torch's CPU CSR product does: not a fused multiply-add);
* blur along each axis: ``(v[n1] + v[n2]) * 0.5 + v``;
* slice: the d+1 vertices of each point in order r = 0..d, ``acc = acc + w * x``, then
  ``add_to + scale * acc`` (``addmm_``'s ``beta = 1, alpha = scale``) or ``scale * acc``.

The kernels are compiled with ``enable_fp_fusion=False`` so that the compiler keeps every
multiplication and addition apart (an FMA rounds once where torch rounds twice; the blur's
multiplication by 0.5 is exact, so there it would not matter). The filter is bound by memory
traffic, where an FMA saves little. torch's CUDA CSR products (cuSPARSE) may sum in another
order, so on a GPU the Triton filter equals the torch CPU filter's bits rather than the torch
CUDA one's (within float32 rounding of it).

Layout: rows, (M+1, L) values with the L labels of a lattice point contiguous, as the filter's
(N, L) input and output already are (the torch path transposes twice per filter on CUDA). Each
program takes a tile of BLOCK_M points x BLOCK_L labels, the labels the fast axis of the tile:
a gathered row is one contiguous run of L floats, and the rows gathered by neighbouring points
are nearly contiguous too (lattice points are numbered by their sorted key codes, and an axis
neighbour is a constant shift of the code, so n1 and n2 increase with the point index, with
gaps where a neighbour is missing). So the gathers are coalesced for small L (2-4 labels: a
tile of 128 points reads a few contiguous spans, where the transposed layout would read L
scattered spans per tile) and for large L (21, 81: each row is one to three 128-byte lines).
The torch path's transposed layout was a workaround for torch's row ``index_select`` kernel,
slow on rows of a few floats, not for the memory layout. Labels beyond BLOCK_L (at most 32)
go to a second grid axis, so L = 81 wastes 15 of 96 lanes instead of 47 of 128.

Indices are int32 or int64 as the lattice stored them; addresses are computed in int64 (M * L
may pass 2^31 on a large batch).

On the CPU these kernels run only under Triton's interpreter: ``TRITON_INTERPRET=1`` in the
environment before this module is imported (Triton reads it when ``@triton.jit`` decorates a
kernel, i.e. at this module's import) and while they run.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # only reached with USE_TRITON = True: the default asks find_spec first
    raise ImportError("the Triton lattice filter needs triton: pip install 'mars-plugin[gpu]' (the 'gpu' extra), "
                      "or leave mars_plugin.engines.permutohedral.USE_TRITON at None / False") from e

if TYPE_CHECKING:  # pragma: no cover
    from mars_plugin.engines.permutohedral import PermutohedralLattice

__all__ = ["triton_filter", "splat", "blur_axis", "slice_into", "interpreted"]

# Points per program: 128 rows x up to 32 labels is 4,096 floats (16 KB) per gathered tile.
BLOCK_M = 128
# Lattice points per program of the splat. Its rows are of very different lengths (the bilateral
# lattice of two 512x512 natural images, preset mars: 7.3 entries on average, 86 at the 99th
# percentile, 780 at most) and a program runs as many steps as its longest row: summed over the
# programs that is 10.3x the entries at 128 rows per program, 3.6x at 16 (measured on that
# lattice), for 8x the programs.
SPLAT_BLOCK_M = 16
# Labels per program along the second grid axis (a warp's 32 lanes on one row at L >= 32).
MAX_BLOCK_L = 32
# Every multiplication and addition rounded on its own, as torch's CPU kernels round them.
_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _larger(a, b):
    # tl.max's combine function, ours: triton's own (triton.language.standard) is decorated when
    # triton is imported, so it is interpreted only if TRITON_INTERPRET was set before that;
    # these kernels call no jit function of triton's, and so run interpreted whenever this
    # module was imported with TRITON_INTERPRET=1 (the tests reload it so).
    return tl.maximum(a, b)


@triton.jit
def _splat_kernel(crow_ptr, col_ptr, val_ptr, x_ptr, out_ptr, rows, L,
                  BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """out[m, :] = sum over the entries k of CSR row m, in stored order, of val[k] * x[col[k], :]."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    lab = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    in_m = m < rows
    in_l = lab < L
    start = tl.load(crow_ptr + m, mask=in_m, other=0).to(tl.int64)
    end = tl.load(crow_ptr + m + 1, mask=in_m, other=0).to(tl.int64)
    count = end - start
    acc = tl.full((BLOCK_M, BLOCK_L), 0.0, tl.float32)
    # A segment sum: the rows of a block run for as many steps as its longest row, each row
    # masked once it is done (rows hold (d+1) N / M entries on average).
    for k in range(0, tl.reduce(count, 0, _larger)):
        live = in_m & (k < count)
        col = tl.load(col_ptr + start + k, mask=live, other=0).to(tl.int64)
        w = tl.load(val_ptr + start + k, mask=live, other=0.0)
        x = tl.load(x_ptr + col[:, None] * L + lab[None, :], mask=live[:, None] & in_l[None, :], other=0.0)
        acc = acc + w[:, None] * x
    tl.store(out_ptr + m.to(tl.int64)[:, None] * L + lab[None, :], acc, mask=in_m[:, None] & in_l[None, :])


@triton.jit
def _blur_kernel(v_ptr, n1_ptr, n2_ptr, out_ptr, rows, L,
                 BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """out[m, :] = (v[n1[m], :] + v[n2[m], :]) * 0.5 + v[m, :] (row M, the missing neighbour,
    has n1 = n2 = M and stays 0)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    lab = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    in_m = m < rows
    mask = in_m[:, None] & (lab < L)[None, :]
    a = tl.load(n1_ptr + m, mask=in_m, other=0).to(tl.int64)
    b = tl.load(n2_ptr + m, mask=in_m, other=0).to(tl.int64)
    va = tl.load(v_ptr + a[:, None] * L + lab[None, :], mask=mask, other=0.0)
    vb = tl.load(v_ptr + b[:, None] * L + lab[None, :], mask=mask, other=0.0)
    here = m.to(tl.int64)[:, None] * L + lab[None, :]
    v = tl.load(v_ptr + here, mask=mask, other=0.0)
    tl.store(out_ptr + here, (va + vb) * 0.5 + v, mask=mask)


@triton.jit
def _slice_kernel(vertex_ptr, w_ptr, v_ptr, out_ptr, n_points, L, stride_n, stride_l, scale,
                  D1: tl.constexpr, ACCUMULATE: tl.constexpr, SCALED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """acc = sum_{r=0..D1-1} w[n, r] * v[vertex[n, r], :] in order r; out[n, :] = out[n, :] +
    scale * acc (ACCUMULATE), or scale * acc (SCALED), or acc."""
    n = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    lab = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    in_n = n < n_points
    mask = in_n[:, None] & (lab < L)[None, :]
    n64 = n.to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_L), 0.0, tl.float32)
    for r in tl.static_range(D1):
        col = tl.load(vertex_ptr + n64 * D1 + r, mask=in_n, other=0).to(tl.int64)
        w = tl.load(w_ptr + n64 * D1 + r, mask=in_n, other=0.0)
        x = tl.load(v_ptr + col[:, None] * L + lab[None, :], mask=mask, other=0.0)
        acc = acc + w[:, None] * x
    dst = out_ptr + n64[:, None] * stride_n + lab.to(tl.int64)[None, :] * stride_l
    if ACCUMULATE:
        acc = tl.load(dst, mask=mask, other=0.0) + scale * acc
    elif SCALED:
        acc = scale * acc
    tl.store(dst, acc, mask=mask)


def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (on CPU tensors) rather than compiled."""
    return not isinstance(_blur_kernel, triton.runtime.jit.JITFunction)


def _grid(rows: int, L: int, block_m: int = BLOCK_M):
    """(grid, BLOCK_L, launch options): warps for the tile's floats, 1 to 4 (a warp per 32)."""
    block_l = min(triton.next_power_of_2(L), MAX_BLOCK_L)
    warps = max(1, min(4, block_m * block_l // 32))
    return (triton.cdiv(rows, block_m), triton.cdiv(L, block_l)), block_l, dict(_NO_FMA, num_warps=warps)


def splat(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, x: torch.Tensor,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Shapes: the CSR (R, N) matrix ``crow`` (R+1,), ``col`` (nnz,), ``val`` (nnz,) float32;
    ``x`` (N, L) float32 contiguous -> (R, L) float32, the product, each row summed in stored order."""
    rows, L = crow.numel() - 1, x.shape[1]
    out = torch.empty(rows, L, dtype=torch.float32, device=x.device) if out is None else out
    grid, block_l, options = _grid(rows, L, SPLAT_BLOCK_M)
    _splat_kernel[grid](crow, col, val, x, out, rows, L, BLOCK_M=SPLAT_BLOCK_M, BLOCK_L=block_l, **options)
    return out


def blur_axis(v: torch.Tensor, n1: torch.Tensor, n2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Shapes: v, out (M+1, L) float32 contiguous, n1, n2 (M+1,) int: ``out = (v[n1] + v[n2]) *
    0.5 + v`` (one lattice axis of the blur, the kernel [1/2, 1, 1/2]). Returns ``out``."""
    rows, L = v.shape
    grid, block_l, options = _grid(rows, L)
    _blur_kernel[grid](v, n1, n2, out, rows, L, BLOCK_M=BLOCK_M, BLOCK_L=block_l, **options)
    return out


def slice_into(vertex: torch.Tensor, weights: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
               accumulate: bool, scale: float = 1.0) -> torch.Tensor:
    """Shapes: ``vertex`` (N, d+1) int and ``weights`` (N, d+1) float32, contiguous (the slice
    CSR's columns and values, d+1 per row); v (M+1, L) float32 contiguous; out (N, L) float32
    (any strides). ``out += scale * (W v)`` with ``accumulate``, else ``out = scale * (W v)``.
    Returns ``out``."""
    n_points, d1 = vertex.shape
    L = v.shape[1]
    grid, block_l, options = _grid(n_points, L)
    _slice_kernel[grid](vertex, weights, v, out, n_points, L, out.stride(0), out.stride(1), float(scale),
                        D1=d1, ACCUMULATE=accumulate, SCALED=(scale != 1.0), BLOCK_M=BLOCK_M, BLOCK_L=block_l,
                        **options)
    return out


def triton_filter(lattice: "PermutohedralLattice", values: torch.Tensor, *, add_to: Optional[torch.Tensor] = None,
                  scale: float = 1.0) -> torch.Tensor:
    """:meth:`PermutohedralLattice.filter` in d+3 kernel launches: splat into an (M+1, L) buffer,
    blur ping-pong between it and a second one, slice into the output (or into ``add_to``).

    Shapes: values (N, L) -> (N, L) float32; ``add_to`` (N, L) float32, ``scale`` times the
    result added into it in place and returned. The lattice's tensors and the values must be on
    a CUDA device, or on the CPU with the interpreter (:func:`interpreted`).
    """
    dev = values.device
    if dev.type != "cuda" and not interpreted():
        raise ValueError(f"the Triton lattice filter runs on CUDA tensors, got values on {dev}; on the CPU it needs "
                         "TRITON_INTERPRET=1 set before mars_plugin.engines.permutohedral_triton is imported "
                         "(or set mars_plugin.engines.permutohedral.USE_TRITON = False)")
    x = values.to(torch.float32).contiguous()
    N, L = x.shape
    if add_to is not None and (add_to.shape != (N, L) or add_to.dtype != torch.float32):
        raise ValueError(f"add_to must be ({N}, {L}) float32 like the values, got {tuple(add_to.shape)} {add_to.dtype}")
    out = torch.empty(N, L, dtype=torch.float32, device=dev) if add_to is None else add_to
    try:
        # Triton launches on the current CUDA device: make it the values' one.
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return _filter(lattice, x, out, accumulate=add_to is not None, scale=scale)
    except torch.cuda.OutOfMemoryError:
        raise  # the torch filter needs as much
    except Exception as e:  # compiling or launching (no C compiler for Triton's launcher, an old GPU, ...)
        from mars_plugin.engines import permutohedral

        why = f"the Triton lattice filter failed on {dev} ({type(e).__name__}: {e})"
        if permutohedral.USE_TRITON is None:
            # Asked for by MARS_TRITON=1 (a C compiler for Triton's launcher may be missing): the
            # torch filter, which nothing has written to add_to before, from now on.
            warnings.warn(f"{why}; the torch filter runs instead in this process "
                          "(mars_plugin.engines.permutohedral.USE_TRITON = False; unset MARS_TRITON to skip the try)")
            permutohedral.USE_TRITON = False
            return lattice.filter(values, add_to=add_to, scale=scale)
        raise RuntimeError(f"{why}; set mars_plugin.engines.permutohedral.USE_TRITON = False (or None, and unset MARS_TRITON) "
                           "to use the torch filter") from e


def _filter(lattice: "PermutohedralLattice", x: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
            scale: float) -> torch.Tensor:
    N = x.shape[0]
    sp, sl = lattice._splat, lattice._slice
    v = splat(sp.crow_indices(), sp.col_indices(), sp.values(), x)
    w = torch.empty_like(v)
    for n1, n2 in lattice._blur:
        blur_axis(v, n1, n2, w)
        v, w = w, v
    del w
    d1 = lattice.dim + 1
    vertex, weights = sl.col_indices().view(N, d1), sl.values().view(N, d1)
    return slice_into(vertex, weights, v, out, accumulate=accumulate, scale=scale)
