"""select_centroids under torch.distributed (gloo, 2 CPU processes) equals one process."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from mars_plugin import select_centroids
from mars_plugin.method.selection import shard_indices


def _world(n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        f = torch.randn(6, 9, 9, generator=g)
        y = torch.randint(0, 4, (9, 9), generator=g)
        if i == 3:
            y[y == 0] = 1  # an image without background
        if i == 5:
            y[y == 3] = 0  # an image without class 3
        out.append((f, y))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, result_dir, mode):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        data = _world()
        mine = [data[i] for i in shard_indices(len(data), rank, world_size)]
        if mode == "bad" and rank == 1:
            mine[0] = (mine[0][0], torch.full((9, 9), 9))  # a label above num_classes, on one rank
        try:
            spill = dict(spill_dir=result_dir, spill_mb=0) if mode == "spill" else {}
            V = select_centroids(iter(mine), num_classes=3, alpha=0.5, batch_size=3, **spill)
            torch.save(V.state_dict(), os.path.join(result_dir, f"rank{rank}.pt"))
        except ValueError as e:
            with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as fh:
                fh.write(str(e))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, mode):
    tmp.spawn(_worker, args=(2, _free_port(), str(tmp_path), mode), nprocs=2, join=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "spill"])
def test_two_gloo_ranks_equal_one_process(tmp_path, mode):
    _spawn(tmp_path, mode)
    single = select_centroids(iter(_world()), num_classes=3, alpha=0.5, batch_size=3).state_dict()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["num_images"] == single["num_images"] == 14
        for key in ("valid", "num_candidates", "num_selected"):
            assert torch.equal(got[key], single[key]), key
        torch.testing.assert_close(got["centroids"], single["centroids"], rtol=0, atol=1e-6)
        # float32 centroids from differently batched K-means agree to ~1e-7, so do their distances.
        torch.testing.assert_close(got["cut_distance"], single["cut_distance"], rtol=0, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(got["background_mean"], single["background_mean"], rtol=0, atol=1e-6)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert all(torch.equal(r0[k], r1[k]) for k in ("centroids", "valid", "num_candidates", "background_mean"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]  # spill folders removed


@pytest.mark.slow
def test_an_error_on_one_rank_reaches_every_rank(tmp_path):
    _spawn(tmp_path, "bad")
    for rank in (0, 1):
        msg = (tmp_path / f"rank{rank}.err").read_text()
        assert "rank 1" in msg and "num_classes" in msg


def test_shard_indices_cover_the_list_once():
    shards = [shard_indices(11, r, 3) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(11))
    assert shards[1] == [1, 4, 7, 10]


@pytest.mark.slow
def test_torchrun_mars_centroids_equals_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m mars_plugin.cli centroids ...` writes the single-process result."""
    import shutil
    import subprocess
    import sys

    from mars_plugin.cli import main
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    world = make_world(12, size=32, dim=16, seed=4)
    write_world(world, tmp_path / "w")
    args = ["centroids", "--features", str(tmp_path / "w" / "features"), "--labels", str(tmp_path / "w" / "labels"),
            "--num-classes", "6", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "one.pt")]) == 0
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--nproc_per_node", "2", "--master_port", str(_free_port()), "-m", "mars_plugin.cli", *args,
        "--out", str(tmp_path / "two.pt")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert one["num_images"] == two["num_images"] == 12
    assert torch.equal(one["valid"], two["valid"]) and torch.equal(one["num_candidates"], two["num_candidates"])
    torch.testing.assert_close(two["centroids"], one["centroids"], rtol=0, atol=1e-6)
