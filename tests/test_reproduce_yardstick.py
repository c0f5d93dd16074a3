"""``mars reproduce`` on files anyone can download: the USS flags of ``mars features`` (a STEGO
Lightning checkpoint, DHR's CAUSE files), the yardstick (other methods' masks under
``<root>/WSS/<data>/``), COCO 2014's 81 classes, and ``--dry-run``.

Every tree is generated here; the reference scores and the agreement are checked against plain
numpy computations written from their definitions.
"""
from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.files import read_label, write_image, write_label
from mars_plugin.commands.references import find_references, score_references
from mars_plugin.commands.reproduce_report import PAPER_COCO_CLASSES, PAPER_COCO_VAL_IOU, paper_columns

from test_reproduce import DATA, make_tree

# -- the independent computations ----------------------------------------------------------------


def ref_miou(preds, gts, C):
    """SEAM's IoU over the set, written out: a prediction of 255 counts for T, never for P."""
    T, P, TP = np.zeros(C + 1), np.zeros(C + 1), np.zeros(C + 1)
    for p, g in zip(preds, gts):
        valid = g != 255
        for c in range(C + 1):
            T[c] += np.sum((g == c) & valid)
            P[c] += np.sum((p == c) & valid)
            TP[c] += np.sum((p == c) & (g == c) & valid)
    union = T + P - TP
    iou = np.where(union > 0, TP / np.maximum(union, 1), np.nan)
    return float(np.nanmean(iou)), iou


def ref_agreement(ours_list, theirs_list, gts, C):
    same = total = 0
    inter, union = np.zeros(C + 1), np.zeros(C + 1)
    for o, t, g in zip(ours_list, theirs_list, gts):
        valid = (g != 255) & (o != 255) & (t != 255)
        total += valid.sum()
        same += np.sum((o == t) & valid)  # 254 (biased) never equals a class
        for c in range(C + 1):
            inter[c] += np.sum((o == c) & (t == c) & valid)
            union[c] += np.sum(((o == c) | (t == c)) & valid)
    return same / total, np.where(union > 0, inter / np.maximum(union, 1), np.nan)


def _np(path):
    return read_label(path, biased_value=None).numpy()


# -- trees -----------------------------------------------------------------------------------------


def _noisy(label: torch.Tensor, C: int, rate: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = label.clone()
    flip = torch.rand(label.shape, generator=g) < rate
    out[flip] = torch.randint(0, C + 1, label.shape, generator=g)[flip]
    out[torch.rand(label.shape, generator=g) < 0.02] = 255
    return out


@pytest.fixture(scope="module")
def wss_tree(tmp_path_factory):
    """The synthetic DHR tree plus WSS/SYN/{RSEPM,MARS,DHR,pseudo}/train_aug: RSEPM = the pseudo
    labels (given as --pseudo), MARS and DHR = the ground truth with noise, 'pseudo' = the ground
    truth itself (a folder whose name is a key of scores.json)."""
    tmp = tmp_path_factory.mktemp("yardstick")
    world, root, pseudo, feats = make_tree(tmp, n=16)
    wss = root / "WSS" / DATA
    rsepm = wss / "RSEPM" / "train_aug"
    shutil.copytree(pseudo, rsepm)
    for k, (name, rate) in enumerate((("MARS", 0.05), ("DHR", 0.2), ("pseudo", 0.0))):
        d = wss / name / "train_aug"
        d.mkdir(parents=True)
        for i, stem in enumerate(world.stems):
            lab = world.gt[i] if rate == 0 else _noisy(world.gt[i], world.num_classes, rate, seed=10 * k + i)
            write_label(d / f"{stem}.png", lab)
    (wss / "empty_method").mkdir()  # no train_aug/: not a reference for this domain
    return world, root, rsepm, feats


def _run_cli(root, pseudo, out, *extra):
    return cli.main(["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(pseudo), "--out", str(out),
                     "--no-progress", "--threads", "1", *map(str, extra)])


@pytest.mark.slow
def test_references_are_scored_like_ours_and_agreement_matches_numpy(wss_tree, tmp_path, capsys):
    world, root, rsepm, feats = wss_tree
    out = tmp_path / "out"
    assert _run_cli(root, rsepm, out, "--features", feats) == 0
    printed = capsys.readouterr().out
    scores = json.loads((out / "scores.json").read_text())
    # RSEPM is the --pseudo folder, empty_method has no train_aug: neither is a reference.
    assert sorted(scores["references"]) == ["DHR", "MARS", "pseudo"]
    assert "RSEPM" not in scores and "empty_method" not in scores
    # A folder named like a key of scores.json gets its own key; ours stay where they were.
    assert scores["pseudo (reference)"]["miou"] == pytest.approx(1.0)
    assert scores["pseudo"]["miou"] < 0.99
    stems = world.stems
    gts = [_np(root / DATA / "train_aug" / "mask" / f"{s}.png") for s in stems]
    ours = [_np(out / "debiased" / f"{s}.png") for s in stems]
    assert any((o == 254).any() for o in ours)  # the agreement's 254 rule is exercised
    C = world.num_classes
    for name in ("MARS", "DHR"):
        theirs = [_np(root / "WSS" / DATA / name / "train_aug" / f"{s}.png") for s in stems]
        miou, iou = ref_miou(theirs, gts, C)
        s = scores[name]
        assert set(s) >= {"miou", "iou", "fp", "fn", "present", "confusion", "num_images"}
        assert set(s) == set(scores["pseudo"])  # the schema of "pseudo"
        assert s["miou"] == pytest.approx(miou, abs=1e-12)
        np.testing.assert_allclose(s["iou"], iou, atol=1e-12)
        assert s["num_images"] == len(stems)
        pixel, agree_iou = ref_agreement(ours, theirs, gts, C)
        a = scores["agreement"][name]
        assert a["pixel"] == pytest.approx(pixel, abs=1e-12)
        np.testing.assert_allclose(a["iou"], agree_iou, atol=1e-12)
        assert f"reference {name}: mIoU {100 * miou:.1f}" in printed
    assert scores["MARS"]["miou"] > scores["DHR"]["miou"]  # less noise, higher score: the data are read right
    text = (out / "report.md").read_text()
    section = text.split("## Beside other methods' masks")[1].split("## Beside the paper's")[0]
    assert "`MARS`: the MARS authors' masks" in section and "*after* training" in section
    head = next(line for line in section.splitlines() if line.startswith("| class"))
    assert "MARS IoU" in head and "agree MARS" in head and "DHR IoU" in head
    boat = next(line for line in section.splitlines() if line.startswith("| boat |")).split(" | ")
    cols = head.split(" | ")
    assert boat[cols.index("MARS IoU")] == f"{100 * scores['MARS']['iou'][1]:.1f}"
    assert f"| measured: `MARS` masks (train_aug) | {100 * scores['MARS']['miou']:.1f} |" in text


@pytest.mark.parametrize("kind, message", [
    ("missing", "no mask for 1 of the 16 evaluated ids"),
    ("biased", "holds 254"),
    ("size", "a reference mask must have its image's size"),
    ("class", "holds 99"),
])
def test_a_bad_reference_stops_with_one_line_or_is_left_out_with_skip(wss_tree, tmp_path, capsys, kind, message):
    world, root, rsepm, feats = wss_tree
    tree = tmp_path / "root"
    shutil.copytree(root, tree)
    bad = tree / "WSS" / DATA / "BAD" / "train_aug"
    shutil.copytree(tree / "WSS" / DATA / "MARS" / "train_aug", bad)
    victim = bad / f"{world.stems[5]}.png"
    if kind == "missing":
        victim.unlink()
    else:
        lab = world.gt[5].clone()
        if kind == "biased":
            lab[0, 0] = 254
        elif kind == "class":
            lab[0, 0] = 99
        else:
            lab = lab[:-2]
        _write_raw(victim, lab)
    pseudo = tree / "WSS" / DATA / "RSEPM" / "train_aug"
    out = tmp_path / "stop"
    assert _run_cli(tree, pseudo, out, "--features", feats) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reference BAD" in err[0] and message in err[0], err
    assert not (out / "scores.json").exists()  # nothing half-written
    out = tmp_path / "skip"
    assert _run_cli(tree, pseudo, out, "--features", feats, "--on-error", "skip") == 1
    err = capsys.readouterr().err
    assert "reference BAD" in err and message in err
    scores = json.loads((out / "scores.json").read_text())
    assert "BAD" not in scores and "MARS" in scores
    assert "BAD" in (out / "report.md").read_text().split("References left out")[1]


def _write_raw(path: Path, lab: torch.Tensor) -> None:
    """An L-mode PNG of the values as they are (write_label refuses 254 in a label)."""
    from PIL import Image

    Image.fromarray(lab.numpy().astype(np.uint8), mode="L").save(path)


def test_find_references_skips_the_pseudo_folder_given_with_or_without_domain(wss_tree):
    _, root, rsepm, _ = wss_tree
    for given in (rsepm, rsepm.parent):
        refs, notes = find_references(root / "WSS" / DATA, "train_aug", given)
        assert "RSEPM" not in refs and any("the --pseudo folder" in n for n in notes)
        assert any("empty_method" in n and "no train_aug/" in n for n in notes)
    assert find_references(root / "WSS" / "NOPE", "train_aug", rsepm) == ({}, [])


def test_score_references_directly_equals_the_numpy_definition():
    rng = np.random.default_rng(3)
    tmp = Path(__import__("tempfile").mkdtemp())
    C, stems = 4, [f"i{k}" for k in range(5)]
    for sub in ("gt", "ours", "theirs"):
        (tmp / sub).mkdir()
    gts, ours, theirs = [], [], []
    for s in stems:
        g = rng.integers(0, C + 1, (9, 11))
        g[rng.random(g.shape) < 0.1] = 255
        o = np.where(rng.random(g.shape) < 0.3, rng.integers(0, C + 1, g.shape), g)
        o[rng.random(g.shape) < 0.1] = 254
        o[rng.random(g.shape) < 0.05] = 255
        t = np.where(rng.random(g.shape) < 0.3, rng.integers(0, C + 1, g.shape), g)
        t[rng.random(g.shape) < 0.05] = 255
        for sub, a in (("gt", g), ("ours", o), ("theirs", t)):
            _write_raw(tmp / sub / f"{s}.png", torch.from_numpy(a))
        gts.append(g), ours.append(o), theirs.append(t)
    sc, ag, left = score_references({"T": tmp / "theirs"}, tmp / "ours", tmp / "gt", stems, C, progress=False)
    assert left == []
    miou, iou = ref_miou(theirs, gts, C)
    assert sc["T"]["miou"] == pytest.approx(miou, abs=1e-12)
    pixel, a_iou = ref_agreement(ours, theirs, gts, C)
    assert ag["T"]["pixel"] == pytest.approx(pixel, abs=1e-12)
    np.testing.assert_allclose(ag["T"]["iou"], a_iou, atol=1e-12)


# -- the model flags of mars features --------------------------------------------------------------


@pytest.mark.slow
def test_stego_lightning_checkpoint_and_cause_files_run_the_features_stage(wss_tree, tmp_path, capsys):
    from test_cause import dhr_files
    from test_stego import FakeDictConfig, lightning_ckpt, stego_state_dict

    world, root, rsepm, _ = wss_tree
    tree = tmp_path / "root"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns("*"))  # empty, then a small copy
    small = world.stems[:6]
    for sub in ("image", "mask", "xml"):
        (tree / DATA / "train_aug" / sub).mkdir(parents=True)
        for p in (root / DATA / "train_aug" / sub).iterdir():
            if p.stem in small:
                shutil.copy(p, tree / DATA / "train_aug" / sub / p.name)
    shutil.copy(root / DATA / f"{DATA}.json", tree / DATA / f"{DATA}.json")
    # DHR's WSS folders: RSEPM (the pseudo labels) and the authors' MARS masks, for these ids.
    for method in ("RSEPM", "MARS"):
        (tree / "WSS" / DATA / method / "train_aug").mkdir(parents=True)
        for s in small:
            shutil.copy(root / "WSS" / DATA / method / "train_aug" / f"{s}.png",
                        tree / "WSS" / DATA / method / "train_aug" / f"{s}.png")
    pseudo = tree / "WSS" / DATA / "RSEPM" / "train_aug"
    ckpt = tmp_path / "cocostuff27_vit_small.ckpt"
    torch.save(lightning_ckpt(stego_state_dict(width=192, dim=6), {"cfg": FakeDictConfig(dim=6)}), ckpt)
    # A Lightning checkpoint is a pickle: refused without --trust-pickle, before any work.
    assert _run_cli(tree, pseudo, tmp_path / "s0", "--uss", "stego", "--checkpoint", ckpt) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    assert not (tmp_path / "s0" / "features").exists()
    out = tmp_path / "stego"
    assert _run_cli(tree, pseudo, out, "--uss", "stego", "--checkpoint", ckpt, "--trust-pickle") == 0
    assert sorted(p.stem for p in (out / "features").glob("*.pt")) == small
    assert torch.load(out / "features" / f"{small[0]}.pt", weights_only=True).shape[0] == 6
    settings = json.loads((out / "reproduce.json").read_text())["settings"]
    assert settings["uss"] == "stego" and settings["checkpoint"]["bytes"] == ckpt.stat().st_size
    assert settings["fp16"] is False
    assert "stego from `cocostuff27_vit_small.ckpt`" in (out / "report.md").read_text()

    def yardstick_is_there(out):
        scores = json.loads((out / "scores.json").read_text())
        assert list(scores["references"]) == ["MARS"] and 0 < scores["agreement"]["MARS"]["pixel"] <= 1
        assert scores["MARS"]["num_images"] == len(small)
        assert "| measured: `MARS` masks" in (out / "report.md").read_text()

    yardstick_is_there(out)
    b, h, *_ = dhr_files(tmp_path)
    out = tmp_path / "cause"
    assert _run_cli(tree, pseudo, out, "--uss", "cause", "--backbone", b, "--heads", h) == 0
    assert torch.load(out / "features" / f"{small[0]}.pt", weights_only=True).shape[0] == 90
    yardstick_is_there(out)
    # CAUSE's own release (a folder whose codebook lives in a sibling folder) gives the same features,
    # and its codebook is part of the run's identity.
    from test_cause import release_files

    b2, folder, _, _ = release_files(tmp_path / "rel")
    out2 = tmp_path / "cause_release"
    assert _run_cli(tree, pseudo, out2, "--uss", "cause", "--backbone", b2, "--heads", folder) == 0
    for s in small:
        assert torch.equal(torch.load(out2 / "features" / f"{s}.pt", weights_only=True),
                           torch.load(out / "features" / f"{s}.pt", weights_only=True))
    recorded = json.loads((out2 / "reproduce.json").read_text())["settings"]["heads_files"]
    assert any(r["path"].endswith("modularity/dinov2_vit_base_14/2048/modular.npy") for r in recorded)
    codebook = next(Path(r["path"]) for r in recorded if r["path"].endswith("modular.npy"))
    np.save(codebook, np.load(codebook) + 1)
    assert _run_cli(tree, pseudo, out2, "--uss", "cause", "--backbone", b2, "--heads", folder) == 2
    assert "other settings (heads_files" in capsys.readouterr().err
    # The same files through mars features give the same tensors: one extractor set-up.
    assert cli.main(["features", "--uss", "cause", "--backbone", str(b), "--heads", str(h), "--dhr", "--format",
                     "pt", "--images", str(tree / DATA / "train_aug" / "image"), "--out", str(tmp_path / "f"),
                     "--no-progress"]) == 0
    for s in small:
        assert torch.equal(torch.load(out / "features" / f"{s}.pt", weights_only=True),
                           torch.load(tmp_path / "f" / f"{s}.pt", weights_only=True))


# -- COCO 2014 ---------------------------------------------------------------------------------------


def _xml(path: Path, names) -> None:
    ann = ET.Element("annotation")
    for n in names:
        ET.SubElement(ET.SubElement(ann, "object"), "name").text = n
    ET.ElementTree(ann).write(path)


def make_coco_tree(tmp: Path, n: int = 10, size: int = 40, seed: int = 0):
    """<tmp>/root/COCO2014/train/{image,mask,xml}, COCO2014.json with 81 names, pseudo labels where
    surfboard (38) spills into the sea below it, features that tell sea from surfboard, and
    WSS/COCO2014/DHR/train holding the ground truth."""
    rng = np.random.default_rng(seed)
    root = tmp / "root"
    dom = root / "COCO2014" / "train"
    for sub in ("image", "mask", "xml"):
        (dom / sub).mkdir(parents=True)
    (root / "COCO2014" / "COCO2014.json").write_text(json.dumps({"names": list(PAPER_COCO_CLASSES), "ignore": 255}))
    pseudo, feats, dhr = tmp / "pseudo", tmp / "features", root / "WSS" / "COCO2014" / "DHR" / "train"
    for d in (pseudo, feats, dhr):
        d.mkdir(parents=True)
    D = 8
    protos = torch.from_numpy(rng.normal(size=(82, D))).float()  # 81 classes + "sea"
    stems = []
    for i in range(n):
        stem = f"COCO_train2014_{i:012d}"
        stems.append(stem)
        gt = np.zeros((size, size), np.int64)
        kinds = np.zeros((size, size), np.int64)
        kinds[size // 2:] = 81  # the sea, a background kind
        classes = [38] + list(rng.choice(np.arange(1, 81), 2, replace=False))
        pseudo_lab = gt.copy()
        for j, c in enumerate(classes):
            y0, x0 = 4 + 12 * j % (size - 12), int(rng.integers(0, size - 12))
            gt[y0:y0 + 10, x0:x0 + 10] = c
        pseudo_lab[:] = gt
        pseudo_lab[(gt == 0) & (kinds == 81) & (np.arange(size)[None, :] < size // 2)] = 38  # surfboard -> sea
        kinds = np.where(gt > 0, gt, kinds)
        f = protos[kinds].permute(2, 0, 1) + 0.05 * torch.randn(D, size, size)
        img = (rng.integers(0, 255, (size, size, 3))).astype(np.uint8)
        write_image(dom / "image" / f"{stem}.jpg", img)
        write_label(dom / "mask" / f"{stem}.png", torch.from_numpy(gt))
        write_label(pseudo / f"{stem}.png", torch.from_numpy(pseudo_lab))
        write_label(dhr / f"{stem}.png", torch.from_numpy(gt))
        _xml(dom / "xml" / f"{stem}.xml", sorted({PAPER_COCO_CLASSES[c] for c in np.unique(gt) if c > 0}))
        torch.save(f.half().clone(), feats / f"{stem}.pt")
    return root, pseudo, feats, stems


@pytest.mark.slow
def test_coco2014_with_81_classes_runs_every_stage(tmp_path, capsys):
    root, pseudo, feats, stems = make_coco_tree(tmp_path)
    out = tmp_path / "out"
    code = cli.main(["reproduce", "--root", str(root), "--data", "COCO2014", "--pseudo", str(pseudo), "--out",
                     str(out), "--features", str(feats), "--no-progress", "--threads", "1"])
    assert code == 0
    scores = json.loads((out / "scores.json").read_text())
    assert len(scores["class_names"]) == 81 and len(scores["pseudo"]["iou"]) == 81
    assert scores["DHR"]["miou"] == pytest.approx(1.0)
    # The surfboard spill is the biased object: debiasing lowers its FP.
    assert scores["debiased"]["fp"][38] < scores["pseudo"]["fp"][38]
    state = json.loads((out / "reproduce.json").read_text())
    assert state["settings"]["domain"] == "train" and set(state["stages"]) == {
        "centroids", "debias", "evaluate", "report"}
    text = (out / "report.md").read_text()
    main_table = text.split("## Beside other methods' masks")[0]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in main_table.splitlines() if line.startswith("| ")}
    assert rows["surfboard"][-2] == "17.0" and rows["surfboard"][-1].rstrip(" |") == "61.3"
    assert rows["**mean**"][-1].rstrip(" |") == "49.4"
    assert "COCO 2014 val" in text and "tab:coco_val_detail" in text and "Table 6" not in text
    assert (out / "report" / "biased_share.png").is_file()


def test_coco2014_features_stage_from_model_files(tmp_path):
    from test_reproduce import _tiny_stego_files

    root, pseudo, _, stems = make_coco_tree(tmp_path, n=4)
    b, h = _tiny_stego_files(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["reproduce", "--root", str(root), "--data", "COCO2014", "--pseudo", str(pseudo), "--out",
                     str(out), "--backbone", str(b), "--heads", str(h), "--no-progress", "--threads", "1"]) == 0
    assert sorted(p.stem for p in (out / "features").glob("*.pt")) == stems
    assert set(json.loads((out / "reproduce.json").read_text())["stages"]) == set(
        ("features", "centroids", "debias", "evaluate", "report"))
    assert len(json.loads((out / "scores.json").read_text())["DHR"]["iou"]) == 81


def test_coco_paper_figures_are_consistent():
    for name, row in PAPER_COCO_VAL_IOU.items():
        assert len(row) == 82, name
        assert abs(sum(row[:81]) / 81 - row[81]) <= 0.1 + 1e-9, name  # RS+EPM: 46.3 printed as 46.4
    i = PAPER_COCO_CLASSES.index
    # The improvements the paper's text states (Sec. C): surfboard +44.3, tennis racket +43, train +24.6.
    for cls, gain in (("surfboard", 44.3), ("tennis racket", 43.0), ("train", 24.6)):
        assert PAPER_COCO_VAL_IOU["MARS"][i(cls)] - PAPER_COCO_VAL_IOU["RS+EPM"][i(cls)] == pytest.approx(gain)


def test_paper_columns_name_a_json_in_another_order():
    names = list(PAPER_COCO_CLASSES)
    names[1], names[2] = names[2], names[1]
    cols = paper_columns(names)
    assert cols["mismatch"] == [("bicycle", "person"), ("person", "bicycle")]
    assert paper_columns(["background", "Dining_Table"] + list(PAPER_COCO_CLASSES[2:]))["mismatch"] == [
        ("Dining_Table", "person")]
    assert paper_columns(["background", "a"]) is None


def test_coco_without_its_json_is_one_line(tmp_path, capsys):
    root, pseudo, feats, _ = make_coco_tree(tmp_path, n=2)
    (root / "COCO2014" / "COCO2014.json").unlink()
    assert cli.main(["reproduce", "--root", str(root), "--data", "COCO2014", "--pseudo", str(pseudo), "--out",
                     str(tmp_path / "o"), "--features", str(feats), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no dataset json" in err[0] and "COCO2014.json" in err[0]


# -- --dry-run ---------------------------------------------------------------------------------------


def test_dry_run_on_a_clean_tree_writes_nothing_and_finds_nothing(wss_tree, tmp_path, capsys):
    world, root, rsepm, feats = wss_tree
    out = tmp_path / "never"
    assert _run_cli(root, rsepm, out, "--features", feats, "--dry-run") == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert "no mismatch found" in printed
    assert f"pseudo labels {world.num_images}" in printed and "reference MARS 16" in printed
    assert "[debias] writes 16 of 16" in printed


def test_dry_run_names_every_mismatch(wss_tree, tmp_path, capsys):
    world, root, rsepm, feats = wss_tree
    tree = tmp_path / "root"
    shutil.copytree(root, tree)
    dom = tree / DATA / "train_aug"
    s = world.stems
    (dom / "mask" / f"{s[0]}.png").unlink()
    _xml(dom / "xml" / f"{s[1]}.xml", ["unicorn"])
    pseudo = tree / "WSS" / DATA / "RSEPM" / "train_aug"
    write_label(pseudo / f"{s[2]}.png", world.pseudo[2][:-3])
    (tree / "WSS" / DATA / "MARS" / "train_aug" / f"{s[3]}.png").unlink()
    (pseudo / f"{s[4]}.png").write_bytes(b"not a png")
    # A finished run of other settings in --out.
    out = tmp_path / "out"
    out.mkdir()
    (out / "reproduce.json").write_text(json.dumps({"settings": {"alpha": 0.9}, "stages": {}}))
    assert _run_cli(tree, pseudo, out, "--features", feats, "--dry-run") == 1
    printed = capsys.readouterr().out
    lines = printed.split("mismatch(es):")[1]
    assert "no ground-truth mask" in lines and s[0] in lines
    assert "unknown class 'unicorn'" in lines and s[1] in lines
    assert f"{s[2]} (pseudo 61x64, image 64x64)" in lines
    assert "reference MARS" in lines and s[3] in lines
    assert "unreadable" in lines and s[4] in lines
    assert "other settings (alpha" in lines
    assert sorted(p.name for p in out.iterdir()) == ["reproduce.json"]  # nothing written


def test_coco_constants_are_the_papers_table():
    """The class order and both rows, read again from the paper's LaTeX (shared/paper beside the
    checkout, as CI lays it)."""
    tex_path = Path(__file__).resolve().parents[2] / "shared" / "paper" / "mars_iccv2023.tex"
    if not tex_path.is_file():
        pytest.skip(f"{tex_path} is not here")
    tex = tex_path.read_text()
    end = tex.index("\\label{tab:coco_val_detail}")
    body = tex[tex.index("\\hline \\hline", tex.rindex("\\caption", 0, end)) + len("\\hline \\hline"):end]
    left, right = [], []
    for line in body.splitlines():
        line = line.replace("\\textbf{", "").replace("}", "").replace("\\cline{6-10", "").replace("\\\\", "")
        if line.count("&") == 9:
            cells = [c.strip() for c in line.split("&")]
            left.append(cells[:5])
            right.append(cells[5:])
    rows = left + right  # the table runs down the left half, then the right
    assert rows[-1][0] == "mIoU"
    assert tuple(r[0] for r in rows[:-1]) == PAPER_COCO_CLASSES
    assert tuple(float(r[3]) for r in rows) == PAPER_COCO_VAL_IOU["RS+EPM"]
    assert tuple(float(r[4]) for r in rows) == PAPER_COCO_VAL_IOU["MARS"]
