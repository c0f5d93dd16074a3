"""``mars features``' flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars features --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.adapters.uss.extractor import uss_names_text

HELP = f"USS embeddings ({uss_names_text()}) for a folder of images"
DESCRIPTION = ("Write one float16 (D, h, w) <stem>.npy (or <stem>.pt with --format pt) per image "
               f"with a {uss_names_text()} model read from disk (nothing is downloaded); "
               "resumable, atomic writes.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars features``."""
    from mars_plugin.commands.features import add_features_arguments

    add_features_arguments(p)
