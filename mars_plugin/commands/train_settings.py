"""``mars train``'s settings: one frozen record, validated once, resolved against a recipe.

The command line builds it (:meth:`TrainSettings.from_args`), the API takes it
(:func:`mars_plugin.commands.train.train` builds one from its keywords), and the run's identity
stores it (:meth:`TrainSettings.record`: the ``settings`` of ``checkpoint.pt`` and ``train.json``,
compared on a resume by :func:`mars_plugin.commands.train_data.open_run` on :data:`RUN_KEYS`;
:meth:`TrainSettings.from_record` reads it back).

A run starts from a recipe (:mod:`mars_plugin.networks.recipes`, ``recipe="dhr"`` by default):
each recipe field that is also a field here (:data:`RECIPE_FIELDS`: the network, the schedule,
the optimizer, the crop) is the recipe's unless given, and a given one is an *override*, named
in ``overrides`` and recorded. ``epochs`` (DHR's unit) or ``iterations``: the iterations of a
run by epochs follow from the number of images (:meth:`TrainSettings.iterations_for`).

Fields are of two more kinds (``metadata["run"]``): what the run *is* (recorded and, in
:data:`RUN_KEYS`, compared) and how this process runs it (device, data-loading workers,
checkpoint and log cadence, memory budget: not recorded, free to change on a resume).

The MARS loss's own settings (``refine``, ``crf_params``, ``ema``:
:data:`~mars_plugin.commands.recipe_uses.LOSS_DEFAULTS`) are the paper's unless given, the
same way: left out, the field (and the flag) holds a
:class:`~mars_plugin.commands.recipe_uses.PaperDefault`, resolved here; one given is named in
``overrides`` too, so that a value given where the run would not read it (``loss="ce"``: plain
CE has no teacher) is refused (:func:`~mars_plugin.commands.recipe_uses.check_used`) instead of
dropped.

The record holds every key ``mars train`` wrote before recipes (same names, same values for
the same run: ``weights`` as the file's base name, ``refine``/``crf_params``/``ema`` None for
``loss="ce"``) plus ``recipe``, ``overrides`` (the recipe's fields given: a run records the
same whether the paper's 0.999 was typed or left out) and the recipe's resolved fields; a checkpoint
written before recipes has no ``recipe`` and is refused on a resume as another run (``recipe:
None -> 'dhr'``; ``--restart`` or another ``--out``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from mars_plugin._checks import check_int_param, check_num_classes, check_real_param, check_seed
from mars_plugin.commands import cli_types as T
from mars_plugin.commands.cli_flags import crf_params_argument
from mars_plugin.commands.recipe_uses import LOSS_DEFAULTS, PaperDefault
from mars_plugin.networks.recipes import (DEFAULT_RECIPE, RECIPE_NAMES, Recipe, get_recipe, iterations_for_epochs,
                                          recipe_to_dict)
from mars_plugin.runs.output_aside import STALE_DIR

__all__ = ["TrainSettings", "RUN_KEYS", "RECIPE_FIELDS", "TRAIN_DEFAULTS", "missing_piece"]

#: The recipe's fields a run may override one by one (``--lr``, ``--epochs``, ...; None: the recipe's).
RECIPE_FIELDS = ("arch", "backbone", "output_stride", "bn", "epochs", "iterations", "batch_size", "iter_size",
                 "crop", "min_size", "max_size", "optimizer", "lr", "momentum", "weight_decay", "poly_power",
                 "lr_step", "loss_grid", "lr_mults", "decay")

#: The settings whose change makes a checkpoint in ``--out`` belong to another run (the ids,
#: folders and files are compared by :func:`~mars_plugin.commands.train_data.data_diff`).
RUN_KEYS = ("recipe", "arch", "backbone", "output_stride", "num_classes", "loss", "refine", "crf_params",
            "iterations", "epochs", "batch_size", "iter_size", "crop", "min_size", "max_size", "lr", "momentum",
            "weight_decay", "ema", "poly_power", "lr_step", "lr_mults", "decay", "loss_grid", "seed", "bn",
            "optimizer", "weights", "normalization", "augmentation", "nesterov", "bn_momentum", "bn_head",
            "bn_affine", "frozen_layers", "poly_max_offset", "drop_last", "msc_scales")

_RUN = {"run": True}  # a field of how this process runs, not of what the run is
# the recipe's augmentation_params names of min_size / max_size (DHR's --min_image / --max_image)
_AUG_NAMES = {"min_size": "min_image", "max_size": "max_image"}


@dataclass(frozen=True)
class TrainSettings:
    """What one ``mars train`` run is, checked (each bad value named: ``lr must be ...``).

    ``recipe`` names the codebase whose training the run follows; the fields of
    :data:`RECIPE_FIELDS` left None are the recipe's (after construction they hold the resolved
    values, and ``overrides`` names those that were given). ``output_stride``/``bn`` given as
    None stay the recipe's; ``refine="none"`` is None; with ``loss="ce"`` ``refine``,
    ``crf_params`` and ``ema`` are None (the baseline has no teacher): a value given for one of
    them is refused (None is no value), as ``crf_params`` with ``refine`` None. Of ``epochs`` and
    ``iterations`` one is set.

    The fields: ``arch, backbone, output_stride``: see :func:`mars_plugin.networks.deeplab.build_model`;
    ``weights``: a torchvision-layout ImageNet ResNet file (read weights-only), None: random init;
    ``loss``: ``"mars"`` (EMA teacher + complement + WCE) or ``"ce"`` (plain CE, the baseline);
    ``refine``: the teacher's refinement, ``"crf"`` (the paper's) or None; ``bn``: ``"train"``
    (batch statistics, as RS+EPM and DHR), ``"frozen"`` (running statistics and affine weights
    fixed, as deeplab-pytorch's ``freeze_bn``, main.py:206-208 at 4219467; N processes then
    compute exactly the step of one) or ``"sync"`` (SyncBatchNorm over torchrun's processes,
    CUDA only); ``optimizer``: ``"sgd"`` or ``"adamw"`` (betas 0.9/0.999, the same groups,
    decoupled weight decay: not the paper's, but a network trained from random initialisation
    on a small set learns in far fewer steps); ``lr_mults``/``decay``: per group (backbone
    weight, backbone bias, head weight, head bias); ``lr_step``: the poly rate is recomputed
    every ``lr_step`` steps; ``iter_size``: batches whose gradients add up to one step;
    ``loss_grid``: see the recipe; ``amp``: mixed precision on CUDA (ignored on the CPU);
    ``device``: ``"auto"`` (CUDA if available; under torchrun the process's ``LOCAL_RANK``),
    ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``workers``: data-loading processes per training
    process; ``max_bytes``: the memory budget of one process (``--max-memory``): ``"auto"`` (80%
    of the device's memory), bytes, or None; a step that needs more
    (:func:`mars_plugin.networks.memory.train_memory_bytes`) is refused before any work.
    """

    num_classes: int
    recipe: str = DEFAULT_RECIPE
    arch: Optional[str] = None
    backbone: Optional[str] = None
    output_stride: Optional[int] = None
    weights: Optional[str] = None
    bn: Optional[str] = None
    loss: str = "mars"
    refine: Optional[str] = LOSS_DEFAULTS["refine"]  # type: ignore[assignment]
    crf_params: Union[str, Mapping[str, Any], None] = LOSS_DEFAULTS["crf_params"]  # type: ignore[assignment]
    ema: Optional[float] = LOSS_DEFAULTS["ema"]  # type: ignore[assignment]
    epochs: Optional[int] = None
    iterations: Optional[int] = None
    batch_size: Optional[int] = None
    iter_size: Optional[int] = None
    crop: Optional[int] = None
    min_size: Optional[int] = None
    max_size: Optional[int] = None
    optimizer: Optional[str] = None
    lr: Optional[float] = None
    momentum: Optional[float] = None
    weight_decay: Optional[float] = None
    poly_power: Optional[float] = None
    lr_step: Optional[int] = None
    loss_grid: Optional[str] = None
    lr_mults: Optional[Tuple[float, float, float, float]] = None
    decay: Optional[Tuple[bool, bool, bool, bool]] = None
    seed: int = 0
    amp: bool = True
    device: str = field(default="auto", metadata=_RUN)
    workers: int = field(default=2, metadata=_RUN)
    save_every: int = field(default=1000, metadata=_RUN)
    log_every: int = field(default=10, metadata=_RUN)
    max_bytes: Union[None, str, int] = field(default="auto", metadata=_RUN)
    #: the fields given of those with a default of their own: the recipe's (in
    #: :data:`RECIPE_FIELDS` order; recorded), then the loss's (``LOSS_DEFAULTS``): set by the checks
    overrides: Tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        rec = self.spec
        put("overrides", tuple(k for k in RECIPE_FIELDS if getattr(self, k) is not None)
            + tuple(k for k in LOSS_DEFAULTS if not isinstance(getattr(self, k), PaperDefault)))
        for k in LOSS_DEFAULTS:
            if isinstance(getattr(self, k), PaperDefault):
                put(k, getattr(self, k).value)
        if self.epochs is not None and self.iterations is not None:
            raise ValueError(f"epochs and iterations: give one, got epochs={self.epochs}, iterations={self.iterations}")
        aug = dict(rec.augmentation_params)
        for k in RECIPE_FIELDS:
            if getattr(self, k) is None and not (k in ("epochs", "iterations") and self.overrides_schedule):
                put(k, aug.get(_AUG_NAMES[k], 320 if k == "min_size" else 640) if k in _AUG_NAMES
                    else getattr(rec, k))
        self._check(put)
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)
        from mars_plugin.commands.recipe_uses import check_used  # looked up here: tests lift it

        check_used(self)  # an override the recipe's run (or its loss) would not read is refused, naming it
        # what the run does not use is None, as the record has always said (a value given for it
        # was refused just above)
        mars = self.loss == "mars"
        put("refine", None if not mars or self.refine == "none" else self.refine)
        put("crf_params", self.crf_params if mars and self.refine else None)
        put("ema", self.ema if mars else None)

    @property
    def overrides_schedule(self) -> bool:
        return "epochs" in self.overrides or "iterations" in self.overrides

    def _check(self, put: Any) -> None:
        from mars_plugin.networks.deeplab import ARCHS, BACKBONES, OUTPUT_STRIDES
        from mars_plugin.networks.recipe_checks import CHOICES
        from mars_plugin.networks.seg_data import Augmentation

        put("num_classes", check_num_classes(self.num_classes))
        if self.loss not in ("mars", "ce"):
            raise ValueError(f"loss must be 'mars' or 'ce', got {self.loss!r}")
        if self.refine not in (None, "crf", "none"):
            raise ValueError(f"refine must be 'crf' or None, got {self.refine!r}")
        for name in ("epochs", "iterations"):
            if getattr(self, name) is not None:
                put(name, check_int_param(getattr(self, name), name, 1))
        for name in ("batch_size", "iter_size", "lr_step", "save_every", "log_every"):
            put(name, check_int_param(getattr(self, name), name, 1))
        put("workers", T.loader_workers.check(self.workers, "workers"))  # the flag's bounds (None refused)
        put("seed", check_seed(self.seed))
        put("lr", check_real_param(self.lr, "lr", 0.0, 10.0, low_open=True))
        put("momentum", check_real_param(self.momentum, "momentum", 0.0, 1.0, high_open=True))
        put("weight_decay", check_real_param(self.weight_decay, "weight_decay", 0.0, 1.0))
        if self.ema is not None or self.loss == "mars":
            put("ema", check_real_param(self.ema, "ema", 0.0, 1.0))
            if self.ema == 1.0:  # Sec. 3.4's EMA with momentum 1 never moves the teacher
                raise ValueError("ema must be in [0, 1), got 1.0: momentum 1 keeps the teacher at its random "
                                 "initialisation (the paper's is 0.999)")
        put("poly_power", check_real_param(self.poly_power, "poly_power", 0.0, 10.0))
        Augmentation(crop=self.crop, min_size=self.min_size, max_size=self.max_size)  # its checks, its messages
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        for name, choices in (("arch", ARCHS + CHOICES["arch"]), ("backbone", BACKBONES + CHOICES["backbone"]),
                              ("loss_grid", CHOICES["loss_grid"])):
            if getattr(self, name) not in dict.fromkeys(choices):
                raise ValueError(f"{name} must be one of {', '.join(map(repr, dict.fromkeys(choices)))}, "
                                 f"got {getattr(self, name)!r}")
        if self.bn not in ("train", "frozen", "sync"):
            raise ValueError(f"bn must be 'train', 'frozen' or 'sync', got {self.bn!r}")
        if isinstance(self.output_stride, bool) or self.output_stride not in OUTPUT_STRIDES:
            raise ValueError(f"output_stride must be 8 or 16, got {self.output_stride}")
        put("output_stride", int(self.output_stride))
        put("lr_mults", _group_tuple(self.lr_mults, "lr_mults", float))
        put("decay", _group_tuple(self.decay, "decay", bool))
        if self.weights is not None:
            put("weights", os.fspath(self.weights))
        # amp: a bool, checked (not coerced: "no" is truthy) by T.check_fields as --no-amp's switch

    @property
    def spec(self) -> Recipe:
        """The recipe the run starts from (:func:`~mars_plugin.networks.recipes.get_recipe`)."""
        return get_recipe(self.recipe)

    @property
    def poly_max_offset(self) -> int:
        """Poly's denominator is ``iterations + poly_max_offset`` (the recipe's; SEAM: 1)."""
        return self.spec.poly_max_offset

    def iterations_for(self, num_images: int) -> int:
        """The optimizer steps of the run on ``num_images`` images: ``iterations``, or ``epochs``
        as DHR counts them (:func:`~mars_plugin.networks.recipes.iterations_for_epochs`: the global
        batch ``batch_size * iter_size``, the recipe's ``drop_last``, on one process: the steps of
        ``mars train`` do not depend on the number of processes). 10,582 images, ``dhr``: 66,100."""
        if self.iterations is not None:
            return self.iterations
        return iterations_for_epochs(num_images, self.epochs, self.batch_size * self.iter_size, self.spec.drop_last)

    @property
    def augmentation(self) -> Any:
        """The :class:`~mars_plugin.networks.seg_data.Augmentation` of ``crop``, ``min_size``, ``max_size``
        (recipe ``seam``: :func:`~mars_plugin.networks.seam_data.seam_augmentation` of ``crop``; recipe
        ``deeplab-pytorch``: its :class:`~mars_plugin.networks.deeplab_pytorch.DeeplabAugmentation` at ``crop``)."""
        from mars_plugin.networks.seg_data import Augmentation

        if self.spec.augmentation == "seam":
            from mars_plugin.networks.seam_data import seam_augmentation

            return seam_augmentation(self.crop, self.spec.augmentation_params)
        if self.spec.augmentation == "deeplab-pytorch":
            from mars_plugin.networks.deeplab_pytorch import DeeplabAugmentation

            return DeeplabAugmentation(crop=self.crop, scales=tuple(dict(self.spec.augmentation_params)["scales"]))

        return Augmentation(crop=self.crop, min_size=self.min_size, max_size=self.max_size)

    @property
    def model(self) -> Dict[str, Any]:
        """``checkpoint["model"]``: the arguments of :func:`mars_plugin.networks.deeplab.build_model`."""
        return {"arch": self.arch, "backbone": self.backbone, "output_stride": self.output_stride,
                "num_classes": self.num_classes}

    def given(self) -> Dict[str, Any]:
        """The arguments that make this record: the overrides and every field of neither kind."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.init and (f.name not in (*RECIPE_FIELDS, *LOSS_DEFAULTS) or f.name in self.overrides)}

    def replace(self, **changes: Any) -> "TrainSettings":
        """A copy with ``changes`` (recipe fields among them become overrides), checked again."""
        return type(self)(**{**self.given(), **changes})

    def record(self, *, amp: Optional[bool] = None, iterations: Optional[int] = None, **facts: Any) -> Dict[str, Any]:
        """The run's identity, JSON-able: the recipe's fields as resolved (``recipe``: its name,
        ``sources`` of overridden fields ``"override"``), every field but the run fields,
        ``weights`` as its base name, ``amp`` as used (False on the CPU), ``iterations`` as run
        (by epochs: from the number of images), and ``facts`` of the run (``stems``, ``images``,
        ``labels``, ``world_size``) that are said, not compared."""
        spec = recipe_to_dict(self.spec)
        spec.pop("name")
        recipe_given = [k for k in self.overrides if k in RECIPE_FIELDS]  # the loss's are not the recipe's
        spec["sources"] = {**spec["sources"], **{k: "override" for k in recipe_given}}
        spec["augmentation_params"] = [[k, self.min_size if k == "min_image" else self.max_size if k == "max_image"
                                        else v] for k, v in spec["augmentation_params"]]
        rec = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("run")}
        rec.update(weights=os.path.basename(self.weights) if self.weights else None, overrides=recipe_given,
                   lr_mults=list(self.lr_mults), decay=list(self.decay))
        if amp is not None:
            rec["amp"] = bool(amp)
        if iterations is not None:
            rec["iterations"] = int(iterations)
        return {**spec, **rec, **facts}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], **run: Any) -> "TrainSettings":
        """The settings a :meth:`record` holds (its recipe, its overrides, its other fields; the
        facts and the recipe's resolved fields are left), with ``run``'s run fields; checked again.
        A loss setting recorded at the value that leaving it out gives is left out (the record
        does not say whether the paper's value was typed; the run is the same)."""
        overrides = set(record.get("overrides") or ())
        keep = {f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get("run")}
        paper = {k: d.value if record.get("loss", "mars") == "mars" else None for k, d in LOSS_DEFAULTS.items()}
        left_out = {**paper, "crf_params": paper["crf_params"] if record.get("refine") is not None else None}
        args = {k: v for k, v in record.items() if k in keep and (k not in RECIPE_FIELDS or k in overrides)
                and not (k in left_out and v == left_out[k])}
        for k in ("lr_mults", "decay"):
            if k in args:
                args[k] = tuple(args[k])
        return cls(**args, **run)

    @classmethod
    def from_args(cls, args: Any, num_classes: int) -> "TrainSettings":
        """``mars train``'s parsed arguments (argparse's namespace) -> the record (a flag left
        out, None, is the recipe's; a loss flag left out, its ``PaperDefault``, the paper's)."""
        return cls(
            num_classes=num_classes, recipe=args.recipe, weights=args.weights, loss=args.loss, refine=args.refine,
            crf_params=args.crf_params, ema=args.ema, seed=args.seed, amp=not args.no_amp,
            **{k: getattr(args, k, None) for k in RECIPE_FIELDS},
            device=args.device, workers=args.workers, save_every=args.save_every, log_every=args.log_every,
            max_bytes="auto" if args.max_memory is None else int(args.max_memory * 2 ** 30),
        )


def _group_tuple(value: Any, name: str, kind: type) -> Tuple[Any, ...]:
    """``lr_mults`` / ``decay``: 4 values, one per group (backbone weight, backbone bias, head
    weight, head bias)."""
    from mars_plugin.networks.recipe_checks import check_field

    return tuple(check_field(name, tuple(value) if isinstance(value, list) else value))


#: What each recipe value the network code of this build lacks needs, and the branch bringing it.
_PIECES = (
    ("bn_head", "frozen", "a frozen head BatchNorm (branch seam)"),
)


def missing_piece(s: TrainSettings) -> Optional[str]:
    """What of ``s`` this build cannot train yet (a network, augmentation, normalisation,
    training scheme another branch brings), or None."""
    from mars_plugin.networks.deeplab import ARCHS

    spec = s.spec
    values = {"arch": s.arch, "backbone": s.backbone, **{k: getattr(spec, k) for k in
                                                         ("normalization", "augmentation", "bn_head")}}
    for key, value, piece in _PIECES:
        if values[key] == value and not (key == "arch" and value in ARCHS):
            return f"{key} {value!r} of recipe {s.recipe!r} needs {piece}"
    # SEAM's groups (deeplabv1.seam_param_groups) hold no BatchNorm parameter: its scheme needs nothing more
    if spec.bn_affine == "fixed" and s.bn != "frozen" and s.arch != "deeplabv1-wr38":
        return (f"recipe {s.recipe!r}: BatchNorm statistics trained with the affine weights out of the optimizer "
                "(SEAM's scheme, branch seam)")
    # load_backbone_weights reads WR38's file for that network and deeplab-pytorch's for deeplabv2
    if s.weights is not None and spec.weights_format not in ("torchvision", "deeplab-pytorch") and (
            spec.weights_format, s.arch) != ("wr38", "deeplabv1-wr38"):
        return f"recipe {s.recipe!r}: a reader of {spec.weights_format!r} weight files (branch dlpt or seam)"
    return None


#: The defaults of ``mars train`` that are not the recipe's (those are :data:`RECIPE_FIELDS`).
TRAIN_DEFAULTS: Dict[str, Any] = {f.name: f.default.value if isinstance(f.default, PaperDefault) else f.default
                                  for f in dataclasses.fields(TrainSettings)
                                  if f.init and f.name not in RECIPE_FIELDS and not f.metadata.get("run")}


#: ``mars train`` in ``mars --help``, and the head of its own ``--help``
HELP = (
    "train the segmentation network on debiased labels (EMA teacher + CRF complement + WCE, Sec. 3.4), or "
    "with plain CE as the baseline"
)
DESCRIPTION = (
    "The paper's second step: a DeepLab network trained on the debiased labels (254 = biased) with the EMA "
    "teacher refined by the dense CRF, the complement and the weighted CE (Eq. 6-7); --loss ce trains plain "
    "CE on the given labels. The MARS authors' trainer's settings (DHR train.py): SGD, poly, batch 16 of "
    "512x512, random resize, flip, colour jitter. Resumes from --out; under torchrun each process takes its "
    "slice of the global batch (the same step as one process)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars train`` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)."""
    _add_data_flags(p)
    _add_network_flags(p)
    _add_schedule_flags(p)
    _add_run_flags(p)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """What the run reads and where it writes."""
    p.add_argument("--images", default=None, help="folder of <id>.jpg|png images (default with --root: "
                                                  "<root>/<data>/<domain>/image)")
    p.add_argument("--labels", required=True, help="folder of <id>.png labels: debiased (254 = biased) for --loss mars, "
                                                   "the pseudo labels for --loss ce")
    p.add_argument("--out", required=True, help="the run's folder: checkpoint.pt, log.jsonl, train.json; a run there "
                                                 "of the same settings and data resumes, of other ones is refused")
    p.add_argument("--restart", action="store_true",
                   help="train from step 0 in --out: its checkpoint.pt, log.jsonl and train.json move to "
                        f"--out/{STALE_DIR}/<UTC time>-<run id>/ (once the data passed its check), where a run of "
                        "other settings or data would be refused")
    p.add_argument("--root", default=None, help="DHR's tree: images and xml tags from <root>/<data>/<domain>")
    p.add_argument("--data", default="VOC2012", help="with --root: dataset folder (VOC2012, COCO2014)")
    p.add_argument("--domain", default="train_aug", help="with --root: split folder")
    p.add_argument("--num-classes", type=T.num_classes, default=None,
                   help="foreground classes C (default: from --class-names, DHR's dataset with --root, else the "
                        "largest class id of --image-labels; refused when none is given)")
    p.add_argument("--class-names", default=None, help="JSON list of class names (background first), kept in the "
                                                        "checkpoint")
    p.add_argument("--image-labels", default=None,
                   help="JSON {id: [class ids]} the teacher may fill biased pixels with (mars reproduce writes "
                        "image_labels.json); default: the xml tags with --root, else each label's classes")


def _add_network_flags(p: argparse.ArgumentParser) -> None:
    """The recipe, the network and the loss."""
    p.add_argument("--recipe", choices=RECIPE_NAMES, default="dhr",
                   help="the codebase whose training the run follows (mars_plugin/networks/recipes.py): dhr (the "
                        "RS+EPM row, DHR's trainer), deeplab-pytorch (IRNet/AdvCAM rows), seam (SEAM row); each flag "
                        "below left out is the recipe's, one given overrides that field (recorded in train.json)")
    p.add_argument("--arch", choices=("deeplabv3+dhr", "deeplabv3+", "deeplabv2", "deeplabv1-wr38"), default=None,
                   help="the network (default: the recipe's); deeplabv3+ is RS+EPM's DeepLabv3+ (3x3 classifier)")
    p.add_argument("--backbone", choices=("resnet18", "resnet50", "resnet101", "wr38"), default=None,
                   help="ResNet depth (resnet18 for small runs; default: the recipe's)")
    p.add_argument("--output-stride", type=T.output_stride, choices=(8, 16), default=None,
                   help="the backbone's output stride (default: the recipe's, 8 for all three)")
    p.add_argument("--bn", choices=("train", "frozen", "sync"), default=None,
                   help="BatchNorm: batch statistics (dhr's), frozen (deeplab-pytorch's) or sync (SyncBatchNorm "
                        "over torchrun's GPUs)")
    p.add_argument("--weights", default=None,
                   help="torchvision-layout ImageNet file of the backbone (e.g. resnet101-63fe2227.pth), read "
                        "weights-only; default: random initialisation")
    p.add_argument("--loss", choices=("mars", "ce"), default="mars",
                   help="mars: EMA teacher + complement + WCE on debiased labels; ce: plain CE (the baseline)")
    p.add_argument("--refine", choices=("crf", "none"), default=LOSS_DEFAULTS["refine"],
                   help="the teacher's refinement (the paper: the dense CRF, on the batch, on the device)")
    p.add_argument("--crf-params", type=crf_params_argument, default=LOSS_DEFAULTS["crf_params"],
                   help="dense-CRF preset or JSON dict (see debias)")


def _add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """The optimisation: steps, batches, crops, the learning rate (each left out is the recipe's)."""
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--iterations", type=T.iterations, default=None, help="optimizer steps (default: the recipe's)")
    sched.add_argument("--epochs", type=T.epochs, default=None,
                       help="passes over the images, counted as DHR (images // global batch per epoch with drop_last; "
                            "dhr: 100, 66,100 steps on VOC train_aug at 16)")
    p.add_argument("--batch-size", type=T.batch_size, default=None,
                   help="global batch (split over torchrun's processes; dhr: 16)")
    p.add_argument("--iter-size", type=T.iter_size, default=None,
                   help="batches whose gradients add up to one step (deeplab-pytorch: 2)")
    p.add_argument("--lr-step", type=T.iterations, default=None,
                   help="the poly learning rate is recomputed every N steps (deeplab-pytorch: 10)")
    p.add_argument("--loss-grid", choices=("logits", "input"), default=None,
                   help="the loss on the logits' grid (labels resized nearest) or at the crop (logits upsampled); "
                        "refused where it changes nothing (deeplab-pytorch's MSC, logits at the crop's size)")
    p.add_argument("--crop", type=T.crop, default=None, help="crop side (dhr: 512)")
    p.add_argument("--min-size", type=T.image_side, default=None,
                   help="random resize: smallest longer side (dhr's augmentation only; dhr: 320)")
    p.add_argument("--max-size", type=T.image_side, default=None,
                   help="random resize: largest longer side (dhr's augmentation only; dhr: 640)")
    p.add_argument("--lr", type=T.lr, default=None, help="backbone learning rate, the groups at the recipe's "
                                                         "multiples (dhr: 1e-3, new layers 10x)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                   help="sgd: the MARS authors' (DHR's); adamw: for a network trained from random initialisation on "
                        "a small set (the demo world), which it teaches in far fewer steps")
    p.add_argument("--momentum", type=T.momentum, default=None, help="SGD momentum (dhr: 0.9)")
    p.add_argument("--weight-decay", type=T.weight_decay, default=None, help="SGD weight decay (dhr: 4e-5)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The teacher's momentum, the seed, and how the run goes."""
    p.add_argument("--ema", type=T.ema, default=LOSS_DEFAULTS["ema"], help="teacher EMA momentum (the paper: 0.999)")
    p.add_argument("--seed", type=T.seed, default=0, help="seed of the initialisation, the data order and the "
                                                          "augmentation")
    p.add_argument("--no-amp", action="store_true", help="float32 on CUDA (AMP is on by default there)")
    p.add_argument("--device", default="auto", help="auto (CUDA if any; under torchrun: GPU LOCAL_RANK), cpu, cuda")
    p.add_argument("--max-memory", type=T.max_memory, default=None, metavar="GIB",
                   help="memory budget per process in GiB: a step of --crop x --batch-size that needs more is refused "
                        "before step 1 (default: 80%% of the device's memory: RAM on the CPU, the GPU's on cuda)"
                   + "%(default).0s")
    p.add_argument("--workers", type=T.loader_workers, default=2, help="data-loading processes per training process")
    p.add_argument("--save-every", type=T.every, default=1000, help="checkpoint every N steps (and at the end)")
    p.add_argument("--log-every", type=T.every, default=10, help="a log.jsonl line every N steps")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: the record the flags build (``from_args(args, num_classes)``: the class count is resolved
#: from the files by :func:`~mars_plugin.commands.train_data.command_inputs`), and the Python
#: function taking it as ``settings=`` or its fields as keywords
SETTINGS = TrainSettings
API = "mars_plugin.commands.train:train"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"no_amp": "amp", "max_memory": "max_bytes", "no_progress": "progress"}
#: flags no keyword takes
CLI_ONLY = {
    "root": "DHR's tree: command_inputs reads <root>/<data>/<domain> into images, image_labels and num_classes",
    "data": "with --root: the dataset folder command_inputs reads (images, tags, class count)",
    "domain": "with --root: the split folder command_inputs reads",
}
#: keywords no flag sets
PYTHON_ONLY = {
    "stems": "train on a caller's subset of the labels (mars reproduce --train)",
    "notes": "lines a caller prints before step 1 (command_inputs' and mars reproduce's notes)",
    "require_biased": "False where the labels are known to be mars debias's output (mars reproduce --train)",
    "on_step": "a hook called after each step (progress, tests)",
    "poly_power": "the recipe's poly exponent; a Python caller may override it",
    "lr_mults": "the recipe's per-group lr multiples; a Python caller may override them",
    "decay": "the recipe's per-group weight decay switches; a Python caller may override them",
}
