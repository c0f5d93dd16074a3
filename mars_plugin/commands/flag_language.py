"""Errors in the command line's language: a message of the library (which names Python
parameters: ``io_workers=2``, ``min_size must be``, ``crf_params['bilateral_srgb']``,
``flip=False``) rewritten with the flags of the command that ran (``--io-workers 2``,
``--min-size must be``, ``--crf-params "bilateral_srgb"``, ``--no-flip``).

The spellings come from the command's own flags (its parser, and its ``FLAG_KEYWORDS``: dest ->
keyword where they differ), so a new flag is spoken of by its name without a list to keep; the
parameters of the core functions whose flag has another name (``images_dir`` -> ``--images``,
``flip_average`` -> ``--flip``) are listed here. :func:`mars_plugin.cli.main` passes every
``ValueError``/``TypeError`` message of a command through :func:`in_flags`."""
from __future__ import annotations

import argparse
import functools
import re
from typing import Dict, Optional, Tuple

__all__ = ["in_flags", "spellings"]

# Python parameter names that core checks and the jobs put in their messages, and the flags that
# set them (a parameter whose flag has another name, e.g. images_dir, maps to that flag).
_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "crf_params", "crf_backend", "batch_size", "num_classes", "k_fg", "k_bg", "spill_mb", "spill_dir",
    "image_labels", "ignore_index", "num_examples", "class_names", "on_error", "per_class", "num_train",
    "num_val", "trust_pickle", "loss_grid", "min_size", "max_size", "iter_size", "output_stride", "lr_step",
    "weight_decay", "crf_image")}
_FLAGS.update(images_dir="--images", features_dir="--features", labels_dir="--labels", out_dir="--out",
              pred_dir="--pred", gt_dir="--gt", debiased_dir="--debiased", pseudo_dir="--pseudo",
              file_format="--format", flip_average="--flip")
# One-word parameters are also English words ("the heads file"): written as flags only where the
# sentence is about the parameter ("workers must be >= 1", "refine='crf'").
_WORD_FLAGS = ("workers", "device", "alpha", "threshold", "refine", "seed", "size", "epochs", "stride", "res",
               "scales", "uss", "backend", "iterations", "data", "domain", "momentum", "optimizer")
_EDGE = r"(?<![\w/\\.-])"  # not inside a path or a longer name
_END = r"(?![\w/\\-]|\.\w)"
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


@functools.lru_cache(maxsize=None)
def spellings(command: Optional[str] = None) -> Tuple[Dict[str, str], Dict[str, Tuple[str, str]]]:
    """(parameter -> flag, switch parameter -> (its spelling when True, when False)) of
    ``command`` (None: the core parameters only)."""
    names = dict(_FLAGS, **{w: "--" + w for w in _WORD_FLAGS})
    switches: Dict[str, Tuple[str, str]] = {}
    if command is None:
        return names, switches
    from mars_plugin.commands.command_table import flags_module

    module = flags_module(command)
    renames = getattr(module, "FLAG_KEYWORDS", {})
    p = argparse.ArgumentParser(add_help=False)
    module.add_arguments(p)
    for a in p._actions:
        flag = next((o for o in a.option_strings if o.startswith("--")), None)
        if flag is None:
            continue
        keyword = renames.get(a.dest, a.dest)
        if list(renames.values()).count(keyword) > 1:
            keyword = a.dest  # one keyword of several flags (fmt of --wsss, --dataset): not this flag's
        for name in dict.fromkeys((a.dest, keyword)):
            names.setdefault(name, flag)
            if isinstance(a, argparse.BooleanOptionalAction):
                switches[name] = (flag, "--no-" + flag[2:])
            elif isinstance(a, _SWITCHES):  # --no-progress sets progress=False; --fp16 sets fp16=True
                on = name == a.dest
                switches[name] = (flag, f"without {flag}") if on else (f"without {flag}", flag)
    return names, switches


def in_flags(msg: str, command: Optional[str] = None) -> str:
    """A core error message with its parameter names written as ``command``'s flags:
    ``name='value'`` and ``name=value`` as ``--name value``, ``flip=False`` as ``--no-flip``,
    ``crf_params['key']`` as ``--crf-params "key"``, ``batch_size`` as ``--batch-size``
    (``images_dir`` as ``--images``), and ``workers must`` as ``--workers must``. Paths and
    double-quoted JSON text are left as they are."""
    every, switches = spellings(command)
    names = "|".join(sorted(every, key=len, reverse=True))
    multi = "|".join(sorted((n for n in every if "_" in n), key=len, reverse=True))
    words = "|".join(sorted((n for n in every if "_" not in n), key=len, reverse=True))

    def switch(m: "re.Match[str]") -> str:
        pair = switches.get(m.group(1))
        if pair is None:
            return f"{every[m.group(1)]} {m.group(2)}"
        return pair[0] if m.group(2) == "True" else pair[1]

    def rewrite(part: str) -> str:
        part = re.sub(_EDGE + r"(" + names + r")=(True|False)\b", switch, part)
        part = re.sub(_EDGE + r"(" + names + r")=(['\"]?)([^'\"\s,;)]*)\2",
                      lambda m: f"{every[m.group(1)]} {m.group(3)}", part)
        part = re.sub(_EDGE + r"(" + names + r")\[(['\"])(\w+)\2\]", lambda m: f'{every[m.group(1)]} "{m.group(3)}"',
                      part)
        part = re.sub(_EDGE + r"(" + multi + r")" + _END, lambda m: every[m.group(1)], part)
        return re.sub(_EDGE + r"(" + words + r")(?= must\b| is not\b| has\b)", lambda m: every[m.group(1)], part)

    # the text between double quotes is JSON the user writes (keys such as "class_names"): kept,
    # unless it is a key of a parameter's mapping (crf_params["bilateral_srgb"])
    msg = re.sub(_EDGE + r"(" + names + r")\[\"(\w+)\"\]", lambda m: f"{m.group(1)}['{m.group(2)}']", msg)
    pieces = re.split(r'("[^"]*")', msg)
    return "".join(p if p.startswith('"') and p.endswith('"') and len(p) > 1 else rewrite(p) for p in pieces)
