"""``mars report``'s settings: one frozen record (:class:`ReportSettings`), checked once where it
is made, built by the command line (:meth:`ReportSettings.from_args`) and taken by
:func:`mars_plugin.commands.report.report_job`; and the command's flags, declared next to it:
``HELP`` (its line in ``mars --help``), ``DESCRIPTION`` (the head of ``mars report --help``) and
:func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

from mars_plugin._checks import check_class_names, check_ignore_byte
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments
from mars_plugin.commands.inputs import check_job_params
from mars_plugin.commands.label_formats import _class_names
from mars_plugin.formats.files import IGNORE_VALUE
from mars_plugin.runs.errors import _check_on_error

__all__ = ["ReportSettings", "add_arguments"]


@dataclass(frozen=True)
class ReportSettings:
    """What ``mars report`` shows: ``class_names`` (background first; None: "class c"),
    ``num_examples`` most-changed images, ``per_class`` images of each class; ``ignore_index``:
    the labels' ignore byte; ``on_error``: a bad file stops the run or is skipped;
    ``progress``: a progress bar; ``gt_dir``: ground-truth PNGs (``report.html`` then shows
    IoU/FP/FN and a ground-truth panel); ``centroids``: the centroids file (its Eq. 1-3 ranking)."""

    class_names: Optional[Sequence[str]] = None
    num_examples: int = 8
    per_class: int = 2
    ignore_index: int = IGNORE_VALUE
    on_error: str = "stop"
    progress: bool = True
    gt_dir: Optional[str] = None
    centroids: Optional[str] = None

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        _check_on_error(self.on_error)
        for name, value in check_job_params(num_examples=self.num_examples, per_class=self.per_class).items():
            put(name, value)
        if self.class_names is not None:
            put("class_names", tuple(check_class_names(self.class_names)))
        put("ignore_index", check_ignore_byte(self.ignore_index, num_classes=self.num_named_classes))
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @property
    def num_named_classes(self) -> Optional[int]:
        """C of ``class_names`` (None: not given)."""
        return None if self.class_names is None else len(self.class_names) - 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReportSettings":
        """``mars report``'s parsed flags -> the settings (checked); ``--class-names`` is read."""
        return cls(class_names=_class_names(args.class_names), num_examples=args.num_examples,
                   per_class=args.per_class, ignore_index=args.ignore_index, on_error=args.on_error,
                   progress=not args.no_progress, gt_dir=args.gt, centroids=args.centroids)


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
    p.add_argument("--gt", default=None,
                   help="folder of ground-truth PNGs: report.html then scores the pseudo and debiased labels "
                        "(IoU, FP, FN per class) and shows each image's ground truth")
    p.add_argument("--centroids", default=None,
                   help="the centroids file of 'mars centroids' (V.pt): report.html draws each class's ranking")
    add_common_arguments(p)


#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = ReportSettings
API = "mars_plugin.commands.report:report_job"
#: flag dest -> Python keyword, where the names differ (--class-names: the file, read into the names)
FLAG_KEYWORDS = {"labels": "labels_dir", "debiased": "debiased_dir", "images": "images_dir", "out": "out_dir",
                 "no_progress": "progress", "gt": "gt_dir"}
#: keywords no flag sets
PYTHON_ONLY = {
    "html": "report.html's extras as one HtmlExtras record: the command line fills its gt_dir and centroids from "
            "--gt and --centroids; its scores and title are what mars demo and mars reproduce pass",
}
