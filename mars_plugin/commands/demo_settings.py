"""``mars demo``'s flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars demo --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import crf_params_argument

HELP = "run the whole method on the built-in biased world and show what it removed"
DESCRIPTION = (
    "Generate the built-in biased world, select centroids, debias (CRF), train a small segmentation network "
    "with plain CE and with MARS, and compare them on held-out images."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars demo``."""
    p.add_argument("--out", default="mars_demo", help="output folder (tables, pictures, metrics.json, the world on disk)")
    p.add_argument("--seed", type=T.seed, default=0, help="seed of the world, the clustering and the training")
    p.add_argument("--num-train", type=T.demo_images, default=240, help="training images")
    p.add_argument("--num-val", type=T.demo_images, default=80, help="held-out images")
    p.add_argument("--size", type=T.demo_size, default=64, help="image side in pixels")
    p.add_argument("--epochs", type=T.demo_epochs, default=20, help="training epochs of each segmentation network")
    p.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="refinement of the debiased mask")
    p.add_argument("--crf-params", type=crf_params_argument, default="mars", help="dense-CRF preset or JSON dict (see debias)")
    p.add_argument("--no-world", action="store_true", help="do not write the world's folders under --out/world")
