"""A new user's first hour: the traps of issue 22, class 6, each as a family over the commands.

* error texts name the command line's flags, never a Python parameter, ``name='value'``,
  ``name['key']`` or a dict repr;
* a mistyped, empty or wrong input folder is one line before any work (exit 2), in every
  command, also with ``--on-error skip`` (which then leaves no empty output folder);
* a folder of label PNGs given as ``--images`` is refused;
* a label set (or ground truth) with no valid pixel is an error naming the folder; one such
  label is a warning (see ``mars_plugin.commands.inputs.no_valid_pixel`` for why);
* Ctrl-C ends every command with one line and exit 130, ``--workers`` processes included;
* ``--wsss dhr`` prints DHR's class names and ``--class-names`` reads DHR's dataset json.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import cli
from mars_plugin.formats.files import read_label, write_label
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

from test_reproduce import DATA, _tiny_stego_files, make_tree

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    w = make_world(6, size=32, seed=3)
    write_world(w, root / "w")
    assert cli.main(["centroids", "--features", str(root / "w" / "features"), "--labels", str(root / "w" / "labels"),
                     "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    b, h = _tiny_stego_files(root)
    return root, w, b, h


def _run(argv, capsys):
    """(exit status, stdout, stderr lines) of ``mars argv``; argparse's usage errors included."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # would end pytest itself
        pytest.fail("KeyboardInterrupt escaped mars")
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("usage:") and not l.startswith(" ")]
    return code, out, lines


def _args(world, cmd: str, **over):
    """A valid command line for ``cmd`` on the world, with flags replaced (None: dropped)."""
    root, w, b, h = world
    d = root / "w"
    base = {
        "centroids": {"--features": d / "features", "--labels": d / "labels", "--num-classes": 6,
                      "--out": root / "tmp" / "V.pt"},
        "debias": {"--features": d / "features", "--labels": d / "labels", "--centroids": root / "V.pt",
                   "--images": d / "images", "--out": root / "tmp" / "db"},
        "evaluate": {"--pred": d / "labels", "--gt": d / "gt", "--num-classes": 6},
        "report": {"--labels": d / "labels", "--debiased": d / "labels", "--images": d / "images",
                   "--out": root / "tmp" / "report"},
        "features": {"--uss": "stego", "--backbone": b, "--heads": h, "--images": d / "images",
                     "--out": root / "tmp" / "f"},
        "demo": {"--out": root / "tmp" / "demo"},
        "sample": {"--tree": "dhr", "--out": root / "tmp" / "sample"},
    }[cmd]
    base.update(over)
    argv = [cmd]
    for k, v in base.items():
        if v is None:
            continue
        argv += [k] if v is True else [k, str(v)]
    return argv + (["--no-progress"] if cmd not in ("demo", "sample") else [])


# --------------------------------------------------------------------------- 1. flags, not parameters

#: The Python parameters of the functions behind the commands: none may reach the command line.
def _python_parameters():
    import inspect

    from mars_plugin import select_centroids

    from mars_plugin.commands import centroids, debias, demo, evaluate, report, reproduce
    from mars_plugin.runs import distributed
    from mars_plugin.adapters.uss import extractor
    from mars_plugin.commands import features
    from mars_plugin.engines.crf_params import check_crf_params
    from mars_plugin.commands.reproduce_settings import ReproduceSettings

    from mars_plugin.commands.command_table import COMMANDS, flags_module

    # the jobs take their settings records' fields as keywords: the records' fields count too
    records = tuple(r for r in (getattr(flags_module(n), "SETTINGS", None) for n in COMMANDS) if r is not None)
    names = set()
    for fn in records + (centroids.centroids_job, debias.debias_job, evaluate.evaluate_job, report.report_job,
               features.features_job, extractor.load_extractor, reproduce.reproduce, demo.run_demo, select_centroids, check_crf_params,
               distributed.resolve_device, ReproduceSettings):
        names |= set(inspect.signature(fn).parameters)
    return names


PARAMS = _python_parameters()
#: how mars reads files, named in some messages: not a parameter of the user's
ALLOWED = {"weights_only=True", "allow_pickle=False"}


def _python_in(line: str) -> list:
    found = []
    line = re.sub(r'"[^"]*"', '""', line)  # JSON the user writes, e.g. {"class_names": [...]}
    for m in re.finditer(r"(?<![\w/.-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w/-])", line):
        if m.group(1) in PARAMS:
            found.append(m.group(1))  # an underscored parameter name, e.g. images_dir
    for m in re.finditer(r"(?<![\w/.-])([a-z][a-z0-9_]*)(=['\"]?[\w.-]+['\"]?|\[['\"])", line):
        if m.group(0) not in ALLOWED and not m.group(0).startswith(tuple(a.split("=")[0] for a in ALLOWED)):
            found.append(m.group(0))  # name='value', name=value, name['key']
    for m in re.finditer(r"(?<![\w/.-])([a-z][a-z0-9_]*) must\b", line):
        if m.group(1) in PARAMS:
            found.append(m.group(0))  # "workers must be >= 1"
    found += re.findall(r"[\w-]\[['\"]\w*['\"]\]", line)  # subscription, e.g. --crf-params['iterations']
    if "{'" in line:
        found.append("a dict repr")
    return found


def _bad_names(root: Path) -> Path:
    p = root / "bad_names.json"
    p.write_text('{"x": 1}')
    return p


ERROR_CASES = {
    "debias crf without images": ("debias", dict(**{"--images": None})),
    "debias workers 0": ("debias", {"--workers": 0}),
    "debias batch size 0": ("debias", {"--batch-size": 0}),
    "debias crf params key": ("debias", {"--crf-params": '{"foo": 1}'}),
    "debias crf params value": ("debias", {"--crf-params": '{"iterations": -1}'}),
    "debias crf params preset": ("debias", {"--crf-params": "bogus"}),
    "debias device": ("debias", {"--device": "tpu"}),
    "debias class names": ("debias", {"--class-names": "{bad}"}),
    "centroids alpha": ("centroids", {"--alpha": 0}),
    "centroids k-fg": ("centroids", {"--k-fg": 0}),
    "centroids num-classes": ("centroids", {"--num-classes": 0}),
    "centroids spill-dir": ("centroids", {"--spill-dir": "{root}/nowhere"}),
    "centroids spill-mb": ("centroids", {"--spill-mb": -1}),
    "centroids device": ("centroids", {"--device": "tpu"}),
    "centroids class names": ("centroids", {"--class-names": "{bad}"}),
    "centroids image labels": ("centroids", {"--image-labels": "{bad}"}),
    "evaluate class names": ("evaluate", {"--class-names": "{bad}"}),
    "evaluate too few names": ("evaluate", {"--class-names": "{two}"}),
    "report num-examples": ("report", {"--num-examples": -1}),
    "report per-class": ("report", {"--per-class": -1}),
    "features batch size": ("features", {"--batch-size": 0}),
    "features stride": ("features", {"--stride": 0}),
    "features device": ("features", {"--device": "tpu"}),
    "features res": ("features", {"--res": 0}),
    "demo size": ("demo", {"--size": 2}),
    "demo crf params": ("demo", {"--crf-params": '{"x": 1}'}),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_name_flags_not_python(world, capsys, case):
    root = world[0]
    cmd, over = ERROR_CASES[case]
    two = root / "two.json"
    two.write_text('["background", "boat"]')
    subst = {"{bad}": str(_bad_names(root)), "{two}": str(two), "{root}": str(root)}
    over = {k: (subst.get(v, v.replace("{root}", str(root))) if isinstance(v, str) else v) for k, v in over.items()}
    code, _, lines = _run(_args(world, cmd, **over), capsys)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: "), lines
    line = lines[0].replace(str(root), "<root>")
    assert not _python_in(line), (line, _python_in(line))
    assert re.search(r"--[a-z]", line), f"no flag named: {line}"


def test_debias_on_cuda_without_cuda_names_the_flag(world, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _, lines = _run(_args(world, "debias", **{"--device": "cuda"}), capsys)
    assert code == 2 and not _python_in(lines[0]) and "--device cuda" in lines[0], lines


def test_compiled_backend_without_numba_names_the_flag(world, capsys, monkeypatch):
    monkeypatch.setenv("MARS_NO_NUMBA", "1")
    code, _, lines = _run(_args(world, "centroids", **{"--backend": "compiled"}), capsys)
    assert code == 2 and not _python_in(lines[0]) and "--backend compiled" in lines[0], lines


@pytest.mark.parametrize("msg, want", [
    ("refine='crf' needs images_dir (the RGB images); or use refine='threshold'",
     "--refine crf needs --images (the RGB images); or use --refine threshold"),
    ("crf_params['iterations'] must be a positive number, got -1", '--crf-params "iterations" must be a positive'),
    ("workers must be >= 1, got 0", "--workers must be >= 1, got 0"),
    ("per_class must be an integer >= 0", "--per-class must be an integer >= 0"),
    ("/data/batch_size/x_dir/a.png: holds class 3 but num_classes is 2", "/data/batch_size/x_dir/a.png: holds class 3 "
     "but --num-classes is 2"),
    ('expected a list or {"class_names": [...]}', 'expected a list or {"class_names": [...]}'),
    ("the heads file and the backbone file", "the heads file and the backbone file"),
])
def test_flag_names_rewrites_parameters_only(msg, want):
    assert cli._flag_names(msg).startswith(want)


# --------------------------------------------------------------------------- 2. input folders

#: (command, flag of an input folder)
FOLDERS = [("centroids", "--features"), ("centroids", "--labels"), ("debias", "--features"), ("debias", "--labels"),
           ("debias", "--images"), ("evaluate", "--pred"), ("evaluate", "--gt"), ("report", "--labels"),
           ("report", "--debiased"), ("report", "--images"), ("features", "--images")]


#: the folders whose files say which images a command works on
LISTED = {("centroids", "--labels"), ("debias", "--labels"), ("evaluate", "--gt"), ("report", "--debiased"),
          ("features", "--images")}


def _wrong(root: Path, how: str, flag: str) -> Path:
    if how == "mistyped":
        return root / "no_such_folder"
    p = root / f"{how}_{flag.strip('-')}"
    shutil.rmtree(p, ignore_errors=True)
    p.mkdir()
    if how == "holding other files":  # files of the right kind, none for these images
        for name in ("other_1", "other_2"):
            if flag == "--features":
                np.save(p / f"{name}.npy", np.zeros((4, 2, 2), np.float16))
            else:
                write_label(p / f"{name}.png", torch.zeros(8, 8, dtype=torch.long))
    return p


# (a folder that lists the images holding other files is other images, not a wrong folder)
WRONG = [(c, f, how) for c, f in FOLDERS for how in ("mistyped", "empty", "holding other files")
         if not (how == "holding other files" and (c, f) in LISTED)]


@pytest.mark.parametrize("cmd, flag, how", WRONG, ids=[f"{c} {f} {h}" for c, f, h in WRONG])
@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_a_wrong_input_folder_is_one_line_before_any_work(world, capsys, cmd, flag, how, on_error):
    root = world[0]
    shutil.rmtree(root / "tmp", ignore_errors=True)
    folder = _wrong(root, how, flag)
    extra = ["--on-error", on_error]
    code, out, lines = _run(_args(world, cmd, **{flag: folder}) + extra, capsys)
    assert code == 2, (out, lines)
    assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: {flag} {folder}: "), lines
    assert not (root / "tmp").exists()  # nothing written, no empty output folder


@pytest.mark.parametrize("how", ["mistyped", "empty"])
@pytest.mark.parametrize("flag", ["--features", "--pseudo"])
def test_reproduce_wrong_input_folder_is_one_line(tmp_path, capsys, flag, how):
    world, root, pseudo, feats = make_tree(tmp_path, n=3, size=32)
    folder = _wrong(tmp_path, how, flag)
    given = {"--features": feats, "--pseudo": pseudo, flag: folder}
    argv = ["reproduce", "--root", root, "--data", DATA, "--out", tmp_path / "out", "--no-progress",
            "--features", given["--features"], "--pseudo", given["--pseudo"]]
    code, _, lines = _run(argv, capsys)
    assert code == 2 and len(lines) == 1 and f"{flag} {folder}" in lines[0], lines


# --------------------------------------------------------------------------- 3. label PNGs as --images

def _label_folders(world) -> dict:
    root, w, _, _ = world
    d = root / "w"
    as_l = root / "labels_L"
    if not as_l.exists():
        as_l.mkdir()
        for p in (d / "gt").glob("*.png"):
            write_label(as_l / p.name, read_label(p, biased_value=None), mode="L")
    return {"the labels": d / "labels", "the ground truth": d / "gt", "grayscale label copies": as_l}


@pytest.mark.parametrize("which", ["the labels", "the ground truth", "grayscale label copies"])
@pytest.mark.parametrize("cmd", ["debias", "report", "features"])
def test_label_pngs_given_as_images_are_refused(world, capsys, cmd, which):
    root = world[0]
    shutil.rmtree(root / "tmp", ignore_errors=True)
    folder = _label_folders(world)[which]
    code, _, lines = _run(_args(world, cmd, **{"--images": folder}), capsys)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: --images {folder}: "), lines
    assert "label" in lines[0]
    assert not (root / "tmp").exists()


def test_grayscale_photographs_are_images(world, capsys):
    """No false alarm: one-channel PNG photographs (many grey levels) are accepted."""
    root, w, _, _ = world
    grey = root / "grey"
    grey.mkdir(exist_ok=True)
    for p in (root / "w" / "images").glob("*.png"):
        Image.open(p).convert("L").save(grey / p.name)
    shutil.rmtree(root / "tmp", ignore_errors=True)
    code, out, lines = _run(_args(world, "debias", **{"--images": grey}), capsys)
    assert code == 0, lines


# --------------------------------------------------------------------------- 4. no valid pixel

def _ignored(root: Path, src: Path, name: str, only=None) -> Path:
    """A copy of the label folder ``src`` with every label (or those of ``only``) all 255."""
    p = root / name
    shutil.rmtree(p, ignore_errors=True)
    p.mkdir()
    for f in sorted(src.glob("*.png")):
        y = read_label(f, biased_value=None)
        if only is None or f.stem in only:
            y = torch.full_like(y, 255)
        write_label(p / f.name, y)
    return p


@pytest.mark.parametrize("cmd, flag", [("centroids", "--labels"), ("debias", "--labels"), ("evaluate", "--gt"),
                                       ("report", "--labels")])
@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_a_set_with_no_valid_pixel_is_an_error_naming_the_folder(world, capsys, cmd, flag, on_error):
    root = world[0]
    shutil.rmtree(root / "tmp", ignore_errors=True)
    folder = _ignored(root, root / "w" / ("gt" if flag == "--gt" else "labels"), f"all255_{cmd}")
    code, out, lines = _run(_args(world, cmd, **{flag: folder}) + ["--on-error", on_error], capsys)
    assert code == 2, (out, lines)
    assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: {flag} {folder}: "), lines
    assert "n/a" not in out


@pytest.mark.parametrize("cmd, flag", [("centroids", "--labels"), ("debias", "--labels"), ("evaluate", "--gt")])
def test_one_label_with_no_valid_pixel_is_a_warning_naming_it(world, capsys, cmd, flag):
    root, w, _, _ = world
    shutil.rmtree(root / "tmp", ignore_errors=True)
    stem = w.stems[2]
    folder = _ignored(root, root / "w" / ("gt" if flag == "--gt" else "labels"), f"one255_{cmd}", only={stem})
    code = cli.main([str(a) for a in _args(world, cmd, **{flag: folder})])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.splitlines() == ["warning: 1 file(s) add nothing:",
                                f"  {stem}: {folder / stem}.png: every pixel is --ignore-index 255 (no valid pixel)"]
    if cmd == "debias":
        assert (root / "tmp" / "db" / f"{stem}.png").is_file()


# --------------------------------------------------------------------------- 5. Ctrl-C

def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


#: what each command says it leaves once its --out exists: the resumable ones keep their finished
#: files (here the job stops before it writes any), the others write their outputs atomically at
#: the end, the demo starts over; before its --out exists, every one says "nothing was written"
#: (issue 41: no promise of a resume where there is nothing to resume)
AFTER = {**{c: "no file written by this run; run it again to resume (finished files are kept)"
            for c in ("features", "debias", "reproduce")},
         **{c: "nothing was written" for c in ("centroids", "evaluate", "report", "sample")},
         "demo": "run it again to start over"}
#: command -> (module, function) its work runs in
JOBS = {"sample": ("mars_plugin.commands.sample_trees", "_write"),
        "centroids": ("mars_plugin.commands.centroids", "centroids_job"),
        "debias": ("mars_plugin.commands.debias", "debias_job"),
        "evaluate": ("mars_plugin.commands.evaluate", "evaluate_job"),
        "report": ("mars_plugin.commands.report", "report_job"),
        "features": ("mars_plugin.commands.features", "features_job"), "demo": ("mars_plugin.commands.demo", "run_demo")}


@pytest.mark.parametrize("cmd", list(JOBS))
def test_ctrl_c_is_one_line_and_exit_130(world, capsys, monkeypatch, cmd):
    import importlib

    module, fn = JOBS[cmd]
    monkeypatch.setattr(importlib.import_module(module), fn, _interrupt)
    argv = _args(world, cmd)
    made = cmd != "evaluate" and Path(argv[argv.index("--out") + 1]).exists()
    code, out, lines = _run(argv, capsys)
    assert code == 130
    assert lines == [f"mars {cmd}: interrupted; {AFTER[cmd] if made else 'nothing was written'}"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # left as it was
    if cmd == "sample":  # no half tree, no temporary folder
        tmp = world[0] / "tmp"
        assert not (tmp / "sample").exists() and not list(tmp.glob(".tmp-*"))


def test_ctrl_c_in_reproduce_is_one_line(tmp_path, capsys, monkeypatch):
    world, root, pseudo, feats = make_tree(tmp_path, n=3, size=32)
    monkeypatch.setattr("mars_plugin.commands.reproduce.debias_job", _interrupt)
    argv = ["reproduce", "--root", root, "--data", DATA, "--pseudo", pseudo, "--features", feats, "--out",
            tmp_path / "out", "--no-progress"]
    code, _, lines = _run(argv, capsys)
    # stopped before its --out exists: nothing to resume, and the line says so (issue 41)
    assert code == 130 and lines == ["mars reproduce: interrupted; nothing was written"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _spawned_workers(pid: int) -> int:
    """How many multiprocessing spawn workers process ``pid`` has started (Linux /proc)."""
    n = 0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            n += "spawn_main" in Path(f"/proc/{child}/cmdline").read_text()
        except OSError:
            pass
    return n


@pytest.fixture(scope="module")
def slow_debias(tmp_path_factory):
    """A debias run of a few seconds per image: 12 images of 96 px, 60 CRF iterations, batch 1."""
    root = tmp_path_factory.mktemp("sigint")
    write_world(make_world(12, size=96, seed=0), root / "w")
    d = root / "w"
    assert cli.main(["centroids", "--features", str(d / "features"), "--labels", str(d / "labels"),
                     "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the worker processes from /proc")
@pytest.mark.parametrize("when", ["while the workers start", "while they work"])
def test_sigint_to_debias_with_workers_is_one_line_and_resumes(slow_debias, tmp_path, when):
    """A real Ctrl-C: SIGINT to the whole process group (what a terminal sends) while two
    ``--workers`` processes start (importing torch) or debias. One line, exit 130, no traceback
    from any process; the images written are complete and a second run finishes the rest."""
    d = slow_debias / "w"
    out = tmp_path / "db"
    argv = [sys.executable, "-m", "mars_plugin.cli", "debias", "--features", str(d / "features"), "--labels",
            str(d / "labels"), "--centroids", str(slow_debias / "V.pt"), "--images", str(d / "images"), "--out",
            str(out), "--workers", "2", "--batch-size", "1", "--no-progress", "--crf-params", '{"iterations": 60}']
    p = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    t = time.time()
    started = (lambda: _spawned_workers(p.pid) == 2) if when == "while the workers start" else \
        (lambda: out.is_dir() and any(out.glob("*.png")))
    while not started():
        assert p.poll() is None and time.time() - t < 300, p.communicate()
        time.sleep(0.01)
    if when == "while the workers start":
        time.sleep(0.3)  # past the interpreter's start, into the imports (torch takes seconds)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    lines = err.strip().splitlines()
    done = sorted(out.glob("*.png"))
    # the line counts the files this run wrote (issue 41), or says that nothing was
    assert len(lines) == 1 and re.fullmatch(r"mars debias: interrupted; (nothing was written|(\d+) files? written to "
                                            + re.escape(str(out)) + r"; run it again to resume \(finished files are "
                                            r"kept\))", lines[0]), err
    assert len(done) < 12 and not list(out.glob(".tmp-*"))
    for f in done:
        read_label(f)  # complete files
    # The same settings: another --crf-params into this --out would be another run (refused).
    r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r
    # Every file is there; those the interrupted run wrote but had not yet recorded (a worker's
    # result on its way to the parent) are computed again, never trusted unrecorded.
    m = re.search(r"(\d+) written(?:[^,]*)(?:, (\d+) already done)?", r.stdout)
    assert m and int(m.group(1)) + int(m.group(2) or 0) == 12 and int(m.group(1)) >= 12 - len(done), r.stdout
    assert len(list(out.glob("*.png"))) == 12


# --------------------------------------------------------------------------- 6. DHR's class names

def test_wsss_dhr_prints_dhrs_class_names_and_class_names_reads_dhrs_json(tmp_path, capsys):
    world, root, pseudo, feats = make_tree(tmp_path, n=6, size=32)
    xml = root / DATA / "train_aug" / "xml"
    base = ["centroids", "--features", feats, "--labels", pseudo, "--num-classes", 6, "--no-progress"]
    code, out, _ = _run(base + ["--out", tmp_path / "V.pt", "--wsss", "dhr", "--image-labels", xml], capsys)
    assert code == 0
    for c, name in enumerate(world.class_names[1:], 1):
        assert f"class {c} ({name}):" in out, out
    # the json itself as --class-names, without --wsss
    code, out2, _ = _run(base + ["--out", tmp_path / "V2.pt", "--class-names", root / DATA / f"{DATA}.json"], capsys)
    assert code == 0 and out2 == out.replace(str(tmp_path / "V.pt"), str(tmp_path / "V2.pt"))
    # debias prints them too
    code, out3, _ = _run(["debias", "--features", feats, "--labels", pseudo, "--centroids", tmp_path / "V.pt",
                          "--refine", "threshold", "--out", tmp_path / "db", "--wsss", "dhr", "--image-labels", xml,
                          "--no-progress"], capsys)
    assert code == 0 and f"class 1 ({world.class_names[1]}):" in out3, out3
