"""Issue 22, class 7 (the small ones): a DHR dataset json whose ``ignore`` is not 255, image ids
that would read outside their folder, and images or maps without pixels.

* ``"ignore"``: DHR hard-codes 255 beside its json's value, so every reader of the json
  (DHRLayout, the tag reader, ``mars reproduce``) refuses any other value with one reason.
* ids: every adapter loader that takes ``ids`` refuses one that is not a plain file name,
  although the file it would name exists outside the folder.
* empty: a 0-height or 0-width feature file or CAM map is refused with the file's name (PIL
  refuses such PNG/JPEG files itself; the readers then name the file too).
"""
from __future__ import annotations

import json
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mars_plugin.adapters.wsss import advcam, dhr, irnet, rsepm, seam
from mars_plugin.cli import main
from mars_plugin.formats.files import read_features, read_image, read_label, write_label

IGNORE_REASON = "DHR's train.py also treats 255 as ignore"


# ---------------------------------------------------------------------------- "ignore" of a DHR json


def _json(root: Path, data: str, ignore) -> dhr.DHRLayout:
    layout = dhr.DHRLayout(root, data)
    layout.dataset_json.parent.mkdir(parents=True, exist_ok=True)
    layout.dataset_json.write_text(json.dumps({"names": list(dhr.CLASS_NAMES), "ignore": ignore}))
    return layout


READERS = {
    "DHRLayout.class_names": lambda layout: layout.class_names(),
    "DHRLayout.ignore_value": lambda layout: layout.ignore_value(),
    "load_image_labels(layout)": lambda layout: dhr.load_image_labels(layout, ids=[]),
    "load_image_labels(xml folder)": lambda layout: dhr.load_image_labels(layout.xml_dir("train_aug"), ids=[]),
    "write_masks": lambda layout: dhr.write_masks([], layout, dry_run=True),
}


@pytest.mark.parametrize("ignore", [0, 254, "255", True, 255.0, None], ids=repr)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_of_a_dhr_json_refuses_an_ignore_other_than_255(reader, ignore, tmp_path):
    layout = _json(tmp_path, "VOC2012", ignore)
    layout.xml_dir("train_aug").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        READERS[reader](layout)
    assert IGNORE_REASON in str(e.value) and "VOC2012.json" in str(e.value), str(e.value)
    _json(tmp_path, "VOC2012", 255)
    READERS[reader](layout)  # 255 is read by all of them


@pytest.mark.parametrize("ignore", [0, 254, 255])
def test_reproduce_agrees_with_dhr_layout_on_ignore(ignore, tmp_path, capsys):
    from test_reproduce import DATA, make_tree

    _, root, pseudo, feats = make_tree(tmp_path, n=4, size=24)
    path = root / DATA / f"{DATA}.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), ignore=ignore)))
    out = tmp_path / "out"
    rc = main(["reproduce", "--root", str(root), "--pseudo", str(pseudo), "--features", str(feats), "--data", DATA,
               "--out", str(out), "--dry-run", "--no-progress"])
    err = capsys.readouterr().err
    if ignore == 255:
        assert rc == 0, err
        return
    assert rc == 2 and IGNORE_REASON in err and f"'ignore' is {ignore}" in err, err
    assert not out.exists()


# ---------------------------------------------------------------------------- unsafe ids


UNSAFE = ["../outside", "sub/inner", "..", "", "a\0b"]


def _folders(tmp: Path):
    """<tmp>/dir (the folder a loader is given) and, beside it, the files an unsafe id names."""
    d = tmp / "dir"
    (d / "sub").mkdir(parents=True)
    for folder in (tmp, d / "sub"):
        name = "outside" if folder == tmp else "inner"
        write_label(folder / f"{name}.png", torch.zeros(2, 2, dtype=torch.long))
        (folder / f"{name}.xml").write_text("<annotation><object><name>cat</name></object></annotation>")
        torch.save({"keys": torch.tensor([0]), "masks": torch.ones(1, 2, 2).half()}, folder / f"{name}.pt")
        with open(folder / f"{name}.pkl", "wb") as fh:
            pickle.dump({"keys": np.array([0, 1]), "seed": np.ones((1, 2, 2), np.float32)}, fh)
        np.save(folder / f"{name}.npy", np.array({0: np.ones((2, 2), np.float32)}, dtype=object), allow_pickle=True)
    return d


LOADERS = {
    "dhr.load_pseudo_labels": lambda d, ids: list(dhr.load_pseudo_labels(d, ids=ids)),
    "irnet.load_pseudo_labels": lambda d, ids: list(irnet.load_pseudo_labels(d, ids=ids)),
    "advcam.load_pseudo_labels": lambda d, ids: list(advcam.load_pseudo_labels(d, ids=ids)),
    "seam.load_pseudo_labels": lambda d, ids: list(seam.load_pseudo_labels(d, ids=ids)),
    "rsepm.load_pseudo_labels": lambda d, ids: list(rsepm.load_pseudo_labels(d, ids=ids)),
    "dhr.iter_cams": lambda d, ids: list(dhr.iter_cams(d, ids=ids)),
    "rsepm.iter_cams": lambda d, ids: list(rsepm.iter_cams(d, ids=ids, trust_pickle=True)),
    "seam.iter_cams": lambda d, ids: list(seam.iter_cams(d, ids=ids, trust_pickle=True)),
    "dhr.load_image_labels": lambda d, ids: dhr.load_image_labels(d, ids=ids, class_names=["background", "cat"]),
    "rsepm.load_image_labels": lambda d, ids: rsepm.load_image_labels(d, ids=ids),
    "seam.load_image_labels": lambda d, ids: seam.load_image_labels(d, ids=ids),
}


@pytest.mark.parametrize("stem", UNSAFE, ids=repr)
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loaders_refuse_ids_that_leave_their_folder(loader, stem, tmp_path):
    d = _folders(tmp_path)
    with pytest.raises(ValueError, match="not a plain file name"):
        LOADERS[loader](d, [stem])


# ---------------------------------------------------------------------------- nothing to see


EMPTY = [(4, 0, 5), (4, 5, 0), (0, 5, 5)]


@pytest.mark.parametrize("shape", EMPTY, ids=str)
@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_an_empty_feature_file_is_refused_naming_it(shape, suffix, tmp_path):
    p = tmp_path / f"f{suffix}"
    if suffix == ".npy":
        np.save(p, np.zeros(shape, np.float16))
    else:
        torch.save(torch.zeros(shape).half(), p)
    with pytest.raises(ValueError, match="is empty") as e:
        read_features(p)
    assert str(p) in str(e.value)


def _save_cams(kind: str, path: Path, h: int, w: int) -> None:
    if kind == "dhr":
        torch.save({"keys": torch.tensor([0, 3]), "masks": torch.ones(2, h, w).half()}, path)
    elif kind == "rsepm":
        with open(path, "wb") as fh:
            pickle.dump({"keys": np.array([0, 3]), "seed": np.ones((1, h, w), np.float32)}, fh)
    elif kind == "seam":
        np.save(path, np.array({2: np.ones((h, w), np.float32)}, dtype=object), allow_pickle=True)
    else:  # irnet, advcam
        np.save(path, np.array({"keys": np.array([2]), "cam": np.ones((1, max(h, 1), w), np.float32),
                                "high_res": np.ones((1, h, w), np.float32)}, dtype=object), allow_pickle=True)


CAMS = {"dhr": (".pt", dhr.load_cams), "rsepm": (".pkl", rsepm.load_cams), "seam": (".npy", seam.load_cams),
        "irnet": (".npy", irnet.load_cams), "advcam": (".npy", advcam.load_cams)}


@pytest.mark.parametrize("hw", [(0, 5), (5, 0)], ids=str)
@pytest.mark.parametrize("kind", sorted(CAMS))
def test_an_empty_cam_map_is_refused_naming_the_file(kind, hw, tmp_path):
    suffix, load = CAMS[kind]
    p = tmp_path / f"2007_000032{suffix}"
    _save_cams(kind, p, *hw)
    kw = {} if kind == "dhr" else {"trust_pickle": True}
    with pytest.raises(ValueError) as e:
        load(p, **kw)
    msg = str(e.value)
    assert str(p) in msg and "at least one pixel" in msg, msg
    _save_cams(kind, p, 3, 4)
    load(p, **kw)  # the same file with pixels is read


def _png(w: int, h: int, color_type: int) -> bytes:
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("wh", [(5, 0), (0, 5)], ids=str)
@pytest.mark.parametrize("reader", ["read_image", "read_label"])
def test_an_image_file_without_pixels_is_refused_naming_it(reader, wh, tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(_png(*wh, 2 if reader == "read_image" else 0))
    with pytest.raises(ValueError) as e:
        (read_image if reader == "read_image" else read_label)(p)
    assert str(p) in str(e.value)


def test_mars_centroids_names_an_empty_feature_file(tmp_path, capsys):
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    w = make_world(3, size=24, dim=16, seed=1)
    write_world(w, tmp_path)
    bad = tmp_path / "features" / f"{w.stems[1]}.npy"
    np.save(bad, np.zeros((16, 0, 6), np.float16))
    rc = main(["centroids", "--features", str(tmp_path / "features"), "--labels", str(tmp_path / "labels"),
               "--num-classes", "6", "--out", str(tmp_path / "V.pt"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad) in err and "is empty" in err, err
    assert not (tmp_path / "V.pt").exists()
