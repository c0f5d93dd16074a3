"""``mars predict``'s inference settings: the flags given, over the checkpoint's recipe.

A checkpoint of ``mars train --recipe NAME`` names its recipe (``ck["recipe"]``) and the fields
its run resolved (``ck["settings"]``); ``mars predict`` then infers as that codebase does -- its
scales, flip, CRF preset, the bytes its CRF sees and its class threshold
(:class:`mars_plugin.networks.recipes.Recipe`'s ``test_scales``, ``test_flip``, ``crf``,
``crf_image``, ``class_threshold``), and its weights (``predict_weights``:
:func:`mars_plugin.networks.seg_checkpoint.recipe_weights`) -- unless a flag says otherwise. A
checkpoint written before recipes keeps the defaults it always had (:data:`PLAIN_DEFAULTS`).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping

from mars_plugin.runs.errors import JobError, one_line
from mars_plugin.networks.inference import CLASS_THRESHOLD, DEFAULT_SCALES

__all__ = ["RECIPE_FIELDS", "PLAIN_DEFAULTS", "predict_settings"]

#: The inference fields of a recipe (:class:`mars_plugin.networks.recipes.Recipe`) that ``mars
#: predict`` follows -> the :func:`~mars_plugin.commands.predict.predict_job` argument (and the
#: ``argparse`` name of the flag) each one is the default of.
RECIPE_FIELDS = {"test_scales": "scales", "test_flip": "flip", "crf": "crf", "crf_image": "crf_image",
                 "class_threshold": "class_threshold"}
#: What ``mars predict`` does for a checkpoint that names no recipe (written before recipes).
PLAIN_DEFAULTS = {"scales": DEFAULT_SCALES, "flip": True, "crf": "mars", "crf_image": "file",
                  "class_threshold": CLASS_THRESHOLD}


def predict_settings(args: argparse.Namespace, meta: Mapping[str, Any]) -> Dict[str, Any]:
    """:func:`~mars_plugin.commands.predict.predict_job`'s ``scales``, ``flip``, ``crf``, ``crf_image`` and ``class_threshold``:
    each flag given wins; otherwise the checkpoint's recipe (``meta["recipe"]``, its fields as
    :func:`~mars_plugin.networks.recipes.get_recipe` has them, or as the run resolved them in
    ``meta["settings"]``) decides, and a checkpoint without a recipe takes :data:`PLAIN_DEFAULTS`.
    A recipe's ``class_threshold`` None (every class in the CRF) is 0. ``--class-threshold`` or
    ``--crf-image`` given with no CRF (``--crf none``) are refused: they would change nothing."""
    name = meta.get("recipe")
    chosen = dict(PLAIN_DEFAULTS)
    if name is not None:
        from mars_plugin.networks.recipes import get_recipe

        try:
            recipe = get_recipe(name)
        except ValueError as e:
            raise JobError(f"--model {args.model}: {one_line(e)}") from None
        resolved = meta.get("settings") if isinstance(meta.get("settings"), dict) else {}
        for field, key in RECIPE_FIELDS.items():
            chosen[key] = resolved.get(field, getattr(recipe, field))
        if chosen["class_threshold"] is None:
            chosen["class_threshold"] = 0.0
        chosen["scales"] = tuple(chosen["scales"])
        _check_stored(args, {k: v for k, v in chosen.items() if getattr(args, k, None) is None})
    for key in RECIPE_FIELDS.values():  # a flag given wins
        if getattr(args, key, None) is not None:
            chosen[key] = getattr(args, key)
    if chosen["crf"] == "none":  # the argmax: a CRF setting given would be recorded and do nothing
        given = [f"--{k.replace('_', '-')}" for k in ("class_threshold", "crf_image") if getattr(args, k, None) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} not used with --crf none "
                             "(the argmax of the probabilities, no CRF); leave it out or choose a CRF")
    return chosen


def _check_stored(args: argparse.Namespace, stored: Mapping[str, Any]) -> None:
    """The values the checkpoint decides (no flag given), checked as the record checks them: a
    bad one is the checkpoint's, said so (not the flag's, which the user did not give)."""
    from mars_plugin.commands.predict_settings import PredictSettings

    try:
        PredictSettings(**stored)
    except (TypeError, ValueError) as e:
        raise JobError(f"--model {args.model}: {one_line(e)} (from the checkpoint {args.model}: its recipe's "
                       f"inference settings; a flag given overrides it)") from None
