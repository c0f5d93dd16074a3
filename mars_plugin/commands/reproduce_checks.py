"""The checks of :func:`~mars_plugin.commands.reproduce_plan.plan_reproduce`: every input a stage of
``mars reproduce`` (and of ``--train``) would refuse, found before any stage runs.

Each check reads what the stage reads with the stage's own reader and check (``read_label`` and
``check_label_values`` for pseudo labels and masks, the yardstick's ``_read_reference``, the
loader of the USS model, ``load_backbone_weights``, predict's image listing), so that the plan
and the run cannot disagree on what is wrong. A problem is one line naming the kind, how many
ids have it and the first few of them (:func:`name_ids`); ``per_file`` problems are skipped by
the stages under ``--on-error skip``, the others stop the run whatever ``--on-error`` says.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.formats.files import IGNORE_VALUE, IMAGE_EXTENSIONS, list_stems, read_label
from mars_plugin.runs.errors import one_line

__all__ = ["Problem", "name_ids", "image_files", "check_tree", "check_model", "check_weights", "check_val_split"]

#: At most this many offending ids are named per kind of problem (the count is always given).
SHOW = 5


@dataclass
class Problem:
    """One kind of problem of a tree: ``line`` names it and its first files; ``per_file``: the
    stages skip those files under ``--on-error skip`` (else the run stops whatever it says)."""

    line: str
    per_file: bool = True


def name_ids(ids: Sequence[str]) -> str:
    """The first :data:`SHOW` of ``ids``, and how many there are in all when more."""
    ids = list(ids)
    return ", ".join(ids[:SHOW]) + (f", ... ({len(ids)} in all)" if len(ids) > SHOW else "")


def _size(path: Path) -> Optional[Tuple[int, int]]:
    """(H, W) from the file's header, or None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except Exception:  # any unreadable file: reported as such by the caller
        return None


def image_files(folder: Path) -> Dict[str, List[Path]]:
    """{stem: its image files} of ``folder`` (several for ``a.jpg`` + ``a.png``: a clash)."""
    by_stem: Dict[str, List[Path]] = {}
    for p in Path(folder).iterdir():
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS:
            by_stem.setdefault(p.stem, []).append(p)
    return by_stem


def _bar(items: Sequence[str], desc: str, progress: bool):
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="img")


def _values(path: Path, C: int) -> Tuple[Optional[Tuple[int, int]], Optional[str]]:
    """((H, W), None) of a pseudo label or ground-truth mask read and checked as the stages do,
    or (None, why)."""
    from mars_plugin.commands.inputs import check_label_values

    try:
        label = read_label(path, biased_value=None)
        flat = label.numpy().ravel()
        # The stages' check on the values present (a histogram) rather than on every pixel: the
        # same verdict and message, a few times faster over a whole split.
        present = torch.from_numpy(np.flatnonzero(np.bincount(flat))) if flat.size and flat.min() >= 0 else label
        check_label_values(present, path, C, IGNORE_VALUE)
    except Exception as e:  # noqa: BLE001 -- any failure to read one file is that file's failure
        return None, one_line(e)
    return (int(label.shape[0]), int(label.shape[1])), None


def check_tree(stems: Sequence[str], images: Mapping[str, List[Path]], pseudo_dir: Path, mask_dir: Path,
               references: Mapping[str, Path], C: int, problems: List[Problem], progress: bool) -> Dict[str, int]:
    """The pseudo labels, images, masks and reference masks of the pseudo-labelled ``stems``:
    one per stem, readable, values 0..C and 255 (a reference: never 254), sizes equal. Every
    label and mask is decoded (the values; a bar with ``progress``), an image by its header.
    Problems go to ``problems``; returns {reference name: ids it covers}."""
    from mars_plugin.commands.references import _read_reference, check_references

    masks = set(list_stems(mask_dir, (".png",)))
    clash = [f"{s} ({' and '.join(sorted(p.name for p in images[s]))})" for s in stems if len(images.get(s, ())) > 1]
    if clash:
        problems.append(Problem(f"{len(clash)} id(s) with two image files (which one is meant? keep one): "
                                f"{name_ids(clash)}"))
    refs = {n: set(list_stems(f, (".png",))) for n, f in references.items()}
    bad: Dict[str, List[str]] = {"values": [], "size": [], "unreadable": []}
    ref_bad: Dict[str, List[str]] = {n: [] for n in references}
    for s in _bar(stems, "checking labels and masks", progress):
        size, why = _values(pseudo_dir / f"{s}.png", C)
        if why is not None:
            bad["values"].append(f"{s} (pseudo label: {why})")
        if s in images and len(images[s]) == 1:
            im = _size(images[s][0])
            if im is None:
                bad["unreadable"].append(f"{s} (image {images[s][0].name})")
            elif size is not None and im != size:
                bad["size"].append(f"{s} (pseudo {size[0]}x{size[1]}, image {im[0]}x{im[1]})")
        if s not in masks:
            continue
        gt, why = _values(mask_dir / f"{s}.png", C)
        if why is not None:
            bad["values"].append(f"{s} (mask: {why})")
        elif size is not None and gt != size:
            bad["size"].append(f"{s} (pseudo {size[0]}x{size[1]}, mask {gt[0]}x{gt[1]})")
        for name, folder in references.items():
            if s in refs[name] and gt is not None:
                try:
                    _read_reference(folder / f"{s}.png", C, gt)
                except Exception as e:  # noqa: BLE001 -- as score_references reads it
                    ref_bad[name].append(f"{s} ({one_line(e)})")
    what = {"values": "unreadable label(s) or mask(s), or ones holding values other than 0..{C} and 255",
            "size": "pseudo label(s) whose size differs from the image or the mask",
            "unreadable": "unreadable image(s)"}
    for kind, ids in bad.items():
        if ids:
            problems.append(Problem(f"{len(ids)} {what[kind].format(C=C)}: {name_ids(ids)}"))
    incomplete = check_references(dict(references), stems)
    for name, folder in references.items():
        if name in incomplete:  # the yardstick's own words
            problems.append(Problem(f"reference {name}: {incomplete[name]}; use --on-error skip to leave it out"))
        if ref_bad[name]:
            problems.append(Problem(f"reference {name}: {len(ref_bad[name])} mask(s) the yardstick refuses (a "
                                    f"method's final mask: 0..{C} and 255, never 254, its image's size): "
                                    f"{name_ids(ref_bad[name])} (--on-error skip leaves the reference out)"))
    return {name: sum(s in refs[name] for s in stems) for name in references}


def check_model(model: Mapping[str, Any], problems: List[Problem]) -> None:
    """The USS model files load as ``mars reproduce`` loads them before its features stage (the
    flags that go together, each file read weights-only); only when that stage runs."""
    from mars_plugin.adapters.uss.extractor import load_extractor

    try:
        load_extractor(model["uss"], model["checkpoint"], backbone=model["backbone"], heads=model["heads"],
                       trust_pickle=model["trust_pickle"], scales=tuple(model["scales"]),
                       flip_average=model["flip"], dhr=True)
    except Exception as e:  # noqa: BLE001 -- the run would stop on it before its features
        problems.append(Problem(f"the USS model (--uss {model['uss']}) cannot be loaded: {one_line(e)}",
                                per_file=False))


def check_weights(train: Mapping[str, Any], C: int, problems: List[Problem]) -> None:
    """``--weights`` fits the backbone ``mars train`` builds (its own loader, weights-only)."""
    if train.get("weights") is None:
        return
    from mars_plugin.networks.deeplab import build_model, load_backbone_weights

    try:
        from mars_plugin.networks.recipes import DEFAULT_RECIPE, get_recipe

        recipe = get_recipe(DEFAULT_RECIPE)  # what mars train builds for an arch or backbone left out
        model = build_model(arch=train.get("arch") or recipe.arch, backbone=train.get("backbone") or recipe.backbone,
                            num_classes=C)
        load_backbone_weights(model, train["weights"])
    except Exception as e:  # noqa: BLE001 -- the training would stop on it after the debias
        problems.append(Problem(f"--weights {train['weights']}: {one_line(e)}", per_file=False))


def check_val_split(layout, val_domain: str, C: int, problems: List[Problem], progress: bool) -> Optional[int]:
    """The validation split ``--train`` predicts and scores: predict's image listing (one file
    per stem, photographs), a mask per image, of its image's size, of values 0..C and 255.
    Returns the number of images, or None when the split is absent (the run skips it)."""
    from mars_plugin.commands.inputs import list_images

    images, masks = Path(layout.image_dir(val_domain)), Path(layout.mask_dir(val_domain))
    if not images.is_dir() or not masks.is_dir():
        return None
    try:
        items, clashes = list_images(images, f"--val-domain {val_domain}: images")
    except Exception as e:  # noqa: BLE001 -- predict would stop on it
        problems.append(Problem(one_line(e), per_file=False))
        return 0
    have = set(list_stems(masks, (".png",)))
    bad: List[str] = [f"{s} (two image files: {' and '.join(n)})" for s, n in sorted(clashes.items())]
    for s, path in _bar(items, f"checking {val_domain}", progress):
        if s not in have:
            bad.append(f"{s} (no mask in {masks})")
            continue
        size, why = _values(masks / f"{s}.png", C)
        im = _size(path)
        if why is not None:
            bad.append(f"{s} (mask: {why})")
        elif im is None:
            bad.append(f"{s} (unreadable image {path.name})")
        elif im != size:
            bad.append(f"{s} (image {im[0]}x{im[1]}, mask {size[0]}x{size[1]})")
    if bad:
        problems.append(Problem(f"--val-domain {val_domain}: {len(bad)} image(s) that cannot be predicted and scored "
                                f"against {masks}: {name_ids(bad)}", per_file=False))
    return len(items) + len(clashes)
