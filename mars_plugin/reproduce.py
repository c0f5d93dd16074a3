"""``mars reproduce``: the MARS authors' VOC setting end to end on DHR's folder layout.

The paper's main setting is RS+EPM (ResNet-101) pseudo labels debiased with STEGO features
(Jo et al., ICCV 2023, Tables 4-6). The authors later published their USS tooling with DHR
(shjo-april/DHR): a DINO ViT-B/8 backbone file plus a STEGO heads file, multi-scale features,
and the dataset tree ``<root>/<data>/<domain>/{image,mask,xml}``. This module runs, on that tree:

1. ``features``: STEGO codes with DHR's multi-scale inference (scales 2, 1, 1.5, 0.5 and the
   flip), one fp16 ``<id>.pt`` per image; skipped with ``features_dir`` (e.g. features DHR's
   ``produce_uss_features.py`` already wrote);
2. ``centroids``: Eq. 1-3 over the pseudo labels (tags from ``<domain>/xml``);
3. ``debias``: Eq. 4-5 with the dense CRF;
4. ``evaluate``: IoU/FP/FN of the pseudo labels and of the debiased labels against
   ``<domain>/mask``, on the images that have a pseudo label;
5. ``report``: the per-class removal chart and overlays (``mars report``) and ``report.md``,
   which puts the paper's published figures beside the measured ones.

Every stage resumes: features and debiased labels already written are kept (each file is
written atomically), and ``reproduce.json`` records the settings and the finished stages. A run
into a folder whose recorded settings differ is refused rather than mixing two settings.

What the paper publishes, and what it does not: it gives no per-class score of the pseudo or
debiased *labels*. ``report.md`` therefore shows (a) Table 6 (``tab:complementing``, VOC
*train*): the RS+EPM baseline and MARS as overall mIoU/FP/FN, and (b) the appendix's per-class
VOC *val* IoU of RS+EPM and MARS after segmentation training (``tab:voc_val_detail``). Both are
the trained segmentation network, not the labels: they show where the labels should lead, not
numbers a label evaluation must equal. The tables say so next to the numbers.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .files import atomic_write, list_stems
from .jobs import JobSummary, LabelFormat, centroids_job, debias_job, evaluate_job, report_job

__all__ = ["PAPER_VOC_VAL_IOU", "PAPER_VOC_TRAIN", "PAPER_SOURCES", "reproduce", "STAGES"]

PathLike = Union[str, os.PathLike]

STAGES = ("features", "centroids", "debias", "evaluate", "report")

#: Per-class IoU (%) on PASCAL VOC 2012 *val* after segmentation training, background first,
#: then mIoU: the paper's appendix table ``tab:voc_val_detail`` ("Class-specific performance
#: comparisons with WSSS methods in terms of IoUs (%) on the PASCAL VOC 2012 val set"), rows
#: "RS+EPM" and "MARS (Ours)" (RS+EPM R101 pseudo labels, STEGO features, DeepLabv3+).
PAPER_VOC_VAL_IOU: Dict[str, Tuple[float, ...]] = {
    "RS+EPM": (92.2, 88.4, 35.4, 87.9, 63.8, 79.5, 93.0, 84.5, 92.7, 39.0, 90.5, 54.5, 90.6, 87.5, 83.0, 84.0,
               61.1, 85.6, 52.1, 56.2, 60.2, 74.4),
    "MARS": (94.1, 89.3, 42.0, 88.8, 72.9, 79.5, 92.7, 86.2, 94.2, 40.3, 91.4, 58.8, 91.1, 88.9, 81.9, 84.6,
             63.6, 91.7, 56.7, 85.3, 57.3, 77.7),
}

#: Overall (mIoU %, FP, FN) on PASCAL VOC 2012 *train*: Table 6 (``tab:complementing``, "Effect of
#: key components"). Row 1 is "our baseline (i.e., RS+EPM)" (Sec. 4.3); row 3 is MARS with
#: complementing and WCE. Both after segmentation training, evaluated on train.
PAPER_VOC_TRAIN: Dict[str, Tuple[float, float, float]] = {
    "RS+EPM (Table 6, row 1)": (77.4, 0.123, 0.108),
    "MARS (Table 6, row 3)": (81.8, 0.099, 0.090),
}

PAPER_SOURCES = (
    "Jo et al., MARS, ICCV 2023. Per class: appendix table 'Class-specific performance comparisons ... on the "
    "PASCAL VOC 2012 val set' (tab:voc_val_detail), rows RS+EPM and MARS (Ours). Overall on train: Table 6 "
    "'Effect of key components ... on PASCAL VOC 2012 train set' (tab:complementing), rows 1 and 3. "
    "Setting: RS+EPM ResNet-101 pseudo labels, STEGO features, DeepLabv3+, multi-scale inference and CRF."
)

#: The pictures ``mars report`` draws, as report.md shows them.
PICTURES = (
    ("share of each class's pixels marked biased", "biased_share.png"),
    ("images with the largest share removed", "most_changed.png"),
    ("per class, the images with the most removed", "per_class.png"),
)


def _file_id(path: PathLike) -> Dict[str, Any]:
    """Name, size and a hash of the first and last MiB: enough to tell two weight files apart
    without reading gigabytes on every resume."""
    p = Path(path)
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        if st.st_size > 2 << 20:
            fh.seek(-(1 << 20), os.SEEK_END)
            h.update(fh.read(1 << 20))
    return {"path": os.fspath(p.resolve()), "bytes": st.st_size, "sha256_ends": h.hexdigest()[:16]}


def _same_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


class _State:
    """``reproduce.json``: the settings of the run in this folder and its finished stages."""

    def __init__(self, path: Path, settings: Dict[str, Any]):
        self.path = path
        self.data: Dict[str, Any] = {"settings": settings, "stages": {}}
        if path.is_file():
            try:
                old = json.loads(path.read_text())
                old_settings, stages = old["settings"], old["stages"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: not a reproduce.json this command wrote ({e}); use another --out") from None
            diff = _same_settings(old_settings, settings)
            if diff:
                raise ValueError(
                    f"--out {path.parent} holds a run with other settings ({'; '.join(diff[:4])}); use another "
                    "--out, or delete that folder to start over"
                )
            self.data["stages"] = dict(stages)

    def done(self, stage: str) -> bool:
        return stage in self.data["stages"]

    def finish(self, stage: str, **info: Any) -> None:
        self.data["stages"][stage] = info
        text = json.dumps(self.data, indent=2)
        atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))


def _fmt(x: Optional[float], pct: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}" if pct else f"{x:.3f}"


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}"


def format_report(
    class_names: Sequence[str],
    pseudo: Mapping[str, Any],
    debiased: Mapping[str, Any],
    removal: Mapping[str, Any],
    info: Mapping[str, Any],
) -> str:
    """``report.md``: measured scores of the pseudo and debiased labels beside the paper's figures."""
    C1 = len(class_names)
    voc = C1 == 21
    lines = [
        "# MARS reproduction report",
        "",
        f"- tree: `{info['root']}`, data `{info['data']}`, domain `{info['domain']}`; "
        f"{pseudo['num_images']} images with a pseudo label evaluated against `{info['domain']}/mask`",
        f"- pseudo labels: `{info['pseudo']}`",
        f"- features: {info['features']}",
        f"- settings: {info['method']}",
        f"- stage times (s, this run; 0 when the stage was already done): "
        + ", ".join(f"{k} {v:.1f}" for k, v in info["times"].items()),
        "",
        "## Scores of the labels (measured)",
        "",
        "IoU (%), FP and FN with SEAM's formulas (FP = (P-TP)/(T+P-TP), FN = (T-TP)/(T+P-TP)), over all evaluated "
        "pixels summed. In the debiased labels a biased pixel counts as background: the labels exactly as a "
        "segmentation network would see them before the teacher fills them (Eq. 6-7).",
        "",
    ]
    head = "| class | pseudo IoU | FP | FN | debiased IoU | FP | FN | change IoU | removed |"
    if voc:
        head += " paper val RS+EPM | paper val MARS |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    classes = removal.get("classes", {}) if removal else {}
    for c in range(C1):
        name = class_names[c]
        pi, di = pseudo["iou"][c], debiased["iou"][c]
        r = classes.get(name, {}).get("share_removed") if c > 0 else None
        row = [name, _fmt(pi), _fmt(pseudo["fp"][c], False), _fmt(pseudo["fn"][c], False),
               _fmt(di), _fmt(debiased["fp"][c], False), _fmt(debiased["fn"][c], False),
               _signed(di - pi) if pi is not None and di is not None else "n/a",
               "" if r is None else f"{100 * r:.1f}%"]
        if voc:
            row += [f"{PAPER_VOC_VAL_IOU['RS+EPM'][c]:.1f}", f"{PAPER_VOC_VAL_IOU['MARS'][c]:.1f}"]
        lines.append("| " + " | ".join(row) + " |")

    def mean(s: Mapping[str, Any], key: str) -> float:
        vals = [v for v, p in zip(s[key], s["present"]) if p]
        return sum(vals) / len(vals) if vals else float("nan")

    row = ["**mean**", _fmt(pseudo["miou"]), _fmt(mean(pseudo, "fp"), False), _fmt(mean(pseudo, "fn"), False),
           _fmt(debiased["miou"]), _fmt(mean(debiased, "fp"), False), _fmt(mean(debiased, "fn"), False),
           _signed(debiased["miou"] - pseudo["miou"]), ""]
    if voc:
        row += [f"{PAPER_VOC_VAL_IOU['RS+EPM'][-1]:.1f}", f"{PAPER_VOC_VAL_IOU['MARS'][-1]:.1f}"]
    lines += ["| " + " | ".join(row) + " |", ""]
    lines += [
        "`removed`: share of the class's pseudo-label pixels marked biased (all images summed). "
        + ("The two `paper val` columns are the paper's per-class IoU on VOC *val* after segmentation training "
           "(appendix table `tab:voc_val_detail`): where the labels should lead, not a score the labels must "
           "equal." if voc else "This tree does not have VOC's 21 classes, so the paper's per-class VOC figures "
           "are not shown."),
        "",
        "## Beside the paper's overall figures",
        "",
        "| what | mIoU | mean FP | mean FN |",
        "|---|---|---|---|",
        f"| measured: pseudo labels ({info['domain']}) | {_fmt(pseudo['miou'])} | {_fmt(mean(pseudo, 'fp'), False)} | "
        f"{_fmt(mean(pseudo, 'fn'), False)} |",
        f"| measured: debiased labels ({info['domain']}) | {_fmt(debiased['miou'])} | "
        f"{_fmt(mean(debiased, 'fp'), False)} | {_fmt(mean(debiased, 'fn'), False)} |",
    ]
    for name, (m, fp, fn) in PAPER_VOC_TRAIN.items():
        lines.append(f"| paper: {name}, segmentation network on VOC train | {m:.1f} | {fp:.3f} | {fn:.3f} |")
    lines += [
        "",
        "The paper's rows are a segmentation network trained on the labels (with MARS: on the debiased labels, "
        "complemented by the EMA teacher with the WCE loss), evaluated on VOC train; the measured rows are the "
        "labels themselves. Expect the debiased labels to lower FP, mostly in the biased classes (boat, train), "
        "and to raise FN, which the training's complementing then wins back.",
        "",
        f"Sources: {PAPER_SOURCES}",
        "",
    ]
    skipped = [(stage, f) for stage, st in info.get("stages", {}).items() for f in st.get("failed", [])]
    lines += ["## Skipped files", ""]
    if skipped:
        lines += [f"- {stage}: `{f[0]}`: {f[1]}" for stage, f in skipped]
    else:
        lines.append("None: every image went through every stage.")
    lines += [
        "",
        "## Pictures",
        "",
    ]
    for alt, rel in info.get("pictures", []):
        lines += [f"![{alt}]({rel})", ""]
    if not info.get("pictures"):
        lines += ["None were drawn (no pixel was marked biased).", ""]
    return "\n".join(lines)


def reproduce(
    root: PathLike,
    pseudo_dir: PathLike,
    out_dir: PathLike,
    *,
    backbone: Optional[PathLike] = None,
    heads: Optional[PathLike] = None,
    features_dir: Optional[PathLike] = None,
    data: str = "VOC2012",
    domain: str = "train_aug",
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
    on_error: str = "stop",
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Features -> centroids -> debias -> evaluate -> report on a DHR-layout tree.

    Args:
        root: the folder holding ``<data>/<domain>/{image,mask,xml}`` (DHR's ``--root``).
        pseudo_dir: the WSSS method's pseudo labels, one PNG per image id (RS+EPM:
            ``experiments/pseudo-labels/<tag>/train``; DHR: ``<root>/WSS/<data>/RSEPM/<domain>``).
        out_dir: everything this run writes (see the module docstring); resumable.
        backbone, heads: DINO's ``dino_vitbase8_pretrain.pth`` and DHR's ``STEGO_<data>.pt``
            (both read with ``weights_only=True``). Or instead:
        features_dir: a folder of ``<id>.pt``/``<id>.npy`` features already computed.

    The pseudo labels are P- or L-mode PNGs of class ids (0 background, 255 ignore); the image
    tags come from ``<domain>/xml`` read as DHR reads them (:mod:`mars_plugin.adapters.dhr`),
    and the class names from ``<root>/<data>/<data>.json`` (VOC's 21 names when it is absent).
        scales, flip: the multi-scale inference of the features (default: DHR's scales 2, 1,
            1.5, 0.5, and the flip).
        alpha, k_fg, k_bg, seed: Eq. 1-3 (the paper's 0.4, 2, 2).
        refine, crf_params: Eq. 5's refinement (see ``mars debias``).
        device, fp16, feature_batch_size: where the features and the K-means/CRF run.
        batch_size, workers: images per CRF call, CPU processes for debias.

    Returns a dict with the two score sets (``pseudo``, ``debiased``), the removal report
    and the paths written.
    """
    from .adapters.dhr import DHRLayout, load_image_labels

    t_all = time.perf_counter()
    out = Path(out_dir)
    if (backbone is None) != (heads is None):
        raise ValueError("give both --uss-backbone and --uss-heads (DHR's STEGO is the pair), or --features")
    if (backbone is None) == (features_dir is None):
        raise ValueError("give either --uss-backbone/--uss-heads (features are computed) or --features "
                         "(features already computed), not both and not neither")
    from .adapters.multiscale import DHR_SCALES, check_scales

    scales = DHR_SCALES if scales is None else check_scales(scales)
    layout = DHRLayout(root, data)
    image_dir, mask_dir, xml_dir = layout.image_dir(domain), layout.mask_dir(domain), layout.xml_dir(domain)
    for flag, d in (("--root (images)", image_dir), ("--root (masks)", mask_dir), ("--root (xml)", xml_dir),
                    ("--pseudo", Path(pseudo_dir))):
        if not Path(d).is_dir():
            raise ValueError(f"{flag}: {d} is not a folder; expected <root>/{data}/{domain}/{{image,mask,xml}} "
                             "(DHR's layout) and a folder of pseudo-label PNGs")
    class_names = list(layout.class_names())
    C = len(class_names) - 1
    stems = list_stems(pseudo_dir, (".png",))
    if not stems:
        raise ValueError(f"--pseudo {pseudo_dir}: no .png pseudo labels")
    out.mkdir(parents=True, exist_ok=True)

    settings: Dict[str, Any] = {
        "root": os.fspath(Path(root).resolve()), "data": data, "domain": domain,
        "pseudo": os.fspath(Path(pseudo_dir).resolve()), "alpha": alpha, "k_fg": k_fg,
        "k_bg": k_bg, "seed": seed, "refine": refine, "crf_params": crf_params,
    }
    if features_dir is None:
        settings.update(backbone=_file_id(backbone), heads=_file_id(heads), scales=[float(s) for s in scales],
                        flip=bool(flip))
        feats = out / "features"
    else:
        feats = Path(features_dir)
        if not feats.is_dir():
            raise ValueError(f"--features {features_dir}: not a folder")
        settings["features"] = os.fspath(feats.resolve())
    state = _State(out / "reproduce.json", settings)
    fmt = LabelFormat(mode="P")
    # Tags as DHR reads them, in the {id: [1-based class ids]} JSON the jobs take.
    tags = {k: [int(i) + 1 for i in v.nonzero().flatten().tolist()]
            for k, v in load_image_labels(xml_dir, class_names=class_names).items()}
    image_labels = out / "image_labels.json"
    tags_text = json.dumps(tags, indent=0, sort_keys=True)
    atomic_write(image_labels, lambda tmp: Path(tmp).write_text(tags_text))
    times: Dict[str, float] = {}
    total = JobSummary()

    def stage(name: str, fn: Callable[[], Dict[str, Any]]) -> None:
        if state.done(name):
            log(f"[{name}] done before, kept")
            times[name] = 0.0
            return
        log(f"[{name}] ...")
        t = time.perf_counter()
        info = fn()
        times[name] = time.perf_counter() - t
        state.finish(name, seconds=round(times[name], 3), **info)

    def run_features() -> Dict[str, Any]:
        from .adapters.extractor import DHR_SETTINGS, features_job
        from .adapters.stego import STEGOExtractor

        # DHR's inference (full resolution, no L2 normalisation), with this run's scales and flip.
        kw = dict(DHR_SETTINGS, scales=tuple(scales), flip_average=flip)
        extractor = STEGOExtractor.from_files(backbone, heads, **kw)
        log(f"  {extractor.describe()}")
        s = features_job(extractor, image_dir, feats, batch_size=feature_batch_size, device=device, fp16=fp16,
                         on_error=on_error, progress=progress, file_format="pt", stems=stems)
        _log_summary(s, "features", log, total)
        return {"written": s.done, "existing": s.existing, "failed": [list(f) for f in s.failed]}

    if features_dir is None:
        stage("features", run_features)
    else:
        times["features"] = 0.0

    centroids = out / "centroids.pt"

    def run_centroids() -> Dict[str, Any]:
        V, s = centroids_job(feats, pseudo_dir, C, centroids, image_labels=image_labels, alpha=alpha, k_fg=k_fg,
                             k_bg=k_bg, seed=seed, on_error=on_error, progress=progress, fmt=fmt, device=device)
        _log_summary(s, "centroids", log, total)
        return {"images": V.num_images, "failed": [list(f) for f in s.failed]}

    stage("centroids", run_centroids)
    debiased = out / "debiased"

    def run_debias() -> Dict[str, Any]:
        s = debias_job(feats, pseudo_dir, centroids, debiased, images_dir=image_dir, refine=refine,
                       image_labels=image_labels, workers=workers, batch_size=batch_size, device=device,
                       crf_params=crf_params, on_error=on_error, progress=progress, fmt=fmt)
        _log_summary(s, "debias", log, total)
        return {"written": s.done, "existing": s.existing, "failed": [list(f) for f in s.failed]}

    stage("debias", run_debias)
    scores_path = out / "scores.json"

    def run_evaluate() -> Dict[str, Any]:
        done = list_stems(debiased, (".png",))
        res = {}
        for key, pred in (("pseudo", Path(pseudo_dir)), ("debiased", debiased)):
            sc, s = evaluate_job(pred, mask_dir, C, on_error=on_error, progress=progress, stems=done)
            _log_summary(s, f"evaluate {key}", log, total)
            res[key] = sc
        text = json.dumps(dict(res, class_names=class_names), indent=2)
        atomic_write(scores_path, lambda tmp: Path(tmp).write_text(text))
        return {"images": res["pseudo"]["num_images"], "failed": [list(f) for f in total.failed
                                                                  if f[0].endswith("(evaluate pseudo)")
                                                                  or f[0].endswith("(evaluate debiased)")]}

    stage("evaluate", run_evaluate)
    scores = json.loads(scores_path.read_text())

    def run_report() -> Dict[str, Any]:
        removal, s = report_job(pseudo_dir, debiased, image_dir, out / "report", class_names=class_names,
                                num_examples=num_examples, on_error=on_error, progress=progress)
        _log_summary(s, "report", log, total)
        method = (f"K_fg {k_fg}, K_bg {k_bg}, alpha {alpha}, seed {seed}, refine {refine}"
                  + (f" ({crf_params if isinstance(crf_params, str) else json.dumps(crf_params)})"
                     if refine == "crf" else ""))
        feat_text = (f"`{feats}` (given)" if features_dir is not None else
                     f"STEGO from `{Path(backbone).name}` + `{Path(heads).name}`, scales "
                     f"{', '.join(f'{x:g}' for x in scales)}, flip {'on' if flip else 'off'} (DHR's inference)")
        text = format_report(class_names, scores["pseudo"], scores["debiased"], removal, {
            "root": root, "data": data, "domain": domain, "pseudo": pseudo_dir, "features": feat_text,
            "method": method, "times": times, "stages": state.data["stages"],
            "pictures": [(alt, f"report/{name}") for alt, name in PICTURES if (out / "report" / name).is_file()],
        })
        atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(text))
        return {}

    # The report is cheap and names this run's stage times: always rewritten.
    state.data["stages"].pop("report", None)
    stage("report", run_report)
    log(f"report -> {out / 'report.md'} ({time.perf_counter() - t_all:.1f} s)")
    return {"pseudo": scores["pseudo"], "debiased": scores["debiased"], "out": out, "report": out / "report.md",
            "summary": total}


def _log_summary(s: JobSummary, what: str, log: Callable[[str], None], total: JobSummary) -> None:
    """One line per stage; the skipped files go to ``total`` (listed at the end, and in report.md)."""
    log(f"  {what}: {s.line('done')}")
    total.failed += [(f"{stem} ({what})", why) for stem, why in s.failed]
