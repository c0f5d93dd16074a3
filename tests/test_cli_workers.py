"""``mars debias --workers N`` never hangs: a worker that fails to start or dies ends the run
with one line and exit 2. Each run is a subprocess with a timeout, as a hang guard only."""
import subprocess
import sys
import textwrap

import pytest

from mars_plugin.cli import main
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

# Runs `mars debias --workers 2`. Its top level also runs in each spawned worker (as
# __mp_main__); there, MARS_TEST_IN_WORKER is set (the parent sets it just before the run),
# and the fault named by MARS_TEST_FAULT is planted in the worker only.
SCRIPT = textwrap.dedent('''
    import os
    import sys

    from mars_plugin.commands import debias as debias_command

    from mars_plugin.method import selection
    FAULT = os.environ["MARS_TEST_FAULT"]
    if os.environ.get("MARS_TEST_IN_WORKER") == "1":
        if FAULT == "init":  # the worker's set-up raises
            def to(self, device):
                raise RuntimeError("simulated start-up failure")
            selection.DebiasedCentroids.to = to
        elif FAULT == "crash":  # the worker dies on its first image
            def read_features(path):
                os._exit(9)
            debias_command.read_features = read_features
        elif FAULT == "no-file":  # a worker that reads the centroid file finds it gone
            def load(*a, **k):
                raise FileNotFoundError("the centroid file was removed after the run began")
            selection.DebiasedCentroids.load = classmethod(load)

    if __name__ == "__main__":
        from mars_plugin.cli import main

        os.environ["MARS_TEST_IN_WORKER"] = "1"
        sys.exit(main(sys.argv[1:]))
''')


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    write_world(make_world(6, size=24, dim=16, seed=4), root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    (root / "run.py").write_text(SCRIPT)
    return root


def _run(root, out, fault):
    import os

    env = dict(os.environ, MARS_TEST_FAULT=fault)
    env.pop("MARS_TEST_IN_WORKER", None)
    cmd = [sys.executable, str(root / "run.py"), "debias", "--features", str(root / "features"), "--labels",
           str(root / "labels"), "--centroids", str(root / "V.pt"), "--out", str(out), "--refine", "threshold",
           "--workers", "2", "--batch-size", "1", "--no-progress"]
    # The timeout only guards against a hang (the old Pool respawned failed workers forever).
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["init", "crash"])
def test_a_failing_worker_ends_the_run_with_one_line(world, tmp_path, fault):
    r = _run(world, tmp_path / "out", fault)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mars debias: error: ") and "--workers" in lines[0], r.stderr
    if fault == "init":
        assert "simulated start-up failure" in lines[0]


@pytest.mark.slow
def test_workers_never_read_the_centroid_file(world, tmp_path):
    """The centroids go to the workers as tensors: a file gone after the start changes nothing."""
    r = _run(world, tmp_path / "out", "no-file")
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "out").glob("*.png"))) == 6
