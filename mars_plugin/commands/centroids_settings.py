"""``mars centroids``' flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars centroids --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments, add_selection_arguments, add_wsss_arguments
from mars_plugin.method.centroids import BACKENDS

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
