"""``mars reproduce --train``: the paper's second step after the debiased labels.

On the folder ``mars reproduce`` wrote (``<out>/debiased``, ``<out>/image_labels.json``):

1. ``<out>/train/``: :func:`mars_plugin.commands.train.train` on the training domain's images and the
   debiased labels, with the image tags the teacher may fill biased pixels with (resumes from
   its checkpoint);
2. ``<out>/val_pred/``: the trained network's labels on the validation domain
   (``<root>/<data>/<val domain>/image``) with multi-scale + flip inference and the CRF
   (:func:`mars_plugin.commands.predict.predict_job`), scored against its masks (the paper's VOC val
   77.7 for RS+EPM + MARS with DeepLabv3+ ResNet-101) into ``<out>/scores_trained.json``;
3. ``<out>/masks/``: its labels on the training domain, the "MARS masks" DHR trains on
   (``--method NAME`` of ``mars predict --root`` writes them into DHR's tree instead).

Each stage resumes: the training from its checkpoint, the predictions file by file.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from mars_plugin.formats.files import atomic_write

__all__ = ["train_after_reproduce", "DEFAULT_VAL_DOMAIN"]

#: DHR's name of VOC's and COCO's validation split folder (adapters/wsss/dhr.py, DHR README).
DEFAULT_VAL_DOMAIN = "validation"


def train_after_reproduce(
    root: os.PathLike,
    out_dir: os.PathLike,
    *,
    data: str = "VOC2012",
    domain: str = "train_aug",
    val_domain: str = DEFAULT_VAL_DOMAIN,
    train_options: Optional[Mapping[str, Any]] = None,
    device: str = "auto",
    predict_batch_size: int = 4,
    masks: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Train, predict the validation split and score it, predict the training split (see the
    module docstring). Returns {"checkpoint", "val": scores or None, "masks": folder or None}."""
    from mars_plugin.adapters.wsss.dhr_layout import DHRLayout
    from mars_plugin.commands.train import train
    from mars_plugin.commands.train_settings import TrainSettings

    out = _check_out(root, out_dir, data, [domain, val_domain], train_options)
    debiased, tags_path = out / "debiased", out / "image_labels.json"
    layout = DHRLayout(root, data)
    names = list(layout.class_names())
    C = len(names) - 1
    tags = {str(k): [int(c) for c in v] for k, v in json.loads(tags_path.read_text()).items()}
    # the options given override the recipe's fields (train_options' None: the recipe's)
    s = TrainSettings(num_classes=C, device=device, **{k: v for k, v in (train_options or {}).items() if v is not None})
    log(f"[train] recipe {s.recipe}: {s.arch} {s.backbone}, {s.iterations_for(len(tags))} steps on {len(tags)} "
        f"debiased labels -> {out / 'train'}")
    # require_biased=False: these are debias's own labels; where it marked nothing (a tree whose
    # pseudo labels hold no biased object), MARS trains on them as they are.
    res = train(layout.image_dir(domain), debiased, out / "train", settings=s, image_labels=tags, class_names=names,
                progress=progress, stems=sorted(tags), require_biased=False)
    ck = res["checkpoint"]
    pred = _Predictor(*_predictor(ck), device=device, batch_size=predict_batch_size, num_classes=C, progress=progress)
    result: Dict[str, Any] = {"checkpoint": ck, "val": None, "masks": None}
    result["val"] = _score_val(pred, layout, val_domain, out, names, res, log)
    if masks:
        log(f"[masks {domain}] -> {out / 'masks'}")
        pred.write(layout.image_dir(domain), out / "masks")
        result["masks"] = out / "masks"
    return result


@dataclass(frozen=True)
class _Predictor:
    """The trained network as ``mars predict --model`` runs it (:func:`_predictor`), on the device."""

    model: Any
    inference: Dict[str, Any]
    settings: Dict[str, Any]
    device: str
    batch_size: int
    num_classes: int
    progress: bool

    def write(self, images: os.PathLike, out: Path) -> None:
        """Its labels of the folder ``images`` into ``out`` (resumable, file by file)."""
        from mars_plugin.commands.predict import predict_job

        predict_job(self.model, images, out, **self.inference, batch_size=self.batch_size, device=self.device,
                    num_classes=self.num_classes, progress=self.progress, settings=self.settings)


def _score_val(pred: _Predictor, layout: Any, val_domain: str, out: Path, names: List[str],
               res: Mapping[str, Any], log: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    """The validation split predicted and, on rank 0, scored into ``scores_trained.json`` (its
    scores; None elsewhere, or without the split's images and masks)."""
    from mars_plugin.commands.evaluate import evaluate_job
    from mars_plugin.runs.distributed import _rank_world

    val_images, val_masks = layout.image_dir(val_domain), layout.mask_dir(val_domain)
    if not (val_images.is_dir() and val_masks.is_dir()):
        log(f"[predict {val_domain}] skipped: no {val_images} and {val_masks}")
        return None
    log(f"[predict {val_domain}] multi-scale + flip + CRF -> {out / 'val_pred'}")
    pred.write(val_images, out / "val_pred")
    if _rank_world()[0] != 0:
        return None
    scores, _ = evaluate_job(out / "val_pred", val_masks, pred.num_classes, progress=False)
    payload = dict(scores, class_names=names, checkpoint=str(res["checkpoint"]), iterations=res["iterations"])
    atomic_write(out / "scores_trained.json", lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2)))
    log(f"[evaluate {val_domain}] mIoU of the trained network {100 * scores['miou']:.1f} "
        f"-> {out / 'scores_trained.json'}")
    return scores


def _predictor(ck: os.PathLike) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """The network of checkpoint ``ck``, :func:`~mars_plugin.commands.predict.predict_job`'s
    inference settings and its record's ``settings``, as ``mars predict --model ck`` takes them:
    the recipe's weights (``dhr``: the EMA teacher), scales, flip, CRF, the CRF's bytes."""
    from mars_plugin.runs.identities import weight_file_id
    from mars_plugin.commands.predict import load_model
    from mars_plugin.commands.predict_recipe import predict_settings

    model, meta = load_model(ck, which=None)
    inference = predict_settings(argparse.Namespace(model=ck), meta)
    settings = {"file": weight_file_id(ck), "which": meta["which"], "network": meta["model"],
                **({"recipe": meta["recipe"]} if meta.get("recipe") is not None else {})}
    return model, inference, settings


def _check_out(root: os.PathLike, out_dir: os.PathLike, data: str, domains: List[str],
               train_options: Optional[Mapping[str, Any]]) -> Path:
    """Before any work: an output is never an input (the splits, ``--weights``), and ``out_dir``
    holds what the debias stages of ``mars reproduce`` wrote."""
    from mars_plugin.commands.inputs import check_out_apart, root_reads

    check_out_apart(out_dir, "--out", {"--root": root_reads(root, data, domains),
                                       "--weights": (train_options or {}).get("weights")})
    out = Path(out_dir)
    if not (out / "debiased").is_dir() or not (out / "image_labels.json").is_file():
        raise ValueError(f"--out {out}: no debiased labels or image_labels.json there; the debias stages of mars "
                         "reproduce run first")
    return out
