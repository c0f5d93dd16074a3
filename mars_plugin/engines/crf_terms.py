"""The general dense CRF's mean field: any number of pairwise terms, each a Gaussian kernel over
features of any dimension with one of pydensecrf's four normalisations and one of its three
label compatibilities; the engine under the pydensecrf drop-in (:mod:`mars_plugin.densecrf`).

It computes what pydensecrf's ``DenseCRF`` computes (``densecrf.cpp`` ``inference``,
``stepInference``, ``klDivergence``; ``pairwise.cpp`` ``DenseKernel``; ``labelcompatibility.cpp``):

    Q = softmax(-U), then each iteration Q = softmax(-U - sum_k C_k(Kn_k(Q)))

over the labels of every point, where Kn_k is term k's normalised Gaussian filter (n = the
filter of ones, K 1):

* NO_NORMALIZATION: K(Q) (pydensecrf computes a mean normaliser for it and never applies it);
* NORMALIZE_BEFORE: K(Q / n); NORMALIZE_AFTER: K(Q) / n;
* NORMALIZE_SYMMETRIC: K(Q / sqrt(n)) / sqrt(n) (pydensecrf's default);

(each 1 / (n + 1e-20), in double, rounded to float32 as there), and C_k the compatibility:
Potts ``-w x``, diagonal ``diag(v) x``, matrix ``W x`` with W = (M + M^T) / 2.

Arrays here are (N, L), one row per point (the layout both lattices filter); the drop-in
transposes at its edge. The lattice of each term is built once, when the term is added: the
numba :class:`~mars_plugin.engines.crf_exact.ExactLattice` on the CPU when numba is available
(pydensecrf's float32 operations in its order, its normalisers applied to the values: Q equal
to pydensecrf's bit for bit where the lattice is the same), else the torch
:class:`~mars_plugin.engines.permutohedral.PermutohedralLattice` on the CRF's device, the
normaliser folded into its splat and slice weights as the fixed-pair CRF folds its own
(:mod:`mars_plugin.engines.crf_lattices`; each product within an ulp of pydensecrf's).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import numpy as np
import torch

import mars_plugin._interrupt as _interrupt
from mars_plugin.engines import crf_exact
from mars_plugin.engines.crf_lattices import _gaussian_lattice, _kept
from mars_plugin.engines.crf_mean_field import _softmax_rows_
from mars_plugin.engines.permutohedral import MAX_COORDINATE, PermutohedralLattice, max_lifted_coordinate

__all__ = ["COMPILED_MAX_DIM", "NO_NORMALIZATION", "NORMALIZE_BEFORE", "NORMALIZE_AFTER", "NORMALIZE_SYMMETRIC", "Compat",
           "PairwiseTerm", "GeneralCRF"]

# pydensecrf's NormalizationType values (densecrf/include/pairwise.h).
NO_NORMALIZATION, NORMALIZE_BEFORE, NORMALIZE_AFTER, NORMALIZE_SYMMETRIC = 0, 1, 2, 3

#: The most feature dimensions the numba lattice takes: it keeps each vertex's rank, 0..D, as int8
#: (past 127 it relies on wrap-around; at D = 256 its filter was wrong by 1e-4, measured).
COMPILED_MAX_DIM = 126

#: A label compatibility: ("potts", w), ("diagonal", (L,) float32 v) or ("matrix", (L, L)
#: float32 symmetric W); the pairwise message is C(Kn(Q)) as labelcompatibility.cpp applies it.
Compat = Tuple[str, Union[float, np.ndarray]]


def _normalisers(k1: np.ndarray, normalization: int) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(before, after): the (N,) float32 factors of the values before and after the filter, None
    for none, from the (N,) float32 filter of ones, in pydensecrf's double arithmetic."""
    k = k1.astype(np.float64)
    if normalization == NORMALIZE_SYMMETRIC:
        n = (1.0 / np.sqrt(k + 1e-20)).astype(np.float32)
        return n, n
    if normalization == NO_NORMALIZATION:
        return None, None
    n = (1.0 / (k + 1e-20)).astype(np.float32)
    return (n, None) if normalization == NORMALIZE_BEFORE else (None, n)


def _check_features(features: np.ndarray) -> None:
    if not np.isfinite(features).all():
        raise ValueError("features: contain NaN or Inf values; expected finite positions (feature / standard deviation)")
    top = max_lifted_coordinate(np.abs(features).max(0).astype(np.float64).tolist())
    if top > MAX_COORDINATE:
        raise ValueError(f"features: too large for the float32 lattice (lifted coordinates reach {top:.4g}, at most "
                         f"{MAX_COORDINATE:.4g}); expected positions divided by larger standard deviations")


def build_lattice(features: np.ndarray, normalization: int, device: torch.device, compiled: bool):
    """The normalised lattice of (N, D) float32 features: an ExactLattice (``compiled``, CPU:
    pydensecrf's float32 operations in its order, the normalisers applied to the values) or a
    PermutohedralLattice on ``device``, the normalisers folded into its splat (before) and
    slice (after) weights."""
    features = np.ascontiguousarray(features, dtype=np.float32)
    _check_features(features)
    N, D = features.shape
    if compiled and D > COMPILED_MAX_DIM:
        raise ValueError(f"features: got D = {D} dimensions; the compiled CPU lattice takes at most "
                         f"{COMPILED_MAX_DIM} (set MARS_NO_NUMBA=1 for the torch lattice, which takes any)")
    if compiled:  # pydensecrf's roundings, operation for operation (crf_exact.py)
        lat = crf_exact.ExactLattice(features)
        lat.set_normalisers(*_normalisers(lat.filter(np.ones((N, 1), np.float32))[:, 0], normalization))
        return lat
    lat = PermutohedralLattice(torch.from_numpy(features).to(device))
    k1 = lat.filter(torch.ones(N, 1, dtype=torch.float32, device=device))[:, 0].cpu().numpy()
    before, after = _normalisers(k1, normalization)
    ones = torch.ones(N, dtype=torch.float32, device=device)
    return lat.scale_(ones if before is None else torch.from_numpy(before).to(device),
                      ones if after is None else torch.from_numpy(after).to(device))


def position_lattice(height: int, width: int, sx: float, sy: float, normalization: int, device: torch.device,
                     compiled: bool):
    """The lattice of ``DenseCRF2D.addPairwiseGaussian`` over (x / sx, y / sy), pixel y W + x.
    With sx == sy and the symmetric normaliser it is the fixed-pair CRF's kept lattice
    (:mod:`mars_plugin.engines.crf_lattices`: same features, same normaliser, built once per
    image size; compiled, the exact lattice of these sizes is kept alike)."""
    sx, sy = np.float32(sx), np.float32(sy)
    if sx == sy and normalization == NORMALIZE_SYMMETRIC and not compiled:
        return _gaussian_lattice(((height, width),), float(sx), device)

    def build():
        f = np.empty((height, width, 2), np.float32)
        f[:, :, 0] = np.arange(width, dtype=np.float32)[None, :] / sx
        f[:, :, 1] = np.arange(height, dtype=np.float32)[:, None] / sy
        return build_lattice(f.reshape(-1, 2), normalization, device, compiled)
    if compiled:
        return _kept(((height, width), float(sx), float(sy), int(normalization), "exact"), build)
    return build()


class PairwiseTerm:
    """One pairwise term: a normalised lattice (:func:`build_lattice`; never changed here, it
    may be a kept one) and a label compatibility. ``compiled``: a CompiledLattice (numpy
    arrays), else a torch PermutohedralLattice on ``device``."""

    def __init__(self, lattice, compat: Compat, device: torch.device, compiled: bool) -> None:
        self.lattice, self.compiled, self.device, self.kind = lattice, compiled, device, compat[0]
        if self.kind == "potts":
            self.weight = float(np.float32(compat[1]))
        elif compiled:
            self.weight = np.ascontiguousarray(compat[1], dtype=np.float32)
        else:
            self.weight = torch.from_numpy(np.ascontiguousarray(compat[1], dtype=np.float32)).to(device)

    @property
    def num_lattice_points(self) -> int:
        return self.lattice.num_lattice_points

    def _filter(self, q, out, scale: float, scratch) -> None:
        """out += scale Kn(q): the compiled filter with the caller's scratch buffers (made once
        per inference: fresh ones would be paged in at every call), or the torch one."""
        if self.compiled:
            self.lattice.filter(q, out, scale, scratch[0], scratch[1])
        else:
            self.lattice.filter(q, add_to=out, scale=scale)

    def add_energy(self, q, energy, scratch=None) -> None:
        """energy -= C(Kn(q)), in place: (N, L) numpy arrays (compiled) or tensors (torch).
        ``scratch``: (vbuf, wbuf, message), see :meth:`GeneralCRF._scratch`."""
        if self.kind == "potts":  # -(-w Kn(q)) = w Kn(q), added by the filter itself
            self._filter(q, energy, self.weight, scratch)
            return
        m = scratch[2]
        m[...] = 0
        self._filter(q, m, 1.0, scratch)
        if self.kind == "diagonal":
            m *= self.weight
            energy -= m
        elif self.compiled:  # rows: (W m^T)^T = m W^T = m W (W symmetric)
            energy -= m @ self.weight
        else:
            energy.addmm_(m, self.weight, alpha=-1.0)


class GeneralCRF:
    """Mean field of a dense CRF over N points and L labels with any pairwise terms.

    Shapes: the unary ``neg_unary`` is (N, L) float32 -U (numpy); Q is (N, L) float32 numpy.
    ``device``: where the torch lattices and iterations run (CPU or CUDA); ``compiled`` (CPU
    only): the numba lattices instead. Results always come back as numpy on the host.
    """

    def __init__(self, num_points: int, num_labels: int, device: torch.device, compiled: bool) -> None:
        self.N, self.L = int(num_points), int(num_labels)
        self.device = torch.device(device)
        self.compiled = bool(compiled) and self.device.type == "cpu"
        self.terms: List[PairwiseTerm] = []

    def add_term(self, features: np.ndarray, compat: Compat, normalization: int) -> None:
        """features: (N, D) float32 (one row per point)."""
        lattice = build_lattice(features, normalization, self.device, self.compiled)
        self.terms.append(PairwiseTerm(lattice, compat, self.device, self.compiled))

    def add_position_term(self, height: int, width: int, sx: float, sy: float, compat: Compat,
                          normalization: int) -> None:
        """The (x / sx, y / sy) kernel of an H x W image (N = H W), see :func:`position_lattice`."""
        lattice = position_lattice(height, width, sx, sy, normalization, self.device, self.compiled)
        self.terms.append(PairwiseTerm(lattice, compat, self.device, self.compiled))

    # ------------------------------------------------------------ the two layouts' arithmetic
    def _softmax(self, x):
        if self.compiled:
            crf_exact.softmax_rows(x)
            return x
        return _softmax_rows_(x)

    def _to_work(self, a: np.ndarray):
        a = np.ascontiguousarray(a, dtype=np.float32)
        return a if self.compiled else torch.from_numpy(a).to(self.device)

    def _to_host(self, a) -> np.ndarray:
        return a if self.compiled else a.cpu().numpy()

    def _scratch(self, q):
        """The filters' buffers for (N, L) values ``q``: two of (M+1) L floats for the
        compiled filter (M: the largest lattice), and an (N, L) message for non-Potts terms."""
        message = (np.empty_like(q) if self.compiled else torch.empty_like(q)) if any(
            t.kind != "potts" for t in self.terms) else None
        if not self.compiled or not self.terms:
            return None, None, message
        size = (max(t.num_lattice_points for t in self.terms) + 1) * q.shape[1]
        return np.empty(size, np.float32), np.empty(size, np.float32), message

    def _step(self, neg_u, q, energy, scratch):
        """energy = -U - sum_k C_k(Kn_k(q)), then softmax: returns the new Q (in ``energy``)."""
        energy[...] = neg_u
        for term in self.terms:
            term.add_energy(q, energy, scratch)
        return self._softmax(energy)

    def inference(self, neg_unary: np.ndarray, iterations: int) -> np.ndarray:
        """Q after ``iterations`` steps from softmax(-U): (N, L) float32."""
        neg_u = self._to_work(neg_unary)
        q = self._softmax(neg_u.copy() if self.compiled else neg_u.clone())
        spare = np.empty_like(q) if self.compiled else torch.empty_like(q)
        scratch = self._scratch(q)
        with _interrupt.polled():  # a Ctrl-C is taken between steps, never inside a compiled call
            for _ in range(int(iterations)):
                _interrupt.check()
                q, spare = self._step(neg_u, q, spare, scratch), q
        return self._to_host(q)

    def step(self, neg_unary: np.ndarray, q: np.ndarray) -> np.ndarray:
        """One step from ``q`` (N, L): the new Q, (N, L) float32."""
        neg_u = self._to_work(neg_unary)
        work = self._to_work(q)
        energy = np.empty_like(work) if self.compiled else torch.empty_like(work)
        return self._to_host(self._step(neg_u, work, energy, self._scratch(work)))

    def kl_divergence(self, unary: Optional[np.ndarray], q: np.ndarray) -> float:
        """pydensecrf's ``klDivergence``: sum Q log Q + sum U Q + sum_k sum Q C_k(Kn_k(Q)), in
        double (U None: no unary term)."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        q64 = q.astype(np.float64)
        kl = float((q64 * np.log(np.maximum(q, np.float32(1e-20))).astype(np.float64)).sum())
        if unary is not None:
            kl += float((unary.astype(np.float64) * q64).sum())
        work = self._to_work(q)
        scratch = self._scratch(work)
        for term in self.terms:  # C(Kn(Q)) = -(0 - C(Kn(Q)))
            message = np.zeros_like(work) if self.compiled else torch.zeros_like(work)
            term.add_energy(work, message, scratch)
            kl -= float((q64 * self._to_host(message).astype(np.float64)).sum())
        return kl
