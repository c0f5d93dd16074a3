"""The dense CRF's parameters: the presets (``mars``, ``psa``), the backends, and the checks a
parameter set passes before any work (values, the standard deviations' bound for an image
size, the backend); the limits they are checked against (:data:`MAX_ITERATIONS`,
:data:`MAX_COMPAT`) and the default memory budget :data:`DEFAULT_MAX_BYTES`.

Used by :func:`mars_plugin.engines.crf.dense_crf` and by every caller that checks
``crf_params`` first (the method, the commands, the adapters).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Mapping, Tuple, Union

import numpy as np

from mars_plugin._checks import describe
from mars_plugin.engines.permutohedral import MAX_COORDINATE, lifted_bounds

__all__ = [
    "CRF_PRESETS",
    "CRF_PRESET_NAMES",
    "DEFAULT_CRF_PRESET",
    "DEFAULT_CRF_PARAMS",
    "CRF_BACKENDS",
    "PROB_CLIP",
    "MAX_ITERATIONS",
    "MAX_COMPAT",
    "DEFAULT_MAX_BYTES",
    "check_crf_params",
    "check_crf_std_bounds",
    "check_crf_backend",
]


#: Named parameter sets. ``"mars"`` (the default) is the setting of the MARS authors' own code:
#: RS+EPM ``convert_seed_to_pseudo_masks.py`` ``crf_dict['deeplab']``, DHR
#: ``core/refinements/densecrf.py`` ``DenseCRF.__init__`` defaults, and STEGO ``src/crf.py``
#: (``MAX_ITER``, ``POS_*``, ``Bi_*``) -- DeepLab's CRF, hence its alias ``"deeplab"``.
#: ``"psa"`` (alias ``"seam"``) is the probability-input ``crf_inference`` of PSA and SEAM
#: (``tool/imutils.py``). ``"seam-seg"`` is the test-time CRF of SEAM's segmentation codebase
#: (YudeWang/semantic-segmentation-codebase ``lib/utils/DenseCRF.py:20-22``, one iteration as
#: ``experiment/seamv1-pseudovoc/test.py:94`` calls it). deeplab-pytorch's ``configs/voc12.yaml``
#: CRF is ``"mars"``.
CRF_PRESETS: Dict[str, Dict[str, float]] = {
    "mars": {
        "iterations": 10,
        "gaussian_sxy": 1,
        "gaussian_compat": 3,
        "bilateral_sxy": 67,
        "bilateral_srgb": 3,
        "bilateral_compat": 4,
    },
    "psa": {
        "iterations": 10,
        "gaussian_sxy": 3,
        "gaussian_compat": 3,
        "bilateral_sxy": 80,
        "bilateral_srgb": 13,
        "bilateral_compat": 10,
    },
    "seam-seg": {
        "iterations": 1,
        "gaussian_sxy": 3,
        "gaussian_compat": 3,
        "bilateral_sxy": 32,
        "bilateral_srgb": 13,
        "bilateral_compat": 10,
    },
    # IRNet's and AdvCAM's crf_inference_label (misc/imutils.py:156-170 of both): Gaussian sxy 3
    # compat 3, bilateral sxy 50 srgb 5 compat 10, t=10 (its gt_prob 0.7 belongs to the unary:
    # mars_plugin.adapters.wsss.irnet.CRF_PARAMS).
    "irnet": {
        "iterations": 10,
        "gaussian_sxy": 3,
        "gaussian_compat": 3,
        "bilateral_sxy": 50,
        "bilateral_srgb": 5,
        "bilateral_compat": 10,
    },
}
#: Each codebase's own CRF by its name: AdvCAM's is IRNet's; deeplab-pytorch's
#: ``configs/voc12.yaml``, RS+EPM's ``convert_seed_to_pseudo_masks.py:77-84`` and DHR's
#: ``core/refinements/densecrf.py`` defaults are DeepLab's (``mars``); SEAM's is PSA's.
_ALIASES = {"deeplab": "mars", "seam": "psa", "advcam": "irnet", "deeplab-pytorch": "mars", "rsepm": "mars",
            "dhr": "mars"}
#: Every name ``crf_params`` takes as a preset (the presets and their aliases).
CRF_PRESET_NAMES: Tuple[str, ...] = tuple(sorted(set(CRF_PRESETS) | set(_ALIASES)))
DEFAULT_CRF_PRESET = "mars"
#: The default parameters (a copy of ``CRF_PRESETS["mars"]``); a dict given as ``crf_params``
#: overrides these keys.
DEFAULT_CRF_PARAMS: Dict[str, float] = dict(CRF_PRESETS[DEFAULT_CRF_PRESET])
CRF_BACKENDS = ("torch", "pydensecrf")
#: pydensecrf's ``unary_from_softmax`` clip.
PROB_CLIP = 1e-5
#: The most mean-field iterations ``crf_params`` may ask for. MARS, its WSSS sources and
#: DeepLab run 10 (pydensecrf's examples 5); the update has long converged by 100, and 10^6
#: would run for hours.
MAX_ITERATIONS = 100
#: The largest Potts weight (``gaussian_compat``, ``bilateral_compat``): a normalised message
#: is at most sqrt(N), so the float32 energies stay finite for any image below it.
MAX_COMPAT = 1e30
#: The default ``max_bytes``: the most memory one lattice's work may take (6 GiB: with the
#: inputs and torch itself, a process within 8 GB). The images of a batch are grouped within
#: it; an image that needs more alone is refused before any work (see
#: :func:`~mars_plugin.engines.crf_memory.crf_memory_bytes`).
DEFAULT_MAX_BYTES = 6 << 30
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_STD_KEYS = ("gaussian_sxy", "bilateral_sxy", "bilateral_srgb")


def check_crf_params(params: Union[None, str, Mapping[str, Any]], defaults: Mapping[str, float] = DEFAULT_CRF_PARAMS,
                     integers: Tuple[str, ...] = ("iterations",)) -> Dict[str, float]:
    """CRF parameters from a preset name (``"mars"``/``"deeplab"``, ``"psa"``/``"seam"``), a
    dict of overrides of ``defaults``, or None (``defaults``).

    Every value must be a real number (not a bool or a string), positive and finite in float32
    (pydensecrf takes them as C floats); the ``integers`` keys must be integers, ``iterations``
    at most :data:`MAX_ITERATIONS`, the ``*_compat`` weights at most :data:`MAX_COMPAT`.
    Unknown names and keys are errors. The standard deviations' lower bound depends on the
    image size and is checked with the image (:func:`check_crf_std_bounds`)."""
    if isinstance(params, str):
        name = _ALIASES.get(params, params)
        if name not in CRF_PRESETS:
            raise ValueError(f"crf_params {params!r} is not a preset; expected one of "
                             f"{sorted(set(CRF_PRESETS) | set(_ALIASES))} or a dict")
        out = dict(defaults)
        out.update(CRF_PRESETS[name])
        return out
    out = dict(defaults)
    if params is None:
        return out
    if not isinstance(params, Mapping):
        raise TypeError(f"crf_params must be a preset name or a dict, got {describe(params)}")
    for key, value in params.items():
        if key not in out:
            raise ValueError(f"crf_params has the unknown key {key!r}; expected some of {sorted(out)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not value > 0:
            raise ValueError(f"crf_params[{key!r}] must be a positive number, got {value!r}")
        if value > _FLOAT32_MAX or float(np.float32(value)) == 0.0:
            raise ValueError(f"crf_params[{key!r}] must be a positive number that float32 holds "
                             f"({np.finfo(np.float32).tiny:.3g} to {_FLOAT32_MAX:.3g}), got {value!r}")
        if key in integers and int(value) != value:
            raise ValueError(f"crf_params[{key!r}] must be an integer, got {value!r}")
        if key == "iterations" and value > MAX_ITERATIONS:
            raise ValueError(f"crf_params['iterations'] must be at most {MAX_ITERATIONS} (mean field has long "
                             f"converged; MARS runs 10), got {value!r}")
        if key.endswith("_compat") and value > MAX_COMPAT:
            raise ValueError(f"crf_params[{key!r}] must be at most {MAX_COMPAT:g} (larger weights overflow the "
                             f"float32 energies), got {value!r}")
        out[key] = value
    return out


def _round_up(x: float) -> float:
    """x rounded up to three significant digits (a bound that is still a bound when printed)."""
    y = float(f"{x:.3g}")
    return y if y >= x else float(f"{x * (1 + 5e-3):.3g}")


def check_crf_std_bounds(params: Mapping[str, float], height: int, width: int, name: str = "crf_params") -> None:
    """Refuse standard deviations so small that, on a ``height`` x ``width`` image, x / sxy,
    y / sxy or rgb / srgb lift to lattice coordinates beyond
    :data:`mars_plugin.engines.permutohedral.MAX_COORDINATE` (the lattice works in float32, as
    pydensecrf): the message names the key (as ``name[key]``: ``--crf-params`` on the command
    line), its value and the smallest value that works for this image size (the other standard
    deviations as they are)."""
    limit = MAX_COORDINATE / (1 + 1e-5)  # below the lattice's own check, whatever float32 rounding does
    pos = [float(width - 1), float(height - 1)]

    def smallest(alpha: List[float], beta: List[float]) -> float:
        # the lifted bound is max_j alpha_j / s + beta_j: the smallest s with it <= limit
        need = 0.0
        for a, b in zip(alpha, beta):
            if a > 0:
                need = max(need, a / (limit - b) if b < limit else math.inf)
        return need

    def fail(key: str, need: float, what: str, other: str = "") -> None:
        value = params[key]
        hint = (f"the smallest that works for this image size{other} is {_round_up(need)}" if math.isfinite(need)
                else f"no value works for this image size{other}")
        # A flag's key as the command line writes it everywhere (``--crf-params "key"``); a Python
        # parameter's as Python does (``crf_params['key']``).
        where = f'{name} "{key}"' if name.startswith("--") else f"{name}[{key!r}]"
        raise ValueError(f"{where} = {value!r} is too small for a {height}x{width} image: {what} would "
                         f"overflow the lattice's float32 coordinates (at most {MAX_COORDINATE:.4g}); {hint}")

    g = float(np.float32(params["gaussian_sxy"]))
    need = smallest(lifted_bounds(pos), [0.0] * 3)
    if g < need:
        fail("gaussian_sxy", need, "x / sxy and y / sxy")
    sxy, srgb = float(np.float32(params["bilateral_sxy"])), float(np.float32(params["bilateral_srgb"]))
    alpha = lifted_bounds(pos + [0.0] * 3)
    beta = lifted_bounds([0.0, 0.0] + [255.0] * 3)
    if max(a / sxy + b / srgb for a, b in zip(alpha, beta)) <= limit:
        return
    need_sxy = smallest(alpha, [b / srgb for b in beta])
    need_srgb = smallest(beta, [a / sxy for a in alpha])
    position_part, colour_part = max(alpha) / sxy, max(beta) / srgb
    if colour_part >= position_part:
        fail("bilateral_srgb", need_srgb, "rgb / srgb", f" with bilateral_sxy = {params['bilateral_sxy']!r}")
    fail("bilateral_sxy", need_sxy, "x / sxy and y / sxy", f" with bilateral_srgb = {params['bilateral_srgb']!r}")


def check_crf_backend(backend: Any) -> str:
    if backend not in CRF_BACKENDS:
        raise ValueError(f"crf_backend must be one of {CRF_BACKENDS}, got {backend!r}")
    return backend
