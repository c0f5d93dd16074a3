"""``--on-error`` in ``mars reproduce`` and ``mars features --dhr``: every kind of bad file is a
per-file failure. ``stop``: one line naming the file, exit 2. ``skip``: the file is named once on
stderr, everything else is done, exit 1. A bad file that no stage reads changes nothing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars_plugin import cli

from test_reproduce import DATA, _tiny_stego_files, make_tree


def _main(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# --------------------------------------------------------------------------- reproduce: xml files

#: Every kind of bad xml, as (what is put at <id>.xml, a piece of the message).
BAD_XML = {
    "not xml": (b"not xml at all", "cannot read the xml annotation"),
    "empty": (b"", "cannot read the xml annotation"),
    "binary": (bytes(range(256)), "cannot read the xml annotation"),
    "unknown tag": (b"<annotation><object><name>zebra</name></object></annotation>", "unknown class 'zebra'"),
    "unstripped tag": (b"<annotation><object><name> boat</name></object></annotation>", "unknown class ' boat'"),
    "object without a name": (b"<annotation><object><bndbox/></object></annotation>", "without a <name>"),
    "unknown encoding": (b'<?xml version="1.0" encoding="bogus"?><annotation/>', "unknown encoding"),
    "bad bytes for its encoding": (b'<?xml version="1.0" encoding="utf-8"?><annotation><object><name>\xff</name>'
                                   b"</object></annotation>", "cannot read the xml annotation"),
    "entity bomb": (b'<?xml version="1.0"?><!DOCTYPE a [<!ENTITY b "bbbbbbbbbb">' + b"".join(
        b'<!ENTITY c%d "%s">' % (i, (b"&b;" if i == 0 else b"&c%d;" % (i - 1)) * 10) for i in range(8))
        + b"]><annotation><object><name>&c7;</name></object></annotation>", "cannot read the xml annotation"),
    "missing": (None, "missing annotation"),
    "a folder": ("dir", "missing annotation"),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("skip_tree"), n=6, size=32)


def _tree_with_bad_xml(tree, tmp_path: Path, kind: str, stem: str):
    """A copy of the tree's xml folder (the rest shared by links) with ``stem``'s xml made bad."""
    world, root, pseudo, feats = tree
    new = tmp_path / "root"
    dom = new / DATA / "train_aug"
    dom.mkdir(parents=True)
    (new / DATA / f"{DATA}.json").symlink_to(root / DATA / f"{DATA}.json")
    for sub in ("image", "mask"):
        (dom / sub).symlink_to(root / DATA / "train_aug" / sub)
    (dom / "xml").mkdir()
    for p in (root / DATA / "train_aug" / "xml").iterdir():
        (dom / "xml" / p.name).write_bytes(p.read_bytes())
    content, _ = BAD_XML[kind]
    target = dom / "xml" / f"{stem}.xml"
    target.unlink()
    if content == "dir":
        target.mkdir()
    elif content is not None:
        target.write_bytes(content)
    return new, target


def _reproduce_argv(root, pseudo, feats, out, *extra):
    return ["reproduce", "--root", str(root), "--data", DATA, "--pseudo", str(pseudo), "--features", str(feats),
            "--out", str(out), "--refine", "threshold", "--no-references", "--no-progress", "--threads", "1", *extra]


@pytest.mark.parametrize("kind", list(BAD_XML))
def test_reproduce_bad_xml_stop_names_the_file(tree, tmp_path, capsys, kind):
    world, _, pseudo, feats = tree
    stem = world.stems[1]
    root, xml = _tree_with_bad_xml(tree, tmp_path, kind, stem)
    code, _, err = _main(_reproduce_argv(root, pseudo, feats, tmp_path / "out"), capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mars reproduce: error: "), err
    assert str(xml) in lines[0] and BAD_XML[kind][1] in lines[0], lines[0]
    assert not (tmp_path / "out" / "centroids.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BAD_XML))
def test_reproduce_bad_xml_skip_names_it_once_and_runs_the_rest(tree, tmp_path, capsys, kind):
    world, _, pseudo, feats = tree
    stem = world.stems[1]
    root, xml = _tree_with_bad_xml(tree, tmp_path, kind, stem)
    out = tmp_path / "out"
    code, printed, err = _main(_reproduce_argv(root, pseudo, feats, out, "--on-error", "skip"), capsys)
    assert code == 1
    assert "mIoU of the labels" in printed
    named = [l for l in err.splitlines() if stem in l]
    # once: as the id whose tags could not be read, not again by every stage
    assert len(named) == 1 and named[0].strip().startswith(f"{stem} (tags): {xml}"), err
    assert BAD_XML[kind][1] in named[0]
    assert sorted(p.stem for p in (out / "debiased").glob("*.png")) == [s for s in world.stems if s != stem]
    assert stem not in json.loads((out / "image_labels.json").read_text())


@pytest.mark.parametrize("kind", ["not xml", "unknown tag", "unknown encoding", "a folder"])
def test_reproduce_a_bad_xml_of_an_id_without_pseudo_label_changes_nothing(tree, tmp_path, capsys, kind):
    world, _, pseudo, feats = tree
    stem = world.stems[1]
    root, _ = _tree_with_bad_xml(tree, tmp_path, kind, stem)
    fewer = tmp_path / "pseudo"
    fewer.mkdir()
    for p in pseudo.glob("*.png"):
        if p.stem != stem:
            (fewer / p.name).symlink_to(p)
    for on_error in ("stop", "skip"):
        code, _, err = _main(_reproduce_argv(root, fewer, feats, tmp_path / f"out_{on_error}", "--on-error",
                                             on_error), capsys)
        assert code == 0 and stem not in err, err


@pytest.mark.parametrize("kind", list(BAD_XML))
def test_reproduce_dry_run_lists_the_bad_xml(tree, tmp_path, capsys, kind):
    world, _, pseudo, feats = tree
    stem = world.stems[1]
    root, _ = _tree_with_bad_xml(tree, tmp_path, kind, stem)
    code, printed, _ = _main(_reproduce_argv(root, pseudo, feats, tmp_path / "out", "--dry-run"), capsys)
    assert code == 1 and stem in printed


# --------------------------------------------------------------------------- features --dhr: images

def _png(path: Path, h: int, w: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def _bomb(path: Path) -> None:
    """A PNG whose header declares far more pixels than PIL's decompression-bomb limit."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10))
                     + chunk(b"IEND", b""))


def _truncated(path: Path) -> None:
    _png(path, 24, 32)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


#: Every kind of bad image for DHR's inference (scales 2, 1, 1.5, 0.5): name -> writer.
BAD_IMAGES = {
    "1x1": lambda p: _png(p, 1, 1),
    "one row": lambda p: _png(p, 1, 40),
    "one column": lambda p: _png(p, 40, 1),
    "empty file": lambda p: p.write_bytes(b""),
    "not an image": lambda p: p.write_text("hello"),
    "truncated": _truncated,
    "decompression bomb": _bomb,
}


@pytest.fixture(scope="module")
def stego_files(tmp_path_factory):
    return _tiny_stego_files(tmp_path_factory.mktemp("stego"))


def _images(tmp_path: Path, kind: str, copies: int = 1) -> Path:
    imgs = tmp_path / "images"
    imgs.mkdir()
    for i in range(3):
        _png(imgs / f"ok{i}.png", 24, 32, seed=i)
    for i in range(copies):
        BAD_IMAGES[kind](imgs / f"bad{i}.png")
    return imgs


def _features_argv(files, imgs, out, *extra):
    b, h = files
    return ["features", "--uss", "stego", "--backbone", str(b), "--heads", str(h), "--dhr", "--images", str(imgs),
            "--out", str(out), "--no-progress", "--threads", "1", *extra]


@pytest.mark.parametrize("kind", list(BAD_IMAGES))
def test_features_dhr_bad_image_stop_names_the_file(stego_files, tmp_path, capsys, kind):
    imgs = _images(tmp_path, kind)
    code, _, err = _main(_features_argv(stego_files, imgs, tmp_path / "out"), capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mars features: error: bad0: "), err
    assert str(imgs / "bad0.png") in lines[0]


@pytest.mark.parametrize("kind", list(BAD_IMAGES))
def test_features_dhr_bad_images_skip_names_each_and_writes_the_rest(stego_files, tmp_path, capsys, kind):
    # Two bad images of one size share a batch: each is named, neither takes a good image with it.
    imgs = _images(tmp_path, kind, copies=2)
    out = tmp_path / "out"
    code, printed, err = _main(_features_argv(stego_files, imgs, out, "--on-error", "skip", "--batch-size", "4"),
                               capsys)
    assert code == 1
    assert "3 written, 2 skipped" in printed
    for i in range(2):
        named = [l for l in err.splitlines() if f"bad{i}" in l]
        assert len(named) == 1 and str(imgs / f"bad{i}.png") in named[0], err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".mars-run")) == ["ok0.npy", "ok1.npy", "ok2.npy"]


def test_reproduce_features_stage_skips_a_tiny_image_by_name(tree, stego_files, tmp_path, capsys):
    """The features stage of reproduce is features --dhr: a 1x1 image in the tree is skipped
    there and named, the other stages go on without it."""
    world, root, pseudo, _ = tree
    new = tmp_path / "root"
    dom = new / DATA / "train_aug"
    for sub in ("image", "mask", "xml"):
        (dom / sub).mkdir(parents=True)
        for p in sorted((root / DATA / "train_aug" / sub).iterdir())[:3]:
            (dom / sub / p.name).symlink_to(p)
    (new / DATA / f"{DATA}.json").symlink_to(root / DATA / f"{DATA}.json")
    few = tmp_path / "pseudo"
    few.mkdir()
    for p in sorted(pseudo.glob("*.png"))[:3]:
        (few / p.name).symlink_to(p)
    tiny = world.stems[0]
    (dom / "image" / f"{tiny}.jpg").unlink()
    _png(dom / "image" / f"{tiny}.jpg", 1, 1)
    b, h = stego_files
    out = tmp_path / "out"
    argv = ["reproduce", "--root", str(new), "--data", DATA, "--pseudo", str(few), "--out", str(out), "--backbone",
            str(b), "--heads", str(h), "--refine", "threshold", "--no-references", "--no-progress", "--threads", "1",
            "--on-error", "skip"]
    code, _, err = _main(argv, capsys)
    assert code == 1
    # named with its file, by the extractor's size check before any work on it
    assert f"{tiny} (features): {dom / 'image' / tiny}.jpg: " in err and "too small" in err, err
    assert sorted(p.stem for p in (out / "features").glob("*.pt")) == world.stems[1:3]
