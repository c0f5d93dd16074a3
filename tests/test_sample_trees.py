"""``mars sample``: each tree is in its codebase's layout (read back by that adapter's readers), its
model files load as ``mars features`` loads them (weights only), and every command it prints runs."""
from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.files import read_features, read_image, read_label
from mars_plugin.commands.sample_trees import CHEAP_TRAIN, LAYOUTS, TREES, VOC_IDS, sample_commands, write_sample_tree
from mars_plugin.worlds.synthetic_scenes import make_world
from mars_plugin.commands.demo import WORLD_NOISE

IDS = [f"2007_{i:06d}" for i in range(1, 5)]


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
    adapter = importlib.import_module(f"mars_plugin.adapters.wsss.{name}")
    lay = {k: out / v for k, v in LAYOUTS[name].items()}
    world = make_world(4, size=48, seed=0, **WORLD_NOISE)
    lut = torch.tensor(VOC_IDS)
    gt = {i: read_label(lay["gt"] / f"{i}.png", biased_value=None) for i in IDS}
    for k, i in enumerate(IDS):
        assert torch.equal(gt[i], torch.where(world.gt[k] == 255, 255, lut[world.gt[k].clamp(max=6)]))
        assert read_image(lay["images"] / f"{i}.jpg").shape == (48, 48, 3)
        assert torch.equal(read_features(next(lay["features"].glob(f"{i}.*"))), world.features[k].half().float())
    pseudo = dict(adapter.load_pseudo_labels(lay["pseudo"]))
    assert sorted(pseudo) == IDS
    assert set().union(*(_classes(y) for y in pseudo.values())) <= set(VOC_IDS[1:])
    mode = adapter.LABEL_MODE
    from PIL import Image

    assert {Image.open(p).mode for p in lay["pseudo"].glob("*.png")} == {mode}
    if name == "dhr":
        layout = adapter.DHRLayout(out)
        assert sorted(layout.ids()) == IDS and layout.class_names()[4] == "boat"
        tags = adapter.load_image_labels(layout)
    elif name == "rsepm":
        tags = adapter.load_image_labels(lay["tags"])
    else:
        tags = adapter.load_image_labels(lay["tags"], trust_pickle=True)
        assert adapter.load_image_list(lay["tags"].parent / "train_aug.txt") == IDS
    for i in IDS:  # the tags are the classes of the ground truth
        assert [c + 1 for c in torch.nonzero(tags[i]).flatten().tolist()] == _classes(gt[i])


def test_the_weights_load_weights_only(tree):
    from mars_plugin.adapters.uss.cause import CAUSEExtractor
    from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor
    from mars_plugin.adapters.uss.stego import STEGOExtractor

    name, out = tree
    w = out / "weights"
    x = torch.rand(1, 3, 32, 48)
    a = STEGOExtractor.from_checkpoint(w / "stego_tiny_random.ckpt", trust_pickle=False, res=None)
    b = STEGOExtractor.from_files(w / "dino_tiny_random.pth", w / "STEGO_VOC2012.pt", res=None)
    fa, fb = a(x), b(x)
    assert fa.shape == (1, 16, 4, 6) and torch.equal(fa, fb)  # the same model in both forms
    assert fa.std() > 0
    c = CAUSEExtractor.from_files(w / "dinov2_tiny_random.pth", w / "CAUSE_VOC2012.pt")(torch.rand(1, 3, 28, 42))
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
    assert "class 4 (boat)" in printed["centroids"]  # --wsss NAME: that codebase's class names
    assert "mIoU" in printed["evaluate"]
    if name == "dhr":
        assert "| boat |" in printed["evaluate"]  # --class-names: DHR's dataset json
        assert (out / "reproduce_stego" / "report.md").is_file() and (out / "reproduce_cause" / "report.md").is_file()
        # the cheap `--train` line trained and wrote the MARS masks; the README shows the same flags
        assert (out / "reproduce_stego" / "train" / "checkpoint.pt").is_file()
        assert len(list((out / "reproduce_stego" / "masks").glob("*.png"))) == len(IDS)
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
