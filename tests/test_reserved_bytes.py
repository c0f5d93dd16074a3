"""Issue 22, class 2: class counts that collide with the reserved bytes.

Labels are bytes 0..C with 254 = biased and 255 = ignore, so C <= 253. Every entry point that
takes C (``num_classes``, a class-name list, a dataset json, or a tensor whose size says C)
must refuse C = 254, 255 or 1000 with that reason, and accept C = 253. One family:
{entry point} x {253, 254, 255, 1000}, through the Python API and through ``mars``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import (
    DebiasedCentroids,
    WCELoss,
    complement_labels,
    debias_labels,
    debiased_similarity,
    image_centroids,
    select_centroids,
)
from mars_plugin.commands import centroids, evaluate, label_formats, report
from mars_plugin.adapters.wsss import dhr, irnet
from mars_plugin.cli import main
from mars_plugin.method.debias import mark_biased
from mars_plugin.commands.metrics import confusion_matrix, format_scores_table, segmentation_scores
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

REASON = "labels are 0..C with 254 = biased and 255 = ignore, so C <= 253"
COUNTS = (253, 254, 255, 1000)

D = 4
G = torch.Generator().manual_seed(0)
F = torch.randn(D, 4, 4, generator=G)
Y = torch.tensor([[0, 0, 1, 1], [0, 2, 1, 1], [0, 2, 2, 1], [0, 0, 2, 255]])


def _centroids(C: int) -> torch.Tensor:
    V = torch.randn(C + 1, D, generator=torch.Generator().manual_seed(C))
    V[0] = 0
    return V


def _names(C: int):
    return ["background"] + [f"class {c}" for c in range(1, C + 1)]


def _probs(C: int) -> torch.Tensor:
    return torch.randn(C + 1, 4, 4, generator=torch.Generator().manual_seed(1)).softmax(0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("reserved")
    w = make_world(4, size=24, dim=16, seed=3)
    write_world(w, root)
    return root, w


def _save_load(C, tmp, world=None):
    V = select_centroids([(F, Y)], 2)
    n = C + 1
    V = DebiasedCentroids(torch.zeros(n, D), torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long),
                          torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.float64), V.background_mean,
                          1, dict(V.config))
    V.save(tmp / "V.pt")
    return DebiasedCentroids.load(tmp / "V.pt")


def _dhr_json(C, tmp, world=None):
    layout = dhr.DHRLayout(tmp / "root", "SET")
    layout.dataset_json.parent.mkdir(parents=True)
    layout.dataset_json.write_text(json.dumps({"names": _names(C), "ignore": 255}))
    return layout.class_names()


# entry point -> call(C, tmp_path, world); C reaches the entry point in the form it takes.
PYTHON = {
    "select_centroids(num_classes)": lambda C, tmp, w: select_centroids([(F, Y)], C),
    "image_centroids(label id C)": lambda C, tmp, w: image_centroids(
        F, Y.masked_fill(Y == 255, -1).masked_fill(Y == 2, C), ignore_index=-1),
    "debias_labels(centroids C+1 rows)": lambda C, tmp, w: debias_labels(F, Y, _centroids(C), [1, 2],
                                                                         refine="threshold"),
    "debiased_similarity(centroids)": lambda C, tmp, w: debiased_similarity(F, _centroids(C), [1]),
    "mark_biased(centroids)": lambda C, tmp, w: mark_biased(Y, torch.ones(4, 4, dtype=torch.bool), _centroids(C)),
    "complement_labels(teacher C+1 channels)": lambda C, tmp, w: complement_labels(Y.masked_fill(Y == 1, -1),
                                                                                  _probs(C), [1, 2]),
    "WCELoss(logits C+1 channels)": lambda C, tmp, w: WCELoss()(torch.randn(1, C + 1, 4, 4), Y[None]),
    "confusion_matrix(num_classes)": lambda C, tmp, w: confusion_matrix(Y, Y, C),
    "segmentation_scores(cm C+1 rows)": lambda C, tmp, w: segmentation_scores(np.eye(C + 1, C + 2)),
    "format_scores_table(C+1 names)": lambda C, tmp, w: format_scores_table(
        _names(C), {"": segmentation_scores(np.eye(C + 1))}),
    "DebiasedCentroids.load(file of C+1 rows)": _save_load,
    "label_formats.read_image_labels(num_classes)": lambda C, tmp, w: label_formats.read_image_labels(None, C),
    "centroids.centroids_job(num_classes)": lambda C, tmp, w: centroids.centroids_job(
        w[0] / "features", w[0] / "labels", C, tmp / "V.pt", progress=False),
    "evaluate.evaluate_job(num_classes)": lambda C, tmp, w: evaluate.evaluate_job(
        w[0] / "labels", w[0] / "gt", C, progress=False),
    "report.report_job(class_names)": lambda C, tmp, w: report.report_job(
        w[0] / "labels", w[0] / "labels", w[0] / "images", tmp / "rep", class_names=_names(C), progress=False),
    "DHRLayout.class_names(dataset json)": _dhr_json,
    "dhr.write_masks(num_classes)": lambda C, tmp, w: dhr.write_masks([("a", Y)], tmp / "wss", num_classes=C,
                                                                        dry_run=True),
    "irnet.parse_cam_dict(num_classes)": lambda C, tmp, w: irnet.parse_cam_dict(
        {"keys": np.array([0]), "cam": np.ones((1, 2, 2), np.float32)}, num_classes=C),
}


@pytest.mark.parametrize("C", COUNTS)
@pytest.mark.parametrize("entry", sorted(PYTHON))
def test_python_entry_points_refuse_a_class_count_that_reaches_254(entry, C, tmp_path, world):
    call = PYTHON[entry]
    if C <= 253:
        call(C, tmp_path, world)  # the largest C is fine
        return
    with pytest.raises(ValueError) as e:
        call(C, tmp_path, world)
    msg = str(e.value)
    assert REASON in msg, msg
    assert str(C) in msg or str(C + 1) in msg, msg  # the count (or the size that implies it) is named
    assert not (tmp_path / "V.pt").exists() or entry.startswith("DebiasedCentroids")
    assert not (tmp_path / "rep").exists()


# ---------------------------------------------------------------------------- the command line


def _names_file(tmp: Path, C: int) -> str:
    p = tmp / f"names{C}.json"
    p.write_text(json.dumps(_names(C)))
    return str(p)


def _tree(tmp: Path, C: int):
    """A DHR tree whose dataset json names C classes (the synthetic world's 6 first)."""
    from test_reproduce import DATA, make_tree

    w, root, pseudo, feats = make_tree(tmp, n=4, size=24)
    names = list(w.class_names) + [f"extra {k}" for k in range(C + 1 - len(w.class_names))]
    (root / DATA / f"{DATA}.json").write_text(json.dumps({"names": names, "ignore": 255}))
    return root, pseudo, feats, DATA


# command -> argv(C, tmp, world root); the output that must not appear on a refusal.
CLI = {
    "centroids --num-classes": lambda C, t, r: (["centroids", "--features", str(r / "features"), "--labels",
                                                 str(r / "labels"), "--num-classes", str(C), "--out", str(t / "o.pt")],
                                                t / "o.pt"),
    "evaluate --num-classes": lambda C, t, r: (["evaluate", "--pred", str(r / "labels"), "--gt", str(r / "gt"),
                                                "--num-classes", str(C), "--json", str(t / "o.json")], t / "o.json"),
    "evaluate --class-names": lambda C, t, r: (["evaluate", "--pred", str(r / "labels"), "--gt", str(r / "gt"),
                                                "--num-classes", "6", "--class-names", _names_file(t, C), "--json",
                                                str(t / "o.json")], t / "o.json"),
    "centroids --class-names": lambda C, t, r: (["centroids", "--features", str(r / "features"), "--labels",
                                                 str(r / "labels"), "--num-classes", "6", "--out", str(t / "o.pt"),
                                                 "--class-names", _names_file(t, C)], t / "o.pt"),
    "debias --class-names": lambda C, t, r: (["debias", "--features", str(r / "features"), "--labels",
                                              str(r / "labels"), "--centroids", str(r / "V.pt"), "--out",
                                              str(t / "db"), "--refine", "threshold", "--class-names",
                                              _names_file(t, C)], t / "db"),
    "report --class-names": lambda C, t, r: (["report", "--labels", str(r / "labels"), "--debiased",
                                              str(r / "labels"), "--images", str(r / "images"), "--out",
                                              str(t / "rep"), "--class-names", _names_file(t, C)], t / "rep"),
}


@pytest.fixture(scope="module")
def cli_world(world):
    root, _ = world
    if not (root / "V.pt").exists():
        assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                     "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root


@pytest.mark.parametrize("C", COUNTS)
@pytest.mark.parametrize("command", sorted(CLI))
def test_commands_refuse_a_class_count_that_reaches_254(command, C, tmp_path, cli_world, capsys):
    argv, output = CLI[command](C, tmp_path, cli_world)
    try:
        rc = main([*argv, "--no-progress"])
    except SystemExit as e:  # argparse: a bad flag value
        rc = e.code
    err = capsys.readouterr().err
    if C <= 253:
        assert rc == 0, err
        return
    assert rc == 2
    lines = [line for line in err.splitlines() if ": error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert REASON in lines[0] and str(C) in lines[0], lines[0]
    assert ("--num-classes" in lines[0]) if "--num-classes" in command else ("--class-names" in lines[0])
    assert not output.exists()


@pytest.mark.parametrize("C", COUNTS)
def test_reproduce_refuses_a_dataset_json_of_more_than_253_classes(C, tmp_path, capsys):
    root, pseudo, feats, data = _tree(tmp_path, C)
    out = tmp_path / "out"
    rc = main(["reproduce", "--root", str(root), "--pseudo", str(pseudo), "--features", str(feats), "--data", data,
               "--out", str(out), "--dry-run", "--no-progress"])
    err = capsys.readouterr().err
    if C <= 253:
        assert rc == 0, err
        return
    assert rc == 2, err
    assert REASON in err and f"{data}.json" in err and str(C) in err, err
    assert not out.exists()
