"""argparse ``type=`` functions of the ``mars`` flags: every numeric flag is parsed and bounded here.

A value out of range stops the command before any work with one line naming the flag, the
value and the range (argparse prefixes ``argument --flag:``; exit status 2). Each type of
:func:`int_in` / :func:`real_in` also carries ``bounds`` (low, high) and ``check(value, name)``:
the same bounds for a Python value, which the settings records call on their fields
(:func:`check_fields`), so that a record made in Python refuses what the flag refuses. The bounds are
the ones the Python functions check (:mod:`mars_plugin._checks`, :mod:`mars_plugin.commands.inputs`,
:func:`mars_plugin.commands.demo.run_demo`, :mod:`mars_plugin.adapters.uss.multiscale`), so that the
command line and the library refuse the same values.
"""
from __future__ import annotations

import argparse
import functools
import math
import numbers
from typing import Any, Callable, Mapping, Tuple, Union

import numpy as np

from mars_plugin._checks import (
    check_int_param,
    check_real_param,
    BIASED_PNG_VALUE,
    IGNORE_PNG_VALUE,
    MAX_BATCH_SIZE,
    MAX_EXAMPLES,
    MAX_K,
    MAX_NUM_CLASSES,
    MAX_PER_CLASS,
    MAX_RES,
    MAX_STRIDE,
    MIN_RES,
    MAX_SEED,
    MAX_THREADS,
    MAX_WORKERS,
    RESERVED_REASON,
)

__all__ = [
    "int_in",
    "real_in",
    "check_fields",
    "check_max_bytes",
    "num_classes",
    "alpha",
    "k_clusters",
    "seed",
    "batch_size",
    "workers",
    "threads",
    "threshold",
    "spill_mb",
    "num_examples",
    "per_class",
    "ignore_index",
    "res",
    "stride",
    "iterations",
    "epochs",
    "iter_size",
    "output_stride",
    "crop",
    "image_side",
    "lr",
    "momentum",
    "weight_decay",
    "ema",
    "every",
    "loader_workers",
    "add_io_workers_argument",
    "demo_images",
    "demo_size",
    "demo_epochs",
    "seg_scales",
    "class_threshold",
    "max_memory",
    "MAX_RES",
    "MIN_RES",
    "MAX_STRIDE",
]



def int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high``."""
    reason = f" ({why})" if why else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {value}{reason}")
        return value

    parse.__name__ = f"integer in {low}..{high}"
    # the same bounds for a Python value (a record's field): one declaration for both doors
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.check = lambda value, name: check_int_param(value, name, low, high, why)  # type: ignore[attr-defined]
    return parse


def real_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False,
            why: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number in the interval from ``low`` to ``high``
    (``math.inf``: no upper bound)."""
    hi_text = "inf" if high == math.inf else f"{high:g}"
    interval = f"{'(' if low_open else '['}{low:g}, {hi_text}{')' if high_open or high == math.inf else ']'}"
    reason = f" ({why})" if why else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and \
            (value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, got {text.strip()}{reason}")
        return value

    parse.__name__ = f"number in {interval}"
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.check = lambda value, name: check_real_param(  # type: ignore[attr-defined]
        value, name, low, high, low_open=low_open, high_open=high_open)
    return parse


num_classes = int_in(1, MAX_NUM_CLASSES, RESERVED_REASON)
alpha = real_in(0.0, 1.0, low_open=True)
k_clusters = int_in(1, MAX_K, "the paper uses 2; beyond an image's pixels K gives one centroid per pixel")
seed = int_in(0, MAX_SEED, "numpy's seed range; larger seeds would repeat smaller ones")
batch_size = int_in(1, MAX_BATCH_SIZE)
workers = int_in(1, MAX_WORKERS)
threads = int_in(1, MAX_THREADS)
threshold = real_in(0.0, 1.0, high_open=True, why="a threshold of 1 or more keeps no pixel")
spill_mb = real_in(0.0, math.inf, why="0 spills every batch")
num_examples = int_in(0, MAX_EXAMPLES, "rows of the most-changed grid")
per_class = int_in(0, MAX_PER_CLASS, "rows per class of the per-class grid")
stride = int_in(1, MAX_STRIDE)
#: mars train
iterations = int_in(1, 10_000_000)
epochs = int_in(1, 100_000)
iter_size = int_in(1, 1024, "batches accumulated into one step")
output_stride = int_in(8, 16, "8 or 16")
crop = int_in(8, 4096, "a side in pixels")
image_side = int_in(8, 8192, "the longer side after the random resize")
lr = real_in(0.0, 10.0, low_open=True)
momentum = real_in(0.0, 1.0, high_open=True)
weight_decay = real_in(0.0, 1.0)
ema = real_in(0.0, 1.0, high_open=True,
              why="the teacher's EMA momentum: 1 keeps it at its random initialisation; the paper's is 0.999")
every = int_in(1, 10_000_000)
loader_workers = int_in(0, MAX_WORKERS)
class_threshold = real_in(0.0, 1.0)
max_memory = real_in(0.0, 2.0 ** 20, low_open=True, why="the memory budget in GiB")


_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


@functools.lru_cache(maxsize=None)
def _flag_actions(add_arguments: Callable[[Any], None]) -> Tuple[argparse.Action, ...]:
    """The actions that ``add_arguments`` declares (a parser built once per command)."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return tuple(a for a in p._actions if a.option_strings)


def check_fields(record: Any, add_arguments: Callable[[Any], None], keywords: Mapping[str, str],
                 wider: Tuple[str, ...] = ()) -> None:
    """Check, where it is made, each field of a frozen settings ``record`` that one of the
    command's flags sets (``add_arguments``: the command's flags; ``keywords``: flag dest ->
    field where the names differ), with that flag's declaration: the bounds of an
    :func:`int_in` / :func:`real_in` type (normalised to int / float), the choices, a switch's
    bool; ``max_bytes`` (``--max-memory GIB``) in bytes. A None field is the record's to resolve
    ("not given"). The one door of "checking a setting": Python callers meet the flag's
    bounds, and a new flag is checked in Python without a line more. Raises ``TypeError`` /
    ``ValueError`` naming the field (``iter_size must be an integer in 1..1024, got ...``).
    ``wider``: the fields whose Python values the record takes beyond the flag's choices (each
    documented there; e.g. predict's ``crf``: every CRF preset a recipe may name), left to it."""
    for a in _flag_actions(add_arguments):
        name = keywords.get(a.dest, a.dest)
        value = getattr(record, name, None)
        if value is None or (name != a.dest and name != "max_bytes" and not isinstance(a, _SWITCHES)) or \
                list(keywords.values()).count(name) > 1:
            continue  # one field made of several flags (--wsss, --dataset -> fmt), or of another kind
        if name == "max_bytes":
            value = check_max_bytes(value, name, auto=_default(record, name) == "auto")
        elif hasattr(a.type, "check"):
            value = a.type.check(value, name)
        elif isinstance(a, _SWITCHES) and (name == a.dest or isinstance(_default(record, name), bool)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}"[:200])
            value = bool(value)
        if a.choices is not None and name not in wider and (isinstance(value, bool) or not _among(value, a.choices)):
            raise ValueError(f"{name} must be one of {', '.join(map(repr, a.choices))}, got {value!r}"[:300])
        object.__setattr__(record, name, value)


def _among(value: Any, choices: Any) -> bool:
    try:
        return value in choices
    except TypeError:  # an unhashable value among hashed choices
        return False


def _default(record: Any, name: str) -> Any:
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(record)}.get(name)


def check_max_bytes(value: Any, name: str = "max_bytes", *, auto: bool = False) -> Union[int, str]:
    """A memory budget in bytes: a number in (0, 2**50] (``--max-memory``'s (0, 2**20] GiB),
    or ``"auto"`` where the command has it; None (no limit) is the caller's."""
    if auto and value == "auto":
        return "auto"
    hi = int(max_memory.bounds[1] * 2 ** 30)  # type: ignore[attr-defined]
    expected = f"a number of bytes in (0, {hi}]" + (", 'auto'" if auto else "") + " or None (no limit)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}"[:200])
    if not (math.isfinite(value) and 0 < value <= hi):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return int(value)


def seg_scales(text: str) -> Tuple[float, ...]:
    """--scales of ``mars predict``: comma-separated positive numbers, e.g. 1,0.5,1.5,2 (order
    kept; the bounds of :func:`mars_plugin.adapters.uss.multiscale.check_scales`)."""
    from mars_plugin._checks import check_scales

    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,0.5,1.5,2, "
                                         f"got {text!r}") from None
    try:
        return check_scales(values)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def ignore_index(text: str) -> int:
    """--ignore-index: a label byte 0..255 other than 254, the biased byte of debiased labels
    (whether it collides with a class id 0..C is checked by the job, which knows C)."""
    value = int_in(0, IGNORE_PNG_VALUE, "label files hold bytes")(text)
    if value == BIASED_PNG_VALUE:
        raise argparse.ArgumentTypeError(f"expected a byte 0..255 other than {BIASED_PNG_VALUE}, got {value} "
                                         f"({BIASED_PNG_VALUE} marks biased pixels in debiased labels)")
    return value


def res(text: str) -> Union[int, str]:
    """--res: 'native' (the image's own resolution) or an integer side in 8..2048."""
    if text.strip().lower() == "native":
        return "native"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'native' or an integer in {MIN_RES}..{MAX_RES}, "
                                         f"got {text!r}") from None
    if not MIN_RES <= value <= MAX_RES:
        raise argparse.ArgumentTypeError(f"expected 'native' or an integer in {MIN_RES}..{MAX_RES}, got {value} "
                                         f"(at least the ViT patch, 8 or more)")
    return value


def _demo_limits():
    from mars_plugin.commands.demo_settings import MAX_DEMO_EPOCHS, MAX_DEMO_IMAGES, MAX_DEMO_SIZE, MIN_DEMO_SIZE

    return MAX_DEMO_IMAGES, MIN_DEMO_SIZE, MAX_DEMO_SIZE, MAX_DEMO_EPOCHS


def demo_images(text: str) -> int:
    """--num-train/--num-val of ``mars demo``."""
    return int_in(1, _demo_limits()[0], "a demo of minutes on a CPU")(text)


def demo_size(text: str) -> int:
    """--size of ``mars demo``: a side that the world's 4-pixel feature cells divide."""
    _, lo, hi, _ = _demo_limits()
    value = int_in(lo, hi)(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"expected a multiple of 4 in {lo}..{hi} (the features are 4x4-pixel "
                                         f"cells), got {value}")
    return value


def demo_epochs(text: str) -> int:
    """--epochs of ``mars demo``."""
    return int_in(1, _demo_limits()[3])(text)


def add_io_workers_argument(p: Any) -> None:
    """``--io-workers N`` of an argparse parser (one flag, one wording for every command that
    has it: :mod:`mars_plugin.runs.io_pipeline`)."""
    from mars_plugin.runs.io_pipeline import IO_WORKERS_HELP

    p.add_argument("--io-workers", type=loader_workers, default=None, metavar="N",
                   help=IO_WORKERS_HELP + "%(default).0s")
