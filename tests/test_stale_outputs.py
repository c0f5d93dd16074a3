"""Stale outputs (issue 30, class 9; issue 41, class 5): the output of an input that is gone
leaves ``--out``, and nothing computed is ever lost.

Families, for each folder job (``mars features``, ``mars predict``, ``mars debias``, ``mars
crf``): an input removed between two runs takes its output with it into this run's own
subfolder ``.mars-stale/<UTC time>-<run id>/``, the others are kept (not computed again), the
summary names what was moved and where, and a second rerun changes nothing; an input of the same
stem that goes away a second time keeps both stale outputs, each in its run's subfolder (issue
41, class 5); a file the user put into ``--out`` and a recorded output the user changed since
are kept and named in a warning; a run on a part of the inputs (``stems``) removes nothing of
the rest; under two torch.distributed ranks rank 0 alone removes. Tiny inputs:
:func:`mars_plugin.worlds.synthetic.write_world` (32 px), a plain callable extractor, a random
two-layer network, random probability maps for ``mars crf --probs``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F

from mars_plugin.commands.centroids import centroids_job
from mars_plugin.commands.crf_job import crf_job
from mars_plugin.commands.debias import debias_job
from mars_plugin.commands.features import features_job
from mars_plugin.commands.predict import predict_job
from mars_plugin.runs.run_record import STALE_DIR
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

from test_predict import Net

N, SIZE = 5, 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pool(images, output_size=None):
    """A plain callable extractor (picklable for spawned ranks): 4x4 mean colours."""
    return F.avg_pool2d(images.float() / 255, 4)


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("stale") / "world"
    world = make_world(N, size=SIZE, seed=3)
    paths = write_world(world, root)
    centroids_job(paths["features"], paths["labels"], world.num_classes, root.parent / "V.pt", progress=False)
    return world, paths


class Job:
    """One folder job on a copy of the world: ``run()`` into ``out``, ``remove(stem)`` its
    defining input."""

    def __init__(self, kind: str, syn, tmp_path: Path, **kw):
        world, paths = syn
        shutil.copytree(paths["root"], tmp_path / "world")
        shutil.copy2(paths["root"].parent / "V.pt", tmp_path / "V.pt")
        self.p = {k: tmp_path / "world" / Path(v).relative_to(paths["root"]) for k, v in paths.items()
                  if k != "root"}
        self.kind, self.kw, self.stems = kind, kw, list(world.stems)
        self.V = tmp_path / "V.pt"
        self.out = tmp_path / "out"
        self.ext = ".npy" if kind == "features" else ".png"
        if kind == "crf":  # (3, H, W) probability maps, one per image
            self.p["probs"] = tmp_path / "world" / "probs"
            self.p["probs"].mkdir()
            rng = np.random.default_rng(0)
            for stem in self.stems:
                q = rng.dirichlet(np.ones(3), size=(SIZE, SIZE)).transpose(2, 0, 1).astype(np.float32)
                np.save(self.p["probs"] / f"{stem}.npy", q)

    def run(self, **more):
        kw = dict(self.kw, **more)
        if self.kind == "features":
            return features_job(_pool, self.p["images"], self.out, progress=False, **kw)
        if self.kind == "predict":
            return predict_job(Net(), self.p["images"], self.out, crf="none", scales=(1.0,), flip=False,
                               progress=False, **kw)
        if self.kind == "crf":
            return crf_job(self.p["images"], self.out, probs_dir=self.p["probs"], progress=False, **kw)
        return debias_job(self.p["features"], self.p["labels"], self.V, self.out, refine="threshold",
                          progress=False, **kw)

    def input_of(self, stem: str) -> Path:
        """The input that makes ``stem`` an id of this job."""
        folder = {"features": "images", "predict": "images", "debias": "labels", "crf": "probs"}[self.kind]
        return self.p[folder] / f"{stem}{'.npy' if self.kind == 'crf' else '.png'}"

    def remove(self, stem: str) -> None:
        """Remove the input that makes ``stem`` an id of this job."""
        self.input_of(stem).unlink()

    def outputs(self):
        """{name: mtime_ns} of the folder's outputs (the record left out)."""
        return {p.name: p.stat().st_mtime_ns for p in sorted(self.out.iterdir()) if not p.name.startswith(".")}

    def journal_ids(self):
        return sorted(json.loads(line)["id"] for p in self.out.glob(".mars-run.files.*.jsonl")
                      for line in p.read_text().splitlines())


def aside(out: Path):
    """{subfolder: sorted file names} of ``out/.mars-stale/`` (the run's records left out)."""
    return {d.name: sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else None
            for d in sorted((out / STALE_DIR).iterdir())} if (out / STALE_DIR).is_dir() else {}


KINDS = ["features", "predict", "debias", "crf"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_of_a_removed_input_is_removed_and_the_others_kept(syn, tmp_path, kind):
    job = Job(kind, syn, tmp_path)
    job.run()
    before = job.outputs()
    gone = job.stems[1]
    job.remove(gone)
    s = job.run()
    name = gone + job.ext
    assert (s.done, s.existing, s.stale, s.notes) == (0, N - 1, [name], [])
    (sub, names), = aside(job.out).items()
    assert names == [name] and s.aside == f".mars-stale/{sub}/"
    assert f"1 stale moved to .mars-stale/{sub}/ (their inputs are gone: {name})" in s.line()
    assert job.outputs() == {k: v for k, v in before.items() if k != name}  # the others untouched
    assert gone not in job.journal_ids() and len(job.journal_ids()) == N - 1
    # idempotent: nothing more to remove, nothing written
    s = job.run()
    assert (s.done, s.existing, s.stale, s.notes) == (0, N - 1, [], [])
    assert job.outputs() == {k: v for k, v in before.items() if k != name}


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_the_user_put_in_out_is_kept_and_named(syn, tmp_path, kind):
    job = Job(kind, syn, tmp_path)
    job.run()
    mine = job.out / f"zz_mine{job.ext}"
    shutil.copy2(job.out / f"{job.stems[0]}{job.ext}", mine)  # same bytes, not written by the job
    gone = job.stems[2]
    job.remove(gone)
    for _ in range(2):
        s = job.run()
        assert mine.is_file()
        assert s.notes == [f"--out {job.out} holds 1 file(s) with no input (zz_mine{job.ext}): not made by this "
                           "command or changed since, so kept; move them"]
        assert f"warning: {s.notes[0]}" in s.warning_lines()
    assert not (job.out / f"{gone}{job.ext}").exists() and list(aside(job.out).values()) == [[f"{gone}{job.ext}"]]


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_output_changed_since_is_kept_and_named(syn, tmp_path, kind):
    job = Job(kind, syn, tmp_path)
    job.run()
    gone, other = job.stems[0], job.stems[3]
    edited = job.out / f"{gone}{job.ext}"
    touched = job.out / f"{other}{job.ext}"
    with open(edited, "ab") as f:  # another size
        f.write(b"\0")
    job.remove(gone)
    job.remove(other)
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same size, another mtime
    for _ in range(2):
        s = job.run()
        assert edited.is_file() and touched.is_file() and s.stale == []
        assert s.notes and f"2 file(s) with no input ({gone}{job.ext}, {other}{job.ext})" in s.notes[0]
    assert gone not in job.journal_ids() and other not in job.journal_ids()


def test_a_run_on_some_ids_removes_only_outputs_of_gone_inputs(syn, tmp_path):
    """``stems`` is a filter: the outputs of the other ids, whose images exist, are kept."""
    job = Job("features", syn, tmp_path)
    job.run()
    gone = job.stems[4]
    job.remove(gone)
    s = job.run(stems=job.stems[:2])
    assert (s.done, s.existing, s.stale) == (0, 2, [f"{gone}.npy"])
    assert sorted(job.outputs()) == [f"{x}.npy" for x in job.stems[:4]]


def test_malformed_journal_lines_are_dropped_not_followed(syn, tmp_path):
    """A torn line (a killed run) and a line of wrong types describe nothing: dropped when the
    journal is rewritten, never a reason to remove a file or to stop."""
    job = Job("features", syn, tmp_path)
    job.run()
    journal = job.out / ".mars-run.files.0.jsonl"
    mine = job.out / "zz.npy"
    np.save(mine, np.zeros(1, np.float16))
    st = mine.stat()
    with open(journal, "a") as f:
        f.write(json.dumps({"id": "zz", "out": ["zz.npy", str(st.st_size), st.st_mtime_ns]}) + "\n")
        f.write('{"id": "zz", "out": ["zz.npy", ')
    gone = job.stems[0]
    job.remove(gone)
    s = job.run()
    assert s.stale == [f"{gone}.npy"] and mine.is_file() and "(zz.npy)" in s.notes[0]
    assert "zz" not in journal.read_text() and job.journal_ids() == sorted(job.stems[1:])


def test_debias_a_removed_feature_file_removes_the_label(syn, tmp_path):
    """The label of an id whose features are gone is stale too; the id is then that file's
    failure (its pseudo label is still there)."""
    job = Job("debias", syn, tmp_path, on_error="skip")
    job.run()
    gone = job.stems[1]
    (job.p["features"] / f"{gone}.npy").unlink()
    s = job.run()
    assert s.stale == [f"{gone}.png"] and [stem for stem, _ in s.failed] == [gone]
    assert not (job.out / f"{gone}.png").exists() and list(aside(job.out).values()) == [[f"{gone}.png"]]


# ------------------------------------------------------- issue 41, class 5: nothing computed is lost


@pytest.mark.parametrize("kind", KINDS)
def test_an_input_gone_twice_keeps_both_stale_outputs(syn, tmp_path, kind):
    """An input of one stem goes away, comes back (other content: another output), goes away
    again: the two stale outputs, each as it was in --out, in two subfolders of .mars-stale/,
    and each run's summary names its own (before issue 41 the second overwrote the first)."""
    job = Job(kind, syn, tmp_path)
    job.run()
    gone = job.stems[2]
    name = gone + job.ext
    first = (job.out / name).read_bytes()
    kept = job.input_of(gone).read_bytes()
    job.remove(gone)
    s1 = job.run()
    other = job.input_of(job.stems[0]).read_bytes()  # comes back as another input: another output
    job.input_of(gone).write_bytes(other)
    assert job.run().done == 1
    second = (job.out / name).read_bytes()
    job.remove(gone)
    s2 = job.run()
    subs = aside(job.out)
    assert list(subs.values()) == [[name], [name]]
    one, two = (job.out / STALE_DIR / sub / name for sub in subs)
    assert (one.read_bytes(), two.read_bytes()) == (first, second)
    assert {s1.aside, s2.aside} == {f".mars-stale/{sub}/" for sub in subs} and s1.aside < s2.aside
    assert f"1 stale moved to {s2.aside} (their inputs are gone: {name})" in s2.line()
    assert kept != other or kind == "crf"  # (the maps are random: other anyway)


def test_two_runs_of_one_second_get_two_subfolders(tmp_path, monkeypatch):
    """The subfolder is the UTC time and a random run id: two runs of one instant (the clock
    held still here) never share one, nor does a collision of the random ids."""
    import mars_plugin.runs.output_aside as oa

    monkeypatch.setattr(oa.time, "time_ns", lambda: 7 * 10**9 + 123456789)
    ids = iter(["aaaaaa", "aaaaaa", "bbbbbb"])  # the second run draws the first one's id once
    monkeypatch.setattr(oa.secrets, "token_hex", lambda n: next(ids))
    for run in range(2):
        (tmp_path / "a.png").write_bytes(b"run %d" % run)
        oa.OutputAside(tmp_path, "--out x").move("a.png")
    subs = sorted((tmp_path / STALE_DIR).iterdir())
    assert [d.name for d in subs] == ["19700101T000007.123456Z-aaaaaa", "19700101T000007.123456Z-bbbbbb"]
    assert [(d / "a.png").read_bytes() for d in subs] == [b"run 0", b"run 1"]


def test_a_move_never_overwrites(tmp_path):
    """A name already in the run's subfolder is refused, naming it; both files stay."""
    from mars_plugin.runs.errors import JobError
    from mars_plugin.runs.output_aside import OutputAside

    (tmp_path / "a.png").write_bytes(b"first")
    out = OutputAside(tmp_path, "--out x")
    out.move("a.png")
    (tmp_path / "a.png").write_bytes(b"second")
    with pytest.raises(JobError, match=r"--out x: cannot move a\.png to \.mars-stale/.*already holds a a\.png"):
        out.move("a.png")
    assert (out.path / "a.png").read_bytes() == b"first" and (tmp_path / "a.png").read_bytes() == b"second"


def test_mars_crf_prints_where_the_stale_output_went(syn, tmp_path, capsys):
    from mars_plugin.cli import main

    job = Job("crf", syn, tmp_path)
    argv = ["crf", "--probs", str(job.p["probs"]), "--images", str(job.p["images"]), "--out", str(job.out),
            "--no-progress"]
    assert main(argv) == 0
    job.remove(job.stems[0])
    capsys.readouterr()
    assert main(argv) == 0
    (sub, names), = aside(job.out).items()
    assert names == [f"{job.stems[0]}.png"]
    assert capsys.readouterr().out.strip().endswith(
        f"0 written, {N - 1} already done, 0 skipped, 1 stale moved to .mars-stale/{sub}/ (their inputs are gone: "
        f"{job.stems[0]}.png)")


@pytest.mark.slow
def test_reproduce_moves_the_label_of_an_id_it_leaves_out_aside(tmp_path):
    """mars reproduce's debiased label of an id whose pseudo label is gone goes to
    debiased/.mars-stale/<run>/, bytes unchanged, and the log says where (it was deleted)."""
    from mars_plugin.commands.reproduce import reproduce
    from test_reproduce import DATA, make_tree

    world, root, pseudo, feats = make_tree(tmp_path, n=6, size=32)
    out, logs = tmp_path / "out", []
    reproduce(root, pseudo, out, data=DATA, features_dir=feats, progress=False, log=logs.append)
    gone = world.stems[2]
    label = (out / "debiased" / f"{gone}.png").read_bytes()
    (pseudo / f"{gone}.png").unlink()
    logs.clear()
    reproduce(root, pseudo, out, data=DATA, features_dir=feats, progress=False, log=logs.append)
    assert not (out / "debiased" / f"{gone}.png").exists()
    subs = aside(out / "debiased")
    assert list(subs.values()) == [[f"{gone}.png"]]
    sub = next(iter(subs))
    assert (out / "debiased" / STALE_DIR / sub / f"{gone}.png").read_bytes() == label
    assert f"  debias: 1 label(s) of ids left out moved to .mars-stale/{sub}/ ({gone}.png)" in logs


@pytest.mark.slow
def test_mars_predict_prints_the_removed_and_the_kept(syn, tmp_path, capsys):
    from mars_plugin.cli import main
    from test_predict import _checkpoint

    job = Job("predict", syn, tmp_path)
    ck = _checkpoint(tmp_path / "ck.pt", 3)
    argv = ["predict", "--model", str(ck), "--images", str(job.p["images"]), "--out", str(job.out),
            "--crf", "none", "--scales", "1", "--no-flip", "--no-progress"]
    assert main(argv) == 0
    (job.out / "notes.png").write_bytes(b"mine")
    job.remove(job.stems[0])
    capsys.readouterr()
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (sub, _), = aside(job.out).items()
    assert out.strip() == (f"predictions -> {job.out}: 0 written, {N - 1} already done, 0 skipped, 1 stale moved to "
                           f".mars-stale/{sub}/ (their inputs are gone: {job.stems[0]}.png)")
    assert err == (f"warning: --out {job.out} holds 1 file(s) with no input (notes.png): not made by this command "
                   "or changed since, so kept; move them\n")


# ---------------------------------------------------------------------------- two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world_size, port, images, out, result_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        s = features_job(_pool, images, out, progress=False)
        result = {"existing": s.existing, "done": s.done, "stale": s.stale}
    finally:
        dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_under_two_ranks_rank_0_alone_removes(syn, tmp_path):
    job = Job("features", syn, tmp_path)
    job.run()
    gone = job.stems[3]  # rank 1's share
    job.remove(gone)
    ctx = tmp.spawn(_rank, args=(2, _free_port(), str(job.p["images"]), str(job.out), str(tmp_path)), nprocs=2,
                    join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("spawned ranks still running after 120 s")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["stale"] == [f"{gone}.npy"] and r1["stale"] == []
    assert r0["done"] + r1["done"] == 0 and r0["existing"] + r1["existing"] == N - 1
    assert sorted(job.outputs()) == sorted(f"{x}.npy" for x in job.stems if x != gone)
