"""``report.md`` of ``mars reproduce``: the measured scores beside the paper's published figures.

What the paper publishes, and what it does not: it gives no per-class score of the pseudo or
debiased *labels*. The report therefore shows (a) Table 6 (``tab:complementing``, VOC *train*):
the RS+EPM baseline and MARS as overall mIoU/FP/FN, and (b) the appendix's per-class *val* IoU
of RS+EPM and MARS after segmentation training: ``tab:voc_val_detail`` for VOC (21 classes) and
``tab:coco_val_detail`` for COCO 2014 (81 classes). Both are the trained segmentation network,
not the labels: they show where the labels should lead, not numbers a label evaluation must
equal. The tables say so next to the numbers. When the tree holds other methods' masks
(``WSS/<data>/<method>/<domain>``, e.g. the authors' own MARS masks), a second table puts their
measured scores and their agreement with our labels beside ours
(:mod:`mars_plugin.commands.references`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mars_plugin.adapters.wsss._common import COCO_CLASSES
from mars_plugin.commands.references import describe_reference

__all__ = [
    "PAPER_VOC_VAL_IOU",
    "PAPER_VOC_TRAIN",
    "PAPER_COCO_CLASSES",
    "PAPER_COCO_VAL_IOU",
    "PAPER_SOURCES",
    "PAPER_SOURCES_COCO",
    "PICTURES",
    "format_report",
    "paper_columns",
]

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


#: COCO 2014's 81 class names, background first, in COCO's category order: the order of the
#: paper's appendix table ``tab:coco_val_detail`` ("Class-specific performance comparisons with
#: WSSS methods in terms of IoUs (%) on the MS COCO 2014 *val* set"; a test compares the two).
PAPER_COCO_CLASSES: Tuple[str, ...] = COCO_CLASSES
#: Per-class IoU (%) on COCO 2014 *val* after segmentation training, in
#: :data:`PAPER_COCO_CLASSES` order, then mIoU: the rows "RS+EPM" and "MARS (Ours)" of
#: ``tab:coco_val_detail`` (RS+EPM's row averages to 46.3; the paper prints 46.4).
PAPER_COCO_VAL_IOU: Dict[str, Tuple[float, ...]] = {
    "RS+EPM": (
        83.6, 74.9, 55.0, 50.1, 72.9, 76.5, 72.5, 47.4, 46.5, 44.1, 60.8, 80.3, 84.1, 77.8, 41.2, 62.6, 79.2,
        73.3, 76.1, 80.0, 79.3, 85.6, 82.9, 87.0, 82.2, 9.4, 73.4, 4.6, 17.2, 53.9, 57.7, 8.2, 24.7, 41.6,
        62.6, 1.5, 0.4, 34.8, 17.0, 9.0, 38.1, 39.8, 38.9, 4.9, 9.0, 1.1, 11.3, 67.0, 49.2, 33.7, 62.3, 50.4,
        35.0, 48.3, 68.6, 62.3, 48.3, 28.9, 44.9, 16.9, 53.6, 24.6, 71.1, 49.9, 56.6, 17.4, 54.8, 48.8, 60.8,
        43.6, 38.0, 0.0, 36.9, 51.8, 27.3, 23.3, 26.0, 47.1, 68.8, 0.0, 19.7, 46.4,
    ),
    "MARS": (
        83.7, 56.8, 59.2, 52.0, 75.2, 79.6, 76.8, 72.0, 54.1, 52.1, 53.8, 80.9, 76.8, 74.8, 47.2, 72.3, 80.9,
        76.3, 78.2, 83.5, 83.2, 87.7, 87.5, 87.9, 83.4, 11.9, 77.1, 8.4, 18.4, 57.2, 57.5, 10.8, 27.7, 40.4,
        63.8, 1.6, 0.3, 34.9, 61.3, 52.0, 36.6, 45.5, 42.0, 1.7, 6.4, 0.9, 14.1, 67.7, 47.9, 34.9, 62.5,
        45.9, 31.7, 51.5, 68.0, 64.9, 53.3, 30.3, 49.1, 20.6, 55.9, 17.4, 76.5, 54.9, 64.5, 12.9, 55.3, 51.8,
        64.6, 56.9, 43.5, 0.0, 40.7, 63.4, 29.2, 19.8, 31.0, 47.0, 69.5, 0.0, 32.2, 49.4,
    ),
}

PAPER_SOURCES_COCO = (
    "Jo et al., MARS, ICCV 2023. Per class and overall: appendix table 'Class-specific performance comparisons "
    "with WSSS methods in terms of IoUs (%) on the MS COCO 2014 val set' (tab:coco_val_detail), rows RS+EPM and "
    "MARS (Ours), after segmentation training."
)


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def paper_columns(class_names: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The paper's per-class val IoU for this class list, or None.

    VOC (21 names) and COCO 2014 (81 names) are matched by position, the order of the paper's
    tables (VOC's and COCO's own category order, which DHR's json files keep). Returns
    ``{"table": label, "rows": {"RS+EPM": (...), "MARS": (...)}, "mismatch": [(ours, paper)]}``,
    where ``mismatch`` lists the positions whose names differ (other than in case, spaces and
    punctuation): shown in the report, so a json in another order cannot pass unnoticed.
    """
    C1 = len(class_names)
    if C1 == 21:
        from mars_plugin.adapters.wsss._common import VOC_CLASSES

        paper_names, rows, table = VOC_CLASSES, PAPER_VOC_VAL_IOU, "tab:voc_val_detail, VOC val"
    elif C1 == 81:
        paper_names, rows, table = PAPER_COCO_CLASSES, PAPER_COCO_VAL_IOU, "tab:coco_val_detail, COCO 2014 val"
    else:
        return None
    mismatch = [(a, b) for a, b in zip(class_names, paper_names) if _norm(a) != _norm(b)]
    return {"table": table, "rows": rows, "mismatch": mismatch}


def _fmt(x: Optional[float], pct: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}" if pct else f"{x:.3f}"


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}"


def _mean(s: Mapping[str, Any], key: str) -> float:
    vals = [v for v, p in zip(s[key], s["present"]) if p]
    return sum(vals) / len(vals) if vals else float("nan")


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _references_section(
    class_names: Sequence[str],
    pseudo: Mapping[str, Any],
    debiased: Mapping[str, Any],
    references: Mapping[str, Mapping[str, Any]],
    agreement: Mapping[str, Mapping[str, Any]],
    info: Mapping[str, Any],
) -> List[str]:
    names = list(references)
    lines = [
        f"## Beside other methods' masks (`WSS/{info['data']}/<method>/{info['domain']}`)",
        "",
        "Each folder is scored against the ground truth exactly as our labels are, on the same images. "
        "`agree` is the per-class IoU between our debiased labels and that folder's masks (our biased pixels "
        "belong to no class); the last row is the share of pixels where both say the same (a biased pixel never "
        "agrees), over pixels where neither map nor the ground truth is ignored. What each folder is:",
        "",
    ]
    lines += [f"- `{n}`: {describe_reference(n)}." for n in names]
    lines += [
        "",
        "A high agreement with `MARS` is not expected from labels alone: the authors' masks come after the "
        "segmentation training (the EMA teacher fills the biased pixels, the network generalises, the CRF sharpens), "
        "our debiased labels before it.",
        "",
    ]
    head = ["class", "pseudo IoU", "debiased IoU (ours)"]
    for n in names:
        head += [f"{n} IoU", f"agree {n}"]
    rows = []
    for c, cname in enumerate(class_names):
        row = [cname, _fmt(pseudo["iou"][c]), _fmt(debiased["iou"][c])]
        for n in names:
            row += [_fmt(references[n]["iou"][c]), _fmt(agreement[n]["iou"][c])]
        rows.append(row)
    row = ["**mean**", _fmt(pseudo["miou"]), _fmt(debiased["miou"])]
    for n in names:
        row += [_fmt(references[n]["miou"]), _fmt(agreement[n]["miou"])]
    rows.append(row)
    row = ["pixels agreeing with ours", "", ""]
    for n in names:
        row += ["", _fmt(agreement[n]["pixel"]) + "%" if not math.isnan(agreement[n]["pixel"]) else "n/a"]
    rows.append(row)
    lines += _table(head, rows)
    lines.append("")
    return lines


def format_report(
    class_names: Sequence[str],
    pseudo: Mapping[str, Any],
    debiased: Mapping[str, Any],
    removal: Mapping[str, Any],
    info: Mapping[str, Any],
    references: Optional[Mapping[str, Mapping[str, Any]]] = None,
    agreement: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> str:
    """``report.md``: measured scores of the pseudo and debiased labels beside the paper's figures,
    and beside the masks of other methods' folders (``references``, keyed by folder name, with
    their ``agreement`` with our debiased labels) when the tree has them."""
    paper = paper_columns(class_names)
    coco = paper is not None and len(class_names) == 81
    lines = _head(pseudo, info) + _label_scores(class_names, pseudo, debiased, removal, paper)
    if references:
        lines += _references_section(class_names, pseudo, debiased, references, agreement or {}, info)
    left_out = info.get("references_left_out", [])
    if left_out:
        lines += ["References left out (`--on-error skip`):", ""]
        lines += [f"- `{n}`: {why}" for n, why in left_out] + [""]
    lines += _overall(pseudo, debiased, references or {}, info, coco) + _tail(info)
    return "\n".join(lines)


def _head(pseudo: Mapping[str, Any], info: Mapping[str, Any]) -> List[str]:
    """The title, what was run on what, and the heading of the label scores."""
    return [
        f"# MARS reproduction report: {info['data']} {info['domain']} (DHR tree at `{info['root']}`)",
        "",
        f"- tree: `{info['root']}`, data `{info['data']}`, domain `{info['domain']}`; "
        f"{pseudo['num_images']} images with a pseudo label evaluated against `{info['domain']}/mask`",
        f"- pseudo labels: `{info['pseudo']}`",
        f"- features: {info['features']}",
        f"- settings: {info['method']}",
        "- run record (settings, input fingerprints, stage times and skipped files): `reproduce.json` beside "
        "this file",
        "- stage times (s, this run; 0 when the stage was already done): "
        + ", ".join(f"{k} {v:.1f}" for k, v in info["times"].items()),
        "",
        "## Scores of the labels (measured)",
        "",
        "IoU (%), FP and FN with SEAM's formulas (FP = (P-TP)/(T+P-TP), FN = (T-TP)/(T+P-TP)), over all evaluated "
        "pixels summed. In the debiased labels a biased pixel counts as background: the labels exactly as a "
        "segmentation network would see them before the teacher fills them (Eq. 6-7).",
        "",
    ]


def _label_scores(class_names: Sequence[str], pseudo: Mapping[str, Any], debiased: Mapping[str, Any],
                  removal: Mapping[str, Any], paper: Optional[Dict[str, Any]]) -> List[str]:
    """The per-class table of the pseudo and debiased labels (the paper's val columns beside
    when the classes are VOC's or COCO's), and its note."""
    head = ["class", "pseudo IoU", "FP", "FN", "debiased IoU", "FP", "FN", "change IoU", "removed"]
    if paper is not None:
        head += ["paper val RS+EPM", "paper val MARS"]
    classes = removal.get("classes", {}) if removal else {}
    rows = []
    for c, name in enumerate(class_names):
        pi, di = pseudo["iou"][c], debiased["iou"][c]
        r = classes.get(name, {}).get("share_removed") if c > 0 else None
        row = [name, _fmt(pi), _fmt(pseudo["fp"][c], False), _fmt(pseudo["fn"][c], False),
               _fmt(di), _fmt(debiased["fp"][c], False), _fmt(debiased["fn"][c], False),
               _signed(di - pi) if pi is not None and di is not None else "n/a",
               "" if r is None else f"{100 * r:.1f}%"]
        if paper is not None:
            row += [f"{paper['rows']['RS+EPM'][c]:.1f}", f"{paper['rows']['MARS'][c]:.1f}"]
        rows.append(row)
    row = ["**mean**", _fmt(pseudo["miou"]), _fmt(_mean(pseudo, "fp"), False), _fmt(_mean(pseudo, "fn"), False),
           _fmt(debiased["miou"]), _fmt(_mean(debiased, "fp"), False), _fmt(_mean(debiased, "fn"), False),
           _signed(debiased["miou"] - pseudo["miou"]), ""]
    if paper is not None:
        row += [f"{paper['rows']['RS+EPM'][-1]:.1f}", f"{paper['rows']['MARS'][-1]:.1f}"]
    rows.append(row)
    if paper is not None:
        note = (f"The two `paper val` columns are the paper's per-class IoU on {paper['table'].split(', ')[1]} after "
                f"segmentation training (appendix table `{paper['table'].split(',')[0]}`): where the labels should "
                "lead, not a score the labels must equal.")
        if paper["mismatch"]:
            note += (" They are matched by position; these names differ from the paper's: "
                     + ", ".join(f"`{a}` (paper: `{b}`)" for a, b in paper["mismatch"][:10])
                     + (" ..." if len(paper["mismatch"]) > 10 else "") + ".")
    else:
        note = ("This tree has neither VOC's 21 nor COCO's 81 classes, so the paper's per-class figures are not "
                "shown.")
    return _table(head, rows) + ["", "`removed`: share of the class's pseudo-label pixels marked biased (all images "
                                     "summed). " + note, ""]


def _overall(pseudo: Mapping[str, Any], debiased: Mapping[str, Any], references: Mapping[str, Mapping[str, Any]],
             info: Mapping[str, Any], coco: bool) -> List[str]:
    """The measured overall scores beside the paper's (Table 6 for VOC, the val mIoU for COCO)."""
    lines = [
        "## Beside the paper's overall figures",
        "",
        "| what | mIoU | mean FP | mean FN |",
        "|---|---|---|---|",
        f"| measured: pseudo labels ({info['domain']}) | {_fmt(pseudo['miou'])} | {_fmt(_mean(pseudo, 'fp'), False)} | "
        f"{_fmt(_mean(pseudo, 'fn'), False)} |",
        f"| measured: debiased labels ({info['domain']}) | {_fmt(debiased['miou'])} | "
        f"{_fmt(_mean(debiased, 'fp'), False)} | {_fmt(_mean(debiased, 'fn'), False)} |",
    ]
    for name, s in references.items():
        lines.append(f"| measured: `{name}` masks ({info['domain']}) | {_fmt(s['miou'])} | "
                     f"{_fmt(_mean(s, 'fp'), False)} | {_fmt(_mean(s, 'fn'), False)} |")
    if coco:
        for name, row in PAPER_COCO_VAL_IOU.items():
            lines.append(f"| paper: {name}, segmentation network on COCO 2014 val | {row[-1]:.1f} | | |")
        trained = "evaluated on COCO 2014 val (the paper gives no FP/FN for COCO)"
    else:
        for name, (m, fp, fn) in PAPER_VOC_TRAIN.items():
            lines.append(f"| paper: {name}, segmentation network on VOC train | {m:.1f} | {fp:.3f} | {fn:.3f} |")
        trained = "evaluated on VOC train"
    return lines + [
        "",
        "The paper's rows are a segmentation network trained on the labels (with MARS: on the debiased labels, "
        f"complemented by the EMA teacher with the WCE loss), {trained}; the measured rows are the "
        "labels themselves. Expect the debiased labels to lower FP, mostly in the biased classes (boat, train), "
        "and to raise FN, which the training's complementing then wins back.",
        "",
        f"Sources: {PAPER_SOURCES_COCO if coco else PAPER_SOURCES}",
        "",
    ]


def _tail(info: Mapping[str, Any]) -> List[str]:
    """The skipped files of every stage, and the pictures."""
    skipped = [(stage, f) for stage, st in info.get("stages", {}).items() for f in st.get("failed", [])]
    lines = ["## Skipped files", ""]
    if skipped:
        lines += [f"- {stage}: `{f[0]}`: {f[1]}" for stage, f in skipped]
    else:
        lines.append("None: every image went through every stage.")
    lines += ["", "## Pictures", ""]
    if info.get("html"):
        lines += [f"Every image, class by class (image, pseudo label, debiased label, ground truth) and each class's "
                  f"centroid ranking: [{info['html']}]({info['html']}), a page that opens offline in a browser.", ""]
    for alt, rel in info.get("pictures", []):
        lines += [f"![{alt}]({rel})", ""]
    if not info.get("pictures"):
        lines += ["None were drawn (no pixel was marked biased).", ""]
    return lines
