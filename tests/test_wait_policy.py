"""The mars command shares the CPU: OMP_WAIT_POLICY=PASSIVE is in its environment before torch
loads libgomp (every way of starting it, its --workers processes too), a user's own OpenMP wait
setting is kept, importing the library changes nothing, and the documented library line makes
torch's idle threads sleep instead of spinning."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mars_plugin._wait_policy import command_line_default, is_mars_command

REPO = Path(__file__).resolve().parents[1]

# Records, in every process started with it on PYTHONPATH, the OMP_WAIT_POLICY in force at the
# moment torch is first imported (libgomp reads it then).
WATCHER = textwrap.dedent('''
    import os
    import sys

    class _Watch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and "torch" not in sys.modules:
                with open(os.environ["MARS_TEST_WATCH"], "a") as f:
                    f.write(f"{os.getpid()} {os.environ.get('OMP_WAIT_POLICY')}\\n")
            return None

    sys.meta_path.insert(0, _Watch())
''')


@pytest.fixture()
def watch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(WATCHER)
    log = tmp_path / "watch.log"

    def run(cmd, **extra):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)] + (
            [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        env["MARS_TEST_WATCH"] = str(log)
        env.update(extra)
        log.unlink(missing_ok=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return [line.split(" ", 1)[1] for line in log.read_text().splitlines()] if log.exists() else []

    return run


def _console_script(tmp_path):
    """What pip writes for the ``mars = mars_plugin.cli:main`` entry point."""
    script = tmp_path / "bin" / "mars"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\nfrom mars_plugin.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(script)]


ENTRIES = {
    "console script": _console_script,
    "python -m": lambda tmp: [sys.executable, "-m", "mars_plugin.cli"],
    "torchrun's rank command": lambda tmp: [sys.executable, "-u", "-m", "mars_plugin.cli"],
    "interpreter options": lambda tmp: [sys.executable, "-X", "utf8", "-W", "ignore", "-mmars_plugin.cli"],
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_mars_command_sets_passive_before_torch_loads(entry, watch, tmp_path):
    seen = watch(ENTRIES[entry](tmp_path) + ["centroids", "--help"])
    assert seen == ["PASSIVE"]


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                  {"GOMP_SPINCOUNT": "300000"}])
@pytest.mark.slow
def test_a_users_own_wait_setting_is_kept(user, watch):
    seen = watch([sys.executable, "-m", "mars_plugin.cli", "centroids", "--help"], **user)
    assert seen == [user.get("OMP_WAIT_POLICY", "None")]


@pytest.mark.parametrize("code", ["import mars_plugin", "import torch, mars_plugin",
                                  "from mars_plugin.cli import main"])
def test_importing_the_library_changes_nothing(code, watch):
    assert watch([sys.executable, "-c", code]) == ["None"]


@pytest.mark.slow
def test_worker_processes_inherit_the_policy(watch, tmp_path):
    from mars_plugin.cli import main
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    root = tmp_path / "w"
    write_world(make_world(4, size=24, dim=16, seed=1), root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    seen = watch([sys.executable, "-m", "mars_plugin.cli", "debias", "--features", str(root / "features"),
                  "--labels", str(root / "labels"), "--centroids", str(root / "V.pt"), "--out", str(root / "out"),
                  "--refine", "threshold", "--workers", "2", "--batch-size", "1", "--no-progress"])
    assert seen == ["PASSIVE"] * 3  # the command and its two spawned workers


@pytest.mark.parametrize("line, argv, expected", [
    (["python", "-m", "mars_plugin.cli", "debias"], ["-m"], True),
    (["python", "-u", "-m", "mars_plugin.cli"], ["-m"], True),
    (["python", "-X", "dev", "-W", "ignore", "-m", "mars_plugin.cli"], ["-m"], True),
    (["python", "-mmars_plugin.cli"], ["-m"], True),
    (["/venv/bin/python", "/venv/bin/mars", "demo"], ["/venv/bin/mars", "demo"], True),
    (["mars.exe"], ["C:\\venv\\Scripts\\mars.exe"], True),
    (["python", "-m", "pytest", "-m", "mars_plugin.cli"], ["-m"], False),
    (["python", "-c", "import mars_plugin"], ["-c"], False),
    (["python", "train.py", "-m", "mars_plugin.cli"], ["train.py"], False),
    (["python", "-W", "-m", "mars_plugin.cli"], ["-m"], False),  # -W's argument is "-m"
    (["python"], [""], False),
])
def test_which_processes_are_the_mars_command(line, argv, expected):
    assert is_mars_command(argv, line) is expected


def test_only_the_mars_command_sets_the_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert command_line_default(["script.py"], ["python", "script.py"]) is False
    assert "OMP_WAIT_POLICY" not in os.environ
    assert command_line_default(["-m"], ["python", "-m", "mars_plugin.cli"]) is True
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert command_line_default(["-m"], ["python", "-m", "mars_plugin.cli"]) is False
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


# torch's two threads around 40 short parallel operations, each followed by 5 ms of sleep: the
# process's CPU time is what its threads spent spinning while it slept.
PROBE = textwrap.dedent('''
    {line}
    import time
    import mars_plugin
    import torch

    torch.set_num_threads(2)
    x = torch.ones(1 << 20)
    x.add_(1)
    start = time.process_time()
    for _ in range(40):
        x.add_(1)
        time.sleep(0.005)
    print(time.process_time() - start)
''')


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="idle OpenMP threads need a second core")
def test_the_documented_library_line_makes_idle_threads_sleep():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))

    def cpu(line, **extra):
        r = subprocess.run([sys.executable, "-c", PROBE.format(line=line)], env=dict(env, **extra),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.strip().splitlines()[-1])

    # the README's line, as written there
    readme_line = re.search(r"```python\n(import os; os\.environ\.setdefault\(\"OMP_WAIT_POLICY\".*)\n```",
                            (REPO / "README.md").read_text()).group(1)
    spinning = cpu("", GOMP_SPINCOUNT="300000")  # libgomp's own default: spin ~3 ms, then sleep
    sleeping = cpu(readme_line)
    assert sleeping < 0.1 and sleeping < spinning / 3, (sleeping, spinning)
