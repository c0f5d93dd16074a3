"""A killed run never blocks its restart (issue 30, class 3): the run lock belongs to the process
that took it, never to the processes it forks (``mars train``'s data-loading workers), which
outlive a ``kill -9`` of their parent for seconds. A second run while the first one lives is
still refused, from another process or from the same one, and the refusal says when the pid it
names no longer runs."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars_plugin import cli
from mars_plugin.runs.errors import JobError
from mars_plugin.runs.run_lock import LOCK_NAME, RunLock

from test_train import _cli_args, _tree

REPO = Path(__file__).resolve().parents[1]

#: Takes mars's lock on argv[1], forks argv[2] children that sleep with the inherited descriptor
#: (as forked data-loading workers do), prints the children's pids and sleeps until killed.
HOLD_AND_FORK = r"""
import os, sys, time
from mars_plugin.runs.run_lock import RunLock
lock = RunLock(sys.argv[1], "a test", "mars test-holder").acquire()
kids = []
for _ in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    kids.append(pid)
print(" ".join(map(str, kids)), flush=True)
time.sleep(300)
"""


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _refused_in_another_process(lock) -> None:
    """A fresh process trying ``lock`` is refused, naming this process as the holder."""
    probe = subprocess.run([sys.executable, "-c", "import sys\nfrom mars_plugin.runs.run_lock import RunLock\n"
                            "RunLock(sys.argv[1], 'a test').acquire()", str(lock)],
                           capture_output=True, text=True, env=_env())
    assert probe.returncode != 0 and f"in use by another run (pid {os.getpid()} on host " in probe.stderr


def _alive(pid: int) -> bool:
    """Running, or stopped; not a zombie, not gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_forked_children_of_a_killed_run_never_block_its_restart(tmp_path):
    lock = tmp_path / LOCK_NAME
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(lock), "2"], stdout=subprocess.PIPE,
                            text=True, env=_env())
    kids = [int(p) for p in proc.stdout.readline().split()]
    try:
        assert len(kids) == 2
        # While the run lives, a second one is refused, naming it.
        with pytest.raises(JobError, match=rf"is in use by another run \(pid {proc.pid} on host "):
            RunLock(lock, "a test").acquire()
        proc.kill()
        proc.wait()
        assert all(_alive(k) for k in kids)  # the orphans still hold the descriptor
        again = RunLock(lock, "a test", "mars restart").acquire()  # immediately: no waiting for them
        assert again.locked and json.loads(lock.read_text())["pid"] == os.getpid()
        again.release()
        assert not lock.exists()
    finally:
        _kill_all(kids)
        proc.kill()


@pytest.mark.slow
def test_a_forked_child_that_releases_its_copy_keeps_the_parents_lock(tmp_path):
    """A child ending (its ``with`` block, or a ``release()`` it inherited) neither unlocks nor
    removes the lock its parent holds."""
    lock = tmp_path / LOCK_NAME
    held = RunLock(lock, "a test", "mars parent").acquire()
    try:
        pid = os.fork()
        if pid == 0:
            held.release()
            os._exit(0)
        os.waitpid(pid, 0)
        assert lock.is_file()
        _refused_in_another_process(lock)
    finally:
        held.release()


@pytest.mark.slow
def test_a_second_lock_in_the_same_process_is_refused_and_keeps_the_first(tmp_path):
    """A record lock never conflicts with its own process, and closing a second descriptor of the
    file would drop it: the second RunLock (under another spelling of the path) is refused, and
    another process is still refused afterwards."""
    lock = tmp_path / LOCK_NAME
    held = RunLock(lock, "a test", "mars first").acquire()
    try:
        with pytest.raises(JobError, match=rf"in use by another run \(pid {os.getpid()} on host .*mars first;"):
            RunLock(tmp_path / "." / ".." / tmp_path.name / LOCK_NAME, "a test").acquire()
        _refused_in_another_process(lock)
    finally:
        held.release()
    RunLock(lock, "a test").acquire().release()  # free again


#: Holds a bare record lock on argv[1] without writing its name (a holder mars does not know).
BARE = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('locked', flush=True)\ntime.sleep(300)")


@pytest.mark.slow
def test_a_refusal_says_when_the_recorded_pid_no_longer_runs(tmp_path):
    lock = tmp_path / LOCK_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": time.time(),
                                "command": "mars train"}))
    # Nobody holds it: a file left by a killed run is taken over at once.
    RunLock(lock, "a test").acquire().release()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": time.time(),
                                "command": "mars train"}))
    bare = subprocess.Popen([sys.executable, "-c", BARE, str(lock)], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert bare.stdout.readline().strip() == "locked"
        with pytest.raises(JobError, match=rf"\(pid {dead.pid} on host .*, mars train, which is no longer running; "):
            RunLock(lock, "a test").acquire()
    finally:
        bare.kill()
        bare.wait()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _tree(tmp_path_factory.mktemp("lock_tree"))


def _children(pid: int):
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
    return kids


@pytest.mark.slow
def test_mars_train_restarts_at_once_after_kill_9_with_workers(tree, tmp_path, capsys):
    """`mars train --workers 2` killed with kill -9 while its data-loading workers live (stopped
    here, so that they outlive it for as long as the test needs): the restart runs."""
    out = tmp_path / "run"
    argv = _cli_args(tree, out, ("--save-every", "1000"))  # no checkpoint before the kill
    argv[argv.index("--workers") + 1] = "2"
    argv[argv.index("--iterations") + 1] = "400"
    proc = subprocess.Popen([sys.executable, "-m", "mars_plugin.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())
    workers = []
    try:
        deadline = time.monotonic() + 300
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = _children(proc.pid)
        assert len(workers) >= 2, (proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        for w in workers:
            os.kill(w, signal.SIGSTOP)
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid
        proc.kill()
        proc.wait()
        assert all(_alive(w) for w in workers)
        argv[argv.index("--iterations") + 1] = "2"  # the restart need not train long: the lock is the test
        capsys.readouterr()
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert "in use by another run" not in err, err
        assert all(_alive(w) for w in workers)  # it ran while the killed run's workers still lived
    finally:
        _kill_all(workers)
        proc.kill()
    assert rc == 0, err
