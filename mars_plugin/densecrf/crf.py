"""pydensecrf's classes (``pydensecrf/densecrf.pyx``): :class:`DenseCRF` (N points, custom
features), :class:`DenseCRF2D` (an image, W first), the unaries :class:`ConstUnary` and
:class:`LogisticUnary`; the mean field is :class:`mars_plugin.engines.crf_terms.GeneralCRF`.

Arrays keep pydensecrf's layout: unaries and Q are (L, N) float32 (N = H W, pixel index
y W + x), features (D, N) float32, images (H, W, 3) uint8, all C-contiguous.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from mars_plugin.densecrf import checks
from mars_plugin.densecrf.checks import KernelType, NormalizationType
from mars_plugin.engines import crf_compiled
from mars_plugin.engines.crf_terms import GeneralCRF

__all__ = ["Unary", "ConstUnary", "LogisticUnary", "DenseCRF", "DenseCRF2D"]

Device = Optional[Union[str, torch.device]]


class Unary:
    """A unary energy for :meth:`DenseCRF.setUnary`; ``get()`` is the (L, N) float32 energy."""

    def get(self) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError


class ConstUnary(Unary):
    """A fixed (L, N) float32 energy ``u``."""

    def __init__(self, u: np.ndarray) -> None:
        self._u = checks.buffer(u, "u", 2, np.float32, "(n_labels, n_pixels)").copy()

    def get(self) -> np.ndarray:
        return self._u


class LogisticUnary(Unary):
    """The energy L f: ``L`` (n_labels, K) and ``f`` (K, n_pixels) float32 (unary.cpp's
    LogisticUnaryEnergy; its learnt parameters are not exposed by pydensecrf either)."""

    def __init__(self, L: np.ndarray, f: np.ndarray) -> None:
        self._L = checks.buffer(L, "L", 2, np.float32, "(n_labels, K)").copy()
        self._f = checks.buffer(f, "f", 2, np.float32, "(K, n_pixels)").copy()
        if self._f.shape[0] != self._L.shape[1]:
            raise ValueError(f"f: got shape {self._f.shape}; expected ({self._L.shape[1]}, n_pixels) to match "
                             f"L of shape {self._L.shape}")

    def get(self) -> np.ndarray:
        return np.matmul(self._L, self._f)


class DenseCRF:
    """A fully connected CRF over ``nvar`` points and ``nlabels`` labels (pydensecrf's
    ``DenseCRF``). ``device``: where the mean field runs ("cpu", "cuda", ...; None: the default
    of :func:`mars_plugin.densecrf.set_default_device` / ``MARS_DENSECRF_DEVICE``, else the CPU).
    Results always come back as numpy arrays on the host. On the CPU with numba (the ``fast``
    extra) one object runs in one thread, as pydensecrf does (the codebases run their images in
    parallel processes): 1.5-1.6x pydensecrf per core at 500x375 with 21 labels, 1.3-2.2x with 2
    (10 iterations, measured); without numba the torch lattice runs (torch's threads; per core
    0.7-1.0x pydensecrf at 21 labels).

    The ``kernel`` argument of the pairwise terms is accepted and checked but changes nothing,
    exactly as in pydensecrf: its kernel parameters start at the identity (CONST_KERNEL has
    none) and its Python API has no way to set them.
    """

    def __init__(self, nvar: int, nlabels: int, *, device: Device = None) -> None:
        self._nvar = checks.count(nvar, "nvar")
        self._nlabel = checks.count(nlabels, "nlabels")
        self.device = checks.resolve_device(device)
        self._engine = GeneralCRF(self._nvar, self._nlabel, self.device,
                                  compiled=self.device.type == "cpu" and crf_compiled.available())
        self._unary: Optional[np.ndarray] = None  # the (L, N) energy, computed once

    # ------------------------------------------------------------ set-up
    def addPairwiseEnergy(self, features: np.ndarray, compat, kernel: int = KernelType.DIAG_KERNEL,
                          normalization: int = NormalizationType.NORMALIZE_SYMMETRIC) -> None:
        """A Gaussian kernel exp(-|f_i - f_j|^2 / 2) over ``features`` (D, nvar) float32
        C-contiguous (already divided by the standard deviations), with label compatibility
        ``compat``: a number w (Potts), a float32 (L,) array (diagonal) or (L, L) array (matrix,
        symmetrised)."""
        f = checks.buffer(features, "features", 2, np.float32, f"(D, {self._nvar})")
        if f.shape[1] != self._nvar or f.shape[0] < 1:
            raise ValueError(f"features: got shape {f.shape}; expected (D, {self._nvar}) with D >= 1 (one column per point)")
        self._add(np.ascontiguousarray(f.T), compat, kernel, normalization)

    def _term_args(self, compat, kernel, normalization):
        comp = checks.compat(compat, self._nlabel)
        checks.enum_value(kernel, KernelType, "kernel")
        return comp, int(checks.enum_value(normalization, NormalizationType, "normalization"))

    def _add(self, rows: np.ndarray, compat, kernel, normalization) -> None:
        """A term over (N, D) features ``rows``."""
        self._engine.add_term(rows, *self._term_args(compat, kernel, normalization))

    def setUnary(self, u: Unary) -> None:
        """A :class:`ConstUnary` or :class:`LogisticUnary` whose energy is (nlabels, nvar)."""
        if not isinstance(u, Unary):
            raise TypeError(f"u: got a {type(u).__name__}; expected a ConstUnary or LogisticUnary")
        energy = np.asarray(u.get(), dtype=np.float32)
        if energy.shape != (self._nlabel, self._nvar):
            raise ValueError(f"u: its energy has shape {energy.shape}; expected {(self._nlabel, self._nvar)}")
        checks.no_nan(energy, "u")
        self._unary = energy

    def setUnaryEnergy(self, u: np.ndarray, f: Optional[np.ndarray] = None) -> None:
        """The (nlabels, nvar) float32 C-contiguous energy U (e.g. -log p); with ``f``, the
        logistic energy u f (pydensecrf asks u for the (nlabels, nvar) shape then too)."""
        u = checks.buffer(u, "u", 2, np.float32, f"({self._nlabel}, {self._nvar})")
        if u.shape != (self._nlabel, self._nvar):
            raise ValueError(f"u: got shape {u.shape}; expected ({self._nlabel}, {self._nvar}) (n_labels, n_pixels)")
        self.setUnary(ConstUnary(u) if f is None else LogisticUnary(u, f))

    # ------------------------------------------------------------ inference
    def _neg_unary(self) -> np.ndarray:
        """-U as (N, L) float32 (zeros without a unary, as pydensecrf)."""
        if self._unary is None:
            return np.zeros((self._nvar, self._nlabel), np.float32)
        return np.ascontiguousarray(-self._unary.T)

    def inference(self, niter: int) -> np.ndarray:
        """Q after ``niter`` mean-field steps from softmax(-U): (nlabels, nvar) float32. ``niter``
        as pydensecrf takes it (a C int: 0 or less runs no step; beyond 2**31 - 1 an
        ``OverflowError`` at once; not a number a ``TypeError``)."""
        q = self._engine.inference(self._neg_unary(), max(0, checks.c_int(niter, "inference: niter")))
        return np.ascontiguousarray(q.T)

    def startInference(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(Q, tmp1, tmp2): Q = softmax(-U) (all zeros without a unary, as pydensecrf), (nlabels,
        nvar) float32; tmp1 and tmp2 are empty scratch arrays kept for pydensecrf's signature."""
        if self._unary is None:
            q = np.zeros((self._nlabel, self._nvar), np.float32)
        else:
            q = self._engine.inference(self._neg_unary(), 0).T.copy()
        return q, np.zeros((0, 0), np.float32), np.zeros((0, 0), np.float32)

    def _q(self, Q, name: str = "Q") -> np.ndarray:
        if not isinstance(Q, np.ndarray) or Q.dtype != np.float32 or Q.shape != (self._nlabel, self._nvar):
            got = f"{Q.dtype} {Q.shape}" if isinstance(Q, np.ndarray) else type(Q).__name__
            raise TypeError(f"{name}: got {got}; expected the float32 ({self._nlabel}, {self._nvar}) array of startInference")
        return Q

    def stepInference(self, Q: np.ndarray, tmp1=None, tmp2=None) -> None:
        """One mean-field step, Q updated in place (tmp1 and tmp2 are not used)."""
        Q = self._q(Q)
        Q[...] = self._engine.step(self._neg_unary(), Q.T).T

    def klDivergence(self, Q: np.ndarray) -> float:
        """KL(Q || P) up to a constant (densecrf.cpp): sum Q log Q + sum U Q + the pairwise terms."""
        Q = self._q(Q)
        unary = None if self._unary is None else self._unary.T
        return self._engine.kl_divergence(unary, Q.T)


class DenseCRF2D(DenseCRF):
    """A dense CRF over the pixels of a W x H image (pydensecrf's ``DenseCRF2D(W, H, nlabels)``,
    width first); pixel (x, y) is point y W + x."""

    def __init__(self, w: int, h: int, nlabels: int, *, device: Device = None) -> None:
        self._w = checks.count(w, "w")
        self._h = checks.count(h, "h")
        super().__init__(self._w * self._h, nlabels, device=device)

    def addPairwiseGaussian(self, sxy, compat, kernel: int = KernelType.DIAG_KERNEL,
                            normalization: int = NormalizationType.NORMALIZE_SYMMETRIC) -> None:
        """The appearance-free kernel over (x / sx, y / sy); ``sxy`` one number or (sx, sy)."""
        sx, sy = checks.pair(sxy, "sxy", 2)
        comp, norm = self._term_args(compat, kernel, normalization)
        self._engine.add_position_term(self._h, self._w, sx, sy, comp, norm)

    def addPairwiseBilateral(self, sxy, srgb, rgbim: np.ndarray, compat, kernel: int = KernelType.DIAG_KERNEL,
                             normalization: int = NormalizationType.NORMALIZE_SYMMETRIC) -> None:
        """The kernel over (x / sx, y / sy, r / sr, g / sg, b / sb); ``rgbim`` (H, W, 3) uint8
        C-contiguous, ``srgb`` one number or three."""
        im = checks.buffer(rgbim, "rgbim", 3, np.uint8, f"({self._h}, {self._w}, 3)")
        if im.shape[:2] != (self._h, self._w):
            raise ValueError(f"rgbim: got shape {im.shape}; expected ({self._h}, {self._w}, 3) (H, W, RGB) for "
                             f"DenseCRF2D(W={self._w}, H={self._h})")
        if im.shape[2] != 3:
            raise ValueError(f"rgbim: got {im.shape[2]} channels; expected 3 (RGB). For other images build the "
                             "features with utils.create_pairwise_bilateral and use addPairwiseEnergy")
        sx, sy = checks.pair(sxy, "sxy", 2)
        s = np.array(checks.pair(srgb, "srgb", 3), dtype=np.float32)
        # densecrf.cpp's float division of the integer coordinates and colours
        f = np.empty((self._h, self._w, 5), np.float32)
        f[:, :, 0] = np.arange(self._w, dtype=np.float32)[None, :] / sx
        f[:, :, 1] = np.arange(self._h, dtype=np.float32)[:, None] / sy
        np.divide(im, s, out=f[:, :, 2:], dtype=np.float32)
        self._add(f.reshape(self._nvar, 5), compat, kernel, normalization)
