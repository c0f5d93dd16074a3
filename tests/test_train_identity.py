"""mars train knows its data (issue 30, class 2): a checkpoint in --out is resumed only on the
data it was trained on (the folders' files by identity, the ids, the image labels); other data
is refused with one line naming what changed, leaving the checkpoint and train.json as they
were, unless --restart asks to train again from step 0."""
import json
import shutil

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.train import CHECKPOINT_NAME, LOG_NAME, train
from mars_plugin.formats.files import write_image, write_label
from mars_plugin.networks.seg_checkpoint import load_checkpoint, save_checkpoint

from test_train import C, TINY, _cli_args, _tree

# plain CE (no teacher, no CRF): the data record is the same for both losses, and CE steps are fast
RUN = dict(TINY, iterations=3, save_every=1, loss="ce")


class _Stop(Exception):
    pass


def _stop_after(step):
    def hook(done):
        if done == step:
            raise _Stop

    return hook


@pytest.fixture
def tree(tmp_path):
    return _tree(tmp_path / "t")


def _killed_run(tree, out, labels="pseudo", **kw):
    """A run killed after step 1 (its checkpoint of step 1 in ``out``)."""
    with pytest.raises(_Stop):
        train(tree / "images", tree / labels, out, C, on_step=_stop_after(1), **dict(RUN, **kw))
    assert load_checkpoint(out / CHECKPOINT_NAME)["iteration"] == 1


def _state(out):
    return {n: (out / n).read_bytes() for n in (CHECKPOINT_NAME, LOG_NAME, "train.json") if (out / n).exists()}


def _other_label(tree, stem, folder="pseudo"):
    lab = np.zeros((36, 40), np.int64)
    lab[2:30, 3:33] = 1
    write_label(tree / folder / f"{stem}.png", torch.from_numpy(lab))


def _change_labels_folder(tree):
    # another folder with the same names: other content (the pseudo labels of another method)
    for i in range(6):
        _other_label(tree, f"s{i}", "other")
    says = r"--labels: 6 of 6 label files changed \(folder .*pseudo -> .*other\), e\.g\. s0, s1"
    return {"labels": tree / "other"}, says


def _replace_a_label(tree):
    _other_label(tree, "s3")
    return {}, r"--labels: 1 of 6 label files changed, e\.g\. s3\)"


def _change_an_image(tree):
    write_image(tree / "images" / "s2.png", np.zeros((36, 40, 3), np.uint8))
    return {}, r"--images: 1 of 6 image files changed, e\.g\. s2\)"


def _remove_an_id(tree):
    (tree / "pseudo" / "s5.png").unlink()
    return {}, r"1 id\(s\) removed, e\.g\. s5"


def _add_an_id(tree):
    shutil.copy(tree / "images" / "s0.png", tree / "images" / "s6.png")
    shutil.copy(tree / "pseudo" / "s0.png", tree / "pseudo" / "s6.png")
    return {}, r"1 id\(s\) added, e\.g\. s6"


def _other_image_labels(tree):
    says = r"--image-labels: the classes of 1 id\(s\) differ, e\.g\. s0: \[1\] -> \[1, 2\]"
    return {"image_labels": {"s0": [1, 2]}}, says


@pytest.mark.parametrize("change", [_change_labels_folder, _replace_a_label, _change_an_image, _remove_an_id,
                                    _add_an_id, _other_image_labels])
@pytest.mark.slow
def test_a_killed_run_resumed_on_other_data_is_refused_naming_what_changed(tree, tmp_path, change):
    out = tmp_path / "run"
    _killed_run(tree, out, image_labels={"s0": [1]})
    before = _state(out)
    kw, says = change(tree)
    labels = kw.pop("labels", tree / "pseudo")
    kw.setdefault("image_labels", {"s0": [1]})
    with pytest.raises(JobError, match=says) as e:
        train(tree / "images", labels, out, C, **dict(RUN, **kw))
    assert "checkpoint (step 1) trained on other data" in str(e.value) and "--restart" in str(e.value)
    assert _state(out) == before  # the checkpoint, the log and train.json as they were


@pytest.mark.slow
def test_a_finished_run_run_again_on_other_data_is_refused_and_train_json_kept(tree, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _cli_args(tree, out, ("--loss", "ce", "--labels", str(tree / "pseudo")))
    assert cli.main(argv) == 0
    before = _state(out)
    assert json.loads(before["train.json"])["data"]["labels"] == str((tree / "pseudo").resolve())
    _change_labels_folder(tree)
    capsys.readouterr()
    assert cli.main([*argv, "--labels", str(tree / "other")]) == 2
    io = capsys.readouterr()
    err = io.err.strip().splitlines()
    assert len(err) == 1 and "trained on other data" in err[0] and "--labels: 6 of 6 label files changed" in err[0], err
    assert "resumed at" not in io.out
    assert _state(out) == before


@pytest.mark.slow
def test_restart_trains_again_from_step_0_on_the_new_data(tree, tmp_path):
    out = tmp_path / "run"
    _killed_run(tree, out)
    _replace_a_label(tree)
    with pytest.raises(JobError, match="trained on other data"):
        train(tree / "images", tree / "pseudo", out, C, **RUN)
    res = train(tree / "images", tree / "pseudo", out, C, restart=True, **RUN)
    assert res["resumed_from"] == 0 and res["iterations"] == 3
    log = [json.loads(x)["iteration"] for x in (out / LOG_NAME).read_text().splitlines()]
    assert log == [1, 2, 3]
    # the new checkpoint and train.json describe the new data: the next run resumes (finished)
    again = train(tree / "images", tree / "pseudo", out, C, **RUN)
    assert again["resumed_from"] == 3


@pytest.mark.slow
def test_a_restart_killed_before_its_first_checkpoint_leaves_no_old_one(tree, tmp_path):
    """--restart removes the old run's checkpoint: killed before its own first one, the next
    run (without --restart) starts from step 0 instead of meeting the other data's checkpoint."""
    out = tmp_path / "run"
    _killed_run(tree, out)
    _replace_a_label(tree)
    with pytest.raises(_Stop):
        train(tree / "images", tree / "pseudo", out, C, restart=True, on_step=_stop_after(1),
              **dict(RUN, save_every=2))
    assert not (out / CHECKPOINT_NAME).exists()
    assert train(tree / "images", tree / "pseudo", out, C, **RUN)["resumed_from"] == 0


@pytest.mark.slow
def test_restart_refused_by_a_bad_file_keeps_the_old_run(tree, tmp_path):
    out = tmp_path / "run"
    _killed_run(tree, out)
    before = _state(out)
    (tree / "pseudo" / "s1.png").write_bytes(b"not a png")
    with pytest.raises(JobError, match="s1.png"):
        train(tree / "images", tree / "pseudo", out, C, restart=True, **RUN)
    assert _state(out) == before


@pytest.mark.slow
def test_the_same_data_resumes_even_from_a_moved_folder(tree, tmp_path):
    """The identities (name, size, mtime) decide, not the folder's name: a tree moved with mv
    (or copied with cp -a) is the same data and resumes."""
    out = tmp_path / "run"
    _killed_run(tree, out)
    res = train(tree / "images", tree / "pseudo", out, C, **RUN)
    assert res["resumed_from"] == 1
    (tree / "pseudo").rename(tree / "moved")
    assert train(tree / "images", tree / "moved", out, C, **RUN)["resumed_from"] == 3


@pytest.mark.slow
def test_a_checkpoint_without_a_data_record_is_refused(tree, tmp_path):
    out = tmp_path / "run"
    _killed_run(tree, out)
    ck = load_checkpoint(out / CHECKPOINT_NAME)
    del ck["data"]
    save_checkpoint(out / CHECKPOINT_NAME, ck)
    with pytest.raises(JobError, match=r"step 1\) without a record of the data"):
        train(tree / "images", tree / "pseudo", out, C, **RUN)


def test_the_checkpoint_and_train_json_record_the_same_data(tree, tmp_path):
    from mars_plugin.runs.identities import roles_digest

    out = tmp_path / "run"
    train(tree / "images", tree / "pseudo", out, C, **dict(RUN, iterations=1))
    data = json.loads(load_checkpoint(out / CHECKPOINT_NAME)["data"])
    summary = json.loads((out / "train.json").read_text())["data"]
    assert sorted(data["files"]) == [f"s{i}" for i in range(6)]
    assert data["files"]["s0"][1].startswith("s0.png:")
    assert summary["files"] == roles_digest(data["files"]) and summary["ids"] == 6
    assert summary["labels"] == data["labels"] == str((tree / "pseudo").resolve())
