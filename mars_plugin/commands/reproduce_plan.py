"""``mars reproduce --dry-run``: check a tree before a long run, computing nothing.

What it reads: folder listings, the xml of the pseudo-labelled ids (as DHR reads them), the
dataset json, image and mask *headers* (PIL reads the size without decoding the pixels) and
``reproduce.json`` of ``--out`` if there is one. What it writes: nothing. What it says: for each
stage what it would read and write and how much of it is already done, and every mismatch that
would stop or skip part of the real run, one line each.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mars_plugin.formats.files import IMAGE_EXTENSIONS, list_stems

__all__ = ["dry_run"]

#: At most this many offending ids are named per kind of mismatch (the count is always given).
_SHOW = 5


def _size(path: Path) -> Optional[Tuple[int, int]]:
    """(H, W) from the file's header, or None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except Exception:  # any unreadable file: reported as such by the caller
        return None


def _ids(ids: Sequence[str]) -> str:
    ids = list(ids)
    return ", ".join(ids[:_SHOW]) + (f", ... ({len(ids)} in all)" if len(ids) > _SHOW else "")


def dry_run(
    *,
    layout,
    domain: str,
    pseudo_dir: Path,
    out: Path,
    stems: Sequence[str],
    class_names: Sequence[str],
    feats: Path,
    compute_features: bool,
    settings: Dict[str, Any],
    references: Dict[str, Path],
    reference_notes: Sequence[str],
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """The plan of a ``mars reproduce`` run and the mismatches of its tree (see the module
    docstring). Returns ``{"counts": {...}, "stages": {stage: line}, "mismatches": [lines],
    "references": {name: folder}}``."""
    from mars_plugin.adapters.wsss.dhr import load_image_labels

    image_dir, mask_dir, xml_dir = layout.image_dir(domain), layout.mask_dir(domain), layout.xml_dir(domain)
    images = {}
    for p in image_dir.iterdir():
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS:
            images[p.stem] = p
    masks = set(list_stems(mask_dir, (".png",)))
    xmls = set(list_stems(xml_dir, (".xml",)))
    mismatches: List[str] = []

    def missing(what: str, have, where: Path) -> List[str]:
        gone = [s for s in stems if s not in have]
        if gone:
            mismatches.append(f"{len(gone)} pseudo-labelled id(s) have no {what} in {where}: {_ids(gone)}")
        return gone

    missing("image", images, image_dir)
    missing("ground-truth mask", masks, mask_dir)
    no_xml = set(missing("xml", xmls, xml_dir))
    bad_xml = []
    tags: Dict[str, List[int]] = {}  # as the run writes them into image_labels.json
    for s in stems:
        if s in no_xml:
            continue
        try:
            hot = load_image_labels(xml_dir, class_names=class_names, ids=[s])[s]
        except ValueError as e:
            bad_xml.append(f"{s} ({e})")
            continue
        tags[s] = [int(i) + 1 for i in hot.nonzero().flatten().tolist()]
    if bad_xml:
        mismatches.append(f"{len(bad_xml)} xml file(s) of pseudo-labelled ids cannot be read as DHR reads them: "
                          + "; ".join(bad_xml[:_SHOW]) + (" ..." if len(bad_xml) > _SHOW else ""))
    # Sizes from the headers: a pseudo label, its image and its mask must agree.
    odd, unreadable = [], []
    for s in stems:
        sp = _size(pseudo_dir / f"{s}.png")
        if sp is None:
            unreadable.append(s)
            continue
        for what, path in (("image", images.get(s)), ("mask", mask_dir / f"{s}.png" if s in masks else None)):
            if path is None:
                continue
            so = _size(path)
            if so is None:
                unreadable.append(f"{s} ({what})")
            elif so != sp:
                odd.append(f"{s} (pseudo {sp[0]}x{sp[1]}, {what} {so[0]}x{so[1]})")
    if unreadable:
        mismatches.append(f"{len(unreadable)} unreadable file(s) (pseudo label, image or mask): {_ids(unreadable)}")
    if odd:
        mismatches.append(f"{len(odd)} pseudo label(s) whose size differs from the image or the mask: {_ids(odd)}")

    # The references: coverage of the evaluated ids and sizes against the masks.
    ref_counts: Dict[str, int] = {}
    for name, folder in references.items():
        have = set(list_stems(folder, (".png",)))
        ref_counts[name] = sum(s in have for s in stems)
        gone = [s for s in stems if s not in have]
        if gone:
            mismatches.append(f"reference {name} ({folder}): no mask for {len(gone)} of the {len(stems)} "
                              f"pseudo-labelled ids: {_ids(gone)} (the run stops on it; --on-error skip leaves it out)")
        wrong = []
        for s in stems:
            if s in have and s in masks:
                a, b = _size(folder / f"{s}.png"), _size(mask_dir / f"{s}.png")
                if a != b:
                    wrong.append(f"{s} ({'unreadable' if a is None else f'{a[0]}x{a[1]}'} vs mask "
                                 f"{'unreadable' if b is None else f'{b[0]}x{b[1]}'})")
        if wrong:
            mismatches.append(f"reference {name}: {len(wrong)} mask(s) of another size than the ground truth: "
                              f"{_ids(wrong)}")

    def done_in(folder: Path, exts: Sequence[str]) -> int:
        if not folder.is_dir():
            return 0
        have = set(list_stems(folder, exts))
        return sum(s in have for s in stems)

    feats_done = done_in(feats, (".pt", ".npy"))
    debiased_done = done_in(out / "debiased", (".png",))
    recorded: Dict[str, Any] = {}
    state_path = out / "reproduce.json"
    if state_path.is_file():
        try:
            old = json.loads(state_path.read_text())
            diff = sorted(k for k in set(old["settings"]) | set(settings)
                          if old["settings"].get(k) != settings.get(k))
            recorded = old.get("stages", {})
            if diff:
                mismatches.append(f"--out {out} holds a run with other settings ({', '.join(diff[:6])}): the run "
                                  "would be refused; use another --out")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            mismatches.append(f"{state_path}: not a reproduce.json this command wrote ({e})")

    n = len(stems)

    # A recorded stage is kept when its inputs are those it was made from and no stage before it
    # runs (the rule of the run, mars_plugin.commands.reproduce_state.STAGE_INPUTS).
    from mars_plugin.commands.reproduce_state import _input_ids, _stage_inputs, _State

    inputs = _input_ids(stems, image_dir, pseudo_dir, mask_dir, json.dumps(tags, indent=0, sort_keys=True),
                        None if compute_features else feats, references)
    record = _State(state_path, settings, write=False, data={"settings": settings, "stages": recorded})
    runs: List[str] = []

    def state(stage: str) -> str:
        if stage not in recorded:
            runs.append(stage)
            return ""
        why = record.stale(stage, _stage_inputs(stage, inputs)) if not runs else f"after [{runs[-1]}]"
        if why is None:
            return " (recorded as finished from the same inputs: kept)"
        runs.append(stage)
        return f" (recorded as finished, runs again: {why})"

    stages = {
        "features": (f"computes {n - feats_done} of {n} <id>.pt from {image_dir} into {feats} ({feats_done} already "
                     f"there){state('features')}" if compute_features else
                     f"reads {feats_done} of {n} feature files from {feats} (given)"),
        "centroids": f"reads {n} pseudo labels from {pseudo_dir} and their features, writes {out / 'centroids.pt'}"
                     f"{state('centroids')}",
        "debias": f"writes {n - debiased_done} of {n} debiased labels into {out / 'debiased'} ({debiased_done} already "
                  f"there), the CRF on the images of {image_dir}{state('debias')}",
        "evaluate": f"scores the pseudo and debiased labels against {mask_dir}"
                    + (f" and {len(references)} reference folder(s) ({', '.join(references)})" if references else
                       " (no reference folders)") + f", writes {out / 'scores.json'}{state('evaluate')}",
        "report": f"writes {out / 'report.md'} and the pictures in {out / 'report'}",
    }
    if not compute_features and feats_done < n:
        mismatches.append(f"--features {feats}: features for {feats_done} of the {n} pseudo-labelled ids")
    counts = {"images": len(images), "masks": len(masks), "xml": len(xmls), "pseudo labels": n,
              "classes": len(class_names) - 1, "features done": feats_done, "debiased done": debiased_done,
              **{f"reference {k}": v for k, v in ref_counts.items()}}
    log(f"dry run of mars reproduce on {layout.root / layout.data / domain} ({len(class_names) - 1} classes + "
        f"background); nothing is computed or written")
    log("found: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for note in reference_notes:
        log(f"  {note}")
    for name, line in stages.items():
        log(f"[{name}] {line}")
    if mismatches:
        log(f"{len(mismatches)} mismatch(es):")
        for m in mismatches:
            log(f"  - {m}")
    else:
        log("no mismatch found")
    return {"counts": counts, "stages": stages, "mismatches": mismatches,
            "references": {k: str(v) for k, v in references.items()}}
