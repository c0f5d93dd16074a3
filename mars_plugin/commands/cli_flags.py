"""The flags several ``mars`` commands share, declared once: the help formatter, ``--threads``,
``--on-error``/``--no-progress``/``--ignore-index``, Eq. 1-3's hyperparameters, ``--wsss``'s
group and ``--crf-params``' parser. Each command declares its own flags next to its settings
(``<command>_settings.py``: ``HELP``, ``DESCRIPTION``, ``add_arguments``) with these pieces.
"""
from __future__ import annotations

import argparse
import json

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.label_formats import WSSS_ADAPTERS

__all__ = ["HelpFormatter", "add_threads", "add_common_arguments", "add_selection_arguments", "add_wsss_arguments",
           "crf_params_argument"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in ``--help``, except where it says nothing: a required flag ends
    with "(required)", and a None default (the help text says what leaving the flag out does)
    is not shown as "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return text + " (required)"
        if action.default is None:
            return text
        return super()._get_help_string(action)


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads N``, taken by every command (see :func:`apply_threads`)."""
    p.add_argument("--threads", type=T.threads, default=None, metavar="N",
                   help="CPU threads of torch (torch.set_num_threads), of numba's kernels and of the compiled "
                        "CRF; default: leave them as they are (one per core). Idle threads sleep (the mars "
                        "command sets OMP_WAIT_POLICY=PASSIVE), so the default suits a shared machine too; fewer "
                        "leave cores to other work")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a bad or missing input file: stop at the first with one line naming it (exit 2), or "
                        "skip it, go on, list every skipped file on stderr at the end and exit 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--ignore-index", type=T.ignore_index, default=255, help="label value of ignored pixels")


def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    """The hyperparameters of Eq. 1-3 (``mars centroids``, ``mars reproduce``)."""
    p.add_argument("--alpha", type=T.alpha, default=0.4, help="share of candidates averaged per class (Eq. 2)")
    p.add_argument("--k-fg", type=T.k_clusters, default=2, help="K-means clusters per foreground class")
    p.add_argument("--k-bg", type=T.k_clusters, default=2, help="K-means clusters for the background")
    p.add_argument("--seed", type=T.seed, default=0, help="K-means seed")


def add_wsss_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wsss", choices=WSSS_ADAPTERS, default=None,
                   help="read/write that WSSS repository's formats through mars_plugin.adapters "
                        "(skips IRNet/AdvCAM _palette.png siblings, reads its image-label file, writes its PNG mode)")
    p.add_argument("--dataset", choices=("voc", "coco"), default="voc", help="class set for --wsss rsepm tags")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling the image-label file (IRNet/AdvCAM/SEAM cls_labels.npy are pickles: "
                        "only for files you trust)")


def crf_params_argument(text: str):
    """--crf-params: a preset name or a JSON object of overrides (checked by the job)."""
    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a preset name or a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a preset name or a JSON object")
    return value
