"""Checkpoints of ``mars train``: student, EMA teacher, optimizer, AMP scaler and iteration.

One file holds everything a resumed run needs to continue bit for bit, and everything
``mars predict`` needs to rebuild the network without the training command line:

    {"format": "mars-train/1",
     "model": {"arch": "deeplabv3+", "backbone": "resnet101", "output_stride": 16, "num_classes": 20},
                                        # (+ "msc_scales": [0.5, 0.75]: deeplab-pytorch's MSC around it)
     "iteration": 1000,                 # optimizer steps done
     "student": state_dict, "teacher": state_dict or None (--loss ce has none),
     "optimizer": state_dict, "scaler": state_dict,
     "rng": {"torch": uint8 tensor, "loader": uint8 tensor},   # where the data order stands
     "settings": {...},                 # the run's flags (JSON-able), for the record
     "data": "{...}",                   # JSON text: the data it was trained on (mars_plugin.commands.train_data)
     "class_names": [...] or None}

Everything in it is tensors, numbers, strings, lists and dicts, so it is written with
``torch.save`` and read back with ``torch.load(weights_only=True)``: no Python object is ever
unpickled. Files are written atomically (temporary file, then rename): a save that fails (a full
disk) leaves the previous checkpoint as it was, and says so in one line.
"""
from __future__ import annotations

import errno
import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn

from mars_plugin.formats.files import WriteError, atomic_write, save_torch
from mars_plugin.formats.bounded_load import ReadRefused, torch_load

__all__ = ["CHECKPOINT_FORMAT", "MODEL_KEYS", "save_checkpoint", "load_checkpoint", "model_from_checkpoint",
           "recipe_weights"]

CHECKPOINT_FORMAT = "mars-train/1"
#: The keys of ``checkpoint["model"]``, the arguments of :func:`mars_plugin.networks.deeplab.build_model`.
MODEL_KEYS = ("arch", "backbone", "output_stride", "num_classes")

PathLike = Union[str, os.PathLike]


def save_checkpoint(path: PathLike, checkpoint: Dict[str, Any]) -> None:
    """Write ``checkpoint`` (the layout of the module docstring) atomically."""
    missing = [k for k in ("model", "iteration", "student") if k not in checkpoint]
    if missing:
        raise ValueError(f"checkpoint: missing keys {missing}")
    had = os.path.isfile(path)
    try:
        atomic_write(path, lambda tmp: save_torch(dict(checkpoint, format=CHECKPOINT_FORMAT), tmp))
    except OSError as e:
        space = " once there is space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        err = WriteError(e.errno, e.strerror or " ".join(str(e).split()), os.fspath(path))
        err.what = "the checkpoint "
        err.after = ("nothing is lost: the checkpoint there, of the last save, is intact, and the run resumes from "
                     f"it when run again{space}") if had else \
            f"no checkpoint had been saved yet: the run starts over when run again{space}"
        raise err from None


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Read a ``mars train`` checkpoint with ``weights_only=True`` (tensors and plain containers
    only; nothing is unpickled), checking its format and model description."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (a checkpoint written by mars train)")
    try:
        ck = torch_load(path, map_location=map_location, what="a checkpoint's tensor")
    except ReadRefused:
        raise
    except Exception as e:  # corrupt, truncated, or pickled Python objects
        raise ValueError(f"{path}: not a readable mars train checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        got = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise ValueError(f"{path}: not a mars train checkpoint (format {got!r}, expected {CHECKPOINT_FORMAT!r}); "
                         "ImageNet backbone weights go to mars train --weights")
    model = ck.get("model")
    if not isinstance(model, dict) or any(k not in model for k in MODEL_KEYS):
        raise ValueError(f"{path}: checkpoint's 'model' must hold {list(MODEL_KEYS)}, got {model!r}")
    return ck


def recipe_weights(ck: Dict[str, Any]) -> str:
    """The weights a checkpoint's recipe predicts with: ``"teacher"`` where its ``predict_weights``
    is ``"ema"`` (``ck["settings"]``' value, else :func:`mars_plugin.networks.recipes.get_recipe`'s)
    and the checkpoint holds a teacher, else ``"student"`` (also for a checkpoint without
    ``ck["recipe"]``, written before recipes, and for a ``--loss ce`` run, which has no EMA)."""
    name = ck.get("recipe")
    if name is None:
        return "student"
    from mars_plugin.networks.recipes import get_recipe

    settings = ck.get("settings") if isinstance(ck.get("settings"), dict) else {}
    weights = settings.get("predict_weights", get_recipe(name).predict_weights)
    return "teacher" if weights == "ema" and ck.get("teacher") is not None else "student"


def model_from_checkpoint(
    path: PathLike, which: Optional[str] = "student", map_location: Union[str, torch.device] = "cpu"
) -> Tuple[nn.Module, Dict[str, Any]]:
    """The network of a checkpoint, in eval mode, and the checkpoint (without the weights, with
    ``"which"``: the weights loaded).

    Args:
        which: ``"student"`` (the trained network), ``"teacher"`` (its EMA; MARS runs only) or
            None: the checkpoint's recipe's (:func:`recipe_weights`).
    """
    from mars_plugin.networks.deeplab import build_model

    if which not in ("student", "teacher", None):
        raise ValueError(f"which must be 'student', 'teacher' or None, got {which!r}")
    ck = load_checkpoint(path, map_location=map_location)
    if which is None:
        try:
            which = recipe_weights(ck)
        except ValueError as e:  # a recipe this version does not know
            raise ValueError(f"{os.fspath(path)}: {e}") from None
    state: Optional[Dict[str, torch.Tensor]] = ck.get(which)
    if state is None:
        raise ValueError(f"{os.fspath(path)}: holds no {which} (a --loss ce run has no teacher)")
    model = build_model(**{k: ck["model"][k] for k in MODEL_KEYS})
    if ck["model"].get("msc_scales"):  # deeplab-pytorch's MSC around the network (its eval: max of the scales' logits)
        from mars_plugin.networks.deeplabv2 import MSC

        model = MSC(model, tuple(float(v) for v in ck["model"]["msc_scales"]))
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as e:
        from mars_plugin.networks.weight_files import state_mismatch

        # a few keys and a count (torch's message lists every key: kilobytes on one line)
        parts = state_mismatch(state, model.state_dict(), required=list(model.state_dict())) \
            if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()) else []
        why = "; ".join(parts) or " ".join(str(e).split())[:300]
        raise ValueError(f"{os.fspath(path)}: the {which} weights do not fit {ck['model']}: {why}") from None
    model.eval()
    meta = {k: v for k, v in ck.items() if k not in ("student", "teacher", "optimizer", "scaler", "rng")}
    meta["which"] = which
    return model, meta
