"""`mars crf` under torchrun with 2 CPU processes writes the files one process writes (each rank
a disjoint share of the sorted stems, one record), for labels and probabilities."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars_plugin.commands.crf_job import crf_job
from mars_plugin.commands.sample_trees import LAYOUTS, write_sample_tree

from test_crf_job import _write_cams
from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("crf_ranks")
    write_sample_tree("seam", root, num_images=5, size=32, seed=4)
    _write_cams("seam", root, root / "cams")
    return root / "cams", root / LAYOUTS["seam"]["images"]


def _files(folder: Path):
    return {p.name: (np.asarray(Image.open(p)) if p.suffix == ".png" else np.load(p))
            for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.mark.slow
@pytest.mark.parametrize("write", ["labels", "probs"])
def test_torchrun_two_ranks_equal_one_process(tree, tmp_path, write):
    cams, images = tree
    crf_job(images, tmp_path / "one", cams_dir=cams, wsss="seam", trust_pickle=True, write=write, batch_size=2,
            progress=False)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "mars_plugin.cli", "crf", "--cams", str(cams), "--wsss", "seam",
           "--trust-pickle", "--images", str(images), "--out", str(out), "--write", write, "--batch-size", "2",
           "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # a disjoint share each: s0, s2, s4 and s1, s3
    assert "crf rank 0/2: 3 written" in res.stdout and "crf rank 1/2: 2 written" in res.stdout, res.stdout
    one, two = _files(tmp_path / "one"), _files(out)
    assert one.keys() == two.keys() and len(one) == 5
    for name in one:
        np.testing.assert_array_equal(one[name], two[name], err_msg=name)
    # each rank journaled its own share: a second run keeps every file
    s = crf_job(images, out, cams_dir=cams, wsss="seam", trust_pickle=True, write=write, progress=False)
    assert (s.existing, s.done) == (5, 0)
