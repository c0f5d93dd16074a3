"""A restart leaves no other run's outputs behind (issue 41, class 6).

``mars crf --restart`` and ``mars train --restart`` first move every output of the earlier run
into ``--out/.mars-stale/<UTC time>-<run id>/`` (with the record that describes them), through
the one door :mod:`mars_plugin.runs.output_aside`: nothing is deleted, nothing of the earlier run
stays beside the new run's files, and ``mars evaluate`` on the folder scores only the new run's
labels. Families: crf from ``--write labels`` to ``--write probs`` and back, a restart with an
input gone, a restart interrupted half-way, a restart that cannot move a file (refused, nothing
written), the summary line naming the subfolder; train's checkpoint, log and ``train.json``; and
the door itself (no module deletes an output, no module but the door names ``.mars-stale``).
Tiny inputs: ``mars sample``'s seam tree (40 px), random probability maps; test_train's tree.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars_plugin.cli import main
from mars_plugin.commands.crf_job import crf_job
from mars_plugin.commands.evaluate import evaluate_job
from mars_plugin.commands.sample_trees import LAYOUTS, write_sample_tree
from mars_plugin.runs.errors import JobError
from mars_plugin.runs.output_aside import STALE_DIR

N, SIZE, L = 4, 40, 21
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart") / "t"
    write_sample_tree("seam", root, num_images=N, size=SIZE, seed=4)
    return root / LAYOUTS["seam"]["images"], root / LAYOUTS["seam"]["gt"]


def _probs(folder: Path, images: Path, seed: int) -> Path:
    """One (L, H, W) probability map per image (random: each seed another run's input)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for p in sorted(images.iterdir()):
        q = rng.dirichlet(np.ones(L) * 0.3, size=(SIZE, SIZE)).transpose(2, 0, 1).astype(np.float32)
        np.save(folder / f"{p.stem}.npy", q)
    return folder


def _files(folder: Path):
    """{name: bytes} of the files directly in ``folder`` (records and .mars-stale/ left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def _subfolders(out: Path):
    return sorted((out / STALE_DIR).iterdir()) if (out / STALE_DIR).is_dir() else []


def _crf(images, probs, out, **kw):
    return crf_job(images, out, probs_dir=probs, progress=False, **kw)


def _evaluate(pred: Path, gt: Path, capsys):
    capsys.readouterr()
    rc = main(["evaluate", "--pred", str(pred), "--gt", str(gt), "--num-classes", "20", "--no-progress"])
    return rc, capsys.readouterr()


def test_restart_from_labels_to_probs_moves_the_labels_aside(sample, tmp_path, capsys):
    """The PNGs of the earlier --write labels leave --out (bytes unchanged) with its record;
    mars evaluate then finds no label to score instead of scoring the earlier run's."""
    images, gt = sample
    probs, out = _probs(tmp_path / "p", images, 0), tmp_path / "out"
    _crf(images, probs, out)
    labels = _files(out)
    record = {p.name: p.read_bytes() for p in out.glob(".mars-run.*")}
    assert len(labels) == N and _evaluate(out, gt, capsys)[0] == 0
    s = _crf(images, probs, out, write="probs", restart=True)
    assert (s.done, s.existing) == (N, 0) and sorted(_files(out)) == sorted(n.replace(".png", ".npy") for n in labels)
    (sub,) = _subfolders(out)
    assert _files(sub) == labels and s.earlier == sorted(labels) and s.aside == f".mars-stale/{sub.name}/"
    assert {n: (sub / n).read_bytes() for n in record} == record  # the record that describes them, with them
    assert f", {N} of the earlier run moved to .mars-stale/{sub.name}/ (--restart: " in s.line()
    rc, io = _evaluate(out, gt, capsys)
    assert rc == 2 and "--pred" in io.err and "prediction" in io.err, io


def test_restart_back_to_labels_scores_only_the_new_labels(sample, tmp_path, capsys):
    """labels (maps A) -> --restart probs (maps B) -> --restart labels (maps B): --out holds the
    labels of B alone, equal to a fresh run's, and scores as they do; each restart's files in
    its own subfolder."""
    images, gt = sample
    a, b, out = _probs(tmp_path / "a", images, 1), _probs(tmp_path / "b", images, 2), tmp_path / "out"
    _crf(images, a, out)
    first = _files(out)
    _crf(images, b, out, write="probs", restart=True)
    middle = _files(out)
    s = _crf(images, b, out, restart=True)
    _crf(images, b, tmp_path / "fresh")
    assert _files(out) == _files(tmp_path / "fresh") != first
    one, two = _subfolders(out)
    assert (_files(one), _files(two)) == (first, middle) and s.aside == f".mars-stale/{two.name}/"
    assert _evaluate(out, gt, capsys)[1].out == _evaluate(tmp_path / "fresh", gt, capsys)[1].out


def test_restart_with_an_input_gone_leaves_no_label_of_it(sample, tmp_path, capsys):
    """The same --write, an input removed: its label goes aside with the rest (before issue 41 the
    restart forgot the record, the label stayed unrecorded and mars evaluate scored it)."""
    images, gt = sample
    probs, out = _probs(tmp_path / "p", images, 3), tmp_path / "out"
    _crf(images, probs, out)
    gone = sorted(probs.iterdir())[1]
    gone.unlink()
    s = _crf(images, probs, out, restart=True)
    assert s.done == N - 1 and s.notes == [] and f"{gone.stem}.png" not in _files(out)
    (sub,) = _subfolders(out)
    assert f"{gone.stem}.png" in _files(sub)
    rc, io = _evaluate(out, gt, capsys)
    assert rc == 2 and gone.stem in io.err


def test_an_interrupted_restart_leaves_none_of_the_earlier_run(sample, tmp_path, monkeypatch):
    """Killed after two files, a restart's --out holds those two, recorded, and nothing of the
    earlier run (which went aside whole); the next run resumes from them."""
    import mars_plugin.commands.crf_job as job

    images, gt = sample
    out = tmp_path / "out"
    _crf(images, _probs(tmp_path / "a", images, 4), out)
    earlier = _files(out)
    b = _probs(tmp_path / "b", images, 5)
    real, calls = job._finish, []

    def dies_on_the_third(item):
        calls.append(item[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(item)

    monkeypatch.setattr(job, "_finish", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        _crf(images, b, out, restart=True, batch_size=1)
    monkeypatch.setattr(job, "_finish", real)
    assert sorted(_files(out)) == sorted(f"{stem}.png" for stem in calls[:2])
    (sub,) = _subfolders(out)
    assert _files(sub) == earlier
    s = _crf(images, b, out)
    assert (s.existing, s.done) == (2, N - 2)


def test_a_restart_that_cannot_move_aside_is_refused_and_writes_nothing(sample, tmp_path, capsys):
    images, _ = sample
    probs, out = _probs(tmp_path / "p", images, 6), tmp_path / "out"
    _crf(images, probs, out)
    before = _files(out)
    (out / STALE_DIR).write_text("not a folder")
    capsys.readouterr()
    rc = main(["crf", "--probs", str(probs), "--images", str(images), "--out", str(out), "--write", "probs",
               "--restart", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {out}: cannot make .mars-stale/" in err and len(err.strip().splitlines()) == 1
    assert _files(out) == before and (out / ".mars-run.json").is_file()


def test_mars_crf_restart_prints_where_the_earlier_run_went(sample, tmp_path, capsys):
    images, _ = sample
    probs, out = _probs(tmp_path / "p", images, 7), tmp_path / "out"
    argv = ["crf", "--probs", str(probs), "--images", str(images), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    names = sorted(_files(out))
    capsys.readouterr()
    assert main(argv + ["--write", "probs", "--restart"]) == 0
    (sub,) = _subfolders(out)
    assert capsys.readouterr().out.strip() == (
        f"crf -> {out}: {N} written, 0 skipped, {N} of the earlier run moved to .mars-stale/{sub.name}/ "
        f"(--restart: {', '.join(names[:3])}, ...)")


# ---------------------------------------------------------------------------- mars train


@pytest.mark.slow
def test_train_restart_moves_the_earlier_checkpoint_log_and_settings_aside(tmp_path, capsys):
    """The earlier run's checkpoint.pt, log.jsonl and train.json move aside together, bytes
    unchanged (before issue 41 the checkpoint and log were deleted); the new run's log starts at
    step 1, and the line on stdout says where the earlier files went."""
    from mars_plugin.commands.train_data import CHECKPOINT_NAME, LOG_NAME, SETTINGS_NAME
    from test_train import _cli_args, _tree

    tree, out = _tree(tmp_path / "t"), tmp_path / "run"
    argv = _cli_args(tree, out, ["--iterations", "2"])
    assert main(argv) == 0
    earlier = {n: (out / n).read_bytes() for n in (CHECKPOINT_NAME, LOG_NAME, SETTINGS_NAME)}
    capsys.readouterr()
    assert main(argv + ["--restart"]) == 0
    (sub,) = _subfolders(out)
    assert _files(sub) == earlier
    assert [json.loads(x)["iteration"] for x in (out / LOG_NAME).read_text().splitlines()] == [1, 2]
    assert capsys.readouterr().out.strip().endswith(
        f"; the earlier run's checkpoint.pt, log.jsonl, train.json moved to .mars-stale/{sub.name}/")


# ---------------------------------------------------------------------------- the door


def _sources():
    return sorted(p for d in ("mars_plugin", "adapters") for p in (ROOT / d).rglob("*.py"))


#: The modules that may delete a file: each deletes only its own temporaries or its own tree
#: (atomic writes, the lock file, a report's temporary, mars demo's and mars sample's own folders,
#: the synthetic world's own files, the selection's spill folder).
MAY_DELETE = {"formats/files.py", "runs/run_lock.py", "commands/report.py", "commands/demo.py",
              "commands/sample_trees.py", "worlds/synthetic.py", "method/selection_stream.py"}


def _deletes(tree: ast.AST):
    """The lines of ``<path>.unlink()``, ``os.remove/unlink()`` and ``shutil.rmtree()`` calls."""
    def deletes(f: ast.Attribute) -> bool:
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        return f.attr == "unlink" or (owner == "os" and f.attr == "remove") or (owner == "shutil" and f.attr == "rmtree")

    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and deletes(node.func)]


def test_no_command_deletes_an_output():
    """An output leaves its folder through runs/output_aside.py (moved, never deleted): a
    ``.unlink()`` / ``os.remove`` / ``shutil.rmtree`` anywhere else fails here (before issue 41:
    crf_job's and train's --restart, reproduce's labels of ids it leaves out)."""
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _sources()
             if not (p.is_relative_to(ROOT / "mars_plugin") and str(p.relative_to(ROOT / "mars_plugin")) in MAY_DELETE)
             for line in _deletes(ast.parse(p.read_text()))]
    assert found == []


def test_the_door_catches_a_delete():
    assert _deletes(ast.parse("import os\n(out / 'a.png').unlink()\nos.remove('b')\n")) == [2, 3]


def test_only_the_door_names_the_stale_folder():
    """``.mars-stale`` is spelled in one module (docstrings aside): every other one imports
    STALE_DIR or goes through OutputAside, so that no command moves files there its own way."""
    found = []
    for p in _sources():
        if p.name == "output_aside.py":
            continue
        tree = ast.parse(p.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{p.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and "mars-stale" in n.value and id(n) not in docs]
    assert found == []


def test_readers_never_see_the_stale_folder(sample, tmp_path):
    """What a folder reader lists skips .mars-stale/ (a dot folder): the labels moved there are
    not evaluated, not trained on."""
    from mars_plugin.formats.files import list_stems

    images, gt = sample
    probs, out = _probs(tmp_path / "p", images, 8), tmp_path / "out"
    _crf(images, probs, out)
    _crf(images, probs, out, write="probs", restart=True)
    assert list_stems(out, (".png",)) == [] and sorted(list_stems(out, (".npy",))) == sorted(
        p.stem for p in probs.iterdir())
    with pytest.raises(JobError, match="--pred"):
        evaluate_job(out, gt, 20, progress=False)
    assert Image.open(next(_subfolders(out)[0].glob("*.png"))).mode == "P"  # the labels, whole, aside


def test_every_command_with_restart_is_in_this_family():
    """The commands whose parser has ``--restart`` are the ones tested above (crf, train): a new
    one fails here until its restart goes through the door and gets its test."""
    import argparse

    from mars_plugin.commands.cli_parser import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    with_restart = {name for name, p in sub.choices.items()
                    if any("--restart" in a.option_strings for a in p._actions)}
    assert with_restart == {"crf", "train"}
