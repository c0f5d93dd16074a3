"""Issue 41, class 9: errors speak the user's language.

On the command line an error names the flag (``--io-workers 2``), never the Python parameter
(``io_workers=2``): :func:`mars_plugin.commands.flag_language.in_flags` rewrites a library
message with the flags of the command that ran (its parser and ``FLAG_KEYWORDS``), so a new flag
needs no list. A value read from a checkpoint says so; a one-line error stays short (a state
dict that does not fit lists a few keys and a count)."""
import argparse
import re
import sys

import pytest
import torch

from mars_plugin import cli
from mars_plugin.commands.command_table import flags_module
from mars_plugin.commands.flag_language import in_flags
from mars_plugin.runs.errors import MAX_LINE, one_line

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_record_bounds import _BASE, _CASES  # noqa: E402 -- the generated (command, flag, bad value) cases


def _run(argv, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _no_python(line, *names):
    """``line`` names none of ``names`` as Python does (``name=``, ``name[``, or bare)."""
    for n in names:
        assert not re.search(rf"(?<![\w-]){re.escape(n)}(=|\[|\b)", line), (n, line)


# --------------------------------------------------------------------------------------------
# the examples, through the command line
# --------------------------------------------------------------------------------------------


def test_io_workers_with_workers_names_both_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, line = _run(["debias", "--features", "f", "--labels", "l", "--centroids", "c.pt", "--out", "o",
                       "--workers", "2", "--io-workers", "2"], capsys)
    assert code == 2 and "--io-workers 2" in line and "--workers" in line, line
    _no_python(line, "io_workers")


def test_min_size_above_max_size_names_the_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "i").mkdir()
    (tmp_path / "l").mkdir()
    code, line = _run(["train", "--images", "i", "--labels", "l", "--out", "o", "--num-classes", "2",
                       "--min-size", "600", "--max-size", "400"], capsys)
    assert code == 2 and "--min-size" in line and "--max-size" in line, line
    _no_python(line, "min_size", "max_size")


def test_write_probs_with_wsss_names_the_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for d in ("c", "i"):
        (tmp_path / d).mkdir()
    code, line = _run(["crf", "--cams", "c", "--images", "i", "--out", "o", "--wsss", "irnet", "--write", "probs"],
                      capsys)
    assert code == 2 and "--write probs" in line and "--wsss irnet" in line, line
    _no_python(line, "write", "wsss")


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_a_files_crf_params_key_names_the_flag(tmp_path, capsys, monkeypatch, on_error):
    """A file's failure (the run stops on it, or lists it skipped) in the flags' words too."""
    import numpy as np
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    for d in ("p", "i"):
        (tmp_path / d).mkdir()
    probs = np.random.default_rng(0).random((3, 16, 16), dtype=np.float32)
    np.save(tmp_path / "p" / "a.npy", probs / probs.sum(0))
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "i" / "a.png")
    code = cli.main(["crf", "--probs", "p", "--images", "i", "--out", "o", "--no-progress", "--on-error", on_error,
                     "--crf-params", '{"bilateral_srgb": 1e-30}'])
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "bilateral_srgb" in x)
    assert code == (2 if on_error == "stop" else 1), err
    start = "mars crf: error: a: " if on_error == "stop" else "a: "
    assert line.strip().startswith(start + '--crf-params "bilateral_srgb"'), line
    _no_python(line, "crf_params")


# the messages the library raises, as the command would print them
def test_bn_sync_on_the_cpu_in_flags():
    msg = "bn='sync' (SyncBatchNorm) runs on CUDA only; on the CPU use bn='train' or 'frozen'"  # train.py
    line = in_flags(msg, "train")
    assert line.startswith("--bn sync (SyncBatchNorm)") and "use --bn train" in line, line
    _no_python(line, "bn")


def test_crf_params_key_in_flags():
    from mars_plugin.engines.crf_memory import check_crf_image

    with pytest.raises(ValueError) as e:
        check_crf_image({"bilateral_srgb": 1e-30}, 64, 64, 3)
    assert "crf_params[" in str(e.value)  # the Python spelling, as a Python caller reads it
    line = in_flags(one_line(e.value), "debias")
    assert '--crf-params "bilateral_srgb"' in line, line
    _no_python(line, "crf_params")


def test_max_bytes_in_flags():
    from mars_plugin.engines.crf_memory import check_crf_image

    with pytest.raises(ValueError) as e:
        check_crf_image("mars", 512, 512, 21, max_bytes=2 ** 20)
    for command in ("debias", "crf", "predict"):
        line = in_flags(one_line(e.value), command)
        assert "--max-memory" in line, line
        _no_python(line, "max_bytes")


def test_flip_false_in_flags():
    msg = "flip: the max of the scales' logits (deeplab-pytorch's MSC) has no flip; use flip=False"
    line = in_flags(msg, "predict")
    assert line.endswith("use --no-flip"), line
    assert in_flags("progress=False", "predict") == "--no-progress"
    assert in_flags("fp16=True", "features") == "--fp16"


# --------------------------------------------------------------------------------------------
# every command: a record's error, as the command line prints it, names the flag
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,flag,keyword,kind,bad", _CASES, ids=[f"{c[0]}{c[1]}" for c in _CASES])
def test_every_record_error_names_its_flag(name, flag, keyword, kind, bad):
    record = flags_module(name).SETTINGS
    for value in bad:
        with pytest.raises((TypeError, ValueError)) as e:
            record(**{**_BASE.get(name, {}), keyword: value})
        line = in_flags(one_line(e.value), name)
        assert flag in line or "--no-" + flag[2:] in line, (flag, value, line)
        assert f"{keyword}=" not in line and ("_" not in keyword or keyword not in line), (keyword, line)


# --------------------------------------------------------------------------------------------
# a value from a checkpoint says so; one line stays short
# --------------------------------------------------------------------------------------------


def _predict_args(model):
    from test_record_bounds import _subparser

    return _subparser("predict").parse_args(["--model", str(model), "--images", "i", "--out", "o"])


def test_a_bad_value_from_the_checkpoint_says_so(tmp_path):
    from mars_plugin.commands.predict_settings import PredictSettings

    args = _predict_args(tmp_path / "ck.pt")
    meta = {"recipe": "dhr", "settings": {"class_threshold": 5.0}}
    with pytest.raises(Exception, match=r"from the checkpoint .*ck\.pt") as e:
        PredictSettings.from_args(args, meta)
    assert "--class-threshold must" not in str(e.value)
    # a flag given wins over the checkpoint: no error
    args.class_threshold = 0.5
    assert PredictSettings.from_args(args, meta).class_threshold == 0.5


def test_weights_that_do_not_fit_list_a_few_keys_and_a_count(tmp_path):
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.seg_checkpoint import model_from_checkpoint, save_checkpoint

    model = {"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 16, "num_classes": 2}
    state = {"renamed." + k: v for k, v in build_model(**model).state_dict().items()}
    save_checkpoint(tmp_path / "ck.pt", {"model": model, "iteration": 1, "student": state})
    with pytest.raises(ValueError) as e:
        model_from_checkpoint(tmp_path / "ck.pt", "student")
    line = one_line(e.value)
    assert len(line) < 1000, len(line)
    assert re.search(r"\d+ missing \(", line) and re.search(r"\d+ unexpected \(", line), line


def test_one_line_is_bounded():
    line = one_line(ValueError("head " + "x" * 10_000 + " the hint"))
    assert len(line) <= MAX_LINE + 60 and line.startswith("head ") and line.endswith(" the hint")
    assert "characters left out" in line
