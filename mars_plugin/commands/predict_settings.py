"""``mars predict``'s flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars predict --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse


HELP = (
    "a trained network's labels (mars train checkpoint): multi-scale + flip inference and the dense CRF, as "
    "the authors' evaluators"
)
DESCRIPTION = (
    "One P-mode PNG (VOC palette) per image: the mean softmax over --scales and flips, then the dense CRF "
    "over the classes reaching --class-threshold (RS+EPM's and DHR's evaluators; sources in "
    "mars_plugin/networks/inference.py). --root/--method write DHR's WSS/<data>/<method>/<domain>/ (MARS "
    "masks, for train.py --wss). Resumable, atomic writes; under torchrun the ranks share the images."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars predict``."""
    from mars_plugin.commands.predict import add_predict_arguments

    add_predict_arguments(p)
