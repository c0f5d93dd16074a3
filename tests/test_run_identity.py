"""A run's identity (issue 22, class 1): a resumed ``mars`` run knows what it was made from.

Families: ``mars reproduce`` after each kind of changed input (the stages that must run again
run again, and the result equals a fresh run on the new inputs; other settings are refused);
``features_job`` / ``debias_job`` / ``centroids_job`` resume after each kind of changed input;
one run at a time per output (a second run refused with one line naming the holder, a run
killed with SIGKILL never blocks); the ``.tmp-*`` files a killed run leaves are removed by the
next run that holds the lock. Trees from :func:`test_reproduce.make_tree` and
:func:`mars_plugin.worlds.synthetic.write_world`.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin import cli
from mars_plugin.commands.features import features_job
from mars_plugin.formats.files import read_image, read_label, write_image, write_label
from mars_plugin.commands.centroids import centroids_job
from mars_plugin.commands.debias import debias_job
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.reproduce import reproduce
from mars_plugin.method.selection import DebiasedCentroids
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

from test_features_distributed import _env
from test_reproduce import DATA, _tiny_stego_files, _write_xml, make_tree

N, SIZE = 10, 32
STAGES = ("centroids", "debias", "evaluate")


def _record_free(folder: Path):
    """{name: bytes} of an output folder, its record (.mars-run.*) and what a run moved aside
    (.mars-stale/: outputs no longer of the folder, e.g. the label of a removed id) left out."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if not p.name.startswith(".mars-run") and p.name != ".mars-stale"}


def _changed(path: Path, write) -> None:
    """Rewrite ``path`` with ``write(path)``; the content must differ (else the test is void)."""
    before = path.read_bytes()
    write(path)
    assert path.read_bytes() != before, path


def _half_background(path: Path) -> None:
    y = read_label(path, biased_value=None)
    y[:, : SIZE // 2] = 0
    write_label(path, y)


# --------------------------------------------------------------------------------------------
# mars reproduce after a change of its inputs
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A DHR-layout tree with a reference folder (the masks, a few pixels off)."""
    tmp = tmp_path_factory.mktemp("identity")
    world, root, pseudo, feats = make_tree(tmp, n=N, size=SIZE)
    ref = root / "WSS" / DATA / "MARS" / "train_aug"
    ref.mkdir(parents=True)
    for p in sorted((root / DATA / "train_aug" / "mask").glob("*.png")):
        y = read_label(p, biased_value=None)
        y[:2] = 0
        write_label(ref / p.name, y)
    return world, tmp


def _copy(base, dst: Path):
    world, tmp = base
    for name in ("root", "pseudo", "features"):
        shutil.copytree(tmp / name, dst / name)  # copy2: sizes and mtimes kept, as cp -a / rsync -a
    return world, dst / "root", dst / "pseudo", dst / "features"


def _run(root, pseudo, feats, out, **kw):
    logs = []
    kw.setdefault("refine", "threshold")  # the CRF only where the images matter (kind "image"): fast
    reproduce(root, pseudo, out, features_dir=feats, data=DATA, progress=False, log=logs.append, **kw)
    return logs


def _change_tags(root: Path, world, i: int) -> None:
    present = {world.class_names[c] for c in world.class_ids(i)}
    extra = next(n for n in world.class_names[1:] if n not in present)
    xml = root / DATA / "train_aug" / "xml" / f"{world.stems[i]}.xml"
    _changed(xml, lambda p: _write_xml(p, sorted(present) + [extra]))


def _invert_left(path: Path) -> None:
    img = read_image(path)
    img[:, : SIZE // 2] = 255 - img[:, : SIZE // 2]
    write_image(path, img)


def _scale_features(path: Path) -> None:
    f = torch.load(path, weights_only=True)
    f[:, : f.shape[1] // 2] *= -1
    torch.save(f.clone(), path)


# kind -> (what changes, the stages that must run again; the others are kept)
CHANGES = {
    "new id": {"centroids", "debias", "evaluate"},
    "removed id": {"centroids", "debias", "evaluate"},
    "pseudo label": {"centroids", "debias", "evaluate"},
    "feature file": {"centroids", "debias", "evaluate"},
    "tags": {"centroids", "debias", "evaluate"},
    "image": {"debias", "evaluate"},
    "mask": {"evaluate"},
    "reference mask": {"evaluate"},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CHANGES))
def test_reproduce_reruns_the_stages_a_change_reaches_and_equals_a_fresh_run(base, tmp_path, kind):
    world, root, pseudo, feats = _copy(base, tmp_path)
    dom = root / DATA / "train_aug"
    stem = world.stems[3]
    held = tmp_path / "held.png"
    if kind == "new id":  # the first run has no pseudo label for the last id
        shutil.move(pseudo / f"{world.stems[-1]}.png", held)
    out = tmp_path / "out"
    # Debiasing reads the images only with the CRF: one iteration of it for kind "image".
    kw = dict(refine="crf", crf_params={"iterations": 1}) if kind == "image" else {}
    _run(root, pseudo, feats, out, **kw)
    first_centroids = (out / "centroids.pt").read_bytes()
    if kind == "new id":
        shutil.move(held, pseudo / f"{world.stems[-1]}.png")
    elif kind == "removed id":
        (pseudo / f"{stem}.png").unlink()
    elif kind == "pseudo label":
        _changed(pseudo / f"{stem}.png", _half_background)
    elif kind == "feature file":
        _changed(feats / f"{stem}.pt", _scale_features)
    elif kind == "tags":
        _change_tags(root, world, 3)
    elif kind == "image":
        _changed(dom / "image" / f"{stem}.jpg", _invert_left)
    elif kind == "mask":
        _changed(dom / "mask" / f"{stem}.png", _half_background)
    else:
        _changed(root / "WSS" / DATA / "MARS" / "train_aug" / f"{stem}.png", _half_background)
    logs = _run(root, pseudo, feats, out, **kw)
    for name in STAGES:
        kept = f"[{name}] done before, kept" in logs
        assert kept == (name not in CHANGES[kind]), (name, logs)
    if kind == "image":  # only the label of the changed image is made again
        assert any(line.strip().startswith("debias: 1 done (1 again") and ", 9 already done" in line
                   for line in logs), logs
    if "centroids" not in CHANGES[kind]:
        assert (out / "centroids.pt").read_bytes() == first_centroids
    # The result is a fresh run's on the new inputs.
    fresh = tmp_path / "fresh"
    _run(root, pseudo, feats, fresh, **kw)
    assert json.loads((out / "scores.json").read_text()) == json.loads((fresh / "scores.json").read_text())
    assert _record_free(out / "debiased") == _record_free(fresh / "debiased")
    # the removed id's label was moved aside, not lost (runs/output_aside.py)
    assert (kind == "removed id") == any((out / "debiased" / ".mars-stale").glob("*/*.png"))
    a, b = (torch.load(p / "centroids.pt", weights_only=True) for p in (out, fresh))
    for k in ("centroids", "valid", "num_candidates", "num_selected", "background_mean"):
        assert torch.equal(a[k], b[k]), k
    assert a["num_images"] == b["num_images"] == N - (kind == "removed id")
    # and nothing changed: everything kept
    logs = _run(root, pseudo, feats, out, **kw)
    assert all(f"[{name}] done before, kept" in logs for name in STAGES), logs


@pytest.mark.slow
def test_dry_run_says_which_recorded_stages_run_again(base, tmp_path):
    world, root, pseudo, feats = _copy(base, tmp_path)
    out = tmp_path / "out"
    _run(root, pseudo, feats, out)
    _changed(pseudo / f"{world.stems[1]}.png", _half_background)
    logs = []
    reproduce(root, pseudo, out, features_dir=feats, data=DATA, refine="threshold", dry_run=True, log=logs.append)
    said = {line.split("]")[0][1:]: line for line in logs if line.startswith("[")}
    assert said["centroids"].endswith("(recorded as finished, runs again: changed since the last run: pseudo labels)")
    assert said["debias"].endswith("(recorded as finished, runs again: after [centroids])")
    _run(root, pseudo, feats, out)
    _changed(root / DATA / "train_aug" / "mask" / f"{world.stems[1]}.png", _half_background)
    logs.clear()
    reproduce(root, pseudo, out, features_dir=feats, data=DATA, refine="threshold", dry_run=True, log=logs.append)
    said = {line.split("]")[0][1:]: line for line in logs if line.startswith("[")}
    assert said["debias"].endswith("(recorded as finished from the same inputs: kept)")
    assert said["evaluate"].endswith("(recorded as finished, runs again: changed since the last run: masks)")


@pytest.mark.parametrize("setting, value, key", [("alpha", 0.5, "alpha"), ("k_fg", 3, "k_fg"),
                                                 ("refine", "crf", "refine")])
@pytest.mark.slow
def test_reproduce_refuses_other_settings_in_one_out(base, tmp_path, setting, value, key):
    world, root, pseudo, feats = _copy(base, tmp_path)
    out = tmp_path / "out"
    _run(root, pseudo, feats, out)
    before = (out / "reproduce.json").read_text()
    with pytest.raises(ValueError, match=rf"--out {out} holds a run with other settings \({key}: "):
        _run(root, pseudo, feats, out, **{setting: value})
    assert (out / "reproduce.json").read_text() == before


def test_reproduce_refuses_another_fp16(base, tmp_path):
    world, root, pseudo, _ = _copy(base, tmp_path)
    b, h = _tiny_stego_files(tmp_path)
    out = tmp_path / "out"
    kw = dict(backbone=b, heads=h, data=DATA, progress=False, log=lambda line: None, scales=[1.0], flip=False,
              refine="threshold")
    reproduce(root, pseudo, out, **kw)
    with pytest.raises(ValueError, match=r"other settings \(fp16: False -> True\)"):
        reproduce(root, pseudo, out, fp16=True, **kw)
    # the features folder has its own record: a features run into it with fp16 is refused too
    from mars_plugin.adapters.uss.extractor import load_extractor

    ex = load_extractor("stego", backbone=b, heads=h, scales=[1.0], flip_average=False, dhr=True)
    with pytest.raises(JobError, match=r"--out .*features holds files made with other settings \(fp16: False -> "
                                       r"True; model"):
        features_job(ex, root / DATA / "train_aug" / "image", out / "features", fp16=True, file_format="pt",
                     progress=False)


# --------------------------------------------------------------------------------------------
# features_job, debias_job, centroids_job
# --------------------------------------------------------------------------------------------


def _pool(images, output_size=None):
    """A plain callable extractor: 4x4 mean colours."""
    return F.avg_pool2d(images.float() / 255, 4)


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn_identity") / "world"
    world = make_world(8, size=SIZE, seed=1)
    paths = write_world(world, root)
    V = root.parent / "V.pt"
    centroids_job(paths["features"], paths["labels"], world.num_classes, V, progress=False)
    debias_job(paths["features"], paths["labels"], V, root.parent / "deb", refine="threshold", progress=False)
    return world, paths, V


def _copy_world(syn, dst: Path):
    world, paths, V = syn
    shutil.copytree(paths["root"], dst / "world")
    shutil.copy2(V, dst / "V.pt")
    p = {k: dst / "world" / Path(v).relative_to(paths["root"]) for k, v in paths.items() if k != "root"}
    return world, p, dst / "V.pt"


@pytest.mark.parametrize("kind, done", [("unchanged", 0), ("image", 1), ("new image", 1), ("output", 1)])
def test_features_resume_recomputes_the_files_whose_image_changed(syn, tmp_path, kind, done):
    world, p, _ = _copy_world(syn, tmp_path)
    images, out = p["images"], tmp_path / "f"
    held = tmp_path / "held.png"
    if kind == "new image":
        shutil.move(images / f"{world.stems[-1]}.png", held)
    features_job(_pool, images, out, progress=False)
    stem = world.stems[2]
    if kind == "image":
        _changed(images / f"{stem}.png", _invert_left)
    elif kind == "new image":
        shutil.move(held, images / f"{world.stems[-1]}.png")
    elif kind == "output":  # a file of the folder changed since it was written
        np.save(out / f"{stem}.npy", np.zeros((3, 8, 8), np.float16))
    s = features_job(_pool, images, out, progress=False)
    assert (s.done, s.existing, s.redone) == (done, 8 - done if kind != "new image" else 7,
                                             int(kind in ("image", "output")))
    fresh = tmp_path / "fresh"
    features_job(_pool, images, fresh, progress=False)
    assert _record_free(out) == _record_free(fresh)


@pytest.mark.parametrize("change", [dict(fp16=True), dict(stride=2), dict(output_size="image")])
def test_features_resume_refuses_other_settings(syn, tmp_path, change):
    _, p, _ = _copy_world(syn, tmp_path)
    features_job(_pool, p["images"], tmp_path / "f", progress=False)
    key = next(iter(change))
    with pytest.raises(JobError, match=rf"holds files made with other settings \({key}: "):
        features_job(_pool, p["images"], tmp_path / "f", progress=False, **change)


@pytest.mark.parametrize("kind, done", [("unchanged", 0), ("label", 1), ("features", 1), ("image", 1),
                                        ("centroids", 8)])
def test_debias_resume_recomputes_the_labels_whose_inputs_changed(syn, tmp_path, kind, done):
    world, p, V = _copy_world(syn, tmp_path)
    out = tmp_path / "deb"
    # Debiasing reads the images only with the CRF: one iteration of it for kind "image".
    kw = dict(images_dir=p["images"], crf_params={"iterations": 1}) if kind == "image" else dict(refine="threshold")
    debias_job(p["features"], p["labels"], V, out, progress=False, **kw)
    stem = world.stems[2]
    if kind == "label":
        _changed(p["labels"] / f"{stem}.png", _half_background)
    elif kind == "features":
        _changed(p["features"] / f"{stem}.npy", lambda q: np.save(q, -np.load(q)))
    elif kind == "image":
        _changed(p["images"] / f"{stem}.png", _invert_left)
    elif kind == "centroids":  # the same file, other centroids (e.g. from new pseudo labels)
        c = DebiasedCentroids.load(V)
        c.centroids = c.centroids.flip(1)
        c.save(V)
    s = debias_job(p["features"], p["labels"], V, out, progress=False, **kw)
    assert (s.done, s.existing, s.redone) == (done, 8 - done, done)
    fresh = tmp_path / "fresh"
    debias_job(p["features"], p["labels"], V, fresh, progress=False, **kw)
    assert _record_free(out) == _record_free(fresh)


def test_debias_resume_with_tags_recomputes_the_label_whose_tags_changed(syn, tmp_path):
    world, p, V = _copy_world(syn, tmp_path)
    out = tmp_path / "deb"
    debias_job(p["features"], p["labels"], V, out, images_dir=p["images"], progress=False,
               image_labels=p["image_labels"], refine="threshold")
    tags = json.loads(p["image_labels"].read_text())
    stem = world.stems[2]
    tags[stem] = [c for c in range(1, world.num_classes + 1) if c not in tags[stem]][:1] + tags[stem]
    p["image_labels"].write_text(json.dumps(tags))
    s = debias_job(p["features"], p["labels"], V, out, images_dir=p["images"], progress=False,
                   image_labels=p["image_labels"], refine="threshold")
    assert (s.done, s.existing) == (1, 7)
    with pytest.raises(JobError, match=r"holds files made with other settings \(threshold: 0.5 -> 0.6\)"):
        debias_job(p["features"], p["labels"], V, out, progress=False, image_labels=p["image_labels"],
                   refine="threshold", threshold=0.6)


@pytest.mark.parametrize("kind", ["unchanged", "label", "features", "new id", "tags"])
def test_centroids_are_kept_only_when_made_from_the_same_inputs(syn, tmp_path, kind):
    world, p, _ = _copy_world(syn, tmp_path)
    out = tmp_path / "V.pt"
    held = tmp_path / "held.png"
    if kind == "new id":
        shutil.move(p["labels"] / f"{world.stems[-1]}.png", held)
    tags = p["image_labels"]
    centroids_job(p["features"], p["labels"], world.num_classes, out, image_labels=tags, progress=False)
    before = out.read_bytes()
    stem = world.stems[2]
    if kind == "label":
        _changed(p["labels"] / f"{stem}.png", _half_background)
    elif kind == "features":
        _changed(p["features"] / f"{stem}.npy", lambda q: np.save(q, -np.load(q)))
    elif kind == "new id":
        shutil.move(held, p["labels"] / f"{world.stems[-1]}.png")
    elif kind == "tags":
        t = json.loads(tags.read_text())
        t[stem] = t[stem][:1] if len(t[stem]) > 1 else t[stem] + [c for c in range(1, 4) if c not in t[stem]][:1]
        tags.write_text(json.dumps(t))
    V, s = centroids_job(p["features"], p["labels"], world.num_classes, out, image_labels=tags, progress=False)
    if kind == "unchanged":
        assert (s.done, s.existing) == (0, 8) and out.read_bytes() == before  # kept, not rewritten
        return
    assert s.done == 8
    fresh, _ = centroids_job(p["features"], p["labels"], world.num_classes, tmp_path / "fresh.pt",
                             image_labels=tags, progress=False)
    for k in ("centroids", "valid", "num_candidates", "num_selected", "background_mean"):
        assert torch.equal(getattr(V, k), getattr(fresh, k)), k


def test_centroids_refuse_other_settings_and_cli_says_kept(syn, tmp_path, capsys):
    world, p, _ = _copy_world(syn, tmp_path)
    out = tmp_path / "V.pt"
    argv = ["centroids", "--features", str(p["features"]), "--labels", str(p["labels"]), "--num-classes",
            str(world.num_classes), "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "kept, made from the same inputs with the same settings" in capsys.readouterr().out
    assert cli.main(argv + ["--alpha", "0.5", "--seed", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mars centroids: error: --out {out} holds centroids made with other settings (alpha: 0.4 -> "
                   "0.5; seed: 0 -> 3); use another --out, or delete it to compute them again"]


# --------------------------------------------------------------------------------------------
# one run at a time
# --------------------------------------------------------------------------------------------

# A process that takes mars's lock on each path written to its stdin, each in a forked child
# that then sleeps (the child's pid comes back on stdout), as a run in progress would hold it.
HOLDER = r"""
import os, signal, sys, time
from mars_plugin.runs.run_lock import RunLock
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children killed by the tests are reaped
for line in sys.stdin:
    if os.fork() == 0:
        RunLock(line.strip(), "a test", "mars test-holder").acquire()
        sys.stdout.write(f"locked {os.getpid()}\n")
        sys.stdout.flush()
        time.sleep(300)
        os._exit(0)
"""


@pytest.fixture(scope="module")
def holder():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())
    pids = []

    def hold(path: Path) -> int:
        proc.stdin.write(f"{path}\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the lock holder did not answer"
        pid = int(proc.stdout.readline().split()[1])
        pids.append(pid)
        return pid

    yield hold
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} still there after SIGKILL")


@pytest.fixture(scope="module")
def cmd_inputs(syn, base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lock_inputs")
    b, h = _tiny_stego_files(tmp)
    return syn, base, b, h


def _argv(cmd: str, cmd_inputs, out: Path):
    (world, p, V), (_, tree), b, h = cmd_inputs
    common = ["--no-progress"]
    if cmd == "features":
        return ["features", "--uss", "stego", "--backbone", b, "--heads", h, "--images", p["images"], "--out", out,
                "--scales", "1", "--no-flip"] + common
    if cmd == "centroids":
        return ["centroids", "--features", p["features"], "--labels", p["labels"], "--num-classes",
                world.num_classes, "--out", out] + common
    if cmd == "debias":
        return ["debias", "--features", p["features"], "--labels", p["labels"], "--centroids", V, "--images",
                p["images"], "--out", out, "--refine", "threshold"] + common
    if cmd == "report":
        return ["report", "--labels", p["labels"], "--debiased", V.parent / "deb", "--images", p["images"],
                "--out", out] + common
    return ["reproduce", "--root", tree / "root", "--data", DATA, "--pseudo", tree / "pseudo", "--features",
            tree / "features", "--out", out, "--refine", "threshold"] + common


def _lock_of(cmd: str, out: Path) -> Path:
    return out.parent / f".{out.name}.lock" if cmd == "centroids" else out / ".mars-run.lock"


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["features", "centroids", "debias", "report", "reproduce"])
def test_a_second_run_is_refused_and_a_killed_run_never_blocks(cmd_inputs, holder, tmp_path, capsys, cmd):
    out = tmp_path / ("V.pt" if cmd == "centroids" else "out")
    lock = _lock_of(cmd, out)
    lock.parent.mkdir(parents=True, exist_ok=True)
    pid = holder(lock)
    argv = [str(a) for a in _argv(cmd, cmd_inputs, out)]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"mars {cmd}: error: --out {out} is in use by another run (pid {pid} on host "), err
    assert f"started {time.strftime('%Y-%m-%d')}" in err[0] and f"lock {lock})" in err[0], err
    assert not (out / "report.md").exists() and not (out / "scores.json").exists()
    _kill(pid)  # killed: its lock file stays behind, and must not block
    assert lock.is_file()
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert not lock.exists()  # a run that ends removes its lock file


def test_a_file_system_without_record_locks_runs_unlocked_with_one_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from mars_plugin.runs.run_lock import RunLock

    def no_locks(fd, op, *args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    lock = RunLock(tmp_path / ".mars-run.lock", f"--out {tmp_path}").acquire()
    assert not lock.locked and not (tmp_path / ".mars-run.lock").exists()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"mars: warning: --out {tmp_path}: this file system cannot lock {tmp_path / '.mars-run.lock'} "
                   "(No locks available); a second run into it at the same time would not be detected"]
    lock.release()


# --------------------------------------------------------------------------------------------
# .tmp-* files a killed run left
# --------------------------------------------------------------------------------------------

STALE = [".tmp-abcd1234.png", ".tmp-x_9y8z7w", ".tmp-qwertyui.json"]
FOREIGN = [".tmp-Mine.txt", "notes.tmp", ".tmp-short.png"]  # not names mars's atomic writes make


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["report", "reproduce", "debias", "features"])
def test_the_next_run_removes_the_tmp_files_a_killed_run_left(cmd_inputs, holder, tmp_path, capsys, cmd):
    out = tmp_path / "out"
    argv = [str(a) for a in _argv(cmd, cmd_inputs, out)]
    assert cli.main(argv) == 0
    folder = out / "report" if cmd == "reproduce" else out  # reproduce: its report stage's folder
    folders = [folder, out] if cmd == "reproduce" else [folder]
    for f in folders:
        for name in STALE + FOREIGN:
            (f / name).write_bytes(b"left by a killed run")
    # A run refused because another holds the lock touches nothing.
    pid = holder(out / ".mars-run.lock")
    assert cli.main(argv) == 2
    assert all((f / name).exists() for f in folders for name in STALE)
    _kill(pid)
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    for f in folders:
        left = sorted(q.name for q in f.iterdir() if q.name.startswith(".tmp") or q.name.endswith(".tmp"))
        assert left == sorted(FOREIGN), (f, left)


def test_features_model_given_as_settings_mapping_is_the_model_keyword(syn, tmp_path):
    """features_job's older spelling (settings={...}, the model's description) records what
    model={...} records; a FeaturesSettings record with keywords beside it, or both spellings, are
    refused by name."""
    from mars_plugin.commands.features_settings import FeaturesSettings

    _, p, _ = _copy_world(syn, tmp_path)
    model = {"uss": "pool", "files": {"weights": "w0"}}
    features_job(_pool, p["images"], tmp_path / "new", progress=False, model=model)
    features_job(_pool, p["images"], tmp_path / "old", progress=False, settings=model)
    assert (tmp_path / "new" / ".mars-run.json").read_bytes() == (tmp_path / "old" / ".mars-run.json").read_bytes()
    s = features_job(_pool, p["images"], tmp_path / "old", progress=False, model=model)
    assert s.existing == 8 and s.done == 0  # the same run: resumed, nothing made again
    with pytest.raises(ValueError, match="not also as settings="):
        features_job(_pool, p["images"], tmp_path / "x", settings=model, model=model)
    with pytest.raises(ValueError, match="not both"):
        features_job(_pool, p["images"], tmp_path / "x", settings=FeaturesSettings(), progress=False)
