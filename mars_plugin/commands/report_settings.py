"""``mars report``'s flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars report --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments

HELP = "which classes were biased: chart and overlays"
DESCRIPTION = (
    "Per-class share of pseudo-label pixels marked biased, ranked, as a bar chart, and a grid of overlays of "
    "the most-changed images (the paper's Fig. 1(d), automatically)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars report``."""
    p.add_argument("--labels", required=True, help="folder of pseudo label PNGs")
    p.add_argument("--debiased", required=True, help="folder of debiased label PNGs (from 'mars debias')")
    p.add_argument("--images", required=True, help="folder of RGB images")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json")
    p.add_argument("--num-examples", type=T.num_examples, default=8, help="most-changed images shown")
    p.add_argument("--per-class", type=T.per_class, default=2,
                   help="for each class, its N images with the largest share of that class's pixels removed "
                        "(per_class.png; 0: none)")
    add_common_arguments(p)
