"""Feature files in both formats: ``<stem>.npy`` arrays and ``<stem>.pt`` fp16 torch tensors
(what DHR's produce_uss_features.py:34 writes): reading, writing, finding, refusing, and the
``mars`` commands giving the same results on either."""
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from mars_plugin import DebiasedCentroids
from mars_plugin.adapters.uss.extractor import ModelExtractor
from mars_plugin.commands.features import add_features_arguments, features_job
from mars_plugin.cli import main
from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.formats.files import (
    FEATURE_EXTENSIONS,
    feature_shape,
    find_features,
    read_features,
    read_label,
    write_features,
)
from mars_plugin.runs.errors import JobError
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world


class Trap:
    """Unpickling this creates the file ``path`` (``open(path, "w")``): the proof that a file
    was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class Custom:
    """A harmless custom class (the matrix of test_cli_errors pickles one)."""


def _fp16(t):
    return t.half().float()


# --------------------------------------------------------------------------------------------
# read / write
# --------------------------------------------------------------------------------------------


def test_extensions():
    assert FEATURE_EXTENSIONS == (".npy", ".pt")


@pytest.mark.parametrize("ext", [".npy", ".pt"])
def test_round_trip_is_fp16_rounding(tmp_path, ext):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 5, 6, generator=g) * 3  # float32, not representable in fp16
    p = tmp_path / f"a{ext}"
    write_features(p, t)
    got = read_features(p)
    assert got.dtype == torch.float32 and got.shape == (7, 5, 6) and got.is_contiguous()
    assert torch.equal(got, _fp16(t))
    assert not torch.equal(got, t)  # the rounding is real: the file is fp16
    # float32 on request, exact; and numpy input
    write_features(p, t.numpy(), dtype=np.float32)
    assert torch.equal(read_features(p), t)
    assert [q.name for q in tmp_path.iterdir()] == [p.name]  # no temporary file left behind


def test_pt_file_is_a_plain_fp16_tensor_as_dhr_reads_it(tmp_path):
    t = torch.randn(4, 3, 5)
    write_features(tmp_path / "x.pt", t)
    # DHR: torch.load(path, map_location='cpu').float() (core/datasets.py:94), here weights_only
    raw = torch.load(tmp_path / "x.pt", map_location="cpu", weights_only=True)
    assert type(raw) is torch.Tensor and raw.dtype == torch.float16 and raw.shape == (4, 3, 5)
    assert torch.equal(raw.float(), _fp16(t))


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_reads_the_dhr_file_exactly(tmp_path, zipfile):
    """produce_uss_features.py:34: ``torch.save(f_us.half().cpu(), uss_path)`` of a (C, h, w)
    map (core/uss/__init__.py averages the scales into one (C, h, w) map)."""
    f_us = torch.randn(2, 90, 16, 20).mean(0)  # (C, h, w)
    p = tmp_path / "2007_000032.pt"
    torch.save(f_us.half().cpu(), p, _use_new_zipfile_serialization=zipfile)
    got = read_features(p)
    assert got.dtype == torch.float32 and torch.equal(got, f_us.half().float())
    assert feature_shape(p) == (90, 16, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pt_of_a_slice_writes_only_the_slice(tmp_path, dtype):
    """torch.save writes a tensor's whole storage: a slice must be saved as a copy."""
    big = torch.randn(64, 32, 32).to(dtype)
    piece = big[3:5]  # contiguous, but its storage is the 64 x 32 x 32 one
    p = tmp_path / "s.pt"
    write_features(p, piece)
    payload = 2 * 32 * 32 * 2  # D*h*w*2 bytes
    size = os.path.getsize(p)
    assert payload <= size < payload + 4096, size
    assert torch.equal(read_features(p), _fp16(piece.float()))
    # a non-contiguous view: read back contiguous and equal
    view = big.permute(0, 2, 1)[10:13]
    write_features(p, view)
    assert torch.load(p, weights_only=True).is_contiguous()
    assert torch.equal(read_features(p), _fp16(view.float()))
    assert os.path.getsize(p) < 3 * 32 * 32 * 2 + 4096


def test_feature_shape_of_both_formats(tmp_path, monkeypatch):
    t = torch.randn(6, 4, 9)
    write_features(tmp_path / "a.npy", t)
    write_features(tmp_path / "b.pt", t)
    assert feature_shape(tmp_path / "a.npy") == feature_shape(tmp_path / "b.pt") == (6, 4, 9)
    # the .pt probe maps the file instead of reading it, and never unpickles
    calls = []
    real = torch.load

    def spy(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    assert feature_shape(tmp_path / "b.pt") == (6, 4, 9)
    assert calls and calls[0].get("mmap") is True and all(k.get("weights_only") is True for k in calls)


def _bad_pt(kind, p):
    t = torch.randn(3, 4, 5).half()
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated":
        torch.save(t, p)
        p.write_bytes(p.read_bytes()[: os.path.getsize(p) // 2])
    elif kind == "not-a-zip":
        p.write_bytes(b"this is no torch file at all" * 10)
    elif kind == "plain-pickle":
        p.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    elif kind == "custom-class":
        torch.save({"f": t, "meta": Custom()}, p)
    elif kind == "dict":
        torch.save({"f": t}, p)
    elif kind == "list":
        torch.save([t], p)
    elif kind == "int-tensor":
        torch.save(torch.ones(3, 4, 5, dtype=torch.int32), p)
    elif kind == "2d":
        torch.save(t[0], p)
    elif kind == "4d":
        torch.save(t[None], p)
    elif kind == "complex":
        torch.save(torch.ones(3, 4, 5, dtype=torch.complex64), p)
    else:
        raise AssertionError(kind)


BAD_PT = {
    "empty": "empty file, 0 bytes",
    "truncated": "truncated or corrupt",
    "not-a-zip": "not a tensor written by torch.save",
    "plain-pickle": "not a tensor written by torch.save",
    "custom-class": "pickled Python object, test_feature_files.Custom, which mars never unpickles",
    "dict": "got a dict",
    "list": "got a list",
    "int-tensor": "got torch.int32 (3, 4, 5)",
    "2d": "got torch.float16 (4, 5)",
    "4d": "got torch.float16 (1, 3, 4, 5)",
    "complex": "got torch.complex64",
}


@pytest.mark.parametrize("kind", list(BAD_PT))
def test_bad_pt_files_are_value_errors_naming_the_file(tmp_path, kind):
    p = tmp_path / f"stem_{kind}.pt"
    _bad_pt(kind, p)
    with pytest.raises(ValueError) as e:
        read_features(p)
    msg = str(e.value)
    assert msg.startswith(str(p)) and BAD_PT[kind] in msg and "\n" not in msg, msg
    if kind not in ("int-tensor", "2d", "4d", "complex"):  # the probe sees a shape for these
        with pytest.raises(ValueError, match=str(p)):
            feature_shape(p)


def test_other_suffixes_are_refused(tmp_path):
    p = tmp_path / "a.npz"
    np.savez(p, a=np.zeros((1, 2, 2)))
    for f in (read_features, feature_shape):
        with pytest.raises(ValueError, match=r"a\.npz: feature files must end in one of \.npy, \.pt, got '\.npz'"):
            f(p)
    with pytest.raises(ValueError, match="got 'no suffix'"):
        write_features(tmp_path / "noext", np.zeros((1, 2, 2)))


@pytest.mark.parametrize("where", ["top", "in-dict"])
def test_refused_pickles_are_never_executed(tmp_path, where):
    marker = tmp_path / "MARKER"
    p = tmp_path / "evil.pt"
    trap = Trap(marker)
    torch.save(trap if where == "top" else {"f": torch.zeros(1, 2, 2), "x": trap}, p)
    assert not marker.exists()
    with pytest.raises(ValueError, match="pickled Python object"):
        read_features(p)
    with pytest.raises(ValueError):
        feature_shape(p)
    assert not marker.exists()
    # through the command line too
    labels = tmp_path / "labels"
    labels.mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8), mode="L").save(labels / "evil.png")
    assert main(["centroids", "--features", str(tmp_path), "--labels", str(labels), "--num-classes", "2",
                 "--out", str(tmp_path / "V.pt"), "--no-progress"]) == 2
    assert not marker.exists()
    # the trap is real: an unsafe load would have created the file
    torch.load(p, weights_only=False)
    assert marker.exists()


# --------------------------------------------------------------------------------------------
# find_features
# --------------------------------------------------------------------------------------------


def test_find_features(tmp_path):
    t = torch.randn(2, 3, 3)
    write_features(tmp_path / "a.npy", t)
    write_features(tmp_path / "b.pt", t)
    assert find_features(tmp_path, "a") == tmp_path / "a.npy"
    assert find_features(tmp_path, "b") == tmp_path / "b.pt"
    with pytest.raises(ValueError) as e:
        find_features(tmp_path, "c")
    assert str(e.value) == f"no features for c in {tmp_path} (looked for c.npy, c.pt)"
    write_features(tmp_path / "a.pt", t)
    with pytest.raises(ValueError) as e:
        find_features(tmp_path, "a")
    assert str(tmp_path / "a.npy") in str(e.value) and str(tmp_path / "a.pt") in str(e.value)
    (tmp_path / "d.pt").mkdir()  # a folder is no feature file
    with pytest.raises(ValueError, match="no features for d"):
        find_features(tmp_path, "d")
    with pytest.raises(ValueError, match="not a plain file name"):
        find_features(tmp_path, "../a")


# --------------------------------------------------------------------------------------------
# the commands on .pt folders
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """One world with its features as .npy, as .pt, and mixed (even stems .pt)."""
    root = tmp_path_factory.mktemp("ptworld")
    w = make_world(10, size=24, dim=16, seed=11)
    write_world(w, root / "npy")
    for name in ("pt", "mixed"):
        shutil.copytree(root / "npy", root / name)
        for i, s in enumerate(w.stems):
            if name == "pt" or i % 2 == 0:
                f = root / name / "features" / f"{s}.npy"
                write_features(f.with_suffix(".pt"), read_features(f))
                f.unlink()
    return root, w.stems


def _centroids(d, out, extra=()):
    return main(["centroids", "--features", str(d / "features"), "--labels", str(d / "labels"),
                 "--num-classes", "6", "--out", str(out), "--no-progress", *extra])


def _debias(d, V, out, extra=()):
    return main(["debias", "--features", str(d / "features"), "--labels", str(d / "labels"), "--centroids", str(V),
                 "--images", str(d / "images"), "--out", str(out), "--no-progress", *extra])


def _labels(folder):
    return {p.stem: read_label(p, biased_value=None) for p in sorted(folder.glob("*.png"))}


@pytest.mark.slow
def test_centroids_and_debias_are_the_same_on_pt_npy_and_mixed(worlds, tmp_path):
    root, stems = worlds
    assert sorted(os.listdir(root / "pt" / "features")) == [f"{s}.pt" for s in stems]
    res = {}
    for name in ("npy", "pt", "mixed"):
        assert _centroids(root / name, tmp_path / f"{name}.pt") == 0
        res[name] = DebiasedCentroids.load(tmp_path / f"{name}.pt")
    ref = res["npy"]
    assert ref.num_images == len(stems) and bool(ref.valid.any())
    for name in ("pt", "mixed"):
        assert torch.equal(res[name].centroids, ref.centroids) and torch.equal(res[name].valid, ref.valid)
        assert torch.equal(res[name].num_candidates, ref.num_candidates)
    V = tmp_path / "npy.pt"
    outs = {}
    for name, extra in (("npy", ["--refine", "threshold"]), ("pt", ["--refine", "threshold"]),
                        ("mixed", ["--refine", "threshold"]), ("npy-crf", []), ("pt-crf", []),
                        ("pt-workers", ["--workers", "2", "--batch-size", "3"])):
        assert _debias(root / name.split("-")[0], V, tmp_path / f"db-{name}", extra) == 0
        outs[name] = _labels(tmp_path / f"db-{name}")
    assert list(outs["npy"]) == stems
    assert any(bool((y == 254).any()) for y in outs["npy"].values())
    for a, b in (("pt", "npy"), ("mixed", "npy"), ("pt-crf", "npy-crf"), ("pt-workers", "npy-crf")):
        assert outs[a].keys() == outs[b].keys()
        assert all(torch.equal(outs[a][s], outs[b][s]) for s in stems), (a, b)


def test_both_formats_for_one_stem_is_named(worlds, tmp_path, capsys):
    root, stems = worlds
    d = tmp_path / "w"
    shutil.copytree(root / "mixed", d)
    clash = stems[0]  # .pt in the mixed world
    write_features(d / "features" / f"{clash}.npy", read_features(d / "features" / f"{clash}.pt"))
    capsys.readouterr()
    assert _centroids(d, tmp_path / "V.pt") == 2
    err = capsys.readouterr().err
    assert f"{clash}.npy" in err and f"{clash}.pt" in err and len(err.strip().splitlines()) == 1
    assert _centroids(d, tmp_path / "V.pt", ["--on-error", "skip"]) == 1
    assert DebiasedCentroids.load(tmp_path / "V.pt").num_images == len(stems) - 1


def test_the_common_d_is_probed_from_pt_files(worlds, tmp_path, capsys):
    """In a folder of .pt files only, the D most files have is found from the .pt shapes: the
    odd file is the one named, whatever its place in the order."""
    root, stems = worlds
    d = tmp_path / "w"
    shutil.copytree(root / "pt", d)
    odd = stems[0]  # first in the order: without the probe it would set D for the others
    write_features(d / "features" / f"{odd}.pt", read_features(d / "features" / f"{odd}.pt")[:8])
    capsys.readouterr()
    assert _centroids(d, tmp_path / "V.pt") == 2
    err = capsys.readouterr().err
    want = f"{odd}.pt: features have embedding size D=8, expected D=16 (as most feature files, e.g. {stems[1]}.pt)"
    assert want in err, err


# --------------------------------------------------------------------------------------------
# mars features --format pt
# --------------------------------------------------------------------------------------------


def _images(folder, n=4):
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (20 + 4 * (i % 2), 28, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
    return [f"im{i}" for i in range(n)]


@pytest.fixture(scope="module")
def extractor():
    torch.manual_seed(0)
    return ModelExtractor(nn.Conv2d(3, 5, 3, stride=4, padding=1))


def test_features_job_writes_fp16_tensors_equal_to_the_npy_files(tmp_path, extractor):
    stems = _images(tmp_path / "img")
    s_pt = features_job(extractor, tmp_path / "img", tmp_path / "pt", file_format="pt", progress=False)
    s_np = features_job(extractor, tmp_path / "img", tmp_path / "npy", progress=False)
    assert s_pt.done == s_np.done == len(stems)
    assert sorted(p for p in os.listdir(tmp_path / "pt") if not p.startswith(".mars-run")) == [f"{s}.pt" for s in stems]
    for i, s in enumerate(stems):
        t = torch.load(tmp_path / "pt" / f"{s}.pt", map_location="cpu", weights_only=True)
        assert type(t) is torch.Tensor and t.dtype == torch.float16 and t.is_contiguous()
        assert t.shape == (5, (20 + 4 * (i % 2)) // 4, 7)
        assert np.array_equal(t.numpy(), np.load(tmp_path / "npy" / f"{s}.npy", allow_pickle=False))
    # resume: every output is there
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "pt").iterdir()}
    s = features_job(extractor, tmp_path / "img", tmp_path / "pt", file_format="pt", progress=False)
    assert (s.done, s.existing, s.failed) == (0, len(stems), [])
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "pt").iterdir()}
    os.remove(tmp_path / "pt" / "im2.pt")
    s = features_job(extractor, tmp_path / "img", tmp_path / "pt", file_format="pt", progress=False)
    assert (s.done, s.existing) == (1, len(stems) - 1) and (tmp_path / "pt" / "im2.pt").is_file()
    with pytest.raises(ValueError, match="file_format must be one of"):
        features_job(extractor, tmp_path / "img", tmp_path / "x", file_format="pth", progress=False)


def test_features_job_refuses_the_other_format_of_a_stem(tmp_path, extractor):
    stems = _images(tmp_path / "img")
    out = tmp_path / "f"
    features_job(extractor, tmp_path / "img", out, progress=False)  # .npy
    os.remove(out / "im1.npy")
    with pytest.raises(JobError, match=r"im0: .*im0\.npy already exists.*im0\.pt.*clash"):
        features_job(extractor, tmp_path / "img", out, file_format="pt", progress=False)
    assert not list(out.glob("*.pt"))
    s = features_job(extractor, tmp_path / "img", out, file_format="pt", on_error="skip", progress=False)
    assert s.done == 1 and sorted(st for st, _ in s.failed) == [x for x in stems if x != "im1"]
    assert all("clash" in why for _, why in s.failed)
    assert sorted(p for p in os.listdir(out) if not p.startswith(".mars-run")) == ["im0.npy", "im1.pt", "im2.npy",
                                                                                "im3.npy"]
    # and the other way round: the .pt of im1 blocks a .npy run for it only
    s = features_job(extractor, tmp_path / "img", out, file_format="npy", on_error="skip", progress=False)
    assert (s.done, s.existing, [st for st, _ in s.failed]) == (0, 3, ["im1"])


def test_format_flag():
    import argparse

    p = argparse.ArgumentParser()
    add_features_arguments(p)
    base = ["--uss", "stego", "--checkpoint", "c", "--images", "i", "--out", "o"]
    assert p.parse_args(base).file_format == "npy"
    assert p.parse_args(base + ["--format", "pt"]).file_format == "pt"
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--format", "pth"])
    help_text = build_parser()._subparsers._group_actions[0].choices["features"].format_help()
    assert "--format" in help_text and "<stem>.pt" in help_text


def test_keep_half_keeps_only_half_dtypes(tmp_path):
    """read_features(keep_half=True): float16 (.npy, .pt) and bfloat16 (.pt) come back as
    stored, equal to their float32 widening; other float dtypes are float32 as without it."""
    from mars_plugin.formats.files import read_features

    x = torch.randn(3, 4, 5)
    cases = {"h.npy": x.half().numpy(), "d.npy": x.double().numpy(), "h.pt": x.half(), "b.pt": x.bfloat16(),
             "d.pt": x.double()}
    for name, value in cases.items():
        if name.endswith(".npy"):
            np.save(tmp_path / name, value)
        else:
            torch.save(value, tmp_path / name)
    want = {"h.npy": torch.float16, "d.npy": torch.float32, "h.pt": torch.float16, "b.pt": torch.bfloat16,
            "d.pt": torch.float32}
    for name, dtype in want.items():
        kept, wide = read_features(tmp_path / name, keep_half=True), read_features(tmp_path / name)
        assert kept.dtype == dtype and wide.dtype == torch.float32, name
        assert torch.equal(kept.float(), wide), name
