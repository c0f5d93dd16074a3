"""Issue 41, class 1: a small file never becomes a large allocation.

Every tensor or array a reader takes from a file goes through one door
(:mod:`mars_plugin.formats.bounded_load`): a view whose values overlap (stride 0), a header
declaring more than the file holds, a zip record or a whole file declaring more than the read's
bound, a ``.npz`` where one array is expected, are refused in one line naming the file and the
key, before anything of the declared size exists. One crafted tiny file per reader kind (the CAMs
of every WSSS format, a checkpoint, centroids, features, a label, a codebook), ``mars crf --cams
--wsss dhr`` on the issue's 1.9 KB file under an address-space limit, and a scan of the sources
that fails on a ``torch.load``/``np.load``/``pickle.load`` outside the door.
"""
import io
import os
import pickle
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin.formats import bounded_load as B
from mars_plugin.formats.files import read_features, read_label, write_label

ROOT = Path(__file__).resolve().parents[1]
#: A view of one stored value declaring 128 MB as float32: small enough that the readers of the
#: base commit, which copy it, pass (and these tests fail) without harm.
VIEW = (2, 4000, 4000)


def _view(dtype=torch.float32, shape=VIEW):
    return torch.zeros(1, dtype=dtype).expand(*shape)


def _one_line(msg: str, path) -> None:
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg


def _npy_header_only(path, shape, dtype="<f4"):
    """A .npy whose header declares ``shape`` and which holds 16 bytes of values."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
        f.write(b"\0" * 16)


# ------------------------------------------------------------------- one crafted file per reader

def _dhr(p):
    torch.save({"keys": torch.tensor([0, 15]), "masks": _view(torch.float16)}, p)


def _irnet(p):
    np.save(p, {"keys": np.array([14]), "cam": _view(), "high_res": _view()}, allow_pickle=True)


def _seam(p):
    np.save(p, {14: _view(shape=VIEW[1:])}, allow_pickle=True)


def _rsepm(p):
    with open(p, "wb") as f:
        pickle.dump({"keys": np.array([0, 15]), "seed": _view()}, f)


def _read_cams(wsss):
    from mars_plugin.commands.label_formats import _adapter

    return lambda p: _adapter(wsss).load_cams(p, trust_pickle=True)


def _checkpoint(p):
    from mars_plugin.networks.seg_checkpoint import CHECKPOINT_FORMAT

    torch.save({"format": CHECKPOINT_FORMAT, "model": {}, "iteration": 1, "student": {"head.weight": _view()}}, p)


def _read_checkpoint(p):
    from mars_plugin.networks.seg_checkpoint import load_checkpoint

    return load_checkpoint(p)


def _centroids(p):
    torch.save({"format": "mars-plugin/debiased-centroids/1", "centroids": _view(shape=(5000, 5000))}, p)


def _read_centroids(p):
    from mars_plugin.method.selection import DebiasedCentroids

    return DebiasedCentroids.load(p)


def _vit(p):
    torch.save({"student": {"backbone.pos_embed": _view()}}, p)


def _read_vit(p):
    from mars_plugin.adapters.uss.vit_weights import load_checkpoint

    return load_checkpoint(p, what="DINO checkpoint")


def _read_codebook(p):
    from mars_plugin.adapters.uss.cause_files import load_codebook_npy

    return load_codebook_npy(p)


#: kind -> (file name, maker, reader, what the message says after the path)
READERS = {
    "dhr masks": ("a.pt", _dhr, _read_cams("dhr"), r"masks: declares a torch.float16 tensor of shape \(2, 4000, "
                  r"4000\) \(64,000,000 bytes\) over a storage of 2 bytes, with strides \(0, 0, 0\) whose values "
                  r"overlap"),
    "irnet cam dict": ("a.npy", _irnet, _read_cams("irnet"), r"cam: declares a torch.float32 tensor .* overlap"),
    "advcam cam dict": ("a.npy", _irnet, _read_cams("advcam"), r"cam: declares a torch.float32 tensor .* overlap"),
    "seam cam dict": ("a.npy", _seam, _read_cams("seam"), r"14: declares a torch.float32 tensor of shape \(4000, "
                      r"4000\) .* overlap"),
    "rsepm pickle": ("a.pkl", _rsepm, _read_cams("rsepm"), r"seed: declares a torch.float32 tensor .* overlap"),
    "irnet npy header": ("a.npy", lambda p: _npy_header_only(p, (64, 100000, 100000)), _read_cams("irnet"),
                         r"CAM dict .* of shape \(64, 100000, 100000\) declares 2,560,000,000,000 bytes, above"),
    "seg checkpoint": ("c.pt", _checkpoint, _read_checkpoint, r"student/head.weight: declares .* overlap"),
    "centroids": ("v.pt", _centroids, _read_centroids, r"centroids: declares .* shape \(5000, 5000\) .* overlap"),
    "vit weights": ("w.pth", _vit, _read_vit, r"student/backbone.pos_embed: declares .* overlap"),
    "features npy header": ("f.npy", lambda p: _npy_header_only(p, (4, 1000, 1000), "<f2"), read_features,
                            r"declares a float16 array of shape \(4, 1000, 1000\) \(8,000,000 bytes\), but the file "
                            r"holds 16 bytes after its header"),
    "features pt view": ("f.pt", lambda p: torch.save(_view(torch.float16), p), read_features,
                         r"declares a torch.float16 tensor .* overlap"),
    "codebook npy header": ("modular.npy", lambda p: _npy_header_only(p, (100000, 100000)), _read_codebook,
                            r"of shape \(100000, 100000\) declares 40,000,000,000 bytes, above the"),
}


@pytest.mark.parametrize("kind", list(READERS))
def test_each_reader_refuses_a_small_file_declaring_a_large_tensor(tmp_path, kind):
    name, make, read, match = READERS[kind]
    p = tmp_path / name
    make(p)
    assert p.stat().st_size < 8192  # a small file, each of them
    with pytest.raises(ValueError) as e:
        read(p)
    msg = str(e.value)
    _one_line(msg, p)
    assert re.search(match, msg), msg


def test_an_npz_named_npy_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "f.npy"
    with open(p, "wb") as f:
        np.savez(f, a=np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError) as e:
        read_features(p)
    _one_line(str(e.value), p)
    assert "a .npz archive (a zip of arrays), not one .npy array" in str(e.value)


def test_a_label_declaring_more_than_the_read_allows_is_refused_before_decoding(tmp_path):
    p = tmp_path / "l.png"
    write_label(p, torch.zeros(300, 400, dtype=torch.long))
    with B.read_limit(100_000, "a test's bound"):
        with pytest.raises(ValueError) as e:
            read_label(p)
    _one_line(str(e.value), p)
    assert "label of shape (300, 400) declares 960,000 bytes, above the 100,000 bytes this read allows (a test's " \
           "bound)" in str(e.value)
    assert read_label(p).shape == (300, 400)  # outside the limit: read


def test_zip_records_declaring_more_than_the_bound_are_refused_before_loading(tmp_path):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1000)}, p)
    with B.read_limit(2000, "--max-memory"):
        with pytest.raises(B.ReadRefused, match=r"its zip records declare [\d,]+ bytes uncompressed .*, above the "
                                                r"2,000 bytes this read allows \(--max-memory\)"):
            B.torch_load(p)
    assert B.torch_load(p)["w"].shape == (1000,)


def test_the_innermost_and_smaller_limit_wins_and_ends_with_its_block():
    assert B.current_limit()[0] == B.DEFAULT_MAX_READ_BYTES
    with B.read_limit(1000, "outer"):
        with B.read_limit(5000, "larger"), B.read_limit(None, "none"):
            assert B.current_limit() == (1000, "outer")
        with B.read_limit(10, "inner"):
            assert B.current_limit() == (10, "inner")
    assert B.current_limit()[0] == B.DEFAULT_MAX_READ_BYTES


def test_files_whose_values_are_real_still_read():
    for shape, strides, overlap in [((3, 4), (4, 1), False), ((3, 4), (1, 3), False), ((3, 4), (0, 1), True),
                                    ((3, 4), (1, 1), True), ((1, 5), (0, 1), False), ((0, 5), (0, 0), False)]:
        assert B.overlapping(shape, strides) is overlap, (shape, strides)


# ------------------------------------------------------------------- the image's bound, mars crf

def test_dhr_maps_larger_than_their_image_allows_are_refused_before_reading(tmp_path):
    """mars crf reads a DHR file under the bound of its image's size: real maps of 2 x 400 x 400
    float32 (1.28 MB) for a 2x3 image (at most 256 channels of 4x6, 8 bytes: 49 KB)."""
    from mars_plugin.commands.crf_job import _prepare
    from mars_plugin.formats.files import write_image

    torch.save({"keys": torch.tensor([0, 15]), "masks": torch.rand(2, 400, 400)}, tmp_path / "a.pt")
    write_image(tmp_path / "a.png", np.zeros((2, 3, 3), np.uint8))
    cfg = {"wsss": "dhr", "trust_pickle": False, "write": "labels", "probs_dtype": "float16", "num_labels": 21,
           "dataset": "voc", "max_bytes": None}
    stem, item, err = _prepare(("a", str(tmp_path / "a.pt"), str(tmp_path / "a.png"), cfg))
    assert item is None and err is not None, item
    # refused from the zip's directory, before torch reads a record
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'a.pt'))}: its zip records declare [\d,]+ bytes uncompressed "
                        r"\(a/data/\d: 1,280,000\), above the 49,152 bytes this read allows \(maps of its 3x2 image: "
                        r".*\)", err), err


def _crf_cli(tmp_path, limit_bytes):
    """``mars crf --cams --wsss dhr`` on the issue's file (masks: a stride-0 view declaring
    2 x 30000 x 30000 float16) in a child whose address space is ``limit_bytes``."""
    cams, images = tmp_path / "cams", tmp_path / "images"
    cams.mkdir()
    torch.save({"keys": torch.tensor([0, 15]), "masks": _view(torch.float16, (2, 30000, 30000))}, cams / "a.pt")
    from mars_plugin.formats.files import write_image

    write_image(images / "a.jpg", np.zeros((20, 30, 3), np.uint8))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "from mars_plugin.cli import main; rc = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)").format(limit_bytes)
    argv = ["crf", "--cams", str(cams), "--wsss", "dhr", "--images", str(images), "--out", str(tmp_path / "out"),
            "--no-progress"]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return cams / "a.pt", r


def test_mars_crf_refuses_the_issues_dhr_file_in_one_line_within_a_few_gb(tmp_path):
    path, r = _crf_cli(tmp_path, 4 << 30)  # 14.5 GB on the base commit: it fails loudly here instead
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    assert re.fullmatch(rf"mars crf: error: a: {re.escape(str(path))}: masks: declares a torch.float16 tensor of "
                        r"shape \(2, 30000, 30000\) \(3,600,000,000 bytes\) over a storage of 2 bytes, with strides "
                        r"\(0, 0, 0\) whose values overlap .*", lines[0]), lines[0]
    assert not (tmp_path / "out" / "a.png").exists()
    peak_kib = int(r.stdout.split()[-1])
    assert peak_kib < 1 << 20, peak_kib  # under 1 GiB at its peak (about 0.3 GiB: torch itself)


# ------------------------------------------------------------------- one door: the sources

#: Calls that read a tensor or an array from a file, and the one module that may make them.
FORBIDDEN = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "load"), ("pickle", "loads"),
             ("np", "fromfile"), ("torch", "from_file")}
DOOR = ROOT / "mars_plugin" / "formats" / "bounded_load.py"


def _calls(path: Path):
    """(line, 'mod.name') of every ``mod.name(`` in the code of ``path`` (strings and comments,
    so docstrings, are not code)."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.STRING)]
    for a, dot, b, paren in zip(toks, toks[1:], toks[2:], toks[3:]):
        if dot.string == "." and paren.string == "(" and (a.string, b.string) in FORBIDDEN:
            yield a.start[0], f"{a.string}.{b.string}"


def test_no_reader_loads_a_file_but_through_the_door():
    sources = sorted((ROOT / "mars_plugin").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))
    assert DOOR in sources and len(sources) > 100
    found = [f"{p.relative_to(ROOT)}:{line}: {call}(" for p in sources if p != DOOR for line, call in _calls(p)]
    assert not found, ("read files through mars_plugin.formats.bounded_load (torch_load, numpy_load, pickle_load), "
                       "which bounds what they declare: " + "; ".join(found))
    assert {c for _, c in _calls(DOOR)} >= {"torch.load", "np.load", "pickle.load"}


def test_the_scan_sees_a_call_and_not_a_docstring(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""torch.load(x) in a docstring"""\n# np.load(y) in a comment\nx = np . load (f)\n')
    assert list(_calls(p)) == [(3, "np.load")]


def test_real_arrays_of_a_trusted_pickle_are_bounded_all_together(tmp_path):
    """Values that are really in the file, each once, still count against the read's bound, all
    arrays of the file together: RS+EPM's pickle (--trust-pickle) under a 100 KB bound."""
    from mars_plugin.adapters.wsss import rsepm

    p = tmp_path / "a.pkl"
    with open(p, "wb") as f:
        pickle.dump({"keys": np.array([0, 15]), "seed": np.zeros((2, 200, 100), np.float32)}, f)
    with B.read_limit(100_000, "--max-memory"):
        with pytest.raises(ValueError) as e:
            rsepm.load_cams(p, trust_pickle=True)
    _one_line(str(e.value), p)
    assert str(e.value) == (f"{p}: seed: its tensors and arrays declare 160,016 bytes (up to this one), above the "
                            "100,000 bytes this read allows (--max-memory)")
    assert rsepm.load_cams(p, trust_pickle=True)["cam"].shape[1:] == (200, 100)


def test_mars_crf_reads_each_maps_file_under_its_max_memory(tmp_path, capsys):
    """Real DHR maps of 480 KB (within their 30x20 image's bound) under --max-memory 0.0001 GiB."""
    from mars_plugin import cli
    from mars_plugin.formats.files import write_image

    (tmp_path / "cams").mkdir()
    torch.save({"keys": torch.tensor([0, 15]), "masks": torch.rand(2, 200, 300)}, tmp_path / "cams" / "a.pt")
    write_image(tmp_path / "images" / "a.jpg", np.zeros((20, 30, 3), np.uint8))
    rc = cli.main(["crf", "--cams", str(tmp_path / "cams"), "--wsss", "dhr", "--images", str(tmp_path / "images"),
                   "--out", str(tmp_path / "out"), "--no-progress", "--max-memory", "0.0001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert re.fullmatch(rf"mars crf: error: a: {re.escape(str(tmp_path / 'cams' / 'a.pt'))}: its zip records declare "
                        r"[\d,]+ bytes uncompressed \(a/data/\d: 480,000\), above the 107,374 bytes this read allows "
                        r"\(--max-memory\)", err[0]), err[0]


def test_every_command_reads_under_its_max_memory():
    """The command line runs each command inside a read_limit of its --max-memory (a command
    without the flag: the default bound)."""
    from types import SimpleNamespace

    from mars_plugin.cli import _run_bounded

    spec = SimpleNamespace(run=lambda args: B.current_limit())
    assert _run_bounded(spec, SimpleNamespace(max_memory=0.5)) == (1 << 29, "--max-memory")
    assert _run_bounded(spec, SimpleNamespace(max_memory=None))[0] == B.DEFAULT_MAX_READ_BYTES
    assert _run_bounded(spec, SimpleNamespace())[0] == B.DEFAULT_MAX_READ_BYTES


def _legacy_torch_file(path, numel):
    """torch's legacy (non-zip) format, whose pickle declares each storage's size before the
    values: one storage of ``numel`` float32 declared, 3 stored."""
    b = io.BytesIO()
    torch.save(torch.zeros(3), b, _use_new_zipfile_serialization=False)
    data = b.getvalue()
    i = data.index(b"cpuq\x04K\x03") + len(b"cpuq\x04")  # the storage's numel, a one-byte int
    path.write_bytes(data[:i] + b"\x8a\x06" + numel.to_bytes(6, "little") + data[i + 2:])


def test_an_allocation_that_fails_names_the_file(tmp_path):
    p = tmp_path / "legacy.pt"
    _legacy_torch_file(p, 10 ** 12)  # 4 TB: no allocator gives it
    with pytest.raises(B.ReadRefused) as e:
        B.torch_load(p)
    _one_line(str(e.value), p)
    assert "reading it needs more memory than this process can have" in str(e.value)


def test_mars_crf_names_the_file_of_a_failed_allocation(tmp_path, monkeypatch):
    """An allocation that fails after the read (numpy's message names a shape, not a file)."""
    from mars_plugin.adapters.wsss import dhr
    from mars_plugin.commands.crf_job import _prepare
    from mars_plugin.formats.files import write_image

    def no_memory(*a, **k):
        raise MemoryError("Unable to allocate 6.71 GiB for an array with shape (2, 30000, 30000)")

    monkeypatch.setattr(dhr, "crf_input", no_memory)
    torch.save({"keys": torch.tensor([0, 15]), "masks": torch.rand(2, 4, 6)}, tmp_path / "a.pt")
    write_image(tmp_path / "a.png", np.zeros((4, 6, 3), np.uint8))
    cfg = {"wsss": "dhr", "trust_pickle": False, "write": "labels", "probs_dtype": "float16", "num_labels": 21,
           "dataset": "voc", "max_bytes": None}
    _, item, err = _prepare(("a", str(tmp_path / "a.pt"), str(tmp_path / "a.png"), cfg))
    assert item is None and err.startswith(f"{tmp_path / 'a.pt'}: Unable to allocate 6.71 GiB"), err


# --- the bound reaches the threads that read ----------------------------------------------------


def test_io_worker_threads_read_under_the_callers_bound(tmp_path):
    """`--io-workers` threads read under the run's bound (--max-memory), not the default: a new
    thread starts with an empty context, so the pipeline runs each read in a copy of the
    submitter's (base: the thread read the label the caller's bound refuses)."""
    from mars_plugin.runs.io_pipeline import IOPipeline

    p = tmp_path / "l.png"
    write_label(p, torch.zeros(300, 400, dtype=torch.long))
    for workers in (0, 2):  # the serial path and the threads: the same answer
        with B.read_limit(100_000, "--max-memory"), IOPipeline(workers, ahead=1, behind=1) as io_:
            (_, future), = list(io_.reads(read_label, [p]))
            with pytest.raises(ValueError, match=r"above the 100,000 bytes this read allows \(--max-memory\)"):
                future.result()


def test_mars_train_checks_its_data_under_its_bound(tmp_path):
    """mars train reads every label once before step 1, in threads: under the run's bound too."""
    from mars_plugin.commands import train_data

    p = tmp_path / "l.png"
    write_label(p, torch.zeros(300, 400, dtype=torch.long))

    class Labels:
        stems, labels_dir = ["l"], tmp_path

        def read(self, stem):
            return None, read_label(p), None

    with B.read_limit(100_000, "--max-memory"), pytest.raises(Exception, match="above the 100,000 bytes"):
        train_data.check_train_files(Labels(), 3, "ce", workers=2, progress=False)


def test_every_thread_pool_that_reads_runs_in_the_callers_context():
    """Threads that read files are made by runs/io_pipeline.reading_threads (the read bound goes
    with the work); the compiled CRF's threads compute only."""
    allowed = {"mars_plugin/runs/io_pipeline.py", "mars_plugin/engines/crf_compiled.py"}
    sources = sorted((ROOT / "mars_plugin").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))
    bad = [p.relative_to(ROOT).as_posix() for p in sources
           if "ThreadPoolExecutor(" in p.read_text() and p.relative_to(ROOT).as_posix() not in allowed]
    assert not bad, f"make reading threads with mars_plugin.runs.io_pipeline.reading_threads: {bad}"
