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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn

from mars_plugin.formats.files import (FEATURE_EXTENSIONS, IMAGE_EXTENSIONS, check_stem, list_stems, read_image,
                                      write_features)
from mars_plugin.commands.features_settings import (FILE_FORMATS, FeaturesSettings, _OWN_DEFAULT,  # noqa: F401
                                                    add_features_arguments, scales_argument)
from mars_plugin.commands.inputs import _label_like
from mars_plugin.runs.errors import ON_ERROR, JobError, JobSummary, one_line  # noqa: F401 -- ON_ERROR: kept importable here
from mars_plugin.runs.resume_ledger import ResumeLedger
from mars_plugin.runs.size_batches import SizeBatches
from mars_plugin.runs.distributed import _dist_ready, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.identities import array_digest, file_id

from mars_plugin.adapters.uss.preprocess import check_output_size

__all__ = [
    "features_job",
    "FeaturesSettings",
    "add_features_arguments",
    "scales_argument",
    "run_features",
]

PathLike = Union[str, os.PathLike]


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
    settings: Union[None, FeaturesSettings, Mapping[str, Any]] = None,
    stems: Optional[Sequence[str]] = None,
    **keywords: Any,
) -> JobSummary:
    """Write ``<out_dir>/<stem>.npy`` (or ``.pt``), float16 (D, h, w), for every image of ``images_dir``
    (or for the images of ``stems`` only).

    Args:
        extractor: a :class:`FeatureExtractor` (an ``nn.Module`` is moved to ``device`` and put
            in eval mode).
        settings: a :class:`~mars_plugin.commands.features_settings.FeaturesSettings`, or its
            fields as ``keywords`` (below); a mapping here is the older spelling of its ``model``.
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
        model: what made the extractor (its model files and options, as ``mars features``
            records them), part of the folder's record; None: from ``uss`` and its files when
            given, else the extractor's ``describe()`` (a library extractor's weights are then
            not recorded: pass them here).

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
    s = _settings(settings, keywords)
    if not callable(extractor):
        raise TypeError(f"extractor must be callable (a FeatureExtractor), got {type(extractor).__name__}")
    # "auto": GPU LOCAL_RANK (mod the GPU count) under torchrun, the one rule of every mars job.
    device = resolve_device(s.device)
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    wanted = None if stems is None else set(check_stem(x) for x in stems)
    rank, world = _rank_world()
    from mars_plugin.runs.run_record import FolderRecord

    record = FolderRecord(out_dir, "features", s.identity(extractor), rank=rank)
    # Created before anything that can fail on one rank only: every rank must reach it.
    group = sync_group()
    try:
        share = _my_share(images_dir, out_dir, wanted, record, group)
        summary = JobSummary()
        record.tell(summary)
        error: Optional[Exception] = None
        try:
            _Embedder(extractor, s, device, out_dir, share).run(
                record, summary, progress=s.progress and rank == 0,
                desc="features" if world == 1 else f"features rank 0/{world}")
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


def _settings(settings: Union[None, FeaturesSettings, Mapping[str, Any]], keywords: Dict[str, Any]) -> FeaturesSettings:
    """:func:`features_job`'s record: ``settings``, or made (and checked) from ``keywords``."""
    from mars_plugin.commands.job_settings import own_record

    own_record("features_job", FeaturesSettings, settings, mapping="the model's description, as model=")
    if isinstance(settings, FeaturesSettings):
        if keywords:
            raise ValueError("give settings=FeaturesSettings(...) or its fields as keywords, not both "
                             f"(got {sorted(keywords)})")
        return settings
    if settings is not None:  # the older spelling of model=: what made the extractor
        if "model" in keywords:
            raise ValueError("give the model's description as model=..., not also as settings=...")
        keywords = {**keywords, "model": settings}
    return FeaturesSettings(**keywords)


@dataclass(frozen=True)
class _Share:
    """One rank's share of the work: the images to embed, the stems whose image clashes with
    another of the same stem, the stems asked for with no image."""

    images_dir: Path
    items: List[Tuple[str, Path]]
    clashes: Dict[str, List[str]]
    missing: List[str]

    @property
    def size(self) -> int:
        return len(self.items) + len(self.clashes) + len(self.missing)


def _my_share(images_dir: Path, out_dir: Path, wanted: Optional[set], record: Any, group: Any) -> _Share:
    """Phase 1: the work list (the same on every rank), then this rank's share of it. A failure
    on any rank (an unreadable folder on one node, another run holding the lock, a folder of
    other settings on rank 0) is raised on every rank by share_error."""
    rank, world = _rank_world()
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
    return _Share(images_dir, [(s, p) for s, p in items if s in mine], {s: n for s, n in clashes.items() if s in mine},
                  [s for s in missing if s in mine])


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


#: one image on its way through a batch: (stem, its identity as read, the (3, H, W) uint8 tensor)
_Item = Tuple[str, Dict[str, Any], torch.Tensor]


class _Embedder:
    """:func:`features_job`'s work on one rank's images (``share``): each read, batched with
    images of its size, embedded, checked and written; its ``ledger`` (a
    :class:`~mars_plugin.runs.resume_ledger.ResumeLedger` over the folder's record and the
    summary) says which files are current, records each file written and counts each file."""

    def __init__(self, extractor: Callable[..., torch.Tensor], s: FeaturesSettings, device: torch.device,
                 out_dir: Path, share: _Share) -> None:
        self.extractor, self.s, self.device, self.out_dir, self.share = extractor, s, device, out_dir, share
        self.ext, self.other_ext = s.extensions
        self.where = {stem: path for stem, path in share.items}

    def run(self, record: Any, summary: JobSummary, progress: bool, desc: str) -> None:
        """Every file of the share, counted in ``summary``: the failures known before reading
        first, then the images; ``record``: the folder's
        :class:`~mars_plugin.runs.run_record.FolderRecord`."""
        self.out_dir.mkdir(parents=True, exist_ok=True)  # on every rank: exist_ok makes the race harmless
        if isinstance(self.extractor, nn.Module):
            self.extractor.to(self.device).eval()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.share.size, desc=desc, unit="img")
        self.ledger = ResumeLedger(record, summary, self.s.on_error, None if bar is None else bar.update)
        fail, images_dir = self.ledger.fail, self.share.images_dir
        try:
            for stem in self.share.missing:
                fail(stem, f"no image of this id in {images_dir} (looked for {', '.join(IMAGE_EXTENSIONS)})")
            for stem, names in sorted(self.share.clashes.items()):
                fail(stem, f"several images share this stem ({', '.join(names)}); rename all but one")
            batches = SizeBatches(self.s.batch_size, self.forward, self.write, self.failed)  # one size: one pass
            for stem, path in self.share.items:
                self.take(stem, path, batches)
            batches.flush()
        finally:
            if bar is not None:
                bar.close()

    def take(self, stem: str, path: Path, batches: SizeBatches) -> None:
        """One image: settled at once (kept, or failed), or read into the batch of its size."""
        fail, other = self.ledger.fail, self.out_dir / f"{stem}{self.other_ext}"
        if other.is_file():
            fail(stem, f"{other} already exists: a {stem}{self.ext} beside it would clash "
                       "(two formats for one stem); remove one or pick that --format")
            return
        inputs = {"image": file_id(path)}  # before reading it: a change while it is read shows next time
        if not self.ledger.needs(stem, self.out_dir / f"{stem}{self.ext}", inputs):
            return
        try:
            rgb = read_image(path)
        except Exception as e:  # noqa: BLE001 -- any failure to read one image is that file's failure
            fail(stem, one_line(e))
            return
        img = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
        key = (int(img.shape[1]), int(img.shape[2]))
        try:  # sizes the extractor refuses (too many tokens, a side below a pixel): this file's failure
            getattr(self.extractor, "check_input_size", lambda h, w: None)(*key)
        except ValueError as e:
            fail(stem, f"{path}: {e}")
            return
        batches.add(key, (stem, inputs, img))

    def forward(self, batch: List[_Item]) -> torch.Tensor:
        """One forward pass over a batch of one image size; the maps' shape checked."""
        images = torch.stack([img for _, _, img in batch]).to(self.device)
        size = _target_size(self.s.output_size, self.s.stride, images.shape[-2], images.shape[-1])
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=torch.float16, enabled=bool(self.s.fp16)):
            feats = self.extractor(images, output_size=size) if size is not None else self.extractor(images)
        if not isinstance(feats, torch.Tensor) or feats.ndim != 4 or feats.shape[0] != len(batch):
            got = f"shape {tuple(feats.shape)}" if isinstance(feats, torch.Tensor) else type(feats).__name__
            raise ValueError(f"the extractor must return (B, D, h, w) with B = {len(batch)}, got {got}")
        if size is not None and tuple(feats.shape[-2:]) != size:
            raise ValueError(f"the extractor returned {tuple(feats.shape[-2:])} maps, {size} were asked for")
        return feats

    def failed(self, item: _Item, e: Exception) -> None:
        """A batch's forward pass failed: each of its images, alone, is that file's failure."""
        stem, _, img = item
        self.ledger.fail(stem, f"{self.where[stem]}, {img.shape[2]}x{img.shape[1]} pixels: {one_line(e)}")

    def write(self, batch: List[_Item], feats: torch.Tensor) -> None:
        """Each image's maps as float16, written atomically and recorded (non-finite: a failure)."""
        feats = feats.float().cpu()
        for (stem, inputs, _), f in zip(batch, feats):
            with np.errstate(over="ignore"):
                arr = f.numpy().astype(np.float16)
            if not np.isfinite(arr).all():
                self.ledger.fail(stem, "embeddings are not finite in float16 (NaN, or beyond +-65504)")
                continue
            out = self.out_dir / f"{stem}{self.ext}"
            write_features(out, arr)
            self.ledger.written(stem, out, inputs, array_digest(arr))


# --------------------------------------------------------------------------------------------
# command line: mars features (its flags: features_settings)
# --------------------------------------------------------------------------------------------


def run_features(args: argparse.Namespace) -> JobSummary:
    """``mars features``: load the extractor, say what it is on stdout, run :func:`features_job`
    (under torchrun: this rank's share, see :func:`features_job`)."""
    settings = FeaturesSettings.from_args(args)
    extractor = settings.load_extractor()
    if _rank_world()[0] == 0:  # once per launch, not once per rank
        print(f"{extractor.describe()} -> {args.out}", flush=True)
    # The folder's record: the model files (size and hash of their ends) and every option that
    # shapes the embeddings, as given (None: the model's default): FeaturesSettings.identity.
    return features_job(extractor, args.images, args.out, settings=settings)
