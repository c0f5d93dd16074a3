"""``mars evaluate``'s settings: one frozen record (:class:`EvaluateSettings`), checked once where
it is made, built by the command line (:meth:`EvaluateSettings.from_args`) and taken by
:func:`mars_plugin.commands.evaluate.evaluate_job`; and the command's flags, declared next to
it: ``HELP`` (its line in ``mars --help``), ``DESCRIPTION`` (the head of ``mars evaluate
--help``) and :func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from mars_plugin._checks import check_ignore_byte, check_num_classes
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments
from mars_plugin.commands.label_formats import WSSS_ADAPTERS
from mars_plugin.formats.files import IGNORE_VALUE
from mars_plugin.runs.errors import _check_on_error

__all__ = ["EvaluateSettings", "add_arguments"]


@dataclass(frozen=True)
class EvaluateSettings:
    """What ``mars evaluate`` scores: ``num_classes`` C foreground classes (ids 1..C, 0 the
    background), ``ignore_index`` the ignored pixels' byte (above C); ``on_error``: a bad file
    stops the run or is skipped; ``progress``: a progress bar."""

    num_classes: int
    ignore_index: int = IGNORE_VALUE
    on_error: str = "stop"
    progress: bool = True

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        _check_on_error(self.on_error)
        put("num_classes", check_num_classes(self.num_classes))
        put("ignore_index", check_ignore_byte(self.ignore_index, num_classes=self.num_classes))
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EvaluateSettings":
        """``mars evaluate``'s parsed flags -> the settings (checked)."""
        return cls(num_classes=args.num_classes, ignore_index=args.ignore_index, on_error=args.on_error,
                   progress=not args.no_progress)


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


#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = EvaluateSettings
API = "mars_plugin.commands.evaluate:evaluate_job"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"pred": "pred_dir", "gt": "gt_dir", "no_progress": "progress"}
#: flags no keyword takes: they name the classes of what the command prints and writes; the
#: scores do not depend on them
_NAMES = "names the classes of the printed table and of --json's class_names; the scores do not depend on it"
CLI_ONLY = {
    "class_names": _NAMES,
    "wsss": _NAMES + " (that codebase's class names)",
    "dataset": _NAMES + " (with --wsss rsepm: its class set)",
    "json": "the command writes the scores evaluate_job returns to this file (write_scores_json)",
}
#: keywords no flag sets
PYTHON_ONLY = {"stems": "only these images of --gt (mars reproduce: the images that have a pseudo label)"}
