"""``mars demo``'s settings: one frozen record (:class:`DemoSettings`), checked once where it is
made, built by the command line (:meth:`DemoSettings.from_args`) or by
:func:`mars_plugin.commands.demo.run_demo` from its keywords; and the command's flags: ``HELP``
(its line in ``mars --help``), ``DESCRIPTION`` (the head of ``mars demo --help``) and
:func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from mars_plugin._checks import check_int_param, check_seed
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import crf_params_argument
from mars_plugin.engines.crf_params import check_crf_params

__all__ = ["DemoSettings", "MAX_DEMO_IMAGES", "MIN_DEMO_SIZE", "MAX_DEMO_SIZE", "MAX_DEMO_EPOCHS"]

#: Bounds of run_demo's (and ``mars demo``'s) sizes that keep the demo a demo: minutes on a CPU
#: and a few GB at most (the world's features and the training images stay in memory).
MAX_DEMO_IMAGES = 2000
MIN_DEMO_SIZE, MAX_DEMO_SIZE = 16, 256
MAX_DEMO_EPOCHS = 1000


@dataclass(frozen=True)
class DemoSettings:
    """What ``mars demo`` does: ``seed`` (the world, the clustering, the training),
    ``num_train``/``num_val`` images of ``size`` pixels a side, ``epochs`` of each segmentation
    network, ``refine`` (``"crf"`` with ``crf_params``, or ``"threshold"``) of the debiased
    masks; ``write_world``: the world's folders under ``--out/world``; ``progress``: the bars;
    ``examples_per_class``: held-out images per class in ``overlays.png``."""

    seed: int = 0
    num_train: int = 240
    num_val: int = 80
    size: int = 64
    epochs: int = 20
    refine: str = "crf"
    crf_params: Union[None, str, Mapping[str, Any]] = "mars"
    write_world: bool = True
    progress: bool = True
    examples_per_class: int = 2
    #: the CRF's parameters resolved from ``crf_params`` with ``refine="crf"``, else None (set by the checks)
    params: Optional[Dict[str, float]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        # checked before the previous run's files are cleared
        put("seed", check_seed(self.seed))
        put("num_train", check_int_param(self.num_train, "num_train", 1, MAX_DEMO_IMAGES))
        put("num_val", check_int_param(self.num_val, "num_val", 1, MAX_DEMO_IMAGES))
        put("size", check_int_param(self.size, "size", MIN_DEMO_SIZE, MAX_DEMO_SIZE))
        if self.size % 4:
            raise ValueError(f"size must be a multiple of 4 (the features are 4x4-pixel cells), got {self.size}")
        put("epochs", check_int_param(self.epochs, "epochs", 1, MAX_DEMO_EPOCHS))
        if self.refine == "crf":  # a bad --crf-params fails before any work, not after the world
            put("params", check_crf_params(self.crf_params))
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoSettings":
        """``mars demo``'s parsed flags -> the settings (checked)."""
        return cls(seed=args.seed, num_train=args.num_train, num_val=args.num_val, size=args.size,
                   epochs=args.epochs, refine=args.refine, crf_params=args.crf_params,
                   write_world=not args.no_world)


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


#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = DemoSettings
API = "mars_plugin.commands.demo:run_demo"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"no_world": "write_world"}
#: keywords no flag sets
PYTHON_ONLY = {
    "progress": "the progress bars (the command always shows them)",
    "examples_per_class": "held-out images per class in overlays.png (the command's: 2)",
}
