"""Which ``mars train`` setting each recipe and each loss uses: one table (:data:`UNUSED`), one
check (:func:`check_used`) that every settings record of a training run goes through once it
is resolved against its recipe (:class:`~mars_plugin.commands.train_settings.TrainSettings`,
which ``mars train``, ``mars reproduce --train`` and the Python API all build).

A recipe field given (an *override*) that the run would not read is refused with one line
naming it, the recipe and what the run does instead: ``loss_grid`` given to the
``deeplab-pytorch`` recipe used to be recorded as an override and to train bit-identically.
So is a setting of the MARS loss (:data:`LOSS_DEFAULTS`: ``refine``, ``crf_params``, ``ema``,
each left out the paper's, a :class:`PaperDefault`) given to a run that trains plain CE
(``loss="ce"``: no teacher, so no refinement and no EMA; ``train._build`` builds no hook and
``train._step`` takes ``train_dhr.ce_loss_sum`` or MSC's CE) or ``crf_params`` where no CRF
runs (``refine`` ``"none"``/None): ``--ema 0.5 --loss ce`` used to train bit-identically to
``--loss ce``. None given is no value (what such a run records).
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
* an entry of ``lr_mults`` / ``decay``: its group may hold no parameter (:func:`param_groups_of`,
  which ``mars train``'s optimizer takes too): the backbone biases where the backbone has no bias
  (deeplab-pytorch's groups, ``main.py:166-177``; WR38's convolutions,
  :func:`~mars_plugin.networks.deeplabv1.seam_param_groups`) or where frozen BatchNorm holds
  them all; a value other than the recipe's there changes nothing (read off the network built
  on the meta device).

``tests/test_recipe_fields.py`` checks the table against the code for every (recipe, field): an
override is refused here exactly where it leaves the run unchanged.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

__all__ = ["Unused", "UNUSED", "GROUPS", "LOSS_DEFAULTS", "PaperDefault", "param_groups_of", "unused_reason",
           "check_used"]


class PaperDefault:
    """A setting of the MARS loss left out: the paper's ``value``, the default of its field and
    of its flag. It reads as its value (``--help`` says "(default: 0.999)", the signature
    ``ema=0.999``) but is not one: :class:`~mars_plugin.commands.train_settings.TrainSettings`
    resolves it to ``value`` knowing that nothing was given, where a value typed (even the
    paper's) is a value given."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)


#: The settings only the MARS loss reads (plain CE, ``loss="ce"``, has no teacher to refine or
#: to average), each left out: the paper's (Sec. 3.4: the dense CRF of DHR's ``mars`` preset, EMA 0.999).
LOSS_DEFAULTS = {"refine": PaperDefault("crf"), "crf_params": PaperDefault("mars"), "ema": PaperDefault(0.999)}

#: The order of ``lr_mults`` / ``decay`` (the recipe's groups) by :func:`~mars_plugin.networks.deeplab.param_groups`' names.
GROUPS = ("backbone_weight", "backbone_bias", "head_weight", "head_bias")

#: the networks whose logits are at the input's size (one loss grid)
_FULL_SIZE_LOGITS = ("deeplabv3+", "deeplabv1-wr38")


@dataclass(frozen=True)
class Unused:
    """A field (``index``: one entry of a per-group tuple) that a run of settings ``s`` does not
    use where ``when(s)``; ``why`` (formatted with ``s``) says what the run does instead, ``by``
    what leaves it unused (the recipe, or another setting: ``"with loss='ce'"``)."""

    field: str
    when: Callable[[Any], bool]
    why: str
    index: Optional[int] = None
    by: str = "by the {s.recipe} recipe"


def _msc(s: Any) -> bool:
    return bool(s.spec.msc_scales)


def param_groups_of(s: Any, model: Any) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """The optimizer's parameter groups of ``model`` (the network of settings ``s``, its frozen
    parameters left out) and the entry of ``lr_mults`` / ``decay`` each group's name takes: the
    four of :func:`~mars_plugin.networks.deeplab.param_groups` (:data:`GROUPS`), or
    deeplab-pytorch's three (``main.py:166-177``: MSC on deeplabv2, entries 0, 2, 3). A group with
    no parameter is left out, so its entries change nothing."""
    from mars_plugin.networks import deeplab_pytorch as dlpt
    from mars_plugin.networks.deeplab import param_groups

    if _msc(s) and s.arch == "deeplabv2":  # main.py's 3 groups (convs only)
        return dlpt.param_groups(model, s.lr, s.weight_decay), {"1x": 0, "10x": 2, "20x": 3}
    return param_groups(model, s.lr, s.weight_decay), {n: i for i, n in enumerate(GROUPS)}


@functools.lru_cache(maxsize=64)
def _groups_used(keyed: "_Keyed") -> FrozenSet[int]:
    """The entries of ``lr_mults`` / ``decay`` whose group holds a parameter."""
    import torch
    import torch.nn as nn

    from mars_plugin.networks.deeplab import build_model

    s = keyed.s
    with torch.device("meta"):  # shapes only: no memory, no arithmetic
        model = build_model(**s.model)
        if _msc(s):
            from mars_plugin.networks.deeplabv2 import MSC

            model = MSC(model, s.spec.msc_scales)
    if s.bn == "frozen":  # as train._build: BatchNorm in no group
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.requires_grad_(False)
    groups, index = param_groups_of(s, model)
    return frozenset(index[g["name"]] for g in groups if g["params"])


def _group_empty(s: Any, i: int) -> bool:
    """Whether entry ``i`` of ``lr_mults`` / ``decay`` names a group the network of ``s`` leaves empty."""
    return i not in _groups_used(_Keyed(s))


class _Keyed:
    """Settings ``s`` compared by what decides the groups alone (the cache's key)."""

    def __init__(self, s: Any) -> None:
        self.s, self.key = s, (s.recipe, s.arch, s.backbone, s.output_stride, s.bn)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and other.key == self.key


def _ce(s: Any) -> bool:
    return s.loss == "ce"


_WITH_CE = "with loss='ce'"
_RESIZE = "its augmentation ({s.spec.augmentation}) scales the image by its own factors ({aug}), not to a longer side"
_GROUP = "its network ({s.arch}, BatchNorm {s.bn}) puts no parameter in the {group} group"

#: When each field changes nothing (see the module docstring); every other (recipe, field) is used.
UNUSED: Tuple[Unused, ...] = (
    Unused("min_size", lambda s: s.spec.augmentation != "dhr", _RESIZE),
    Unused("max_size", lambda s: s.spec.augmentation != "dhr", _RESIZE),
    Unused("loss_grid", _msc, "it trains deeplab-pytorch's MSC: each output's loss is on that output's own grid"),
    Unused("loss_grid", lambda s: s.arch in _FULL_SIZE_LOGITS,
           "its network ({s.arch}) gives its logits at the crop's size: the two grids are one"),
    Unused("momentum", lambda s: s.optimizer != "sgd", "optimizer={s.optimizer!r} has no momentum"),
    # one row per entry: the group it names may be empty (no bias in the backbone, BatchNorm frozen)
    *(Unused(f, functools.partial(_group_empty, i=i), _GROUP, index=i) for f in ("lr_mults", "decay")
      for i in range(len(GROUPS))),
    # the MARS loss's settings: plain CE builds no teacher hook (train._build); no CRF, no crf_params
    Unused("refine", _ce, "plain cross-entropy has no teacher whose labels a CRF would refine", by=_WITH_CE),
    Unused("crf_params", _ce, "plain cross-entropy runs no CRF", by=_WITH_CE),
    Unused("crf_params", lambda s: s.refine in (None, "none"), "the teacher's labels are not refined: no CRF runs",
           by="with refine='none'"),
    Unused("ema", _ce, "plain cross-entropy trains without the EMA teacher", by=_WITH_CE),
)


def _given(s: Any, row: Unused) -> bool:
    """Whether ``s`` gives ``row``'s field (an override; for one entry: other than the recipe's;
    of the loss: not None, the value of a run that does not use it)."""
    if row.field not in s.overrides or (row.field in LOSS_DEFAULTS and getattr(s, row.field) is None):
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
            group = GROUPS[row.index].replace("_", " ") if row.index is not None else ""
            return f"{name} is not used {row.by.format(s=s)} ({row.why.format(s=s, aug=aug, group=group)}); " \
                   "leave it out"
    return None


def check_used(s: Any) -> None:
    """Refuse (ValueError, one line naming the field and the recipe or the setting that leaves it
    unused) the first override of the settings ``s`` (a resolved
    :class:`~mars_plugin.commands.train_settings.TrainSettings`) that its run would not use."""
    for field in dict.fromkeys(row.field for row in UNUSED):
        reason = unused_reason(s, field)
        if reason is not None:
            raise ValueError(reason)
