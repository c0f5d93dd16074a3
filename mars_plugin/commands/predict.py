"""``mars predict``: a trained segmentation network's labels for a folder of images.

Per image, the authors' evaluators' computation (RS+EPM's ``infer_seg.py`` and
``convert_seed_to_pseudo_masks.py``, DHR's ``produce_wss_masks.py``): the mean softmax over scales
and flips, then the dense CRF over the classes reaching a threshold; each step and its source
line are in :mod:`mars_plugin.networks.inference` (:func:`~mars_plugin.networks.inference.multiscale_probs`,
:func:`~mars_plugin.networks.inference.labels_from_probs`). This module is the folder job
(:func:`predict_job`: resumable, atomic writes, sharded under torchrun) and the command line.

Labels are written as P-mode PNGs with the VOC palette (:func:`mars_plugin.formats.files.write_label`,
what both write: ``convert_seed_to_pseudo_masks.py:135-137``, ``produce_wss_masks.py:73-75``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from mars_plugin._checks import MAX_BATCH_SIZE, check_int_param, check_real_param, check_scales, describe
from mars_plugin.engines.crf_memory import check_crf_image
from mars_plugin.formats.files import read_image, write_label
from mars_plugin.networks.inference import (CLASS_THRESHOLD, CRF_CHOICES, CRF_IMAGES, DEFAULT_SCALES, _crf_params,
                                           _scaled_size, crf_rgb, labels_from_probs, multiscale_probs,
                                           multiscale_probs_dhr, multiscale_probs_max)
from mars_plugin.networks.memory import MEMORY_FLAG, resolve_max_bytes
from mars_plugin.commands.inputs import _check_out_dir, list_images
from mars_plugin.runs.errors import ON_ERROR, JobError, JobSummary, one_line
from mars_plugin.runs.size_batches import SizeBatches
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.runs.io_pipeline import IOPipeline, check_io_workers
from mars_plugin.commands.predict_memory import memory_plan
from mars_plugin.runs.distributed import _rank_world, resolve_device, share_error, sync_group

__all__ = [
    "predict_job",
    "run_predict",
]

PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------------------------
# the folder job
# --------------------------------------------------------------------------------------------


def _default_preprocess(rgb: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 RGB -> (B, 3, H, W), what :func:`mars_plugin.networks.deeplab.build_model`'s
    networks take (:func:`mars_plugin.networks.deeplab.normalize`)."""
    from mars_plugin.networks.deeplab import normalize

    return normalize(rgb)


def _preprocess_of(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The input a network takes: deeplabv2 (deeplab-pytorch's) BGR minus the caffe mean
    (:func:`mars_plugin.networks.deeplab_pytorch.normalize`), the others :func:`_default_preprocess`."""
    if (getattr(model, "config", None) or {}).get("arch") == "deeplabv2":
        from mars_plugin.networks.deeplab_pytorch import normalize

        return normalize
    return _default_preprocess


def predict_job(
    model: nn.Module,
    images_dir: PathLike,
    out_dir: PathLike,
    *,
    scales: Sequence[float] = DEFAULT_SCALES,
    flip: bool = True,
    crf: Optional[str] = "mars",
    class_threshold: float = CLASS_THRESHOLD,
    crf_image: str = "file",
    fuse_at: Optional[str] = None,
    batch_size: int = 4,
    device: Union[str, torch.device] = "cpu",
    fp16: bool = False,
    preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    num_classes: Optional[int] = None,
    on_error: str = "stop",
    progress: bool = True,
    settings: Optional[Mapping[str, Any]] = None,
    images_flag: str = "--images",
    max_bytes: Union[None, str, int] = "auto",
    io_workers: Optional[int] = None,
) -> JobSummary:
    """Write ``<out_dir>/<stem>.png``, the predicted labels of every image of ``images_dir``
    (:func:`~mars_plugin.networks.inference.predict_labels`), P mode with the VOC palette, atomically.

    Args:
        model: the network ((B, 3, h, w) -> (B, L, h', w') logits; a smaller grid is upsampled);
            moved to ``device``, eval mode.
        crf_image: the bytes the CRF compares: ``"file"`` (the image's own) or ``"denormalized"``
            (upstream's: the network's input turned back to bytes by truncation,
            :func:`~mars_plugin.networks.inference.denormalized_bytes`; assumes ``preprocess``
            normalises with ImageNet's mean and std, as the default does) or ``"mean-subtracted"``
            (deeplab-pytorch's, :func:`~mars_plugin.networks.inference.mean_subtracted_bytes`).
        fuse_at: where the scales' probabilities are averaged: ``"input"`` (RS+EPM's,
            :func:`~mars_plugin.networks.inference.multiscale_probs`), ``"logits"`` (DHR's
            ``apply_ms``, :func:`~mars_plugin.networks.inference.multiscale_probs_dhr`), ``"seam"``
            (SEAM's test.py: :func:`~mars_plugin.networks.deeplabv1.seam_multiscale_probs`, and with
            ``crf_image="denormalized"`` its float32 bytes, :func:`~mars_plugin.networks.deeplabv1.seam_crf_bytes`),
            ``"max-logits"`` (deeplab-pytorch's MSC, :func:`~mars_plugin.networks.inference.multiscale_probs_max`),
            or None: the network's own upstream's (``"logits"`` for ``deeplabv3+dhr``, ``"seam"`` for
            ``deeplabv1-wr38``, ``"max-logits"`` for an ``MSC``, else ``"input"``).
        batch_size: images per forward pass (each with its flip); only images of one size share
            a batch (a few sizes are buffered, at most ``4 * batch_size`` images).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (this rank's GPU if any): the
            network and the CRF run there.
        preprocess: (B, H, W, 3) uint8 RGB -> the network's (B, 3, H, W) input (default:
            :func:`mars_plugin.networks.deeplab.normalize`, ImageNet's mean and std; for
            deeplabv2, :func:`mars_plugin.networks.deeplab_pytorch.normalize`).
        num_classes: C, when known (``L = C + 1`` outputs are then checked, and each image's CRF
            memory before any work).
        on_error: a file that cannot be read or predicted: ``"stop"`` raises a
            :class:`~mars_plugin.runs.errors.JobError` naming it, ``"skip"`` records it and goes on.
        settings: what made ``model`` (its file, which weights), part of the folder's record.
        images_flag: the flag that named ``images_dir``, for messages.
        max_bytes: the memory budget (``--max-memory``): ``"auto"`` (80% of ``device``'s memory,
            :func:`~mars_plugin.networks.memory.default_max_bytes`), bytes, or None (no limit).
            Before any work, every image whose prediction (the network of ``model.config`` over
            the scales and flips, and its CRF: :func:`~mars_plugin.networks.memory.inference_memory_bytes`)
            needs more is refused by name (skipped with ``on_error="skip"``), from its header
            alone; a batch holds only as many images of one size as fit; the CRF takes the same
            budget as its ``max_bytes``.
        io_workers: threads that read and decode the next images and encode and write the labels
            while ``device`` computes (:mod:`mars_plugin.runs.io_pipeline`; 0: in turn; None:
            min(4, CPU cores) on cuda, 0 on the CPU); the outputs do not depend on it.

    Resume (:mod:`mars_plugin.runs.run_record`): ``out_dir/.mars-run.json`` records the settings
    (the model, scales, flip, CRF, class threshold, fp16; other settings are refused) and each
    rank's journal the image each label was made from: a label whose image is unchanged is
    kept. Under torch.distributed (``torchrun``) every rank lists the same sorted images and
    takes ``rank, rank + W, ...``; a failure on one rank is raised on all once they meet
    (:func:`~mars_plugin.runs.distributed.share_error`); only rank 0 shows a progress bar.
    """
    from mars_plugin.commands.inputs import check_out_apart  # before any work: an output is never an input

    check_out_apart(out_dir, "--out", {images_flag: images_dir})
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    scales = check_scales(scales)
    params = _crf_params(crf)
    class_threshold = check_real_param(class_threshold, "class_threshold", 0.0, 1.0)
    if crf_image not in CRF_IMAGES:
        raise ValueError(f"crf_image must be one of {CRF_IMAGES}, got {crf_image!r}")
    if fuse_at is None:  # DHR's apply_ms is a method of its network: that network fuses as DHR does (SEAM's: test.py)
        from mars_plugin.networks.deeplabv2 import MSC

        fuse_at = {"deeplabv3+dhr": "logits", "deeplabv1-wr38": "seam"}.get(
            (getattr(model, "config", None) or {}).get("arch"), "input")
        fuse_at = "max-logits" if isinstance(model, MSC) else fuse_at  # deeplab-pytorch's MSC: the max of its logits
    if fuse_at not in ("input", "logits", "seam", "max-logits"):
        raise ValueError(f"fuse_at must be 'input', 'logits', 'seam', 'max-logits' or None, got {fuse_at!r}")
    batch_size = check_int_param(batch_size, "batch_size", 1, MAX_BATCH_SIZE)
    if not callable(model):
        raise TypeError(f"model must be a network (nn.Module), got {describe(model)}")
    device = resolve_device(device) if isinstance(device, str) else device
    max_bytes = resolve_max_bytes(max_bytes, device)
    io_workers = check_io_workers(io_workers, device)
    preprocess = preprocess or _preprocess_of(model)
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    rank, world = _rank_world()
    from mars_plugin.runs.run_record import FolderRecord

    record = FolderRecord(out_dir, "predict", {
        "model": dict(settings or {"model": type(model).__name__}), "scales": list(scales), "flip": bool(flip),
        "crf": "none" if params is None else crf, "crf_params": params,
        "class_threshold": class_threshold if params is not None else None, "fp16": bool(fp16),
        # recorded only where it is not the file's bytes, so folders written before the option resume
        **({"crf_image": crf_image} if params is not None and crf_image != "file" else {}),
        **({"fuse_at": fuse_at} if fuse_at != "input" else {})}, rank=rank)
    group = sync_group()  # before anything that can fail on one rank only: every rank reaches it
    try:
        error: Optional[BaseException] = None
        items: List[Tuple[str, Path]] = []
        clashes: Dict[str, List[str]] = {}
        try:
            items, clashes = list_images(images_dir, images_flag)
            if rank == 0:
                _check_out_dir(out_dir, "--out")
                record.open({s for s, _ in items} | set(clashes), (".png",))  # the label of any other id is stale
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        share_error(error, group)
        everything = sorted({s for s, _ in items} | set(clashes))
        from mars_plugin.commands.features import _check_same_work

        _check_same_work(everything, images_dir, group)
        if rank == 0:
            record.write_settings()
        record.load()
        mine = set(everything[rank::world])
        summary = JobSummary()
        record.tell(summary)
        error = None
        try:
            _predict_shard(model, [(s, p) for s, p in items if s in mine],
                           {s: n for s, n in clashes.items() if s in mine}, out_dir, summary, record,
                           scales=scales, flip=flip, crf=crf, params=params, class_threshold=class_threshold,
                           crf_image=crf_image, fuse_at=fuse_at, batch_size=batch_size, device=device, fp16=fp16,
                           preprocess=preprocess,
                           num_classes=num_classes, on_error=on_error, progress=progress and rank == 0,
                           max_bytes=max_bytes, io_workers=io_workers,
                           desc="predict" if world == 1 else f"predict rank 0/{world}")
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        share_error(error, group)  # every rank meets here, also one that failed
        return summary
    finally:
        record.close()
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)


def _predict_shard(model: nn.Module, items: List[Tuple[str, Path]], clashes: Dict[str, List[str]], out_dir: Path,
                   summary: JobSummary, record: Any, *, scales: Tuple[float, ...], flip: bool, crf: Optional[str],
                   params: Optional[Dict[str, float]], class_threshold: float, batch_size: int, device: torch.device,
                   fp16: bool, preprocess: Callable[[torch.Tensor], torch.Tensor], num_classes: Optional[int],
                   on_error: str, progress: bool, desc: str, max_bytes: Optional[int] = None,
                   crf_image: str = "file", fuse_at: str = "input", io_workers: int = 0) -> None:
    """:func:`predict_job`'s work on one rank's images, counted in ``summary``."""
    from mars_plugin.runs.identities import file_id

    out_dir.mkdir(parents=True, exist_ok=True)  # on every rank: exist_ok makes the race harmless
    if isinstance(model, nn.Module):
        model.to(device).eval()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items) + len(clashes), desc=desc, unit="img")

    def tick() -> None:
        if bar is not None:
            bar.update(1)

    def fail(stem: str, why: str) -> None:
        if on_error == "stop":
            raise JobError(f"{stem}: {why}")
        summary.failed.append((stem, why))
        tick()

    where = dict(items)
    again = set()  # stems whose existing label is computed again (its image changed, or no record)
    Batch = List[Tuple[str, Dict[str, Any], torch.Tensor]]

    def labels_of(batch: Batch) -> torch.Tensor:
        rgb = torch.stack([img for _, _, img in batch]).to(device)  # (B, H, W, 3) uint8
        x = preprocess(rgb)
        from mars_plugin.networks.deeplabv1 import seam_crf_bytes, seam_multiscale_probs

        fuse = {"logits": multiscale_probs_dhr, "seam": seam_multiscale_probs,
                "max-logits": multiscale_probs_max}.get(fuse_at, multiscale_probs)
        probs = fuse(model, x, scales, flip, fp16=fp16)
        if num_classes is not None and probs.shape[1] != num_classes + 1:
            raise ValueError(f"the network gives {probs.shape[1]} classes, the checkpoint says {num_classes} + "
                             "background")
        seam_bytes = fuse_at == "seam" and crf_image == "denormalized"  # test.py's img_denorm, in float32
        crf_bytes = seam_crf_bytes(x) if seam_bytes else crf_rgb(rgb, x, crf_image)
        return labels_from_probs(probs, crf_bytes, crf, class_threshold, max_bytes=max_bytes).cpu()

    def failed(item: Tuple[str, Dict[str, Any], torch.Tensor], e: Exception) -> None:
        stem, _, img = item
        fail(stem, f"{where[stem]}, {img.shape[1]}x{img.shape[0]} pixels: {one_line(e)}")

    def keep(written: Any) -> None:
        # the labels written, recorded in the order they were queued (a failed write, a full
        # disk, is not the image's fault: it stops)
        for (stem, inputs), digest in written:
            record.add(stem, out_dir / f"{stem}.png", inputs, digest)
            summary.done += 1
            summary.redone += stem in again
            tick()

    try:
        for stem, names in sorted(clashes.items()):
            fail(stem, f"several images share this stem ({', '.join(names)}); rename all but one")
        # Before any work: every image to predict against the memory budget, from its header.
        refused, limits = memory_plan(model, items, out_dir, record, max_bytes, scales=scales, flip=flip, fp16=fp16,
                                       params=params, num_classes=num_classes, device=device)
        if refused and on_error == "stop":
            fail(*next(iter(refused.items())))
        todo = []
        for stem, path in items:
            inputs = {"image": file_id(path)}  # before reading it: a change while it is read shows next time
            kept, exists = record.current(stem, out_dir / f"{stem}.png", inputs)
            if kept:
                summary.existing += 1
                tick()
                continue
            if exists:
                again.add(stem)
            if stem in refused:
                fail(stem, refused[stem])
                continue
            todo.append((stem, path, inputs))

        def load(job: Tuple[str, Path, Dict[str, Any]]) -> torch.Tensor:
            # one image read, decoded and checked (in an --io-workers thread)
            rgb = read_image(job[1])
            H, W = rgb.shape[:2]
            for s in scales:
                _scaled_size(H, W, s)
            if params is not None and num_classes is not None:  # before any work: its CRF's memory
                check_crf_image(params, H, W, num_classes + 1, max_bytes=max_bytes, name="--crf",
                                budget_name=MEMORY_FLAG)
            return torch.from_numpy(rgb)

        with IOPipeline(io_workers, ahead=2 * batch_size, behind=2 * batch_size) as io:
            def write(batch: Batch, labels: torch.Tensor) -> None:
                for (stem, inputs, _), y in zip(batch, labels):
                    io.write((stem, inputs), _write_labels, out_dir / f"{stem}.png", y)
                keep(io.written())

            batches = SizeBatches(batch_size, labels_of, write, failed)  # one size: one forward pass
            try:
                for (stem, _, inputs), fut in io.reads(load, todo):
                    try:
                        img = fut.result()
                    except Exception as e:  # noqa: BLE001 -- any failure to read one image is that file's failure
                        fail(stem, one_line(e))
                        continue
                    key = tuple(img.shape[:2])
                    batches.add(key, (stem, inputs, img), limits.get(key))
                batches.flush()
                keep(io.written(0))
            except BaseException:  # the network failed or Ctrl-C: the labels already whole are recorded first
                with contextlib.suppress(Exception):  # (a failure to record them must not hide the error)
                    keep(io.settled())
                raise
    finally:
        if bar is not None:
            bar.close()


def _write_labels(path: Path, labels: torch.Tensor) -> str:
    """(H, W) labels written atomically as a P-mode PNG (in an ``--io-workers`` thread); their digest."""
    from mars_plugin.runs.identities import array_digest

    y8 = labels.to(torch.uint8)
    write_label(path, y8, mode="P")
    return array_digest(y8)


# --------------------------------------------------------------------------------------------
# command line: mars predict
# --------------------------------------------------------------------------------------------


def load_model(path: PathLike, which: Optional[str] = "student") -> Tuple[nn.Module, Dict[str, Any]]:
    """:func:`mars_plugin.networks.seg_checkpoint.model_from_checkpoint` with one-line errors naming
    ``--model`` (and ``--which`` for a checkpoint without a teacher); ``which=None``: the
    checkpoint's recipe's weights."""
    from mars_plugin.networks.seg_checkpoint import model_from_checkpoint

    try:
        return model_from_checkpoint(path, which)
    except (ValueError, OSError) as e:
        msg = one_line(e)
        if which == "teacher" and "holds no teacher" in msg:
            msg += "; use --which student"
        raise JobError(f"--model {msg}") from None


def run_predict(args: argparse.Namespace) -> Tuple[JobSummary, Path]:
    """``mars predict``: check the flags, load ``--model``, run :func:`predict_job` into
    ``--out`` or DHR's ``<root>/WSS/<data>/<method>/<domain>/``. Returns the summary and the
    output folder."""
    if (args.images is None) == (args.root is None):
        raise ValueError("give either --images DIR (a folder of images) or --root ROOT (DHR's tree, with --data "
                         "and --domain)" + (", not both" if args.images is not None else ""))
    if args.root is None:
        given = [f for f, v in (("--data", args.data), ("--domain", args.domain), ("--method", args.method)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --root (DHR's tree); with --images give --out DIR")
        if args.out is None:
            raise ValueError("--images needs --out DIR, the folder for the predicted labels")
    elif (args.out is None) == (args.method is None):
        raise ValueError("with --root give either --method NAME (writes <root>/WSS/<data>/<NAME>/<domain>/, where "
                         "DHR's train.py --wss NAME reads) or --out DIR" + (", not both" if args.out else ""))
    model, meta = load_model(args.model, args.which)
    num_classes = int(meta["model"]["num_classes"])
    from mars_plugin.commands.predict_recipe import predict_settings

    inference = predict_settings(args, meta)
    flag = "--images"
    if args.root is not None:
        from mars_plugin.adapters.wsss.dhr_layout import DHRLayout
        from mars_plugin.commands.reproduce import default_domain

        data = args.data or "VOC2012"
        domain = args.domain or default_domain(data, args.root)
        try:
            layout = DHRLayout(args.root, data)
            images_dir = layout.image_dir(domain)
        except ValueError as e:
            raise ValueError(f"--data/--domain: {one_line(e)}") from None
        if not images_dir.is_dir():
            raise JobError(f"--root {args.root}: {images_dir} is not a folder; expected <root>/{data}/{domain}/image "
                           "(DHR's layout)")
        flag = "--root"
        if args.method is not None:
            try:
                out = layout.wss_dir(args.method, domain)
            except ValueError as e:
                raise ValueError(f"--method {args.method!r}: {one_line(e)}") from None
            # DHR trains on these with its dataset json's classes: the network must have as many.
            try:
                layout.class_names(num_classes)
            except ValueError as e:
                raise JobError(f"--model {args.model}: a network of {num_classes} classes for {data}: "
                               f"{one_line(e)}") from None
        else:
            out = Path(args.out)
    else:
        images_dir, out = Path(args.images), Path(args.out)
    from mars_plugin.runs.identities import weight_file_id

    settings = {"file": weight_file_id(args.model), "which": meta["which"], "network": meta["model"],
                **({"recipe": meta["recipe"]} if meta.get("recipe") is not None else {})}
    s = predict_job(model, images_dir, out, **inference, batch_size=args.batch_size, device=args.device,
                    fp16=args.fp16, num_classes=num_classes, on_error=args.on_error,
                    progress=not args.no_progress, settings=settings, images_flag=flag,
                    max_bytes="auto" if args.max_memory is None else int(args.max_memory * 2 ** 30),
                    io_workers=args.io_workers)
    return s, out


def add_predict_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mars predict`` (defaults shown by an ``ArgumentDefaultsHelpFormatter``)."""
    from mars_plugin.commands import cli_types as T
    _OWN_DEFAULT = "%(default).0s"  # no "(default: None)" where the help says what None means

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
    recipe = " (default: the checkpoint's recipe's; without one, %s)"
    p.add_argument("--scales", type=T.seg_scales, default=None, metavar="S,S,...",
                   help="inference scales, comma-separated (RS+EPM's and DHR's evaluators: 1,0.5,1.5,2); the mean "
                        "softmax over scales (and flips) is taken"
                        + recipe % ",".join(f"{s:g}" for s in DEFAULT_SCALES))
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="also predict each scale's mirror image and average it in" + recipe % "on")
    p.add_argument("--crf", choices=CRF_CHOICES, default=None,
                   help="dense CRF on the mean softmax and the RGB image: mars (RS+EPM's DeepLab setting, Gaussian "
                        "1/3, bilateral 67/3/4, 10 iterations), psa (PSA/SEAM's 3/3, 80/13/10), or none (argmax)"
                        + recipe % "mars")
    p.add_argument("--crf-image", choices=CRF_IMAGES, default=None,
                   help="the bytes the CRF compares: the image file's, or denormalized: the network's input turned "
                        "back to bytes by truncation, as DHR's and RS+EPM's evaluators do (13-30%% of the values one "
                        "below the file's)" + recipe % "file")
    p.add_argument("--class-threshold", type=T.class_threshold, default=None, metavar="P",
                   help="classes whose probability reaches this somewhere in an image are that image's CRF labels "
                        "(RS+EPM/DHR: 0.05; 0: every class)" + recipe % CLASS_THRESHOLD)
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

