"""mars train has no quiet wrong defaults (issue 30, class 8): C is inferred where it can be
(--class-names, --root's dataset, --image-labels) and asked for where it cannot (never a silent
20); --loss mars on labels without a single 254 (the pseudo labels) and labels with nothing to
learn (every pixel 254 or 255) are refused; debiased labels without image labels train with a
warning naming the flag that fixes it."""
import json

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.commands.train import CHECKPOINT_NAME
from mars_plugin.formats.files import write_label
from mars_plugin.networks.seg_checkpoint import load_checkpoint

from test_train import C, _tree


@pytest.fixture
def tree(tmp_path):
    return _tree(tmp_path / "t")


def _argv(tree, out, *extra, labels="pseudo", loss="ce"):
    """mars train, 1 tiny step, without --num-classes unless ``extra`` gives it."""
    return ["train", "--images", str(tree / "images"), "--labels", str(tree / labels), "--out", str(out),
            "--loss", loss, "--arch", "deeplabv3+", "--output-stride", "16", "--backbone", "resnet18", "--iterations", "1", "--batch-size", "2", "--crop", "32",
            "--min-size", "28", "--max-size", "40", "--workers", "0", "--no-progress", *extra]


def _err_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_without_num_classes_and_nothing_to_infer_it_from_the_command_asks(tree, tmp_path, capsys):
    assert cli.main(_argv(tree, tmp_path / "run")) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith("mars train: error: --num-classes: not given"), err
    assert "VOC: 20" in err[0] and not (tmp_path / "run").exists()


def test_num_classes_from_the_class_names(tree, tmp_path):
    names = tmp_path / "classes.json"
    names.write_text(json.dumps({"class_names": ["background"] + [f"c{i}" for i in range(1, C + 1)]}))
    assert cli.main(_argv(tree, tmp_path / "run", "--class-names", str(names))) == 0
    ck = load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)
    assert ck["model"]["num_classes"] == C and len(ck["class_names"]) == C + 1


def test_num_classes_from_the_image_labels_is_said(tree, tmp_path, capsys):
    tags = tmp_path / "image_labels.json"
    tags.write_text(json.dumps({f"s{i}": [1 + i % C, 1 + (i + 1) % C] for i in range(6)}))
    assert cli.main(_argv(tree, tmp_path / "run", "--image-labels", str(tags))) == 0
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)["model"]["num_classes"] == C
    err = _err_lines(capsys)
    assert err == [f"mars train: note: --num-classes {C}: the largest class id in --image-labels {tags} (give "
                   "--num-classes if the dataset has more classes)"], err


@pytest.mark.slow
def test_num_classes_from_the_root_dataset(tmp_path):
    from mars_plugin.commands.sample_trees import write_sample_tree

    root = tmp_path / "s"
    write_sample_tree("dhr", root, num_images=4, size=32, seed=0)
    argv = ["train", "--root", str(root), "--labels", str(root / "WSS/VOC2012/RSEPM/train_aug"), "--out",
            str(tmp_path / "run"), "--loss", "ce", "--arch", "deeplabv3+", "--output-stride", "16", "--backbone", "resnet18", "--iterations", "1", "--batch-size", "2",
            "--crop", "32", "--min-size", "28", "--max-size", "40", "--workers", "0", "--no-progress"]
    assert cli.main(argv) == 0
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)["model"]["num_classes"] == 20


def test_loss_mars_on_labels_without_a_biased_pixel_is_refused(tree, tmp_path, capsys):
    assert cli.main(_argv(tree, tmp_path / "run", "--num-classes", str(C), loss="mars")) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and "none of the 6 labels holds a biased pixel (254)" in err[0], err
    assert "--loss ce" in err[0] and f"--labels {tree / 'pseudo'}" in err[0]


@pytest.mark.parametrize("value,loss", [(254, "mars"), (255, "ce")])
def test_labels_with_nothing_to_learn_are_refused(tree, tmp_path, capsys, value, loss):
    for i in range(6):
        write_label(tree / "nothing" / f"s{i}.png", torch.full((36, 40), value, dtype=torch.long))
    assert cli.main(_argv(tree, tmp_path / "run", "--num-classes", str(C), labels="nothing", loss=loss)) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and "every pixel of all 6 labels is 254 (biased) or 255 (ignore)" in err[0], err


@pytest.mark.slow
def test_debiased_labels_without_image_labels_train_with_a_warning(tree, tmp_path, capsys):
    argv = _argv(tree, tmp_path / "run", "--num-classes", str(C), "--refine", "none", labels="debiased", loss="mars")
    assert cli.main(argv) == 0
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith("mars train: warning: no --image-labels: "), err
    assert "a class whose pixels were all marked biased is lost" in err[0] and "give --image-labels" in err[0]
    tags = tmp_path / "image_labels.json"
    tags.write_text(json.dumps({f"s{i}": [1 + i % C, 1 + (i + 1) % C] for i in range(6)}))
    assert cli.main([*argv, "--image-labels", str(tags), "--out", str(tmp_path / "run2")]) == 0
    assert _err_lines(capsys) == []


def test_the_readme_training_block_gives_num_classes():
    """The README's blocks that run mars train say --num-classes or give what infers it."""
    from test_readme_blocks import ROOT, _blocks

    for b in _blocks(ROOT / "README.md"):
        for cmd in b.code.replace("\\\n", " ").splitlines():
            if "mars train" in cmd or "mars_plugin.cli train" in cmd:
                assert any(f in cmd for f in ("--num-classes", "--class-names", "--root", "--image-labels")), cmd
