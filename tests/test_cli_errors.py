"""The ``--on-error`` contract of every command that reads folders, as one matrix:
{kind of bad file} x {centroids, debias, evaluate, report} x {stop, skip}.

stop: exit 2, one error line on stderr naming the file, no traceback.
skip: exit 1, the file named on stderr, every good file still processed.
"""
import json
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import DebiasedCentroids
from mars_plugin.cli import main
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

N = 8
BAD = 2  # index of the damaged image: good files come before and after it


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("errworld")
    w = make_world(N, size=24, dim=16, seed=5)
    write_world(w, root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    assert main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--centroids", str(root / "V.pt"), "--out", str(root / "db"), "--refine", "threshold",
                 "--no-progress"]) == 0
    return root, w.stems


def bomb_png() -> bytes:
    """A PNG header declaring 50000 x 50000 pixels (over twice PIL's MAX_IMAGE_PIXELS)."""
    ihdr = struct.pack(">IIBBBBB", 50000, 50000, 8, 0, 0, 0, 0)
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _npy(path, change):
    arr = np.load(path)
    np.save(path, change(arr.copy()))


class Custom:
    """A class of this test module: a .pt file holding one needs unpickling, which mars refuses."""


def _pt(path, change, keep_npy=False):
    """Replace the features ``<stem>.npy`` by ``<stem>.pt`` (DHR's fp16 tensor), changed by
    ``change``: the folder then mixes both formats. ``keep_npy``: both formats for one stem."""
    t = torch.from_numpy(np.load(path)).half()
    if not keep_npy:
        path.unlink()
    torch.save(change(t), path.with_suffix(".pt"))


def _pt_truncated(path):
    _pt(path, lambda t: t)
    pt = path.with_suffix(".pt")
    pt.write_bytes(pt.read_bytes()[: len(pt.read_bytes()) // 2])


def _label(path, value):
    with Image.open(path) as im:
        mode, arr = im.mode, np.array(im)
    arr[0, 0] = value
    out = Image.fromarray(arr, mode="L")
    if mode == "P":
        out = out.convert("P")
    out.save(path)


# kind -> (role of the damaged file, how to damage it)
KINDS = {
    "npy-empty": ("features", lambda p: p.write_bytes(b"")),
    "npy-truncated": ("features", lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])),
    "npy-nan": ("features", lambda p: _npy(p, lambda a: (a.__setitem__((0, 0, 0), np.nan), a)[1])),
    "npy-other-D": ("features", lambda p: _npy(p, lambda a: a[:8])),
    "npy-missing": ("features", lambda p: p.unlink()),
    "pt-empty": ("features", lambda p: (p.unlink(), p.with_suffix(".pt").write_bytes(b""))),
    "pt-truncated": ("features", _pt_truncated),
    "pt-pickled-class": ("features", lambda p: _pt(p, lambda t: {"features": t, "meta": Custom()})),
    "pt-dict-of-tensors": ("features", lambda p: _pt(p, lambda t: {"features": t})),
    "pt-int-tensor": ("features", lambda p: _pt(p, lambda t: t.to(torch.int16))),
    "pt-nan": ("features", lambda p: _pt(p, lambda t: (t.__setitem__((0, 0, 0), float("nan")), t)[1])),
    "pt-other-D": ("features", lambda p: _pt(p, lambda t: t[:8].clone())),
    "pt-and-npy": ("features", lambda p: _pt(p, lambda t: t, keep_npy=True)),
    "png-corrupt": ("labels", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")),
    "png-bomb": ("labels", lambda p: p.write_bytes(bomb_png())),
    "class-above-C": ("labels", lambda p: _label(p, 9)),
    "254-in-pseudo-label": ("labels", lambda p: _label(p, 254)),
    "png-missing": ("labels", lambda p: p.unlink()),
    "image-corrupt": ("images", lambda p: p.write_bytes(b"GIF89a garbage")),
    "image-bomb": ("images", lambda p: p.write_bytes(bomb_png())),
    "image-missing": ("images", lambda p: p.unlink()),
}

# The roles each command reads. centroids and debias list their images from the labels, so a
# missing label is no error there (the image is simply not in the set); evaluate lists the
# ground truth, its missing file is a prediction.
READS = {
    "centroids": {"features", "labels"},
    "debias": {"features", "labels", "images"},
    "evaluate": {"labels"},
    "report": {"labels", "images"},
}
CASES = [(kind, cmd) for kind, (role, _) in KINDS.items() for cmd in READS if role in READS[cmd]
         and not (kind == "png-missing" and cmd in ("centroids", "debias"))]


def _setup(root, stems, kind, cmd, tmp_path):
    """A copy of the world's folders with one file of stems[BAD] damaged; returns the stem.
    evaluate reads the copied labels as its ground truth (--gt) and ``pred`` as --pred."""
    for sub in ("features", "labels", "images", "db"):
        shutil.copytree(root / sub, tmp_path / sub)
    shutil.copytree(root / "labels", tmp_path / "pred")
    role, damage = KINDS[kind]
    stem = stems[BAD]
    folder = {"features": "features", "labels": "labels", "images": "images"}[role]
    if kind == "png-missing" and cmd == "evaluate":
        folder = "pred"  # a ground truth without its prediction
    ext = {"features": ".npy", "labels": ".png", "images": ".png"}[role]
    damage(tmp_path / folder / f"{stem}{ext}")
    return stem


def _argv(cmd, root, d, on_error):
    common = ["--no-progress", "--on-error", on_error]
    if cmd == "centroids":
        return ["centroids", "--features", str(d / "features"), "--labels", str(d / "labels"), "--num-classes", "6",
                "--out", str(d / "out.pt"), *common]
    if cmd == "debias":
        return ["debias", "--features", str(d / "features"), "--labels", str(d / "labels"), "--centroids",
                str(root / "V.pt"), "--images", str(d / "images"), "--out", str(d / "out"), *common]
    if cmd == "evaluate":
        return ["evaluate", "--pred", str(d / "pred"), "--gt", str(d / "labels"), "--num-classes", "6",
                "--json", str(d / "scores.json"), *common]
    return ["report", "--labels", str(d / "labels"), "--debiased", str(d / "db"), "--images", str(d / "images"),
            "--class-names", str(root / "classes.json"), "--out", str(d / "out"), *common]


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["stop", "skip"])
@pytest.mark.parametrize("kind,cmd", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_bad_file_matrix(world, tmp_path, capsys, kind, cmd, on_error):
    root, stems = world
    stem = _setup(root, stems, kind, cmd, tmp_path)
    capsys.readouterr()
    rc = main(_argv(cmd, root, tmp_path, on_error))  # an uncaught exception fails the test
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert stem in err, err
    assert "samples[" not in err and "pseudo_label" not in err
    good = set(stems) - {stem}
    if on_error == "stop":
        assert rc == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mars {cmd}: error: ") and stem in lines[0], err
        if cmd == "report":
            assert not (tmp_path / "out" / "biased_share.png").exists()
        return
    assert rc == 1
    assert f"skipped 1 file(s):" in err and "1 skipped" in out
    if cmd == "centroids":
        assert DebiasedCentroids.load(tmp_path / "out.pt").num_images == N - 1
    elif cmd == "debias":
        assert {p.stem for p in (tmp_path / "out").glob("*.png")} == good
    elif cmd == "evaluate":
        assert json.loads((tmp_path / "scores.json").read_text())["num_images"] == N - 1
    else:
        rep = json.loads((tmp_path / "out" / "report.json").read_text())
        assert rep["num_images"] == N - 1 and stem not in {e["stem"] for e in rep["most_changed"]}
        assert (tmp_path / "out" / "biased_share.png").is_file()


def test_every_skipped_file_is_listed(world, tmp_path, capsys):
    """More than ten skipped files: all of them are listed, none elided."""
    root, stems = world
    many = make_world(14, size=16, dim=16, seed=9)
    write_world(many, tmp_path / "w")
    for s in many.stems[:12]:
        (tmp_path / "w" / "features" / f"{s}.npy").write_bytes(b"")
    capsys.readouterr()
    assert main(["centroids", "--features", str(tmp_path / "w" / "features"), "--labels",
                 str(tmp_path / "w" / "labels"), "--num-classes", "6", "--out", str(tmp_path / "V.pt"),
                 "--no-progress", "--on-error", "skip"]) == 1
    out, err = capsys.readouterr()
    assert "12 skipped" in out and "skipped 12 file(s):" in err
    for s in many.stems[:12]:
        assert f"  {s}: " in err


def test_report_failure_leaves_no_chart_without_report_json(world, tmp_path, capsys, monkeypatch):
    """Outputs are staged and renamed together, report.json last: a failure while writing the
    overlays leaves neither the chart nor report.json (nor temporary files)."""
    from mars_plugin.pictures import panel_grids
    root, _ = world

    def broken(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(panel_grids, "save_overlay_grid", broken)
    assert main(["report", "--labels", str(root / "labels"), "--debiased", str(root / "db"), "--images",
                 str(root / "images"), "--out", str(tmp_path / "rep"), "--no-progress"]) == 2
    assert "disk full" in capsys.readouterr().err
    assert list((tmp_path / "rep").iterdir()) == []
