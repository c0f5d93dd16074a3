"""A full disk during a write (issue 30, class 4): one line that names the file that could not be
written, why (ENOSPC) and that nothing is lost, never a traceback; the file there before is
unchanged and no temporary file is left. The disk is made full for real: the temporary file of
the chosen atomic write is a link to /dev/full, whose every write fails with ENOSPC."""
import errno
import os
import tempfile

import numpy as np
import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.files import WriteError, write_features, write_label
from mars_plugin.networks.seg_checkpoint import load_checkpoint
from mars_plugin.commands.train import CHECKPOINT_NAME

from test_train import _cli_args, _tree

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def _full_disk(monkeypatch, suffix: str, after: int = 0) -> None:
    """Atomic writes of files ending in ``suffix``, after the first ``after`` of them, meet a full disk."""
    real = tempfile.mkstemp
    seen = [0]

    def mkstemp(*args, **kwargs):
        fd, tmp = real(*args, **kwargs)
        if tmp.endswith(suffix):
            seen[0] += 1
            if seen[0] > after:
                os.unlink(tmp)
                os.symlink("/dev/full", tmp)
        return fd, tmp

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _tree(tmp_path_factory.mktemp("full_disk_tree"), n=4)


def _train(tree, out, *extra):
    argv = _cli_args(tree, out, ("--save-every", "1", *extra))
    argv[argv.index("--iterations") + 1] = "2"
    return cli.main(argv)


@pytest.mark.slow
def test_mars_train_on_a_full_disk_says_the_last_checkpoint_is_intact(tree, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _full_disk(monkeypatch, ".pt", after=1)  # the checkpoint of step 1 is written, that of step 2 is not
    capsys.readouterr()
    assert _train(tree, out) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if not line.startswith("mars train: warning: ")] == [
        f"mars train: error: cannot write the checkpoint {out / CHECKPOINT_NAME} (No space left on device); "
        "nothing is lost: the checkpoint there, of the last save, is intact, and the run resumes from it when "
        "run again once there is space"], err
    assert load_checkpoint(out / CHECKPOINT_NAME)["iteration"] == 1
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.undo()
    assert _train(tree, out) == 0
    assert "resumed at 1" in capsys.readouterr().out
    assert load_checkpoint(out / CHECKPOINT_NAME)["iteration"] == 2


def test_mars_train_on_a_full_disk_before_any_checkpoint(tree, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _full_disk(monkeypatch, ".pt")
    capsys.readouterr()
    assert _train(tree, out) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if not line.startswith("mars train: warning: ")] == [
        f"mars train: error: cannot write the checkpoint {out / CHECKPOINT_NAME} (No space left on device); "
        "no checkpoint had been saved yet: the run starts over when run again once there is space"], err
    assert not (out / CHECKPOINT_NAME).exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]


WRITERS = {
    "features .pt (torch.save)": ("f.pt", lambda p, v: write_features(p, torch.full((2, 3, 3), float(v)))),
    "features .npy": ("f.npy", lambda p, v: write_features(p, np.full((2, 3, 3), v, np.float32))),
    "label .png": ("l.png", lambda p, v: write_label(p, torch.full((5, 6), v, dtype=torch.long))),
    "centroids (torch.save)": ("V.pt", lambda p, v: _centroids(v).save(p)),
}


def _centroids(v):
    from mars_plugin.method.selection import select_centroids

    feats = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(int(v)))
    label = torch.zeros(6, 6, dtype=torch.long)
    label[1:4, 1:4] = 1
    return select_centroids([(feats, label)], num_classes=1)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_atomic_writer_names_its_file_on_a_full_disk(tmp_path, monkeypatch, writer):
    name, write = WRITERS[writer]
    path = tmp_path / name
    write(path, 1)
    before = path.read_bytes()
    _full_disk(monkeypatch, os.path.splitext(name)[1])
    with pytest.raises(WriteError) as e:
        write(path, 2)
    assert str(e.value) == (f"cannot write {path} (No space left on device); the file there before, if any, "
                            "is unchanged")
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
