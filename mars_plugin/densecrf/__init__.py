"""A drop-in for pydensecrf (pydensecrf2 1.1): ``import mars_plugin.densecrf as dcrf`` in place
of ``import pydensecrf.densecrf as dcrf`` gives the same classes, constants and results,
computed by this package's dense CRF (:mod:`mars_plugin.engines.crf_terms`): compiled with numba
on the CPU (the ``fast`` extra), in pydensecrf's float32 operations and order, so Q is its bit
for bit (:mod:`mars_plugin.engines.crf_exact`; 310 of 310 cases, docs/crf.md); with torch
without numba or on a GPU (Q to float32 rounding, amplified near label ties: 4.6e-4 at most).

    d = dcrf.DenseCRF2D(W, H, n_labels)            # W first, as pydensecrf
    d.setUnaryEnergy(unary_from_softmax(probs))    # (L, H W) float32, C order
    d.addPairwiseGaussian(sxy=3, compat=3)
    d.addPairwiseBilateral(sxy=80, srgb=13, rgbim=img, compat=10)   # (H, W, 3) uint8
    Q = np.array(d.inference(10)).reshape((n_labels, H, W))

The device: CPU by default; per object ``DenseCRF2D(W, H, L, device="cuda")``; for a codebase
left unchanged, ``MARS_DENSECRF_DEVICE=cuda`` in the environment (read when an object is made)
or :func:`set_default_device`. Results always come back as numpy arrays on the host.

* ``crf.py`` -- :class:`DenseCRF`, :class:`DenseCRF2D`, :class:`ConstUnary`, :class:`LogisticUnary`.
* ``checks.py`` -- the argument checks (pydensecrf's refusals, clearer), the kernel and
  normalisation types, the device choice.
* ``utils.py`` -- ``unary_from_labels``, ``unary_from_softmax``, ``create_pairwise_gaussian``,
  ``create_pairwise_bilateral`` (bit for bit pydensecrf's).
"""
from mars_plugin.densecrf import utils
from mars_plugin.densecrf.checks import (
    DEVICE_ENV,
    KernelType,
    NormalizationType,
    get_default_device,
    set_default_device,
)
from mars_plugin.densecrf.crf import ConstUnary, DenseCRF, DenseCRF2D, LogisticUnary, Unary

CONST_KERNEL = KernelType.CONST_KERNEL
DIAG_KERNEL = KernelType.DIAG_KERNEL
FULL_KERNEL = KernelType.FULL_KERNEL
NO_NORMALIZATION = NormalizationType.NO_NORMALIZATION
NORMALIZE_BEFORE = NormalizationType.NORMALIZE_BEFORE
NORMALIZE_AFTER = NormalizationType.NORMALIZE_AFTER
NORMALIZE_SYMMETRIC = NormalizationType.NORMALIZE_SYMMETRIC

__all__ = [
    "CONST_KERNEL", "DIAG_KERNEL", "FULL_KERNEL", "NO_NORMALIZATION", "NORMALIZE_BEFORE", "NORMALIZE_AFTER",
    "NORMALIZE_SYMMETRIC", "KernelType", "NormalizationType", "DEVICE_ENV", "set_default_device",
    "get_default_device", "Unary", "ConstUnary", "LogisticUnary", "DenseCRF", "DenseCRF2D", "utils",
]
