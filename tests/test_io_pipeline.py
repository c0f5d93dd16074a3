"""The folder jobs' I/O overlapped with the device (issue 32): ``IOPipeline`` alone (results in
input order, a failing read fails its item alone, a failure in the compute or a writer stops the
job naming its cause, no temp file left, bounded reads ahead of a generator input), then
``mars debias``, ``mars crf`` and ``mars predict`` writing byte-identical files with
``--io-workers 0`` and ``2``, and naming the same corrupt file with ``--on-error skip``."""
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from mars_plugin.cli import main
from mars_plugin.runs.errors import JobError
from mars_plugin.runs.io_pipeline import IOPipeline, check_io_workers, default_io_workers
from mars_plugin.formats.files import atomic_write


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _jitter(x):
    time.sleep(random.Random(x).uniform(0, 0.004))  # later items often finish first
    return x


def _io_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mars-io")]


# --------------------------------------------------------------------------------------------
# the pipeline alone
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_reads_and_writes_come_back_in_input_order(workers):
    got, written = [], []
    with IOPipeline(workers, ahead=4, behind=3) as io:
        for item, fut in io.reads(_jitter, range(40)):
            got.append((item, fut.result()))
            io.write(item, _jitter, item * 10)
            written += list(io.written())
        written += list(io.written(0))
    assert got == [(i, i) for i in range(40)]
    assert written == [(i, i * 10) for i in range(40)]


def test_a_failing_read_fails_that_item_alone():
    def read(i):
        if i == 5:
            raise ValueError(f"item {i} is corrupt")
        return _jitter(i)

    ok, bad = [], []
    with IOPipeline(2, ahead=3, behind=2) as io:
        for item, fut in io.reads(read, range(12)):
            try:
                ok.append(fut.result())
            except ValueError as e:
                bad.append((item, str(e)))
    assert ok == [i for i in range(12) if i != 5] and bad == [(5, "item 5 is corrupt")]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_reads_stay_a_bounded_window_ahead_of_a_generator(workers):
    """A generator input is taken lazily: when item i is handed out, at most ``ahead`` + 1 more
    items have been taken from it (memory bounded whatever the folder's size)."""
    taken = []

    def items():
        for i in range(50):
            taken.append(i)
            yield i

    lead = []
    with IOPipeline(workers, ahead=4, behind=2) as io:
        for item, fut in io.reads(_jitter, items()):
            lead.append(len(taken) - 1 - item)
            assert fut.result() == item
    assert max(lead) <= 4 + 1 and len(taken) == 50


def test_writes_in_flight_are_bounded():
    running, most = [0], [0]
    lock = threading.Lock()

    def write(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return i

    keys = []
    with IOPipeline(4, ahead=2, behind=3) as io:
        for i in range(30):
            io.write(i, write, i)
            keys += [k for k, _ in io.written()]
            assert len(io.pending) <= 3
        keys += [k for k, _ in io.written(0)]
    assert keys == list(range(30)) and most[0] <= 4


def test_a_failing_write_stops_the_job_naming_its_cause(tmp_path):
    def write(i):
        if i == 3:
            raise OSError(28, "No space left on device")
        atomic_write(tmp_path / f"{i}.txt", lambda tmp: Path(tmp).write_text(str(i)))
        return i

    with pytest.raises(OSError, match="No space left"):
        with IOPipeline(2, ahead=2, behind=2) as io:
            for i in range(10):
                io.write(i, write, i)
                list(io.written())
            list(io.written(0))
    assert not _io_threads()  # the threads are gone: nothing hangs
    names = [p.name for p in tmp_path.iterdir()]
    assert "3.txt" not in names and not [n for n in names if n.startswith(".tmp")]


@pytest.mark.parametrize("error", [RuntimeError("the CRF failed"), KeyboardInterrupt()])
def test_an_error_in_the_compute_stops_the_reads_and_writes(tmp_path, error):
    """The compute (this thread) raising, or Ctrl-C: the reads not begun are cancelled, those
    running finish, nothing hangs, and no half file is left."""
    started = []

    def read(i):
        started.append(i)
        time.sleep(0.05)
        return i

    with pytest.raises(type(error)):
        with IOPipeline(2, ahead=6, behind=2) as io:
            for i, fut in io.reads(read, range(1000)):
                fut.result()
                io.write(i, atomic_write, tmp_path / f"{i}.txt", lambda tmp: Path(tmp).write_text("x" * 1000))
                if i == 3:
                    raise error
    # reads 4..10 were queued when item 3 was handed out: those not begun are cancelled
    assert len(started) <= 8 and not _io_threads()
    assert all(p.read_text() == "x" * 1000 for p in tmp_path.iterdir())  # whole files only, no temp file


@pytest.mark.parametrize("workers", [0, 2])
def test_after_an_error_the_finished_writes_are_handed_over(workers):
    """``settled()``: the writes queued before an error that finished (their files whole) come
    back in order for the record; a failed one is left out."""
    def write(i):
        if i == 2:
            raise OSError("disk full")
        return i * 10

    with IOPipeline(workers, ahead=2, behind=10) as io:
        for i in range(5):
            io.write(i, write, i)
        while not all(f.done() for _, f in io.pending):  # all run (those not begun would be cancelled)
            time.sleep(0.001)
        got = list(io.settled())
    assert got == [(0, 0), (1, 10), (3, 30), (4, 40)] and not _io_threads()


def test_io_workers_values_are_checked_by_name():
    assert check_io_workers(None, "cpu") == 0 and check_io_workers(3, "cpu") == 3
    assert check_io_workers(None, torch.device("cuda", 1)) == default_io_workers("cuda") >= 1
    assert check_io_workers(None, "cuda", processes=2) == 0  # --workers processes read and write themselves
    with pytest.raises(ValueError, match=r"io_workers must be an integer in 0\.\.256, got -1"):
        check_io_workers(-1, "cpu")
    with pytest.raises(TypeError, match="io_workers must be an integer"):
        check_io_workers(1.5, "cpu")
    with pytest.raises(ValueError, match="not both"):
        check_io_workers(2, "cpu", processes=2)


# --------------------------------------------------------------------------------------------
# the three jobs: the same bytes with io-workers 0 and 2
# --------------------------------------------------------------------------------------------


def _files(folder: Path):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def _run(args, capsys):
    rc = main(args + ["--no-progress"])
    return rc, capsys.readouterr().err


def _corrupt(folder: Path, name: str, dest: Path) -> Path:
    """A copy of ``folder`` whose file ``name`` is not an image."""
    dest.mkdir()
    for p in folder.iterdir():
        (dest / p.name).write_bytes(b"not an image file" if p.name == name else p.read_bytes())
    return dest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    root = tmp_path_factory.mktemp("world")
    write_world(make_world(9, size=32, dim=16, seed=3), root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root


def _debias(root, out, images, extra):
    return ["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
            str(root / "V.pt"), "--images", str(images), "--out", str(out), "--batch-size", "3", *extra]


def test_debias_writes_the_same_bytes_with_io_workers(world, tmp_path, capsys):
    for n in ("0", "2"):
        assert _run(_debias(world, tmp_path / n, world / "images", ["--io-workers", n]), capsys)[0] == 0
    a, b = _files(tmp_path / "0"), _files(tmp_path / "2")
    assert len(a) == 9 and a == b
    bad = sorted(p.name for p in (world / "images").iterdir())[4]
    images = _corrupt(world / "images", bad, tmp_path / "bad")
    errs = []
    for n in ("0", "2"):
        rc, err = _run(_debias(world, tmp_path / f"skip{n}", images, ["--io-workers", n, "--on-error", "skip"]),
                       capsys)
        assert rc == 1 and Path(bad).stem in err
        errs.append(err)
    assert errs[0] == errs[1] and _files(tmp_path / "skip0") == _files(tmp_path / "skip2")
    assert len(_files(tmp_path / "skip2")) == 8


@pytest.mark.parametrize("where", ["compute", "record"])
def test_debias_interrupted_with_io_workers_leaves_whole_files_and_resumes(world, tmp_path, monkeypatch, where):
    """Ctrl-C during the second batch's compute, or while the results are recorded, with 2
    threads reading ahead and writing behind: the job stops (no thread left running), every file
    there is whole (no temp file), and the next run writes the rest, the folder then equal to
    one uninterrupted run."""
    import mars_plugin.commands.debias as job
    from mars_plugin.commands.debias import debias_job

    real_masks, real_progress, calls = job._debias_masks, job._progress, []

    def masks(items):
        calls.append(len(items))
        if len(calls) == 2:
            # The first batch's writes are queued behind this compute; on a loaded machine they
            # may not have begun, and the pipeline cancels writes not begun: let them land first,
            # so that the interrupt meets whole files that must be recorded.
            deadline = time.monotonic() + 60
            while len(list((tmp_path / "out").glob("*.png"))) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt
        return real_masks(items)

    def progress(results, *a):
        for i, r in enumerate(results):
            if i == 4:
                raise KeyboardInterrupt
            yield r

    def run(out):
        return debias_job(world / "features", world / "labels", world / "V.pt", out, images_dir=world / "images",
                          batch_size=3, io_workers=2, progress=False)

    if where == "compute":
        monkeypatch.setattr(job, "_debias_masks", masks)
    else:
        monkeypatch.setattr(job, "_progress", progress)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "out")
    assert not _io_threads()
    left = _files(tmp_path / "out")
    assert len(left) >= 3 and not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".tmp")]
    monkeypatch.setattr(job, "_debias_masks", real_masks)
    monkeypatch.setattr(job, "_progress", real_progress)
    s = run(tmp_path / "out")
    assert s.existing + s.done == 9 and s.existing >= 3
    run(tmp_path / "once")
    assert _files(tmp_path / "out") == _files(tmp_path / "once")


@pytest.fixture(scope="module")
def probs(tmp_path_factory):
    """A --probs folder: (3, H, W) softmax maps and their images, two sizes."""
    root = tmp_path_factory.mktemp("probs")
    (root / "images").mkdir()
    (root / "probs").mkdir()
    rng = np.random.default_rng(0)
    for i in range(7):
        h, w = (32, 40) if i % 2 else (40, 32)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "images" / f"p{i}.png")
        logits = rng.normal(0, 2, (3, h, w))
        p = np.exp(logits) / np.exp(logits).sum(0)
        np.save(root / "probs" / f"p{i}.npy", p.astype(np.float32))
    return root


@pytest.mark.parametrize("write", ["labels", "probs"])
def test_crf_writes_the_same_bytes_with_io_workers(probs, tmp_path, capsys, write):
    def args(out, images, *extra):
        return ["crf", "--probs", str(probs / "probs"), "--images", str(images), "--out", str(out),
                "--write", write, "--batch-size", "2", *extra]

    for n in ("0", "2"):
        assert _run(args(tmp_path / n, probs / "images", "--io-workers", n), capsys)[0] == 0
    a, b = _files(tmp_path / "0"), _files(tmp_path / "2")
    assert len(a) == 7 and a == b
    images = _corrupt(probs / "images", "p3.png", tmp_path / "bad")
    errs = []
    for n in ("0", "2"):
        rc, err = _run(args(tmp_path / f"skip{n}", images, "--io-workers", n, "--on-error", "skip"), capsys)
        assert rc == 1 and "p3" in err
        errs.append(err)
    assert errs[0] == errs[1] and _files(tmp_path / "skip0") == _files(tmp_path / "skip2")
    assert "p3.png" not in _files(tmp_path / "skip2") and len(_files(tmp_path / "skip2")) == 6


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, x):
        return self.conv(x)


def test_predict_writes_the_same_bytes_with_io_workers(probs, tmp_path):
    from mars_plugin.commands.predict import predict_job

    model = _Net().eval()
    for n in (0, 2):
        s = predict_job(model, probs / "images", tmp_path / str(n), scales=(1.0,), flip=True, batch_size=2,
                        io_workers=n, progress=False)
        assert (s.done, s.failed) == (7, [])
    a, b = _files(tmp_path / "0"), _files(tmp_path / "2")
    assert len(a) == 7 and a == b
    images = _corrupt(probs / "images", "p2.png", tmp_path / "bad")
    failed = []
    for n in (0, 2):
        s = predict_job(model, images, tmp_path / f"skip{n}", scales=(1.0,), flip=True, batch_size=2,
                        io_workers=n, on_error="skip", progress=False)
        failed.append(s.failed)
    assert failed[0] == failed[1] and [stem for stem, _ in failed[0]] == ["p2"]
    assert _files(tmp_path / "skip0") == _files(tmp_path / "skip2") and len(_files(tmp_path / "skip2")) == 6
    with pytest.raises(JobError, match="p2"):
        predict_job(model, images, tmp_path / "stop", scales=(1.0,), io_workers=2, progress=False)


def test_io_workers_with_worker_processes_refused_by_name(world, probs, tmp_path, capsys):
    """--io-workers (threads beside the device) with --workers processes: one line naming both,
    nothing written (their out-of-range values: tests/test_param_edges.py)."""
    rc, err = _run(_debias(world, tmp_path / "d", world / "images", ["--workers", "2", "--io-workers", "2"]), capsys)
    assert rc == 2 and "--io-workers" in err and "--workers" in err and "not both" in err
    rc, err = _run(["crf", "--probs", str(probs / "probs"), "--images", str(probs / "images"), "--out",
                    str(tmp_path / "c"), "--workers", "1", "--io-workers", "1"], capsys)
    assert rc == 2 and "not both" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "c").exists()


def test_io_workers_is_documented_the_same_way_by_each_command():
    from mars_plugin.commands.cli_parser import build_parser
    from mars_plugin.runs.io_pipeline import IO_WORKERS_HELP

    sub = next(a for a in build_parser()._actions if a.choices and "debias" in a.choices)
    helps = {cmd: [a.help for a in sub.choices[cmd]._actions if "--io-workers" in a.option_strings]
             for cmd in ("debias", "crf", "predict")}
    assert all(h == [IO_WORKERS_HELP + "%(default).0s"] for h in helps.values()), helps
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = [line for line in readme.splitlines()
            if line.startswith(("| `mars debias", "| `mars crf", "| `mars predict"))]
    assert len(rows) == 3 and all("[--io-workers N]" in r for r in rows)
