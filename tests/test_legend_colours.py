"""The overlay grids draw every label in its legend's exact colour (issue 30, class 11): a class's
pixels in a label panel of ``mars report`` (most_changed.png, per_class.png) and ``mars demo``
(overlays.png) have the RGB its legend entry shows, and so have the removed (biased) pixels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin.pictures import panel_grids
from mars_plugin.commands.demo import _overlay_rows
from mars_plugin.commands.report import report_job
from mars_plugin.formats.files import read_label, write_label
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world


def _check_panel(panel, label: np.ndarray, legend: dict, names, where: str) -> int:
    """Every labelled pixel (classes and removed) of ``panel`` in its legend colour; returns how
    many classes were checked."""
    rgb = panel_grids._panel_rgb(panel, where)
    checked = 0
    for c in np.unique(label):
        key = "removed (biased)" if c == -1 else ("ignore" if c == 255 else names[c])
        if key not in legend:
            continue
        got = {tuple(int(v) for v in px) for px in rgb[label == c]}
        assert got == {legend[key]}, (where, key, sorted(got)[:3], legend[key])
        checked += c != 0
    return checked


def _check_removed(panel, debiased: np.ndarray, legend: dict, names, where: str) -> int:
    """The removed panel: removed (-1) and kept foreground pixels in their legend colours (the
    rest is the darkened image, not a label)."""
    shown = np.where((debiased > 0) & (debiased != 255) | (debiased == -1), debiased, 0)
    return _check_panel(panel, shown, {k: v for k, v in legend.items() if k != "background"}, names, where)


def _biased(debiased: np.ndarray) -> np.ndarray:
    lab = debiased.astype(np.int64)
    lab[lab == 254] = -1  # read_label's default already does this; kept for a raw array
    return lab


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("legend")
    world = make_world(6, size=32, dim=16, seed=3)
    write_world(world, root)
    return root, world


def test_report_label_panels_are_in_the_legend_colours(world_dir, tmp_path, monkeypatch):
    root, world = world_dir
    names = list(world.class_names)
    # debiased labels: every second pixel of each image's foreground marked biased (254)
    deb = tmp_path / "debiased"
    deb.mkdir()
    for stem in world.stems:
        y = np.asarray(read_label(root / "labels" / f"{stem}.png", biased_value=None)).copy()
        fg = np.flatnonzero((y > 0) & (y < 254))
        y.flat[fg[::2]] = 254
        write_label(deb / f"{stem}.png", torch.from_numpy(y))
    grids = []
    original = panel_grids.save_overlay_grid

    def capture(path, rows, *a, **kw):
        grids.append((Path(path).name, rows, dict(kw["legend"])))
        return original(path, rows, *a, **kw)

    monkeypatch.setattr(panel_grids, "save_overlay_grid", capture)
    report_job(root / "labels", deb, root / "images", tmp_path / "out", class_names=names, progress=False)
    assert grids and (tmp_path / "out" / "most_changed.png").is_file()
    checked = 0
    for name, rows, legend in grids:
        for title, panels in rows:
            stem = next(part for part in title.split(": ") if part in world.stems)  # most_changed / per_class
            y = np.asarray(read_label(root / "labels" / f"{stem}.png", biased_value=None), dtype=np.int64)
            d = _biased(np.asarray(read_label(deb / f"{stem}.png")))
            panel = dict(panels)
            checked += _check_panel(panel["pseudo label"], y, legend, names, f"{name} {stem} pseudo")
            checked += _check_panel(panel["debiased label"], d, legend, names, f"{name} {stem} debiased")
            checked += _check_removed(panel["removed pixels"], d, legend, names, f"{name} {stem} removed")
    assert checked >= 2 * len(world.problematic)


def test_demo_label_panels_are_in_the_legend_colours(world_dir):
    _, world = world_dir
    names = list(world.class_names)
    db = world.pseudo.clone().long()
    db[(db > 0) & (db < 255) & (torch.arange(db[0].numel()).reshape(db[0].shape) % 2 == 0)] = -1
    preds = [world.gt, world.pseudo]
    rows = _overlay_rows(names, world, db, *preds, examples_per_class=2)
    legend = dict(panel_grids.class_legend(names))
    assert rows
    for title, panels in rows:
        i = world.stems.index(title.split(": ")[1].split(" ")[0])
        panel = dict(panels)
        for key, lab in (("ground truth", world.gt[i]), ("WSSS pseudo", world.pseudo[i]),
                         ("plain CE", preds[0][i]), ("MARS", preds[1][i])):
            _check_panel(panel[key], np.asarray(lab, dtype=np.int64), legend, names, f"{title} {key}")
        _check_removed(panel["removed"], np.asarray(db[i], dtype=np.int64), legend, names, f"{title} removed")
