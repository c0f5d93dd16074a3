"""``mars debias``' flags, declared next to its settings: ``HELP`` (its line in ``mars --help``),
``DESCRIPTION`` (the head of ``mars debias --help``) and :func:`add_arguments`
(:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments, add_wsss_arguments, crf_params_argument
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.engines.crf_params import CRF_BACKENDS

HELP = "write debiased labels (Eq. 4-5) for a folder"
DESCRIPTION = (
    "One P-mode PNG (VOC palette) per pseudo label; biased pixels are written as 254, ignore stays 255. "
    "Existing outputs are skipped, so an interrupted run resumes."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars debias``."""
    p.add_argument("--features", required=True, help="folder of <stem>.npy or <stem>.pt embeddings")
    p.add_argument("--labels", required=True, help="folder of <stem>.png pseudo labels")
    p.add_argument("--centroids", required=True, help=".pt file written by 'mars centroids'")
    p.add_argument("--images", default=None, help="folder of RGB images <stem>.jpg/.png (needed by --refine crf)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="dense CRF or a plain threshold")
    p.add_argument("--threshold", type=T.threshold, default=0.5, help="similarity threshold of --refine threshold")
    p.add_argument("--image-labels", default=None, help="JSON {stem: [class ids]}; default: classes of each label")
    p.add_argument("--crf-params", type=crf_params_argument, default="mars",
                   help="dense-CRF parameters: a preset, mars (= deeplab: the MARS authors' RS+EPM/DHR/STEGO setting, "
                        "Gaussian sxy 1 compat 3, bilateral sxy 67 srgb 3 compat 4) or psa (= seam: 3/3, 80/13/10), "
                        "or a JSON dict of overrides of mars, e.g. '{\"iterations\": 5}'")
    p.add_argument("--crf-backend", choices=CRF_BACKENDS, default="torch",
                   help="torch (batched, on --device) or pydensecrf (the reference, CPU, one image at a time; "
                        "needs the crf extra)")
    p.add_argument("--device", default="cpu", help="where Eq. 4 and the CRF run: cpu, cuda, cuda:1, or auto")
    p.add_argument("--batch-size", type=T.batch_size, default=8, help="images per CRF call (64 suits a GPU)")
    p.add_argument("--max-memory", type=T.max_memory, default=None, metavar="GIB",
                   help="the CRF's memory budget in GiB per worker: an image whose CRF needs more is refused by name "
                        "(default: 6, the CRF's own)" + "%(default).0s")
    p.add_argument("--workers", type=T.workers, default=1,
                   help="processes, each with one thread (on a CPU with free cores: one per core)")
    add_io_workers_argument(p)
    p.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json, for the printed "
                        "per-class summary (default with --wsss: that codebase's class names)")
    add_wsss_arguments(p)
    add_common_arguments(p)
