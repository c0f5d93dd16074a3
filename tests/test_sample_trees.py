"""``mars sample``: each tree is in its codebase's layout (read back by that adapter's readers), its
CAM files are the codebase's own (read by its ``load_cams``, refused without the trust flag) and
``mars crf`` refines them into labels, its model files load as ``mars features`` loads them
(weights only), and every command it prints runs."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.files import read_features, read_image, read_label
from mars_plugin.commands.crf_job import CAM_EXTENSIONS
from mars_plugin.commands.sample_trees import (CHEAP_TRAIN, COCO_IDS, DHR_DATA, LAYOUTS, TREES, class_ids, image_ids,
                                               sample_commands, write_sample_tree)
from mars_plugin.worlds.synthetic_scenes import make_world
from mars_plugin.commands.demo import WORLD_NOISE



@pytest.fixture(scope="module", params=TREES)
def tree(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"sample_{request.param}") / "t"
    assert cli.main(["sample", "--tree", request.param, "--out", str(out), "--num-images", "4", "--size", "48"]) == 0
    return request.param, out


def _classes(y: torch.Tensor):
    return sorted(set(y.unique().tolist()) - {0, 255})


def test_the_tree_is_the_codebase_layout_read_back_by_its_adapter(tree):
    import importlib

    name, out = tree
    IDS = image_ids(name, 4)
    adapter = importlib.import_module(f"mars_plugin.adapters.wsss.{'dhr' if name in DHR_DATA else name}")
    lay = {k: out / v for k, v in LAYOUTS[name].items()}
    world = make_world(4, size=48, seed=0, **WORLD_NOISE)
    lut = torch.tensor(class_ids(name))
    gt = {i: read_label(lay["gt"] / f"{i}.png", biased_value=None) for i in IDS}
    for k, i in enumerate(IDS):
        assert torch.equal(gt[i], torch.where(world.gt[k] == 255, 255, lut[world.gt[k].clamp(max=6)]))
        assert read_image(lay["images"] / f"{i}.jpg").shape == (48, 48, 3)
        assert torch.equal(read_features(next(lay["features"].glob(f"{i}.*"))), world.features[k].half().float())
    pseudo = dict(adapter.load_pseudo_labels(lay["pseudo"]))
    assert sorted(pseudo) == IDS
    assert set().union(*(_classes(y) for y in pseudo.values())) <= set(class_ids(name)[1:])
    mode = adapter.LABEL_MODE
    from PIL import Image

    assert {Image.open(p).mode for p in lay["pseudo"].glob("*.png")} == {mode}
    if name in DHR_DATA:
        layout = adapter.DHRLayout(out, DHR_DATA[name])
        domain = lay["images"].parent.name
        assert sorted(layout.ids(domain)) == IDS and layout.class_names()[class_ids(name)[1]] == "boat"
        assert len(layout.class_names()) == (81 if name == "dhr-coco" else 21)
        tags = adapter.load_image_labels(layout, domain=domain)
    elif name == "rsepm":
        tags = adapter.load_image_labels(lay["tags"])
    else:
        tags = adapter.load_image_labels(lay["tags"], trust_pickle=True)
        assert adapter.load_image_list(lay["tags"].parent / "train_aug.txt") == IDS
    for i in IDS:  # the tags are the classes of the ground truth
        assert [c + 1 for c in torch.nonzero(tags[i]).flatten().tolist()] == _classes(gt[i])


def _adapter(name: str):
    import importlib

    return importlib.import_module(f"mars_plugin.adapters.wsss.{'dhr' if name in DHR_DATA else name}")


def test_the_cams_are_the_codebase_files_read_by_its_load_cams(tree):
    """One CAM file per image in the codebase's CAM folder and format: its ``load_cams`` reads it
    (only with trust_pickle: each is a pickle), its keys are the image's tags (DHR's with
    background 0), and every class map is high on that class's pseudo label and low elsewhere."""
    name, out = tree
    IDS = image_ids(name, 4)
    adapter = _adapter(name)
    folder = out / LAYOUTS[name]["cams"]
    ext = CAM_EXTENSIONS["dhr" if name in DHR_DATA else name]
    assert sorted(p.name for p in folder.iterdir()) == [f"{i}{ext}" for i in IDS]
    world = make_world(4, size=48, seed=0, **WORLD_NOISE)
    lut = class_ids(name)
    for k, i in enumerate(IDS):
        with pytest.raises(PermissionError, match="trust"):
            adapter.load_cams(folder / f"{i}{ext}")
        cams = adapter.load_cams(folder / f"{i}{ext}", trust_pickle=True)
        tags = sorted(lut[c] for c in _classes(world.gt[k]))
        keys = cams["keys"].tolist()
        maps = torch.as_tensor(cams["high_res"] if name in ("irnet", "advcam") else cams["cam"]).float()
        assert maps.shape == (len(keys), 48, 48)
        if name in DHR_DATA:  # softmax maps of background and classes
            assert keys == [0] + tags
            torch.testing.assert_close(maps.sum(0), torch.ones(48, 48), rtol=0, atol=1e-2)
            keys, maps = keys[1:], maps[1:]
        else:
            assert keys == tags and float(maps.min()) >= 0 and float(maps.max()) <= 1
        if name in ("irnet", "advcam"):
            assert tuple(cams["cam"].shape) == (len(keys), 12, 12)  # IRNet's stride-4 maps beside high_res
        pseudo = torch.tensor(lut + (0,) * (256 - len(lut)))[world.pseudo[k]]
        pseudo[world.pseudo[k] == 255] = 255
        for c, m in zip(keys, maps):
            inside = pseudo == c
            assert inside.any() and float(m[inside].mean()) > float(m[~inside].mean()) + 0.3, (i, c)


@pytest.mark.parametrize("name", ["irnet", "seam", "rsepm", "dhr"])
def test_the_cam_keys_ascend_as_upstream_writes_them(name, tmp_path):
    """An image of two classes (the 8-image world's 4th: train and dog, VOC 19 and 12): its keys
    ascend as upstream's np.nonzero of the tag vector gives them, not in the world's order."""
    paths = write_sample_tree(name, tmp_path / "t", num_images=8, size=32)
    ext = CAM_EXTENSIONS[name]
    keys = _adapter(name).load_cams(paths["cams"] / f"{image_ids(name, 8)[3]}{ext}", trust_pickle=True)["keys"]
    assert [k for k in keys.tolist() if k] == [12, 19]


def test_mars_crf_runs_on_every_tree(tree, capsys):
    """The tree's `mars crf` line (its CAMs, its codebase's rule and CRF) writes one label PNG per
    image of the image's size, with the tree's class ids (IRNet/AdvCAM: 255 between their
    confident foreground and background), closer to the ground truth than the CAMs' own labels
    without the CRF; the `mars evaluate` line after it scores them."""
    from PIL import Image

    name, out = tree
    commands = sample_commands(name, out)
    at = [k for k, c in enumerate(commands) if c.startswith("mars crf ")]
    assert len(at) == 1
    crf, evaluate = shlex.split(commands[at[0]]), shlex.split(commands[at[0] + 1])
    folder = Path(crf[crf.index("--out") + 1])
    assert evaluate[:4] == ["mars", "evaluate", "--pred", str(folder)]
    assert not folder.exists()
    capsys.readouterr()
    for argv in (crf, evaluate):
        code = cli.main(argv[1:] + ["--no-progress", "--threads", "1"])
        printed, err = capsys.readouterr()
        assert code == 0, (argv, err)
    assert "mIoU" in printed
    IDS = image_ids(name, 4)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [f"{i}.png" for i in IDS]
    lay = {k: out / v for k, v in LAYOUTS[name].items()}
    adapter, ext = _adapter(name), CAM_EXTENSIONS["dhr" if name in DHR_DATA else name]
    allowed = set(class_ids(name)) | ({255} if name in ("irnet", "advcam") else set())
    hits = {"crf": 0, "cams": 0}
    for i in IDS:
        png = Image.open(folder / f"{i}.png")
        label = np.asarray(png)
        assert png.size == (48, 48) and png.mode == "P" and set(np.unique(label).tolist()) <= allowed
        gt = read_label(lay["gt"] / f"{i}.png", biased_value=None).numpy()
        plain = adapter.cams_to_label(adapter.load_cams(lay["cams"] / f"{i}{ext}", trust_pickle=True)).numpy()
        hits["crf"] += int(((label == gt) & (gt != 255)).sum())
        hits["cams"] += int(((plain == gt) & (gt != 255)).sum())
    assert hits["crf"] > hits["cams"], hits  # the CRF had work to do, and did it


def test_the_weights_load_weights_only(tree):
    from mars_plugin.adapters.uss.cause import CAUSEExtractor
    from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor
    from mars_plugin.adapters.uss.stego import STEGOExtractor

    name, out = tree
    w = out / "weights"
    data = DHR_DATA.get(name, "VOC2012")
    x = torch.rand(1, 3, 32, 48)
    a = STEGOExtractor.from_checkpoint(w / "stego_tiny_random.ckpt", trust_pickle=False, res=None)
    b = STEGOExtractor.from_files(w / "dino_tiny_random.pth", w / f"STEGO_{data}.pt", res=None)
    fa, fb = a(x), b(x)
    assert fa.shape == (1, 16, 4, 6) and torch.equal(fa, fb)  # the same model in both forms
    assert fa.std() > 0
    c = CAUSEExtractor.from_files(w / "dinov2_tiny_random.pth", w / f"CAUSE_{data}.pt")(torch.rand(1, 3, 28, 42))
    assert c.shape == (1, 90, 2, 3) and torch.isfinite(c).all() and c.std() > 0
    d = DINOv2Extractor.from_files(w / "dinov2_tiny_random.pth")(torch.rand(1, 3, 28, 42))
    assert d.shape == (1, 192, 2, 3)


@pytest.mark.slow  # every command on each tree, a reproduce --train included: minutes on 2 cores
def test_every_printed_command_runs(tree, capsys):
    name, out = tree
    capsys.readouterr()
    printed = {}
    for cmd in sample_commands(name, out):
        argv = shlex.split(cmd)
        assert argv[0] == "mars"
        code = cli.main(argv[1:] + ["--no-progress", "--threads", "1"])
        printed[argv[1]], err = capsys.readouterr()
        assert code == 0, (cmd, err)
        assert "Traceback" not in err and "warning" not in err
    boat = class_ids(name)[1]
    assert f"class {boat} (boat)" in printed["centroids"]  # --wsss NAME: that codebase's class names
    assert "mIoU" in printed["evaluate"]
    if name in DHR_DATA:
        assert "| boat |" in printed["evaluate"]  # --class-names: DHR's dataset json
        assert (out / "reproduce_stego" / "report.md").is_file() and (out / "reproduce_cause" / "report.md").is_file()
        assert "mIoU of the labels" in printed["reproduce"]
    if name == "dhr":
        # the cheap `--train` line trained and wrote the MARS masks; the README shows the same flags
        assert (out / "reproduce_stego" / "train" / "checkpoint.pt").is_file()
        assert len(list((out / "reproduce_stego" / "masks").glob("*.png"))) == len(image_ids(name, 4))
        readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().replace("\\\n", " ").split())
        assert CHEAP_TRAIN in readme


def test_mars_sample_prints_the_commands_and_refuses_a_used_folder(tmp_path, capsys):
    out = tmp_path / "s"
    assert cli.main(["sample", "--tree", "irnet", "--out", str(out), "--num-images", "2", "--size", "32"]) == 0
    printed = capsys.readouterr().out
    for cmd in sample_commands("irnet", out):
        assert f"  {cmd}\n" in printed
    assert cli.main(["sample", "--tree", "irnet", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mars sample: error: --out {out}: exists and is not an empty folder; give a new one"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["sample", "--tree", "seam", "--out", str(empty), "--num-images", "2", "--size", "32"]) == 0
    assert (empty / "out_rw" / "2007_000001.png").is_file() and not list(tmp_path.glob(".tmp-*"))
    assert oct(empty.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_the_coco_tree_is_what_reproduce_data_coco2014_reads(tmp_path, capsys):
    """``--tree dhr-coco``: DHR's COCO 2014 tree (domain train, COCO's 81 names and ids), which
    ``mars reproduce --data COCO2014`` runs on offline in seconds (given features, threshold)."""
    out = tmp_path / "coco"
    assert cli.main(["sample", "--tree", "dhr-coco", "--out", str(out), "--num-images", "4", "--size", "32"]) == 0
    printed = capsys.readouterr().out
    reproduce = [c for c in sample_commands("dhr-coco", out) if c.startswith("mars reproduce")]
    assert len(reproduce) == 2 and all(f"  {c}\n" in printed and " --data COCO2014 " in c for c in reproduce)
    names = json.loads((out / "COCO2014" / "COCO2014.json").read_text())["names"]
    assert len(names) == 81 and [names[i] for i in COCO_IDS[1:]] == ["boat", "train", "dog", "car", "person", "bird"]
    code = cli.main(["reproduce", "--root", str(out), "--data", "COCO2014", "--pseudo",
                     str(out / "WSS/COCO2014/RSEPM/train"), "--features", str(out / "COCO2014/train/SYNTHETIC"),
                     "--refine", "threshold", "--out", str(tmp_path / "r"), "--no-progress", "--threads", "1"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "mIoU of the labels" in printed and "(4 images)" in printed
    report = (tmp_path / "r" / "report.md").read_text()
    assert "COCO 2014" in report and "| boat |" in report
