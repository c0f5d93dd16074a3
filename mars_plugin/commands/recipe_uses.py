"""Which ``mars train`` setting each recipe uses: one table (:data:`UNUSED`), one check
(:func:`check_used`) that every settings record of a training run goes through once it is
resolved against its recipe (:class:`~mars_plugin.commands.train_settings.TrainSettings`, which
``mars train``, ``mars reproduce --train`` and the Python API all build).

A recipe field given (an *override*) that the run would not read is refused with one line
naming it, the recipe and what the run does instead: ``loss_grid`` given to the
``deeplab-pytorch`` recipe used to be recorded as an override and to train bit-identically.
The table says *when* a field changes nothing; every other (recipe, field) is used. Each row is
read off the code that consumes the field (:mod:`mars_plugin.commands.train`):

* ``min_size`` / ``max_size``: DHR's RandomResize (:class:`~mars_plugin.networks.seg_data.Augmentation`);
  deeplab-pytorch's and SEAM's augmentations scale by their own factors
  (``augmentation_params``) and never read them.
* ``loss_grid``: the labels meet the logits on the logits' grid or the crop's
  (:mod:`mars_plugin.commands.train_dhr`). deeplab-pytorch's MSC loss takes every output's loss
  on that output's own grid (``main.py:228-236``) and ignores it; a network whose logits are at
  the crop's size already (``deeplabv3+``, SEAM's ``deeplabv1-wr38``) has one grid, so both
  choices train the same.
* ``momentum``: SGD's; AdamW (``optimizer="adamw"``) has none (its betas are fixed).
* ``lr_mults[1]`` / ``decay[1]`` (the backbone biases' group): empty where the backbone has no
  bias (deeplab-pytorch's groups, ``main.py:166-177``, and WR38's convolutions,
  :func:`~mars_plugin.networks.deeplabv1.seam_param_groups`): a value other than the recipe's there
  changes nothing.

``tests/test_recipe_fields.py`` checks the table against the code for every (recipe, field): an
override is refused here exactly where it leaves the run unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

__all__ = ["Unused", "UNUSED", "unused_reason", "check_used"]

#: the networks whose logits are at the input's size (one loss grid)
_FULL_SIZE_LOGITS = ("deeplabv3+", "deeplabv1-wr38")


@dataclass(frozen=True)
class Unused:
    """A field (``index``: one entry of a per-group tuple) that a run of settings ``s`` does not
    use where ``when(s)``; ``why`` (formatted with ``s``) says what the run does instead."""

    field: str
    when: Callable[[Any], bool]
    why: str
    index: Optional[int] = None


def _msc(s: Any) -> bool:
    return bool(s.spec.msc_scales)


def _no_backbone_bias(s: Any) -> bool:
    # deeplab-pytorch's three groups (train._optimizer: MSC on deeplabv2) and WR38 (convs without bias)
    return (_msc(s) and s.arch == "deeplabv2") or s.arch == "deeplabv1-wr38"


_RESIZE = "its augmentation ({s.spec.augmentation}) scales the image by its own factors ({aug}), not to a longer side"
_BIAS = "its network ({s.arch}) has no backbone bias: that group is empty"

#: When each field changes nothing (see the module docstring); every other (recipe, field) is used.
UNUSED: Tuple[Unused, ...] = (
    Unused("min_size", lambda s: s.spec.augmentation != "dhr", _RESIZE),
    Unused("max_size", lambda s: s.spec.augmentation != "dhr", _RESIZE),
    Unused("loss_grid", _msc, "it trains deeplab-pytorch's MSC: each output's loss is on that output's own grid"),
    Unused("loss_grid", lambda s: s.arch in _FULL_SIZE_LOGITS,
           "its network ({s.arch}) gives its logits at the crop's size: the two grids are one"),
    Unused("momentum", lambda s: s.optimizer != "sgd", "optimizer={s.optimizer!r} has no momentum"),
    Unused("lr_mults", _no_backbone_bias, _BIAS, index=1),
    Unused("decay", _no_backbone_bias, _BIAS, index=1),
)


def _given(s: Any, row: Unused) -> bool:
    """Whether ``s`` gives ``row``'s field (an override; for one entry: other than the recipe's)."""
    if row.field not in s.overrides:
        return False
    if row.index is None:
        return True
    return getattr(s, row.field)[row.index] != getattr(s.spec, row.field)[row.index]


def unused_reason(s: Any, field: str) -> Optional[str]:
    """Why the run of settings ``s`` does not use its override of ``field`` (one line), or None
    where it uses it (or ``field`` is not given)."""
    for row in UNUSED:
        if row.field == field and _given(s, row) and row.when(s):
            name = row.field if row.index is None else f"{row.field}[{row.index}]"
            aug = ", ".join(f"{k} {v}" for k, v in s.spec.augmentation_params if k in ("scale", "scales"))
            return f"{name} is not used by the {s.recipe} recipe ({row.why.format(s=s, aug=aug)}); leave it out"
    return None


def check_used(s: Any) -> None:
    """Refuse (ValueError, one line naming the field and the recipe) the first override of the
    settings ``s`` (a resolved :class:`~mars_plugin.commands.train_settings.TrainSettings`) that its
    run would not use."""
    for field in dict.fromkeys(row.field for row in UNUSED):
        reason = unused_reason(s, field)
        if reason is not None:
            raise ValueError(reason)
