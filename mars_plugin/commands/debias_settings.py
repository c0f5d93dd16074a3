"""``mars debias``' settings: one frozen record (:class:`DebiasSettings`), checked once where it
is made, built by the command line (:meth:`DebiasSettings.from_args`), taken by
:func:`mars_plugin.commands.debias.debias_job` and stored as the run's identity
(:meth:`DebiasSettings.identity`); and the command's flags, declared next to it: ``HELP`` (its
line in ``mars --help``), ``DESCRIPTION`` (the head of ``mars debias --help``) and
:func:`add_arguments` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from mars_plugin._checks import check_ignore_byte
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_common_arguments, add_wsss_arguments, crf_params_argument
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.commands.inputs import check_job_params
from mars_plugin.commands.label_formats import LabelFormat, label_format
from mars_plugin.engines.crf_params import CRF_BACKENDS, DEFAULT_MAX_BYTES, check_crf_backend, check_crf_params
from mars_plugin.formats.files import IGNORE_VALUE
from mars_plugin.runs.errors import _check_on_error
from mars_plugin.runs.io_pipeline import check_io_workers

__all__ = ["DebiasSettings", "add_arguments"]

_RUN = {"run": True}  # how the run goes, not what it writes: left out of the identity


@dataclass(frozen=True)
class DebiasSettings:
    """What ``mars debias`` does. ``refine``: ``crf`` (the dense CRF with ``crf_params``, a
    preset name or a dict of overrides of ``mars``, on ``crf_backend``) or ``threshold`` (Eq. 4's
    similarity above ``threshold``); ``ignore_index``: the ignore byte of the labels; ``fmt``:
    the WSSS repository's label files (:func:`~mars_plugin.commands.label_formats.label_format`;
    None: this package's). ``device``: where Eq. 4 and the CRF run; ``batch_size``: images per
    CRF call; ``workers`` > 1: processes running whole batches (one thread each);
    ``io_workers``: threads reading and writing beside the device instead (None: min(4, CPU
    cores) on cuda, 0 on the CPU); ``max_bytes``: the CRF's memory budget per batch and worker."""

    refine: str = "crf"
    threshold: float = 0.5
    crf_params: Union[None, str, Mapping[str, Any]] = None
    crf_backend: str = "torch"
    ignore_index: int = IGNORE_VALUE
    fmt: Optional[LabelFormat] = None
    device: str = field(default="cpu", metadata=_RUN)
    batch_size: int = field(default=8, metadata=_RUN)
    workers: int = field(default=1, metadata=_RUN)
    io_workers: Optional[int] = field(default=None, metadata=_RUN)
    max_bytes: Optional[int] = field(default=DEFAULT_MAX_BYTES, metadata=_RUN)
    on_error: str = field(default="stop", metadata=_RUN)
    progress: bool = field(default=True, metadata=_RUN)
    #: the CRF's parameters, resolved from ``crf_params`` (set by the checks)
    params: Dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        _check_on_error(self.on_error)
        if self.refine not in ("crf", "threshold"):
            raise ValueError(f"refine must be 'crf' or 'threshold', got {self.refine!r}")
        for name, value in check_job_params(threshold=self.threshold, workers=self.workers,
                                            batch_size=self.batch_size).items():
            put(name, value)
        put("ignore_index", check_ignore_byte(self.ignore_index))
        put("params", check_crf_params(self.crf_params))
        check_crf_backend(self.crf_backend)
        if self.io_workers is not None:  # None: resolved for the device when the job runs
            put("io_workers", check_io_workers(self.io_workers, "cpu", self.processes))
        if self.fmt is not None and not isinstance(self.fmt, LabelFormat):
            raise TypeError(f"fmt must be a LabelFormat (label_format('irnet'), ...) or None (this package's), "
                            f"got {type(self.fmt).__name__} {self.fmt!r}"[:200])
        put("fmt", self.fmt or LabelFormat())
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @property
    def processes(self) -> int:
        """The ``--workers`` processes running whole batches (0: this one, with its threads)."""
        return self.workers if self.workers > 1 else 0

    def identity(self) -> Dict[str, Any]:
        """The settings that shape a label (the run's identity, recorded and compared on
        resume); the folders and the centroid file are not among them: each file read is
        recorded by its identity (a moved or copied tree is the same run)."""
        crf = self.refine == "crf"
        return {"refine": self.refine, "threshold": None if crf else self.threshold,
                "crf_params": self.params if crf else None, "crf_backend": self.crf_backend if crf else None,
                "ignore_index": self.ignore_index, "wsss": self.fmt.name, "mode": self.fmt.mode}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DebiasSettings":
        """``mars debias``' parsed flags -> the settings (checked)."""
        return cls(refine=args.refine, threshold=args.threshold, crf_params=args.crf_params,
                   crf_backend=args.crf_backend, ignore_index=args.ignore_index,
                   fmt=label_format(args.wsss, dataset=args.dataset, trust_pickle=args.trust_pickle),
                   device=args.device, batch_size=args.batch_size, workers=args.workers,
                   io_workers=args.io_workers,
                   max_bytes=DEFAULT_MAX_BYTES if args.max_memory is None else int(args.max_memory * 2 ** 30),
                   on_error=args.on_error, progress=not args.no_progress)


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


#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = DebiasSettings
API = "mars_plugin.commands.debias:debias_job"
#: flag dest -> Python keyword, where the names differ (--wsss, --dataset and --trust-pickle
#: make one label format, ``fmt``)
FLAG_KEYWORDS = {"features": "features_dir", "labels": "labels_dir", "images": "images_dir", "out": "out_dir",
                 "no_progress": "progress", "max_memory": "max_bytes",
                 "wsss": "fmt", "dataset": "fmt", "trust_pickle": "fmt"}
#: flags no keyword takes
CLI_ONLY = {"class_names": "names the classes of the per-class summary the command prints; no label depends on it"}
#: keywords no flag sets
PYTHON_ONLY = {"stems": "only these labels of the folder (a caller's subset: mars reproduce's images)"}
