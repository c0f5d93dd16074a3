"""The settings of one ``mars reproduce`` run: :class:`ReproduceSettings`, a frozen record that the
command line builds (:meth:`ReproduceSettings.from_args`), the Python API takes
(:func:`~mars_plugin.commands.reproduce.run_reproduce`; :func:`~mars_plugin.commands.reproduce.reproduce`
builds it from keywords) and ``reproduce.json`` stores (:meth:`ReproduceSettings.identity`).

Validated once, in two steps: the record checks every value when it is made (the error names
the parameter, the value it got and what was expected; nothing is read), and :func:`prepare`
checks it against the disk before any stage runs (an output apart from every input, the
folders of DHR's tree, the model files or the given features) and resolves what the disk
decides (the default ``domain``, the class names, the pseudo-labelled ids, the reference
folders, the identity of the model files).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from mars_plugin._checks import describe
from mars_plugin.adapters.uss.extractor import USS_MODELS
from mars_plugin.adapters.uss.multiscale import DHR_SCALES
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import add_selection_arguments, crf_params_argument

__all__ = ["ReproduceSettings", "ReproduceInputs", "TRAIN_PLAN_KEYS", "default_domain", "prepare"]

PathLike = Union[str, os.PathLike]

#: The keys of ``ReproduceSettings.train`` (the ``--train`` options the plan checks first).
TRAIN_PLAN_KEYS = ("val_domain", "weights", "arch", "backbone", "masks")
_PATHS = ("root", "pseudo_dir", "out_dir")
_OPTIONAL_PATHS = ("checkpoint", "backbone", "heads", "features_dir")
_BOOLS = ("trust_pickle", "flip", "fp16", "references")


def default_domain(data: str, root: Optional[PathLike] = None) -> str:
    """DHR's training split of ``data``: ``train_aug`` for VOC2012 (RS+EPM's layout) and for any
    tree that has a ``<root>/<data>/train_aug`` folder, ``train`` for COCO2014 and DHR's other sets
    (DHR's README, "Preparing datasets")."""
    if data == "VOC2012" or (root is not None and (Path(root) / data / "train_aug").is_dir()):
        return "train_aug"
    return "train"


@dataclass(frozen=True)
class ReproduceSettings:
    """What one ``mars reproduce`` run is (its flags, one field each; see ``mars reproduce --help``).

    root: the folder holding ``<data>/<domain>/{image,mask,xml}`` (DHR's ``--root``) and,
    optionally, ``WSS/<data>/<method>/<domain>/`` (other methods' masks: the yardstick).
    pseudo_dir: the WSSS method's pseudo labels, one PNG per image id (RS+EPM:
    ``experiments/pseudo-labels/<tag>/train``; DHR: ``<root>/WSS/<data>/RSEPM/<domain>``); P- or
    L-mode PNGs of class ids (0 background, 255 ignore). out_dir: everything the run writes.

    uss, checkpoint, backbone, heads, trust_pickle: the USS model, exactly as ``mars features``
    takes it (:func:`~mars_plugin.adapters.uss.extractor.load_extractor`): ``stego`` from a
    Lightning ``checkpoint`` (a pickle: needs ``trust_pickle``) or from DINO's backbone + DHR's
    ``STEGO_<data>.pt``; ``cause`` from DINOv2's backbone + DHR's ``CAUSE_<data>.pt`` or CAUSE's
    own release; ``dinov2`` from one ``backbone``; ``leopart`` from a ``checkpoint``. Or instead
    features_dir: a folder of ``<id>.pt``/``<id>.npy`` features already computed.

    data, domain: DHR's ``--data`` and ``--domain`` (None: :func:`default_domain`, resolved by
    :func:`prepare`). scales, flip: the features' multi-scale inference (None: DHR's 2, 1, 1.5,
    0.5; and the flip). alpha, k_fg, k_bg, seed: Eq. 1-3 (the paper's 0.4, 2, 2). refine,
    crf_params: Eq. 5's refinement (see ``mars debias``). device, fp16, feature_batch_size: where
    the features and the K-means/CRF run; batch_size, workers: images per CRF call, debias
    processes. num_examples: overlays in the report. references: score the other method folders
    of ``<root>/WSS/<data>/``. on_error: ``"stop"`` or ``"skip"`` a bad input file. train: the
    ``--train`` options the run is followed by (:data:`TRAIN_PLAN_KEYS`), for the plan: their
    inputs are checked first too; None without ``--train``.

    Paths are kept as the strings given (a ``Path`` as its ``str``), so that messages name them
    as the user wrote them and the command line's record equals the API's.
    """

    root: str
    pseudo_dir: str
    out_dir: str
    uss: str = "stego"
    checkpoint: Optional[str] = None
    backbone: Optional[str] = None
    heads: Optional[str] = None
    trust_pickle: bool = False
    features_dir: Optional[str] = None
    data: str = "VOC2012"
    domain: Optional[str] = None
    scales: Tuple[float, ...] = DHR_SCALES
    flip: bool = True
    alpha: float = 0.4
    k_fg: int = 2
    k_bg: int = 2
    seed: int = 0
    refine: str = "crf"
    crf_params: Union[str, Dict[str, Any]] = "mars"
    device: str = "cpu"
    fp16: bool = False
    feature_batch_size: int = 1
    batch_size: int = 8
    workers: int = 1
    num_examples: int = 8
    references: bool = True
    on_error: str = "stop"
    train: Optional[Dict[str, Any]] = None

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    def identity(self, model_files: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """The run's settings as ``reproduce.json`` records them: what changes a result. The
        paths resolved; with the model (``model_files``: :func:`prepare`'s identity of its files,
        ``trust_pickle`` included) its scales, flip and fp16, else the given ``features``. Left
        out, since no output depends on them: device, batch sizes, workers, num_examples,
        on_error, references (the reference folders have their own digest), train. The keys
        and their form are those of every earlier ``mars``, so a recorded run resumes."""
        if self.domain is None:
            raise ValueError("identity() needs the domain resolved (prepare() resolves it)")
        out: Dict[str, Any] = {
            "root": os.fspath(Path(self.root).resolve()), "data": self.data, "domain": self.domain,
            "pseudo": os.fspath(Path(self.pseudo_dir).resolve()), "alpha": self.alpha, "k_fg": self.k_fg,
            "k_bg": self.k_bg, "seed": self.seed, "refine": self.refine, "crf_params": self.crf_params,
        }
        if model_files is None:
            out["features"] = os.fspath(Path(self.features_dir).resolve())
        else:
            out.update(model_files, scales=list(self.scales), flip=self.flip, fp16=self.fp16)
        return out

    def model(self) -> Optional[Dict[str, Any]]:
        """The USS model as the plan loads it (None with ``features_dir``)."""
        if self.features_dir is not None:
            return None
        return dict(uss=self.uss, checkpoint=self.checkpoint, backbone=self.backbone, heads=self.heads,
                    trust_pickle=self.trust_pickle, scales=self.scales, flip=self.flip)

    @classmethod
    def from_args(cls, args: Any) -> "ReproduceSettings":
        """``mars reproduce``'s parsed flags (:mod:`mars_plugin.commands.cli_parser`) -> the record
        (checked). ``--train``'s options the plan checks first are ``train`` (None without ``--train``)."""
        plan = dict(val_domain=args.val_domain, weights=args.weights, arch=args.arch, backbone=args.train_backbone,
                    masks=not args.no_masks)
        return cls(
            args.root, args.pseudo, args.out, uss=args.uss, checkpoint=args.checkpoint, backbone=args.backbone,
            heads=args.heads, trust_pickle=args.trust_pickle, features_dir=args.features, data=args.data,
            domain=args.domain, scales=args.scales, flip=not args.no_flip, alpha=args.alpha, k_fg=args.k_fg,
            k_bg=args.k_bg, seed=args.seed, refine=args.refine, crf_params=args.crf_params, device=args.device,
            fp16=args.fp16, batch_size=args.batch_size, workers=args.workers, num_examples=args.num_examples,
            references=not args.no_references, on_error=args.on_error, train=plan if args.train else None)


def _checked(s: ReproduceSettings) -> Dict[str, Any]:
    """Every field of ``s`` checked, in the order of the earlier ``reproduce()``'s checks (Eq. 1-3
    and the sizes first), and converted: paths to ``str``, scales to a tuple of floats."""
    from mars_plugin._checks import check_scales
    from mars_plugin.runs.errors import _check_on_error
    from mars_plugin.commands.inputs import check_job_params
    from mars_plugin.engines.crf_params import check_crf_params

    out = check_job_params(alpha=s.alpha, k_fg=s.k_fg, k_bg=s.k_bg, seed=s.seed,
                           feature_batch_size=s.feature_batch_size, batch_size=s.batch_size, workers=s.workers,
                           num_examples=s.num_examples)
    for name in _PATHS + _OPTIONAL_PATHS:
        out[name] = _path(getattr(s, name), name, optional=name in _OPTIONAL_PATHS)
    for name in _BOOLS:
        if not isinstance(getattr(s, name), bool):
            raise TypeError(f"{name} must be True or False, got {describe(getattr(s, name))}")
    for name in ("data", "domain", "device"):
        value = getattr(s, name)
        if not (value is None and name == "domain") and not (isinstance(value, str) and value):
            raise TypeError(f"{name} must be a non-empty string, got {describe(value)}")
    if s.uss not in USS_MODELS:
        raise ValueError(f"--uss must be one of {', '.join(USS_MODELS)}, got {s.uss!r}")
    if s.refine not in ("crf", "threshold"):  # debias_job's words, said before any stage
        raise ValueError(f"refine must be 'crf' or 'threshold', got {s.refine!r}")
    check_crf_params(s.crf_params)
    out["crf_params"] = dict(s.crf_params) if isinstance(s.crf_params, Mapping) else s.crf_params
    _check_on_error(s.on_error)
    out["scales"] = DHR_SCALES if s.scales is None else check_scales(s.scales)
    out["train"] = _train_plan(s.train)
    return out


def _path(value: Any, name: str, optional: bool) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a path (a str or os.PathLike){' or None' if optional else ''}, "
                        f"got {describe(value)}")
    return os.fspath(value)


def _train_plan(train: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    if train is None:
        return None
    if not isinstance(train, Mapping):
        raise TypeError(f"train must be a dict of --train options or None, got {describe(train)}")
    unknown = sorted(set(train) - set(TRAIN_PLAN_KEYS))
    if unknown:
        raise ValueError(f"train has the unknown key {unknown[0]!r}; expected some of {list(TRAIN_PLAN_KEYS)}")
    return dict(train)


@dataclass(frozen=True)
class ReproduceInputs:
    """What :func:`prepare` found on disk for a record (``settings``, its domain resolved):
    DHR's tree (``layout``), the class names (background first), the pseudo-labelled ids
    (``stems``), the features folder read (``feats``: given, or ``<out>/features``), the run's
    identity and that of ``<out>/features`` (``feature_settings``, None when given), the
    reference folders and the notes on those left out."""

    settings: ReproduceSettings
    layout: Any
    class_names: List[str]
    stems: List[str]
    feats: Path
    identity: Dict[str, Any]
    feature_settings: Optional[Dict[str, Any]]
    references: Dict[str, Path]
    reference_notes: List[str]

    @property
    def out(self) -> Path:
        return Path(self.settings.out_dir)

    @property
    def num_classes(self) -> int:
        return len(self.class_names) - 1

    def dirs(self) -> Tuple[Path, Path, Path]:
        """The domain's image, mask and xml folders."""
        d = self.settings.domain
        return Path(self.layout.image_dir(d)), Path(self.layout.mask_dir(d)), Path(self.layout.xml_dir(d))


def prepare(s: ReproduceSettings) -> ReproduceInputs:
    """``s`` checked against the disk, before anything is computed or written (see the module
    docstring); each refusal names the flag, what it got and what was expected."""
    from mars_plugin.adapters.wsss.dhr_layout import DHRLayout
    from mars_plugin.runs.distributed import resolve_device
    from mars_plugin.commands.inputs import check_out_apart, root_reads
    from mars_plugin.commands.references import find_references
    from mars_plugin.formats.files import list_stems

    s = replace(s, domain=default_domain(s.data, s.root) if s.domain is None else s.domain)
    check_out_apart(s.out_dir, "--out", {"--root": root_reads(s.root, s.data, [s.domain], s.references),
                                         "--pseudo": s.pseudo_dir, "--features": s.features_dir,
                                         "--checkpoint": s.checkpoint, "--backbone": s.backbone, "--heads": s.heads})
    _check_source(s)
    resolve_device(s.device)  # a bad or absent device before the features, not after them
    layout = DHRLayout(s.root, s.data)
    for d in (layout.image_dir(s.domain), layout.mask_dir(s.domain), layout.xml_dir(s.domain)):
        if not Path(d).is_dir():
            raise ValueError(f"--root {s.root}: {d} is not a folder; expected <root>/{s.data}/{s.domain}/"
                             "{image,mask,xml} (DHR's layout)")
    pseudo = Path(s.pseudo_dir)
    if not pseudo.is_dir():
        raise ValueError(f"--pseudo {s.pseudo_dir}: {'not a folder' if pseudo.exists() else 'no such folder'}"
                         "; expected a folder of pseudo-label PNGs")
    class_names = list(layout.class_names())
    stems = list_stems(pseudo, (".png",))
    if not stems:
        raise ValueError(f"--pseudo {s.pseudo_dir}: no .png pseudo labels")
    model_files, feats = _features_source(s)
    feature_settings = None if model_files is None else dict(model_files, scales=list(s.scales), flip=s.flip,
                                                               dhr=True)
    refs, notes = (find_references(layout.root / "WSS" / s.data, s.domain, s.pseudo_dir) if s.references
                   else ({}, []))
    return ReproduceInputs(s, layout, class_names, stems, feats, s.identity(model_files), feature_settings, refs,
                           list(notes))


def _check_source(s: ReproduceSettings) -> None:
    """The model files or the given features: one of the two."""
    given = [f for f, v in (("--checkpoint", s.checkpoint), ("--backbone", s.backbone), ("--heads", s.heads)) if v]
    if s.features_dir is not None and given:
        raise ValueError(f"give either the USS model files ({', '.join(given)}) or --features (features already "
                         "computed), not both")
    if s.features_dir is None and not given:
        raise ValueError("give the USS model files (--uss with --checkpoint FILE, or --backbone FILE [--heads "
                         "FILE], as mars features takes them) or --features (features already computed)")


def _features_source(s: ReproduceSettings) -> Tuple[Optional[Dict[str, Any]], Path]:
    """(the identity of the model files and ``trust_pickle``, ``<out>/features``) when the run
    computes its features, (None, the given folder) with ``features_dir``."""
    from mars_plugin.runs.identities import model_files_id
    from mars_plugin.formats.files import list_stems

    if s.features_dir is None:
        for flag in ("checkpoint", "backbone", "heads"):
            f = getattr(s, flag)
            if f is not None and not Path(f).exists():
                raise ValueError(f"--{flag} {f}: no such file or folder")
        model = model_files_id(s.uss, s.checkpoint, s.backbone, s.heads)
        model["trust_pickle"] = s.trust_pickle
        return model, Path(s.out_dir) / "features"
    feats = Path(s.features_dir)
    if not feats.is_dir():
        raise ValueError(f"--features {s.features_dir}: not a folder")
    if not list_stems(feats, (".npy", ".pt")):
        raise ValueError(f"--features {s.features_dir}: no .npy or .pt feature files in this folder")
    return None, feats


#: ``mars reproduce`` in ``mars --help``, and the head of its own ``--help``
HELP = (
    "the paper's setting end to end on DHR's folder tree (VOC2012, COCO2014), with the paper's figures and "
    "the other methods' masks beside"
)
DESCRIPTION = (
    "On <root>/<data>/<domain>/{image,mask,xml} (DHR's layout): USS features with DHR's multi-scale inference"
    " (the model files as 'mars features' takes them), centroids, debias, evaluation of the pseudo and the "
    "debiased labels against <domain>/mask and of every other method folder of <root>/WSS/<data>/ (e.g. the "
    "authors' MARS masks) with its agreement with ours, and report.md with the paper's published figures "
    "beside. Every stage resumes; --out remembers its settings. Under torchrun the ranks share every stage."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars reproduce`` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
    _add_model_flags(p)
    _add_data_flags(p)
    _add_stage_flags(p)
    _add_train_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The tree, the labels, the output and the USS model (its files, or its features given)."""
    from mars_plugin.commands.features import _OWN_DEFAULT

    p.add_argument("--root", required=True, help="folder holding <data>/<domain>/{image,mask,xml} (DHR's --root)")
    p.add_argument("--pseudo", required=True, help="folder of pseudo-label PNGs (e.g. <root>/WSS/VOC2012/RSEPM/train_aug)")
    p.add_argument("--out", required=True, help="output folder (features, centroids, debiased labels, report.md)")
    p.add_argument("--uss", choices=USS_MODELS, default="stego",
                   help="the USS model (paper: stego; DHR: cause), loaded exactly as by 'mars features'")
    p.add_argument("--checkpoint", default=None,
                   help="STEGO Lightning .ckpt (e.g. cocostuff27_vit_base_5.ckpt; a pickle: needs --trust-pickle) "
                        "or Leopart .ckpt" + _OWN_DEFAULT)
    p.add_argument("--backbone", "--uss-backbone", dest="backbone", default=None,
                   help="DINO's dino_vitbase8_pretrain.pth (stego, with --heads) or DINOv2's "
                        "dinov2_vit?14_pretrain.pth (cause with --heads; dinov2 alone); weights_only" + _OWN_DEFAULT)
    p.add_argument("--heads", "--uss-heads", dest="heads", default=None,
                   help="DHR's STEGO_<data>.pt or CAUSE_<data>.pt, or CAUSE's own release (see docs/adapters.md); "
                        "weights_only" + _OWN_DEFAULT)
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling --checkpoint (STEGO's and Lightning's .ckpt files need it); only for "
                        "files you trust")
    p.add_argument("--features", default=None,
                   help="instead of the model files: a folder of <id>.pt/.npy features already computed "
                        "(e.g. <root>/VOC2012/train_aug/STEGO from DHR's produce_uss_features.py)" + _OWN_DEFAULT)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """Which split of the tree, and the features' scales and flip (DHR's inference)."""
    from mars_plugin.commands.features import _OWN_DEFAULT, scales_argument

    p.add_argument("--data", default="VOC2012", help="dataset folder under --root (DHR's --data: VOC2012, COCO2014)")
    p.add_argument("--domain", default=None,
                   help="split folder under <data> (DHR's --domain; default: train_aug for VOC2012, train "
                        "otherwise)" + _OWN_DEFAULT)
    p.add_argument("--scales", type=scales_argument, default=DHR_SCALES,
                   help="feature scales, comma-separated; the first sets the feature grid (DHR's inference)")
    p.add_argument("--no-flip", action="store_true", help="no flip averaging of the features")


def _add_stage_flags(p: argparse.ArgumentParser) -> None:
    """Eq. 1-5's settings and how the stages run."""
    add_selection_arguments(p)
    p.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="dense CRF or a plain threshold")
    p.add_argument("--crf-params", type=crf_params_argument, default="mars", help="dense-CRF preset or JSON dict (see debias)")
    p.add_argument("--device", default="cpu",
                   help="where features, K-means and CRF run: cpu, cuda, cuda:1, or auto (under torchrun: GPU "
                        "LOCAL_RANK)")
    p.add_argument("--fp16", action="store_true", help="features under float16 autocast (GPUs)")
    p.add_argument("--batch-size", type=T.batch_size, default=8, help="images per CRF call (64 suits a GPU)")
    p.add_argument("--workers", type=T.workers, default=1, help="debias processes on the CPU (one thread each)")
    p.add_argument("--num-examples", type=T.num_examples, default=8, help="most-changed images shown in the report")
    p.add_argument("--no-references", action="store_true",
                   help="do not score the other method folders of <root>/WSS/<data>/")
    p.add_argument("--dry-run", action="store_true",
                   help="check the tree and say what each stage would read and write, computing and writing "
                        "nothing (exit 1 when it finds a mismatch)")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a bad input file: stop with its name (exit 2), or skip it, name it and exit 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """The second step (``--train``): its flags are ``mars train``'s."""
    tr = p.add_argument_group("the second step (--train): mars train on the debiased labels, mars predict")
    tr.add_argument("--train", action="store_true",
                    help="then train the segmentation network on the debiased labels (out/train), predict and score "
                         "the validation split (out/val_pred, scores_trained.json) and write the MARS masks of the "
                         "training split (out/masks); each stage resumes")
    # each left out is the dhr recipe's, as mars train's (deeplabv3+dhr resnet101, 100 epochs of 16 512 crops, lr 1e-3)
    tr.add_argument("--arch", choices=("deeplabv3+dhr", "deeplabv3+", "deeplabv2"), default=None,
                    help="as mars train --arch (default: the dhr recipe's, deeplabv3+dhr)")
    tr.add_argument("--train-backbone", choices=("resnet18", "resnet50", "resnet101"), default=None,
                    help="as mars train --backbone (default: resnet101)")
    tr.add_argument("--weights", default=None, help="as mars train --weights (ImageNet ResNet, torchvision layout)")
    tr.add_argument("--iterations", type=T.iterations, default=None,
                    help="as mars train --iterations (default: the recipe's 100 epochs)")
    tr.add_argument("--train-batch-size", type=T.batch_size, default=None, help="as mars train --batch-size (16)")
    tr.add_argument("--crop", type=T.crop, default=None, help="as mars train --crop (512)")
    tr.add_argument("--min-size", type=T.image_side, default=None, help="as mars train --min-size (320)")
    tr.add_argument("--max-size", type=T.image_side, default=None, help="as mars train --max-size (640)")
    tr.add_argument("--lr", type=T.lr, default=None, help="as mars train --lr (1e-3)")
    tr.add_argument("--loader-workers", type=T.loader_workers, default=2, help="as mars train --workers")
    tr.add_argument("--val-domain", default="validation",
                    help="the split scored after training (<root>/<data>/<val-domain>/{image,mask}; DHR: validation)")
    tr.add_argument("--no-masks", action="store_true", help="do not predict the training split (the MARS masks)")


#: the record the flags build, and the Python function taking its fields as keywords
#: (:func:`~mars_plugin.commands.reproduce.reproduce` builds it from them)
SETTINGS = ReproduceSettings
API = "mars_plugin.commands.reproduce:reproduce"
_SECOND_STEP = "--train's second step only (train_after_reproduce's train_options, as mars train's flag)"
#: flag dest -> Python keyword, where the names differ; --train and the --train options the plan
#: checks first (TRAIN_PLAN_KEYS) make ``train=``, and also drive the second step
#: (:func:`~mars_plugin.commands.reproduce_train.train_after_reproduce`: arch, backbone, weights,
#: val_domain, masks)
FLAG_KEYWORDS = {"pseudo": "pseudo_dir", "out": "out_dir", "features": "features_dir", "no_flip": "flip",
                 "no_references": "references", "no_progress": "progress",
                 "val_domain": "train", "weights": "train", "arch": "train", "train_backbone": "train",
                 "no_masks": "train"}
#: flags no keyword of reproduce() takes: mars train's options of the second step
CLI_ONLY = {"iterations": _SECOND_STEP, "train_batch_size": _SECOND_STEP, "crop": _SECOND_STEP,
            "min_size": _SECOND_STEP, "max_size": _SECOND_STEP, "lr": _SECOND_STEP, "loader_workers": _SECOND_STEP}
#: keywords no flag sets
PYTHON_ONLY = {
    "feature_batch_size": "images per feature batch of a Python caller (the command's: 1, DHR's inference)",
    "log": "where a Python caller's progress lines go (the command's: print)",
}
