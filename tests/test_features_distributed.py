"""`mars features` / features_job under torch.distributed: two gloo CPU ranks (torchrun, or spawned
processes) write what one process writes, in .npy and .pt, resume per file, stop or skip per file on
every rank; which stems each rank takes; the rank helpers of mars_plugin.runs.distributed."""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from PIL import Image

import mars_plugin.commands.features as features_module
from mars_plugin import cli
from mars_plugin.commands.features import features_job
from mars_plugin.runs.errors import JobError
from mars_plugin.runs.distributed import all_ok, barrier, share_error, sync_group

from test_distributed import _free_port
from test_reproduce import _tiny_stego_files

pytestmark = pytest.mark.slow  # minutes of processes on 2 cores: left out of the fast subset

REPO = Path(__file__).resolve().parents[1]
#: 7 images: rank 0 of 2 takes img0, img2, img4, img6 and rank 1 img1, img3, img5.
SIZES = [(16, 24), (24, 16), (32, 32), (16, 16), (24, 32), (32, 24), (16, 32)]
STEMS = [f"img{i}" for i in range(len(SIZES))]


def _env():
    """The repository first on PYTHONPATH (a plain checkout works like an editable install)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _write_images(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for stem, (h, w) in zip(STEMS, SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3)).astype(np.uint8)).save(folder / f"{stem}.png")
    return folder


class World:
    def __init__(self, root: Path):
        self.images = _write_images(root / "images")
        self.backbone, self.heads = _tiny_stego_files(root)
        self.ref = {}

    def args(self, out: Path, fmt: str = "npy", images: Path = None):
        # --batch-size 1: a batch's composition differs between one process and a rank, and a
        # matmul over another batch size may round differently; per image it is the same work.
        return ["features", "--uss", "stego", "--backbone", str(self.backbone), "--heads", str(self.heads),
                "--images", str(images or self.images), "--out", str(out), "--res", "32", "--batch-size", "1",
                "--format", fmt, "--no-progress"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Images, a tiny STEGO in DHR's two files, and what one process writes (one thread, as every
    torchrun rank here runs), for both formats."""
    w = World(tmp_path_factory.mktemp("features_ddp"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fmt in ("npy", "pt"):
            out = w.images.parent / f"one_{fmt}"
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                assert cli.main(w.args(out, fmt)) == 0
            # one process: the line of before, no rank in it
            assert f"features -> {out}: 7 written, 0 skipped" in said.getvalue(), said.getvalue()
            w.ref[fmt] = out
    finally:
        torch.set_num_threads(threads)
    return w


def _torchrun(args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "--tee", "3", "-m", "mars_plugin.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def _rank_lines(stdout: str, out: Path):
    """{rank: (written, already done, skipped)} from the summary lines (torchrun's --tee prefix
    [default<local rank>] must agree with the rank the line names)."""
    got = {}
    for m in re.finditer(r"^\[default(\d)\]:features rank (\d)/2: (\d+) written(?:, (\d+) already done)?, "
                         r"(\d+) skipped -> (.*)$", stdout, re.M):
        assert m.group(1) == m.group(2) and m.group(6) == str(out), m.group(0)
        got[int(m.group(2))] = (int(m.group(3)), int(m.group(4) or 0), int(m.group(5)))
    return got


def _load(path: Path) -> torch.Tensor:
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    return torch.load(path, weights_only=True)


def _outputs(folder: Path):
    """The files of an output folder but its record (.mars-run.*, see mars_plugin.runs.run_record)."""
    return [p for p in folder.iterdir() if not p.name.startswith(".mars-run")]


def _assert_same_files(got: Path, want: Path) -> None:
    names = sorted(p.name for p in _outputs(want))
    assert sorted(p.name for p in _outputs(got)) == names  # nothing more: no .tmp- leftovers
    for name in names:
        a, b = _load(got / name), _load(want / name)
        assert a.dtype == b.dtype == torch.float16 and torch.equal(a, b), name


@pytest.mark.parametrize("fmt", ["npy", "pt"])
def test_torchrun_two_ranks_write_what_one_process_writes(world, tmp_path, fmt):
    out = tmp_path / "two"
    res = _torchrun(world.args(out, fmt))
    assert res.returncode == 0, res.stderr[-3000:]
    assert _rank_lines(res.stdout, out) == {0: (4, 0, 0), 1: (3, 0, 0)}, res.stdout
    assert sum("STEGO on DINO" in line for line in res.stdout.splitlines()) == 1  # said once, by rank 0
    _assert_same_files(out, world.ref[fmt])


def test_an_interrupted_run_resumes_on_two_ranks(world, tmp_path):
    """What a one-process run left (img0, img3 and img4 missing: killed) is finished by two
    ranks: each computes only its missing images and counts the rest as already done."""
    out = tmp_path / "resume"
    shutil.copytree(world.ref["npy"], out)
    for stem in ("img0", "img3", "img4"):
        (out / f"{stem}.npy").unlink()
    res = _torchrun([a for a in world.args(out) if a != "--no-progress"])
    assert res.returncode == 0, res.stderr[-3000:]
    # one progress bar, rank 0's, over its share (tqdm writes to stderr)
    assert re.search(r"^\[default0\]:features rank 0/2: .*4/4", res.stderr, re.M), res.stderr[-3000:]
    assert "[default1]:features" not in res.stderr
    lines = _rank_lines(res.stdout, out)
    assert lines == {0: (2, 2, 0), 1: (1, 2, 0)}, res.stdout  # rank 0: img0, img4; rank 1: img3
    assert sum(done for done, _, _ in lines.values()) == 3 and sum(e for _, e, _ in lines.values()) == 4
    _assert_same_files(out, world.ref["npy"])


def _break(images: Path, stems) -> Path:
    for stem in stems:
        (images / f"{stem}.png").write_bytes(b"\x89PNG\r\n\x1a\n but no image")
    return images


def test_an_unreadable_image_on_rank_1_stops_both_ranks(world, tmp_path):
    images = _break(shutil.copytree(world.images, tmp_path / "images"), ["img3"])  # rank 1's share
    out = tmp_path / "stop"
    start = time.monotonic()
    res = _torchrun(world.args(out, images=images), timeout=180)  # a hang would raise TimeoutExpired
    assert res.returncode != 0 and time.monotonic() - start < 180
    assert re.search(r"^\[default1\]:mars features: error: img3: .*img3\.png", res.stderr, re.M), res.stderr[-3000:]
    # Rank 0 learns it where the ranks meet, after its own share (torchrun may stop it as soon as
    # rank 1 exits, before it prints: spawned ranks below show that it raises).
    for m in re.finditer(r"^\[default0\]:mars features: error: (.*)$", res.stderr, re.M):
        assert m.group(1).startswith("rank 1 stopped: img3: "), m.group(0)
    assert "features rank" not in res.stdout
    # rank 0's share all written, rank 1's up to the bad image, no half-written file
    assert sorted(p.name for p in _outputs(out)) == ["img0.npy", "img1.npy", "img2.npy", "img4.npy", "img6.npy"]


def test_on_error_skip_each_rank_names_its_skipped_file(world, tmp_path):
    images = _break(shutil.copytree(world.images, tmp_path / "images"), ["img2", "img3"])  # one per rank
    out = tmp_path / "skip"
    res = _torchrun(world.args(out, images=images) + ["--on-error", "skip"])
    assert res.returncode == 1, res.stderr[-3000:]  # skipped files: exit 1, as in one process
    assert _rank_lines(res.stdout, out) == {0: (3, 0, 1), 1: (2, 0, 1)}, res.stdout
    for rank, stem in ((0, "img2"), (1, "img3")):
        assert re.search(rf"^\[default{rank}\]:  {stem}: .*{stem}\.png", res.stderr, re.M), res.stderr[-3000:]
    assert sorted(p.stem for p in _outputs(out)) == ["img0", "img1", "img4", "img5", "img6"]


# ---------------------------------------------------------------------------- spawned ranks


def _pool(images, output_size=None):
    """A plain callable extractor (picklable for spawned processes): 4x4 mean colours."""
    return F.avg_pool2d(images.float() / 255, 4)


def _job_worker(rank, world_size, port, images, out, result_dir, mode):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = {}
    try:
        if mode == "helpers":
            group = sync_group()
            result["all_ok"] = [all_ok(True, group), all_ok(rank == 0, group), all_ok(True)]
            try:
                share_error(ValueError("bad file x") if rank == 1 else None, group)
            except Exception as e:  # noqa: BLE001 -- the test reads it
                result["error"] = f"{type(e).__name__}: {e}"
            barrier(group)
            dist.destroy_process_group(group)
        else:
            stems = STEMS[:-1] if mode == "other_lists" and rank == 1 else None
            try:
                s = features_job(_pool, images, out, progress=False, stems=stems, device="auto")
                result["summary"] = [s.done, s.existing, s.failed]
            except JobError as e:
                result["error"] = str(e)
    finally:
        dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def _spawn(tmp_path, mode, images=None, timeout=120):
    """Both ranks' results; fails instead of hanging when a rank waits forever."""
    ctx = tmp.spawn(_job_worker, args=(2, _free_port(), str(images), str(tmp_path / "out"), str(tmp_path), mode),
                    nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"spawned ranks still running after {timeout} s: a rank waits forever")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_spawned_ranks_every_rank_raises_the_stop_of_another(world, tmp_path):
    images = _break(shutil.copytree(world.images, tmp_path / "images"), ["img5"])  # rank 1's share
    r0, r1 = _spawn(tmp_path, "stop", images)
    assert r1["error"].startswith("img5: ") and "img5.png" in r1["error"]
    assert r0["error"] == "rank 1 stopped: " + r1["error"]
    # rank 0's share; rank 1 held img1 and img3 in its batch buffers (batch size 8), never written
    assert sorted(p.stem for p in _outputs(tmp_path / "out")) == ["img0", "img2", "img4", "img6"]


def test_spawned_ranks_refuse_different_work_lists(world, tmp_path):
    r0, r1 = _spawn(tmp_path, "other_lists", world.images)
    for r in (r0, r1):
        assert "ranks see different lists of images to work on (rank 0: 7, rank 1: 6)" in r["error"], r
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_spawned_ranks_helpers(tmp_path):
    r0, r1 = _spawn(tmp_path, "helpers")
    assert r0["all_ok"] == r1["all_ok"] == [True, False, True]
    assert r1["error"] == "ValueError: bad file x"  # its own error
    assert r0["error"] == "JobError: rank 1 stopped: bad file x"


# ---------------------------------------------------------------------------- one process


def test_helpers_without_torch_distributed():
    assert sync_group() is None and all_ok(True) and not all_ok(False)
    barrier()
    share_error(None)
    with pytest.raises(KeyError, match="x"):
        share_error(KeyError("x"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_takes_its_strided_share_of_the_sorted_work(tmp_path, monkeypatch, world, world_size):
    """stems= with a stem that has no image and a stem of two images: the work list is every stem
    asked for, sorted, and rank r takes positions r, r + W, ...; a failure is its owner's."""
    images = shutil.copytree(world.images, tmp_path / "images")
    Image.new("RGB", (8, 8)).save(images / "img1.jpg")  # img1: two files, a per-file failure
    asked = ["img6", "img1", "img0", "img5", "img3", "img2", "absent"]
    work = sorted(asked)  # absent, img0, img1, img2, img3, img5, img6
    out = tmp_path / "out"
    written = {}
    for rank in range(world_size):
        before = {p.name for p in out.iterdir()} if out.exists() else set()
        monkeypatch.setattr(features_module, "_rank_world", lambda rank=rank: (rank, world_size))
        s = features_job(_pool, images, out, stems=asked, on_error="skip", progress=False, device="auto")
        written[rank] = sorted(p.stem for p in _outputs(out) if p.name not in before)
        mine = work[rank::world_size]
        assert sorted(written[rank] + [stem for stem, _ in s.failed]) == sorted(mine), (rank, s.failed)
        assert {stem for stem, _ in s.failed} == {"absent", "img1"} & set(mine)
        assert s.done == len(written[rank]) and s.existing == 0
    assert sorted(sum(written.values(), [])) == ["img0", "img2", "img3", "img5", "img6"]  # each once


def test_device_auto_and_a_bad_device(tmp_path, world):
    s = features_job(_pool, world.images, tmp_path / "auto", device="auto", progress=False)
    assert s.done == 7
    with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or auto, got 'gpu0'"):
        features_job(_pool, world.images, tmp_path / "x", device="gpu0", progress=False)
