"""A .pt feature file whose tensor is not backed, value by value, by the file (issue 22, class 3):
a stride-0 or overlapping view that declares far more values than it stores (a 1.6 KB file
declaring a 2.6 TB tensor), a meta tensor (a shape without data), a storage smaller than the
tensor it declares. Each is refused by ``read_features`` and ``feature_shape`` with one line
that names the file and what it declares, before any copy; ``mars centroids`` names the file
and ``--on-error skip`` skips it.

Files are made by torch.save where torch can write them, else written here the way torch.save
writes them (``_craft``: its pickle, its zip records) with the numbers changed.
"""
from __future__ import annotations

import collections
import io
import pickle
import re
import resource
import shutil

import pytest
import torch

from mars_plugin import DebiasedCentroids
from mars_plugin.cli import main
from mars_plugin.formats.files import feature_shape, read_features, write_features
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world


class _Storage:
    pass


class _Tensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride), False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _craft(path, *, size, stride, declared_numel, record_bytes, offset=0):
    """A torch.save-format float32 tensor file whose storage declares ``declared_numel`` values
    and whose data record holds ``record_bytes`` bytes."""
    storage = _Storage()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", declared_numel) if obj is storage else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(_Tensor(storage, offset, size, stride))
    w = torch._C.PyTorchFileWriter(str(path))
    w.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
    w.write_record("byteorder", b"little", 6)
    w.write_record("data/0", bytes(record_bytes), record_bytes)
    w.write_end_of_file()


HUGE = (64, 100000, 100000)  # 6.4e11 values: 2.56 TB as float32


def _make(kind, p):
    if kind == "stride-0-expand":
        torch.save(torch.zeros(1).expand(*HUGE), p)
    elif kind == "expand-one-axis":
        torch.save(torch.randn(64, 1, 50).expand(64, 4000, 50), p)  # 51 MB declared, 12.8 KB stored
    elif kind == "overlapping-strides":
        torch.save(torch.zeros(2100).as_strided((64, 1000, 1000), (1, 1, 1)), p)
    elif kind == "huge-over-small-storage":
        torch.save(torch.zeros(200100).as_strided(HUGE, (1, 1, 1)), p)
    elif kind == "meta-tensor":
        torch.save(torch.empty(3, 4, 5, device="meta"), p)
    elif kind == "record-shorter-than-storage":
        _craft(p, size=(3, 4, 5), stride=(20, 5, 1), declared_numel=60, record_bytes=40)
    elif kind == "huge-storage-small-record":
        _craft(p, size=(3, 4, 5), stride=(20, 5, 1), declared_numel=10 ** 12, record_bytes=40)
    elif kind == "storage-smaller-than-shape":
        _craft(p, size=(3, 4, 5), stride=(20, 5, 1), declared_numel=10, record_bytes=40)
    elif kind == "offset-past-storage":
        _craft(p, size=(3, 4, 5), stride=(20, 5, 1), offset=10 ** 12, declared_numel=60, record_bytes=240)
    else:
        raise AssertionError(kind)


# kind -> what the message must say (after the path); the probe (feature_shape) refuses the
# kinds it can see without reading the data.
BAD = {
    "stride-0-expand": (r"declares a torch.float32 tensor of shape \(64, 100000, 100000\) \(2,560,000,000,000 bytes\) "
                        r"over a storage of 4 bytes, with strides \(0, 0, 0\) whose values overlap", True),
    "expand-one-axis": (r"shape \(64, 4000, 50\) \(51,200,000 bytes\) over a storage of 12,800 bytes, with strides "
                        r"\(50, 0, 1\) whose values overlap", True),
    "overlapping-strides": (r"shape \(64, 1000, 1000\) \(256,000,000 bytes\) over a storage of 8,400 bytes, with "
                            r"strides \(1, 1, 1\) whose values overlap", True),
    "huge-over-small-storage": (r"shape \(64, 100000, 100000\) \(2,560,000,000,000 bytes\) over a storage of 800,400 "
                                r"bytes", True),
    "meta-tensor": (r"features must be a CPU tensor whose values are in the file; it holds a meta-device "
                    r"torch.float32 tensor of shape \(3, 4, 5\) \(a meta tensor: a shape without data\)", True),
    "record-shorter-than-storage": (r"its storage record holds 40 bytes where the file declares 240: a truncated or "
                                    r"altered file", False),
    "huge-storage-small-record": (r"its storage record holds 40 bytes where the file declares 4,000,000,000,000",
                                  False),
    "storage-smaller-than-shape": (r"the tensor it declares \(shape, strides, offset\) needs more bytes than its "
                                   r"storage holds", True),
    "offset-past-storage": (r"the tensor it declares \(shape, strides, offset\) needs more bytes than its storage "
                            r"holds", True),
}


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("kind", list(BAD))
def test_a_pt_whose_values_are_not_in_the_file_is_refused_naming_it(tmp_path, kind):
    p = tmp_path / f"stem_{kind}.pt"
    _make(kind, p)
    assert p.stat().st_size < 1 << 20  # small files, all of them
    match, probe = BAD[kind]
    before = _max_rss()
    with pytest.raises(ValueError) as e:
        read_features(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg, msg
    assert re.search(match, msg), msg
    if probe:
        with pytest.raises(ValueError) as e:
            feature_shape(p)
        assert str(e.value) == msg
    # nothing of the declared size was allocated on the way (the process grew by < 64 MB)
    assert _max_rss() - before < 64 << 20


def test_views_that_do_not_overlap_still_read():
    # what torch.save writes for a slice or a permuted view of a bigger tensor: every value once
    import tempfile
    from pathlib import Path

    base = torch.randn(6, 8, 10)
    with tempfile.TemporaryDirectory() as d:
        # (an empty view, e.g. base[:0], is refused as empty features: tests/test_small_edges.py)
        for name, t in (("slice", base[::2]), ("permuted", base.permute(0, 2, 1)), ("channel", base[3:4]),
                        ("offset", base[2:5, 1:7])):
            p = Path(d) / f"{name}.pt"
            torch.save(t, p)
            assert torch.equal(read_features(p), t.float()), name
            assert feature_shape(p) == tuple(t.shape)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ptstorage")
    w = make_world(6, size=24, dim=16, seed=3)
    write_world(w, root / "w")
    for s in w.stems:
        f = root / "w" / "features" / f"{s}.npy"
        write_features(f.with_suffix(".pt"), read_features(f))
        f.unlink()
    return root / "w", w.stems


@pytest.mark.parametrize("kind", ["stride-0-expand", "meta-tensor"])
def test_mars_centroids_names_the_file_and_skip_skips_it(world, tmp_path, capsys, kind):
    src, stems = world
    d = tmp_path / "w"
    shutil.copytree(src, d)
    bad = d / "features" / f"{stems[2]}.pt"
    if kind == "meta-tensor":
        torch.save(torch.empty(16, 24, 24, device="meta"), bad)
    else:
        torch.save(torch.zeros(1).expand(16, 10 ** 5, 10 ** 5), bad)
    args = ["centroids", "--features", str(d / "features"), "--labels", str(d / "labels"), "--num-classes", "6",
            "--out", str(tmp_path / "V.pt"), "--no-progress"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err, err
    assert main(args + ["--on-error", "skip"]) == 1
    assert str(bad) in capsys.readouterr().err
    assert DebiasedCentroids.load(tmp_path / "V.pt").num_images == len(stems) - 1
