"""The dense CRF's mean field, per backend: in torch (one lattice pair per run of images, on
the inputs' device), on the CPU with numba (:mod:`mars_plugin.engines.crf_compiled`, the runs
in parallel threads), and pydensecrf's ``DenseCRF2D`` itself (the reference, the ``crf``
extra). :func:`mars_plugin.engines.crf.dense_crf` checks the inputs and calls these.

Q = softmax(-U), then ``iterations`` times Q = softmax(-U + w_g n_g K_g(n_g Q) + w_b n_b K_b(n_b Q)).
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

import mars_plugin._interrupt as _interrupt
from mars_plugin.engines import crf_compiled
from mars_plugin.engines.crf_lattices import (
    _checked_features,
    _compiled_gaussian,
    _features,
    _gaussian_lattice,
    _lattice,
    _segments,
)
from mars_plugin.engines.crf_memory import (
    _bilateral_points_within,
    _check_budget,
    _label_blocks,
    _pixels_within,
    _too_large,
)
from mars_plugin.engines.crf_params import PROB_CLIP
from mars_plugin.engines.permutohedral import LatticeTooLarge

__all__ = ["CPU_CHUNK_PIXELS", "CUDA_CHUNK_PIXELS", "COMPILED_RUNS_PER_THREAD"]


#: Pixels filtered as one lattice. On the CPU one VOC image at a time is fastest (a batch of
#: eight 500x375 images as one lattice ran 1.6-2.3x slower than eight single runs: the working
#: set leaves the caches), small images are still grouped; on a GPU the batch is the point, up
#: to about 64 images of 512x512 per lattice.
CPU_CHUNK_PIXELS = 1 << 18
CUDA_CHUNK_PIXELS = 1 << 24
#: On the CPU with numba, the lattices (runs of at most CPU_CHUNK_PIXELS) of a batch are solved
#: in torch.get_num_threads() parallel threads, up to this many per thread in a group (so that
#: the threads stay busy when images differ in size; a group is within max_bytes; only one
#: lattice per thread is alive at a time).
COMPILED_RUNS_PER_THREAD = 4
_SOFTMAX_ROWS = 1 << 16
_SOFTMAX_ROWS_CUDA = 1 << 22


def _softmax_rows_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the L labels of (N, L) energies, in place: exp(x - max) / sum, pydensecrf's
    ``expAndNormalize``.

    On the CPU torch's softmax over a short last axis is slow (5.3 ms at L = 2 for 187,500
    pixels, 15.7 ms at L = 8, against 1.4 and 2.6 ms written out); from about 16 labels on it
    is the faster one (4.9 against 7.9 ms at L = 21): it runs on blocks of rows, so that its
    output is never a second (N, L) array.
    """
    if x.is_cuda or x.shape[1] >= 16:
        rows = _SOFTMAX_ROWS_CUDA if x.is_cuda else _SOFTMAX_ROWS
        for a in range(0, x.shape[0], rows):
            x[a:a + rows] = torch.softmax(x[a:a + rows], 1)
        return x
    x.sub_(x.amax(1, keepdim=True)).exp_()
    return x.div_(x.sum(1, keepdim=True))


def _chunks(sizes: Sequence[int], limit: int) -> List[Tuple[int, int]]:
    """Consecutive runs of images with at most ``limit`` pixels in all (one image at least)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            runs.append((start, i))
            start, total = i, 0
        total += n
    runs.append((start, len(sizes)))
    return runs


def _mean_field_torch(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                      rgbs: List[torch.Tensor], p: Mapping[str, float], chunk_pixels: Optional[int],
                      max_bytes: Optional[int]) -> List[torch.Tensor]:
    """Mean field for a batch, in runs of at most ``chunk_pixels`` pixels (one lattice each) that
    fit in ``max_bytes``; an image that does not fit alone is refused before any work.

    On the CPU with numba (:mod:`mars_plugin.engines.crf_compiled`), groups of up to
    ``COMPILED_RUNS_PER_THREAD`` runs per thread (within ``max_bytes`` together) are solved in
    parallel threads, one run per thread at a time."""
    device = sources[0].device
    compiled = device.type == "cpu" and crf_compiled.available()
    if chunk_pixels is None:
        chunk_pixels = CUDA_CHUNK_PIXELS if device.type == "cuda" else CPU_CHUNK_PIXELS
    L = sources[0].shape[0]
    shapes = [(s.shape[1], s.shape[2]) for s in sources]
    sizes = [H * W for H, W in shapes]
    fit = None
    if max_bytes is not None:
        _check_budget(shapes, L, p, max_bytes)
        fit = _pixels_within(max_bytes, L, p)
        chunk_pixels = max(1, min(chunk_pixels, fit))
    groups = _chunks(sizes, chunk_pixels)
    if compiled:  # runs of images grouped: up to so many runs per thread, within the budget
        most = COMPILED_RUNS_PER_THREAD * torch.get_num_threads()
        groups, runs = [], _chunks(sizes, chunk_pixels)
        for a, b in runs:
            n = sum(sizes[a:b])
            if groups and groups[-1][2] < most and (fit is None or groups[-1][3] + n <= fit):
                groups[-1] = (groups[-1][0], b, groups[-1][2] + 1, groups[-1][3] + n)
            else:
                groups.append((a, b, 1, n))
        groups = [(a, b) for a, b, _, _ in groups]
    out: List[torch.Tensor] = []
    for a, b in groups:
        try:
            out.extend(_mean_field_chunk(sources[a:b], kind, masks[a:b], rgbs[a:b], p, max_bytes, chunk_pixels))
        except LatticeTooLarge:  # images whose colours make a denser lattice than assumed: one at a time
            for i in range(a, b):
                out.extend(_mean_field_chunk(sources[i:i + 1], kind, masks[i:i + 1], rgbs[i:i + 1], p, max_bytes,
                                             chunk_pixels))
    return out


def _neg_energy(dst: torch.Tensor, src: torch.Tensor, kind: str, mask: Optional[torch.Tensor]) -> None:
    """Write -U of one image into its (n, L) rows of the mean field's array: log(clip(p, 1e-5,
    1)) of probabilities (``unary_from_softmax``, in the probabilities' precision, the half
    types widened to float32 first, as :func:`~mars_plugin.engines.crf.unary_from_probs`) or -U
    of a unary; -inf for the labels ``mask`` forbids."""
    rows = src.reshape(src.shape[0], -1).t()
    if kind == "unary":
        dst.copy_(rows).neg_()
    elif src.dtype == torch.float32:
        torch.clamp(rows, PROB_CLIP, 1.0, out=dst).log_()
    else:
        wide = rows.float() if src.dtype in (torch.float16, torch.bfloat16) else rows
        dst.copy_(wide.clamp(PROB_CLIP, 1.0).log_())
    if mask is not None:
        dst[:, ~mask] = float("-inf")


def _mean_field_chunk(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                      rgbs: List[torch.Tensor], p: Mapping[str, float], max_bytes: Optional[int],
                      chunk_pixels: int = CPU_CHUNK_PIXELS) -> List[torch.Tensor]:
    """Mean field for one lattice: sources[i] (L, H_i, W_i) probabilities (``kind="probs"``) or
    unary energies (``"unary"``, +inf = label not allowed), masks[i] None or (L,) bool, rgbs[i]
    (H_i, W_i, 3) uint8, all on one device. Returns the (L, H_i, W_i) float32 marginals.

    On the CPU with numba: one lattice per run of at most ``chunk_pixels`` pixels, the runs
    solved in parallel (:func:`_mean_field_compiled`).

    Memory (see :func:`~mars_plugin.engines.crf_memory.crf_memory_bytes`): the lattices are built
    first; then three (N, L) arrays (-U, Q and the energy, reused by every iteration; -U is
    written straight from the inputs, no unary array is made) and the filter's (M, L) arrays, a
    few labels at a time.
    """
    device = sources[0].device
    L = sources[0].shape[0]
    shapes = tuple((s.shape[1], s.shape[2]) for s in sources)
    sizes = [H * W for H, W in shapes]
    N = sum(sizes)
    if device.type == "cpu" and crf_compiled.available():
        with _interrupt.polled():  # the lattices' kernels too: a Ctrl-C waits for their return
            return _mean_field_compiled(sources, kind, masks, rgbs, p, max_bytes, chunk_pixels)
    gaussian = _gaussian_lattice(shapes, p["gaussian_sxy"], device)
    max_points = None
    if max_bytes is not None:
        max_points = _bilateral_points_within(max_bytes, N, L, gaussian.num_lattice_points)
    try:
        bilateral = _lattice(_features(shapes, p["bilateral_sxy"], rgbs, p["bilateral_srgb"], device),
                             _segments(sizes, device), max_points)
    except LatticeTooLarge as e:
        if len(shapes) > 1:
            raise  # the caller runs these images one at a time
        raise _too_large(e, shapes, L, p, max_bytes) from None
    # The Potts message of one kernel is compat * n * K(n * Q), compat applied by the product.
    terms = [(gaussian, float(np.float32(p["gaussian_compat"]))), (bilateral, float(np.float32(p["bilateral_compat"])))]
    # (N, L): one row per pixel, the layout the sparse products want.
    neg_u = torch.empty(N, L, dtype=torch.float32, device=device)
    start = 0
    for s, m, n in zip(sources, masks, sizes):
        _neg_energy(neg_u[start:start + n], s, kind, m)
        start += n
    # Q = softmax(-U), then each iteration the energy -U + messages and Q = softmax in place.
    # All labels at once into a second (N, L) array, the roles of the two swapped every
    # iteration; or, where the filter's (M, L) arrays would be large, a block of labels at a
    # time (the Potts message of a label depends on that label's Q alone): the block's energy
    # is made aside and written over that block of Q once both kernels have read it.
    q = _softmax_rows_(neg_u.clone())
    blocks = _label_blocks(L, N, max(gaussian.num_lattice_points, bilateral.num_lattice_points))
    spare = torch.empty_like(neg_u) if len(blocks) == 1 else None
    for _ in range(int(p["iterations"])):
        if spare is not None:
            spare.copy_(neg_u)
            for lattice, compat in terms:
                lattice.filter(q, add_to=spare, scale=compat)
            q, spare = spare, q
        else:
            for a, b in blocks:
                energy = neg_u[:, a:b].clone(memory_format=torch.contiguous_format)
                block = q[:, a:b]
                for lattice, compat in terms:
                    lattice.filter(block, add_to=energy, scale=compat)
                block.copy_(energy)
                del energy, block
        _softmax_rows_(q)
    del neg_u, spare, terms, gaussian, bilateral
    out, start = [], 0
    for (H, W), n in zip(shapes, sizes):
        out.append(q[start:start + n].t().reshape(L, H, W).contiguous())
        start += n
    return out


def _mean_field_compiled(sources: List[torch.Tensor], kind: str, masks: List[Optional[torch.Tensor]],
                         rgbs: List[torch.Tensor], p: Mapping[str, float], max_bytes: Optional[int],
                         chunk_pixels: int) -> List[torch.Tensor]:
    """:func:`_mean_field_chunk` on the CPU with numba: the images cut into runs of at most
    ``chunk_pixels`` pixels, one lattice pair per run, the runs solved in
    ``torch.get_num_threads()`` threads (:func:`mars_plugin.engines.crf_compiled.mean_field`), each
    run's bilateral lattice within its share of ``max_bytes``."""
    L = sources[0].shape[0]
    shapes = tuple((s.shape[1], s.shape[2]) for s in sources)
    sizes = [H * W for H, W in shapes]
    N = sum(sizes)
    neg_u = torch.empty(N, L, dtype=torch.float32)
    start = 0
    for s, m, n in zip(sources, masks, sizes):
        _neg_energy(neg_u[start:start + n], s, kind, m)
        start += n
    cpu = torch.device("cpu")
    units, start = [], 0
    for a, b in _chunks(sizes, chunk_pixels):
        run_shapes = shapes[a:b]
        n = sum(sizes[a:b])
        gaussian = _compiled_gaussian(run_shapes, p["gaussian_sxy"])
        features = _checked_features(_features(run_shapes, p["bilateral_sxy"], rgbs[a:b], p["bilateral_srgb"], cpu))
        limit = None
        if max_bytes is not None:
            limit = _bilateral_points_within(max_bytes * n / N, n, L, gaussian.num_lattice_points)

        def build(features=features, run=sizes[a:b], limit=limit):
            return crf_compiled.CompiledLattice(features, run, limit)

        units.append((start, start + n, gaussian, build))
        start += n
    compats = (float(np.float32(p["gaussian_compat"])), float(np.float32(p["bilateral_compat"])))
    try:
        q = crf_compiled.mean_field(neg_u.numpy(), units, compats, int(p["iterations"]), torch.get_num_threads())
    except LatticeTooLarge as e:
        if len(shapes) > 1:
            raise  # the caller runs these images one at a time
        raise _too_large(e, shapes, L, p, max_bytes) from None
    del neg_u
    out, start = [], 0
    for (H, W), n in zip(shapes, sizes):
        out.append(torch.from_numpy(q[start:start + n].T.reshape(L, H, W).copy()))
        start += n
    return out


def _mean_field_pydensecrf(unaries: List[torch.Tensor], rgbs: List[torch.Tensor], p: Mapping[str, float]) -> List[torch.Tensor]:
    """The reference: pydensecrf's DenseCRF2D, one image at a time on the CPU."""
    try:
        import pydensecrf.densecrf as dcrf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("crf_backend='pydensecrf' needs pydensecrf: pip install 'mars-plugin[crf]' "
                          "(installs pydensecrf2), or use the default crf_backend='torch'") from e
    out = []
    for u, c in zip(unaries, rgbs):
        L, H, W = u.shape
        d = dcrf.DenseCRF2D(W, H, L)
        d.setUnaryEnergy(np.ascontiguousarray(u.detach().cpu().numpy().reshape(L, -1), dtype=np.float32))
        d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
        d.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"],
                               rgbim=np.ascontiguousarray(c.cpu().numpy()), compat=p["bilateral_compat"])
        q = np.asarray(d.inference(int(p["iterations"])), dtype=np.float32).reshape(L, H, W)
        out.append(torch.from_numpy(q).to(u.device))
    return out
