"""The plan of a ``mars reproduce`` run: what each stage would do, and every input it would refuse.

:func:`plan_reproduce` is the one function both ``--dry-run`` and the real run call: the dry run
prints it (:func:`show_plan`), the real run calls it first and stops on its problems
(:func:`refuse`) before any stage writes anything, so that the dry run's "no mismatch found"
means the run will not refuse its inputs.

What it reads: folder listings, the xml of the pseudo-labelled ids (as DHR reads them), the
dataset json, the *values* of every pseudo label, ground-truth mask and reference mask of those
ids (decoded, with the stages' own checks: a bar with ``progress``; about 6 ms a mask on a
loaded CPU, a few minutes for VOC's 10,582 with two reference folders), image *headers* (the
size, without decoding the pixels), ``reproduce.json`` of ``--out``, the USS model files when
the features stage would run (loaded weights-only, as the run loads them) and, with
``--train``, the ``--weights`` file and the validation split's images (headers) and masks
(values). What it writes: nothing. Each problem is one line naming how many ids have it and the
first few (:mod:`mars_plugin.commands.reproduce_checks`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from mars_plugin.formats.files import list_stems
from mars_plugin.commands.errors import JobError
from mars_plugin.commands.reproduce_checks import (Problem, check_model, check_tree, check_val_split, check_weights,
                                                   image_files, name_ids)

__all__ = ["Plan", "plan_reproduce", "show_plan", "refuse"]


@dataclass
class Plan:
    """What :func:`plan_reproduce` found: ``counts`` (what the tree holds), ``stages`` ({stage:
    what it would read and write, and its state}), ``problems``, ``notes`` (informative lines)."""

    title: str
    counts: Dict[str, int]
    stages: Dict[str, str]
    problems: List[Problem] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    references: Dict[str, str] = field(default_factory=dict)


def plan_reproduce(
    *,
    layout,
    domain: str,
    pseudo_dir: Path,
    out: Path,
    stems: Sequence[str],
    class_names: Sequence[str],
    feats: Path,
    settings: Dict[str, Any],
    references: Dict[str, Path],
    reference_notes: Sequence[str],
    model: Optional[Mapping[str, Any]] = None,
    train: Optional[Mapping[str, Any]] = None,
    progress: bool = False,
) -> Plan:
    """The plan of a run and every problem of its inputs (see the module docstring).

    ``model``: the USS model files (``uss``, ``checkpoint``, ``backbone``, ``heads``,
    ``trust_pickle``, ``scales``, ``flip``) when the run computes its features, None with
    ``--features``. ``train``: the ``--train`` options (``val_domain``, ``weights``, ``arch``,
    ``backbone``, ``masks``), None without ``--train``.
    """
    from mars_plugin.adapters.wsss.dhr import load_image_labels
    from mars_plugin.commands.reproduce_state import _input_ids, _stage_inputs, _State

    image_dir, mask_dir, xml_dir = layout.image_dir(domain), layout.mask_dir(domain), layout.xml_dir(domain)
    C = len(class_names) - 1
    compute_features = model is not None
    images = image_files(image_dir)
    masks = set(list_stems(mask_dir, (".png",)))
    xmls = set(list_stems(xml_dir, (".xml",)))
    problems: List[Problem] = []

    def missing(what: str, have, where: Path) -> None:
        gone = [s for s in stems if s not in have]
        if gone:
            problems.append(Problem(f"{len(gone)} pseudo-labelled id(s) have no {what} in {where}: {name_ids(gone)}"))

    missing("image", images, image_dir)
    missing("ground-truth mask", masks, mask_dir)
    bad_xml: List[str] = []
    tags: Dict[str, List[int]] = {}  # as the run writes them into image_labels.json
    for s in stems:  # a missing xml too: DHR's reader names the file
        try:
            hot = load_image_labels(xml_dir, class_names=class_names, ids=[s])[s]
        except Exception as e:  # noqa: BLE001 -- the run names any failure to read one xml
            bad_xml.append(f"{s} ({e})")
            continue
        tags[s] = [int(i) + 1 for i in hot.nonzero().flatten().tolist()]
    if bad_xml:
        problems.append(Problem(f"{len(bad_xml)} xml file(s) of pseudo-labelled ids cannot be read as DHR reads them: "
                                + "; ".join(bad_xml[:5]) + (" ..." if len(bad_xml) > 5 else "")))
    ref_counts = check_tree(stems, images, pseudo_dir, mask_dir, references, C, problems, progress)

    def done_in(folder: Path, exts: Sequence[str]) -> int:
        if not folder.is_dir():
            return 0
        have = set(list_stems(folder, exts))
        return sum(s in have for s in stems)

    feats_done = done_in(feats, (".pt", ".npy"))
    if not compute_features:
        if feats_done < len(stems):
            problems.append(Problem(f"--features {feats}: features for {feats_done} of the {len(stems)} "
                                    "pseudo-labelled ids"))
        both = [s for s in stems if (feats / f"{s}.pt").is_file() and (feats / f"{s}.npy").is_file()]
        if both:
            problems.append(Problem(f"--features {feats}: {len(both)} id(s) with two feature files (.pt and .npy; "
                                    f"keep one): {name_ids(both)}"))
    debiased_done = done_in(out / "debiased", (".png",))
    # The record of --out, read as the run reads it: other settings are refused there too.
    state_path = out / "reproduce.json"
    try:
        record = _State(state_path, settings, write=False)
    except ValueError as e:
        problems.append(Problem(str(e), per_file=False))
        record = _State(state_path, settings, write=False, data={"settings": settings, "stages": {}})
    recorded = record.data["stages"]
    inputs = _input_ids(stems, image_dir, pseudo_dir, mask_dir, json.dumps(tags, indent=0, sort_keys=True),
                        None if compute_features else feats, references)
    runs: List[str] = []

    def state(stage: str) -> str:
        """A recorded stage is kept when its inputs are those it was made from and no stage
        before it runs (the rule of the run, reproduce_state.STAGE_INPUTS)."""
        if stage not in recorded:
            runs.append(stage)
            return " (to do)"
        why = record.stale(stage, _stage_inputs(stage, inputs)) if not runs else f"after [{runs[-1]}]"
        if why is None:
            return " (recorded as finished from the same inputs: kept)"
        runs.append(stage)
        return f" (recorded as finished, runs again: {why})"

    n = len(stems)
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
        "report": f"writes {out / 'report.md'} and the pictures in {out / 'report'} (always rewritten)",
    }
    if compute_features and "features" in runs:  # the run loads the model only when it computes features
        check_model(model, problems)
    notes = list(reference_notes)
    no_pseudo = sorted(set(images) - set(stems))
    if no_pseudo:  # not a problem: the run reads only the pseudo-labelled ids
        notes.append(f"{len(no_pseudo)} image(s) of {image_dir} have no pseudo label and are left out: "
                     f"{name_ids(no_pseudo)}")
    if train is not None:
        stages.update(_train_stages(layout, domain, out, train, C, n, problems, progress))
    counts = {"images": len(images), "masks": len(masks), "xml": len(xmls), "pseudo labels": n, "classes": C,
              "features done": feats_done, "debiased done": debiased_done,
              **{f"reference {k}": v for k, v in ref_counts.items()}}
    title = (f"mars reproduce on {layout.root / layout.data / domain} ({C} classes + background)")
    return Plan(title, counts, stages, problems, notes, {k: str(v) for k, v in references.items()})


def _train_stages(layout, domain: str, out: Path, train: Mapping[str, Any], C: int, n: int,
                  problems: List[Problem], progress: bool) -> Dict[str, str]:
    """The stages of ``--train`` (train, predict the validation split, the MARS masks) and the
    problems of their inputs: ``--weights``, the validation split."""
    from mars_plugin.commands.train import CHECKPOINT_NAME

    val = train.get("val_domain", "validation")
    check_weights(train, C, problems)
    ck = out / "train" / CHECKPOINT_NAME
    stages = {"train": f"{train.get('arch', 'deeplabv3+')} {train.get('backbone', 'resnet101')} on the {n} debiased "
                       f"labels and the images of {layout.image_dir(domain)} -> {out / 'train'} "
                       + ("(a checkpoint is there: resumes from it)" if ck.is_file() else "(to do)")}
    found = check_val_split(layout, val, C, problems, progress)
    if found is None:
        stages[f"predict {val}"] = (f"skipped: no {layout.image_dir(val)} and {layout.mask_dir(val)} (the run "
                                    "says so and goes on)")
    else:
        stages[f"predict {val}"] = (f"predicts the {found} images of {layout.image_dir(val)} into {out / 'val_pred'}, "
                                    f"scores them against {layout.mask_dir(val)} into {out / 'scores_trained.json'}")
    if train.get("masks", True):
        stages[f"masks {domain}"] = f"predicts the images of {layout.image_dir(domain)} into {out / 'masks'}"
    return stages


def show_plan(plan: Plan, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Print ``plan`` (the dry run): what was found, each stage, then every problem, one line
    each. Returns ``{"counts", "stages", "mismatches": [lines], "references"}``."""
    log(f"dry run of {plan.title}; nothing is computed or written")
    log("found: " + ", ".join(f"{k} {v}" for k, v in plan.counts.items()))
    for note in plan.notes:
        log(f"  {note}")
    for name, line in plan.stages.items():
        log(f"[{name}] {line}")
    lines = [p.line for p in plan.problems]
    if lines:
        log(f"{len(lines)} mismatch(es): the run would refuse each (with --on-error skip, a file's problem "
            "skips that file; the others still stop it)")
        for m in lines:
            log(f"  - {m}")
    else:
        log("no mismatch found")
    return {"counts": plan.counts, "stages": plan.stages, "mismatches": lines, "references": plan.references}


def refuse(plan: Plan, on_error: str) -> None:
    """The real run's stop on the plan's problems, before any stage: every problem with
    ``on_error="stop"``, those that are not one file's with ``"skip"`` (the stages skip and
    name the others). One line: the first problem and how many more ``--dry-run`` lists."""
    stop = [p for p in plan.problems if on_error == "stop" or not p.per_file]
    if stop:
        more = f" (and {len(stop) - 1} more problem(s): mars reproduce --dry-run lists them all)" if stop[1:] else ""
        # A bad file is a JobError, a bad flag or --out a ValueError, as the stages raise them.
        raise (JobError if stop[0].per_file else ValueError)(f"{stop[0].line}{more}")

