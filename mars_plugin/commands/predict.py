"""``mars predict``: a trained segmentation network's labels for a folder of images.

Per image, the authors' evaluators' computation (RS+EPM's ``infer_seg.py`` and
``convert_seed_to_pseudo_masks.py``, DHR's ``produce_wss_masks.py``): the mean softmax over scales
and flips, then the dense CRF over the classes exceeding a threshold; each step and its source
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from mars_plugin._checks import describe
from mars_plugin.engines.crf_memory import check_crf_image
from mars_plugin.formats.files import read_image, write_label
from mars_plugin.networks.inference import (CLASS_THRESHOLD, DEFAULT_SCALES, _scaled_size, crf_rgb, labels_from_probs,
                                           multiscale_probs, multiscale_probs_dhr, multiscale_probs_max)
from mars_plugin.networks.memory import MEMORY_FLAG, resolve_max_bytes
from mars_plugin.commands.inputs import _check_out_dir, list_images
from mars_plugin.commands.predict_memory import memory_plan
from mars_plugin.commands.predict_settings import PredictSettings, add_predict_arguments  # noqa: F401 -- kept here
from mars_plugin.runs.errors import JobError, JobSummary, one_line
from mars_plugin.runs.size_batches import SizeBatches
from mars_plugin.runs.io_pipeline import IOPipeline, check_io_workers
from mars_plugin.runs.distributed import _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.resume_ledger import ResumeLedger

__all__ = [
    "predict_job",
    "run_predict",
]

PathLike = Union[str, os.PathLike]
#: one batch of images of one size: (stem, its inputs' identities, (H, W, 3) uint8 RGB) each
Batch = List[Tuple[str, Dict[str, Any], torch.Tensor]]


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


def _fuse_of(model: Any) -> str:
    """Where a network's own upstream fuses the scales (``predict_job``'s ``fuse_at=None``)."""
    # DHR's apply_ms is a method of its network: that network fuses as DHR does (SEAM's: test.py)
    from mars_plugin.networks.deeplabv2 import MSC

    fuse_at = {"deeplabv3+dhr": "logits", "deeplabv1-wr38": "seam"}.get(
        (getattr(model, "config", None) or {}).get("arch"), "input")
    return "max-logits" if isinstance(model, MSC) else fuse_at  # deeplab-pytorch's MSC: the max of its logits


def _check_fits(model: Any, s: PredictSettings, fuse_at: str, own_input: bool) -> None:
    """Settings the network cannot honour, refused once, before the first image (not as every
    image's failure): a flip where the scales are fused by deeplab-pytorch's max of the logits
    (``libs/models/msc.py:41-47``, no flip: :func:`~mars_plugin.networks.inference.multiscale_probs_max`),
    and, where the network's own input is used (``own_input``), CRF bytes turned back from
    another input than the network's (``"denormalized"``: ImageNet's mean and std;
    ``"mean-subtracted"``: deeplab-pytorch's BGR minus its mean)."""
    if s.flip and fuse_at == "max-logits":
        raise ValueError("flip is not possible with a deeplab-pytorch network: its scales are fused by the max of "
                         "their logits (MSC, libs/models/msc.py:41-47), which has no mirror images; turn it off "
                         "(--no-flip)")
    if not own_input or s.params is None:
        return
    caffe = (getattr(model, "config", None) or {}).get("arch") == "deeplabv2"
    wants = {"denormalized": False, "mean-subtracted": True}.get(s.crf_image, caffe)
    if wants != caffe:
        net = "BGR minus the caffe mean (deeplabv2)" if caffe else "RGB over ImageNet's mean and std"
        fit = "'mean-subtracted' or 'file'" if caffe else "'denormalized' or 'file'"
        raise ValueError(f"crf_image {s.crf_image!r} turns back another input than this network's ({net}); "
                         f"use {fit}")


@dataclass(frozen=True)
class _Job:
    """A :func:`predict_job`'s settings as this process runs them: the record ``s``, with the
    device, the memory budget, the I/O threads, the fusion and the network's input resolved."""

    s: PredictSettings
    device: torch.device
    max_bytes: Optional[int]
    io_workers: int
    fuse_at: str
    preprocess: Callable[[torch.Tensor], torch.Tensor]
    num_classes: Optional[int]

    @classmethod
    def of(cls, model: Any, s: PredictSettings, preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]],
           num_classes: Optional[int]) -> "_Job":
        """``s`` resolved for ``model`` on this rank's device."""
        fuse_at = s.fuse_at or _fuse_of(model)
        _check_fits(model, s, fuse_at, preprocess is None)  # before the device, the folder, any image
        device = resolve_device(s.device) if isinstance(s.device, str) else s.device
        max_bytes = resolve_max_bytes(s.max_bytes, device)
        io_workers = check_io_workers(s.io_workers, device)
        return cls(s, device, max_bytes, io_workers, fuse_at, preprocess or _preprocess_of(model), num_classes)

    def identity(self, model: Any, settings: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
        """What shapes the labels (the folder's record, compared on resume); ``settings``: what
        made ``model``."""
        s, params = self.s, self.s.params
        return {
            "model": dict(settings or {"model": type(model).__name__}), "scales": list(s.scales), "flip": bool(s.flip),
            "crf": "none" if params is None else s.crf, "crf_params": params,
            "class_threshold": s.class_threshold if params is not None else None, "fp16": bool(s.fp16),
            # recorded only where it is not the file's bytes, so folders written before the option resume
            **({"crf_image": s.crf_image} if params is not None and s.crf_image != "file" else {}),
            **({"fuse_at": self.fuse_at} if self.fuse_at != "input" else {})}


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
    # the keywords checked as one record (mars predict passes the fields of the one it built: the
    # same checks again, which a checked record passes unchanged)
    s = PredictSettings(scales=scales, flip=flip, crf=crf, class_threshold=class_threshold, crf_image=crf_image,
                        fuse_at=fuse_at, batch_size=batch_size, device=device, fp16=fp16, on_error=on_error,
                        progress=progress, max_bytes=max_bytes, io_workers=io_workers)
    if not callable(model):
        raise TypeError(f"model must be a network (nn.Module), got {describe(model)}")
    from mars_plugin.commands.job_settings import own_record

    own_record("predict_job", None, settings, mapping="what made the model: its file, which weights")
    job = _Job.of(model, s, preprocess, num_classes)
    return _predict_folder(model, job, Path(images_dir), Path(out_dir), settings, images_flag)


def _predict_folder(model: nn.Module, job: _Job, images_dir: Path, out_dir: Path,
                    settings: Optional[Mapping[str, Any]], images_flag: str) -> JobSummary:
    """:func:`predict_job` once its arguments are checked: the record, the ranks' meeting points."""
    from mars_plugin.runs.run_record import FolderRecord

    rank, world = _rank_world()
    record = FolderRecord(out_dir, "predict", job.identity(model, settings), rank=rank)
    group = sync_group()  # before anything that can fail on one rank only: every rank reaches it
    try:
        items, clashes = _open_folder(images_dir, out_dir, images_flag, record, rank, group)
        everything = sorted({s for s, _ in items} | set(clashes))
        mine = set(everything[rank::world])
        summary = JobSummary()
        record.tell(summary)
        error: Optional[BaseException] = None
        try:
            _predict_shard(model, job, [(s, p) for s, p in items if s in mine],
                           {s: n for s, n in clashes.items() if s in mine}, out_dir, summary, record,
                           progress=job.s.progress and rank == 0,
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


def _open_folder(images_dir: Path, out_dir: Path, images_flag: str, record: Any, rank: int, group: Any
                 ) -> Tuple[List[Tuple[str, Path]], Dict[str, List[str]]]:
    """The images (and the stems several images share), listed alike on every rank; the
    folder's record opened (rank 0 writes its settings) and loaded."""
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
    from mars_plugin.commands.features import _check_same_work

    _check_same_work(sorted({s for s, _ in items} | set(clashes)), images_dir, group)
    if rank == 0:
        record.write_settings()
    record.load()
    return items, clashes


def _predict_shard(model: nn.Module, job: _Job, items: List[Tuple[str, Path]], clashes: Dict[str, List[str]],
                   out_dir: Path, summary: JobSummary, record: Any, *, progress: bool, desc: str) -> None:
    """:func:`predict_job`'s work on one rank's images, counted in ``summary``."""
    out_dir.mkdir(parents=True, exist_ok=True)  # on every rank: exist_ok makes the race harmless
    if isinstance(model, nn.Module):
        model.to(job.device).eval()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items) + len(clashes), desc=desc, unit="img")
    ledger = ResumeLedger(record, summary, job.s.on_error, None if bar is None else lambda: bar.update(1))
    try:
        todo, limits = _todo(model, job, items, clashes, out_dir, ledger)
        _predict_todo(model, job, todo, limits, dict(items), out_dir, ledger)
    finally:
        if bar is not None:
            bar.close()


def _todo(model: nn.Module, job: _Job, items: List[Tuple[str, Path]], clashes: Dict[str, List[str]], out_dir: Path,
          ledger: ResumeLedger) -> Tuple[List[Tuple[str, Path, Dict[str, Any]]], Dict[Tuple[int, int], int]]:
    """The images whose label must be made ((stem, path, inputs) each), and the most images of
    each size a batch holds; the stems several images share, the labels kept and the images the
    memory budget refuses are settled in ``ledger``."""
    from mars_plugin.runs.identities import file_id

    s = job.s
    for stem, names in sorted(clashes.items()):
        ledger.fail(stem, f"several images share this stem ({', '.join(names)}); rename all but one")
    # Before any work: every image to predict against the memory budget, from its header.
    refused, limits = memory_plan(model, items, out_dir, ledger.record, job.max_bytes, scales=s.scales, flip=s.flip,
                                  fp16=s.fp16, params=s.params, num_classes=job.num_classes, device=job.device)
    if refused and s.on_error == "stop":
        ledger.fail(*next(iter(refused.items())))
    todo = []
    for stem, path in items:
        inputs = {"image": file_id(path)}  # before reading it: a change while it is read shows next time
        if not ledger.needs(stem, out_dir / f"{stem}.png", inputs):
            continue
        if stem in refused:
            ledger.fail(stem, refused[stem])
            continue
        todo.append((stem, path, inputs))
    return todo, limits


def _read(job: _Job, path: Path) -> torch.Tensor:
    """One image read, decoded and checked (in an ``--io-workers`` thread): (H, W, 3) uint8."""
    rgb = read_image(path)
    H, W = rgb.shape[:2]
    for s in job.s.scales:
        _scaled_size(H, W, s)
    if job.s.params is not None and job.num_classes is not None:  # before any work: its CRF's memory
        check_crf_image(job.s.params, H, W, job.num_classes + 1, max_bytes=job.max_bytes, name="--crf",
                        budget_name=MEMORY_FLAG)
    return torch.from_numpy(rgb)


def _labels(model: nn.Module, job: _Job, batch: Batch) -> torch.Tensor:
    """One batch's labels: the scales' (and flips') softmax fused, then the CRF; on the CPU."""
    from mars_plugin.networks.deeplabv1 import seam_crf_bytes, seam_multiscale_probs

    s = job.s
    rgb = torch.stack([img for _, _, img in batch]).to(job.device)  # (B, H, W, 3) uint8
    x = job.preprocess(rgb)
    fuse = {"logits": multiscale_probs_dhr, "seam": seam_multiscale_probs,
            "max-logits": multiscale_probs_max}.get(job.fuse_at, multiscale_probs)
    probs = fuse(model, x, s.scales, s.flip, fp16=s.fp16)
    if job.num_classes is not None and probs.shape[1] != job.num_classes + 1:
        raise ValueError(f"the network gives {probs.shape[1]} classes, the checkpoint says {job.num_classes} + "
                         "background")
    seam_bytes = job.fuse_at == "seam" and s.crf_image == "denormalized"  # test.py's img_denorm, in float32
    crf_bytes = seam_crf_bytes(x) if seam_bytes else crf_rgb(rgb, x, s.crf_image)
    return labels_from_probs(probs, crf_bytes, s.crf, s.class_threshold, max_bytes=job.max_bytes).cpu()


def _predict_todo(model: nn.Module, job: _Job, todo: List[Tuple[str, Path, Dict[str, Any]]],
                  limits: Dict[Tuple[int, int], int], where: Dict[str, Path], out_dir: Path,
                  ledger: ResumeLedger) -> None:
    """The images read ahead and the labels written behind (``--io-workers`` threads,
    :class:`~mars_plugin.runs.io_pipeline.IOPipeline`), predicted in batches of one size
    (:class:`~mars_plugin.runs.size_batches.SizeBatches`); each label written is recorded."""
    def keep(written: Any) -> None:
        # the labels written, recorded in the order they were queued (a failed write, a full
        # disk, is not the image's fault: it stops)
        for (stem, inputs), digest in written:
            ledger.written(stem, out_dir / f"{stem}.png", inputs, digest)

    def failed(item: Tuple[str, Dict[str, Any], torch.Tensor], e: Exception) -> None:
        stem, _, img = item
        ledger.fail(stem, f"{where[stem]}, {img.shape[1]}x{img.shape[0]} pixels: {one_line(e)}")

    batch_size = job.s.batch_size
    with IOPipeline(job.io_workers, ahead=2 * batch_size, behind=2 * batch_size) as io:
        def write(batch: Batch, labels: torch.Tensor) -> None:
            for (stem, inputs, _), y in zip(batch, labels):
                io.write((stem, inputs), _write_labels, out_dir / f"{stem}.png", y)
            keep(io.written())

        batches = SizeBatches(batch_size, lambda b: _labels(model, job, b), write, failed)  # one size: one pass
        try:
            for (stem, _, inputs), fut in io.reads(lambda t: _read(job, t[1]), todo):
                try:
                    img = fut.result()
                except Exception as e:  # noqa: BLE001 -- any failure to read one image is that file's failure
                    ledger.fail(stem, one_line(e))
                    continue
                key = tuple(img.shape[:2])
                batches.add(key, (stem, inputs, img), limits.get(key))
            batches.flush()
            keep(io.written(0))
        except BaseException:  # the network failed or Ctrl-C: the labels already whole are recorded first
            with contextlib.suppress(Exception):  # (a failure to record them must not hide the error)
                keep(io.settled())
            raise


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
    from mars_plugin.runs.identities import weight_file_id

    _check_folder_flags(args)
    model, meta = load_model(args.model, args.which)
    num_classes = int(meta["model"]["num_classes"])
    s = PredictSettings.from_args(args, meta)  # the flags given, over the checkpoint's recipe
    if args.root is not None:
        images_dir, out, flag = _dhr_folders(args, num_classes)
    else:
        images_dir, out, flag = Path(args.images), Path(args.out), "--images"
    settings = {"file": weight_file_id(args.model), "which": meta["which"], "network": meta["model"],
                **({"recipe": meta["recipe"]} if meta.get("recipe") is not None else {})}
    summary = predict_job(model, images_dir, out, **s.keywords(), num_classes=num_classes, settings=settings,
                          images_flag=flag)
    return summary, out


def _check_folder_flags(args: argparse.Namespace) -> None:
    """One of ``--images DIR`` (with ``--out``) and ``--root`` (with ``--method`` or ``--out``)."""
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


def _dhr_folders(args: argparse.Namespace, num_classes: int) -> Tuple[Path, Path, str]:
    """``--root``: the images of ``<root>/<data>/<domain>/image/``, the output folder (``--out``
    or, with ``--method``, DHR's WSS tree) and the flag naming the images."""
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
    if args.method is None:
        return images_dir, Path(args.out), "--root"
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
    return images_dir, out, "--root"
