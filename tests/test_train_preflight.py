"""mars train fails early, in one line (issue 30, class 4): every file the run will read is
checked before step 1 (decodable, label and image of one size, label values 0..C / 254 / 255,
one image per id, an image for every label), the refusal names the file; a file that breaks
later, inside a data-loading worker, is reported as one line naming it, not as the worker's
flattened traceback."""
import shutil

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.commands import train as train_module
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.train import CHECKPOINT_NAME, train
from mars_plugin.formats.files import write_image, write_label

from test_train import C, TINY, _cli_args, _tree

RUN = dict(TINY, iterations=2, loss="ce")


@pytest.fixture
def tree(tmp_path):
    return _tree(tmp_path / "t")


def _undecodable_label(tree):
    (tree / "pseudo" / "s2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return r"s2\.png: cannot read label image"


def _size_mismatch(tree):
    write_image(tree / "images" / "s3.png", np.zeros((20, 20, 3), np.uint8))
    return r"s3\.png: label is 36x40 but its image is 20x20"


def _value_above_c(tree):
    lab = np.zeros((36, 40), np.int64)
    lab[5:9, 5:9] = 30
    write_label(tree / "pseudo" / "s4.png", torch.from_numpy(lab))
    return rf"s4\.png: holds the value 30; expected 0\.\.{C}"


def _biased_with_ce(tree):
    shutil.copy(tree / "debiased" / "s1.png", tree / "pseudo" / "s1.png")
    return r"s1\.png: holds biased pixels \(254\) but --loss ce"


def _two_images_of_one_id(tree):
    write_image(tree / "images" / "s1.jpg", np.zeros((36, 40, 3), np.uint8))
    return r"1 id\(s\) have several images \(s1: s1\.jpg, s1\.png\)"


def _missing_image(tree):
    (tree / "images" / "s5.png").unlink()
    return r"no image for 1 label\(s\), e\.g\. \['s5'\]"


def _unreadable_image(tree):
    (tree / "images" / "s0.png").write_bytes(b"not an image at all")
    return r"s0\.png: cannot read image"


BAD = [_undecodable_label, _size_mismatch, _value_above_c, _biased_with_ce, _two_images_of_one_id, _missing_image,
       _unreadable_image]


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_file_is_refused_before_step_1_naming_it(tree, tmp_path, monkeypatch, bad):
    from mars_plugin.networks import deeplab

    real = deeplab.build_model

    def no_network(*a, **k):  # refused before the network is built, not by the first step
        if torch.get_default_device().type == "meta":  # the memory budget's trace: shapes only, no weights
            return real(*a, **k)
        raise AssertionError("the network was built")

    monkeypatch.setattr(deeplab, "build_model", no_network)
    says = bad(tree)
    with pytest.raises((JobError, ValueError), match=says) as e:
        train(tree / "images", tree / "pseudo", tmp_path / "run", C, **RUN)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", [_undecodable_label, _value_above_c, _two_images_of_one_id])
def test_the_command_line_refuses_in_one_line(tree, tmp_path, capsys, bad):
    says = bad(tree)
    argv = _cli_args(tree, tmp_path / "run", ("--loss", "ce", "--labels", str(tree / "pseudo"), "--workers", "2"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mars train: error: "), err
    import re

    assert re.search(says, err[0]), err


@pytest.mark.slow
def test_the_check_reads_every_file_once_with_a_progress_bar(tree, tmp_path, capsys):
    train(tree / "images", tree / "pseudo", tmp_path / "run", C, **dict(RUN, iterations=1, progress=True))
    err = capsys.readouterr().err
    assert "check data" in err and "6/6" in err, err
    # a resume of the same data skips it (those files passed it when the run started)
    train(tree / "images", tree / "pseudo", tmp_path / "run", C, **dict(RUN, iterations=1, progress=True))
    assert "check data" not in capsys.readouterr().err


def _corrupt_after_the_check(monkeypatch, path):
    """The label at ``path`` breaks right after the check before step 1 (as a file changed
    under a running job)."""
    checked = train_module.check_train_files

    def check_then_break(*a, **k):
        checked(*a, **k)
        path.write_bytes(b"\x89PNG\r\n\x1a\n broken while training")

    monkeypatch.setattr(train_module, "check_train_files", check_then_break)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_broken_after_the_check_is_one_line_naming_it(tree, tmp_path, capsys, monkeypatch, workers):
    bad = tree / "pseudo" / "s2.png"
    _corrupt_after_the_check(monkeypatch, bad)
    argv = _cli_args(tree, tmp_path / "run", ("--loss", "ce", "--labels", str(tree / "pseudo"),
                                               "--workers", str(workers), "--iterations", "4", "--save-every", "1"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith(f"mars train: error: s2: {bad}: cannot read label image"), line
    assert "the file changed after the check before step 1" in line, line
    assert "Traceback" not in line and "Caught" not in line and len(line) < 400, line
    # the checkpoint of the steps before the failure, if any, is a checkpoint of this run
    if (tmp_path / "run" / CHECKPOINT_NAME).exists():
        from mars_plugin.networks.seg_checkpoint import load_checkpoint

        assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)["iteration"] < 4
