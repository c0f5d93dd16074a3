"""``mars reproduce``: the MARS authors' setting end to end on DHR's folder layout.

The paper's main setting is RS+EPM (ResNet-101) pseudo labels debiased with STEGO features
(Jo et al., ICCV 2023, Tables 4-6). The authors later published their USS tooling with DHR
(shjo-april/DHR, read at 94d5189): multi-scale features, CAUSE as their USS, the dataset tree
``<root>/<data>/<domain>/{image,mask,xml}`` and, in its "WSS labels" download,
``<root>/WSS/<data>/{RSEPM,MARS,DHR}/<domain>/``: RS+EPM's pseudo labels and the authors' own MARS
masks. This module runs, on that tree (VOC2012 with ``train_aug``, COCO2014 with ``train``):

1. ``features``: the USS model's embeddings with DHR's multi-scale inference (scales 2, 1,
   1.5, 0.5 and the flip, native resolution), one fp16 ``<id>.pt`` per image, through the same
   :func:`~mars_plugin.adapters.uss.extractor.load_extractor` as ``mars features`` (``--uss stego``
   from a STEGO Lightning ``--checkpoint`` or DHR's two files, ``--uss cause`` from DINOv2 +
   CAUSE's files, ``dinov2``, ``leopart``); skipped with ``features_dir`` (e.g. features DHR's
   ``produce_uss_features.py`` already wrote);
2. ``centroids``: Eq. 1-3 over the pseudo labels (tags from ``<domain>/xml``, read for the
   pseudo-labelled ids only);
3. ``debias``: Eq. 4-5 with the dense CRF;
4. ``evaluate``: IoU/FP/FN of the pseudo labels and of the debiased labels against
   ``<domain>/mask`` on the images that have a pseudo label, and of every other method folder
   under ``<root>/WSS/<data>/`` (the yardstick, :mod:`mars_plugin.commands.references`), with its
   agreement with our debiased labels;
5. ``report``: the per-class removal chart and overlays (``mars report``) and ``report.md``
   (:mod:`mars_plugin.commands.reproduce_report`), which puts the paper's published figures and the
   reference folders beside the measured ones.

Every stage resumes (:mod:`mars_plugin.commands.run_record`): ``reproduce.json``
(:mod:`mars_plugin.commands.reproduce_state`) records the settings, the finished stages and, per
stage, a digest of the inputs it read (the ids; each image, pseudo label, mask and given feature
file by name, size and mtime; the tags; the reference folders). A
run into a folder whose recorded settings differ is refused rather than mixing two settings. A
stage whose inputs changed since it finished runs again, and so does every stage after it:

=====================================================  =========================================
changed since the last run                             runs again
=====================================================  =========================================
a new or removed pseudo label, a changed pseudo         centroids, debias, evaluate, report
label, tag (xml) or given feature file
an image                                               features computed here: features (that
                                                       image's), then as a changed feature file;
                                                       ``--features``: debias (CRF: that image's
                                                       label), evaluate, report
a ground-truth mask, a reference folder or its masks   evaluate, report
nothing                                                report (always rewritten)
=====================================================  =========================================

Within a stage that runs again, ``mars features``, ``centroids`` and ``debias`` keep what their
own records say is current: the features of unchanged images, the centroids when their inputs
are unchanged, the debiased labels whose features, pseudo label, image, tags and centroids are
unchanged (all of them are made again when the centroids changed); a debiased label of an id
whose pseudo label is gone is removed. One run at a time per ``--out`` (a lock that a killed run
never leaves stuck); holding it, the run removes the ``.tmp-*`` files a killed run left.
Before any stage the run checks its plan (:func:`~mars_plugin.commands.reproduce_plan.plan_reproduce`:
every input a stage, or ``--train``'s, would refuse) and stops on its problems; ``dry_run=True``
(``--dry-run``) prints that plan, what each stage would read and write and every problem,
computing nothing.

Under ``torchrun`` every stage is shared by the ranks: features and debiased labels in strided
shards (each rank on GPU ``LOCAL_RANK`` with ``--device auto``), the centroids gathered as
``mars centroids`` does, the evaluation and the report on rank 0; the ranks meet between stages
and rank 0 alone takes the lock and writes the shared files (``reproduce.json``, ``centroids.pt``,
``scores.json``, ``report.md``); a refusal on rank 0 stops every rank.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from mars_plugin.adapters.uss.extractor import USS_MODELS
from mars_plugin.formats.files import atomic_write, list_stems
from mars_plugin.commands.centroids import centroids_job
from mars_plugin.commands.debias import debias_job
from mars_plugin.commands.evaluate import evaluate_job
from mars_plugin.commands.label_formats import LabelFormat
from mars_plugin.commands.report import report_job
from mars_plugin.commands.errors import JobError, JobSummary, one_line
from mars_plugin.commands.identities import model_files_id
from mars_plugin.commands.run_lock import LOCK_NAME, RunLock, remove_stale_tmp
from mars_plugin.commands.run_record import broadcast_object
from mars_plugin.commands.reproduce_state import _input_ids, _stage_inputs, _State
from mars_plugin.commands.references import find_references, reference_summary, score_references, scores_key
from mars_plugin.commands.reproduce_report import PAPER_SOURCES, PAPER_VOC_TRAIN, PAPER_VOC_VAL_IOU, PICTURES, format_report

__all__ = ["PAPER_VOC_VAL_IOU", "PAPER_VOC_TRAIN", "PAPER_SOURCES", "reproduce", "STAGES", "default_domain",
           "USS_CHOICES"]

PathLike = Union[str, os.PathLike]

STAGES = ("features", "centroids", "debias", "evaluate", "report")
#: ``--uss`` of ``mars reproduce``: the models ``mars features`` loads (the adapters' registry).
USS_CHOICES = USS_MODELS


def default_domain(data: str, root: Optional[PathLike] = None) -> str:
    """DHR's training split of ``data``: ``train_aug`` for VOC2012 (RS+EPM's layout) and for any
    tree that has a ``<root>/<data>/train_aug`` folder, ``train`` for COCO2014 and DHR's other sets
    (DHR's README, "Preparing datasets")."""
    if data == "VOC2012" or (root is not None and (Path(root) / data / "train_aug").is_dir()):
        return "train_aug"
    return "train"


def _model_settings(uss: str, checkpoint, backbone, heads, trust_pickle: bool) -> Dict[str, Any]:
    """The model files of the features stage, checked the way ``mars features`` checks them."""
    if uss not in USS_CHOICES:
        raise ValueError(f"--uss must be one of {', '.join(USS_CHOICES)}, got {uss!r}")
    files = {"checkpoint": checkpoint, "backbone": backbone, "heads": heads}
    for flag, f in files.items():
        if f is not None and not Path(f).exists():
            raise ValueError(f"--{flag} {f}: no such file or folder")
    out = model_files_id(uss, checkpoint, backbone, heads)
    out["trust_pickle"] = bool(trust_pickle)
    return out


def reproduce(
    root: PathLike,
    pseudo_dir: PathLike,
    out_dir: PathLike,
    *,
    uss: str = "stego",
    checkpoint: Optional[PathLike] = None,
    backbone: Optional[PathLike] = None,
    heads: Optional[PathLike] = None,
    trust_pickle: bool = False,
    features_dir: Optional[PathLike] = None,
    data: str = "VOC2012",
    domain: Optional[str] = None,
    scales: Optional[Sequence[float]] = None,
    flip: bool = True,
    alpha: float = 0.4,
    k_fg: int = 2,
    k_bg: int = 2,
    seed: int = 0,
    refine: str = "crf",
    crf_params: Union[str, Mapping[str, Any]] = "mars",
    device: str = "cpu",
    fp16: bool = False,
    feature_batch_size: int = 1,
    batch_size: int = 8,
    workers: int = 1,
    num_examples: int = 8,
    references: bool = True,
    on_error: str = "stop",
    dry_run: bool = False,
    train: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Features -> centroids -> debias -> evaluate -> report on a DHR-layout tree.

    Args:
        root: the folder holding ``<data>/<domain>/{image,mask,xml}`` (DHR's ``--root``) and,
            optionally, ``WSS/<data>/<method>/<domain>/`` (other methods' masks: the yardstick).
        pseudo_dir: the WSSS method's pseudo labels, one PNG per image id (RS+EPM:
            ``experiments/pseudo-labels/<tag>/train``; DHR: ``<root>/WSS/<data>/RSEPM/<domain>``).
        out_dir: everything this run writes (see the module docstring); resumable.
        uss, checkpoint, backbone, heads, trust_pickle: the USS model, exactly as ``mars features``
            takes it (:func:`~mars_plugin.adapters.uss.extractor.load_extractor`): ``stego`` from a
            Lightning ``checkpoint`` (a pickle: needs ``trust_pickle``) or from DINO's backbone +
            DHR's ``STEGO_<data>.pt``; ``cause`` from DINOv2's backbone + DHR's ``CAUSE_<data>.pt``
            or CAUSE's own release; ``dinov2`` from one ``backbone``; ``leopart`` from a
            ``checkpoint``. ``.pt``/``.pth`` state dicts are read with ``weights_only=True``. Or instead:
        features_dir: a folder of ``<id>.pt``/``<id>.npy`` features already computed.
        data, domain: DHR's ``--data`` and ``--domain`` (default :func:`default_domain`:
            ``train_aug`` for VOC2012, ``train`` otherwise). Class names come from
            ``<root>/<data>/<data>.json`` (VOC's 21 names when VOC2012 has none).
        scales, flip: the multi-scale inference of the features (default: DHR's scales 2, 1,
            1.5, 0.5, and the flip).
        alpha, k_fg, k_bg, seed: Eq. 1-3 (the paper's 0.4, 2, 2).
        refine, crf_params: Eq. 5's refinement (see ``mars debias``).
        device, fp16, feature_batch_size: where the features and the K-means/CRF run.
        batch_size, workers: images per CRF call, CPU processes for debias.
        references: score the other method folders of ``<root>/WSS/<data>/``.
        dry_run: read the tree and report, compute and write nothing (returns the plan).
        train: the ``--train`` options the run will be followed by (``val_domain``, ``weights``,
            ``arch``, ``backbone``, ``masks``), for the plan: their inputs are checked first too.

    The pseudo labels are P- or L-mode PNGs of class ids (0 background, 255 ignore); the image
    tags come from ``<domain>/xml`` read as DHR reads them (:mod:`mars_plugin.adapters.wsss.dhr`).

    Returns a dict with the score sets (``pseudo``, ``debiased``, ``references``,
    ``agreement``), the paths written and the run's :class:`~mars_plugin.commands.errors.JobSummary`.
    """
    from mars_plugin.adapters.wsss.dhr import load_image_labels
    from mars_plugin.adapters.wsss.dhr_layout import DHRLayout
    from mars_plugin._checks import check_scales
    from mars_plugin.adapters.uss.multiscale import DHR_SCALES
    from mars_plugin.commands.inputs import check_job_params
    from mars_plugin.commands.distributed import _rank_world, share_error, sync_group

    t_all = time.perf_counter()
    # Before anything is read or computed: a bad value must not stop the run after its features.
    check_job_params(alpha=alpha, k_fg=k_fg, k_bg=k_bg, seed=seed, feature_batch_size=feature_batch_size,
                     batch_size=batch_size, workers=workers, num_examples=num_examples)
    out = Path(out_dir)
    domain = default_domain(data, root) if domain is None else domain
    from mars_plugin.commands.inputs import check_out_apart, root_reads  # an output is never an input

    check_out_apart(out_dir, "--out", {"--root": root_reads(root, data, [domain], references), "--pseudo": pseudo_dir,
                                       "--features": features_dir, "--checkpoint": checkpoint, "--backbone": backbone,
                                       "--heads": heads})
    given = [f for f, v in (("--checkpoint", checkpoint), ("--backbone", backbone), ("--heads", heads)) if v]
    if features_dir is not None and given:
        raise ValueError(f"give either the USS model files ({', '.join(given)}) or --features (features already "
                         "computed), not both")
    if features_dir is None and not given:
        raise ValueError("give the USS model files (--uss with --checkpoint FILE, or --backbone FILE [--heads "
                         "FILE], as mars features takes them) or --features (features already computed)")
    scales = DHR_SCALES if scales is None else check_scales(scales)
    layout = DHRLayout(root, data)
    image_dir, mask_dir, xml_dir = layout.image_dir(domain), layout.mask_dir(domain), layout.xml_dir(domain)
    for d in (image_dir, mask_dir, xml_dir):
        if not Path(d).is_dir():
            raise ValueError(f"--root {root}: {d} is not a folder; expected <root>/{data}/{domain}/{{image,mask,xml}} "
                             "(DHR's layout)")
    if not Path(pseudo_dir).is_dir():
        raise ValueError(f"--pseudo {pseudo_dir}: {'not a folder' if Path(pseudo_dir).exists() else 'no such folder'}"
                         "; expected a folder of pseudo-label PNGs")
    class_names = list(layout.class_names())
    C = len(class_names) - 1
    stems = list_stems(pseudo_dir, (".png",))
    if not stems:
        raise ValueError(f"--pseudo {pseudo_dir}: no .png pseudo labels")

    settings: Dict[str, Any] = {
        "root": os.fspath(Path(root).resolve()), "data": data, "domain": domain,
        "pseudo": os.fspath(Path(pseudo_dir).resolve()), "alpha": alpha, "k_fg": k_fg,
        "k_bg": k_bg, "seed": seed, "refine": refine, "crf_params": crf_params,
    }
    feature_settings: Optional[Dict[str, Any]] = None  # the record of --out/features: the model
    if features_dir is None:
        model = _model_settings(uss, checkpoint, backbone, heads, trust_pickle)
        feature_settings = dict(model, scales=[float(s) for s in scales], flip=bool(flip), dhr=True)
        settings.update(model, scales=[float(s) for s in scales], flip=bool(flip), fp16=bool(fp16))
        feats = out / "features"
    else:
        feats = Path(features_dir)
        if not feats.is_dir():
            raise ValueError(f"--features {features_dir}: not a folder")
        if not list_stems(feats, (".npy", ".pt")):
            raise ValueError(f"--features {features_dir}: no .npy or .pt feature files in this folder")
        settings["features"] = os.fspath(feats.resolve())
    refs, ref_notes = (find_references(layout.root / "WSS" / data, domain, pseudo_dir) if references else ({}, []))
    from mars_plugin.commands.reproduce_plan import plan_reproduce, refuse, show_plan

    # One plan, for the dry run and the real run alike: what the dry run says is what stops the run.
    plan_args = dict(layout=layout, domain=domain, pseudo_dir=Path(pseudo_dir), out=out, stems=stems,
                     class_names=class_names, feats=feats, settings=settings, references=refs,
                     reference_notes=ref_notes, progress=progress, train=train,
                     model=None if features_dir is not None else dict(
                         uss=uss, checkpoint=checkpoint, backbone=backbone, heads=heads, trust_pickle=trust_pickle,
                         scales=scales, flip=flip))
    if dry_run:
        return show_plan(plan_reproduce(**plan_args), log)

    rank, world = _rank_world()
    # The ranks meet after every stage; a stage of hours (features) must not hit torchrun's
    # 30-minute default timeout while the others wait, hence a group of its own.
    group = sync_group()
    out.mkdir(parents=True, exist_ok=True)
    # One run at a time into --out: rank 0 holds the lock for the whole run, and a refusal (the
    # lock held, other settings recorded) stops every rank. Holding it, rank 0 removes the
    # temporary files a killed run left and reads the record; the ranks follow its reading.
    lock = RunLock(out / LOCK_NAME, f"--out {out}", "mars reproduce")
    # ``record``, not ``data``: ``data`` is DHR's dataset name, which report.md's title shows.
    error, record = None, None
    if rank == 0:
        try:
            refuse(plan_reproduce(**plan_args), on_error)  # every refusal of the stages, before any of them
            lock.acquire()
            remove_stale_tmp(out)
            record = _State(out / "reproduce.json", settings).data
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            lock.release()
            error = e
    share_error(error, group)
    try:
        state = _State(out / "reproduce.json", settings, write=rank == 0, data=broadcast_object(record, group))
        fmt = LabelFormat(mode="P")
        total = JobSummary()
        # Tags as DHR reads them, for the pseudo-labelled ids only (an xml no stage uses cannot stop
        # the run), in the {id: [1-based class ids]} JSON the jobs take. An id whose xml is bad
        # (missing, unreadable, an unknown class) is named; with --on-error skip it is skipped: named
        # once, as "<id> (tags)", and left out of every stage (``work``), not failed again by each.
        tags: Dict[str, List[int]] = {}
        for stem in stems:
            try:
                hot = load_image_labels(xml_dir, class_names=class_names, ids=[stem])[stem]
            except Exception as e:  # noqa: BLE001 -- any failure to read one xml is that file's failure
                if on_error == "stop":
                    raise JobError(one_line(e)) from None
                total.failed.append((f"{stem} (tags)", one_line(e)))
                continue
            tags[stem] = [int(i) + 1 for i in hot.nonzero().flatten().tolist()]
        work = [s for s in stems if s in tags]
        if not work:
            raise JobError(f"no pseudo-labelled id of --pseudo {pseudo_dir} has readable tags in {xml_dir} "
                           f"({len(stems)} skipped)")
        image_labels = out / "image_labels.json"
        tags_text = json.dumps(tags, indent=0, sort_keys=True)
        error, inputs = None, None
        if rank == 0:
            try:
                atomic_write(image_labels, lambda tmp: Path(tmp).write_text(tags_text))
                # What each stage reads, as one digest per role (see STAGE_INPUTS), taken before
                # any stage reads it: a file changed while the run reads it shows on the next run.
                inputs = _input_ids(stems, image_dir, Path(pseudo_dir), mask_dir, tags_text,
                                    None if features_dir is None else feats, refs)
            except Exception as e:  # noqa: BLE001 -- raised on every rank just below
                error = e
        share_error(error, group)
        inputs = broadcast_object(inputs, group)
        times: Dict[str, float] = {}
        ran: List[str] = []  # the stages run by this call: every stage after one of them runs too

        def stage(name: str, fn: Callable[[], Dict[str, Any]], everyone: bool = True) -> None:
            """Run a stage on every rank (``everyone``) or on rank 0, then meet; record it once."""
            deps = _stage_inputs(name, inputs)
            why = state.stale(name, deps) if not ran else f"after [{ran[-1]}]"
            if why is None:
                if rank == 0:
                    log(f"[{name}] done before, kept")
                times[name] = 0.0
                return
            ran.append(name)
            if rank == 0:
                log(f"[{name}] ..." + (f" ({why})" if why else ""))
            t = time.perf_counter()
            info, error = {}, None
            if everyone or rank == 0:
                try:
                    info = fn()
                except BaseException as e:  # every rank must learn of it, or the others wait forever
                    error = e
            share_error(error, group)
            times[name] = time.perf_counter() - t
            state.finish(name, seconds=round(times[name], 3), inputs=deps, **info)

        extractor = None
        if features_dir is None and state.stale("features", _stage_inputs("features", inputs)) is not None:
            from mars_plugin.adapters.uss.extractor import load_extractor

            # mars features' own loader with DHR's inference (native resolution, no L2
            # normalisation), at this run's scales and flip; loaded before any work, so that a bad
            # flag or file stops the run at once.
            extractor = load_extractor(uss, checkpoint, backbone=backbone, heads=heads, trust_pickle=trust_pickle,
                                       scales=tuple(scales), flip_average=flip, dhr=True)

        def run_features() -> Dict[str, Any]:
            from mars_plugin.commands.features import features_job

            if rank == 0:
                log(f"  {extractor.describe()}")
            s = features_job(extractor, image_dir, feats, batch_size=feature_batch_size, device=device, fp16=fp16,
                             on_error=on_error, progress=progress and rank == 0, file_format="pt", stems=work,
                             settings=feature_settings)
            _log_summary(s, "features", log, total, rank, world)
            return {"written": s.done, "existing": s.existing, "failed": [list(f) for f in s.failed]}

        if features_dir is None:
            stage("features", run_features)
        else:
            times["features"] = 0.0

        centroids = out / "centroids.pt"

        def run_centroids() -> Dict[str, Any]:
            V, s = centroids_job(feats, pseudo_dir, C, centroids, image_labels=image_labels, alpha=alpha, k_fg=k_fg,
                                 k_bg=k_bg, seed=seed, on_error=on_error, progress=progress and rank == 0, fmt=fmt,
                                 device=device, stems=work)
            _log_summary(s, "centroids", log, total, rank, world)
            return {"images": V.num_images, "failed": [list(f) for f in s.failed]}

        stage("centroids", run_centroids)
        debiased = out / "debiased"

        def run_debias() -> Dict[str, Any]:
            if rank == 0:  # the debiased label of an id whose pseudo label is gone is no result of this run
                for gone in sorted(set(list_stems(debiased, (".png",))) - set(work)) if debiased.is_dir() else ():
                    (debiased / f"{gone}.png").unlink()
            s = debias_job(feats, pseudo_dir, centroids, debiased, images_dir=image_dir, refine=refine,
                           image_labels=image_labels, workers=workers, batch_size=batch_size, device=device,
                           crf_params=crf_params, on_error=on_error, progress=progress and rank == 0, fmt=fmt,
                           stems=work)
            _log_summary(s, "debias", log, total, rank, world)
            return {"written": s.done, "existing": s.existing, "failed": [list(f) for f in s.failed]}

        stage("debias", run_debias)
        scores_path = out / "scores.json"

        def run_evaluate() -> Dict[str, Any]:
            done = list_stems(debiased, (".png",))
            res: Dict[str, Any] = {}
            failed: List[Tuple[str, str]] = []
            for key, pred in (("pseudo", Path(pseudo_dir)), ("debiased", debiased)):
                sc, s = evaluate_job(pred, mask_dir, C, on_error=on_error, progress=progress, stems=done)
                _log_summary(s, f"evaluate {key}", log, total)
                failed += [(f"{stem} (evaluate {key})", why) for stem, why in s.failed]
                res[key] = sc
            # The references are scored on the images both our scores counted.
            bad = {stem for stem, _ in failed}
            common = [s for s in done if not any(b.startswith(s + " (") for b in bad)]
            ref_scores, agreement, left_out = score_references(refs, debiased, mask_dir, common, C,
                                                               on_error=on_error, progress=progress)
            for name, why in left_out:
                total.failed.append((f"reference {name}", why))
            for name, sc in ref_scores.items():
                log(reference_summary(name, sc, agreement.get(name)))
                res[scores_key(name)] = sc
            res["agreement"] = agreement
            res["references"] = {name: os.fspath(refs[name]) for name in ref_scores}
            text = json.dumps(dict(res, class_names=class_names), indent=2)
            atomic_write(scores_path, lambda tmp: Path(tmp).write_text(text))
            return {"images": res["pseudo"]["num_images"], "failed": [list(f) for f in failed],
                    "references": sorted(ref_scores), "references_left_out": [list(x) for x in left_out],
                    "reference_notes": ref_notes}

        stage("evaluate", run_evaluate, everyone=False)
        scores = json.loads(scores_path.read_text())
        ref_names = scores.get("references", {})
        ref_scores = {n: scores[scores_key(n)] for n in ref_names}

        def run_report() -> Dict[str, Any]:
            removal, s = report_job(pseudo_dir, debiased, image_dir, out / "report", class_names=class_names,
                                    num_examples=num_examples, on_error=on_error, progress=progress)
            _log_summary(s, "report", log, total)
            method = (f"K_fg {k_fg}, K_bg {k_bg}, alpha {alpha}, seed {seed}, refine {refine}"
                      + (f" ({crf_params if isinstance(crf_params, str) else json.dumps(crf_params)})"
                         if refine == "crf" else ""))
            if features_dir is not None:
                feat_text = f"`{feats}` (given)"
            else:
                files = " + ".join(f"`{Path(f).name}`" for f in (checkpoint, backbone, heads) if f is not None)
                feat_text = (f"{uss} from {files}, scales {', '.join(f'{x:g}' for x in scales)}, flip "
                             f"{'on' if flip else 'off'}{', fp16' if fp16 else ''} (DHR's inference)")
            ev = state.data["stages"].get("evaluate", {})
            text = format_report(class_names, scores["pseudo"], scores["debiased"], removal, {
                "root": root, "data": data, "domain": domain, "pseudo": pseudo_dir, "features": feat_text,
                "method": method, "times": times, "stages": state.data["stages"],
                "pictures": [(alt, f"report/{name}") for alt, name in PICTURES if (out / "report" / name).is_file()],
                "references_left_out": ev.get("references_left_out", []),
            }, references=ref_scores, agreement=scores.get("agreement", {}))
            atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(text))
            return {}

        # The report is cheap and names this run's stage times: always rewritten.
        state.data["stages"].pop("report", None)
        stage("report", run_report, everyone=False)
        if rank == 0:
            log(f"report -> {out / 'report.md'} ({time.perf_counter() - t_all:.1f} s)")
        return {"pseudo": scores["pseudo"], "debiased": scores["debiased"], "references": ref_scores,
                "agreement": scores.get("agreement", {}), "out": out, "report": out / "report.md", "summary": total,
                "rank": rank, "world_size": world}
    finally:
        lock.release()


def _log_summary(s: JobSummary, what: str, log: Callable[[str], None], total: JobSummary, rank: int = 0,
                 world: int = 1) -> None:
    """One line per stage (per rank under torchrun); the skipped files go to ``total`` (listed at
    the end, and in report.md)."""
    log(f"  {what}{f' rank {rank}/{world}' if world > 1 else ''}: {s.line('done')}")
    total.failed += [(f"{stem} ({what})", why) for stem, why in s.failed]
    total.warnings += [(f"{stem} ({what})", why) for stem, why in s.warnings]
    total.notes += s.notes  # files of no input kept in an output folder, named once at the end
