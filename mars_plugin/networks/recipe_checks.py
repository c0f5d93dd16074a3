"""The checks of each :class:`~mars_plugin.networks.recipes.Recipe` field (type, range,
choice), one table: :data:`CHOICES` for the string fields, :func:`check_field` for every field.
An error names the field, what it got and what was expected."""
from __future__ import annotations

import math
import re
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

from mars_plugin._checks import check_int_param, check_real_param, describe
from mars_plugin.engines.crf_params import CRF_PRESETS

__all__ = ["CHOICES", "META_FIELDS", "check_field", "check_bool"]

#: The choices of each string field.
CHOICES: Dict[str, Tuple[str, ...]] = {
    "arch": ("deeplabv3+dhr", "deeplabv3+", "deeplabv2", "deeplabv1-wr38"),
    "backbone": ("resnet50", "resnet101", "wr38"),
    "weights_format": ("torchvision", "deeplab-pytorch", "wr38"),
    "normalization": ("imagenet-rgb", "caffe-bgr"),
    "augmentation": ("dhr", "deeplab-pytorch", "seam"),
    "optimizer": ("sgd",),
    "bn": ("train", "frozen"),
    "bn_head": ("train", "frozen", "none"),
    "bn_affine": ("trained", "fixed"),
    "loss_grid": ("logits", "input"),
    "predict_weights": ("ema", "student"),
    "test_fusion": ("mean-softmax", "max-logits", "mean-logits"),
    "crf_image": ("denormalized", "file", "mean-subtracted"),
}
#: Fields that say where a recipe comes from: never overridden.
META_FIELDS = ("name", "rows", "upstream", "sources")
_UPSTREAM = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{7,40}$")
#: "path:line" or "path:first-last", several joined by " + " (the first is the main one)
_SOURCE = re.compile(r"^[\w./-]+:\d+(-\d+)?( \+ [\w./-]+:\d+(-\d+)?)*$")

def _real_tuple(value: Any, name: str, n: Optional[int], low: float, high: float, low_open: bool) -> Tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or (n is not None and len(value) != n):
        size = f"{n} numbers" if n is not None else "numbers"
        raise TypeError(f"{name} must be a tuple of {size}, got {describe(value)}")
    return tuple(check_real_param(v, f"{name}[{i}]", low, high, low_open=low_open) for i, v in enumerate(value))


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {describe(value)}")
    return value


def _optional(check: Any) -> Any:
    return lambda v, name: None if v is None else check(v, name)


def _pairs(value: Any, name: str) -> Tuple[Tuple[str, Any], ...]:
    if isinstance(value, Mapping):
        value = tuple(value.items())
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in value):
        raise TypeError(f"{name} must be a tuple of (name, value) pairs, got {describe(value)}")
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in value)


def _sources(value: Any, name: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(f"{name} must map field names to 'path:line' strings, got {describe(value)}")
    for k, v in value.items():
        if v != "override" and not _SOURCE.match(v):
            raise ValueError(f"{name}[{k!r}] must be 'path:line' or 'path:first-last' (several joined by "
                             f"' + ') or 'override', got {v!r}")
    return MappingProxyType(dict(value))


def _crf(value: Any, name: str) -> str:
    value = _str(value, name)
    if value != "none" and value not in CRF_PRESETS:
        raise ValueError(f"{name} must be 'none' or a CRF preset {sorted(CRF_PRESETS)}, got {value!r}")
    return value


def _upstream(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _UPSTREAM.match(value):
        raise ValueError(f"{name} must be 'owner/repo@commit', got {describe(value)}")
    return value


_POS = dict(low=0.0, high=math.inf, low_open=True)
_CHECKS: Dict[str, Any] = {
    "name": _str,
    "rows": lambda v, n: tuple(_str(r, f"{n}[{i}]") for i, r in enumerate(_seq(v, n))),
    "upstream": _upstream,
    "output_stride": lambda v, n: _choice(check_int_param(v, n, 1), n, (8, 16)),
    "init_weights": _str,
    "crop": lambda v, n: check_int_param(v, n, 1),
    "augmentation_params": _pairs,
    "lr": lambda v, n: check_real_param(v, n, **_POS),
    "momentum": lambda v, n: check_real_param(v, n, 0.0, 1.0, high_open=True),
    "nesterov": check_bool,
    "weight_decay": lambda v, n: check_real_param(v, n, 0.0, math.inf),
    "lr_mults": lambda v, n: _real_tuple(v, n, 4, 0.0, math.inf, True),
    "decay": lambda v, n: tuple(check_bool(b, f"{n}[{i}]") for i, b in enumerate(_seq(v, n, 4))),
    "bn_momentum": lambda v, n: check_real_param(v, n, 0.0, 1.0, low_open=True),
    "batch_size": lambda v, n: check_int_param(v, n, 1),
    "iter_size": lambda v, n: check_int_param(v, n, 1),
    "epochs": _optional(lambda v, n: check_int_param(v, n, 1)),
    "iterations": _optional(lambda v, n: check_int_param(v, n, 1)),
    "drop_last": check_bool,
    "poly_power": lambda v, n: check_real_param(v, n, 0.0, math.inf),
    "lr_step": lambda v, n: check_int_param(v, n, 1),
    "msc_scales": lambda v, n: _real_tuple(v, n, None, 0.0, 8.0, True),
    "test_scales": lambda v, n: _nonempty(_real_tuple(v, n, None, 0.0, 8.0, True), n),
    "test_flip": check_bool,
    "crf": _crf,
    "class_threshold": _optional(lambda v, n: check_real_param(v, n, 0.0, 1.0, high_open=True)),
    "sources": _sources,
    "bn_batch": _optional(lambda v, n: check_int_param(v, n, 1)),
    "poly_max_offset": lambda v, n: check_int_param(v, n, 0),
    "ema_decay": _optional(lambda v, n: check_real_param(v, n, 0.0, 1.0, low_open=True, high_open=True)),
}


def _seq(value: Any, name: str, n: Optional[int] = None) -> Tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or (n is not None and len(value) != n):
        raise TypeError(f"{name} must be a tuple{f' of {n}' if n else ''}, got {describe(value)}")
    return tuple(value)


def _nonempty(value: Tuple[Any, ...], name: str) -> Tuple[Any, ...]:
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _choice(value: Any, name: str, choices: Tuple[Any, ...]) -> Any:
    if value not in choices or isinstance(value, bool):
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_field(field: str, value: Any) -> Any:
    """``value`` checked (and normalised: lists to tuples, ints to floats) for ``field``."""
    if field in CHOICES:
        if not isinstance(value, str):
            raise TypeError(f"{field} must be one of {list(CHOICES[field])}, got {describe(value)}")
        return _choice(value, field, CHOICES[field])
    return _CHECKS[field](value, field)


