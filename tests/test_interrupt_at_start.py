"""Ctrl-C in the first second of a ``mars`` command, while the package and torch import (before
``cli.main`` runs), ends with the command's one line and status 130, never a traceback (issue 30,
class 4). The moments are found with ``PYTHONPROFILEIMPORTTIME``, which writes a line to stderr as
each import ends: the interrupt comes right after the first module of mars, in the middle of
torch's import, and as ``cli.py``'s own imports end."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mars_plugin._interrupt import interrupt_line

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("mars")  # the console script of this environment

LAUNCHERS = {"console script": [str(SCRIPT)], "python -m": [sys.executable, "-m", "mars_plugin.cli"]}
#: Right after mars's first module; within torch's import; as cli.py's imports end, before main().
MOMENTS = ["mars_plugin._interrupt", "torch._C", "mars_plugin.commands.cli_parser"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPROFILEIMPORTTIME="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_ctrl_c_while_the_command_starts_prints_one_line(tmp_path, launcher, moment):
    if launcher == "console script" and not SCRIPT.is_file():
        pytest.skip(f"no console script {SCRIPT} (the package is not installed in this environment)")
    argv = ["demo", "--out", str(tmp_path / "demo")]
    proc = subprocess.Popen(LAUNCHERS[launcher] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == moment:
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"the import of {moment} was not seen: {''.join(seen)[-2000:]}")
        rest = proc.stderr.read()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    lines = [x for x in (''.join(seen) + rest).splitlines() if not x.startswith("import time:")]
    assert "Traceback" not in rest and rc == 130, (rc, lines[-20:])
    # before main(): nothing was written; just after, main()'s own line for the command
    assert lines in ([interrupt_line(argv, started=False)], [interrupt_line(argv)]), lines
