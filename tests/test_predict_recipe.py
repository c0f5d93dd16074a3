"""mars predict follows the checkpoint's recipe: the dhr recipe predicts with the EMA teacher
and gives the CRF upstream's denormalised bytes (DHR produce_wss_masks.py:59); flags given win;
a checkpoint without a recipe predicts as before recipes (student, the file's bytes)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mars_plugin.formats.files import write_image
from mars_plugin.networks import inference
from mars_plugin.networks.deeplab import build_model, normalize
from mars_plugin.networks.inference import denormalized_bytes
from mars_plugin.networks.recipes import get_recipe
from mars_plugin.networks.seg_checkpoint import save_checkpoint


def _net(label: int):
    """A tiny deeplabv3+dhr whose 1x1 classifier votes for ``label`` everywhere."""
    torch.manual_seed(0)
    net = build_model("deeplabv3+dhr", "resnet18", 2).eval()
    with torch.no_grad():
        w = net.seg_decoder.classifier.weight
        w.zero_()
        w[label] = 1.0  # the ReLU'd decoder features are >= 0 and not all 0
    return net


def _checkpoint(path: Path, recipe=None, settings=None) -> Path:
    student, teacher = _net(0), _net(1)  # they differ: background vs class 1
    ck = {"model": student.config, "iteration": 1, "student": student.state_dict(),
          "teacher": teacher.state_dict(), "settings": settings or {}}
    if recipe is not None:
        ck["recipe"] = recipe
    save_checkpoint(path, ck)
    return path


def _images(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    d = tmp_path / "im"
    d.mkdir()
    write_image(d / "a.png", rng.integers(0, 256, size=(24, 32, 3), dtype=np.uint8))
    return d


def _run(argv, monkeypatch):
    from mars_plugin.cli import main

    seen = []
    real = inference.dense_crf

    def spy(probs, images, *a, **k):
        seen.append(images.clone().cpu())
        return real(probs, images, *a, **k)

    monkeypatch.setattr(inference, "dense_crf", spy)
    assert main(argv + ["--no-progress"]) == 0
    return seen


def _label(out: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(out / "a.png") as im:
        return np.asarray(im)


def _record(out: Path) -> dict:
    return json.loads((out / ".mars-run.json").read_text())["settings"]


def test_dhr_checkpoint_predicts_with_the_teacher_and_upstream_crf_bytes(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "ck.pt", recipe="dhr")
    images = _images(tmp_path)
    seen = _run(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out")],
                monkeypatch)
    assert (_label(tmp_path / "out") == 1).all()  # the teacher's class, not the student's background
    from mars_plugin.formats.files import read_image

    rgb = torch.from_numpy(read_image(images / "a.png"))[None]
    want = denormalized_bytes(normalize(rgb))
    assert torch.equal(seen[0], want) and not torch.equal(seen[0], rgb)
    rec = _record(tmp_path / "out")
    r = get_recipe("dhr")
    assert rec["model"]["which"] == "teacher" and rec["model"]["recipe"] == "dhr"
    assert rec["crf_image"] == "denormalized"
    assert tuple(rec["scales"]) == tuple(r.test_scales) and rec["flip"] is r.test_flip
    assert rec["class_threshold"] == r.class_threshold and rec["crf"] == r.crf and rec["fuse_at"] == "logits"


def test_flags_win_over_the_recipe(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "ck.pt", recipe="dhr")
    images = _images(tmp_path)
    seen = _run(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out"),
                 "--which", "student", "--crf-image", "file", "--scales", "1", "--no-flip",
                 "--class-threshold", "0.2"], monkeypatch)
    assert (_label(tmp_path / "out") == 0).all()
    from mars_plugin.formats.files import read_image

    assert torch.equal(seen[0], torch.from_numpy(read_image(images / "a.png"))[None])
    rec = _record(tmp_path / "out")
    assert rec["model"]["which"] == "student" and "crf_image" not in rec
    assert rec["scales"] == [1.0] and rec["flip"] is False and rec["class_threshold"] == 0.2


def test_the_runs_resolved_settings_beat_the_recipe_table(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "ck.pt", recipe="dhr", settings={"predict_weights": "student", "test_flip": False})
    images = _images(tmp_path)
    _run(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out")], monkeypatch)
    assert (_label(tmp_path / "out") == 0).all()
    assert _record(tmp_path / "out")["flip"] is False


def test_checkpoint_without_recipe_predicts_as_before(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "ck.pt")
    images = _images(tmp_path)
    seen = _run(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out"),
                 "--scales", "1"], monkeypatch)
    assert (_label(tmp_path / "out") == 0).all()  # the student
    from mars_plugin.formats.files import read_image

    assert torch.equal(seen[0], torch.from_numpy(read_image(images / "a.png"))[None])
    rec = _record(tmp_path / "out")
    assert rec["model"]["which"] == "student" and "recipe" not in rec["model"] and "crf_image" not in rec
    assert rec["flip"] is True and rec["class_threshold"] == 0.05 and rec["crf"] == "mars"


def test_unknown_recipe_is_one_line_naming_the_model(tmp_path, capsys):
    from mars_plugin.cli import main

    ck = _checkpoint(tmp_path / "ck.pt", recipe="nope")
    images = _images(tmp_path)
    code = main(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--model" in err and "'nope'" in err and "recipe must be one of" in err, err
