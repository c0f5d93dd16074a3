"""Dense CRF refinement (Krahenbuhl & Koltun), the post-processing of Eq. 4-5 and of the teacher.

pydensecrf is an optional dependency (``pip install mars-plugin[crf]``, which installs
``pydensecrf2``: the original
``pydensecrf`` 1.0rc3 does not build on Python 3.11). The defaults are those of the
probability-input ``crf_inference`` of PSA and SEAM (``tool/imutils.py``): 10 mean-field
iterations, a Gaussian kernel (sxy 3, compat 3) and a bilateral kernel (sxy 80, srgb 13,
compat 10). IRNet/AdvCAM only ship ``crf_inference_label`` (a label unary with gt_prob 0.7 and
bilateral srgb 5), which their adapters reproduce themselves.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from ._checks import as_tensor, describe

__all__ = ["DEFAULT_CRF_PARAMS", "dense_crf", "check_crf_params", "image_to_hwc_uint8"]

DEFAULT_CRF_PARAMS: Dict[str, float] = {
    "iterations": 10,
    "gaussian_sxy": 3,
    "gaussian_compat": 3,
    "bilateral_sxy": 80,
    "bilateral_srgb": 13,
    "bilateral_compat": 10,
}


def check_crf_params(params: Optional[Mapping[str, Any]], defaults: Mapping[str, float] = DEFAULT_CRF_PARAMS,
                     integers: Tuple[str, ...] = ("iterations",)) -> Dict[str, float]:
    """Merge user overrides into ``defaults``; unknown keys, non-positive values and non-integers
    for the ``integers`` keys are errors."""
    out = dict(defaults)
    if params is None:
        return out
    if not isinstance(params, Mapping):
        raise TypeError(f"crf_params must be a dict, got {describe(params)}")
    for key, value in params.items():
        if key not in out:
            raise ValueError(f"crf_params has the unknown key {key!r}; expected some of {sorted(out)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"crf_params[{key!r}] must be a positive number, got {value!r}")
        if key in integers and int(value) != value:
            raise ValueError(f"crf_params[{key!r}] must be an integer, got {value!r}")
        out[key] = value
    return out


def image_to_hwc_uint8(image: Any, name: str, size: Tuple[int, int]) -> np.ndarray:
    """An RGB image as a contiguous (H, W, 3) uint8 array, the layout pydensecrf needs.

    Accepts (H, W, 3) or (3, H, W) (whichever matches ``size``; (3, H, W) wins a tie), as
    uint8 or as float in [0, 1] (torchvision's convention, scaled by 255 and rounded).
    """
    t = as_tensor(image, name).detach().cpu()
    H, W = size
    if t.ndim == 3 and tuple(t.shape) == (3, H, W):
        t = t.permute(1, 2, 0)
    elif not (t.ndim == 3 and tuple(t.shape) == (H, W, 3)):
        raise ValueError(f"{name} must be an RGB image (H, W, 3) or (3, H, W) with (H, W) = {size}, got {describe(t)}")
    if t.dtype == torch.uint8:
        arr = t.numpy()
    elif t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or float(t.min()) < 0 or float(t.max()) > 1:
            raise ValueError(f"{name} as a float image must hold values in [0, 1], got {describe(t)}")
        arr = (t * 255).round().to(torch.uint8).numpy()
    else:
        raise TypeError(f"{name} must be uint8 or float in [0, 1], got {describe(t)}")
    return np.ascontiguousarray(arr)


def dense_crf(probs: np.ndarray, image: np.ndarray, params: Optional[Mapping[str, Any]] = None) -> np.ndarray:
    """Mean-field dense CRF over L labels.

    Shapes:
        probs: (L, H, W) probabilities (clipped at 1e-5 before -log, as pydensecrf's
            ``unary_from_softmax``).
        image: (H, W, 3) uint8 RGB.

    Returns:
        (L, H, W) float32 marginals Q.
    """
    try:
        import pydensecrf.densecrf as dcrf
        from pydensecrf.utils import unary_from_softmax
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "refine='crf' needs pydensecrf: pip install 'mars-plugin[crf]' (installs pydensecrf2), "
            "or use refine='threshold'"
        ) from e
    p = check_crf_params(params)
    L, H, W = probs.shape
    d = dcrf.DenseCRF2D(W, H, L)
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(np.asarray(probs, dtype=np.float32))))
    d.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
    d.addPairwiseBilateral(
        sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"], rgbim=np.ascontiguousarray(image),
        compat=p["bilateral_compat"],
    )
    q = d.inference(int(p["iterations"]))
    return np.asarray(q, dtype=np.float32).reshape(L, H, W)
