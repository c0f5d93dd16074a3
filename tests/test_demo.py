"""``mars demo``: its --out folder (manifest, no stale files, refusals), its written world split
(the folder commands reproduce the table's columns (a) and (b)) and its overlays."""
from __future__ import annotations

import json

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")

from mars_plugin.commands import demo as demo_mod  # noqa: E402
from mars_plugin.cli import main  # noqa: E402
from mars_plugin.commands.demo import MANIFEST, DemoFolderError, run_demo  # noqa: E402
from mars_plugin.pictures.label_images import BIASED_COLOR  # noqa: E402
from mars_plugin.pictures.panel_grids import SWATCH  # noqa: E402

TINY = dict(size=32, epochs=1, progress=False)


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _tiny(out, **kw):
    args = dict(TINY, num_train=12, num_val=6, refine="threshold")
    args.update(kw)
    return run_demo(out=str(out), **args)


@pytest.mark.slow
def test_rerun_replaces_exactly_its_own_files(tmp_path):
    out = tmp_path / "demo"
    _tiny(out, num_train=14, num_val=6)
    first = _files(out)
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(listed + [MANIFEST]) == first  # every file is in the manifest, and only those
    assert "world/train/features/syn_000013.npy" in first and "world/val/gt/syn_000019.png" in first
    # files the demo did not write, inside its folder: kept
    (out / "report").mkdir()
    (out / "report" / "mine.txt").write_text("keep")
    (out / "world" / "train" / "notes.txt").write_text("keep too")
    _tiny(out, num_train=8, num_val=4, write_world=True)
    second = _files(out)
    assert "world/train/features/syn_000013.npy" not in second  # stale world files are gone
    assert "world/val/gt/syn_000019.png" not in second
    assert {"report/mine.txt", "world/train/notes.txt"} <= set(second)
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(listed + [MANIFEST, "report/mine.txt", "world/train/notes.txt"]) == second
    # --no-world removes the previous world, and the folders it leaves empty
    _tiny(out, num_train=8, num_val=4, write_world=False)
    assert _files(out) == sorted(["centroids.pt", "iou_per_class.png", "overlays.png", "metrics.json", MANIFEST,
                                  "report/mine.txt", "world/train/notes.txt"])
    assert not (out / "world" / "val").exists()


def test_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    with pytest.raises(DemoFolderError, match="not empty and has no mars_demo_manifest.json"):
        _tiny(out)
    assert _files(out) == ["precious.txt"]
    assert main(["demo", "--out", str(out), "--num-train", "8", "--num-val", "4", "--epochs", "1"]) == 2
    assert "mars_demo_manifest.json" in capsys.readouterr().err
    # a manifest naming a file outside --out is refused, and nothing is deleted
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    (out / MANIFEST).write_text(json.dumps({"files": ["../victim.txt"]}))
    with pytest.raises(DemoFolderError, match="outside"):
        _tiny(out)
    assert victim.exists()
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DemoFolderError, match="not a mars demo manifest"):
        _tiny(out)
    assert (out / "precious.txt").exists()


def test_an_interrupted_run_is_cleaned_up_by_the_next(tmp_path, monkeypatch):
    out = tmp_path / "demo"

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(demo_mod, "train_segmenter", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        _tiny(out)
    assert (out / "centroids.pt").is_file()
    assert json.loads((out / MANIFEST).read_text())["files"] == ["centroids.pt"]
    monkeypatch.undo()
    _tiny(out, write_world=False)
    assert sorted(json.loads((out / MANIFEST).read_text())["files"] + [MANIFEST]) == _files(out)


@pytest.mark.slow
@pytest.mark.parametrize("refine", ["threshold", "crf"])
def test_the_world_split_reproduces_columns_a_and_b(tmp_path, capsys, refine):
    out = tmp_path / "demo"
    m = _tiny(out, num_train=16, num_val=6, refine=refine, seed=1)
    w = out / "world"
    split = json.loads((w / "split.json").read_text())
    assert split["train"] == [f"syn_{i:06d}" for i in range(16)]
    assert split["val"] == [f"syn_{i:06d}" for i in range(16, 22)]
    for part in ("train", "val"):
        for sub in ("images", "labels", "gt", "features", "debiased"):
            assert sorted(p.stem for p in (w / part / sub).iterdir()) == split[part]
    # The documented commands: centroids of world/train, debias world/val, evaluate against its gt.
    assert main(["centroids", "--features", str(w / "train" / "features"), "--labels", str(w / "train" / "labels"),
                 "--num-classes", "6", "--seed", "1", "--out", str(tmp_path / "V.pt"), "--no-progress"]) == 0
    assert main(["debias", "--features", str(w / "val" / "features"), "--labels", str(w / "val" / "labels"),
                 "--image-labels", str(w / "val" / "image_labels.json"), "--centroids", str(tmp_path / "V.pt"),
                 "--images", str(w / "val" / "images"), "--refine", refine, "--out", str(tmp_path / "db"),
                 "--no-progress"]) == 0
    for pred, column in ((tmp_path / "db", "(b) debiased"), (w / "val" / "debiased", "(b) debiased"),
                         (w / "val" / "labels", "(a) WSSS pseudo")):
        assert main(["evaluate", "--pred", str(pred), "--gt", str(w / "val" / "gt"), "--num-classes", "6",
                     "--json", str(tmp_path / "s.json"), "--no-progress"]) == 0
        got = json.loads((tmp_path / "s.json").read_text())
        want = m["scores"][column]
        for key in ("iou", "fp", "fn"):
            assert np.allclose(got[key], want[key], rtol=0, atol=1e-12, equal_nan=True), (pred, column, key)
    capsys.readouterr()


def test_overlays_have_ground_truth_a_legend_and_no_repeated_image(tmp_path):
    from mars_plugin.worlds.synthetic_scenes import make_world

    world = make_world(30, size=32, seed=4)
    names = list(world.class_names)
    lab = world.pseudo
    rows = demo_mod._overlay_rows(names, world, lab, world.gt, world.gt, 3)
    stems = [r[0].split(":")[1].split()[0] for r in rows]
    assert len(stems) == len(set(stems)) and len(stems) > 6
    assert all([t for t, _ in r[1]] == ["image", "ground truth", "WSSS pseudo", "removed", "plain CE", "MARS"]
               for r in rows)
    # every class with an unused image gets its rows, up to 3
    for c in range(1, len(names)):
        assert 1 <= sum(r[0].startswith(f"{names[c]}:") for r in rows) <= 3
    out = tmp_path / "demo"
    _tiny(out, write_world=False)
    with PIL_Image.open(out / "overlays.png") as im:
        arr = np.asarray(im.convert("RGB"))
    assert (arr == np.array(BIASED_COLOR, np.uint8)).all(-1).sum() >= (SWATCH - 2) ** 2  # the legend's swatch
