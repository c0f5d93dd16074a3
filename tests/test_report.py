"""``mars report``: per-class examples, a legend, pixel counts and what the share means."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

PIL_Image = pytest.importorskip("PIL.Image")

from mars_plugin.cli import main  # noqa: E402
from mars_plugin.commands.report import SHARE_DEFINITION, report_job  # noqa: E402
from mars_plugin.formats.files import write_image, write_label  # noqa: E402
from mars_plugin.pictures.label_images import BIASED_COLOR  # noqa: E402
from mars_plugin.pictures.panel_grids import SWATCH  # noqa: E402

NAMES = ["background", "boat", "a class with a rather long name", "bird"]


def _folders(tmp_path, seed=0, n=7, size=24):
    """Random pseudo labels with classes 1..3 and debiased labels with random removals; returns
    the folders and the labels as tensors, so that every count can be recomputed by hand."""
    g = torch.Generator().manual_seed(seed)
    root = tmp_path / "w"
    ys, ds, stems = [], [], []
    for i in range(n):
        y = torch.zeros(size, size, dtype=torch.long)
        for c in range(1, 4):
            if torch.rand(1, generator=g) < 0.7:
                r0, c0 = torch.randint(0, size - 8, (2,), generator=g).tolist()
                h, w = torch.randint(2, 9, (2,), generator=g).tolist()
                y[r0 : r0 + h, c0 : c0 + w] = c
        y[0, : size // 3] = 255
        gone = (torch.rand(size, size, generator=g) < torch.rand(1, generator=g)) & (y > 0) & (y < 255)
        d = torch.where(gone, torch.full_like(y, -1), y)
        stem = f"img_{i:02d}"
        write_label(root / "labels" / f"{stem}.png", y)
        write_label(root / "debiased" / f"{stem}.png", d)
        write_image(root / "images" / f"{stem}.png", torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8))
        ys.append(y), ds.append(d), stems.append(stem)
    return root, ys, ds, stems


def test_report_counts_shares_and_per_class_examples_by_hand(tmp_path):
    root, ys, ds, stems = _folders(tmp_path)
    rep, s = report_job(root / "labels", root / "debiased", root / "images", tmp_path / "rep", class_names=NAMES,
                        num_examples=3, per_class=2, progress=False)
    assert s.done == len(stems)
    assert rep["share_definition"] == SHARE_DEFINITION and "whole set" in SHARE_DEFINITION
    all_fg = sum(int(((y > 0) & (y < 255)).sum()) for y in ys)
    for c in range(1, 4):
        pix = sum(int((y == c).sum()) for y in ys)
        rem = sum(int(((y == c) & (d == -1)).sum()) for y, d in zip(ys, ds))
        got = rep["classes"][NAMES[c]]
        assert (got["pixels"], got["removed"]) == (pix, rem)
        assert got["share_removed"] == pytest.approx(rem / pix)
        assert got["pixel_share"] == pytest.approx(pix / all_fg)
        # the per-class examples: images where some pixels of c were removed, largest share first
        cand = []
        for y, d, stem in zip(ys, ds, stems):
            t, r = int((y == c).sum()), int(((y == c) & (d == -1)).sum())
            if r:
                cand.append((-r / t, -r, stem, r, t))
        want = [{"stem": st, "share_removed": r / t, "removed": r, "pixels": t} for _, _, st, r, t in sorted(cand)[:2]]
        # the same integer division as the job: exact equality (pytest.approx takes no list of dicts)
        assert rep["per_class_examples"][NAMES[c]] == want
    assert rep["ranking"] == sorted(NAMES[1:], key=lambda k: -rep["classes"][k]["share_removed"])
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert saved["per_class_examples"] == json.loads(json.dumps(rep["per_class_examples"]))
    for name in ("biased_share.png", "most_changed.png", "per_class.png"):
        with PIL_Image.open(tmp_path / "rep" / name) as im:
            arr = np.asarray(im.convert("RGB"))
        if name != "biased_share.png":  # the legend's "removed (biased)" swatch is drawn
            assert (arr == np.array(BIASED_COLOR, np.uint8)).all(-1).sum() >= (SWATCH - 2) ** 2


@pytest.mark.slow
def test_more_examples_per_class_give_a_taller_grid_and_zero_gives_none(tmp_path):
    root, *_ = _folders(tmp_path, seed=1)
    sizes = {}
    for k in (1, 3):
        report_job(root / "labels", root / "debiased", root / "images", tmp_path / f"r{k}", class_names=NAMES,
                   per_class=k, progress=False)
        with PIL_Image.open(tmp_path / f"r{k}" / "per_class.png") as im:
            sizes[k] = im.size
    assert sizes[3][1] > sizes[1][1]
    rep, _ = report_job(root / "labels", root / "debiased", root / "images", tmp_path / "r0", class_names=NAMES,
                        per_class=0, num_examples=0, progress=False)
    assert not (tmp_path / "r0" / "per_class.png").exists() and not (tmp_path / "r0" / "most_changed.png").exists()
    assert all(v == [] for v in rep["per_class_examples"].values())
    for bad in (-1, 1.5, True, 11):
        with pytest.raises((ValueError, TypeError), match=r"per_class must be an integer in 0\.\.10"):
            report_job(root / "labels", root / "debiased", root / "images", tmp_path / "rx", per_class=bad,
                       progress=False)


def test_cli_per_class_flag(tmp_path, capsys):
    root, *_ = _folders(tmp_path, seed=2)
    names = tmp_path / "names.json"
    names.write_text(json.dumps(NAMES))
    assert main(["report", "--labels", str(root / "labels"), "--debiased", str(root / "debiased"), "--images",
                 str(root / "images"), "--out", str(tmp_path / "rep"), "--class-names", str(names), "--per-class", "1",
                 "--no-progress"]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert all(len(v) <= 1 for v in rep["per_class_examples"].values())
    assert any(len(v) == 1 for v in rep["per_class_examples"].values())
    out = capsys.readouterr().out
    assert "boat" in out
    # the printed ranking is report.json's: each class in order, with its share and pixel count
    lines = [l.strip() for l in out.splitlines() if "% of " in l and "pixels (" in l]
    assert [l.split("  ")[0] for l in lines] == rep["ranking"]
    for line, name in zip(lines, rep["ranking"]):
        c = rep["classes"][name]
        assert f"{100 * c['share_removed']:.1f}% of {c['pixels']:,} pixels" in line


@pytest.mark.slow
def test_photographs_make_grids_of_bounded_size_and_per_class_keeps_the_top_classes(tmp_path, monkeypatch):
    """Photo-sized images are shrunk to PANEL_SIDE (at 3x a 500 px photo, a VOC per-class grid
    passed PIL's decompression-bomb limit), small ones keep their 3x, and per_class.png shows the
    MAX_GRID_CLASSES classes with the largest share removed (report.json keeps them all)."""
    import mars_plugin.pictures.panel_grids as panel_grids
    from mars_plugin.commands.report import MAX_GRID_CLASSES
    C = MAX_GRID_CLASSES + 6
    root = tmp_path / "w"
    g = torch.Generator().manual_seed(1)
    for i in range(C):  # image i holds class i+1, a share (i+1)/(C+1) of it removed
        y = torch.zeros(300, 600, dtype=torch.long)
        y[100:200, 100:500] = i + 1
        d = y.clone()
        d[100:100 + round(100 * (i + 1) / (C + 1)), 100:500] = -1
        write_label(root / "labels" / f"img_{i:02d}.png", y)
        write_label(root / "debiased" / f"img_{i:02d}.png", d)
        write_image(root / "images" / f"img_{i:02d}.png", torch.randint(0, 256, (300, 600, 3), generator=g,
                                                                     dtype=torch.uint8))
    seen = {}

    def spy(path, rows, scale=3, *, legend=None):
        seen[len(seen)] = (rows, scale)
        return real(path, rows, scale, legend=legend)

    real = panel_grids.save_overlay_grid
    monkeypatch.setattr(panel_grids, "save_overlay_grid", spy)
    names = ["background"] + [f"c{c}" for c in range(1, C + 1)]
    report, _ = report_job(root / "labels", root / "debiased", root / "images", tmp_path / "out", class_names=names,
                           per_class=1, progress=False)
    most_changed, per_class = seen[0], seen[1]
    for rows, scale in (most_changed, per_class):
        assert scale == 1
        for _, panels in rows:
            assert all(np.asarray(p).shape[:2] == (128, 256) for _, p in panels)
    # the top classes by share: C, C-1, ... (the share grows with the class id)
    assert [cap.split(":")[0] for cap, _ in per_class[0]] == [f"c{c}" for c in range(C, C - MAX_GRID_CLASSES, -1)]
    assert len(report["ranking"]) == C and len(report["per_class_examples"]) == C
    with PIL_Image.open(tmp_path / "out" / "per_class.png") as im:
        assert im.width < 1200 and im.height < MAX_GRID_CLASSES * 200
    # Small images (the demo's) keep their 3x enlargement.
    _folders(tmp_path / "small")
    seen.clear()
    report_job(tmp_path / "small" / "w" / "labels", tmp_path / "small" / "w" / "debiased",
               tmp_path / "small" / "w" / "images", tmp_path / "out2", class_names=NAMES, progress=False)
    assert seen[0][1] == 3
