"""``mars sample``'s settings: one frozen record (:class:`SampleSettings`), checked once where it
is made, built by the command line (:meth:`SampleSettings.from_args`) or by
:func:`mars_plugin.commands.sample_trees.write_sample_tree` from its arguments; and the command's
flags: ``HELP`` (its line in ``mars --help``), ``DESCRIPTION`` (the head of ``mars sample
--help``) and :func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from mars_plugin.commands import cli_types as T

__all__ = ["SampleSettings", "TREES"]

#: The codebases whose layout a sample tree can have (:data:`mars_plugin.commands.sample_trees.LAYOUTS`).
TREES = ("dhr", "dhr-coco", "irnet", "advcam", "seam", "rsepm")


@dataclass(frozen=True)
class SampleSettings:
    """What ``mars sample`` writes: the layout of ``tree`` (one of :data:`TREES`), ``num_images``
    images of ``size`` pixels a side, the world and the random weights of ``seed``."""

    tree: str
    num_images: int = 8
    size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tree not in TREES:
            raise ValueError(f"--tree must be one of {', '.join(TREES)}, got {self.tree!r}")
        T.check_fields(self, add_arguments, {})  # then every flag's bounds, choices, switches (cli_types)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SampleSettings":
        """``mars sample``'s parsed flags -> the settings (checked)."""
        return cls(tree=args.tree, num_images=args.num_images, size=args.size, seed=args.seed)


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
    p.add_argument("--tree", choices=TREES, required=True, help="whose layout")
    p.add_argument("--out", required=True, help="a new (or empty) folder for the tree")
    p.add_argument("--num-images", type=T.demo_images, default=8, help="images in the tree")
    p.add_argument("--size", type=T.demo_size, default=64, help="image side in pixels (16..256, a multiple of 4)")
    p.add_argument("--seed", type=T.seed, default=0, help="seed of the world and of the random weights")


#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = SampleSettings
API = "mars_plugin.commands.sample_trees:write_sample_tree"
