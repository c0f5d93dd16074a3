"""Issue 22, class 4: every numeric parameter of the commands at its edges.

Command line: each numeric flag of each ``mars`` command, given a value below its range, above
it, or no finite number, stops before any work with exit status 2 and one error line that
names the flag, the value and the range; nothing is written. Python: the functions behind the
flags refuse the same values, naming the parameter (scikit-learn style), before any work.
Also: a 3x3 image, which reads both as (3, H, W) and as (H, W, 3), is refused naming both.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mars_plugin import complement_labels, debias_labels, dense_crf, image_centroids, local_crf, select_centroids
from mars_plugin.commands import centroids, debias, evaluate, report
from mars_plugin.commands.features import features_job
from mars_plugin._checks import check_scales
from mars_plugin.cli import apply_threads, main
from mars_plugin.commands.demo import run_demo
from mars_plugin.commands.reproduce import reproduce

# (command, flag, bad value): below the range, above it, not a finite number.
BAD_FLAGS = [
    ("demo", "--seed", "-1"), ("demo", "--seed", str(2**32)), ("demo", "--seed", "1.5"),
    ("demo", "--num-train", "0"), ("demo", "--num-train", "2001"),
    ("demo", "--num-val", "0"), ("demo", "--num-val", "100000"),
    ("demo", "--size", "8"), ("demo", "--size", "18"), ("demo", "--size", "4096"),
    ("demo", "--epochs", "0"), ("demo", "--epochs", "1001"),
    ("demo", "--threads", "0"), ("demo", "--threads", "1025"),
    ("sample", "--num-images", "0"), ("sample", "--num-images", "2001"),
    ("sample", "--size", "8"), ("sample", "--size", "18"), ("sample", "--seed", "-1"),
    ("sample", "--threads", "0"),
    ("centroids", "--num-classes", "0"), ("centroids", "--num-classes", "254"),
    ("centroids", "--alpha", "0"), ("centroids", "--alpha", "1.5"), ("centroids", "--alpha", "nan"),
    ("centroids", "--k-fg", "0"), ("centroids", "--k-fg", "1001"), ("centroids", "--k-bg", "0"),
    ("centroids", "--k-bg", "100000"), ("centroids", "--seed", "-1"), ("centroids", "--seed", str(2**32)),
    ("centroids", "--batch-size", "0"), ("centroids", "--batch-size", "4097"),
    ("centroids", "--spill-mb", "-1"), ("centroids", "--spill-mb", "inf"), ("centroids", "--spill-mb", "nan"),
    ("centroids", "--ignore-index", "-1"), ("centroids", "--ignore-index", "256"),
    ("centroids", "--ignore-index", "254"),
    ("debias", "--threshold", "-0.1"), ("debias", "--threshold", "1"), ("debias", "--threshold", "nan"),
    ("debias", "--batch-size", "0"), ("debias", "--batch-size", "10000"),
    ("debias", "--workers", "0"), ("debias", "--workers", "257"), ("debias", "--ignore-index", "254"),
    ("debias", "--threads", "0"),
    ("evaluate", "--num-classes", "0"), ("evaluate", "--num-classes", "1000"),
    ("evaluate", "--ignore-index", "300"),
    ("features", "--batch-size", "0"), ("features", "--batch-size", "4097"),
    ("features", "--res", "4"), ("features", "--res", "4096"), ("features", "--res", "big"),
    ("features", "--scales", "0"), ("features", "--scales", "1,nan"), ("features", "--scales", "9"),
    ("features", "--scales", ",".join(["1"] * 17)), ("features", "--stride", "0"),
    ("features", "--stride", "1025"),
    ("report", "--num-examples", "-1"), ("report", "--num-examples", "101"),
    ("report", "--per-class", "-1"), ("report", "--per-class", "11"), ("report", "--ignore-index", "254"),
    ("reproduce", "--scales", "0"), ("reproduce", "--scales", "inf"), ("reproduce", "--alpha", "0"),
    ("reproduce", "--k-fg", "0"), ("reproduce", "--k-bg", "1001"), ("reproduce", "--seed", str(2**32)),
    ("reproduce", "--batch-size", "0"), ("reproduce", "--workers", "0"), ("reproduce", "--num-examples", "101"),
    ("reproduce", "--threads", "0"), ("centroids", "--threads", "0"), ("evaluate", "--threads", "2000"),
    ("features", "--threads", "-3"), ("report", "--threads", "x"),
    ("predict", "--scales", "0"), ("predict", "--scales", "1,nan"), ("predict", "--scales", "9"),
    ("predict", "--scales", ",".join(["1"] * 17)), ("predict", "--class-threshold", "-0.1"),
    ("predict", "--class-threshold", "1.5"), ("predict", "--class-threshold", "nan"),
    ("predict", "--batch-size", "0"), ("predict", "--batch-size", "4097"), ("predict", "--threads", "0"),
    ("predict", "--max-memory", "0"), ("predict", "--max-memory", "nan"), ("train", "--max-memory", "-1"),
    ("debias", "--max-memory", "inf"),
    ("train", "--iterations", "0"), ("train", "--iterations", "10000001"), ("train", "--batch-size", "0"),
    ("train", "--crop", "7"), ("train", "--crop", "4097"), ("train", "--min-size", "7"),
    ("train", "--max-size", "8193"), ("train", "--lr", "0"), ("train", "--lr", "nan"), ("train", "--lr", "11"),
    ("train", "--momentum", "1"), ("train", "--momentum", "-0.1"), ("train", "--weight-decay", "-1"),
    ("train", "--weight-decay", "inf"), ("train", "--ema", "1.5"), ("train", "--ema", "nan"),
    ("train", "--seed", "-1"), ("train", "--workers", "-1"), ("train", "--workers", "257"),
    ("train", "--save-every", "0"), ("train", "--log-every", "0"), ("train", "--num-classes", "254"),
    ("train", "--threads", "0"), ("train", "--output-stride", "12"), ("train", "--output-stride", "32"),
    ("train", "--epochs", "0"), ("train", "--epochs", "100001"), ("train", "--iter-size", "0"),
    ("train", "--iter-size", "1025"), ("train", "--lr-step", "0"),
    ("reproduce", "--iterations", "0"), ("reproduce", "--train-batch-size", "0"), ("reproduce", "--crop", "4"),
    ("reproduce", "--min-size", "0"), ("reproduce", "--max-size", "99999"), ("reproduce", "--lr", "-1"),
    ("reproduce", "--loader-workers", "-1"),
    ("crf", "--batch-size", "0"), ("crf", "--batch-size", "4097"), ("crf", "--workers", "-1"),
    ("crf", "--workers", "257"), ("crf", "--max-memory", "0"), ("crf", "--max-memory", "nan"),
    ("crf", "--threads", "0"),
    ("debias", "--io-workers", "-1"), ("debias", "--io-workers", "257"), ("crf", "--io-workers", "-1"),
    ("crf", "--io-workers", "1.5"), ("predict", "--io-workers", "-1"), ("predict", "--io-workers", "257"),
]


def _argv(cmd, tmp):
    """The command's required flags; every input is missing on purpose: a bad value must stop
    the command before it looks at any of them."""
    t = str(tmp)
    return {
        "demo": ["demo", "--out", f"{t}/out"],
        "sample": ["sample", "--tree", "dhr", "--out", f"{t}/out"],
        "features": ["features", "--uss", "stego", "--checkpoint", f"{t}/none.ckpt", "--images", f"{t}/images",
                     "--out", f"{t}/out"],
        "centroids": ["centroids", "--features", f"{t}/f", "--labels", f"{t}/l", "--num-classes", "6",
                      "--out", f"{t}/out"],
        "debias": ["debias", "--features", f"{t}/f", "--labels", f"{t}/l", "--centroids", f"{t}/V.pt",
                   "--out", f"{t}/out"],
        "evaluate": ["evaluate", "--pred", f"{t}/p", "--gt", f"{t}/g", "--num-classes", "6", "--json", f"{t}/out"],
        "report": ["report", "--labels", f"{t}/l", "--debiased", f"{t}/d", "--images", f"{t}/i", "--out", f"{t}/out"],
        "reproduce": ["reproduce", "--root", f"{t}/root", "--pseudo", f"{t}/p", "--features", f"{t}/f",
                      "--out", f"{t}/out"],
        "predict": ["predict", "--model", f"{t}/m.pt", "--images", f"{t}/i", "--out", f"{t}/out"],
        "train": ["train", "--images", f"{t}/i", "--labels", f"{t}/l", "--out", f"{t}/out"],
        "crf": ["crf", "--probs", f"{t}/p", "--images", f"{t}/i", "--out", f"{t}/out"],
    }[cmd]


@pytest.mark.parametrize("cmd, flag, value", BAD_FLAGS, ids=[f"{c} {f} {v[:12]}" for c, f, v in BAD_FLAGS])
def test_a_flag_out_of_range_stops_before_any_work(cmd, flag, value, tmp_path, capsys, monkeypatch):
    def no_work(*a, **k):  # a value that got through would reach the job: fail loudly
        raise AssertionError("the command started its work")

    for module in (centroids, debias, evaluate, report):  # each job lists its stems first
        monkeypatch.setattr(module, "_stems", no_work)
    with pytest.raises(SystemExit) as e:
        main([*_argv(cmd, tmp_path), f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"mars {cmd}: error: argument {flag}"), line
    shown = value if len(value) < 20 else value[:8]
    assert shown in line or str(float(value)) in line, line  # the value given
    assert any(s in line for s in ("..", "[", "(")), line  # the range expected
    assert not (tmp_path / "out").exists()


def test_every_numeric_flag_is_in_the_family():
    """A numeric flag added later must get a bound and a row above."""
    from mars_plugin.commands.cli_parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "demo" in a.choices)
    covered = {(c, f) for c, f, _ in BAD_FLAGS}
    missing = []
    for cmd, p in sub.choices.items():
        for a in p._actions:
            if a.type in (int, float):
                missing.append((cmd, a.option_strings[0], "plain int/float"))
            elif a.type is not None and getattr(a.type, "__module__", "").endswith("cli_types") \
                    and (cmd, a.option_strings[0]) not in covered:
                missing.append((cmd, a.option_strings[0], "no row"))
    assert not missing, missing


def test_the_edges_themselves_are_accepted():
    from mars_plugin.commands.cli_parser import build_parser

    p = build_parser()
    a = p.parse_args(["centroids", "--features", "f", "--labels", "l", "--num-classes", "253", "--out", "o",
                      "--alpha", "1", "--k-fg", "1000", "--k-bg", "1", "--seed", str(2**32 - 1), "--batch-size",
                      "4096", "--spill-mb", "0", "--ignore-index", "255", "--threads", "1024"])
    assert (a.num_classes, a.alpha, a.k_fg, a.seed, a.spill_mb, a.ignore_index) == (253, 1.0, 1000, 2**32 - 1, 0, 255)
    a = p.parse_args(["debias", "--features", "f", "--labels", "l", "--centroids", "c", "--out", "o",
                      "--threshold", "0", "--workers", "256", "--ignore-index", "0"])
    assert (a.threshold, a.workers, a.ignore_index) == (0.0, 256, 0)
    a = p.parse_args(["demo", "--num-train", "1", "--num-val", "2000", "--size", "16", "--epochs", "1000"])
    assert (a.num_train, a.size, a.epochs) == (1, 16, 1000)
    a = p.parse_args(["features", "--uss", "stego", "--images", "i", "--out", "o", "--res", "8", "--stride",
                      "1024", "--scales", ",".join(["8"] * 16)])
    assert a.res == 8 and a.stride == 1024 and a.scales == (8.0,) * 16
    a = p.parse_args(["report", "--labels", "l", "--debiased", "d", "--images", "i", "--out", "o",
                      "--num-examples", "100", "--per-class", "10"])
    assert (a.num_examples, a.per_class) == (100, 10)


# ---------------------------------------------------------------------------- the Python side

F = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([[0, 0, 1, 1], [0, 2, 1, 1], [0, 2, 2, 1], [0, 0, 2, 255]])


def _job(name, **kw):
    """A folder job on folders that do not exist: the parameter check must come first."""
    def call(tmp):
        t = tmp / "missing"
        if name == "centroids":
            return centroids.centroids_job(t / "f", t / "l", kw.pop("num_classes", 6), tmp / "out.pt", progress=False,
                                           **kw)
        if name == "debias":
            return debias.debias_job(t / "f", t / "l", t / "V.pt", tmp / "out", refine="threshold", progress=False,
                                     **kw)
        if name == "evaluate":
            return evaluate.evaluate_job(t / "p", t / "g", kw.pop("num_classes", 6), progress=False, **kw)
        if name == "report":
            return report.report_job(t / "l", t / "d", t / "i", tmp / "out", progress=False, **kw)
        if name == "features":
            return features_job(lambda x: x, t / "images", tmp / "out", progress=False, **kw)
        if name == "reproduce":
            return reproduce(t / "root", t / "p", tmp / "out", features_dir=t / "f", progress=False, **kw)
        raise AssertionError(name)
    return call


# (case id, call, the parameter named, bad value)
PY_BAD = [
    ("select_centroids", lambda t, v: select_centroids([(F, Y)], 2, seed=v), "seed", -1),
    ("select_centroids", lambda t, v: select_centroids([(F, Y)], 2, seed=v), "seed", 2**32),
    ("select_centroids", lambda t, v: select_centroids([(F, Y)], 2, alpha=v), "alpha", 0.0),
    ("select_centroids", lambda t, v: select_centroids([(F, Y)], 2, spill_mb=v, spill_dir=t), "spill_mb", math.inf),
    ("select_centroids", lambda t, v: select_centroids([(F, Y)], 2, spill_mb=v, spill_dir=t), "spill_mb", math.nan),
    ("image_centroids", lambda t, v: image_centroids(F, Y, seed=v), "seed", -5),
    ("centroids_job", lambda t, v: _job("centroids", k_fg=v)(t), "k_fg", 1001),
    ("centroids_job", lambda t, v: _job("centroids", k_bg=v)(t), "k_bg", 0),
    ("centroids_job", lambda t, v: _job("centroids", seed=v)(t), "seed", 2**40),
    ("centroids_job", lambda t, v: _job("centroids", alpha=v)(t), "alpha", 1.01),
    ("centroids_job", lambda t, v: _job("centroids", batch_size=v)(t), "batch_size", 4097),
    ("centroids_job", lambda t, v: _job("centroids", spill_mb=v)(t), "spill_mb", -1.0),
    ("centroids_job", lambda t, v: _job("centroids", ignore_index=v)(t), "ignore_index", 254),
    ("centroids_job", lambda t, v: _job("centroids", ignore_index=v)(t), "ignore_index", 3),  # a class id
    ("centroids_job", lambda t, v: _job("centroids", ignore_index=v)(t), "ignore_index", 256),
    ("centroids_job", lambda t, v: _job("centroids", num_classes=v)(t), "num_classes", 0),
    ("debias_job", lambda t, v: _job("debias", threshold=v)(t), "threshold", 1.0),
    ("debias_job", lambda t, v: _job("debias", threshold=v)(t), "threshold", -0.5),
    ("debias_job", lambda t, v: _job("debias", workers=v)(t), "workers", 0),
    ("debias_job", lambda t, v: _job("debias", workers=v)(t), "workers", 257),
    ("debias_job", lambda t, v: _job("debias", batch_size=v)(t), "batch_size", 0),
    ("debias_job", lambda t, v: _job("debias", ignore_index=v)(t), "ignore_index", 254),
    ("evaluate_job", lambda t, v: _job("evaluate", ignore_index=v)(t), "ignore_index", 0),
    ("evaluate_job", lambda t, v: _job("evaluate", num_classes=v)(t), "num_classes", 254),
    ("report_job", lambda t, v: _job("report", num_examples=v)(t), "num_examples", 101),
    ("report_job", lambda t, v: _job("report", per_class=v)(t), "per_class", -1),
    ("report_job", lambda t, v: _job("report", ignore_index=v)(t), "ignore_index", 254),
    ("features_job", lambda t, v: _job("features", batch_size=v)(t), "batch_size", 4097),
    ("features_job", lambda t, v: _job("features", stride=v)(t), "stride", 1025),
    ("reproduce", lambda t, v: _job("reproduce", alpha=v)(t), "alpha", 0.0),
    ("reproduce", lambda t, v: _job("reproduce", k_fg=v)(t), "k_fg", 0),
    ("reproduce", lambda t, v: _job("reproduce", seed=v)(t), "seed", -1),
    ("reproduce", lambda t, v: _job("reproduce", workers=v)(t), "workers", 1000),
    ("reproduce", lambda t, v: _job("reproduce", feature_batch_size=v)(t), "feature_batch_size", 0),
    ("reproduce", lambda t, v: _job("reproduce", num_examples=v)(t), "num_examples", 500),
    ("check_scales", lambda t, v: check_scales(v), "scales", (1.0,) * 17),
    ("check_scales", lambda t, v: check_scales(v), "scales", (1.0, 9.0)),
    ("run_demo", lambda t, v: run_demo(t / "out", num_train=v), "num_train", 0),
    ("run_demo", lambda t, v: run_demo(t / "out", size=v), "size", 18),
    ("run_demo", lambda t, v: run_demo(t / "out", size=v), "size", 1024),
    ("run_demo", lambda t, v: run_demo(t / "out", epochs=v), "epochs", 0),
    ("run_demo", lambda t, v: run_demo(t / "out", seed=v), "seed", 2**33),
    ("apply_threads", lambda t, v: apply_threads(v), "threads", 0),
]


@pytest.mark.parametrize("case, call, param, value", PY_BAD,
                         ids=[f"{c}-{p}-{str(v)[:10]}" for c, _, p, v in PY_BAD])
def test_python_parameters_out_of_range_are_refused_naming_them(case, call, param, value, tmp_path):
    with pytest.raises((ValueError, TypeError)) as e:
        call(tmp_path, value)
    msg = str(e.value)
    assert msg.startswith(param) or f" {param} " in msg or f"{param}[" in msg, msg
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()


def test_run_demo_checks_before_it_clears_the_previous_run(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "mars_demo_manifest.json").write_text('{"files": ["metrics.json"]}')
    (out / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match="epochs"):
        run_demo(out, epochs=0)
    assert (out / "metrics.json").exists()


def test_res_above_the_bound_is_refused_by_every_extractor():
    from test_multiscale import stego_parts, tiny_vit

    from mars_plugin.adapters.uss.leopart import LeopartExtractor
    from mars_plugin.adapters.uss.stego import STEGOExtractor

    vit, c1, c2 = stego_parts()
    with pytest.raises(ValueError, match=r"res must be None .*8\.\.2048.*got 4096"):
        STEGOExtractor(vit, c1, c2, res=4096)
    with pytest.raises(ValueError, match=r"res must be None .*up to 2048, got 4096"):
        LeopartExtractor(tiny_vit(8), res=4096)
    assert STEGOExtractor(vit, c1, c2, res=2048).res == 2048


# ---------------------------------------------------------------------------- 3x3 images

P3 = torch.full((2, 3, 3), 0.5, dtype=torch.float64)
IMG3 = torch.randint(0, 256, (3, 3, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

AMBIGUOUS = {
    "dense_crf one image": lambda: dense_crf(P3, IMG3),
    "dense_crf batch": lambda: dense_crf(P3[None], IMG3[None]),
    "dense_crf list": lambda: dense_crf([P3], [IMG3.numpy()]),
    "local_crf": lambda: local_crf(P3[None].float(), IMG3[None]),
    "debias_labels crf": lambda: debias_labels(torch.randn(4, 3, 3), torch.ones(3, 3, dtype=torch.long),
                                               torch.randn(3, 4), [1], image=IMG3),
    "complement_labels crf": lambda: complement_labels(-torch.ones(3, 3, dtype=torch.long), P3.float().softmax(0),
                                                       [1], refine="crf", image=IMG3[None]),
    "complement_labels local_crf": lambda: complement_labels(-torch.ones(3, 3, dtype=torch.long),
                                                             P3.float().softmax(0), [1], refine="local_crf",
                                                             image=IMG3[None]),
}


@pytest.mark.parametrize("case", sorted(AMBIGUOUS))
def test_a_3x3_image_is_refused_naming_both_layouts(case):
    with pytest.raises(ValueError) as e:
        AMBIGUOUS[case]()
    msg = str(e.value)
    assert "ambiguous" in msg and "(3, H, W)" in msg and "(H, W, 3)" in msg, msg


def test_other_sizes_read_the_same_in_both_layouts():
    p = torch.rand(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    p = p / p.sum(0, keepdim=True)
    hwc = torch.randint(0, 256, (3, 4, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(dense_crf(p, hwc), dense_crf(p, hwc.permute(2, 0, 1)))
    torch.testing.assert_close(local_crf(p[None].float(), hwc[None]), local_crf(p[None].float(),
                                                                                hwc.permute(2, 0, 1)[None]))


def test_plots_require_channels_last_and_say_so():
    from mars_plugin.pictures import label_images
    with pytest.raises(ValueError, match=r"channels first\?.*permute\(1, 2, 0\)"):
        label_images.blend(np.zeros((3, 8, 8), np.uint8), np.zeros((8, 8), np.int64))
    with pytest.raises(ValueError, match="at least one pixel"):
        label_images.blend(np.zeros((0, 8, 3), np.uint8), np.zeros((0, 8), np.int64))
