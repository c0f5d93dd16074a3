"""An input is never an output (issue 30, class 1): every command refuses, before any work, an
output (``--out``, ``mars evaluate --json``) that is, contains or lies inside one of the same
command's inputs, under any spelling (``DIR/.``, ``DIR/sub/..``, a trailing slash, relative or
absolute, a symlink to the input or to its parent, a not-yet-existing output below a symlink
into an input). The refusal names both flags and both paths, exits 2, and leaves the tree as it
was: the inputs byte for byte, no file, folder or lock created. The Python API (the job
functions) refuses the same; ``mars demo`` and ``mars sample`` read no file of the user's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from mars_plugin.cli import main
from mars_plugin.runs.errors import JobError

# ------------------------------------------------------------------------------------------
# every command, its output flag and every file or folder it reads (by flag)
# ------------------------------------------------------------------------------------------

DIR, FILE = "dir", "file"

#: command -> (the argv's other flags, the output flag, {input flag: dir or file})
COMMANDS: Dict[str, Tuple[List[str], str, Dict[str, str]]] = {
    "features": (["--uss", "stego"], "--out",
                 {"--images": DIR, "--checkpoint": FILE, "--backbone": FILE, "--heads": FILE}),
    "centroids": (["--num-classes", "2"], "--out",
                  {"--features": DIR, "--labels": DIR, "--image-labels": FILE, "--class-names": FILE}),
    "debias": (["--refine", "crf"], "--out",
               {"--features": DIR, "--labels": DIR, "--centroids": FILE, "--images": DIR, "--image-labels": FILE,
                "--class-names": FILE}),
    "report": ([], "--out", {"--labels": DIR, "--debiased": DIR, "--images": DIR, "--class-names": FILE}),
    "evaluate": (["--num-classes", "2"], "--json", {"--pred": DIR, "--gt": DIR, "--class-names": FILE}),
    "predict": ([], "--out", {"--images": DIR, "--model": FILE}),
    "crf": (["--wsss", "seam"], "--out", {"--cams": DIR, "--probs": DIR, "--images": DIR}),
    "train": (["--num-classes", "2"], "--out",
              {"--images": DIR, "--labels": DIR, "--image-labels": FILE, "--class-names": FILE, "--weights": FILE}),
    "reproduce": (["--root", "tree", "--train"], "--out",
                  {"--pseudo": DIR, "--features": DIR, "--checkpoint": FILE, "--backbone": FILE, "--heads": FILE,
                   "--weights": FILE}),
}

#: spelling -> (applies to dir inputs, to file inputs, the refusal's word). ``P`` is the input
#: as the argv gives it (``ins/<name>/<name>``), ``Q`` its parent folder (``ins/<name>``), ``B``
#: its base name; ``lnk`` is a symlink to P, ``plnk`` a symlink to Q.
SPELLINGS = {
    "same": (True, True, "is", "{P}"),
    "dot": (True, True, "is", "{Q}/./{B}"),
    "dotdot": (True, True, "is", "{Q}/sub/../{B}"),
    "slash": (True, False, "is", "{P}/"),
    "absolute": (True, True, "is", "{ABS}"),
    "symlink": (True, True, "is", "lnk"),
    "parent_symlink": (True, True, "is", "plnk/{B}"),
    "inside": (True, False, "lies inside", "{P}/new"),
    "inside_new_folder": (True, False, "lies inside", "{P}/new/deeper"),
    "inside_symlink": (True, False, "lies inside", "lnk/new"),
    "inside_absolute": (True, False, "lies inside", "{ABS}/sub/new"),
    "contains": (True, True, "contains", "{Q}"),
    "contains_slash": (True, True, "contains", "{Q}/"),
    "contains_dotdot": (True, True, "contains", "{Q}/sub/.."),
    "contains_parent_symlink": (True, True, "contains", "plnk"),
}


def _name(flag: str) -> str:
    return flag.lstrip("-")


def _make_inputs(tmp: Path, inputs: Dict[str, str]) -> Dict[str, str]:
    """Each input at ``ins/<name>/<name>`` (a folder holding a file and a sub-folder) or
    ``ins/<name>/<name>.json`` (a file), each parent with a ``sub`` folder; returns flag ->
    the relative path the argv gives. They need not be valid: the refusal reads none of them."""
    paths = {}
    for flag, kind in inputs.items():
        parent = tmp / "ins" / _name(flag)
        (parent / "sub").mkdir(parents=True)
        if kind == DIR:
            p = parent / _name(flag)
            (p / "sub").mkdir(parents=True)
            (p / "a.png").write_bytes(b"not an image " + flag.encode())
        else:
            p = parent / f"{_name(flag)}.json"
            p.write_bytes(b'["background", "thing"]')
        paths[flag] = p.relative_to(tmp).as_posix()
    return paths


def _snapshot(root: Path) -> Dict[str, object]:
    """Every entry under ``root``: a symlink's target, a file's bytes, a folder."""
    out: Dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def _spell(spelling: str, tmp: Path, rel: str) -> str:
    p = Path(rel)
    os.symlink(tmp / p, tmp / "lnk")
    os.symlink(tmp / p.parent, tmp / "plnk")
    return SPELLINGS[spelling][3].format(P=rel, Q=p.parent.as_posix(), B=p.name, ABS=tmp / p)


def _refused(capsys, argv: List[str], tmp: Path) -> str:
    before = _snapshot(tmp)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert _snapshot(tmp) == before, "the refusal changed or created something"
    assert err.count("\n") == 1, err  # one line
    return err


CLI_CASES = [(cmd, flag, spelling)
             for cmd, (_, _, inputs) in COMMANDS.items()
             for flag, kind in inputs.items()
             for spelling, (on_dir, on_file, _, _) in SPELLINGS.items()
             if (on_dir if kind == DIR else on_file)]


@pytest.mark.slow
@pytest.mark.parametrize("cmd,flag,spelling", CLI_CASES, ids=["-".join(c) for c in CLI_CASES])
def test_every_command_refuses_an_output_on_its_input(cmd, flag, spelling, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    extra, out_flag, inputs = COMMANDS[cmd]
    paths = _make_inputs(tmp_path, inputs)
    if cmd == "reproduce":
        (tmp_path / "tree").mkdir()
    out = _spell(spelling, tmp_path, paths[flag])
    argv = [cmd, *extra, *[a for f, p in paths.items() for a in (f, p)], out_flag, out]
    err = _refused(capsys, argv, tmp_path)
    word = SPELLINGS[spelling][2]
    assert f"mars {cmd}: error: {out_flag} {out} {word} {flag} {paths[flag]} (" in err, err


# ------------------------------------------------------------------------------------------
# DHR's tree under --root: what predict, train and reproduce read there, and what they do not
# ------------------------------------------------------------------------------------------


def _dhr_tree(tmp: Path) -> None:
    for d in ("VOC2012/train_aug/image", "VOC2012/train_aug/mask", "VOC2012/train_aug/xml",
              "VOC2012/validation/image", "VOC2012/validation/mask", "WSS/VOC2012/RSEPM/train_aug"):
        (tmp / "R" / d).mkdir(parents=True)
        (tmp / "R" / d / "a.png").write_bytes(b"x")
    (tmp / "L").mkdir()  # labels or features, beside the tree
    (tmp / "L" / "a.png").write_bytes(b"x")
    os.symlink(tmp / "R", tmp / "rlnk")


ROOT_ARGV = {
    "predict": ["predict", "--model", "m.pt", "--root", "R"],
    "train": ["train", "--root", "R", "--labels", "L", "--num-classes", "2"],
    "reproduce": ["reproduce", "--root", "R", "--pseudo", "R/WSS/VOC2012/RSEPM/train_aug", "--features", "L"],
    "reproduce-train": ["reproduce", "--root", "R", "--pseudo", "R/WSS/VOC2012/RSEPM/train_aug", "--features", "L",
                        "--train"],
}
#: (command, --out, the refusal's word, the folder it names); the split folder
#: <root>/<data>/<domain> holds image, mask and xml
ROOT_CASES = [
    (cmd, out, word, where)
    for cmd in ROOT_ARGV
    for out, word, where in (
        ("R", "contains", "R/VOC2012/train_aug"),
        ("rlnk/", "contains", "R/VOC2012/train_aug"),
        ("R/VOC2012", "contains", "R/VOC2012/train_aug"),
        ("R/VOC2012/train_aug", "is", "R/VOC2012/train_aug"),
        ("R/VOC2012/train_aug/image/../xml/new", "lies inside", "R/VOC2012/train_aug"),
        ("rlnk/VOC2012/train_aug/mask/new", "lies inside", "R/VOC2012/train_aug"),
    )
] + [
    ("reproduce", "R/WSS/VOC2012/mine", "lies inside", "R/WSS/VOC2012"),  # the other methods' masks
    ("reproduce", "R/WSS", "contains", "R/WSS/VOC2012"),
    ("reproduce-train", "R/VOC2012/validation/pred", "lies inside", "R/VOC2012/validation"),
]


@pytest.mark.parametrize("cmd,out,word,where", ROOT_CASES, ids=[f"{c[0]}-{c[1]}" for c in ROOT_CASES])
def test_an_output_stays_out_of_what_root_holds(cmd, out, word, where, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _dhr_tree(tmp_path)
    err = _refused(capsys, ROOT_ARGV[cmd] + ["--out", out], tmp_path)
    assert f"--out {out} {word} --root {where} (" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["predict", "train", "reproduce"])
def test_an_output_elsewhere_under_root_is_not_refused(cmd, tmp_path, monkeypatch, capsys):
    """``--out`` beside the data under ``--root`` (DHR's checkout, ``runs/``: what the README and
    ``mars sample``'s commands do) is apart from every input: the command goes on (and here
    stops at its fake inputs, for another reason)."""
    monkeypatch.chdir(tmp_path)
    _dhr_tree(tmp_path)
    main(ROOT_ARGV[cmd] + ["--out", "R/runs/x", "--no-progress"] + (["--dry-run"] if cmd == "reproduce" else []))
    err = capsys.readouterr().err
    assert "an output never" not in err, err


# ------------------------------------------------------------------------------------------
# the Python API: each job function refuses the same
# ------------------------------------------------------------------------------------------


def _api_call(job: str, p: Dict[str, str], out: str):
    import torch

    if job == "features_job":
        from mars_plugin.commands.features import features_job

        return lambda: features_job(lambda x: x, p["--images"], out, progress=False)
    if job == "centroids_job":
        from mars_plugin.commands.centroids import centroids_job

        return lambda: centroids_job(p["--features"], p["--labels"], 2, out, image_labels=p["--image-labels"],
                                     progress=False)
    if job == "debias_job":
        from mars_plugin.commands.debias import debias_job

        return lambda: debias_job(p["--features"], p["--labels"], p["--centroids"], out, images_dir=p["--images"],
                                  image_labels=p["--image-labels"], progress=False)
    if job == "report_job":
        from mars_plugin.commands.report import report_job

        return lambda: report_job(p["--labels"], p["--debiased"], p["--images"], out, progress=False)
    if job == "predict_job":
        from mars_plugin.commands.predict import predict_job

        return lambda: predict_job(torch.nn.Identity(), p["--images"], out, progress=False)
    if job == "train":
        from mars_plugin.commands.train import train

        return lambda: train(p["--images"], p["--labels"], out, 2, arch="deeplabv3+", weights=p["--weights"],
                             progress=False)
    if job == "reproduce":
        from mars_plugin.commands.reproduce import reproduce

        return lambda: reproduce("tree", p["--pseudo"], out, features_dir=p["--features"], checkpoint=p["--checkpoint"],
                                 backbone=p["--backbone"], heads=p["--heads"], progress=False)
    if job == "train_after_reproduce":
        from mars_plugin.commands.reproduce_train import train_after_reproduce

        return lambda: train_after_reproduce("tree", out, train_options={"weights": p["--weights"]}, progress=False)
    raise AssertionError(job)


#: job function -> {input: dir or file}
JOBS = {
    "features_job": {"--images": DIR},
    "centroids_job": {"--features": DIR, "--labels": DIR, "--image-labels": FILE},
    "debias_job": {"--features": DIR, "--labels": DIR, "--centroids": FILE, "--images": DIR, "--image-labels": FILE},
    "report_job": {"--labels": DIR, "--debiased": DIR, "--images": DIR},
    "predict_job": {"--images": DIR},
    "train": {"--images": DIR, "--labels": DIR, "--weights": FILE},
    "reproduce": {"--pseudo": DIR, "--features": DIR, "--checkpoint": FILE, "--backbone": FILE, "--heads": FILE},
    "train_after_reproduce": {"--weights": FILE},
}
API_CASES = [(job, flag, spelling) for job, inputs in JOBS.items() for flag, kind in inputs.items()
             for spelling in ("same", "symlink", "inside_symlink", "contains_parent_symlink")
             if (SPELLINGS[spelling][0] if kind == DIR else SPELLINGS[spelling][1])]


@pytest.mark.parametrize("job,flag,spelling", API_CASES, ids=["-".join(c) for c in API_CASES])
def test_every_job_function_refuses_an_output_on_its_input(job, flag, spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = _make_inputs(tmp_path, JOBS[job])
    (tmp_path / "tree").mkdir()
    out = _spell(spelling, tmp_path, paths[flag])
    call = _api_call(job, paths, out)
    before = _snapshot(tmp_path)
    with pytest.raises(JobError) as e:
        call()
    assert f"--out {out} {SPELLINGS[spelling][2]} {flag} {paths[flag]} (" in str(e.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("references", [True, False])
def test_reproduce_reads_root_folders_by_name(references, tmp_path, monkeypatch):
    """reproduce() (the Python API): the split folder always, the other methods' masks
    (``<root>/WSS/<data>``) only when it scores them."""
    from mars_plugin.commands.reproduce import reproduce

    monkeypatch.chdir(tmp_path)
    _dhr_tree(tmp_path)
    args = dict(features_dir="L", references=references, progress=False, dry_run=True, log=lambda s: None)
    with pytest.raises(JobError, match=r"--out R/VOC2012/train_aug/x lies inside --root R/VOC2012/train_aug \("):
        reproduce("R", "R/WSS/VOC2012/RSEPM/train_aug", "R/VOC2012/train_aug/x", **args)
    if references:
        with pytest.raises(JobError, match=r"--out rlnk/WSS/VOC2012/x lies inside --root R/WSS/VOC2012 \("):
            reproduce("R", "R/WSS/VOC2012/RSEPM/train_aug", "rlnk/WSS/VOC2012/x", **args)
    else:  # not read: the run goes on (to its next check, of the fake features)
        with pytest.raises(ValueError, match="--features L: no .npy or .pt feature files"):
            reproduce("R", "R/WSS/VOC2012/RSEPM/train_aug", "R/WSS/VOC2012/x", **args)


# ------------------------------------------------------------------------------------------
# what is allowed: an output beside its inputs
# ------------------------------------------------------------------------------------------


def test_outputs_beside_their_inputs_still_work(tmp_path, monkeypatch, capsys):
    """Outputs in the same parent folder as the inputs (and reached through a symlink to that
    parent) are apart from them: centroids, debias and evaluate --json run as before."""
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    monkeypatch.chdir(tmp_path)
    write_world(make_world(4, size=24, dim=16, seed=3), tmp_path / "w")
    os.symlink(tmp_path / "w", tmp_path / "wl")
    common = ["--features", "w/features", "--labels", "w/labels", "--no-progress"]
    assert main(["centroids", *common, "--num-classes", "6", "--backend", "torch", "--out", "w/V.pt"]) == 0
    assert main(["debias", *common, "--centroids", "w/V.pt", "--refine", "threshold", "--out", "wl/db"]) == 0
    assert main(["evaluate", "--pred", "w/db", "--gt", "w/gt", "--num-classes", "6", "--json", "wl/scores.json",
                 "--no-progress"]) == 0
    assert (tmp_path / "w" / "V.pt").is_file() and (tmp_path / "w" / "scores.json").is_file()
    assert len(list((tmp_path / "w" / "db").glob("*.png"))) == 4
    capsys.readouterr()
    # and the same debias into its own --labels is refused, the labels untouched
    err = _refused(capsys, ["debias", *common, "--centroids", "w/V.pt", "--refine", "threshold", "--out", "wl/labels/"],
                   tmp_path)
    assert "--out wl/labels/ is --labels w/labels (" in err


# ------------------------------------------------------------------------------------------
# demo and sample: no input to keep apart
# ------------------------------------------------------------------------------------------

_TRACE = r"""
import os, sys
user, out = sys.argv[1], sys.argv[2]
seen = []

def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(user + os.sep) or path == user:
            seen.append(path)

sys.addaudithook(hook)
from mars_plugin.cli import main
code = main(sys.argv[3:])
inside = lambda p: p == out or p.startswith(out + os.sep) or os.path.basename(p).startswith(".tmp-sample-") \
    or os.sep + ".tmp-sample-" in p
print("CODE", code)
print("READ", sorted(set(p for p in seen if not inside(p))))
"""


@pytest.mark.parametrize("argv", [["sample", "--tree", "dhr", "--num-images", "2", "--size", "32"],
                                  ["demo", "--num-train", "3", "--num-val", "2", "--size", "32", "--epochs", "1",
                                   "--refine", "threshold"]], ids=["sample", "demo"])
@pytest.mark.slow
def test_demo_and_sample_read_no_file_of_the_user(argv, tmp_path):
    """``mars demo`` and ``mars sample`` generate their world: they have no input flag, open or
    list nothing in the user's folders but their own ``--out`` (traced with an audit hook), and
    refuse a non-empty ``--out`` they did not write, so they cannot overwrite a file either."""
    user = tmp_path / "user"
    (user / "photos").mkdir(parents=True)
    (user / "photos" / "a.jpg").write_bytes(b"precious")
    script = tmp_path / "trace.py"
    script.write_text(_TRACE)
    run = lambda out: subprocess.run(  # noqa: E731
        [sys.executable, "-I", str(script), str(user), str(user / out), *argv, "--out", str(user / out)],
        cwd=user, capture_output=True, text=True, timeout=600)
    r = run("made")
    assert "CODE 0" in r.stdout, r.stdout + r.stderr
    assert "READ []" in r.stdout, r.stdout
    before = _snapshot(user)
    r = run("photos")  # an existing folder of the user's
    assert "CODE 2" in r.stdout and "photos" in r.stderr, r.stdout + r.stderr
    assert _snapshot(user) == before


def test_every_command_is_covered():
    """The families above cover every command of the parser (demo and sample: no input)."""
    from mars_plugin.cli import _READS
    from mars_plugin.commands.cli_parser import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS) | {"demo", "sample"} == set(_READS)
    for cmd, (_, _, inputs) in COMMANDS.items():
        assert set(_READS[cmd]) | ({"--weights"} if cmd == "reproduce" else set()) == set(inputs), cmd
