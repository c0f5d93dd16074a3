"""Command-line flags and boundaries: --threads, --version, --class-names, broken pipes,
unsafe image ids, corrupt --centroids files, unwritable outputs."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mars_plugin
from mars_plugin.commands import centroids, debias, evaluate, report
from mars_plugin.runs import errors
from mars_plugin.cli import main
from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.formats.files import check_stem, read_label, stem_path
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

COMMANDS = ("demo", "features", "centroids", "debias", "evaluate", "report")
MARS = str(Path(sys.executable).parent / "mars")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    w = make_world(8, size=24, dim=16, seed=6)
    write_world(w, root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root, w


def _minimal_argv(cmd, root, tmp):
    return {
        "demo": ["demo", "--out", str(tmp / "demo")],
        "features": ["features", "--uss", "stego", "--checkpoint", str(tmp / "none.ckpt"), "--images",
                     str(root / "images"), "--out", str(tmp / "feats")],
        "centroids": ["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                      "--num-classes", "6", "--out", str(tmp / "V.pt")],
        "debias": ["debias", "--features", str(root / "features"), "--labels", str(root / "labels"),
                   "--centroids", str(root / "V.pt"), "--out", str(tmp / "db"), "--refine", "threshold"],
        "evaluate": ["evaluate", "--pred", str(root / "labels"), "--gt", str(root / "gt"), "--num-classes", "6"],
        "report": ["report", "--labels", str(root / "labels"), "--debiased", str(root / "labels"), "--images",
                   str(root / "images"), "--out", str(tmp / "rep")],
    }[cmd]


# --threads -------------------------------------------------------------------------------


def test_threads_is_documented_for_every_command(capsys):
    parser = build_parser()
    for cmd in COMMANDS:
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        assert "--threads N" in capsys.readouterr().out, cmd


@pytest.mark.parametrize("cmd", COMMANDS)
def test_threads_is_applied_before_every_command_runs(world, tmp_path, monkeypatch, capsys, cmd):
    """The job itself sees the thread counts that --threads asked for."""
    from mars_plugin.commands import demo
    from mars_plugin.commands import features
    root, _ = world
    seen = {}

    def job(*a, **k):
        seen["torch"] = torch.get_num_threads()
        try:
            import numba
        except ImportError:
            pass
        else:
            seen["numba"] = numba.get_num_threads()
        raise errors.JobError("stopped by the test")

    for mod, name in ((demo, "run_demo"), (features, "run_features"), (centroids, "centroids_job"),
                      (debias, "debias_job"), (evaluate, "evaluate_job"), (report, "report_job")):
        monkeypatch.setattr(mod, name, job)
    before = torch.get_num_threads()
    try:
        import numba
    except ImportError:
        numba = None
    numba_before = None if numba is None else numba.get_num_threads()
    try:
        want = 1 if before > 1 else 2
        assert main([*_minimal_argv(cmd, root, tmp_path), "--threads", str(want)]) == 2
        assert seen["torch"] == want
        if "numba" in seen:
            import numba

            assert seen["numba"] == min(want, numba.config.NUMBA_NUM_THREADS)
    finally:  # thread counts are process-wide: later tests must find them as they were
        torch.set_num_threads(before)
        if numba is not None:
            numba.set_num_threads(numba_before)
    assert "stopped by the test" in capsys.readouterr().err


def test_threads_left_alone_by_default_and_refused_below_one(world, tmp_path, capsys):
    root, _ = world
    before = torch.get_num_threads()
    assert main([*_minimal_argv("evaluate", root, tmp_path), "--no-progress"]) == 0
    assert torch.get_num_threads() == before
    with pytest.raises(SystemExit) as e:
        main([*_minimal_argv("evaluate", root, tmp_path), "--threads", "0"])
    assert e.value.code == 2 and "--threads" in capsys.readouterr().err


# --version, broken pipes -----------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"mars {mars_plugin.__version__}"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["evaluate"]], ids=["help", "evaluate"])
def test_a_reader_closing_the_pipe_ends_quietly(world, argv):
    """`mars ... | head -1` where head has already gone: nothing on stderr, exit 141 (--help:
    0, argparse ignores the failed write itself)."""
    root, _ = world
    if argv == ["evaluate"]:
        argv = ["evaluate", "--pred", str(root / "labels"), "--gt", str(root / "gt"), "--num-classes", "6",
                "--no-progress"]
    p = subprocess.Popen([MARS, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before mars writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == (0 if argv == ["--help"] else 141), err
    assert err == ""


# --class-names ---------------------------------------------------------------------------


def test_centroids_and_debias_print_class_names(world, tmp_path, capsys):
    root, w = world
    names = ["background", *w.class_names[1:]]
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(tmp_path / "V.pt"), "--no-progress",
                 "--class-names", str(root / "classes.json")]) == 0
    out = capsys.readouterr().out
    for c in range(1, 7):
        assert f"class {c} ({names[c]}): " in out

    args = ["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
            str(root / "V.pt"), "--out", str(tmp_path / "db"), "--refine", "threshold", "--no-progress",
            "--class-names", str(root / "classes.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    # the printed counts equal those of the written labels against the pseudo labels
    pixels, removed = {}, {}
    for p in sorted((tmp_path / "db").glob("*.png")):
        y = read_label(root / "labels" / p.name, biased_value=None)
        d = read_label(p)
        for c in range(1, 7):
            pixels[c] = pixels.get(c, 0) + int((y == c).sum())
            removed[c] = removed.get(c, 0) + int(((y == c) & (d == -1)).sum())
    assert sum(removed.values()) > 0
    for c in range(1, 7):
        if pixels[c]:
            share = 100 * removed[c] / pixels[c]
            assert f"class {c} ({names[c]}): {removed[c]} of {pixels[c]} ({share:.1f}%)" in out
    # a resumed run writes nothing, so counts nothing
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8 already done" in out and "marked biased" not in out



@pytest.mark.parametrize("wsss", ["seam", "rsepm"])
def test_wsss_without_class_names_prints_that_codebases_names(world, tmp_path, capsys, wsss):
    """``--wsss NAME`` and no ``--class-names``: the summary names the classes as that codebase does."""
    from mars_plugin.adapters.wsss import rsepm, seam

    names = list(seam.CLASS_NAMES) if wsss == "seam" else list(rsepm.class_names("voc"))
    root, _ = world
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(tmp_path / "V.pt"), "--no-progress", "--wsss", wsss]) == 0
    out = capsys.readouterr().out
    for c in range(1, 7):
        assert f"class {c} ({names[c]}): " in out

# unsafe ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", ["../x", "a/b", "a\\b", "", ".", "..", "a\0b", "/abs"])
def test_writers_refuse_ids_that_are_not_plain_file_names(tmp_path, stem):
    with pytest.raises(ValueError, match="not a plain file name"):
        check_stem(stem)
    with pytest.raises(ValueError, match="not a plain file name"):
        stem_path(tmp_path, stem, ".png")
    assert stem_path(tmp_path, "ok.1", ".png") == tmp_path / "ok.1.png"


def test_debias_writes_through_stem_path(world, tmp_path, monkeypatch):
    """The debias writer builds its output path with the checked stem_path."""
    root, _ = world
    calls = []
    real = debias.stem_path

    def spy(folder, stem, suffix):
        calls.append(stem)
        return real(folder, stem, suffix)

    monkeypatch.setattr(debias, "stem_path", spy)
    assert main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
                 str(root / "V.pt"), "--out", str(tmp_path / "db"), "--refine", "threshold", "--no-progress"]) == 0
    assert len(set(calls)) == 8


# corrupt --centroids, unwritable outputs -------------------------------------------------


class _Foreign:
    pass


def _bad_centroids(kind, tmp_path):
    p = tmp_path / f"{kind}.pt"
    if kind == "random-bytes":
        p.write_bytes(os.urandom(4096))
    elif kind == "other-torch-file":
        torch.save({"state": torch.zeros(3)}, p)
    elif kind == "tag-but-no-tensors":
        torch.save({"format": "mars-plugin/debiased-centroids/1"}, p)
    elif kind == "needs-unpickling":
        torch.save({"format": "mars-plugin/debiased-centroids/1", "x": _Foreign()}, p)
    elif kind == "plain-pickle":
        p.write_bytes(pickle.dumps(_Foreign()))
    elif kind == "folder":
        p.mkdir()
    elif kind == "empty":
        p.write_bytes(b"")
    return p  # "missing": never written


@pytest.mark.parametrize("kind", ["random-bytes", "other-torch-file", "tag-but-no-tensors", "needs-unpickling",
                                  "plain-pickle", "folder", "empty", "missing"])
def test_a_bad_centroids_file_is_one_line(world, tmp_path, capsys, kind):
    root, _ = world
    p = _bad_centroids(kind, tmp_path)
    rc = main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
               str(p), "--out", str(tmp_path / "db"), "--refine", "threshold", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mars debias: error: --centroids {p}"), err
    assert "Traceback" not in err and "weights_only" not in err
    if kind == "needs-unpickling":
        assert "unpickling" in err
    assert not (tmp_path / "db").exists() or not list((tmp_path / "db").iterdir())


def _unwritable_cases(tmp_path, root):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    folder = tmp_path / "a_folder"
    folder.mkdir()
    base = {
        "centroids": ["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                      "--num-classes", "6", "--no-progress", "--out"],
        "debias": ["debias", "--features", str(root / "features"), "--labels", str(root / "labels"),
                   "--centroids", str(root / "V.pt"), "--refine", "threshold", "--no-progress", "--out"],
        "report": ["report", "--labels", str(root / "labels"), "--debiased", str(root / "labels"), "--images",
                   str(root / "images"), "--no-progress", "--out"],
        "evaluate": ["evaluate", "--pred", str(root / "labels"), "--gt", str(root / "gt"), "--num-classes", "6",
                     "--no-progress", "--json"],
    }
    return [
        ("centroids", base["centroids"] + [str(folder)]),                  # a folder where a file goes
        ("centroids", base["centroids"] + [str(a_file / "V.pt")]),         # under a file
        ("debias", base["debias"] + [str(a_file)]),                        # a file where a folder goes
        ("debias", base["debias"] + [str(a_file / "db")]),
        ("report", base["report"] + [str(a_file)]),
        ("evaluate", base["evaluate"] + [str(a_file / "s.json")]),
    ]


def test_unwritable_outputs_are_one_line(world, tmp_path, capsys):
    root, _ = world
    for cmd, argv in _unwritable_cases(tmp_path, root):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: "), err
        assert "a_file" in lines[0] or "a_folder" in lines[0]
        assert ("--json" if cmd == "evaluate" else "--out") in lines[0]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_out_under_a_read_only_folder_is_one_line(world, tmp_path, capsys):
    root, _ = world
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for cmd, argv in (("centroids", _minimal_argv("centroids", root, ro)),
                          ("debias", _minimal_argv("debias", root, ro)),
                          ("report", _minimal_argv("report", root, ro))):
            assert main([*argv, "--no-progress"]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and str(ro) in lines[0] and "--out" in lines[0]
    finally:
        ro.chmod(0o755)
