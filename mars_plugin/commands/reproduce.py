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

The run's settings are one record, :class:`~mars_plugin.commands.reproduce_settings.ReproduceSettings`
(the command line builds it, :func:`reproduce` builds it from keywords, :func:`run_reproduce`
takes it), checked once before anything is read; the run is a few stages, one method each of
``_Run``.

Every stage resumes (:mod:`mars_plugin.runs.run_record`): ``reproduce.json``
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
from typing import Any, Callable, Dict, List, Optional, Tuple

from mars_plugin.adapters.uss.extractor import USS_MODELS
from mars_plugin.formats.files import atomic_write, list_stems
from mars_plugin.commands.centroids import centroids_job
from mars_plugin.commands.debias import debias_job
from mars_plugin.commands.evaluate import evaluate_job
from mars_plugin.commands.label_formats import LabelFormat
from mars_plugin.commands.report import report_job
from mars_plugin.commands.report_html import HtmlExtras
from mars_plugin.runs.errors import JobError, JobSummary, few, one_line
from mars_plugin.runs.output_aside import OutputAside
from mars_plugin.runs.run_lock import LOCK_NAME, RunLock, remove_stale_tmp
from mars_plugin.runs.run_record import broadcast_object
from mars_plugin.commands.reproduce_settings import ReproduceInputs, ReproduceSettings, default_domain, prepare
from mars_plugin.commands.reproduce_state import _input_ids, _stage_inputs, _State
from mars_plugin.commands.references import reference_summary, score_references, scores_key
from mars_plugin.commands.reproduce_report import PAPER_SOURCES, PAPER_VOC_TRAIN, PAPER_VOC_VAL_IOU, PICTURES, format_report

__all__ = ["PAPER_VOC_VAL_IOU", "PAPER_VOC_TRAIN", "PAPER_SOURCES", "reproduce", "run_reproduce", "ReproduceSettings",
           "STAGES", "default_domain", "USS_CHOICES"]

STAGES = ("features", "centroids", "debias", "evaluate", "report")
#: ``--uss`` of ``mars reproduce``: the models ``mars features`` loads (the adapters' registry).
USS_CHOICES = USS_MODELS


def reproduce(root: os.PathLike, pseudo_dir: os.PathLike, out_dir: os.PathLike, *, dry_run: bool = False,
              progress: bool = True, log: Callable[[str], None] = print, **settings: Any) -> Dict[str, Any]:
    """Features -> centroids -> debias -> evaluate -> report on a DHR-layout tree: :func:`run_reproduce`
    on ``ReproduceSettings(root, pseudo_dir, out_dir, **settings)``.

    ``settings``: the keywords of :class:`~mars_plugin.commands.reproduce_settings.ReproduceSettings`
    (``uss``, ``checkpoint``, ``backbone``, ``heads``, ``trust_pickle`` or ``features_dir``; ``data``,
    ``domain``, ``scales``, ``flip``, ``alpha``, ``k_fg``, ``k_bg``, ``seed``, ``refine``,
    ``crf_params``, ``device``, ``fp16``, ``feature_batch_size``, ``batch_size``, ``workers``,
    ``num_examples``, ``references``, ``on_error``, ``train``), each checked there, naming it.
    """
    return run_reproduce(ReproduceSettings(root, pseudo_dir, out_dir, **settings), dry_run=dry_run,
                         progress=progress, log=log)


def run_reproduce(settings: ReproduceSettings, *, dry_run: bool = False, progress: bool = True,
                  log: Callable[[str], None] = print) -> Dict[str, Any]:
    """The run of ``settings`` (see the module docstring); ``dry_run``: read the tree and report,
    compute and write nothing (returns the plan, :func:`~mars_plugin.commands.reproduce_plan.show_plan`).

    Returns a dict with the score sets (``pseudo``, ``debiased``, ``references``,
    ``agreement``), the paths written (``out``, ``report``), the run's
    :class:`~mars_plugin.runs.errors.JobSummary` (``summary``), ``rank`` and ``world_size``.
    """
    from mars_plugin.commands.job_settings import own_record
    from mars_plugin.commands.reproduce_plan import plan_reproduce, show_plan

    if own_record("run_reproduce", ReproduceSettings, settings) is None:
        raise TypeError("run_reproduce(settings=...) takes a ReproduceSettings, got None")
    t_all = time.perf_counter()
    inputs = prepare(settings)  # every check of a value or a folder, before anything is read or computed
    if dry_run:
        return show_plan(plan_reproduce(inputs, progress=progress), log)
    run = _Run(inputs, progress, log)
    record = run.lock_out()
    try:
        run.start(record)
        run.features()
        run.centroids()
        run.debias()
        run.evaluate()
        return run.report(t_all)
    finally:
        run.lock.release()


class _Run:
    """The stages of one run on one rank: what they share (the inputs, the record, the tags, the
    ranks' meeting points) and one method per stage. Under torchrun every rank makes one."""

    def __init__(self, inputs: ReproduceInputs, progress: bool, log: Callable[[str], None]):
        from mars_plugin.runs.distributed import _rank_world, sync_group

        self.inputs, self.s, self.progress, self.log = inputs, inputs.settings, progress, log
        self.out = inputs.out
        self.image_dir, self.mask_dir, self.xml_dir = inputs.dirs()
        self.rank, self.world = _rank_world()
        # The ranks meet after every stage; a stage of hours (features) must not hit torchrun's
        # 30-minute default timeout while the others wait, hence a group of its own.
        self.group = sync_group()
        self.total = JobSummary()
        self.fmt = LabelFormat(mode="P")
        self.times: Dict[str, float] = {}
        self.ran: List[str] = []  # the stages run by this call: every stage after one of them runs too
        self.image_labels = self.out / "image_labels.json"
        self.centroids_path, self.debiased = self.out / "centroids.pt", self.out / "debiased"
        self.scores_path = self.out / "scores.json"

    def lock_out(self) -> Optional[Dict[str, Any]]:
        """One run at a time into --out: rank 0 holds the lock for the whole run, and a refusal
        (the plan's problems, the lock held, other settings recorded) stops every rank. Holding
        it, rank 0 removes the temporary files a killed run left and reads the record, which it
        returns (the ranks follow its reading)."""
        from mars_plugin.runs.distributed import share_error
        from mars_plugin.commands.reproduce_plan import plan_reproduce, refuse

        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(self.out / LOCK_NAME, f"--out {self.out}", "mars reproduce")
        error, record = None, None
        if self.rank == 0:
            try:
                # every refusal of the stages, before any of them
                refuse(plan_reproduce(self.inputs, progress=self.progress), self.s.on_error)
                self.lock.acquire()
                remove_stale_tmp(self.out)
                record = _State(self.out / "reproduce.json", self.inputs.identity).data
            except Exception as e:  # noqa: BLE001 -- raised on every rank just below
                self.lock.release()
                error = e
        share_error(error, self.group)
        return record

    def start(self, record: Optional[Dict[str, Any]]) -> None:
        """The record (rank 0's reading), the tags, and the digests of every input, taken before
        any stage reads it: a file changed while the run reads it shows on the next run."""
        from mars_plugin.runs.distributed import share_error

        self.state = _State(self.out / "reproduce.json", self.inputs.identity, write=self.rank == 0,
                            data=broadcast_object(record, self.group))
        tags_text = self._read_tags()
        error, digests = None, None
        if self.rank == 0:
            try:
                atomic_write(self.image_labels, lambda tmp: Path(tmp).write_text(tags_text))
                # What each stage reads, as one digest per role (see STAGE_INPUTS).
                digests = _input_ids(self.inputs.stems, self.image_dir, Path(self.s.pseudo_dir), self.mask_dir,
                                     tags_text, None if self.s.features_dir is None else self.inputs.feats,
                                     self.inputs.references)
            except Exception as e:  # noqa: BLE001 -- raised on every rank just below
                error = e
        share_error(error, self.group)
        self.digests = broadcast_object(digests, self.group)

    def _read_tags(self) -> str:
        """Tags as DHR reads them, for the pseudo-labelled ids only (an xml no stage uses cannot
        stop the run), as the {id: [1-based class ids]} JSON the jobs take. An id whose xml is
        bad (missing, unreadable, an unknown class) is named; with --on-error skip it is skipped:
        named once, as "<id> (tags)", and left out of every stage (``work``)."""
        from mars_plugin.adapters.wsss.dhr import load_image_labels

        tags: Dict[str, List[int]] = {}
        stems = self.inputs.stems
        for stem in stems:
            try:
                hot = load_image_labels(self.xml_dir, class_names=self.inputs.class_names, ids=[stem])[stem]
            except Exception as e:  # noqa: BLE001 -- any failure to read one xml is that file's failure
                if self.s.on_error == "stop":
                    raise JobError(one_line(e)) from None
                self.total.failed.append((f"{stem} (tags)", one_line(e)))
                continue
            tags[stem] = [int(i) + 1 for i in hot.nonzero().flatten().tolist()]
        self.work = [s for s in stems if s in tags]
        if not self.work:
            raise JobError(f"no pseudo-labelled id of --pseudo {self.s.pseudo_dir} has readable tags in "
                           f"{self.xml_dir} ({len(stems)} skipped)")
        return json.dumps(tags, indent=0, sort_keys=True)

    def _stage(self, name: str, fn: Callable[[], Dict[str, Any]], everyone: bool = True) -> None:
        """Run a stage on every rank (``everyone``) or on rank 0, then meet; record it once."""
        from mars_plugin.runs.distributed import share_error

        deps = _stage_inputs(name, self.digests)
        why = self.state.stale(name, deps) if not self.ran else f"after [{self.ran[-1]}]"
        if why is None:
            if self.rank == 0:
                self.log(f"[{name}] done before, kept")
            self.times[name] = 0.0
            return
        self.ran.append(name)
        if self.rank == 0:
            self.log(f"[{name}] ..." + (f" ({why})" if why else ""))
        t = time.perf_counter()
        info, error = {}, None
        if everyone or self.rank == 0:
            try:
                info = fn()
            except BaseException as e:  # every rank must learn of it, or the others wait forever
                error = e
        share_error(error, self.group)
        self.times[name] = time.perf_counter() - t
        self.state.finish(name, seconds=round(self.times[name], 3), inputs=deps, **info)

    def _summary(self, s: JobSummary, what: str, ranked: bool = True) -> None:
        _log_summary(s, what, self.log, self.total, *((self.rank, self.world) if ranked else ()))

    def features(self) -> None:
        """The USS features of the pseudo-labelled ids into ``<out>/features`` (none with
        ``features_dir``)."""
        s = self.s
        if s.features_dir is not None:
            self.times["features"] = 0.0
            return
        extractor = None
        if self.state.stale("features", _stage_inputs("features", self.digests)) is not None:
            from mars_plugin.adapters.uss.extractor import load_extractor

            # mars features' own loader with DHR's inference (native resolution, no L2
            # normalisation), at this run's scales and flip; loaded before any work, so that a bad
            # flag or file stops the run at once.
            extractor = load_extractor(s.uss, s.checkpoint, backbone=s.backbone, heads=s.heads,
                                       trust_pickle=s.trust_pickle, scales=tuple(s.scales), flip_average=s.flip,
                                       dhr=True)

        def run() -> Dict[str, Any]:
            from mars_plugin.commands.features import features_job

            if self.rank == 0:
                self.log(f"  {extractor.describe()}")
            js = features_job(extractor, self.image_dir, self.inputs.feats, batch_size=s.feature_batch_size,
                              device=s.device, fp16=s.fp16, on_error=s.on_error,
                              progress=self.progress and self.rank == 0, file_format="pt", stems=self.work,
                              model=self.inputs.feature_settings)
            self._summary(js, "features")
            return {"written": js.done, "existing": js.existing, "failed": [list(f) for f in js.failed]}

        self._stage("features", run)

    def centroids(self) -> None:
        """Eq. 1-3 over the pseudo labels into ``<out>/centroids.pt``."""
        s = self.s

        def run() -> Dict[str, Any]:
            V, js = centroids_job(self.inputs.feats, s.pseudo_dir, self.inputs.num_classes, self.centroids_path,
                                  image_labels=self.image_labels, alpha=s.alpha, k_fg=s.k_fg, k_bg=s.k_bg,
                                  seed=s.seed, on_error=s.on_error, progress=self.progress and self.rank == 0,
                                  fmt=self.fmt, device=s.device, stems=self.work)
            self._summary(js, "centroids")
            return {"images": V.num_images, "failed": [list(f) for f in js.failed]}

        self._stage("centroids", run)

    def debias(self) -> None:
        """Eq. 4-5 into ``<out>/debiased``; the label of an id this run leaves out (its pseudo
        label gone, its tags unreadable) is moved to ``debiased/.mars-stale/<UTC time>-<run id>/``
        (no result of this run, but not lost)."""
        s, debiased = self.s, self.debiased

        def run() -> Dict[str, Any]:
            if self.rank == 0:
                aside = OutputAside(debiased, f"--out {debiased.parent} (debiased/)")
                for gone in sorted(set(list_stems(debiased, (".png",))) - set(self.work)) if debiased.is_dir() else ():
                    aside.move(f"{gone}.png")
                if aside.moved:
                    self.log(f"  debias: {len(aside.moved)} label(s) of ids left out moved to {aside.where} "
                             f"({few(aside.moved)})")
            js = debias_job(self.inputs.feats, s.pseudo_dir, self.centroids_path, debiased, images_dir=self.image_dir,
                            refine=s.refine, image_labels=self.image_labels, workers=s.workers,
                            batch_size=s.batch_size, device=s.device, crf_params=s.crf_params, on_error=s.on_error,
                            progress=self.progress and self.rank == 0, fmt=self.fmt, stems=self.work)
            self._summary(js, "debias")
            return {"written": js.done, "existing": js.existing, "failed": [list(f) for f in js.failed]}

        self._stage("debias", run)

    def evaluate(self) -> None:
        """The stage of the scores (on rank 0), then every rank reads ``scores.json``."""
        self._stage("evaluate", self._scores, everyone=False)
        self.scores = json.loads(self.scores_path.read_text())

    def _scores(self) -> Dict[str, Any]:
        """The pseudo and debiased labels against the masks, then the references on the images
        both our scores counted, into ``scores.json``."""
        s, refs, C = self.s, self.inputs.references, self.inputs.num_classes
        done = list_stems(self.debiased, (".png",))
        res: Dict[str, Any] = {}
        failed: List[Tuple[str, str]] = []
        for key, pred in (("pseudo", Path(s.pseudo_dir)), ("debiased", self.debiased)):
            sc, js = evaluate_job(pred, self.mask_dir, C, on_error=s.on_error, progress=self.progress, stems=done)
            self._summary(js, f"evaluate {key}", ranked=False)
            failed += [(f"{stem} (evaluate {key})", why) for stem, why in js.failed]
            res[key] = sc
        bad = {stem for stem, _ in failed}
        common = [x for x in done if not any(b.startswith(x + " (") for b in bad)]
        ref_scores, agreement, left_out = score_references(refs, self.debiased, self.mask_dir, common, C,
                                                           on_error=s.on_error, progress=self.progress)
        for name, why in left_out:
            self.total.failed.append((f"reference {name}", why))
        for name, sc in ref_scores.items():
            self.log(reference_summary(name, sc, agreement.get(name)))
            res[scores_key(name)] = sc
        res["agreement"] = agreement
        res["references"] = {name: os.fspath(refs[name]) for name in ref_scores}
        text = json.dumps(dict(res, class_names=self.inputs.class_names), indent=2)
        atomic_write(self.scores_path, lambda tmp: Path(tmp).write_text(text))
        return {"images": res["pseudo"]["num_images"], "failed": [list(f) for f in failed],
                "references": sorted(ref_scores), "references_left_out": [list(x) for x in left_out],
                "reference_notes": self.inputs.reference_notes}

    def report(self, t_all: float) -> Dict[str, Any]:
        """``report.md`` (cheap, and it names this run's stage times: always rewritten), and the
        run's result."""
        scores = self.scores
        ref_scores = {n: scores[scores_key(n)] for n in scores.get("references", {})}
        self.state.data["stages"].pop("report", None)
        self._stage("report", lambda: self._report(ref_scores), everyone=False)
        if self.rank == 0:
            self.log(f"report -> {self.out / 'report.md'} ({time.perf_counter() - t_all:.1f} s)")
        return {"pseudo": scores["pseudo"], "debiased": scores["debiased"], "references": ref_scores,
                "agreement": scores.get("agreement", {}), "out": self.out, "report": self.out / "report.md",
                "summary": self.total, "rank": self.rank, "world_size": self.world}

    def _report(self, ref_scores: Dict[str, Any]) -> Dict[str, Any]:
        s, out = self.s, self.out
        html = HtmlExtras(gt_dir=self.mask_dir, centroids=self.centroids_path,
                          scores={"pseudo": self.scores["pseudo"], "debiased": self.scores["debiased"]},
                          title=f"MARS reproduction: {s.data} {s.domain}")
        removal, js = report_job(s.pseudo_dir, self.debiased, self.image_dir, out / "report", html=html,
                                 class_names=self.inputs.class_names, num_examples=s.num_examples,
                                 on_error=s.on_error, progress=self.progress)
        self._summary(js, "report", ranked=False)
        ev = self.state.data["stages"].get("evaluate", {})
        text = format_report(self.inputs.class_names, self.scores["pseudo"], self.scores["debiased"], removal, {
            "root": s.root, "data": s.data, "domain": s.domain, "pseudo": s.pseudo_dir,
            "features": _features_text(s, self.inputs.feats), "method": _method_text(s), "times": self.times,
            "stages": self.state.data["stages"],
            "pictures": [(alt, f"report/{name}") for alt, name in PICTURES if (out / "report" / name).is_file()],
            "references_left_out": ev.get("references_left_out", []),
            "html": "report/report.html" if (out / "report" / "report.html").is_file() else None,
        }, references=ref_scores, agreement=self.scores.get("agreement", {}))
        atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(text))
        return {}


def _method_text(s: ReproduceSettings) -> str:
    """The report's line of Eq. 1-5's settings."""
    crf = s.crf_params if isinstance(s.crf_params, str) else json.dumps(s.crf_params)
    return (f"K_fg {s.k_fg}, K_bg {s.k_bg}, alpha {s.alpha}, seed {s.seed}, refine {s.refine}"
            + (f" ({crf})" if s.refine == "crf" else ""))


def _features_text(s: ReproduceSettings, feats: Path) -> str:
    """The report's line of where the features came from."""
    if s.features_dir is not None:
        return f"`{feats}` (given)"
    files = " + ".join(f"`{Path(f).name}`" for f in (s.checkpoint, s.backbone, s.heads) if f is not None)
    return (f"{s.uss} from {files}, scales {', '.join(f'{x:g}' for x in s.scales)}, flip "
            f"{'on' if s.flip else 'off'}{', fp16' if s.fp16 else ''} (DHR's inference)")


def _log_summary(s: JobSummary, what: str, log: Callable[[str], None], total: JobSummary, rank: int = 0,
                 world: int = 1) -> None:
    """One line per stage (per rank under torchrun); the skipped files go to ``total`` (listed at
    the end, and in report.md)."""
    log(f"  {what}{f' rank {rank}/{world}' if world > 1 else ''}: {s.line('done')}")
    total.failed += [(f"{stem} ({what})", why) for stem, why in s.failed]
    total.warnings += [(f"{stem} ({what})", why) for stem, why in s.warnings]
    total.notes += s.notes  # files of no input kept in an output folder, named once at the end
