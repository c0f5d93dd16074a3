"""``mars train``'s settings: one frozen record, validated once.

The command line builds it (:meth:`TrainSettings.from_args`), the API takes it
(:func:`mars_plugin.commands.train.train` builds one from its keywords), and the run's identity
stores it (:meth:`TrainSettings.record`: the ``settings`` of ``checkpoint.pt`` and ``train.json``,
compared on a resume by :func:`mars_plugin.commands.train_data.open_run` on :data:`RUN_KEYS`;
:meth:`TrainSettings.from_record` reads it back).

Fields are of two kinds (``metadata["run"]``): what the run *is* (network, objective,
schedule, augmentation, optimizer: recorded and, in :data:`RUN_KEYS`, compared) and how this
process runs it (device, data-loading workers, checkpoint and log cadence, memory budget: not
recorded, free to change between a run and its resume).

The record is the one ``mars train`` wrote before the record existed (the same keys and values,
``weights`` as the file's base name, ``refine``/``crf_params``/``ema`` None for ``loss="ce"``),
so checkpoints written before it stay comparable.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from mars_plugin._checks import check_int_param, check_num_classes, check_real_param, check_seed

__all__ = ["TrainSettings", "RUN_KEYS", "TRAIN_DEFAULTS"]

#: The settings whose change makes a checkpoint in ``--out`` belong to another run (the ids,
#: folders and files are compared by :func:`~mars_plugin.commands.train_data.data_diff`).
RUN_KEYS = ("arch", "backbone", "output_stride", "num_classes", "loss", "refine", "crf_params", "iterations",
            "batch_size", "crop", "min_size", "max_size", "lr", "momentum", "weight_decay", "ema", "poly_power",
            "seed", "bn", "optimizer", "weights")

_RUN = {"run": True}  # a field of how this process runs, not of what the run is


@dataclass(frozen=True)
class TrainSettings:
    """What one ``mars train`` run is, checked (each bad value named: ``lr must be ...``).

    Defaults: the MARS authors' trainer (DHR train.py:366-371 at 94d5189), DeepLabv3+ ResNet-101.
    ``output_stride`` None and ``bn`` None resolve to the arch's own (16 / ``"train"`` for
    DeepLabv3+, 8 / ``"frozen"`` for DeepLabv2); ``refine="none"`` is None; with ``loss="ce"``
    ``refine``, ``crf_params`` and ``ema`` are None (the baseline has no teacher). See
    :func:`mars_plugin.commands.train.train` for each field's meaning.
    """

    num_classes: int
    arch: str = "deeplabv3+"
    backbone: str = "resnet101"
    output_stride: Optional[int] = None
    weights: Optional[str] = None
    bn: Optional[str] = None
    loss: str = "mars"
    refine: Optional[str] = "crf"
    crf_params: Union[str, Mapping[str, Any], None] = "mars"
    ema: Optional[float] = 0.999
    iterations: int = 30000
    batch_size: int = 16
    crop: int = 512
    min_size: int = 320
    max_size: int = 640
    optimizer: str = "sgd"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 4e-5
    poly_power: float = 0.9
    seed: int = 0
    amp: bool = True
    device: str = field(default="auto", metadata=_RUN)
    workers: int = field(default=2, metadata=_RUN)
    save_every: int = field(default=1000, metadata=_RUN)
    log_every: int = field(default=10, metadata=_RUN)
    max_bytes: Union[None, str, int] = field(default="auto", metadata=_RUN)

    def __post_init__(self) -> None:
        from mars_plugin.networks.deeplab import _check_model_args
        from mars_plugin.networks.seg_data import Augmentation

        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        put("num_classes", check_num_classes(self.num_classes))
        if self.loss not in ("mars", "ce"):
            raise ValueError(f"loss must be 'mars' or 'ce', got {self.loss!r}")
        if self.refine not in (None, "crf", "none"):
            raise ValueError(f"refine must be 'crf' or None, got {self.refine!r}")
        for name in ("iterations", "batch_size", "save_every", "log_every"):
            put(name, check_int_param(getattr(self, name), name, 1))
        put("workers", check_int_param(self.workers, "workers", 0, 64))
        put("seed", check_seed(self.seed))
        put("lr", check_real_param(self.lr, "lr", 0.0, 10.0, low_open=True))
        put("momentum", check_real_param(self.momentum, "momentum", 0.0, 1.0, high_open=True))
        put("weight_decay", check_real_param(self.weight_decay, "weight_decay", 0.0, 1.0))
        if self.ema is not None or self.loss == "mars":
            put("ema", check_real_param(self.ema, "ema", 0.0, 1.0))
        put("poly_power", check_real_param(self.poly_power, "poly_power", 0.0, 10.0))
        Augmentation(crop=self.crop, min_size=self.min_size, max_size=self.max_size)  # its checks, its messages
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        arch, backbone, _, stride = _check_model_args(self.arch, self.backbone, self.num_classes, self.output_stride)
        put("output_stride", stride)
        put("bn", ("frozen" if arch == "deeplabv2" else "train") if self.bn is None else self.bn)
        if self.bn not in ("train", "frozen", "sync"):
            raise ValueError(f"bn must be 'train', 'frozen' or 'sync', got {self.bn!r}")
        if self.weights is not None:
            put("weights", os.fspath(self.weights))
        put("amp", bool(self.amp))
        # what the baseline does not use is None, as the record has always said
        mars = self.loss == "mars"
        put("refine", None if not mars or self.refine == "none" else self.refine)
        put("crf_params", self.crf_params if mars and self.refine else None)
        put("ema", self.ema if mars else None)

    @property
    def augmentation(self) -> Any:
        """The :class:`~mars_plugin.networks.seg_data.Augmentation` of ``crop``, ``min_size``, ``max_size``."""
        from mars_plugin.networks.seg_data import Augmentation

        return Augmentation(crop=self.crop, min_size=self.min_size, max_size=self.max_size)

    @property
    def model(self) -> Dict[str, Any]:
        """``checkpoint["model"]``: the arguments of :func:`mars_plugin.networks.deeplab.build_model`."""
        return {"arch": self.arch, "backbone": self.backbone, "output_stride": self.output_stride,
                "num_classes": self.num_classes}

    def replace(self, **changes: Any) -> "TrainSettings":
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    def record(self, *, amp: Optional[bool] = None, **facts: Any) -> Dict[str, Any]:
        """The run's identity, JSON-able: every field but the run fields, ``weights`` as its base
        name, ``amp`` as used (``amp``: False on the CPU), and ``facts`` of the run (``stems``,
        ``images``, ``labels``, ``world_size``) that are said, not compared."""
        rec = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("run")}
        rec["weights"] = os.path.basename(self.weights) if self.weights else None
        if amp is not None:
            rec["amp"] = bool(amp)
        return {**rec, **facts}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], **run: Any) -> "TrainSettings":
        """The settings a :meth:`record` holds (keys that are not fields, the facts, are left),
        with ``run``'s run fields; checked as any other."""
        names = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("run")}
        return cls(**{k: v for k, v in record.items() if k in names}, **run)

    @classmethod
    def from_args(cls, args: Any, num_classes: int) -> "TrainSettings":
        """``mars train``'s parsed arguments (argparse's namespace) -> the record."""
        return cls(
            num_classes=num_classes, arch=args.arch, backbone=args.backbone, output_stride=args.output_stride,
            weights=args.weights, bn=args.bn, loss=args.loss, refine=args.refine, crf_params=args.crf_params,
            ema=args.ema, iterations=args.iterations, batch_size=args.batch_size, crop=args.crop,
            min_size=args.min_size, max_size=args.max_size, optimizer=args.optimizer, lr=args.lr,
            momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed, amp=not args.no_amp,
            device=args.device, workers=args.workers, save_every=args.save_every, log_every=args.log_every,
            max_bytes="auto" if args.max_memory is None else int(args.max_memory * 2 ** 30),
        )


#: The defaults of ``mars train`` (DHR train.py:366-371 at 94d5189), read off the record.
TRAIN_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainSettings)
                                  if f.name in ("arch", "backbone", "loss", "refine", "crf_params", "iterations",
                                                "batch_size", "crop", "min_size", "max_size", "lr", "momentum",
                                                "weight_decay", "ema", "poly_power", "seed")}
