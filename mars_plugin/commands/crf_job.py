"""``mars crf``: the dense CRF over a folder of a codebase's CAMs (or of probability maps) and
their images, in batches on the device; label PNGs or probabilities out. Resumable, sharded
under torchrun, ``--on-error skip``.

Per file, in ``--io-workers`` threads or ``--workers`` processes (or this one): the CAMs are
read by the codebase's adapter (``load_cams``) and turned into the CRF's input by its own rule
(``crf_input``: IRNet/AdvCAM's confident labels' unary, SEAM's and RS+EPM's background from the
CAMs, DHR's probabilities resized to the image); in this process, the CRF of a batch
(:func:`mars_plugin.engines.crf.dense_crf` or :func:`~mars_plugin.engines.crf.dense_crf_from_unary`,
images of any sizes with one number of labels); then, in the workers again, the codebase's rule
after the CRF (``crf_label``) and the file's encoding. A batched run equals the adapter's per-image ``cams_to_label``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES
from mars_plugin.formats.files import BIASED_VALUE, FEATURE_EXTENSIONS, atomic_write, list_stems, read_image, write_label
from mars_plugin.commands.crf_settings import CrfSettings
from mars_plugin.runs.distributed import _free, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.errors import JobError, JobSummary, one_line

__all__ = ["crf_job", "run_crf_command", "CAM_EXTENSIONS"]

#: The CAM file of each codebase (its ``load_cams``).
CAM_EXTENSIONS = {"irnet": ".npy", "advcam": ".npy", "seam": ".npy", "rsepm": ".pkl", "dhr": ".pt"}
#: The outputs of ``--write labels`` and ``--write probs`` (a restart moves both kinds aside).
OUTPUT_EXTENSIONS = (".png", ".npy")


# ------------------------------------------------------------------------ one file (workers)

def _adapter(wsss: str):
    from mars_plugin.commands.label_formats import _adapter as adapter

    return adapter(wsss)


def _read_probs(path: Path) -> Dict[str, Any]:
    """A ``--probs`` file: (L, H, W) probabilities, channel = class id (never unpickled)."""
    from mars_plugin.formats.files import read_features

    try:
        p = read_features(path, keep_half=True)  # widened on the device: half the bytes move
    except ValueError as e:
        raise ValueError(one_line(e).replace("features", "probability map")) from None
    return {"kind": "probs", "maps": [p], "ids": np.arange(p.shape[0]), "size": tuple(p.shape[1:])}


def _read_item(src: str, rgb: np.ndarray, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The CRF's input from one file of maps, for the (H, W, 3) image ``rgb``."""
    if cfg["wsss"] is None:
        item = _read_probs(Path(src))
        if cfg["write"] == "labels" and len(item["ids"]) > BIASED_VALUE:
            # a class id written into a uint8 PNG must stay below 254 (biased) and 255 (ignore)
            raise ValueError(f"the probability map has {len(item['ids'])} channels; label PNGs hold class ids "
                             f"0..{BIASED_VALUE - 1} (254 is biased, 255 ignore): use --write probs")
        return item
    adapter = _adapter(cfg["wsss"])
    cams = adapter.load_cams(src, trust_pickle=cfg["trust_pickle"])
    if cfg["wsss"] == "dhr":  # DHR resizes its maps to the image (produce_wss_masks.py:64-67)
        return adapter.crf_input(cams, image_size=rgb.shape[:2])
    if cfg["wsss"] == "seam":  # an empty dict (no class) is all background, of the image's size
        return adapter.crf_input(cams, size=rgb.shape[:2])
    return adapter.crf_input(cams)


def _prepare(job: Tuple[str, str, str, Dict[str, Any]]) -> Tuple[str, Optional[Dict[str, Any]], Optional[str]]:
    """Read one file and its image, and make the CRF's input (in a worker): (stem, the prepared
    item or None, the error message or None). The maps file may declare no more than maps of
    its image can be (:func:`~mars_plugin.formats.bounded_load.image_read_bytes`) and
    ``--max-memory`` allows: checked by the one door of file reads before anything is allocated."""
    from mars_plugin.formats.bounded_load import image_read_bytes, read_limit

    stem, src, image_path, cfg = job
    try:
        rgb = read_image(image_path)
        H, W = rgb.shape[:2]
        with read_limit(image_read_bytes(H, W), f"maps of its {W}x{H} image: 256 channels of twice its side, 8 "
                        "bytes each"), read_limit(cfg.get("max_bytes"), "--max-memory"):
            item = _read_item(src, rgb, cfg)
        if tuple(item["size"]) != tuple(rgb.shape[:2]):
            raise ValueError(f"the maps are {item['size'][1]}x{item['size'][0]} and the image {image_path} "
                             f"{rgb.shape[1]}x{rgb.shape[0]} (width x height); expected one size")
        if cfg["write"] == "probs" and cfg["wsss"] is not None and item["maps"] \
                and int(np.max(item["ids"])) >= cfg["num_labels"]:
            raise ValueError(f"class id {int(np.max(item['ids']))} does not fit the {cfg['num_labels']} channels of "
                             f"--dataset {cfg['dataset']}")
        # plain arrays cross processes cheaply; a float16 map stays float16 until the device
        item["maps"] = [(m if m.dtype == torch.float16 else m.float()).numpy() for m in item["maps"]]
        item["rgb"] = rgb
        return stem, item, None
    except MemoryError as e:  # numpy's message names a shape, not the file: name it
        return stem, None, f"{src}: {one_line(e)} (preparing its maps for the CRF)"
    except Exception as e:  # noqa: BLE001 -- any failure to read one file is that file's failure
        return stem, None, one_line(e)


def _output(item: Dict[str, Any], marginals: Optional[List[np.ndarray]], cfg: Dict[str, Any]) -> np.ndarray:
    """The file's content after the CRF: its codebase's label, or the marginals by class id."""
    if cfg["write"] == "labels":
        if cfg["wsss"] is None:  # (H, W): the argmax already taken on the GPU (see _crf_batch)
            best = marginals[0] if marginals[0].ndim == 2 else np.argmax(marginals[0], axis=0)
            return np.asarray(item["ids"])[best].astype(np.uint8)
        q = None if marginals is None else [torch.from_numpy(m) for m in marginals]
        return _adapter(cfg["wsss"]).crf_label(item, q).numpy().astype(np.uint8)
    dtype = np.dtype(cfg["probs_dtype"])
    if cfg["wsss"] is None:
        return marginals[0].astype(dtype)
    H, W = item["size"]
    out = np.zeros((cfg["num_labels"], H, W), dtype=dtype)
    if marginals:
        out[np.asarray(item["ids"])] = marginals[0]
    else:  # nothing to refine: all background
        out[0] = 1
    return out


def _finish(job: Tuple[str, Dict[str, Any], Optional[List[np.ndarray]], str, Dict[str, Any]]) -> Tuple[str, str]:
    """After the CRF (in a worker): the output, written atomically; (stem, its digest)."""
    from mars_plugin.runs.identities import array_digest

    stem, item, marginals, path, cfg = job
    out = _output(item, marginals, cfg)
    if cfg["write"] == "labels":
        write_label(path, torch.from_numpy(out), mode="P")
    else:
        def save(tmp: str) -> None:
            with open(tmp, "wb") as f:  # closed (and its error raised) before atomic_write renames it
                np.save(f, out, allow_pickle=False)

        atomic_write(path, save)
    return stem, array_digest(out)


# ------------------------------------------------------------------------ the batch's CRF

def _crf_batch(items: List[Dict[str, Any]], params: Dict[str, float], device: torch.device,
               max_bytes: Optional[int], argmax: bool = False) -> List[Optional[List[np.ndarray]]]:
    """One CRF call for every map of a batch (one kind, one number of labels; IRNet's two maps
    per image in the same call): each item's marginals, as float32 arrays, or with ``argmax``
    on a GPU their (H, W) argmax, taken there (``--probs`` to labels: 1/L of the bytes come
    back, and the CPU's slowest step, numpy's argmax over the label axis, is not needed)."""
    from mars_plugin.engines import crf

    # float16 maps widen on the device (exact): half the bytes cross the bus
    maps = [torch.from_numpy(m).to(device).float() for it in items for m in it["maps"]]
    if not maps:
        return [None if not it["maps"] else [] for it in items]
    rgbs = [torch.from_numpy(it["rgb"]).to(device) for it in items for _ in it["maps"]]
    run = crf.dense_crf_from_unary if items[0]["kind"] == "unary" else crf.dense_crf
    reduce = argmax and device.type == "cuda"  # numpy's argmax beats torch's on the CPU
    q = [(t.argmax(0) if reduce else t).cpu().numpy() for t in run(maps, rgbs, params, max_bytes=max_bytes)]
    out, i = [], 0
    for it in items:
        out.append(q[i:i + len(it["maps"])])
        i += len(it["maps"])
    return out


def _batch_key(item: Dict[str, Any]) -> Tuple[str, int]:
    """Items that share one CRF call: one kind of input, one number of labels."""
    return (item["kind"], item["maps"][0].shape[0]) if item["maps"] else ("none", 0)


# ------------------------------------------------------------------------ the folder

def _inputs(src_dir: Path, images_dir: Path, wsss: Optional[str], flag: str
            ) -> Tuple[Dict[str, Path], Dict[str, Path], Dict[str, str]]:
    """({stem: input file}, {stem: image}, {stem: why it cannot run}) of the whole folder: an
    input without an image, or with two files, fails alone."""
    from mars_plugin.commands.inputs import list_images

    exts = (CAM_EXTENSIONS[wsss],) if wsss else FEATURE_EXTENSIONS
    if not src_dir.is_dir():
        raise JobError(f"{flag} {src_dir}: no such folder")
    found: Dict[str, List[Path]] = {}
    for stem in list_stems(src_dir, exts):
        found.setdefault(stem, [p for p in (src_dir / f"{stem}{e}" for e in exts) if p.is_file()])
    if not found:
        raise JobError(f"{flag} {src_dir}: no {' or '.join(exts)} files in this folder")
    images, clashes = list_images(images_dir, "--images")
    images_of = dict(images)
    bad = {s: f"several files share this stem ({', '.join(p.name for p in ps)}); keep one"
           for s, ps in found.items() if len(ps) > 1}
    bad.update({s: f"several images share this stem ({', '.join(clashes[s])}); rename all but one"
                for s in found if s in clashes})
    bad.update({s: f"no image {s}.jpg/.png in --images {images_dir}" for s in found
                if s not in images_of and s not in clashes})
    return {s: ps[0] for s, ps in found.items()}, images_of, bad


def crf_job(images_dir: os.PathLike, out_dir: os.PathLike, *, cams_dir: Optional[os.PathLike] = None,
            probs_dir: Optional[os.PathLike] = None, settings: Optional[CrfSettings] = None,
            stems: Optional[Sequence[str]] = None, **keywords: Any) -> JobSummary:
    """Write ``out_dir/<stem>.png`` (labels, P mode with the VOC palette) or ``<stem>.npy``
    ((L, H, W) marginals of ``settings.probs_dtype``, channel = class id) for every input file.

    Args:
        cams_dir: a folder of ``settings.wsss``'s CAM files (its adapter's ``load_cams``); or
        probs_dir: a folder of (L, H, W) ``.npy``/``.pt`` probability maps (channel = class id).
        settings: a :class:`~mars_plugin.commands.crf_settings.CrfSettings`, or its fields as
            ``keywords``.
        stems: only these of the folder's files.

    The inputs of one kind and number of labels go ``settings.batch_size`` at a time through one
    CRF call on ``settings.device``; ``settings.workers`` processes read, prepare and write the
    files. Resumable (:mod:`mars_plugin.runs.run_record`): ``.mars-run.json`` holds
    :meth:`~mars_plugin.commands.crf_settings.CrfSettings.identity` (other settings are refused,
    unless ``restart``, which first moves the earlier run's record and every ``.png``/``.npy``
    into ``out_dir/.mars-stale/<UTC time>-<run id>/``) and each file is kept while its input
    and image are unchanged; the output of an input that is gone is moved there too. Under
    torchrun each rank takes ``rank, rank + W, ...`` of the sorted stems.
    """
    from mars_plugin.commands.inputs import check_out_apart

    from mars_plugin.commands.job_settings import own_record

    own_record("crf_job", CrfSettings, settings)
    if settings is not None and keywords:
        raise ValueError(f"give settings=CrfSettings(...) or its fields as keywords, not both (got {sorted(keywords)})")
    s = settings if settings is not None else CrfSettings(**keywords)
    flag, src = ("--cams", cams_dir) if cams_dir is not None else ("--probs", probs_dir)
    check_out_apart(out_dir, "--out", {"--cams": cams_dir, "--probs": probs_dir, "--images": images_dir})
    if (cams_dir is None) == (probs_dir is None):
        raise ValueError("give --cams DIR (a codebase's CAMs, with --wsss) or --probs DIR (probability maps), one of "
                         "them" + (", not both" if cams_dir is not None else ""))
    if cams_dir is not None and s.wsss is None:
        raise ValueError("--cams needs --wsss NAME: whose CAM files they are (irnet, advcam, seam, rsepm, dhr)")
    if probs_dir is not None and s.wsss is not None:
        raise ValueError(f"--probs takes plain probability maps; --wsss {s.wsss} reads --cams")
    device = resolve_device(s.device)
    rank, world = _rank_world()
    return _run(s, Path(src), flag, Path(images_dir), Path(out_dir), stems, device, rank, world)


def _run(s: CrfSettings, src: Path, flag: str, images_dir: Path, out_dir: Path, stems: Optional[Sequence[str]],
         device: torch.device, rank: int, world: int) -> JobSummary:
    """:func:`crf_job` once its arguments are checked: the record, the ranks' meeting points."""
    from mars_plugin.commands.inputs import _check_out_dir
    from mars_plugin.runs.run_record import FolderRecord

    record = FolderRecord(out_dir, "crf", s.identity(), rank=rank)
    ext = ".png" if s.write == "labels" else ".npy"
    group = sync_group()  # before anything that can fail on one rank only: every rank reaches it
    try:
        error, files, images, bad = None, {}, {}, {}
        try:
            files, images, bad = _inputs(src, images_dir, s.wsss, flag)
            if rank == 0:
                _check_out_dir(out_dir, "--out")
                # --restart: under the folder's lock (never the record of a run still going), the
                # earlier run's record and its outputs of either --write move aside: none of its
                # labels stays beside the new run's probabilities for mars evaluate to score
                record.open(set(files), (ext,), restart=OUTPUT_EXTENSIONS if s.restart else None)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        share_error(error, group)
        if rank == 0:
            record.write_settings()
        record.load()
        everything = sorted(files) if stems is None else [x for x in sorted(files) if x in set(stems)]
        mine = everything[rank::world]
        summary = JobSummary()
        record.tell(summary)
        error = None
        try:
            _shard(s, mine, files, images, bad, out_dir, ext, record, summary, device,
                   desc="crf" if world == 1 else f"crf rank 0/{world}", progress=s.progress and rank == 0)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        share_error(error, group)  # every rank meets here, also one that failed
        return summary
    finally:
        record.close()
        _free(group)


def _shard(s: CrfSettings, stems: List[str], files: Dict[str, Path], images: Dict[str, Path], bad: Dict[str, str],
           out_dir: Path, ext: str, record: Any, summary: JobSummary, device: torch.device, *, desc: str,
           progress: bool) -> None:
    """One rank's files: which are current, then the others through the pipeline."""
    from mars_plugin.runs.identities import file_id
    from mars_plugin.runs.resume_ledger import ResumeLedger

    cfg = {"wsss": s.wsss, "trust_pickle": s.trust_pickle, "write": s.write, "probs_dtype": s.probs_dtype,
           "num_labels": s.num_labels, "dataset": s.dataset, "max_bytes": s.max_bytes}
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(stems), desc=desc, unit="img")
    ledger = ResumeLedger(record, summary, s.on_error, None if bar is None else lambda: bar.update(1))
    todo, inputs = [], {}
    for stem in stems:
        if stem in bad:
            ledger.fail(stem, bad[stem])
            continue
        inputs[stem] = {"input": file_id(files[stem]), "image": file_id(images[stem])}  # before reading them
        if ledger.needs(stem, out_dir / f"{stem}{ext}", inputs[stem]):
            todo.append((stem, os.fspath(files[stem]), os.fspath(images[stem]), cfg))
    try:
        _pipeline(s, todo, cfg, out_dir, ext, device, ledger, inputs)
    finally:
        if bar is not None:
            bar.close()


def _pipeline(s: CrfSettings, todo: List[Tuple[str, str, str, Dict[str, Any]]], cfg: Dict[str, Any], out_dir: Path,
              ext: str, device: torch.device, ledger: Any, inputs: Dict[str, Any]) -> None:
    """Read and prepare (``--io-workers`` threads or ``--workers`` processes), the CRF by
    batches (here), label and write (the same workers), with at most a few batches in flight,
    so memory stays bounded whatever the folder's size
    (:class:`~mars_plugin.runs.io_pipeline.IOPipeline`); each file written is recorded in
    ``ledger`` (a :class:`~mars_plugin.runs.resume_ledger.ResumeLedger`)."""
    from mars_plugin.runs.io_pipeline import IOPipeline, check_io_workers
    from mars_plugin.runs.size_batches import SizeBatches

    max_bytes = DEFAULT_MAX_BYTES if s.max_bytes is None else s.max_bytes
    io_workers = check_io_workers(s.io_workers, device, s.workers)
    window = 2 * s.batch_size + max(s.workers, io_workers)

    def collect(io: IOPipeline, limit: Optional[int] = None) -> None:
        # every write already done is recorded at once (an interrupted run keeps it), and the
        # oldest are waited for beyond the limit in flight; a failed write (disk full) is not
        # the file's fault: it stops
        keep(io.written(limit))

    def keep(written: Any) -> None:
        for stem, (_, digest) in written:
            ledger.written(stem, out_dir / f"{stem}{ext}", inputs[stem], digest)

    with IOPipeline(io_workers, ahead=window, behind=2 * s.batch_size, executor=_pool(s.workers)) as io:
        try:
            def write(batch: List[Tuple[str, Dict[str, Any]]], marginals: List[Any]) -> None:
                for (stem, item), q in zip(batch, marginals):
                    if q:  # the inputs are spent: only their count goes on (not held while
                        # the write waits, nor 2 x L x H x W floats through a --workers pipe)
                        item = {**item, "maps": [None] * len(item["maps"]), "rgb": None}
                    io.write(stem, _finish, (stem, item, q, os.fspath(out_dir / f"{stem}{ext}"), cfg))
                collect(io)

            argmax = s.write == "labels" and s.wsss is None
            batches = SizeBatches(s.batch_size,
                                  lambda b: _crf_batch([it for _, it in b], s.params, device, max_bytes, argmax),
                                  write, lambda it, e: ledger.fail(it[0], one_line(e)))
            for _, fut in io.reads(_prepare, todo):
                stem, item, err = fut.result()  # _prepare returns a file's failure, never raises it
                if item is None:
                    ledger.fail(stem, err or "")
                    continue
                batches.add(_batch_key(item), (stem, item))
            batches.flush()
            collect(io, 0)
        except BaseException:  # the CRF failed or Ctrl-C: the files already whole are recorded first
            with contextlib.suppress(Exception):  # (a failure to record them must not hide the error)
                keep(io.settled())
            raise


def _pool(workers: int) -> Any:
    """``workers`` processes (None for 0), that leave Ctrl-C to this one and die with it
    (:func:`mars_plugin.runs.worker_processes.process_pool`)."""
    from mars_plugin.runs.worker_processes import process_pool

    return process_pool(workers, _worker_init)


def _worker_init() -> None:
    torch.set_num_threads(1)  # N workers use N cores instead of fighting over them


# ------------------------------------------------------------------------ command line

def run_crf_command(args: argparse.Namespace) -> JobSummary:
    """``mars crf``: :func:`crf_job` on the parsed flags."""
    settings = CrfSettings.from_args(args)
    return crf_job(args.images, args.out, cams_dir=args.cams, probs_dir=args.probs, settings=settings)
