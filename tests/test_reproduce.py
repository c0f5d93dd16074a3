"""``mars reproduce`` end to end on a tiny tree in DHR's layout, made here.

Two kinds of features: the synthetic world's own USS-like embeddings given with ``--features``
(so that debiasing has something real to find: boat and train leak into sea and rail), and a
tiny random-weight STEGO in DHR's file format (backbone file + heads file) with DHR's
multi-scale inference, to run the features stage itself.
"""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.files import read_features, read_label, write_image, write_label
from mars_plugin.commands.evaluate import evaluate_job
from mars_plugin.commands.reproduce import PAPER_VOC_TRAIN, PAPER_VOC_VAL_IOU, format_report, reproduce
from mars_plugin.worlds.synthetic_scenes import make_world

DATA = "SYN"


def _write_xml(path: Path, names) -> None:
    root = ET.Element("annotation")
    for n in names:
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = n
        box = ET.SubElement(obj, "bndbox")
        for k, v in (("xmin", 1), ("ymin", 1), ("xmax", 20), ("ymax", 20)):
            ET.SubElement(box, k).text = str(v)
    ET.ElementTree(root).write(path)


def make_tree(tmp: Path, n: int = 24, size: int = 64, seed: int = 0):
    """<tmp>/root/SYN/train_aug/{image,mask,xml}, SYN.json, pseudo labels and .pt features."""
    world = make_world(n, size=size, seed=seed, erode_rate=0.1, dilate_rate=0.5)
    root = tmp / "root"
    dom = root / DATA / "train_aug"
    for sub in ("image", "mask", "xml"):
        (dom / sub).mkdir(parents=True)
    (root / DATA / f"{DATA}.json").write_text(json.dumps({"names": list(world.class_names), "ignore": 255}))
    pseudo, feats = tmp / "pseudo", tmp / "features"
    pseudo.mkdir()
    feats.mkdir()
    for i, stem in enumerate(world.stems):
        write_image(dom / "image" / f"{stem}.jpg", world.images[i].numpy())
        write_label(dom / "mask" / f"{stem}.png", world.gt[i])
        _write_xml(dom / "xml" / f"{stem}.xml", [world.class_names[c] for c in world.class_ids(i)])
        write_label(pseudo / f"{stem}.png", world.pseudo[i])
        torch.save(world.features[i].half().clone(), feats / f"{stem}.pt")  # DHR's file form
    return world, root, pseudo, feats


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("reproduce"))


def _run(root, pseudo, out, **kw):
    logs = []
    res = reproduce(root, pseudo, out, data=DATA, progress=False, log=logs.append, **kw)
    return res, logs


@pytest.mark.slow
def test_features_given_runs_every_stage_and_scores_match_evaluate(tree, tmp_path):
    world, root, pseudo, feats = tree
    out = tmp_path / "out"
    res, logs = _run(root, pseudo, out, features_dir=feats)
    for name in ("centroids.pt", "scores.json", "report.md", "reproduce.json", "image_labels.json",
                 "report/report.json", "report/biased_share.png"):
        assert (out / name).is_file(), name
    assert len(list((out / "debiased").glob("*.png"))) == world.num_images
    # The scores are those of `mars evaluate` on the same folders.
    mask = root / DATA / "train_aug" / "mask"
    for key, pred in (("pseudo", pseudo), ("debiased", out / "debiased")):
        ref, _ = evaluate_job(pred, mask, world.num_classes, progress=False)
        assert res[key]["iou"] == pytest.approx(ref["iou"], nan_ok=True)
        assert res[key]["confusion"] == ref["confusion"]
    # The world's biased classes (boat 1, train 2) leak into their context: MARS must lower their FP.
    for c in world.problematic:
        assert res["debiased"]["fp"][c] < res["pseudo"]["fp"][c] - 0.05, world.class_names[c]
    assert res["debiased"]["miou"] > res["pseudo"]["miou"]
    # The tags JSON is DHR's reading of the xml files: the image's classes.
    tags = json.loads((out / "image_labels.json").read_text())
    assert tags == {s: world.class_ids(i) for i, s in enumerate(world.stems)}
    text = (out / "report.md").read_text()
    # The title names the dataset, split and tree; the run record stays in reproduce.json, not in the text.
    assert text.splitlines()[0] == f"# MARS reproduction report: {DATA} train_aug (DHR tree at `{root.resolve()}`)"
    assert "'settings'" not in text and "reproduce.json" in text
    assert "boat" in text and "Table 6" in text and "not shown" in text  # 7 classes: no VOC per-class columns
    pictures = [line[line.index("](") + 2:-1] for line in text.splitlines() if line.startswith("![")]
    assert pictures and all((out / p).is_file() for p in pictures)
    # report.html (issue 43): linked from report.md, with the ground truth and the centroid ranking
    assert "(report/report.html)" in text and (out / "report" / "report.html").is_file()
    data = (out / "report" / "report_data.js").read_text()
    assert '"has_gt":true' in data and '"distances":[' in data
    assert len(list((out / "report" / "thumbs").rglob("*_gt.png"))) == world.num_images
    assert res["summary"].failed == []


@pytest.mark.slow
def test_resume_keeps_finished_stages_and_refuses_other_settings(tree, tmp_path):
    world, root, pseudo, feats = tree
    out = tmp_path / "out"
    _run(root, pseudo, out, features_dir=feats)
    first = {p.name: p.read_bytes() for p in (out / "debiased").glob("*.png")}
    # An interrupted debias: two outputs gone and the stage not recorded as finished.
    state = json.loads((out / "reproduce.json").read_text())
    del state["stages"]["debias"], state["stages"]["evaluate"]
    (out / "reproduce.json").write_text(json.dumps(state))
    gone = sorted(first)[:2]
    for name in gone:
        (out / "debiased" / name).unlink()
    res, logs = _run(root, pseudo, out, features_dir=feats)
    assert "[centroids] done before, kept" in logs
    assert any("debias: 2 done" in line and f"{world.num_images - 2} already done" in line for line in logs), logs
    assert {p.name: p.read_bytes() for p in (out / "debiased").glob("*.png")} == first
    with pytest.raises(ValueError, match="other settings.*alpha"):
        _run(root, pseudo, out, features_dir=feats, alpha=0.5)


def _tiny_stego_files(tmp: Path, width: int = 192, dim: int = 5, patch: int = 8):
    """A DINO-format backbone file (flat state dict) and a DHR heads file, random weights."""
    from mars_plugin.adapters.uss.vit import DinoViT

    torch.manual_seed(0)
    vit = DinoViT(patch_size=patch, embed_dim=width, depth=1, num_patches=16)
    for p in vit.parameters():
        torch.nn.init.normal_(p, std=0.2)
    heads = {
        "cluster1": torch.nn.Sequential(torch.nn.Conv2d(width, dim, 1)).state_dict(),
        "cluster2": torch.nn.Sequential(torch.nn.Conv2d(width, width, 1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(width, dim, 1)).state_dict(),
    }
    b, h = tmp / "dino_tiny.pth", tmp / f"STEGO_{DATA}.pt"
    torch.save(vit.state_dict(), b)
    torch.save(heads, h)
    return b, h


@pytest.mark.slow
def test_features_stage_from_dhr_files_through_the_cli(tree, tmp_path, capsys):
    world, root, pseudo, _ = tree
    b, h = _tiny_stego_files(tmp_path)
    out = tmp_path / "out"
    argv = ["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(pseudo), "--out", str(out),
            "--uss-backbone", str(b), "--uss-heads", str(h), "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "mIoU of the labels: pseudo" in printed
    feats = sorted((out / "features").glob("*.pt"))
    assert [p.stem for p in feats] == world.stems
    # DHR's multi-scale grid: the first scale (2x) of a 64-pixel side on patch 8 is 16 cells.
    f = read_features(feats[0])
    assert f.shape == (5, 16, 16)
    raw = torch.load(feats[0], weights_only=True)
    assert raw.dtype == torch.float16
    # A second run finds everything done.
    assert cli.main(argv) == 0
    state = json.loads((out / "reproduce.json").read_text())
    assert state["settings"]["scales"] == [2.0, 1.0, 1.5, 0.5]
    # Another heads file is another run.
    torch.save({k: {n: t + 1 for n, t in v.items()} for k, v in torch.load(h, weights_only=True).items()}, h)
    assert cli.main(argv) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize("argv_extra, message", [
    ([], "give the USS model files"),
    (["--uss-backbone", "b.pth"], "--backbone b.pth: no such file"),
    (["--features", "nowhere"], "--features nowhere: not a folder"),
    (["--features", ".", "--checkpoint", "x.ckpt"], "not both"),
    (["--uss", "cause", "--checkpoint", "{real}"], "--uss cause reads"),
    (["--uss", "stego", "--backbone", "{real}"], "--backbone and --heads go together"),
    (["--uss", "stego", "--checkpoint", "{real}", "--heads", "{real}"], "either --checkpoint FILE or --backbone"),
])
def test_bad_flags_are_named(tree, tmp_path, capsys, argv_extra, message):
    _, root, pseudo, _ = tree
    real = tmp_path / "real.pth"  # exists: the flag combination, not the file, is what is wrong
    real.write_bytes(b"x")
    argv = ["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(pseudo), "--out", str(tmp_path / "o"),
            "--no-progress"] + [a.replace("{real}", str(real)) for a in argv_extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "centroids.pt").exists()  # refused before any work


def test_missing_tree_is_named(tmp_path, capsys):
    (tmp_path / "p").mkdir()
    argv = ["reproduce", "--root", str(tmp_path), "--pseudo", str(tmp_path / "p"), "--out", str(tmp_path / "o"),
            "--features", str(tmp_path / "p"), "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "VOC2012/train_aug" in err and "is not a folder" in err


@pytest.mark.slow
def test_skip_names_a_bad_pseudo_label_and_exits_1(tree, tmp_path, capsys):
    world, root, pseudo, feats = tree
    bad = tmp_path / "pseudo"
    bad.mkdir()
    for p in pseudo.glob("*.png"):
        (bad / p.name).write_bytes(p.read_bytes())
    broken = world.stems[3]
    (bad / f"{broken}.png").write_bytes(b"not a png")
    argv = ["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(bad), "--out", str(tmp_path / "o"),
            "--features", str(feats), "--on-error", "skip", "--no-progress"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert broken in err
    text = (tmp_path / "o" / "report.md").read_text()
    assert broken in text.split("## Skipped files")[1]


def test_paper_figures_are_consistent():
    # Each per-class row's mean is the mIoU the paper prints beside it (catches a typo in a copy).
    for name, row in PAPER_VOC_VAL_IOU.items():
        assert len(row) == 22, name
        assert round(sum(row[:21]) / 21, 1) == row[21], name
    assert PAPER_VOC_VAL_IOU["MARS"][4] - PAPER_VOC_VAL_IOU["RS+EPM"][4] == pytest.approx(9.1)  # boat, Sec. C
    assert PAPER_VOC_VAL_IOU["MARS"][19] - PAPER_VOC_VAL_IOU["RS+EPM"][19] == pytest.approx(29.1)  # train
    for m, fp, fn in PAPER_VOC_TRAIN.values():
        assert 0 < fp < 1 and 0 < fn < 1 and 50 < m < 100


def test_report_shows_paper_columns_for_voc():
    from mars_plugin.adapters.wsss._common import VOC_CLASSES

    rng = np.random.default_rng(0)

    def scores():
        iou = rng.uniform(0.3, 0.9, 21)
        fp = rng.uniform(0, 1 - iou)
        return {"iou": iou.tolist(), "fp": fp.tolist(), "fn": (1 - iou - fp).tolist(), "present": [True] * 21,
                "miou": float(iou.mean()), "num_images": 5}

    p, d = scores(), scores()
    removal = {"classes": {VOC_CLASSES[c]: {"share_removed": 0.1 * (c % 3)} for c in range(1, 21)}}
    info = {"root": "r", "data": "VOC2012", "domain": "train_aug", "pseudo": "p", "features": "f", "method": "m",
            "times": {"features": 1.0}}
    text = format_report(VOC_CLASSES, p, d, removal, info)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    boat = next(r for r in rows if r.startswith("| boat |")).split(" | ")
    assert boat[1] == f"{100 * p['iou'][4]:.1f}" and boat[4] == f"{100 * d['iou'][4]:.1f}"
    assert boat[7] == f"{100 * (d['iou'][4] - p['iou'][4]):+.1f}"
    assert boat[9] == "63.8" and boat[10].rstrip(" |") == "72.9"
    mean = next(r for r in rows if r.startswith("| **mean**")).split(" | ")
    assert mean[1] == f"{100 * p['miou']:.1f}" and mean[-1].rstrip(" |") == "77.7"
    assert math.isclose(float(mean[2]), np.mean(p["fp"]), abs_tol=5e-4)
    assert "77.4 | 0.123 | 0.108" in text and "81.8 | 0.099 | 0.090" in text


def test_evaluate_job_on_chosen_stems_equals_a_folder_of_those(tree, tmp_path):
    world, root, pseudo, _ = tree
    mask = root / DATA / "train_aug" / "mask"
    chosen = world.stems[::3]
    sub = tmp_path / "gt"
    sub.mkdir()
    for s in chosen:
        (sub / f"{s}.png").write_bytes((mask / f"{s}.png").read_bytes())
    got, _ = evaluate_job(pseudo, mask, world.num_classes, progress=False, stems=chosen)
    ref, _ = evaluate_job(pseudo, sub, world.num_classes, progress=False)
    assert got["confusion"] == ref["confusion"] and got["num_images"] == len(chosen)
    with pytest.raises(ValueError, match="not a plain file name"):
        evaluate_job(pseudo, mask, world.num_classes, progress=False, stems=["../x"])
    with pytest.raises(ValueError, match="stems is empty"):
        evaluate_job(pseudo, mask, world.num_classes, progress=False, stems=[])
