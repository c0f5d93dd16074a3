"""``mars sample``'s flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars sample --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T

HELP = (
    "write a small sample tree in a WSSS codebase's layout, with random-weight models, to try every command "
    "offline"
)
DESCRIPTION = (
    "Write the built-in synthetic world (VOC class ids) as a small tree in the layout of DHR (its --root: "
    "VOC2012/train_aug/{image,mask,xml}, WSS/...; dhr-coco: its COCO2014/train tree, COCO ids, for reproduce "
    "--data COCO2014), IRNet, AdvCAM, SEAM or RS+EPM, with random-weight model files in weights/ (a tiny "
    "STEGO as DHR's two files and as a .ckpt, a tiny DINOv2 with DHR's CAUSE heads) and CAMs in the "
    "codebase's own files, and print the commands to try on it (features, centroids, debias, evaluate, "
    "report, crf, reproduce). A few seconds, a few MB."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars sample``."""
    from mars_plugin.commands.sample_trees import TREES

    p.add_argument("--tree", choices=TREES, required=True, help="whose layout")
    p.add_argument("--out", required=True, help="a new (or empty) folder for the tree")
    p.add_argument("--num-images", type=T.demo_images, default=8, help="images in the tree")
    p.add_argument("--size", type=T.demo_size, default=64, help="image side in pixels (16..256, a multiple of 4)")
    p.add_argument("--seed", type=T.seed, default=0, help="seed of the world and of the random weights")
