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
from typing import Any, Callable, Dict, List, Mapping, Sequence

from mars_plugin.formats.files import list_stems
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.reproduce_checks import (Problem, check_model, check_tree, check_val_split, check_weights,
                                                   image_files, name_ids)
from mars_plugin.commands.reproduce_settings import ReproduceInputs

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


def plan_reproduce(inputs: ReproduceInputs, progress: bool = False) -> Plan:
    """The plan of a run and every problem of its inputs (see the module docstring), from what
    :func:`~mars_plugin.commands.reproduce_settings.prepare` found: the settings' USS model
    (``settings.model()``) when the run computes its features, their ``train`` options (the
    ``--train`` stages) when given."""
    s, stems, feats, out = inputs.settings, inputs.stems, inputs.feats, inputs.out
    image_dir, mask_dir, xml_dir = inputs.dirs()
    C = inputs.num_classes
    images = image_files(image_dir)
    masks = set(list_stems(mask_dir, (".png",)))
    problems: List[Problem] = []
    for what, have, where in (("image", images, image_dir), ("ground-truth mask", masks, mask_dir)):
        gone = [x for x in stems if x not in have]
        if gone:
            problems.append(Problem(f"{len(gone)} pseudo-labelled id(s) have no {what} in {where}: {name_ids(gone)}"))
    tags = _tags(stems, xml_dir, inputs.class_names, problems)
    ref_counts = check_tree(stems, images, Path(s.pseudo_dir), mask_dir, inputs.references, C, problems, progress)
    feats_done = _done_in(feats, (".pt", ".npy"), stems)
    if s.features_dir is not None:
        _given_features_problems(feats, stems, feats_done, problems)
    debiased_done = _done_in(out / "debiased", (".png",), stems)
    runs = _StageStates(inputs, json.dumps(tags, indent=0, sort_keys=True), problems)
    stages = _stage_lines(inputs, runs, feats_done, debiased_done)
    if s.features_dir is None and "features" in runs.runs:  # the run loads the model only when it computes features
        check_model(s.model(), problems)
    notes = list(inputs.reference_notes)
    no_pseudo = sorted(set(images) - set(stems))
    if no_pseudo:  # not a problem: the run reads only the pseudo-labelled ids
        notes.append(f"{len(no_pseudo)} image(s) of {image_dir} have no pseudo label and are left out: "
                     f"{name_ids(no_pseudo)}")
    if s.train is not None:
        stages.update(_train_stages(inputs.layout, s.domain, out, s.train, C, len(stems), problems, progress))
    counts = {"images": len(images), "masks": len(masks), "xml": len(set(list_stems(xml_dir, (".xml",)))),
              "pseudo labels": len(stems), "classes": C, "features done": feats_done, "debiased done": debiased_done,
              **{f"reference {k}": v for k, v in ref_counts.items()}}
    title = f"mars reproduce on {inputs.layout.root / inputs.layout.data / s.domain} ({C} classes + background)"
    return Plan(title, counts, stages, problems, notes, {k: str(v) for k, v in inputs.references.items()})


def _tags(stems: Sequence[str], xml_dir: Path, class_names: Sequence[str], problems: List[Problem]
          ) -> Dict[str, List[int]]:
    """The tags as the run writes them into image_labels.json; the xml files that DHR's reader
    refuses (a missing one too: the reader names the file) are one problem."""
    from mars_plugin.adapters.wsss.dhr import load_image_labels

    bad_xml: List[str] = []
    tags: Dict[str, List[int]] = {}
    for s in stems:
        try:
            hot = load_image_labels(xml_dir, class_names=class_names, ids=[s])[s]
        except Exception as e:  # noqa: BLE001 -- the run names any failure to read one xml
            bad_xml.append(f"{s} ({e})")
            continue
        tags[s] = [int(i) + 1 for i in hot.nonzero().flatten().tolist()]
    if bad_xml:
        problems.append(Problem(f"{len(bad_xml)} xml file(s) of pseudo-labelled ids cannot be read as DHR reads them: "
                                + "; ".join(bad_xml[:5]) + (" ..." if len(bad_xml) > 5 else "")))
    return tags


def _done_in(folder: Path, exts: Sequence[str], stems: Sequence[str]) -> int:
    """How many of ``stems`` have a file in ``folder`` (0 when it does not exist)."""
    if not folder.is_dir():
        return 0
    have = set(list_stems(folder, exts))
    return sum(s in have for s in stems)


def _given_features_problems(feats: Path, stems: Sequence[str], feats_done: int, problems: List[Problem]) -> None:
    if feats_done < len(stems):
        problems.append(Problem(f"--features {feats}: features for {feats_done} of the {len(stems)} "
                                "pseudo-labelled ids"))
    both = [s for s in stems if (feats / f"{s}.pt").is_file() and (feats / f"{s}.npy").is_file()]
    if both:
        problems.append(Problem(f"--features {feats}: {len(both)} id(s) with two feature files (.pt and .npy; "
                                f"keep one): {name_ids(both)}"))


class _StageStates:
    """The record of --out, read as the run reads it (other settings are refused there too, as
    a problem), and the state of each recorded stage against the inputs' digests."""

    def __init__(self, inputs: ReproduceInputs, tags_text: str, problems: List[Problem]):
        from mars_plugin.commands.reproduce_state import _input_ids, _State

        s, identity = inputs.settings, inputs.identity
        image_dir, mask_dir, _ = inputs.dirs()
        path = inputs.out / "reproduce.json"
        try:
            self.record = _State(path, identity, write=False)
        except ValueError as e:
            problems.append(Problem(str(e), per_file=False))
            self.record = _State(path, identity, write=False, data={"settings": identity, "stages": {}})
        self.digests = _input_ids(inputs.stems, image_dir, Path(s.pseudo_dir), mask_dir, tags_text,
                                  inputs.feats if s.features_dir is not None else None, inputs.references)
        self.runs: List[str] = []

    def __call__(self, stage: str) -> str:
        """A recorded stage is kept when its inputs are those it was made from and no stage
        before it runs (the rule of the run, reproduce_state.STAGE_INPUTS)."""
        from mars_plugin.commands.reproduce_state import _stage_inputs

        if stage not in self.record.data["stages"]:
            self.runs.append(stage)
            return " (to do)"
        why = self.record.stale(stage, _stage_inputs(stage, self.digests)) if not self.runs else \
            f"after [{self.runs[-1]}]"
        if why is None:
            return " (recorded as finished from the same inputs: kept)"
        self.runs.append(stage)
        return f" (recorded as finished, runs again: {why})"


def _stage_lines(inputs: ReproduceInputs, state: _StageStates, feats_done: int, debiased_done: int) -> Dict[str, str]:
    """{stage: what it would read and write, and its state}, the stages in order."""
    s, out, feats, n, refs = inputs.settings, inputs.out, inputs.feats, len(inputs.stems), inputs.references
    image_dir, mask_dir, _ = inputs.dirs()
    stages = {"features": (f"computes {n - feats_done} of {n} <id>.pt from {image_dir} into {feats} ({feats_done} "
                           f"already there){state('features')}" if s.features_dir is None else
                           f"reads {feats_done} of {n} feature files from {feats} (given)")}
    stages["centroids"] = (f"reads {n} pseudo labels from {Path(s.pseudo_dir)} and their features, writes "
                           f"{out / 'centroids.pt'}{state('centroids')}")
    stages["debias"] = (f"writes {n - debiased_done} of {n} debiased labels into {out / 'debiased'} ({debiased_done} "
                        f"already there), the CRF on the images of {image_dir}{state('debias')}")
    stages["evaluate"] = (f"scores the pseudo and debiased labels against {mask_dir}"
                          + (f" and {len(refs)} reference folder(s) ({', '.join(refs)})" if refs else
                             " (no reference folders)") + f", writes {out / 'scores.json'}{state('evaluate')}")
    stages["report"] = f"writes {out / 'report.md'} and the pictures in {out / 'report'} (always rewritten)"
    return stages


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

