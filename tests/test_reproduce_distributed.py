"""``mars reproduce`` under torchrun (2 gloo CPU ranks): the same files as one process (features,
centroids, debiased labels, scores), one summary line per rank and stage naming its share, and a
killed run resumed by two ranks."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_distributed import _free_port
from test_features_distributed import _env
from test_reproduce import DATA, _tiny_stego_files, make_tree

pytestmark = pytest.mark.slow  # minutes of processes on 2 cores: left out of the fast subset

N = 7  # rank 0 of 2 takes ids 0, 2, 4, 6 (4 images), rank 1 ids 1, 3, 5 (3)


def _cli(args, ranks: int, timeout: int = 300):
    head = [sys.executable]
    if ranks > 1:
        head += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_free_port()),
                 "--tee", "3"]
    return subprocess.run(head + ["-m", "mars_plugin.cli", *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reproduce_ddp")
    world, root, pseudo, _ = make_tree(tmp, n=N, size=32)
    b, h = _tiny_stego_files(tmp)

    def args(out):
        return ["reproduce", "--root", root, "--data", DATA, "--pseudo", pseudo, "--out", out, "--backbone", b,
                "--heads", h, "--no-progress", "--threads", "1", "--batch-size", "2"]

    one = tmp / "one"
    res = _cli(args(one), 1)
    assert res.returncode == 0, res.stderr[-3000:]
    return args, one, world


def _same_outputs(got: Path, want: Path) -> None:
    for sub, load in (("features", lambda p: torch.load(p, weights_only=True)), ("debiased", Path.read_bytes)):
        # every file but the folder's record (.mars-run.*: per rank, see mars_plugin.runs.run_record)
        names = sorted(p.name for p in (want / sub).iterdir() if not p.name.startswith(".mars-run"))
        assert sorted(p.name for p in (got / sub).iterdir() if not p.name.startswith(".mars-run")) == names, sub
        for n in names:
            a, b = load(got / sub / n), load(want / sub / n)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (sub, n)
    a = torch.load(got / "centroids.pt", weights_only=True)
    b = torch.load(want / "centroids.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor) and a[k].is_floating_point():
            # The ranks gather their sums in another order than one process adds them (as for
            # mars centroids, tests/test_distributed.py): float rounding, nothing more.
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, equal_nan=True, msg=k)
        else:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    assert json.loads((got / "scores.json").read_text()) == json.loads((want / "scores.json").read_text())
    assert (got / "report.md").is_file()


def _shares(stdout: str, stage: str):
    """{rank: (done, already done)} of the stage's per-rank lines (torchrun's [default<r>] prefix
    must agree with the rank the line names)."""
    got = {}
    for m in re.finditer(rf"^\[default(\d)\]:  {stage} rank (\d)/2: (\d+) done(?:, (\d+) already done)?, 0 skipped$",
                         stdout, re.M):
        assert m.group(1) == m.group(2), m.group(0)
        got[int(m.group(2))] = (int(m.group(3)), int(m.group(4) or 0))
    return got


def test_two_ranks_write_what_one_process_writes(setup, tmp_path):
    args, one, _ = setup
    out = tmp_path / "two"
    res = _cli(args(out), 2)
    assert res.returncode == 0, res.stderr[-3000:]
    _same_outputs(out, one)
    assert _shares(res.stdout, "features") == {0: (4, 0), 1: (3, 0)}, res.stdout
    assert _shares(res.stdout, "debias") == {0: (4, 0), 1: (3, 0)}, res.stdout
    assert res.stdout.count("mIoU of the labels") == 1  # rank 0 alone reports
    for sub in ("features", "debiased"):  # each rank journals the files it wrote (mars_plugin.runs.run_record)
        assert sorted(p.name for p in (out / sub).glob(".mars-run.files.*")) == [f".mars-run.files.{r}.jsonl"
                                                                                 for r in (0, 1)], sub


def test_a_killed_run_resumes_on_two_ranks(setup, tmp_path):
    args, one, world = setup
    out = tmp_path / "resume"
    shutil.copytree(one, out)
    # Killed during debias: features 1 and 2 and three debiased labels were never written, and
    # reproduce.json holds the stages before features.
    for i in (1, 2):
        (out / "features" / f"{world.stems[i]}.pt").unlink()
    for i in (0, 3, 5):
        (out / "debiased" / f"{world.stems[i]}.png").unlink()
    state = json.loads((out / "reproduce.json").read_text())
    state["stages"] = {}
    (out / "reproduce.json").write_text(json.dumps(state))
    (out / "scores.json").unlink()
    res = _cli(args(out), 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _shares(res.stdout, "features") == {0: (1, 3), 1: (1, 2)}, res.stdout
    assert _shares(res.stdout, "debias") == {0: (1, 3), 1: (2, 1)}, res.stdout
    _same_outputs(out, one)


def test_a_failure_on_one_rank_stops_both(setup, tmp_path):
    args, _, world = setup
    # A corrupt image of rank 1's share (id 3): both ranks stop, no hang, the file is named. A
    # truncated JPEG: its header reads (the plan, which reads headers, passes it), its pixels do
    # not, so the features stage meets it on rank 1.
    import mars_plugin

    root = Path(args(tmp_path)[2])
    tree = tmp_path / "root"
    shutil.copytree(root, tree)
    jpeg = tree / DATA / "train_aug" / "image" / f"{world.stems[3]}.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:-40])
    a = args(tmp_path / "out")
    a[a.index("--root") + 1] = tree
    res = _cli(a, 2, timeout=240)
    assert res.returncode != 0
    assert world.stems[3] in res.stderr
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "out" / "features").iterdir())
    assert mars_plugin  # imported: the package is on the path the ranks use


#: A process holding mars's lock on argv[1] (as a run in progress would) until it is killed.
HOLD = ("import sys, time\nfrom mars_plugin.runs.run_lock import RunLock\n"
        "RunLock(sys.argv[1], 'a test', 'mars test-holder').acquire()\nprint('locked', flush=True)\ntime.sleep(300)")


def test_a_run_holding_out_stops_both_ranks(setup, tmp_path):
    """One run at a time into --out: rank 0 finds the lock held and refuses, naming the holder;
    rank 1 stops too (share_error), nothing is computed, no rank hangs."""
    args, _, _ = setup
    out = tmp_path / "held"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / ".mars-run.lock")], stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _cli(args(out), 2, timeout=240)  # a hang would raise TimeoutExpired
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode != 0
    assert re.search(rf"^\[default0\]:mars reproduce: error: --out {re.escape(str(out))} is in use by another run "
                     rf"\(pid {holder.pid} on host ", res.stderr, re.M), res.stderr[-3000:]
    # rank 1 learns it where the ranks meet (torchrun may stop it before it prints)
    for m in re.finditer(r"^\[default1\]:mars reproduce: error: (.*)$", res.stderr, re.M):
        assert m.group(1).startswith(f"rank 0 stopped: --out {out} is in use"), m.group(0)
    assert sorted(p.name for p in out.iterdir()) == [".mars-run.lock"]  # the holder's: nothing written


def _refused_worker(rank, world_size, port, argv, result_dir):
    """reproduce() itself on a spawned gloo rank (no torchrun to stop the other ranks)."""
    import os

    import torch.distributed as dist

    from mars_plugin.commands.reproduce import reproduce

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        reproduce(*argv["paths"], **argv["kw"], progress=False, log=lambda line: None)
        result = "finished"
    except Exception as e:  # noqa: BLE001 -- the test reads it
        result = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}.txt").write_text(result)


def test_a_refusal_on_rank_0_reaches_every_rank_of_a_spawned_group(setup, tmp_path):
    """Without torchrun to stop them, the other ranks learn rank 0's refusal where the ranks meet
    (share_error) instead of waiting for it forever."""
    import time

    import torch.multiprocessing as tmp

    args, _, _ = setup
    a = args(tmp_path / "held")
    val = {k: a[a.index(k) + 1] for k in ("--root", "--pseudo", "--backbone", "--heads", "--out")}
    (tmp_path / "held").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "held" / ".mars-run.lock")],
                              stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        argv = {"paths": [str(val["--root"]), str(val["--pseudo"]), str(val["--out"])],
                "kw": {"data": DATA, "backbone": str(val["--backbone"]), "heads": str(val["--heads"])}}
        ctx = tmp.spawn(_refused_worker, args=(2, _free_port(), argv, str(tmp_path)), nprocs=2, join=False)
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("a rank still waits 120 s after rank 0 refused")
    finally:
        holder.kill()
        holder.wait()
    r0, r1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert r0.startswith(f"JobError: --out {val['--out']} is in use by another run (pid {holder.pid} "), r0
    assert r1 == "JobError: rank 0 stopped: " + r0[len("JobError: "):], r1
