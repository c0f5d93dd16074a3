"""``mars debias``: one debiased label PNG per pseudo label (Eq. 4-5, the dense CRF), in
batches, the files read and written in ``--io-workers`` threads beside the device
(:func:`_debias_stream`) or whole batches in ``--workers`` processes, resumable.

The worker functions (``_debias_init``, ``_debias_batch``) are module-level: the worker
processes (spawn) import them by their qualified name. The equations are in
:mod:`mars_plugin.method.debias`; this module is the command's folder work.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from mars_plugin._checks import check_ignore_byte
from mars_plugin.engines.crf_memory import check_crf_image
from mars_plugin.method.debias import _centroid_matrix, _mark, debiased_similarity, refine_mask
from mars_plugin.formats.files import (
    FEATURE_EXTENSIONS,
    IMAGE_EXTENSIONS,
    classes_in_label,
    find_features,
    find_image,
    list_stems,
    read_features,
    read_image,
    read_label,
    stem_path,
    write_label,
)
from mars_plugin.runs.distributed import _free, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.io_pipeline import check_io_workers
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, one_line
from mars_plugin.method.selection import DebiasedCentroids
from mars_plugin.commands.debias_settings import DebiasSettings
from mars_plugin.commands.label_formats import _class_label, _class_names, _wsss_class_names
from mars_plugin.commands.inputs import (
    _check_out_dir,
    _only,
    _progress,
    _stems,
    check_any_valid,
    check_features,
    check_images_folder,
    check_input_folder,
    check_label_values,
    load_centroids,
    no_valid_pixel,
)

__all__ = ["debias_job", "run_debias_command"]


_WORKER: Dict[str, Any] = {}


def _debias_init(config: Dict[str, Any]) -> None:
    """Set up a worker. The centroids come as tensors in ``config``, so no worker re-reads the
    file (which may have changed or gone since the run began). An error here is kept and
    raised, as a :class:`JobError`, by the worker's first batch: a pool whose initializer
    raises would print a traceback per worker (and ``multiprocessing.Pool`` respawns them
    forever)."""
    _WORKER.clear()
    try:
        # One thread per worker process: N workers use N cores instead of fighting over them.
        if config["workers"] > 1:
            torch.set_num_threads(1)
        _WORKER.update(config)
        _WORKER["centroids"] = config["centroids"].to(config["device"])
        _WORKER["valid"] = _centroid_matrix(config["centroids"])[1]  # Eq. 5's classes with a centroid, on the CPU
    except Exception as e:  # noqa: BLE001 -- reported by _debias_batch, see above
        _WORKER["init_error"] = f"a --workers process failed to start: {one_line(e)}"


def _debias_check_init() -> None:
    if "init_error" in _WORKER:
        raise JobError(_WORKER["init_error"])


def _debias_load(stem: str) -> Dict[str, Any]:
    """One image's inputs, read, decoded and checked on the CPU (in an ``--io-workers`` thread):
    features, pseudo label, its classes, with the CRF the RGB image."""
    cfg = _WORKER
    V: DebiasedCentroids = cfg["centroids"]
    feat_path = find_features(cfg["features_dir"], stem)
    feats = read_features(feat_path)
    check_features(feats, feat_path, V.dim, f"as --centroids {cfg['centroids_path']}")
    label_path = Path(cfg["labels_dir"]) / f"{stem}.png"
    label = read_label(label_path, biased_value=None)
    check_label_values(label, label_path, V.num_classes, cfg["ignore_index"],
                       flag=f"the number of classes of --centroids {cfg['centroids_path']}")
    if cfg["image_labels"] is not None:
        if stem not in cfg["image_labels"]:
            raise ValueError(f"{stem!r} has no entry in the --image-labels file")
        classes = cfg["image_labels"][stem]
    else:
        classes = [c for c in classes_in_label(label, cfg["ignore_index"]) if c <= V.num_classes]
    # Eq. 5's checks on the label (check_pseudo_label's: ids 0..C and the ignore index) are
    # check_label_values' above, before the batch's CRF, so that a bad file fails alone.
    item = {"stem": stem, "label": label, "features": feats, "classes": classes}
    if cfg["refine"] == "crf":
        image = read_image(find_image(cfg["images_dir"], stem))
        if image.shape[:2] != tuple(label.shape):
            raise ValueError(f"image {image.shape[1]}x{image.shape[0]} and pseudo label "
                             f"{label.shape[1]}x{label.shape[0]} (width x height) differ in size")
        # this image's CRF edges (standard deviations for its size, its memory) fail it alone
        check_crf_image(cfg["crf_params"], *label.shape, 2, name="--crf-params", budget_name="--max-memory",
                        max_bytes=cfg["max_bytes"] if cfg["crf_backend"] == "torch" else None)
        item["image"] = torch.from_numpy(image)
    return item


def _debias_prepare(item: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded image's soft mask M_hat (Eq. 4), on the job's device (in this thread)."""
    cfg = _WORKER
    dev = cfg["device"]
    item = dict(item)
    feats = item.pop("features").to(dev)
    item["similarity"] = debiased_similarity(feats, cfg["centroids"], item.pop("classes"),
                                             size=tuple(item["label"].shape))
    if "image" in item:
        item["image"] = item["image"].to(dev)
    return item


def _debias_masks(items: List[Dict[str, Any]]) -> List[torch.Tensor]:
    """The batch's masks M (Eq. 5: one CRF call on the job's device), on the CPU."""
    cfg = _WORKER
    sims = [it["similarity"] for it in items]
    if cfg["refine"] == "crf":
        masks = refine_mask(sims, [it["image"] for it in items], cfg["crf_params"], cfg["crf_backend"],
                            max_bytes=cfg["max_bytes"])
    else:
        masks = [m > cfg["threshold"] for m in sims]
    return [m.cpu() for m in masks]


_Result = Tuple[str, str, Optional[str], Dict[int, Tuple[int, int]], str]


def _debias_write(stem: str, label: torch.Tensor, mask: torch.Tensor) -> _Result:
    """Eq. 5's label written atomically (in an ``--io-workers`` thread): (stem, "done", warning
    or None, {class: (pixels, removed)}, digest of the label written)."""
    from mars_plugin.runs.identities import array_digest

    cfg = _WORKER
    # mark_biased without its checks: the label was checked when read, the mask is the CRF's own
    y = _mark(label, mask, cfg["valid"], cfg["ignore_index"])
    write_label(stem_path(cfg["out_dir"], stem, ".png"), y, mode=cfg["mode"])
    # "done" with a message: written, with a warning (see no_valid_pixel)
    empty = no_valid_pixel(label, Path(cfg["labels_dir"]) / f"{stem}.png", cfg["ignore_index"])
    return stem, "done", empty, _removed_per_class(label, y, cfg["ignore_index"]), array_digest(y)


def _debias_stream(batches: Sequence[Sequence[str]], io_workers: int) -> Iterator[_Result]:
    """Each of ``batches``' stems debiased, its result in input order: the files read
    ``io_workers`` threads ahead, Eq. 4 and the batch's CRF here, the labels written behind
    (:class:`~mars_plugin.runs.io_pipeline.IOPipeline`; 0: in turn, here). A file that
    cannot be read or prepared fails alone ("failed" and its message)."""
    from mars_plugin.runs.io_pipeline import IOPipeline

    _debias_check_init()
    size = max((len(b) for b in batches), default=1)
    with IOPipeline(io_workers, ahead=2 * size, behind=2 * size) as io:
        try:
            reads = io.reads(_debias_load, (stem for b in batches for stem in b))
            for stems in batches:
                got: List[Tuple[str, Any]] = []  # (stem, prepared item or the error's message), in order
                for _ in stems:
                    stem, fut = next(reads)
                    try:
                        got.append((stem, _debias_prepare(fut.result())))
                    except FILE_ERRORS as e:
                        got.append((stem, one_line(e)))
                items = [it for _, it in got if isinstance(it, dict)]
                masks = iter(_debias_masks(items) if items else [])
                for stem, it in got:
                    if isinstance(it, dict):
                        io.write(stem, _debias_write, stem, it["label"], next(masks))
                    else:
                        io.write(stem, _failed, stem, it)
                yield from (r for _, r in io.written())
            yield from (r for _, r in io.written(0))
        except GeneratorExit:  # the caller stopped reading (its own error): nothing more to hand out
            raise
        except BaseException:
            # the compute failed or Ctrl-C: the labels already whole on disk go to the caller
            # (recorded: a new run keeps them), then the error
            yield from (r for _, r in io.settled())
            raise


def _failed(stem: str, why: str) -> _Result:
    return stem, "failed", why, {}, ""


def _debias_batch(stems: Sequence[str]) -> List[_Result]:
    """Debias a batch of images in a ``--workers`` process (one CRF call), every one of
    ``stems`` (the caller left out those whose output is current); the results of
    :func:`_debias_stream`."""
    return list(_debias_stream([stems], 0))


def _removed_per_class(label: torch.Tensor, debiased: torch.Tensor, ignore_index: int) -> Dict[int, Tuple[int, int]]:
    """{class id: (pixels in the pseudo label, of them marked biased)} of one image, counted on
    the label just written (no re-read)."""
    label, debiased = label.cpu().reshape(-1), debiased.cpu().reshape(-1)
    if not label.numel():
        return {}
    # Histograms of the whole label (ids are bytes, so no mask-select of every pixel first) and
    # of its biased pixels; the background and the ignore index are left out after.
    keep = label.masked_fill((label == ignore_index) | (label < 0), 0)
    pixels = torch.bincount(keep)
    removed = torch.bincount(keep[debiased == -1], minlength=pixels.numel())
    return {c: (int(pixels[c]), int(removed[c])) for c in range(1, pixels.numel()) if int(pixels[c])}


def debias_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    centroids: os.PathLike,
    out_dir: os.PathLike,
    *,
    images_dir: Optional[os.PathLike] = None,
    image_labels: Optional[os.PathLike] = None,
    settings: Optional[DebiasSettings] = None,
    stems: Optional[Sequence[str]] = None,
    **keywords: Any,
) -> JobSummary:
    """Write one debiased label PNG per pseudo label (biased pixels as 254, see
    :data:`mars_plugin.formats.files.BIASED_VALUE`).

    ``settings``: a :class:`~mars_plugin.commands.debias_settings.DebiasSettings`, or its fields
    as ``keywords`` (``refine``, ``threshold``, ``crf_params``, ``crf_backend``,
    ``ignore_index``, ``fmt``, ``device``, ``batch_size``, ``workers``, ``io_workers``,
    ``max_bytes``, ``on_error``, ``progress``).

    Images are debiased ``batch_size`` at a time on ``device`` (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``): Eq. 4 per image, then one dense-CRF call for the batch
    (:func:`mars_plugin.method.debias.refine_mask`; images of any sizes), then Eq. 5. ``crf_params`` is
    a preset name or a dict (:data:`mars_plugin.engines.crf_params.CRF_PRESETS`). Resumable
    (:mod:`mars_plugin.runs.run_record`): ``out_dir/.mars-run.json`` records the settings (the
    folders, the ``centroids`` path, ``refine`` and its parameters, the PNG mode; other settings
    are refused) and each rank's journal what each label was made from (its features, pseudo
    label, image, tags, and the centroids' content): a label whose inputs are unchanged is
    skipped, any other is computed again (all of them when the centroids changed). Outputs are
    written atomically, so an existing file is always complete; one run at a time per
    ``out_dir`` (a lock). ``workers`` > 1 runs batches in that many processes (one thread each);
    outputs do not depend on ``workers`` or ``batch_size``. Under torch.distributed each rank
    debiases its strided shard. ``fmt`` writes in a WSSS repository's PNG mode (see
    :func:`label_format`). ``stems``: only these of the folder's labels. ``max_bytes``: the
    CRF's memory budget per batch (``--max-memory``; default 6 GiB, the CRF's own, since each of
    ``workers`` takes it); an image whose CRF needs more fails alone, by name. ``io_workers``
    (with ``workers=1``): threads that read the next batches' files and write the labels while
    the device computes (:mod:`mars_plugin.runs.io_pipeline`; 0: in turn; None: min(4, CPU
    cores) on cuda, 0 on the CPU); the outputs do not depend on it.
    """
    from mars_plugin.commands.inputs import check_out_apart  # before any work: an output is never an input

    from mars_plugin.commands.job_settings import own_record

    own_record("debias_job", DebiasSettings, settings)
    if settings is not None and keywords:
        raise ValueError(f"give settings=DebiasSettings(...) or its fields as keywords, not both "
                         f"(got {sorted(keywords)})")
    s = settings if settings is not None else DebiasSettings(**keywords)
    check_out_apart(out_dir, "--out", {"--features": features_dir, "--labels": labels_dir, "--centroids": centroids,
                                       "--images": images_dir, "--image-labels": image_labels})
    if s.refine == "crf" and images_dir is None:
        raise ValueError("refine='crf' needs images_dir (the RGB images); or use refine='threshold'")
    dev = resolve_device(s.device)
    io_workers = check_io_workers(s.io_workers, dev, s.processes)
    stems = _check_folders(s, features_dir, labels_dir, images_dir, stems)
    rank, world = _rank_world()
    V = load_centroids(centroids)
    ignore_index = check_ignore_byte(s.ignore_index, num_classes=V.num_classes)
    _check_out_dir(out_dir, "--out")
    config = dict(
        centroids=V, centroids_path=os.fspath(centroids), features_dir=os.fspath(features_dir), labels_dir=os.fspath(labels_dir),
        images_dir=None if images_dir is None else os.fspath(images_dir), out_dir=os.fspath(out_dir), refine=s.refine,
        threshold=s.threshold, ignore_index=ignore_index, crf_params=s.params, crf_backend=s.crf_backend,
        image_labels=s.fmt.image_labels(image_labels, V.num_classes), mode=s.fmt.mode, device=str(dev),
        workers=s.workers, max_bytes=s.max_bytes,
    )
    return _debias_ranks(s, config, stems[rank::world], rank, io_workers)


def _check_folders(s: DebiasSettings, features_dir: os.PathLike, labels_dir: os.PathLike,
                   images_dir: Optional[os.PathLike], stems: Optional[Sequence[str]]) -> List[str]:
    """The labels to debias (all of ``labels_dir``'s, or ``stems`` of them), once their input
    folders are checked: a mistyped folder is one line, not one failure per image."""
    stems = _only(_stems(labels_dir, s.fmt.skip_suffixes), stems)
    check_input_folder(features_dir, "--features", stems, FEATURE_EXTENSIONS, "feature")
    if s.refine == "crf":
        check_images_folder(images_dir, stems, labels_dir=labels_dir)
    check_any_valid(labels_dir, stems, "--labels", s.ignore_index)
    return stems


def _debias_ranks(s: DebiasSettings, config: Dict[str, Any], stems: Sequence[str], rank: int,
                  io_workers: int) -> JobSummary:
    """:func:`debias_job` once its arguments are checked: the folder's record opened by rank 0,
    this rank's ``stems`` debiased, and the ranks' meeting points (a failure anywhere is raised
    everywhere)."""
    from mars_plugin.runs.run_record import FolderRecord

    crf = s.refine == "crf"
    record = FolderRecord(config["out_dir"], "debias", s.identity(), rank=rank)
    error = None
    group = sync_group()  # the ranks meet here however late rank 0 comes (24 h, not torchrun's 30 min)
    if rank == 0:
        try:
            record.open(_input_ids(config["labels_dir"], config["features_dir"], config["images_dir"] if crf else None,
                                   s.fmt.skip_suffixes), (".png",))
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
    try:
        share_error(error, group)  # a refusal on rank 0 (another run, other settings) stops every rank
    except BaseException:
        _free(group)
        raise
    try:
        summary, error = None, None
        try:
            summary = _debias_folder(record, config, stems, s, rank, io_workers)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
        # Every rank meets again at the end, also one whose shard failed (a bad file, a dead
        # --workers process): a failure anywhere is raised everywhere, as in mars features,
        # instead of the other ranks finishing as if all went well.
        share_error(error, group)
        return summary
    finally:
        record.close()
        _free(group)


def _input_ids(labels_dir: os.PathLike, features_dir: os.PathLike, images_dir: Optional[os.PathLike],
               skip_suffixes: Sequence[str]) -> Set[str]:
    """The ids whose inputs all exist (a pseudo label, a feature file, with the CRF an image),
    of the whole folders (not only ``stems``): a debiased label of any other id is stale
    (:meth:`~mars_plugin.runs.run_record.FolderRecord.open` removes it)."""
    ids = set(_stems(labels_dir, skip_suffixes)) & set(list_stems(features_dir, FEATURE_EXTENSIONS))
    return ids if images_dir is None else ids & set(list_stems(images_dir, IMAGE_EXTENSIONS))


def _debias_folder(record: Any, config: Dict[str, Any], stems: Sequence[str], s: DebiasSettings, rank: int,
                   io_workers: int = 0) -> JobSummary:
    """:func:`debias_job` once the folder's record is open: which labels are current, then the
    others, each recorded as it is written (in this process, also with ``--workers``
    processes: the ledger stays here)."""
    from mars_plugin.runs.resume_ledger import ResumeLedger

    summary = JobSummary()
    record.tell(summary)
    if rank == 0:
        record.write_settings()
    record.load()
    # debias counts its progress itself (over the labels to make): no tick per file here
    ledger = ResumeLedger(record, summary, s.on_error, tick=None)
    inputs = _label_inputs(config, stems)
    todo = [stem for stem in stems if ledger.needs(stem, _out_path(config, stem), inputs[stem])]
    batches = [todo[i:i + s.batch_size] for i in range(0, len(todo), s.batch_size)]

    def consume(results: Iterable[_Result]) -> None:
        for result in _progress(results, len(todo), "debias", s.progress):
            _settle(ledger, config, inputs, result)

    if s.workers == 1:
        from contextlib import closing

        _debias_init(config)
        with closing(_debias_stream(batches, io_workers)) as results:  # closed (its threads stopped) on any error
            consume(results)
    else:
        _debias_in_processes(config, batches, s.workers, consume, summary)
    return summary


def _out_path(config: Dict[str, Any], stem: str) -> Path:
    return stem_path(config["out_dir"], stem, ".png")


def _label_inputs(config: Dict[str, Any], stems: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """What each label is made from (its features, pseudo label, image, tags and the centroids'
    content), taken before anything is read: a file changed while the run reads it is then seen
    as changed next time."""
    from mars_plugin.runs.identities import centroids_digest, file_id
    from mars_plugin.runs.run_record import OutputIds

    features_dir, labels_dir, images_dir = config["features_dir"], config["labels_dir"], config["images_dir"]
    feature_id, tags = OutputIds(features_dir), config["image_labels"]
    v_id = centroids_digest(config["centroids"].state_dict())

    def found(find, *args):
        try:
            return find(*args)
        except (ValueError, OSError):  # missing or clashing: the read names it
            return None

    return {stem: {"features": feature_id(found(find_features, features_dir, stem)),
                   "label": file_id(Path(labels_dir) / f"{stem}.png"),
                   "image": file_id(found(find_image, images_dir, stem)) if config["refine"] == "crf" else None,
                   "tags": None if tags is None else tags.get(stem), "centroids": v_id}
            for stem in stems}


def _settle(ledger: Any, config: Dict[str, Any], inputs: Dict[str, Dict[str, Any]], result: _Result) -> None:
    """One label's result: written (recorded, its warning and per-class counts kept) or failed
    (``on_error``: the run stops naming it, or it is listed)."""
    stem, status, err, counts, content = result
    if status != "done":
        ledger.fail(stem, err or "")
        return
    summary = ledger.summary
    ledger.written(stem, _out_path(config, stem), inputs[stem], content)
    if err is not None:
        summary.warnings.append((stem, err))
    for c, (n, r) in counts.items():
        summary.pixels[c] = summary.pixels.get(c, 0) + n
        summary.removed[c] = summary.removed.get(c, 0) + r


def _debias_in_processes(config: Dict[str, Any], batches: List[List[str]], workers: int,
                         consume: Callable[[Iterable[_Result]], None], summary: JobSummary) -> None:
    """``batches`` in ``workers`` spawned processes, their results consumed here in order
    (:func:`mars_plugin.runs.worker_processes.process_pool`: Ctrl-C is this process's, which
    stops them; they die with it)."""
    from concurrent.futures.process import BrokenProcessPool

    from mars_plugin import _interrupt
    from mars_plugin.runs.worker_processes import process_pool

    # A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies the executor is
    # "broken" and every pending result raises, where a Pool replaces the worker and waits
    # forever for the result the dead one held.
    pool = process_pool(workers, _debias_init, (config,))
    futures = [pool.submit(_debias_batch, b) for b in batches]
    handed = [0]  # results given to consume, in order

    def results(skip: int = 0, finished_only: bool = False) -> Iterator[_Result]:
        for f in futures:
            if finished_only and not (f.done() and not f.cancelled() and f.exception() is None):
                return
            for r in f.result():
                if skip:
                    skip -= 1
                    continue
                handed[0] += 1
                yield r

    started = time.time()

    def settle_finished() -> None:
        # After a Ctrl-C the workers stop (shutdown: their grace, then killed); what they finished
        # is written whole: recorded too (as IOPipeline.settled does for threads), so the line
        # counts it and a rerun keeps it. A file a worker wrote whose result never came back
        # (stopped in between) is whole too (atomic writes): counted, not recorded.
        pool.shutdown(wait=True, cancel_futures=True)
        consume(results(skip=handed[0], finished_only=True))
        rest = [stem for batch in batches for stem in batch][handed[0]:]
        _interrupt.wrote(sum(1 for stem in rest if _written_since(_out_path(config, stem), started)))

    try:
        consume(results())
    except KeyboardInterrupt:
        settle_finished()
        raise
    except BrokenProcessPool:
        if _interrupt.requested():  # a worker killed after a Ctrl-C: the interrupt, not a crash
            settle_finished()
            raise KeyboardInterrupt from None
        raise JobError(f"a --workers process died (killed, out of memory, or crashed); "
                       f"{summary.done} images were written and a new run resumes after them") from None
    finally:
        # Do not wait for batches nobody will read (an error stops the run).
        pool.shutdown(wait=True, cancel_futures=True)


def _written_since(path: Path, started: float) -> bool:
    """Whether ``path`` was written (renamed into place) at or after ``started`` (time.time())."""
    try:
        return path.stat().st_mtime >= started
    except OSError:
        return False


def run_debias_command(args: argparse.Namespace) -> JobSummary:
    """``mars debias``: :func:`debias_job` on the parsed flags, then its summary on stdout (per
    class: the pseudo-label pixels marked biased, of the images this run wrote)."""
    names = _class_names(args.class_names) or _wsss_class_names(args)
    settings = DebiasSettings.from_args(args)
    s = debias_job(args.features, args.labels, args.centroids, args.out, images_dir=args.images,
                   image_labels=args.image_labels, settings=settings)
    print(f"debiased labels -> {args.out}: {s.line()}")
    if s.pixels:
        print("pseudo-label pixels marked biased, per class (images written by this run):")
        for c in sorted(s.pixels):
            n, r = s.pixels[c], s.removed.get(c, 0)
            print(f"  {_class_label(names, c)}: {r} of {n} ({100 * r / n:.1f}%)")
    return s
