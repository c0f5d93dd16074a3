"""Issue 41, class 8: a setting is checked where its record is made, with the flag's bounds.

Every command's settings record (``<command>_settings.py``: ``SETTINGS``) refuses at
construction, with a ``TypeError``/``ValueError`` naming the field, each value its flag refuses:
the tests below are generated from the parser, one per (command, flag whose keyword is a field
of the record), so that a new flag or field is covered without a new test. Bounded flags
(:func:`mars_plugin.commands.cli_types.int_in` / ``real_in``) are tried just past each bound and
with a wrong type; flags with choices with a value outside them; switches with a non-bool.
``settings=`` takes only the command's own record; the pydensecrf drop-in's ``inference(n)``
refuses at once an ``n`` pydensecrf cannot take."""
import argparse
import dataclasses
import math
import time

import numpy as np
import pytest

from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.commands.command_table import COMMANDS, flags_module

#: the arguments each record needs besides the one tried
_BASE = {"centroids": {"num_classes": 2}, "evaluate": {"num_classes": 2}, "train": {"num_classes": 2},
         "sample": {"tree": "dhr"}, "reproduce": {"root": "r", "pseudo_dir": "p", "out_dir": "o"}}


def _subparser(name):
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _fields(record):
    return {f.name for f in dataclasses.fields(record) if f.init}


def _cases():
    """(command, flag, keyword, kind, bad values) for each flag whose keyword is a record field."""
    out = []
    for name in COMMANDS:
        flags = flags_module(name)
        fields = _fields(flags.SETTINGS)
        for a in _subparser(name)._actions:
            if not a.option_strings or a.dest in ("help", "threads"):
                continue
            renames = getattr(flags, "FLAG_KEYWORDS", {})
            keyword = renames.get(a.dest, a.dest)
            if keyword not in fields or list(renames.values()).count(keyword) > 1:
                continue  # fmt, made of --wsss, --dataset and --trust-pickle: tried below
            flag = a.option_strings[0]
            if keyword == "max_bytes":  # GiB on the command line, bytes in Python: (0, 2**50] bytes
                out.append((name, flag, keyword, "bytes", [-1, 0, "6GB", True, math.nan, 2 ** 51]))
                continue
            if hasattr(a.type, "check"):
                low, high = a.type.bounds
                is_int = isinstance(low, int) and not isinstance(low, float)
                bad = [low - 1, "1", True] + ([high + 1] if high != math.inf else [math.inf, math.nan])
                if not is_int:
                    bad.append(math.nan)
                out.append((name, flag, keyword, "bounded", bad))
            elif a.choices:
                out.append((name, flag, keyword, "choices", ["no-such-choice", 3]))
            elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                argparse.BooleanOptionalAction)):
                out.append((name, flag, keyword, "switch", ["no", 0.5]))
    return out


_CASES = _cases()


def test_the_cases_cover_every_command_with_a_record():
    assert {c[0] for c in _CASES} == set(COMMANDS)
    assert len(_CASES) > 60
    assert len({(c[0], c[1]) for c in _CASES}) == len(_CASES)


@pytest.mark.parametrize("name,flag,keyword,kind,bad", _CASES, ids=[f"{c[0]}{c[1]}" for c in _CASES])
def test_record_refuses_what_the_flag_refuses(name, flag, keyword, kind, bad):
    record = flags_module(name).SETTINGS
    parser = _subparser(name)
    action = next(a for a in parser._actions if flag in a.option_strings)
    for value in bad:
        with pytest.raises((TypeError, ValueError)) as e:
            record(**{**_BASE.get(name, {}), keyword: value})
        assert keyword in str(e.value), (flag, value, str(e.value))
        if kind == "bounded" and not isinstance(value, bool) and not (isinstance(value, str)):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(repr(value) if isinstance(value, float) else str(value))


def test_bounded_flags_accept_their_bounds_in_python():
    """The edges the flag takes, the record takes (the bounds are one declaration)."""
    for name, flag, keyword, kind, _ in _CASES:
        if kind != "bounded":
            continue
        action = next(a for a in _subparser(name)._actions if flag in a.option_strings)
        for edge in action.type.bounds:
            try:
                text = action.type(str(edge))
            except argparse.ArgumentTypeError:
                continue  # an open end
            if keyword == "max_bytes":
                continue  # GiB on the command line, bytes in Python
            try:
                flags_module(name).SETTINGS(**{**_BASE.get(name, {}), keyword: text})
            except (TypeError, ValueError) as e:
                # refused by a rule between fields (min_size <= max_size, ...), never by the bound
                assert "must be an integer in" not in str(e) and "finite number in" not in str(e), (name, flag, e)


# --------------------------------------------------------------------------------------------
# the examples
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("iter_size", 10 ** 9), ("crop", 10 ** 6), ("lr_step", 10 ** 12)])
def test_train_settings_take_the_flags_bounds(field, value):
    from mars_plugin.commands.train_settings import TrainSettings

    with pytest.raises(ValueError, match=field):
        TrainSettings(num_classes=2, **{field: value})


@pytest.mark.parametrize("field,value,error", [
    ("fmt", "irnet", TypeError), ("fmt", {"name": "irnet"}, TypeError), ("max_bytes", "6GB", TypeError), ("max_bytes", -1, ValueError),
    ("max_bytes", 0, ValueError), ("progress", "no", TypeError), ("max_bytes", True, TypeError)])
def test_debias_settings_refuse_at_construction(field, value, error):
    from mars_plugin.commands.debias_settings import DebiasSettings

    with pytest.raises(error, match=field):
        DebiasSettings(**{field: value})


def _jobs():
    from mars_plugin.commands.centroids import centroids_job
    from mars_plugin.commands.crf_job import crf_job
    from mars_plugin.commands.debias import debias_job
    from mars_plugin.commands.evaluate import evaluate_job
    from mars_plugin.commands.report import report_job
    from mars_plugin.commands.train import train

    return [(centroids_job, "CentroidsSettings"), (crf_job, "CrfSettings"), (debias_job, "DebiasSettings"),
            (evaluate_job, "EvaluateSettings"), (report_job, "ReportSettings"), (train, "TrainSettings")]


@pytest.mark.parametrize("wrong", ["other", "dict", "str"])
def test_settings_takes_only_its_own_record(tmp_path, wrong):
    from mars_plugin.commands.evaluate_settings import EvaluateSettings
    from mars_plugin.commands.report_settings import ReportSettings

    for job, record_name in _jobs():
        other = ReportSettings() if record_name != "ReportSettings" else EvaluateSettings(num_classes=2)
        value = {"other": other, "dict": {"batch_size": 2}, "str": "fast"}[wrong]
        with pytest.raises(TypeError, match=rf"settings=.*{record_name}") as e:
            _call(job, tmp_path, value)
        assert type(value).__name__ in str(e.value)
        assert not any(tmp_path.joinpath("out").glob("*")), job.__name__  # nothing written


def _call(job, tmp_path, settings):
    """``job`` on folders that hold nothing, with ``settings``: the check comes first."""
    import inspect

    params = inspect.signature(job).parameters
    args = {}
    for p in params.values():
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            args[p.name] = tmp_path / p.name
    return job(**args, settings=settings)


@pytest.mark.parametrize("settings", ["fast", 3, ["model"]])
def test_features_job_settings_must_be_its_record_or_a_mapping(tmp_path, settings):
    from mars_plugin.commands.features import features_job

    (tmp_path / "images").mkdir()
    with pytest.raises(TypeError, match=r"features_job\(settings=\.\.\.\) takes a FeaturesSettings"):
        features_job(object(), tmp_path / "images", tmp_path / "out", settings=settings)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# the pydensecrf drop-in
# --------------------------------------------------------------------------------------------


def _dropin():
    from mars_plugin.densecrf import DenseCRF2D

    d = DenseCRF2D(8, 8, 3)
    d.setUnaryEnergy(np.ones((3, 64), np.float32))
    return d


# what pydensecrf 1.0rc3's inference(int n) raises (measured: OverflowError "value too large to
# convert to int" past a C int, TypeError "an integer is required" for a string)
@pytest.mark.parametrize("n,error", [(2 ** 40, OverflowError), (2 ** 31, OverflowError),
                                     (-2 ** 40, OverflowError), ("5", TypeError), (None, TypeError)])
def test_dropin_inference_refuses_at_once(n, error):
    d = _dropin()
    start = time.monotonic()
    with pytest.raises(error, match="niter"):
        d.inference(n)
    assert time.monotonic() - start < 5.0  # generous: the point is "at once, not for minutes"


@pytest.mark.parametrize("n", [-1, 0, 1, 1.5, True, np.int64(2)])
def test_dropin_inference_takes_what_pydensecrf_takes(n):
    """pydensecrf runs these (0 or less: no step; 1.5: one): so does the drop-in."""
    assert np.asarray(_dropin().inference(n)).shape == (3, 64)


# --------------------------------------------------------------------------------------------
# the doors are used: a record or a job that bypasses them fails here
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_record_goes_through_the_flags_door(name):
    """Each record's ``__post_init__`` calls ``cli_types.check_fields`` with its command's flags."""
    import inspect

    source = inspect.getsource(flags_module(name).SETTINGS.__post_init__)
    assert "T.check_fields(self, add_arguments" in source, name


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_job_taking_settings_goes_through_its_door(name):
    """Each Python entry point with ``settings=`` checks it with ``job_settings.own_record``."""
    import importlib
    import inspect

    module, function = flags_module(name).API.split(":")
    job = getattr(importlib.import_module(module), function)
    p = inspect.signature(job).parameters.get("settings")
    if p is None or p.kind == p.VAR_KEYWORD:  # reproduce(**settings): the record's keywords
        pytest.skip(f"{function} takes no settings=")
    source = inspect.getsource(importlib.import_module(module))
    assert "own_record(" in source, (name, module)
