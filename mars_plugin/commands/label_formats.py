"""How a WSSS repository stores its labels (:class:`LabelFormat`, ``--wsss``), the image-level
label files (``--image-labels``) and the class names the commands print (``--class-names``).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from mars_plugin._checks import check_class_names, check_num_classes

__all__ = ["LabelFormat", "label_format", "read_image_labels"]


def read_image_labels(path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
    """Image-level labels from a JSON file ``{stem: [1-based class ids]}`` (None: no file).

    Without a file, every job derives an image's classes from its pseudo label.
    """
    num_classes = check_num_classes(num_classes)
    if path is None:
        return None
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--image-labels {p}: cannot read image labels as JSON {{stem: [class ids]}} ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--image-labels {p}: must be a JSON object {{stem: [class ids]}}, got {type(data).__name__}")
    out: Dict[str, List[int]] = {}
    for stem, ids in data.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and 1 <= i <= num_classes for i in ids):
            raise ValueError(f"--image-labels {p}: the classes of {stem!r} must be a list of class ids in "
                             f"1..{num_classes}, got {ids!r}")
        out[str(stem)] = sorted(set(ids))
    return out


WSSS_ADAPTERS = ("irnet", "advcam", "seam", "rsepm", "dhr")


@dataclass
class LabelFormat:
    """How a WSSS repository stores labels: PNG mode of its outputs, sibling files to skip,
    and how its image-level label file is read (through ``mars_plugin.adapters.wsss.<name>``)."""

    name: Optional[str] = None
    mode: str = "P"
    skip_suffixes: Tuple[str, ...] = ()
    dataset: str = "voc"
    trust_pickle: bool = False

    def image_labels(self, path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
        if path is None:
            return None
        if self.name is None:
            return read_image_labels(path, num_classes)
        import inspect

        adapter = _adapter(self.name)
        kwargs: Dict[str, Any] = {"trust_pickle": self.trust_pickle}
        if "dataset" in inspect.signature(adapter.load_image_labels).parameters:
            kwargs["dataset"] = self.dataset
        multi_hot = adapter.load_image_labels(path, **kwargs)
        return {str(k): [int(i) + 1 for i in torch.nonzero(v).flatten().tolist()] for k, v in multi_hot.items()}


def _adapter(name: str):
    import importlib

    if name not in WSSS_ADAPTERS:
        raise ValueError(f"wsss must be one of {WSSS_ADAPTERS}, got {name!r}")
    return importlib.import_module(f"mars_plugin.adapters.wsss.{name}")


def label_format(wsss: Optional[str] = None, *, dataset: str = "voc", trust_pickle: bool = False) -> LabelFormat:
    """The :class:`LabelFormat` of a WSSS repository (None: this package's own layout)."""
    if wsss is None:
        return LabelFormat(trust_pickle=trust_pickle, dataset=dataset)
    adapter = _adapter(wsss)
    skip = ("_palette",) if wsss in ("irnet", "advcam") else ()
    return LabelFormat(wsss, adapter.LABEL_MODE, skip, dataset, trust_pickle)


def _class_names(path: Optional[str]) -> Optional[List[str]]:
    """Class names from a JSON list, a classes.json {"class_names": [...]} file (``mars demo``'s),
    or DHR's dataset json {"names": [...], "ignore": 255} (``<root>/<data>/<data>.json``)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--class-names {path}: cannot read a JSON list of names ({e})") from None
    if isinstance(data, dict):
        data = data.get("class_names", data.get("names"))
    if not isinstance(data, list) or not all(isinstance(n, str) for n in data):
        raise ValueError(f'--class-names {path}: expected a JSON list of class names (background first), '
                         f'{{"class_names": [...]}} (classes.json) or {{"names": [...]}} (DHR\'s dataset json)')
    return check_class_names(data, f"--class-names {path}")


def _wsss_class_names(args: argparse.Namespace) -> Optional[List[str]]:
    """With ``--wsss NAME`` and no ``--class-names``: that codebase's class names (background
    first), read where its own code reads them: DHR's dataset json beside ``--image-labels``'s
    xml folder (``<root>/<data>/<data>.json``, else VOC's), RS+EPM's of ``--dataset``, VOC's for
    IRNet, AdvCAM and SEAM."""
    if args.wsss is None:
        return None
    adapter = _adapter(args.wsss)
    if args.wsss == "rsepm":
        return list(adapter.class_names(args.dataset))
    # DHR's dataset json sits two levels above any of <root>/<data>/<domain>/{xml,mask} folders
    folder = getattr(args, "image_labels", None) or getattr(args, "gt", None)
    if args.wsss == "dhr" and folder is not None:
        sub = Path(folder)
        sub = sub / "xml" if (sub / "xml").is_dir() else sub
        layout = adapter._json_beside_xml(sub) if sub.is_dir() else None
        if layout is not None:
            return list(layout.class_names())
    return list(adapter.CLASS_NAMES)


def _names_beside(folder: os.PathLike) -> Optional[Tuple[List[str], Path]]:
    """(names, file) of the dataset json kept beside a label folder, if any: ``classes.json``
    beside it (``mars demo``'s world: ``val/{gt,classes.json}``), or DHR's ``<root>/<data>/<data>.json``
    two levels above ``<root>/<data>/<domain>/mask``."""
    here = Path(folder).resolve()
    data_dir = here.parent.parent
    for path in (here.parent / "classes.json", data_dir / f"{data_dir.name}.json"):
        if path.is_file():
            try:
                return _class_names(os.fspath(path)), path
            except ValueError:  # not a names file: nothing to infer from it
                return None
    return None


def evaluate_names(args: argparse.Namespace) -> Tuple[List[str], Optional[str]]:
    """Names of classes 0..C for ``mars evaluate``, and where they came from (None: given or
    unknown): ``--class-names``; else ``--wsss``'s (DHR: the dataset json above ``--gt``); else a
    dataset json beside ``--gt`` with exactly C + 1 names; else "class c"."""
    C = args.num_classes
    if args.class_names is not None:
        return _names_for(args.class_names, C), None
    names = _wsss_class_names(args)
    if names is not None:
        if len(names) < C + 1:
            raise ValueError(f"--wsss {args.wsss}: its {len(names) - 1} classes are fewer than --num-classes {C}; "
                             "give --class-names")
        return names, f"--wsss {args.wsss}"
    found = _names_beside(args.gt)
    if found is not None and len(found[0]) == C + 1:
        return found[0], os.fspath(found[1])
    return _names_for(None, C), None


def _names_for(path: Optional[str], num_classes: int) -> List[str]:
    """Names of classes 0..C from --class-names, or "class c"."""
    names = _class_names(path)
    if names is None:
        return ["background"] + [f"class {c}" for c in range(1, num_classes + 1)]
    if len(names) < num_classes + 1:
        raise ValueError(f"--class-names {path}: {len(names)} names, but there are {num_classes} classes "
                         "(plus background)")
    return names


def _class_label(names: Optional[List[str]], c: int) -> str:
    return f"class {c} ({names[c]})" if names is not None and c < len(names) else f"class {c}"
