"""``mars predict``'s settings: one frozen record (:class:`PredictSettings`), checked once where
it is made, built by the command line (:meth:`PredictSettings.from_args`, over the checkpoint's
recipe: :mod:`mars_plugin.commands.predict_recipe`) and taken field by field by
:func:`mars_plugin.commands.predict.predict_job`; and the command's flags
(:func:`add_predict_arguments`, ``HELP``, ``DESCRIPTION``; :mod:`mars_plugin.commands.cli_parser`
adds ``--threads``).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from mars_plugin._checks import MAX_BATCH_SIZE, check_int_param, check_real_param, check_scales
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.networks.inference import CLASS_THRESHOLD, CRF_CHOICES, CRF_IMAGES, DEFAULT_SCALES, _crf_params
from mars_plugin.networks.memory import MEMORY_FLAG
from mars_plugin.runs.errors import ON_ERROR

__all__ = ["PredictSettings", "add_predict_arguments", "FUSE_CHOICES"]

#: Where the scales' probabilities are averaged (:func:`~mars_plugin.commands.predict.predict_job`'s
#: ``fuse_at``; None: the network's own upstream's).
FUSE_CHOICES = ("input", "logits", "seam", "max-logits")


@dataclass(frozen=True)
class PredictSettings:
    """What ``mars predict`` does with a network (the keywords of
    :func:`~mars_plugin.commands.predict.predict_job`, which documents each): the mean softmax
    over ``scales`` (and their mirror images with ``flip``, fused at ``fuse_at``), then the CRF
    preset ``crf`` (None or ``"none"``: the argmax) over the classes exceeding
    ``class_threshold``, comparing the bytes ``crf_image``; ``batch_size`` images of one size per
    forward pass on ``device`` (``fp16``: under autocast); ``max_bytes``: the memory budget
    (``"auto"``, bytes or None); ``io_workers``: reading and writing threads (None: the device's
    default); ``on_error``: ``"stop"`` or ``"skip"`` a file that fails; ``progress``: a bar."""

    scales: Sequence[float] = DEFAULT_SCALES
    flip: bool = True
    crf: Optional[str] = "mars"
    class_threshold: float = CLASS_THRESHOLD
    crf_image: str = "file"
    fuse_at: Optional[str] = None
    batch_size: int = 4
    device: Any = "cpu"
    fp16: bool = False
    on_error: str = "stop"
    progress: bool = True
    max_bytes: Union[None, str, int] = "auto"
    io_workers: Optional[int] = None
    #: the CRF's parameters, resolved from ``crf`` (None: no CRF; set by the checks)
    params: Optional[Dict[str, float]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        put("scales", check_scales(self.scales))
        put("params", _crf_params(self.crf))
        put("class_threshold", check_real_param(self.class_threshold, "class_threshold", 0.0, 1.0))
        if self.crf_image not in CRF_IMAGES:
            raise ValueError(f"crf_image must be one of {CRF_IMAGES}, got {self.crf_image!r}")
        if self.fuse_at is not None and self.fuse_at not in FUSE_CHOICES:
            raise ValueError(f"fuse_at must be 'input', 'logits', 'seam', 'max-logits' or None, got {self.fuse_at!r}")
        put("batch_size", check_int_param(self.batch_size, "batch_size", 1, MAX_BATCH_SIZE))
        # crf: any preset of the CRF (a recipe's, e.g. seam's 'seam-seg'), the flag offers three
        T.check_fields(self, add_arguments, FLAG_KEYWORDS, wider=("crf",))

    def keywords(self) -> Dict[str, Any]:
        """The fields as :func:`~mars_plugin.commands.predict.predict_job`'s keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_args(cls, args: argparse.Namespace, meta: Optional[Mapping[str, Any]] = None) -> "PredictSettings":
        """``mars predict``'s parsed flags -> the settings (checked). ``meta``: the checkpoint's
        (:func:`~mars_plugin.commands.predict.load_model`): its recipe decides the inference flags
        not given (:func:`~mars_plugin.commands.predict_recipe.predict_settings`); None, as a
        checkpoint without a recipe: :data:`~mars_plugin.commands.predict_recipe.PLAIN_DEFAULTS`."""
        from mars_plugin.commands.predict_recipe import predict_settings

        return cls(**predict_settings(args, meta or {}), batch_size=args.batch_size, device=args.device,
                   fp16=args.fp16, on_error=args.on_error, progress=not args.no_progress,
                   max_bytes="auto" if args.max_memory is None else int(args.max_memory * 2 ** 30),
                   io_workers=args.io_workers)


_OWN_DEFAULT = "%(default).0s"  # no "(default: None)" where the help says what None means
_RECIPE = " (default: the checkpoint's recipe's; without one, %s)"


def add_predict_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars predict`` (defaults shown by an ``ArgumentDefaultsHelpFormatter``)."""
    _add_input_flags(p)
    _add_inference_flags(p)
    _add_run_flags(p)


def _add_input_flags(p: argparse.ArgumentParser) -> None:
    """The network and the folders: ``--model``, ``--which``, ``--images``/``--out`` or DHR's tree."""
    p.add_argument("--model", required=True, metavar="FILE",
                   help="a checkpoint written by mars train (read with weights_only=True: nothing is unpickled)"
                   + _OWN_DEFAULT)
    p.add_argument("--which", choices=("student", "teacher"), default=None,
                   help="the trained network or its EMA teacher (MARS runs only; --loss ce has none); default: "
                        "the checkpoint's recipe's (dhr: the teacher, as DHR predicts with its EMA weights), "
                        "the student for a checkpoint without a recipe" + _OWN_DEFAULT)
    p.add_argument("--images", default=None, metavar="DIR",
                   help="folder of RGB images <stem>.jpg/.png (or give --root)" + _OWN_DEFAULT)
    p.add_argument("--root", default=None, metavar="ROOT",
                   help="DHR's --root: predict <root>/<data>/<domain>/image/ (with --method: into DHR's WSS tree)"
                   + _OWN_DEFAULT)
    p.add_argument("--data", default=None,
                   help="dataset folder under --root (DHR's --data); default VOC2012" + _OWN_DEFAULT)
    p.add_argument("--domain", default=None,
                   help="split folder under <data> (DHR's --domain); default train_aug for VOC2012, else train"
                   + _OWN_DEFAULT)
    p.add_argument("--method", default=None, metavar="NAME",
                   help="with --root: write <root>/WSS/<data>/<NAME>/<domain>/<id>.png, where DHR's train.py --wss "
                        "NAME reads its masks (MARS masks: --method MARS)" + _OWN_DEFAULT)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder of <stem>.png labels (P mode, VOC palette); with --root: instead of --method"
                   + _OWN_DEFAULT)


def _add_inference_flags(p: argparse.ArgumentParser) -> None:
    """What is computed: the scales, flip and CRF (each defaulting to the checkpoint's recipe's)."""
    p.add_argument("--scales", type=T.seg_scales, default=None, metavar="S,S,...",
                   help="inference scales, comma-separated (RS+EPM's and DHR's evaluators: 1,0.5,1.5,2); the mean "
                        "softmax over scales (and flips) is taken"
                        + _RECIPE % ",".join(f"{s:g}" for s in DEFAULT_SCALES))
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="also predict each scale's mirror image and average it in" + _RECIPE % "on")
    p.add_argument("--crf", choices=CRF_CHOICES, default=None,
                   help="dense CRF on the mean softmax and the RGB image: mars (RS+EPM's DeepLab setting, Gaussian "
                        "1/3, bilateral 67/3/4, 10 iterations), psa (PSA/SEAM's 3/3, 80/13/10), or none (argmax)"
                        + _RECIPE % "mars")
    p.add_argument("--crf-image", choices=CRF_IMAGES, default=None,
                   help="the bytes the CRF compares: the image file's, or denormalized: the network's input turned "
                        "back to bytes by truncation, as DHR's and RS+EPM's evaluators do (13-30%% of the values one "
                        "below the file's)" + _RECIPE % "file")
    p.add_argument("--class-threshold", type=T.class_threshold, default=None, metavar="P",
                   help="classes whose probability exceeds this somewhere in an image are that image's CRF labels "
                        "(RS+EPM/DHR: 0.05; 0: every class)" + _RECIPE % CLASS_THRESHOLD)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How the run goes: batches, device, precision, memory, failures, threads, progress."""
    p.add_argument("--batch-size", type=T.batch_size, default=4, metavar="N",
                   help="images of one size per forward pass (each with its mirror); 16 suits a GPU")
    p.add_argument("--device", default="cpu",
                   help="where the network and the CRF run: cpu, cuda, cuda:1, or auto (under torchrun: GPU "
                        "LOCAL_RANK)")
    p.add_argument("--fp16", action="store_true",
                   help="the network under half-precision autocast: bfloat16 (float16 on GPUs without it); softmax, "
                        "mean and CRF stay float32")
    p.add_argument(MEMORY_FLAG, type=T.max_memory, default=None, metavar="GIB",
                   help="the memory budget in GiB: an image whose prediction (network over the scales and flips, "
                        "CRF) needs more is refused by name before any work (default: 80%% of the device's memory: "
                        "RAM on the CPU, the GPU's on cuda)" + _OWN_DEFAULT)
    p.add_argument("--on-error", choices=ON_ERROR, default="stop",
                   help="an unreadable image: stop at the first with one line naming it (exit 2), or skip it, go "
                        "on, list every skipped file on stderr at the end and exit 1")
    add_io_workers_argument(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: ``mars predict`` in ``mars --help``, and the head of its own ``--help``
HELP = (
    "a trained network's labels (mars train checkpoint): multi-scale + flip inference and the dense CRF, as "
    "the authors' evaluators"
)
DESCRIPTION = (
    "One P-mode PNG (VOC palette) per image: the mean softmax over --scales and flips, then the dense CRF "
    "over the classes exceeding --class-threshold (RS+EPM's and DHR's evaluators; sources in "
    "mars_plugin/networks/inference.py). --root/--method write DHR's WSS/<data>/<method>/<domain>/ (MARS "
    "masks, for train.py --wss). Resumable, atomic writes; under torchrun the ranks share the images."
)

#: the flags of ``mars predict``
add_arguments = add_predict_arguments
#: the record the flags build, and the Python function taking its fields as keywords
SETTINGS = PredictSettings
API = "mars_plugin.commands.predict:predict_job"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"images": "images_dir", "out": "out_dir", "no_progress": "progress", "max_memory": "max_bytes"}
#: flags no keyword takes: the command line turns them into the job's arguments
CLI_ONLY = {
    "model": "the checkpoint file: the command line loads the network (the keyword model) from it and records "
             "its identity (the keyword settings)",
    "which": "which weights of --model are loaded (student or teacher; recorded in the keyword settings)",
    "root": "DHR's tree: the command line resolves images_dir (and out_dir with --method) in it",
    "data": "with --root: the dataset folder images_dir and out_dir are resolved in",
    "domain": "with --root: the split folder images_dir and out_dir are resolved in",
    "method": "with --root: out_dir is DHR's WSS/<data>/<method>/<domain>/",
}
#: keywords no flag sets
PYTHON_ONLY = {
    "model": "the network itself (mars predict loads it from the checkpoint --model names)",
    "fuse_at": "where the scales are fused; mars predict leaves it to the network's own upstream (None)",
    "preprocess": "the network's input from the image bytes; mars predict takes the network's default",
    "num_classes": "the classes the network must output; mars predict reads them from the checkpoint",
    "images_flag": "the flag naming images_dir in messages (mars predict: --images or --root)",
}
