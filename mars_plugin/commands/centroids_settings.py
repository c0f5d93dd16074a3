"""``mars centroids``' settings: one frozen record (:class:`CentroidsSettings`), checked once where
it is made, built by the command line (:meth:`CentroidsSettings.from_args`), taken by
:func:`mars_plugin.commands.centroids.centroids_job` and stored as the run's identity
(:meth:`CentroidsSettings.identity`); and the command's flags: ``HELP`` (its line in
``mars --help``), ``DESCRIPTION`` (the head of ``mars centroids --help``) and
:func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from mars_plugin._checks import check_ignore_byte, check_num_classes
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.inputs import check_job_params
from mars_plugin.commands.cli_flags import add_common_arguments, add_selection_arguments, add_wsss_arguments
from mars_plugin.formats.files import IGNORE_VALUE
from mars_plugin.method.centroids import BACKENDS
from mars_plugin.runs.errors import _check_on_error

__all__ = ["CentroidsSettings", "add_arguments"]


@dataclass(frozen=True)
class CentroidsSettings:
    """What ``mars centroids`` does: Eq. 1-3 for ``num_classes`` C foreground classes (``alpha``:
    the share of candidates averaged per class; ``k_fg``, ``k_bg``: K-means clusters per
    foreground class and for the background, seeded by ``seed``), label pixels of
    ``ignore_index`` left out. How the run goes (not recorded: they change the result by float
    rounding at most): ``batch_size`` images per batched K-means call on ``device`` with
    ``backend``, candidate centroids beyond ``spill_mb`` MB spilled to a temporary folder in
    ``spill_dir``; ``on_error``: a bad file stops the run or is skipped."""

    num_classes: int
    alpha: float = 0.4
    k_fg: int = 2
    k_bg: int = 2
    seed: int = 0
    ignore_index: int = IGNORE_VALUE
    batch_size: int = 64
    device: str = "cpu"
    backend: str = "auto"
    spill_dir: Optional[os.PathLike] = None
    spill_mb: float = 1024
    on_error: str = "stop"
    progress: bool = True

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        _check_on_error(self.on_error)
        put("num_classes", check_num_classes(self.num_classes))
        put("ignore_index", check_ignore_byte(self.ignore_index, num_classes=self.num_classes))
        checked = check_job_params(alpha=self.alpha, k_fg=self.k_fg, k_bg=self.k_bg, seed=self.seed,
                                   batch_size=self.batch_size, spill_mb=self.spill_mb)
        for name, value in checked.items():
            put(name, value)
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    def identity(self, wsss: Optional[str]) -> Dict[str, Any]:
        """The settings that shape the centroids (recorded in ``--out``, compared on resume), with
        ``wsss``, the codebase whose folders are read; the folders are not among them: each file
        read is recorded by its identity (a moved or copied tree is the same run)."""
        return {"num_classes": self.num_classes, "alpha": self.alpha, "k_fg": self.k_fg, "k_bg": self.k_bg,
                "seed": self.seed, "ignore_index": self.ignore_index, "wsss": wsss}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CentroidsSettings":
        """``mars centroids``' parsed flags -> the settings (checked)."""
        return cls(num_classes=args.num_classes, alpha=args.alpha, k_fg=args.k_fg, k_bg=args.k_bg, seed=args.seed,
                   ignore_index=args.ignore_index, batch_size=args.batch_size, device=args.device,
                   backend=args.backend, spill_dir=args.spill_dir, spill_mb=args.spill_mb, on_error=args.on_error,
                   progress=not args.no_progress)


#: ``mars centroids`` in ``mars --help``, and the head of its own ``--help``
HELP = "select debiased centroids (Eq. 1-3) from folders"
DESCRIPTION = "Stream (features, pseudo label) pairs and write the debiased centroids to a .pt file."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars centroids``."""
    p.add_argument("--features", required=True, help="folder of float (D, h, w) embeddings, <stem>.npy or <stem>.pt "
                                                      "(DHR's fp16 tensors, read with weights_only=True)")
    p.add_argument("--labels", required=True, help="folder of <stem>.png pseudo labels (0 = background, 255 = ignore)")
    p.add_argument("--image-labels", default=None, help="JSON {stem: [1-based class ids]}; default: classes of each label")
    p.add_argument("--num-classes", type=T.num_classes, required=True, help="C, the number of foreground classes")
    p.add_argument("--out", required=True, help="output .pt file")
    add_selection_arguments(p)
    p.add_argument("--batch-size", type=T.batch_size, default=64,
                   help="images clustered per batched K-means call (512 suits a GPU)")
    p.add_argument("--device", default="cpu",
                   help="where the K-means runs: cpu, cuda, cuda:1, or auto (this rank's GPU if any)")
    p.add_argument("--spill-dir", default=None,
                   help="existing folder: candidate centroids beyond --spill-mb go to a temporary folder in it")
    p.add_argument("--spill-mb", type=T.spill_mb, default=1024, help="MB of candidate centroids held in memory")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="K-means implementation: compiled (numba, CPU), torch (any device), or auto "
                        "(compiled on the CPU when numba is installed)")
    p.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json, for the printed "
                        "summary (default with --wsss: that codebase's class names)")
    add_wsss_arguments(p)
    add_common_arguments(p)


#: the record the flags build, and the Python function taking it as ``settings=`` or its fields
#: as keywords
SETTINGS = CentroidsSettings
API = "mars_plugin.commands.centroids:centroids_job"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"features": "features_dir", "labels": "labels_dir", "no_progress": "progress"}
#: flags no keyword takes
CLI_ONLY = {
    "class_names": "names for the printed summary only",
    "wsss": "made into fmt (label_format: that codebase's folders and image-label file)",
    "dataset": "with --wsss: made into fmt (the class set of its tags)",
    "trust_pickle": "with --wsss: made into fmt (its image-label file may be a pickle)",
}
#: keywords no flag sets
PYTHON_ONLY = {
    "fmt": "a LabelFormat, made by the command line from --wsss, --dataset and --trust-pickle",
    "stems": "only these of the folder's labels (a caller's subset: mars reproduce's ids)",
}
