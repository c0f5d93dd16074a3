"""Issue 41, classes 3 and 4 (and class 9's interrupt before --out exists): Ctrl-C is honoured
everywhere, in one line, and worker processes die with their run.

* A SIGINT that lands while the compiled (numba) CRF runs stops it at the next iteration, as a
  KeyboardInterrupt (it was lost, or became a SystemError): the kernels run one iteration per
  call, with the request checked between (:mod:`mars_plugin._interrupt`), and give the same
  bits as the whole loop in one kernel.
* ``mars crf`` and ``mars debias`` (one process and ``--workers 2``) stop within a few seconds
  of SIGINT with exit 130 and one line that says what was written; every file written is
  whole, and a rerun resumes to the files of an uninterrupted run.
* After ``kill -9`` of ``mars crf --workers 2`` / ``mars debias --workers 2`` every process
  they started (the workers, the resource tracker) ends within seconds.
* Every worker pool and every SIGINT handler goes through its one door (a source scan).
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars_plugin import _interrupt
from mars_plugin.cli import main

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
LINE = re.compile(r"^mars (crf|debias): interrupted; (?:(\d+) files? written to (.+); run it again to resume "
                  r"\(finished files are kept\)|nothing was written)$")


# ------------------------------------------------------------------------ the compiled CRF

def _crf_inputs(size: int, labels: int = 3, images: int = 1, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    maps = [torch.rand(labels, size, size, generator=g) for _ in range(images)]
    rgbs = [torch.randint(0, 255, (size, size, 3), dtype=torch.uint8, generator=g) for _ in range(images)]
    return [m / m.sum(0, keepdim=True) for m in maps], rgbs


def _sigint_in_the_iterations(monkeypatch, timers, seconds: float = 0.3) -> None:
    """A SIGINT to this process ``seconds`` after each bilateral lattice (5 features) is built:
    inside the mean-field iterations that follow it."""
    from mars_plugin.engines import crf_compiled

    real = crf_compiled.CompiledLattice.__init__

    def built(self, features, *a, **k):
        real(self, features, *a, **k)
        if features.shape[1] == 5:
            timers.append(threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)))
            timers[-1].start()
            timers.append(time.monotonic() + seconds)

    monkeypatch.setattr(crf_compiled.CompiledLattice, "__init__", built)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_sigint_inside_the_compiled_crf_stops_it(threads, monkeypatch):
    """Three SIGINTs, each while the compiled mean field of a 500x500 image iterates (one thread:
    the kernel runs in this thread; two: in pool threads): each is a KeyboardInterrupt within
    2.5 s, a few iterations, never lost and never a SystemError (base, one thread: one kernel
    ran the 100 iterations, about 20 s, and the interrupt came after them, or as numba's
    ``SystemError: ... returned a result with an exception set``)."""
    import torch

    from mars_plugin.engines import crf, crf_compiled
    from mars_plugin.engines.crf_params import check_crf_params

    if not crf_compiled.available():
        pytest.skip("numba is not installed")
    params = dict(check_crf_params("mars"), iterations=100)
    maps, rgbs = _crf_inputs(48)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        crf.dense_crf(maps, rgbs, params)  # compiled (or read from numba's cache) before the clock
        maps, rgbs = _crf_inputs(500)
        for _ in range(3):
            timers = []
            _sigint_in_the_iterations(monkeypatch, timers)
            with pytest.raises(KeyboardInterrupt):
                crf.dense_crf(maps, rgbs, params)
            timers[0].join()
            assert time.monotonic() - timers[1] < 2.5
            monkeypatch.undo()
    finally:
        torch.set_num_threads(before)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the library left it as it was
    assert not _interrupt.requested()


@pytest.mark.slow
def test_chunked_mean_field_is_bit_identical_to_one_kernel():
    """One compiled call per iteration (checked between) gives the bits of the whole loop in
    one kernel (the loop before issue 41, rebuilt here from the same compiled pieces)."""
    from mars_plugin.engines import crf_compiled as cc

    if not cc.available():
        pytest.skip("numba is not installed")
    from numba import njit

    @njit(nogil=True, fastmath={"contract", "nsz"}, boundscheck=False)
    def whole(neg_u, q, e, gv, gsw, glw, gn1, gn2, cg, bv, bsw, blw, bn1, bn2, cb, iterations, vbuf, wbuf):
        N, L = neg_u.shape
        cc._copy_cols(neg_u, q, 0, L)
        cc._softmax_rows(q, 0, N)
        for _ in range(iterations):
            cc._copy_cols(neg_u, e, 0, L)
            cc._filter(gv, gsw, glw, gn1, gn2, q, vbuf, wbuf, e, cg, 0, L)
            cc._filter(bv, bsw, blw, bn1, bn2, q, vbuf, wbuf, e, cb, 0, L)
            cc._softmax_rows(e, 0, N)
            q, e = e, q
        return q

    rng = np.random.default_rng(3)
    H, W, L = 24, 30, 4
    yx = np.stack(np.meshgrid(np.arange(H), np.arange(W), indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
    rgb = rng.integers(0, 255, (H * W, 3)).astype(np.float32)
    g = cc.CompiledLattice(yx / 3, [H * W])
    b = cc.CompiledLattice(np.concatenate([yx / 50, rgb / 5], 1), [H * W])
    neg_u = np.log(rng.uniform(0.05, 1, (H * W, L))).astype(np.float32)
    compats = (3.0, 4.0)
    size = (max(g.num_lattice_points, b.num_lattice_points) + 1) * L
    for iterations in (0, 1, 5, 10):
        want = whole(neg_u, np.empty_like(neg_u), np.empty_like(neg_u), g.vert, g.sw, g.lw, g.n1, g.n2,
                     np.float32(compats[0]), b.vert, b.sw, b.lw, b.n1, b.n2, np.float32(compats[1]), iterations,
                     np.empty(size, np.float32), np.empty(size, np.float32))
        for threads in (1, 2, 3):
            got = cc.mean_field(neg_u, [(0, H * W, g, lambda: b)], compats, iterations, threads)
            assert got.tobytes() == want.tobytes(), (iterations, threads)


# ------------------------------------------------------------------------ the line (class 9)

def _probs_tree(root: Path, n: int, size: int) -> Path:
    """``root/probs`` (L=3 probability maps) and ``root/images`` of ``n`` random images."""
    rng = np.random.default_rng(0)
    (root / "probs").mkdir(parents=True)
    (root / "images").mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / "images" / f"im{i}.png")
        p = rng.uniform(0.1, 1, (3, size, size)).astype(np.float32)
        np.save(root / "probs" / f"im{i}.npy", p / p.sum(0, keepdims=True))
    return root


def _crf_args(root: Path, out: Path, *more: str):
    return ["crf", "--probs", str(root / "probs"), "--images", str(root / "images"), "--out", str(out),
            "--no-progress", *more]


def test_the_line_counts_the_files_written(tmp_path, monkeypatch, capsys):
    """An interrupted `mars crf` says how many files it wrote and that a rerun resumes (base:
    "nothing was written", with the files there)."""
    import mars_plugin.commands.crf_job as job

    root = _probs_tree(tmp_path / "t", 4, 12)
    real, calls = job._finish, []

    def dies(j):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(j[0])
        return real(j)

    monkeypatch.setattr(job, "_finish", dies)
    assert main(_crf_args(root, tmp_path / "out", "--batch-size", "1")) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mars crf: interrupted; 2 files written to {tmp_path / 'out'}; run it again to resume "
                   "(finished files are kept)"]
    assert len(list((tmp_path / "out").glob("*.png"))) == 2
    monkeypatch.setattr(job, "_finish", real)
    # a second interrupted run over the same folder writes nothing new: no false count, a resume
    monkeypatch.setattr(job, "_pipeline", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(_crf_args(root, tmp_path / "out")) == 130
    assert capsys.readouterr().err.strip() == ("mars crf: interrupted; no file written by this run; run it again to "
                                               "resume (finished files are kept)")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # main() put Python's back


@pytest.mark.parametrize("command", ["crf", "debias", "features", "predict"])
def test_an_interrupt_before_out_exists_promises_nothing(command, tmp_path, capsys):
    """Interrupted before its --out exists, a command says "nothing was written", never "run
    it again to resume" (base: the resumable commands promised a resume)."""
    _interrupt.begin(tmp_path / "never-made")
    assert _interrupt.interrupt_line([command, "--out", str(tmp_path / "never-made")]) == \
        f"mars {command}: interrupted; nothing was written"
    _interrupt.begin(tmp_path)  # an existing folder of an earlier run, nothing new: a resume, no count
    assert _interrupt.interrupt_line([command]).endswith("no file written by this run; run it again to resume "
                                                          "(finished files are kept)")
    _interrupt.wrote(3)
    assert _interrupt.interrupt_line([command]) == (f"mars {command}: interrupted; 3 files written to {tmp_path}; "
                                                    "run it again to resume (finished files are kept)")
    _interrupt.begin(None)


def test_an_interrupt_before_the_run_starts_in_main(tmp_path, monkeypatch, capsys):
    """A Ctrl-C in `mars crf` before its folder is made: one line, nothing was written."""
    import mars_plugin.commands.crf_job as job

    root = _probs_tree(tmp_path / "t", 1, 8)

    def early(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "_run", early)
    assert main(_crf_args(root, tmp_path / "out")) == 130
    assert capsys.readouterr().err.strip() == "mars crf: interrupted; nothing was written"


# ------------------------------------------------------------------------ the doors

def _sources():
    return [p for p in sorted((ROOT / "mars_plugin").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))]


def test_every_worker_pool_goes_through_the_door():
    """Worker processes are made only by mars_plugin/runs/worker_processes.py (which makes them
    die with their parent and leave Ctrl-C to it); SIGINT handlers are set only by the Ctrl-C
    door, mars_plugin/_interrupt.py (and the pool door, for its workers' start). Base: crf_job.py
    and debias.py made their own pools and handlers."""
    pools = re.compile(r"ProcessPoolExecutor\(|get_context\(|multiprocessing\.Pool\(|mp\.Pool\(|\.Process\(")
    handlers = re.compile(r"signal\.signal\(\s*signal\.SIGINT")
    bad = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if rel != "mars_plugin/runs/worker_processes.py" and pools.search(text):
            bad.append(f"{rel} makes worker processes")
        if rel not in ("mars_plugin/_interrupt.py", "mars_plugin/cli.py") and handlers.search(text):
            bad.append(f"{rel} sets a SIGINT handler")
    assert not bad, "\n".join(bad)


def test_a_pool_takes_work_only_from_its_thread():
    """A worker's death signal follows the thread that started it: work from another thread
    (which could end before the run) is refused."""
    from mars_plugin.runs.worker_processes import process_pool

    assert process_pool(0) is None
    pool = process_pool(1)
    try:
        got = []
        t = threading.Thread(target=lambda: got.append(_raises(lambda: pool.submit(abs, -1))))
        t.start()
        t.join()
        assert got == ["RuntimeError"]
    finally:
        pool.shutdown()


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return None


ORPHAN = """
import os, sys, time
sys.path.insert(0, {root!r})
if {no_prctl}:
    sys.platform = "other"  # the portable way only: the thread that watches the parent
from mars_plugin.runs.worker_processes import die_with_parent
die_with_parent(int(sys.argv[1]))
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="finds processes in /proc")
@pytest.mark.parametrize("no_prctl", [False, True])
def test_a_worker_ends_when_its_parent_dies(tmp_path, no_prctl):
    """A process that called die_with_parent ends within seconds of its parent's SIGKILL, by
    the kernel's death signal or, without it, by the thread that watches its parent."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN.format(root=str(ROOT), no_prctl=no_prctl))
    # the parent: a shell that starts the orphan-to-be with its own pid, prints the child's pid, waits
    parent = subprocess.Popen(["sh", "-c", f'"{sys.executable}" "{script}" $$ & echo $!; wait'],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "ready"  # die_with_parent has run
        parent.kill()
        parent.wait()
        assert _wait_for(lambda: not _alive(child), 10), f"pid {child} outlived its parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------ the commands (subprocesses)

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _descendants(pid: int):
    """Every live process under ``pid`` (by PPid, through /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return [k for k in found if _alive(k)]


def _wait_for(cond, seconds: float, step: float = 0.1) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def _mars(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mars_plugin.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _outputs(out: Path):
    return sorted(out.glob("*.png"))


def _whole(paths):
    for p in paths:
        with Image.open(p) as im:
            im.load()  # a truncated PNG raises here


def _interrupt_during_run(args, out: Path, written: int, to_group: bool = False):
    """Run `mars ARGS`, send SIGINT once ``written`` outputs exist (the next image's CRF is then
    running), and return (exit status, seconds to exit, stderr)."""
    p = _mars(args)
    try:
        assert _wait_for(lambda: len(_outputs(out)) >= written or p.poll() is not None, 240)
        time.sleep(0.3)  # inside the next image's mean field
        sent = time.monotonic()
        if to_group:
            os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        return p.returncode, time.monotonic() - sent, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _check_interrupted(rc, took, err, out: Path, command: str):
    lines = err.strip().splitlines()
    assert rc == 130, err
    assert len(lines) == 1, err
    m = LINE.match(lines[0])
    assert m and m.group(1) == command, lines[0]
    files = _outputs(out)
    _whole(files)
    assert not list(out.glob(".tmp-*")), "a half-written file was left"
    assert int(m.group(2) or 0) == len(files), (lines[0], [f.name for f in files])
    if files:
        assert m.group(3) == str(out)
    assert took < 8, f"stopped {took:.1f} s after SIGINT"


@pytest.fixture(scope="module")
def probs_tree(tmp_path_factory):
    root = _probs_tree(tmp_path_factory.mktemp("sigint_crf"), 5, 160)
    once = root / "once"
    r = subprocess.run([sys.executable, "-m", "mars_plugin.cli", *_crf_args(root, once, "--crf-params",
                        '{"iterations": 100}')], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return root, {p.name: np.asarray(Image.open(p)) for p in _outputs(once)}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="signals to a process group, /proc")
@pytest.mark.parametrize("extra", [["--threads", "1"], ["--threads", "2"], ["--workers", "2", "--threads", "1"]],
                         ids=["threads1", "threads2", "workers2"])
def test_mars_crf_stops_on_sigint_and_resumes(probs_tree, tmp_path, extra):
    """SIGINT while `mars crf` runs an image's compiled CRF, three times: exit 130 within a few
    seconds, one line that counts the files written, each whole; the rerun resumes to the
    files of an uninterrupted run (base: 5 of 6 SIGINTs lost, exit 0; or "nothing was written")."""
    root, want = probs_tree
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        args = _crf_args(root, out, "--crf-params", '{"iterations": 100}', "--batch-size", "1", *extra)
        rc, took, err = _interrupt_during_run(args, out, 1 + attempt % 2, to_group=attempt == 2)
        _check_interrupted(rc, took, err, out, "crf")
        r = subprocess.run([sys.executable, "-m", "mars_plugin.cli", *args], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        assert {p.name: np.asarray(Image.open(p)).tolist() for p in _outputs(out)} == \
            {k: v.tolist() for k, v in want.items()}


@pytest.fixture(scope="module")
def debias_world(tmp_path_factory):
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    root = tmp_path_factory.mktemp("sigint_debias")
    write_world(make_world(5, size=240, dim=16, seed=4), root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    once = root / "once"
    assert main(_debias_args(root, once)) == 0
    return root, {p.name: np.asarray(Image.open(p)) for p in _outputs(once)}


def _debias_args(root: Path, out: Path, *more: str):
    return ["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
            str(root / "V.pt"), "--images", str(root / "images"), "--out", str(out), "--refine", "crf",
            "--crf-params", '{"iterations": 100}', "--batch-size", "1", "--no-progress", *more]


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="signals to a process group, /proc")
@pytest.mark.parametrize("extra", [["--threads", "1"], ["--workers", "2"]], ids=["threads1", "workers2"])
def test_mars_debias_stops_on_sigint_and_resumes(debias_world, tmp_path, extra):
    """SIGINT while `mars debias` runs the CRF (here, or in its --workers): exit 130 within a few
    seconds, one line (base: a 68-line traceback ending in SystemError), files whole, a rerun
    resumes to the uninterrupted run's labels."""
    root, want = debias_world
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        rc, took, err = _interrupt_during_run(_debias_args(root, out, *extra), out, 1, to_group=attempt == 1)
        _check_interrupted(rc, took, err, out, "debias")
        assert main(_debias_args(root, out, *extra)) == 0
        assert {p.name: np.asarray(Image.open(p)).tolist() for p in _outputs(out)} == \
            {k: v.tolist() for k, v in want.items()}


def _kill_parent_and_wait(args, out: Path):
    """Start `mars ARGS` with --workers 2, wait for its workers to run, SIGKILL it: the
    processes it started that are still alive 10 seconds later."""
    p = _mars(args)
    kids = []
    try:
        assert _wait_for(lambda: len(_outputs(out)) >= 1 or p.poll() is not None, 240)
        kids = _descendants(p.pid)
        assert sum("spawn_main" in _cmdline(k) for k in kids) == 2, [_cmdline(k) for k in kids]
        p.kill()
        p.wait()
        _wait_for(lambda: not any(_alive(k) for k in kids), 10)
        return [(k, _cmdline(k)) for k in kids if _alive(k)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for k in kids:  # what outlived the parent (handed to another): this test's to end
            if _alive(k) and "multiprocessing" in _cmdline(k):
                os.kill(k, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="finds processes in /proc")
def test_crf_workers_die_with_their_run(probs_tree, tmp_path):
    """kill -9 of `mars crf --workers 2`: its workers and the resource tracker end within 10 s
    (base: alive after a minute)."""
    root, _ = probs_tree
    args = _crf_args(root, tmp_path / "out", "--crf-params", '{"iterations": 100}', "--batch-size", "1",
                     "--workers", "2")
    left = _kill_parent_and_wait(args, tmp_path / "out")
    assert not left, left


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="finds processes in /proc")
def test_debias_workers_die_with_their_run(debias_world, tmp_path):
    """kill -9 of `mars debias --workers 2`: its workers and the resource tracker end within 10 s."""
    root, _ = debias_world
    left = _kill_parent_and_wait(_debias_args(root, tmp_path / "out", "--workers", "2"), tmp_path / "out")
    assert not left, left
