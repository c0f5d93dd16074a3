"""``reproduce.json``: the record of a ``mars reproduce`` run in its ``--out`` folder.

The settings of the run, the finished stages and, per stage, one digest per input role it read
(:data:`STAGE_INPUTS`, :func:`_input_ids`): a stage whose recorded digests differ runs again, and
so does every stage after it (the rule of the run, :mod:`mars_plugin.commands.reproduce`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from mars_plugin.formats.files import atomic_write
from mars_plugin.runs.identities import file_id, json_digest, roles_digest, weight_file_id
from mars_plugin.runs.run_record import OutputIds, settings_diff

__all__ = ["STAGE_INPUTS"]


#: The identity of a model file (name, size, hash of its first and last MiB).
_file_id = weight_file_id


_same_settings = settings_diff


#: The input roles each stage reads (digests of :func:`_input_ids`); a stage whose recorded
#: digests differ runs again, and so does every stage after it. The report always runs.
STAGE_INPUTS = {
    "features": ("ids", "images"),
    "centroids": ("ids", "pseudo", "tags", "features"),
    "debias": ("ids", "pseudo", "tags", "features", "images"),
    "evaluate": ("ids", "pseudo", "masks", "references"),
}
_ROLE_NAMES = {"ids": "the set of ids", "images": "images", "pseudo": "pseudo labels", "tags": "tags (xml)",
               "features": "features", "masks": "masks", "references": "reference folders"}


def _input_ids(stems: Sequence[str], image_dir: Path, pseudo_dir: Path, mask_dir: Path, tags_text: str,
               features: Optional[Path], refs: Mapping[str, Path]) -> Dict[str, str]:
    """One digest per input role of the run: the ids, and per id the identity (name, size,
    mtime: :func:`~mars_plugin.runs.identities.file_id`) of its image, pseudo label, mask and given
    features; the tags JSON; each reference folder and its masks. A stat per file, no read."""
    from mars_plugin.formats.files import find_features, find_image

    def found(find, folder, s):
        try:
            return find(folder, s)
        except (ValueError, OSError):  # missing: the stage that reads it names it
            return None

    ids = {
        "ids": json_digest(list(stems)),
        "images": roles_digest({s: file_id(found(find_image, image_dir, s) or image_dir / s) for s in stems}),
        "pseudo": roles_digest({s: file_id(pseudo_dir / f"{s}.png") for s in stems}),
        "tags": json_digest(tags_text),
        "masks": roles_digest({s: file_id(mask_dir / f"{s}.png") for s in stems}),
        "references": json_digest({name: [os.fspath(Path(folder).resolve()),
                                          roles_digest({p.name: file_id(p) for p in Path(folder).glob("*.png")})]
                                   for name, folder in refs.items()}),
    }
    if features is not None:  # given: files of another tool, or of a mars features run
        feature_id = OutputIds(features)
        ids["features"] = roles_digest({s: feature_id(found(find_features, features, s)) for s in stems})
    return ids


def _stage_inputs(stage: str, inputs: Mapping[str, str]) -> Dict[str, str]:
    return {k: inputs[k] for k in STAGE_INPUTS.get(stage, ()) if k in inputs}


class _State:
    """``reproduce.json``: the settings of the run in this folder, the finished stages and the
    digests of the inputs each was made from. ``write=False`` (ranks other than 0 under
    torchrun) keeps the record in memory only; ``data``: rank 0's reading of the file."""

    def __init__(self, path: Path, settings: Dict[str, Any], write: bool = True,
                 data: Optional[Dict[str, Any]] = None):
        self.path = path
        self.write = write
        self.data: Dict[str, Any] = {"settings": settings, "stages": {}}
        if data is not None:
            self.data = data
        elif path.is_file():
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

    def stale(self, stage: str, inputs: Mapping[str, str]) -> Optional[str]:
        """None when ``stage`` finished from these ``inputs``, else why it must run ("": never
        finished here)."""
        rec = self.data["stages"].get(stage)
        if rec is None:
            return ""
        if "inputs" not in rec:
            return "its inputs were not recorded (an earlier mars)"
        changed = [_ROLE_NAMES.get(k, k) for k in sorted(set(inputs) | set(rec["inputs"]))
                   if rec["inputs"].get(k) != inputs.get(k)]
        return f"changed since the last run: {', '.join(changed)}" if changed else None

    def finish(self, stage: str, **info: Any) -> None:
        self.data["stages"][stage] = info
        if not self.write:
            return
        text = json.dumps(self.data, indent=2)
        atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))
