"""``mars crf``'s settings: one frozen record (:class:`CrfSettings`), checked once where it is
made, built by the command line (:meth:`CrfSettings.from_args`), taken by
:func:`mars_plugin.commands.crf_job.crf_job` and stored as the run's identity
(:meth:`CrfSettings.identity`); and the command's flags (:func:`add_crf_arguments`).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from mars_plugin._checks import MAX_BATCH_SIZE, check_int_param
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_types import MAX_WORKERS
from mars_plugin.engines.crf_params import CRF_PRESET_NAMES, check_crf_params
from mars_plugin.runs.errors import ON_ERROR
from mars_plugin.runs.output_aside import STALE_DIR
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.runs.io_pipeline import check_io_workers
from mars_plugin.commands.label_formats import WSSS_ADAPTERS

__all__ = ["CrfSettings", "add_crf_arguments", "WRITE_CHOICES", "PROBS_DTYPES", "OWN_CRF"]

WRITE_CHOICES = ("labels", "probs")
PROBS_DTYPES = ("float32", "float16")
#: Each codebase's own CRF (a preset name of :data:`mars_plugin.engines.crf_params.CRF_PRESETS`
#: or its alias), the default ``--crf`` with ``--wsss``; ``mars`` for ``--probs``.
OWN_CRF = {"irnet": "irnet", "advcam": "advcam", "seam": "seam", "rsepm": "rsepm", "dhr": "dhr", None: "mars"}
#: The classes + background of a ``--dataset`` (the channels of ``--write probs`` with ``--wsss``).
_LABELS = {"voc": 21, "coco": 81}
_RUN = {"run": True}  # how the run goes, not what it writes: left out of the identity


@dataclass(frozen=True)
class CrfSettings:
    """What ``mars crf`` does. ``wsss``: the codebase whose CAMs ``--cams`` holds (its rule turns
    them into the CRF's input), None for ``--probs`` maps; ``crf``: a preset name (default the
    codebase's own, :data:`OWN_CRF`), ``crf_params``: overrides of its keys; ``write``:
    ``labels`` (PNG, VOC palette) or ``probs`` ((L, H, W) ``.npy`` of ``probs_dtype``, channel =
    class id: L = 21 for ``dataset="voc"``, 81 for ``"coco"`` with ``wsss``, the input's L for
    ``--probs``). ``workers``: processes decoding and encoding files (0: this one);
    ``io_workers``: threads doing it instead, overlapped with the device
    (:mod:`mars_plugin.runs.io_pipeline`; None: min(4, CPU cores) on cuda, else 0);
    ``batch_size``: images per CRF call on ``device``."""

    wsss: Optional[str] = None
    dataset: str = "voc"
    crf: Optional[str] = None
    crf_params: Optional[Mapping[str, Any]] = None
    write: str = "labels"
    probs_dtype: str = "float32"
    trust_pickle: bool = field(default=False, metadata=_RUN)
    device: str = field(default="cpu", metadata=_RUN)
    batch_size: int = field(default=8, metadata=_RUN)
    workers: int = field(default=0, metadata=_RUN)
    io_workers: Optional[int] = field(default=None, metadata=_RUN)
    on_error: str = field(default="stop", metadata=_RUN)
    progress: bool = field(default=True, metadata=_RUN)
    restart: bool = field(default=False, metadata=_RUN)
    max_bytes: Union[None, int] = field(default=None, metadata=_RUN)
    #: the CRF's parameters, resolved from ``crf`` and ``crf_params`` (set by the checks)
    params: Dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        if self.wsss is not None and self.wsss not in WSSS_ADAPTERS:
            raise ValueError(f"wsss must be one of {WSSS_ADAPTERS} or None (--probs), got {self.wsss!r}")
        if self.dataset not in _LABELS:
            raise ValueError(f"dataset must be one of {tuple(_LABELS)}, got {self.dataset!r}")
        crf = OWN_CRF[self.wsss] if self.crf is None else self.crf
        if not isinstance(crf, str) or crf not in CRF_PRESET_NAMES:
            raise ValueError(f"crf must be one of {CRF_PRESET_NAMES}, got {crf!r}")
        put("crf", crf)
        params = check_crf_params(crf)
        if self.crf_params is not None:
            params = check_crf_params(dict(self.crf_params), defaults=params)
        put("params", params)
        if self.write not in WRITE_CHOICES:
            raise ValueError(f"write must be one of {WRITE_CHOICES}, got {self.write!r}")
        if self.write == "probs" and self.wsss in ("irnet", "advcam"):
            raise ValueError(f"write='probs' with wsss={self.wsss!r}: its rule ends in a label (confident "
                             "foreground, background, 255 between) from two CRFs, not one probability map; "
                             "use write='labels'")
        if self.probs_dtype not in PROBS_DTYPES:
            raise ValueError(f"probs_dtype must be one of {PROBS_DTYPES}, got {self.probs_dtype!r}")
        put("batch_size", check_int_param(self.batch_size, "batch_size", 1, MAX_BATCH_SIZE))
        put("workers", check_int_param(self.workers, "workers", 0, MAX_WORKERS))
        if self.io_workers is not None:  # None: resolved for the device when the job runs
            put("io_workers", check_io_workers(self.io_workers, "cpu", self.workers))
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @property
    def num_labels(self) -> int:
        """The channels of a written probability map with ``wsss`` (classes + background)."""
        return _LABELS[self.dataset]

    def identity(self) -> Dict[str, Any]:
        """What shapes the files written (the run's identity, recorded and compared on resume)."""
        return {"wsss": self.wsss, "dataset": self.dataset if self.write == "probs" and self.wsss else None,
                "crf_params": dict(self.params), "write": self.write,
                "probs_dtype": self.probs_dtype if self.write == "probs" else None}

    def replace(self, **changes: Any) -> "CrfSettings":
        keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return CrfSettings(**{**keep, **changes})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CrfSettings":
        """``mars crf``'s parsed flags -> the settings (checked)."""
        return cls(wsss=args.wsss, dataset=args.dataset, crf=args.crf, crf_params=args.crf_params,
                   write=args.write, probs_dtype=args.probs_dtype, trust_pickle=args.trust_pickle,
                   device=args.device, batch_size=args.batch_size, workers=args.workers, io_workers=args.io_workers,
                   on_error=args.on_error,
                   progress=not args.no_progress, restart=args.restart,
                   max_bytes=None if args.max_memory is None else int(args.max_memory * 2 ** 30))


def _overrides(text: str) -> Dict[str, Any]:
    """--crf-params: a JSON object of overrides of --crf's keys."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"iterations\": 5}}', got {text!r}")
    return value


def add_crf_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars crf`` (called by :func:`mars_plugin.commands.cli_parser.build_parser`)."""
    own = "%(default).0s"  # no "(default: None)" where the help says what None means

    # one of --cams and --probs (checked by the job, after the inputs' check against --out)
    p.add_argument("--cams", default=None, metavar="DIR",
                     help="folder of a codebase's CAM files (or give --probs), read as --wsss reads them (IRNet/AdvCAM/SEAM .npy and "
                          "RS+EPM .pkl are pickles: they need --trust-pickle; DHR .pt)" + own)
    p.add_argument("--probs", default=None, metavar="DIR",
                     help="folder of <stem>.npy or <stem>.pt (L, H, W) probability maps (or give --cams), channel = class id "
                          "(np.load allow_pickle=False, torch.load weights_only=True)" + own)
    p.add_argument("--wsss", choices=WSSS_ADAPTERS, default=None,
                   help="the codebase of --cams: its rule makes the CRF's input (IRNet/AdvCAM: the confident "
                        "labels' unary; SEAM, RS+EPM: background from the CAMs; DHR: its probabilities)" + own)
    p.add_argument("--images", required=True, metavar="DIR", help="folder of the RGB images <stem>.jpg/.png")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (never an input folder or in one)")
    p.add_argument("--crf", choices=CRF_PRESET_NAMES, default=None,
                   help="the CRF's parameters by name: a preset or a codebase's own (irnet/advcam: 3/3, 50/5/10; "
                        "seam/psa: 3/3, 80/13/10; mars/deeplab/deeplab-pytorch/rsepm/dhr: 1/3, 67/3/4; 10 "
                        "iterations); default: the --wsss codebase's own, mars for --probs" + own)
    p.add_argument("--crf-params", type=_overrides, default=None, metavar="JSON",
                   help="overrides of --crf's keys, e.g. '{\"iterations\": 5}' (iterations, gaussian_sxy, "
                        "gaussian_compat, bilateral_sxy, bilateral_srgb, bilateral_compat)" + own)
    p.add_argument("--write", choices=WRITE_CHOICES, default="labels",
                   help="labels: <stem>.png (P mode, VOC palette); probs: <stem>.npy (L, H, W) marginals, channel = "
                        "class id (not with irnet/advcam, whose rule ends in a label)")
    p.add_argument("--probs-dtype", choices=PROBS_DTYPES, default="float32", help="the dtype of --write probs")
    p.add_argument("--dataset", choices=tuple(_LABELS), default="voc",
                   help="with --wsss and --write probs: 21 (voc) or 81 (coco) channels")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling pickled CAM files (only for files you trust)")
    p.add_argument("--device", default="cpu", help="where the CRF runs: cpu, cuda, cuda:1, or auto (under torchrun: "
                                                   "GPU LOCAL_RANK)")
    p.add_argument("--batch-size", type=T.batch_size, default=8, metavar="N",
                   help="images per CRF call (any sizes; same number of labels); 32-64 suit a GPU")
    p.add_argument("--workers", type=T.loader_workers, default=0, metavar="N",
                   help="processes that read and decode the inputs and encode and write the outputs (0: this one)")
    add_io_workers_argument(p)
    p.add_argument("--max-memory", type=T.max_memory, default=None, metavar="GIB",
                   help="the CRF's memory budget per batch in GiB (default: the CRF's own, 6 GiB)" + own)
    p.add_argument("--restart", action="store_true",
                   help="compute every file again (other settings too): the earlier run's record and outputs "
                        f"move to --out/{STALE_DIR}/<UTC time>-<run id>/ first")
    p.add_argument("--on-error", choices=ON_ERROR, default="stop",
                   help="a bad input file: stop at the first with one line naming it (exit 2), or skip it, go on, "
                        "list every skipped file on stderr at the end and exit 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: ``mars crf`` in ``mars --help``, and the head of its own ``--help``
HELP = "the dense CRF over a folder of a codebase's CAMs or of probability maps, in batches on the device"
DESCRIPTION = (
    "One label PNG (P mode, VOC palette) or (L, H, W) .npy of marginals per file of --cams (a codebase's "
    "CAMs, made into the CRF's input by its own rule) or --probs (probability maps, channel = class id), with"
    " its image of --images. Resumable, atomic writes; under torchrun the ranks share the files."
)

#: the flags of ``mars crf`` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)
add_arguments = add_crf_arguments
#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = CrfSettings
API = "mars_plugin.commands.crf_job:crf_job"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"cams": "cams_dir", "probs": "probs_dir", "images": "images_dir", "out": "out_dir",
                 "no_progress": "progress", "max_memory": "max_bytes"}
#: keywords no flag sets
PYTHON_ONLY = {"stems": "only these files of the folder (a caller's subset)"}
