"""``mars evaluate``'s flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars evaluate --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments
from mars_plugin.commands.label_formats import WSSS_ADAPTERS

HELP = "IoU, FP, FN per class (SEAM's formulas)"
DESCRIPTION = (
    "Confusion matrix over the whole set on pixels where gt < 255; FP = (P-TP)/(T+P-TP), FN = "
    "(T-TP)/(T+P-TP); mIoU over classes present. Predicted 254 (biased) counts as background."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars evaluate``."""
    p.add_argument("--pred", required=True, help="folder of predicted label PNGs")
    p.add_argument("--gt", required=True, help="folder of ground-truth label PNGs")
    p.add_argument("--num-classes", type=T.num_classes, required=True, help="C, the number of foreground classes")
    p.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json; default: "
                        "--wsss's names, else a classes.json beside --gt or DHR's <data>.json above it, else "
                        "'class c'")
    p.add_argument("--wsss", choices=WSSS_ADAPTERS, default=None,
                   help="name the classes as that WSSS codebase does (dhr: the dataset json above --gt, else VOC's)")
    p.add_argument("--dataset", choices=("voc", "coco"), default="voc", help="class set for --wsss rsepm")
    p.add_argument("--json", default=None, help="also write the scores to this JSON file")
    add_common_arguments(p)
