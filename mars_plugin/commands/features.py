"""``mars features``: a folder of images in, ``features/<stem>.npy`` (or ``.pt``) out.

The folder job (:func:`features_job`) runs any
:class:`~mars_plugin.adapters.uss.extractor.FeatureExtractor` over an image folder, batching
same-size images, resumable per file, sharded under torchrun; :func:`run_features` is the
command (the extractor from :func:`~mars_plugin.adapters.uss.extractor.load_extractor`).

The command line (wired as ``mars features`` by :mod:`mars_plugin.cli`)::

    mars features --uss stego --checkpoint cocostuff27_vit_base_5.ckpt --trust-pickle \\
                  --images VOC2012/JPEGImages --out features --device cuda --fp16
    # DHR's STEGO: DINO's backbone file + DHR's heads file, DHR's inference
    mars features --uss stego --backbone dino_vitbase8_pretrain.pth --heads weights/STEGO_VOC2012.pt \\
                  --dhr --images VOC2012/JPEGImages --out features --device cuda
    # DINOv2's patch tokens from its release file, DHR's inference
    mars features --uss dinov2 --backbone dinov2_vitb14_pretrain.pth --dhr \\
                  --images VOC2012/JPEGImages --out features --device cuda
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn

from mars_plugin.commands import cli_types as T
from mars_plugin._checks import MAX_BATCH_SIZE, MAX_STRIDE, check_int_param, check_scales
from mars_plugin.formats.files import (FEATURE_EXTENSIONS, IMAGE_EXTENSIONS, check_stem, list_stems, read_image,
                                      write_features)
from mars_plugin.commands.inputs import _label_like
from mars_plugin.runs.errors import JobError, JobSummary, one_line
from mars_plugin.runs.size_batches import SizeBatches
from mars_plugin.runs.distributed import _dist_ready, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.identities import array_digest, file_id

from mars_plugin.adapters.uss.preprocess import check_output_size
from mars_plugin.adapters.uss.extractor import USS_MODELS, load_extractor

__all__ = [
    "features_job",
    "add_features_arguments",
    "scales_argument",
    "run_features",
]

PathLike = Union[str, os.PathLike]
ON_ERROR = ("stop", "skip")
#: ``file_format`` of :func:`features_job`: numpy arrays, or fp16 torch tensors as DHR writes them.
FILE_FORMATS = ("npy", "pt")


# --------------------------------------------------------------------------------------------
# the folder job
# --------------------------------------------------------------------------------------------


def _target_size(output_size: Any, stride: Optional[int], height: int, width: int) -> Optional[Tuple[int, int]]:
    if stride is not None:
        return math.ceil(height / stride), math.ceil(width / stride)
    if output_size is None:
        return None
    if isinstance(output_size, str):
        return height, width  # "image", checked by features_job
    return check_output_size(output_size)


def _image_paths(images_dir: Path) -> Tuple[List[Tuple[str, Path]], Dict[str, List[str]]]:
    """(stem, path) for every image, sorted by stem; stems with several files are returned apart."""
    if not images_dir.exists():
        raise ValueError(f"--images {images_dir}: no such folder")
    if not images_dir.is_dir():
        raise ValueError(f"--images {images_dir}: not a folder")
    by_stem: Dict[str, List[Path]] = {}
    for p in images_dir.iterdir():
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS:
            by_stem.setdefault(p.stem, []).append(p)
    ok = [(s, ps[0]) for s, ps in sorted(by_stem.items()) if len(ps) == 1]
    clashes = {s: sorted(p.name for p in ps) for s, ps in by_stem.items() if len(ps) > 1}
    return ok, clashes


def features_job(
    extractor: Callable[..., torch.Tensor],
    images_dir: PathLike,
    out_dir: PathLike,
    *,
    batch_size: int = 8,
    device: Union[str, torch.device] = "cpu",
    fp16: bool = False,
    output_size: Optional[Union[str, Tuple[int, int]]] = None,
    stride: Optional[int] = None,
    on_error: str = "stop",
    progress: bool = True,
    file_format: str = "npy",
    stems: Optional[Sequence[str]] = None,
    settings: Optional[Dict[str, Any]] = None,
) -> JobSummary:
    """Write ``<out_dir>/<stem>.npy`` (or ``.pt``), float16 (D, h, w), for every image of ``images_dir``
    (or for the images of ``stems`` only).

    Args:
        extractor: a :class:`FeatureExtractor` (an ``nn.Module`` is moved to ``device`` and put
            in eval mode).
        batch_size: images per forward pass; only images of the same size share a batch (a few
            sizes are buffered at once, at most ``4 * batch_size`` images).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``... or ``"auto"``: GPU ``LOCAL_RANK`` (mod
            the GPU count) when CUDA is available, else the CPU (the rule of every ``mars`` job).
        fp16: run under ``torch.autocast`` in float16 (for GPUs; the files are float16 anyway).
        output_size: None (the extractor's grid, e.g. (H'/8, W'/8) for STEGO ViT-S/8: the
            smallest files; the core resizes to the label), ``"image"`` (each image's own H x W)
            or an (h, w) pair.
        stride: instead of ``output_size``: ``(ceil(H / stride), ceil(W / stride))``.
        on_error: a file that cannot be read (or clashes with another of the same stem):
            ``"stop"`` raises :class:`~mars_plugin.runs.errors.JobError` naming it; ``"skip"`` records
            it in the summary and goes on.
        progress: show a progress bar (under torch.distributed, rank 0's only: see below).
        file_format: ``"npy"`` (a numpy array) or ``"pt"`` (an fp16 torch tensor, the file
            DHR's produce_uss_features.py:34 writes); both are read by every ``mars`` command.
        stems: only these images (e.g. those that have a pseudo label, when the image folder
            holds a whole split); a stem with no image in ``images_dir`` is a per-file failure.
        settings: what made the extractor (its model files and options, as ``mars features``
            records them), part of the folder's record; None: the extractor's ``describe()``
            (a library extractor's weights are then not recorded: pass them here).

    Resume (:mod:`mars_plugin.runs.run_record`): ``out_dir/.mars-run.json`` records the settings
    (the model, ``fp16``, the output size, the format, the image folder; other settings are
    refused) and each rank's journal the image each file was made from: a file whose image is
    unchanged (name, size, mtime) is kept, one whose image changed, or that has no record, is
    computed again (``redone`` in the summary). One run at a time per ``out_dir`` (a lock, rank
    0's under torchrun). Every file is
    written atomically, so an interrupted run never leaves a half-written file. A stem whose
    file of the *other* format is already there is a per-file failure (``on_error``): the
    folder would hold two feature files for it, which the readers refuse. Returns a
    :class:`~mars_plugin.runs.errors.JobSummary`.

    Under an initialised torch.distributed (``torchrun``), every rank lists the same work (every
    stem asked for, sorted) and takes stems ``rank, rank + W, ...`` of it: the ranks write
    disjoint files, and resume stays per file, so a run killed under one world size resumes
    under another. Each rank returns the summary of its own share. All ranks meet at the end;
    a failure on one rank (``on_error="stop"``) is raised on every rank once they meet
    (:func:`~mars_plugin.runs.distributed.share_error`): the failed rank raises its own error, the others
    a :class:`~mars_plugin.runs.errors.JobError` naming that rank and its message. Only rank 0 shows
    a progress bar, over its share: bars of several processes on one terminal overwrite each
    other's lines, and the strided shares progress at about the same pace.
    """
    from mars_plugin.commands.inputs import check_out_apart  # before any work: an output is never an input

    check_out_apart(out_dir, "--out", {"--images": images_dir})
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if file_format not in FILE_FORMATS:
        raise ValueError(f"file_format must be one of {FILE_FORMATS}, got {file_format!r}")
    ext, other_ext = (".npy", ".pt") if file_format == "npy" else (".pt", ".npy")
    batch_size = check_int_param(batch_size, "batch_size", 1, MAX_BATCH_SIZE)
    if stride is not None:
        stride = check_int_param(stride, "stride", 1, MAX_STRIDE)
    if stride is not None and output_size is not None:
        raise ValueError("give either output_size or stride, not both")
    if isinstance(output_size, str) and output_size != "image":
        raise ValueError(f"output_size must be None, 'image' or an (h, w) pair, got {output_size!r}")
    if output_size is not None and not isinstance(output_size, str):
        check_output_size(output_size)
    if not callable(extractor):
        raise TypeError(f"extractor must be callable (a FeatureExtractor), got {type(extractor).__name__}")
    # "auto": GPU LOCAL_RANK (mod the GPU count) under torchrun, the one rule of every mars job.
    device = resolve_device(device)
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    wanted = None if stems is None else set(check_stem(s) for s in stems)
    rank, world = _rank_world()
    from mars_plugin.runs.run_record import FolderRecord

    if settings is None:
        describe = getattr(extractor, "describe", None)
        settings = {"extractor": describe() if callable(describe) else type(extractor).__name__}
    # The settings that shape the embeddings; not the image folder: each image is recorded by
    # its identity (a moved or copied tree is the same run), nor the format (npy or pt: the
    # same values; a folder may mix them).
    record = FolderRecord(out_dir, "features", {"fp16": bool(fp16), "output_size": output_size, "stride": stride,
                                                "model": settings}, rank=rank)
    # Created before anything that can fail on one rank only: every rank must reach it.
    group = sync_group()
    try:
        # Phase 1: the work list, then this rank's share of it. A failure on any rank (an
        # unreadable folder on one node, another run holding the lock, a folder of other
        # settings on rank 0) is raised on every rank by share_error.
        error: Optional[Exception] = None
        try:
            items, clashes, missing = _work_list(images_dir, wanted)
            if rank == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
                # the features of an id with no image are stale; ``stems`` is a filter, see FolderRecord.open
                record.open(list_stems(images_dir, IMAGE_EXTENSIONS), FEATURE_EXTENSIONS)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        share_error(error, group)
        everything = sorted({s for s, _ in items} | set(clashes) | set(missing))
        _check_same_work(everything, images_dir, group)
        if rank == 0:
            record.write_settings()
        record.load()
        # Rank r takes stems r, r + W, ... of the sorted list: no two ranks write the same file
        # (files are per stem), and a resumed run, whose done files are mostly a prefix of that
        # list, leaves every rank about the same share of the work left.
        mine = set(everything[rank::world])
        items = [(s, p) for s, p in items if s in mine]
        clashes = {s: n for s, n in clashes.items() if s in mine}
        missing = [s for s in missing if s in mine]
        summary = JobSummary()
        record.tell(summary)
        error = None
        try:
            _features_shard(extractor, images_dir, out_dir, items, clashes, missing, summary, ext=ext,
                            other_ext=other_ext, batch_size=batch_size, device=device, fp16=fp16,
                            output_size=output_size, stride=stride, on_error=on_error,
                            progress=progress and rank == 0,
                            desc="features" if world == 1 else f"features rank 0/{world}", record=record)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        # Phase 2: every rank meets here, also one that failed (on_error="stop"), so that none
        # waits for it forever; a failure anywhere is raised everywhere.
        share_error(error, group)
        return summary
    finally:
        record.close()
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)


def _work_list(
    images_dir: Path, wanted: Optional[set],
) -> Tuple[List[Tuple[str, Path]], Dict[str, List[str]], List[str]]:
    """(stem, path) of every image to process, the stems that clash, the asked-for stems with no image."""
    items, clashes = _image_paths(images_dir)
    if not items and not clashes:
        raise ValueError(f"--images {images_dir}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
    missing: List[str] = []
    if wanted is not None:
        have = {s for s, _ in items} | set(clashes)
        missing = sorted(wanted - have)
        if wanted and not wanted & have:
            raise ValueError(f"--images {images_dir}: none of the {len(wanted)} ids asked for has an image here "
                             f"(e.g. {min(wanted)}); is it the right folder?")
        items = [(s, p) for s, p in items if s in wanted]
        clashes = {s: n for s, n in clashes.items() if s in wanted}
    # A folder of label PNGs (pseudo labels, masks) given as the images: refused, not embedded.
    looked = [why for why in (_label_like(p, None) for _, p in items[:8])]
    if looked and all(looked):
        raise ValueError(f"--images {images_dir}: holds label maps, not RGB images ({len(looked)} of {len(looked)} "
                         f"looked at are class-id PNGs, e.g. {looked[0]}); give the folder of the photographs")
    return items, clashes, missing


def _check_same_work(stems: List[str], images_dir: Path, group: Any) -> None:
    """Every rank must shard the same list. Per-node copies of the images that differ, or a folder
    being written to, would make ranks skip or duplicate images silently: refuse, on every rank."""
    if not _dist_ready():
        return
    import hashlib

    import torch.distributed as dist

    mine = (len(stems), hashlib.sha256("\0".join(stems).encode()).hexdigest())
    got: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, mine, group=group)
    if len(set(got)) > 1:
        counts = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(got))
        raise JobError(f"{images_dir}: the ranks see different lists of images to work on ({counts}); every rank "
                       "must read the same folder (on a shared file system, with no images being added)")


def _features_shard(
    extractor: Callable[..., torch.Tensor], images_dir: Path, out_dir: Path, items: List[Tuple[str, Path]],
    clashes: Dict[str, List[str]], missing: List[str], summary: JobSummary, *, ext: str, other_ext: str,
    batch_size: int, device: torch.device, fp16: bool, output_size: Any, stride: Optional[int], on_error: str,
    progress: bool, desc: str, record: Any,
) -> None:
    """:func:`features_job`'s work on one rank's images, counted in ``summary``; ``record`` (a
    :class:`~mars_plugin.runs.run_record.FolderRecord`) says which files are current and records
    each file written."""
    out_dir.mkdir(parents=True, exist_ok=True)  # on every rank: exist_ok makes the race harmless
    if isinstance(extractor, nn.Module):
        extractor.to(device).eval()

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items) + len(clashes) + len(missing), desc=desc, unit="img")

    def tick(n: int = 1) -> None:
        if bar is not None:
            bar.update(n)

    def fail(stem: str, why: str) -> None:
        if on_error == "stop":
            raise JobError(f"{stem}: {why}")
        summary.failed.append((stem, why))
        tick()

    where = {stem: path for stem, path in items}

    def forward(batch: List[Tuple[str, Dict[str, Any], torch.Tensor]]) -> torch.Tensor:
        images = torch.stack([img for _, _, img in batch]).to(device)
        size = _target_size(output_size, stride, images.shape[-2], images.shape[-1])
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.float16, enabled=bool(fp16)):
            feats = extractor(images, output_size=size) if size is not None else extractor(images)
        if not isinstance(feats, torch.Tensor) or feats.ndim != 4 or feats.shape[0] != len(batch):
            got = f"shape {tuple(feats.shape)}" if isinstance(feats, torch.Tensor) else type(feats).__name__
            raise ValueError(f"the extractor must return (B, D, h, w) with B = {len(batch)}, got {got}")
        if size is not None and tuple(feats.shape[-2:]) != size:
            raise ValueError(f"the extractor returned {tuple(feats.shape[-2:])} maps, {size} were asked for")
        return feats

    def failed(item: Tuple[str, Dict[str, Any], torch.Tensor], e: Exception) -> None:
        stem, _, img = item
        fail(stem, f"{where[stem]}, {img.shape[2]}x{img.shape[1]} pixels: {one_line(e)}")

    def write(batch: List[Tuple[str, Dict[str, Any], torch.Tensor]], feats: torch.Tensor) -> None:
        feats = feats.float().cpu()
        for (stem, inputs, _), f in zip(batch, feats):
            with np.errstate(over="ignore"):
                arr = f.numpy().astype(np.float16)
            if not np.isfinite(arr).all():
                fail(stem, "embeddings are not finite in float16 (NaN, or beyond +-65504)")
                continue
            write_features(out_dir / f"{stem}{ext}", arr)
            record.add(stem, out_dir / f"{stem}{ext}", inputs, array_digest(arr))
            summary.done += 1
            summary.redone += stem in again
            tick()

    try:
        for stem in missing:
            fail(stem, f"no image of this id in {images_dir} (looked for {', '.join(IMAGE_EXTENSIONS)})")
        for stem, names in sorted(clashes.items()):
            fail(stem, f"several images share this stem ({', '.join(names)}); rename all but one")
        batches = SizeBatches(batch_size, forward, write, failed)  # one size: one forward pass
        again = set()  # stems whose existing file is computed again (its image changed, or no record)
        for stem, path in items:
            if (out_dir / f"{stem}{other_ext}").is_file():
                fail(stem, f"{out_dir / (stem + other_ext)} already exists: a {stem}{ext} beside it would clash "
                           "(two formats for one stem); remove one or pick that --format")
                continue
            inputs = {"image": file_id(path)}  # before reading it: a change while it is read shows next time
            kept, exists = record.current(stem, out_dir / f"{stem}{ext}", inputs)
            if kept:
                summary.existing += 1
                tick()
                continue
            if exists:
                again.add(stem)
            try:
                rgb = read_image(path)
            except Exception as e:  # noqa: BLE001 -- any failure to read one image is that file's failure
                fail(stem, one_line(e))
                continue
            img = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
            key = (int(img.shape[1]), int(img.shape[2]))
            try:  # sizes the extractor refuses (too many tokens, a side below a pixel): this file's failure
                getattr(extractor, "check_input_size", lambda h, w: None)(*key)
            except ValueError as e:
                fail(stem, f"{path}: {e}")
                continue
            batches.add(key, (stem, inputs, img))
        batches.flush()
    finally:
        if bar is not None:
            bar.close()


# --------------------------------------------------------------------------------------------
# command line: mars features
# --------------------------------------------------------------------------------------------


def scales_argument(text: str) -> Tuple[float, ...]:
    """--scales: comma-separated positive numbers, e.g. 2,1,1.5,0.5 (order kept)."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 2,1,1.5,0.5, got {text!r}") from None
    try:
        return check_scales(values)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


# An empty "%(default)" field: ArgumentDefaultsHelpFormatter then leaves out its "(default: None)"
# where the help text already says what None means.
_OWN_DEFAULT = "%(default).0s"


def add_features_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mars features`` (use an ``ArgumentDefaultsHelpFormatter`` to show defaults)."""
    parser.add_argument("--uss", choices=USS_MODELS, required=True,
                        help="unsupervised segmentation model the checkpoint belongs to")
    parser.add_argument("--checkpoint", default=None,
                        help="STEGO Lightning .ckpt (cocostuff27_vit_base_5.ckpt, potsdam_test.ckpt, ...) or Leopart "
                             ".ckpt (leopart_vits16.ckpt, leopart_vitb8.ckpt, or a Lightning checkpoint); or give "
                             "--backbone and --heads" + _OWN_DEFAULT)
    parser.add_argument("--backbone", default=None,
                        help="STEGO or CAUSE as DHR stores them: the backbone file (DINO's dino_vitbase8_pretrain.pth; "
                             "DINOv2 weights for CAUSE), with --heads; --uss dinov2: DINOv2's release file alone "
                             "(dinov2_vitb14_pretrain.pth, ..._reg4_pretrain.pth)"
                             + _OWN_DEFAULT)
    parser.add_argument("--heads", default=None,
                        help="STEGO or CAUSE as DHR stores them: the heads file (weights/STEGO_<dataset>.pt, 'cluster1' "
                             "and 'cluster2'; weights/CAUSE_<dataset>.pt, 'decoder' and 'codebook'; or CAUSE's own release folder "
                             "CAUSE/<dataset>/dinov2_vit_base_14/2048/ or its segment_tr.pth), with --backbone" + _OWN_DEFAULT)
    parser.add_argument("--images", required=True, help="folder of RGB images <stem>.jpg/.jpeg/.png/.bmp")
    parser.add_argument("--out", required=True, help="output folder of <stem>.npy float16 (D, h, w) embeddings")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N, or auto: GPU LOCAL_RANK under torchrun (each rank its own GPU), "
                             "the GPU if any otherwise, else the CPU")
    parser.add_argument("--batch-size", type=T.batch_size, default=8, help="images per forward pass (same-size images only)")
    parser.add_argument("--fp16", action="store_true", help="run the network under float16 autocast (GPU)")
    parser.add_argument("--res", type=T.res, default=None,
                        help="STEGO: shorter image side fed to the ViT (default: 320, its evaluation); "
                             "Leopart: square input side (default: 448, its evaluation); DINOv2: shorter side "
                             "(default: native); 'native': the image's own "
                             "resolution (DHR)" + _OWN_DEFAULT)
    parser.add_argument("--interpolation", choices=("nearest", "bilinear"), default=None,
                        help="input resize (default: nearest for STEGO, as its transform; bilinear for Leopart)"
                             + _OWN_DEFAULT)
    parser.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                        help="average the embeddings with those of the horizontally flipped image (default: yes for "
                             "STEGO, as its evaluation; no for Leopart)" + _OWN_DEFAULT)
    parser.add_argument("--scales", type=scales_argument, default=None,
                        help="DHR's multi-scale inference at these comma-separated scales of the --res image, e.g. "
                             "2,1,1.5,0.5 (the first sets the output grid; default: one scale)" + _OWN_DEFAULT)
    parser.add_argument("--dhr", action="store_true",
                        help="DHR's inference: --res native --scales 2,1,1.5,0.5 --flip --no-normalize (flags given "
                             "explicitly win)")
    parser.add_argument("--head", action="store_true",
                        help="Leopart: use the 256-d projection-head embedding instead of the backbone tokens")
    parser.add_argument("--prefix", default=None,
                        help="Leopart: key prefix of the backbone in the checkpoint (default: 'model.', else the "
                             "single prefix in front of 'cls_token')" + _OWN_DEFAULT)
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalise each pixel's embedding (default: yes for STEGO and the Leopart head, no "
                             "for Leopart backbone tokens)" + _OWN_DEFAULT)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--stride", type=T.stride, default=None,
                      help="write maps of ceil(H/N) x ceil(W/N) for an H x W image (default: the ViT patch grid; "
                           "the MARS core resizes features to each label anyway)" + _OWN_DEFAULT)
    size.add_argument("--full-size", action="store_true",
                      help="write maps of the image's own H x W (large files: D*H*W*2 bytes each)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow unpickling a checkpoint that holds Python objects besides its weights (STEGO's "
                             "and Lightning's .ckpt files do); only for files you trust")
    parser.add_argument("--on-error", choices=ON_ERROR, default="stop",
                        help="an unreadable image: stop with its name (exit 2), or report it, go on and exit 1")
    parser.add_argument("--format", choices=FILE_FORMATS, default="npy", dest="file_format",
                        help="write <stem>.npy arrays or <stem>.pt fp16 torch tensors (DHR's format)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_features(args: argparse.Namespace) -> JobSummary:
    """``mars features``: load the extractor, say what it is on stdout, run :func:`features_job`
    (under torchrun: this rank's share, see :func:`features_job`)."""
    extractor = load_extractor(
        args.uss, args.checkpoint, backbone=args.backbone, heads=args.heads, trust_pickle=args.trust_pickle,
        res=args.res, flip_average=args.flip, head=args.head, normalize=args.normalize,
        interpolation=args.interpolation, prefix=args.prefix, scales=args.scales, dhr=args.dhr,
    )
    if _rank_world()[0] == 0:  # once per launch, not once per rank
        print(f"{extractor.describe()} -> {args.out}", flush=True)
    from mars_plugin.runs.identities import model_files_id

    # The folder's record: the model files (size and hash of their ends) and every option that
    # shapes the embeddings, as given (None: the model's default).
    settings = dict(model_files_id(args.uss, args.checkpoint, args.backbone, args.heads),
                    **{k: getattr(args, k) for k in ("res", "flip", "scales", "dhr", "head", "normalize",
                                                     "interpolation", "prefix")})
    return features_job(
        extractor, args.images, args.out, batch_size=args.batch_size, device=args.device, fp16=args.fp16,
        output_size="image" if args.full_size else None, stride=args.stride, on_error=args.on_error,
        progress=not args.no_progress, file_format=args.file_format, settings=settings,
    )
