"""`mars debias` under torch.distributed (two gloo CPU ranks): a failure on one rank's share (a bad
file) reaches every rank where the ranks meet at the end (share_error, as in mars features), so
no rank finishes as if all went well or waits for the other forever (issue 30, class 4)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from mars_plugin import select_centroids
from mars_plugin.commands.debias import debias_job
from mars_plugin.runs.errors import JobError
from mars_plugin.formats.files import write_features, write_label

from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]
STEMS = [f"s{i}" for i in range(6)]  # sorted: rank 0 of 2 takes s0, s2, s4 and rank 1 s1, s3, s5
BAD = "s3"  # rank 1's share


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Features, pseudo labels and centroids of 6 tiny images; the feature file of ``BAD`` is not a
    feature file."""
    root = tmp_path_factory.mktemp("debias_ranks")
    g = torch.Generator().manual_seed(0)
    pairs = []
    for stem in STEMS:
        f = torch.randn(4, 8, 8, generator=g)
        y = torch.zeros(8, 8, dtype=torch.long)
        y[2:6, 2:6] = 1
        y[0, 0:3] = 2
        write_features(root / "features" / f"{stem}.npy", f)
        write_label(root / "labels" / f"{stem}.png", y)
        pairs.append((f, y))
    select_centroids(iter(pairs), num_classes=2).save(root / "V.pt")
    (root / "features" / f"{BAD}.npy").write_bytes(b"not a numpy file")
    return root


def _job_worker(rank, world_size, port, root, out, result_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = {}
    try:
        try:
            s = debias_job(Path(root) / "features", Path(root) / "labels", Path(root) / "V.pt", out,
                           refine="threshold", progress=False)
            result["summary"] = [s.done, s.existing, len(s.failed)]
        except JobError as e:
            result["error"] = str(e)
    finally:
        dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_a_bad_file_on_rank_1_stops_both_spawned_ranks(world, tmp_path):
    out = tmp_path / "out"
    ctx = tmp.spawn(_job_worker, args=(2, _free_port(), str(world), str(out), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("spawned ranks still running after 180 s: a rank waits forever")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1.get("error", "").startswith(f"{BAD}: "), r1
    assert r0 == {"error": "rank 1 stopped: " + r1["error"]}, r0
    # rank 0's share written (and what rank 1's batch held but the bad file); no half-written file
    written = sorted(p.name for p in out.iterdir() if not p.name.startswith(".mars-run"))
    assert {"s0.png", "s2.png", "s4.png"} <= set(written) <= {f"{s}.png" for s in STEMS if s != BAD}, written


@pytest.mark.slow
def test_torchrun_mars_debias_a_bad_file_on_one_rank_fails_every_rank(world, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "--tee", "3", "-m", "mars_plugin.cli", "debias", "--features", str(world / "features"),
           "--labels", str(world / "labels"), "--centroids", str(world / "V.pt"), "--out", str(out),
           "--refine", "threshold", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)  # a hang: TimeoutExpired
    assert res.returncode != 0
    # no rank prints a traceback (torchrun's own report of the failed rank, unprefixed, has one)
    assert not re.search(r"^\[default\d\]:Traceback", res.stderr, re.M), res.stderr[-3000:]
    m = re.search(rf"^\[default1\]:mars debias: error: ({BAD}: .*)$", res.stderr, re.M)
    assert m, res.stderr[-3000:]
    # rank 0 learns it where the ranks meet (torchrun may stop it as soon as rank 1 exits)
    for line in re.findall(r"^\[default0\]:mars debias: error: (.*)$", res.stderr, re.M):
        assert line == "rank 1 stopped: " + m.group(1), line
    assert "debiased labels ->" not in res.stdout  # no rank says it finished
