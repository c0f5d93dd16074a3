"""Degenerate features (issue 30, class 7): a feature map whose every value is 0, or whose every
pixel holds the same vector (what a failed extractor leaves), is refused by name in every
command that reads features (centroids, debias, reproduce; ``--on-error skip`` skips and names
it) and in the Python API's debias_labels / debiased_similarity; a map constant only inside one
class region is legitimate and goes through."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import DebiasedCentroids, debias_labels, debiased_similarity
from mars_plugin._checks import degenerate_features
from mars_plugin.cli import main
from mars_plugin.formats.files import read_label
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

from test_reproduce import DATA, make_tree


def _zero(f: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(f)


def _constant(f: torch.Tensor) -> torch.Tensor:
    return f[:, :1, :1].expand_as(f).clone() + 0.25  # one nonzero vector at every pixel


#: name -> (make the map from a real one, a piece of the refusal)
DEGENERATE = {"all zero": (_zero, "every value is 0"), "constant": (_constant, "every pixel holds the same vector")}


def _flat_in_one_region(f: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``f`` with one vector at every pixel of the label's first foreground class (a flat
    object): legitimate, the rest of the image still varies."""
    g = f.clone()
    cls = int(label[(label > 0) & (label < 255)][0])
    region = torch.nn.functional.interpolate(label[None, None].float(), size=f.shape[-2:], mode="nearest")[0, 0] == cls
    assert region.any() and not region.all()
    g[:, region] = g[:, region][:, :1]
    return g


def test_the_rule_on_maps():
    torch.manual_seed(0)
    f = torch.randn(4, 5, 6)
    assert degenerate_features(f) is None
    assert degenerate_features(_zero(f)) == "every value is 0"
    assert degenerate_features(_constant(f)) == "every pixel holds the same vector"
    g = f.clone()
    g[:, 0, 0] = g[:, -1, -1]  # first and last pixel equal, the rest varies: a full look says so
    assert degenerate_features(g) is None
    assert degenerate_features(torch.ones(4, 1, 1)) is None  # one pixel is one vector by its size
    assert degenerate_features(torch.zeros(4, 1, 1)) == "every value is 0"
    y = torch.zeros(5, 6, dtype=torch.long)
    y[1:4, 1:4] = 2
    assert degenerate_features(_flat_in_one_region(f, y)) is None


# --------------------------------------------------------------------------- the Python API

def test_debias_labels_and_similarity_refuse_a_degenerate_map_naming_it():
    torch.manual_seed(0)
    V = torch.randn(3, 4)
    y = torch.zeros(6, 6, dtype=torch.long)
    y[2:5, 2:5] = 1
    good = torch.randn(4, 6, 6)
    for kind, (make, says) in DEGENERATE.items():
        bad = make(good)
        with pytest.raises(ValueError, match=rf"^features: {says} \(6x6 pixels, D=4\)"):
            debias_labels(bad, y, V, [1], refine="threshold")
        with pytest.raises(ValueError, match=rf"^features\[1\]: {says}"):
            debias_labels(torch.stack([good, bad]), torch.stack([y, y]), V, [[1], [1]], refine="threshold")
        with pytest.raises(ValueError, match=rf"^features: {says}"):
            debiased_similarity(bad, V, [1])
    debias_labels(_flat_in_one_region(good, y), y, V, [1], refine="threshold")  # legitimate


# --------------------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("degenerate_world")
    w = make_world(8, size=32, dim=16, seed=3)
    write_world(w, root)
    return root, w


def _copy(root: Path, dest: Path, stem: str, make) -> Path:
    """A copy of the world's folders with ``stem``'s feature map replaced by ``make(map)``."""
    for sub in ("features", "labels", "images"):
        (dest / sub).mkdir(parents=True)
        for p in (root / sub).iterdir():
            (dest / sub / p.name).write_bytes(p.read_bytes())
    path = dest / "features" / f"{stem}.npy"
    label = read_label(dest / "labels" / f"{stem}.png", biased_value=None)
    f = torch.from_numpy(np.load(path).astype(np.float32))
    np.save(path, (make(f, label) if make is _flat_in_one_region else make(f)).numpy().astype(np.float16))
    return path


def _centroids(root: Path, out: Path, *extra: str) -> int:
    return main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(out), "--no-progress", *extra])


def _debias(root: Path, V: Path, out: Path, *extra: str) -> int:
    return main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
                 str(V), "--refine", "threshold", "--out", str(out), "--no-progress", *extra])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_centroids_refuses_or_skips_a_degenerate_map_by_name(world, tmp_path, capsys, kind):
    root, w = world
    make, says = DEGENERATE[kind]
    stem = w.stems[2]
    bad = _copy(root, tmp_path / "bad", stem, make)
    assert _centroids(tmp_path / "bad", tmp_path / "V.pt") == 2
    line = _one_line(capsys)
    assert line.startswith("mars centroids: error: ") and f"{bad}: {says}" in line, line
    assert not (tmp_path / "V.pt").exists()
    assert _centroids(tmp_path / "bad", tmp_path / "V.pt", "--on-error", "skip") == 1
    err = capsys.readouterr().err
    assert f"{bad}: {says}" in err
    assert DebiasedCentroids.load(tmp_path / "V.pt").num_images == len(w.stems) - 1


@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_debias_refuses_or_skips_a_degenerate_map_by_name(world, tmp_path, capsys, kind):
    root, w = world
    make, says = DEGENERATE[kind]
    assert _centroids(root, tmp_path / "V.pt") == 0
    stem = w.stems[3]
    bad = _copy(root, tmp_path / "bad", stem, make)
    capsys.readouterr()
    assert _debias(tmp_path / "bad", tmp_path / "V.pt", tmp_path / "stop") == 2
    line = _one_line(capsys)
    assert line.startswith("mars debias: error: ") and f"{bad}: {says}" in line, line
    assert _debias(tmp_path / "bad", tmp_path / "V.pt", tmp_path / "skip", "--on-error", "skip") == 1
    assert f"{bad}: {says}" in capsys.readouterr().err
    assert sorted(p.stem for p in (tmp_path / "skip").glob("*.png")) == [s for s in w.stems if s != stem]


def test_a_map_flat_in_one_class_region_goes_through(world, tmp_path):
    root, w = world
    _copy(root, tmp_path / "flat", w.stems[1], _flat_in_one_region)
    assert _centroids(tmp_path / "flat", tmp_path / "V.pt") == 0
    assert _debias(tmp_path / "flat", tmp_path / "V.pt", tmp_path / "db") == 0
    assert len(list((tmp_path / "db").glob("*.png"))) == len(w.stems)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("degenerate_tree"), n=6, size=32)


@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_reproduce_refuses_or_skips_a_degenerate_map_by_name(tree, tmp_path, capsys, kind):
    world, root, pseudo, feats = tree
    make, says = DEGENERATE[kind]
    stem = world.stems[1]
    mine = tmp_path / "features"
    mine.mkdir()
    for p in feats.iterdir():
        (mine / p.name).symlink_to(p)
    bad = mine / f"{stem}.pt"
    bad.unlink()
    torch.save(make(torch.load(feats / f"{stem}.pt", weights_only=True).float()).half(), bad)
    argv = ["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(pseudo), "--features", str(mine),
            "--refine", "threshold", "--no-references", "--no-progress", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path / "stop")]) == 2
    line = _one_line(capsys)
    assert line.startswith("mars reproduce: error: ") and f"{bad}: {says}" in line, line
    assert main([*argv, "--out", str(tmp_path / "skip"), "--on-error", "skip"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: {says}" in err
    assert stem not in {p.stem for p in (tmp_path / "skip" / "debiased").glob("*.png")}
    assert json.loads((tmp_path / "skip" / "reproduce.json").read_text())  # the run finished
