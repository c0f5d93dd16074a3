"""Issue 41, class 7 (the rest): every setting means what it says, the MARS loss's too.

``mars train --loss ce`` trains plain cross-entropy: no EMA teacher, no CRF complement, no WCE
(``train._build`` builds no hook). The settings only the MARS loss reads (``--refine``,
``--crf-params``, ``--ema``: :data:`~mars_plugin.commands.recipe_uses.LOSS_DEFAULTS`) used to be
dropped without a word: their flags had the paper's values as defaults, so a value given could
not be told from none. Now one given with ``--loss ce`` (and ``--crf-params`` with ``--refine
none``) is refused with one line naming the flag, on the command line (exit 2, nothing
written) and in Python (``TrainSettings``, ``train``); left out, everything is as before
(``--help``, the record, a resume). And a teacher of momentum 1 (``EMATeacher``,
``MARSTrainingHook``), which never moves from its initialisation, is taken with a warning.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

from mars_plugin import cli
from mars_plugin.commands.recipe_uses import LOSS_DEFAULTS, UNUSED
from mars_plugin.commands.train import CHECKPOINT_NAME, train
from mars_plugin.commands.train_settings import TrainSettings
from mars_plugin.networks.seg_checkpoint import load_checkpoint

from test_train import C, _tree

#: a value of each MARS-loss setting, as typed on the command line and as given in Python; the
#: paper's own value typed is a value given too
GIVEN: Dict[str, List[Tuple[str, Any]]] = {
    "refine": [("crf", "crf"), ("none", "none")],
    "crf_params": [("psa", "psa"), ('{"iterations": 3}', {"iterations": 3}), ("mars", "mars")],
    "ema": [("0.5", 0.5), ("0.999", 0.999)],
}
_CASES = [(field, text, value) for field in LOSS_DEFAULTS for text, value in GIVEN[field]]
_IDS = [f"{f}={t}" for f, t, _ in _CASES]
#: what the run does instead, as the refusal says it
_WHY = {"refine": "plain cross-entropy has no teacher", "crf_params": "plain cross-entropy runs no CRF",
        "ema": "plain cross-entropy trains without the EMA teacher"}
#: a tiny, fast run (ResNet-18 DeepLabv3+, one step of 2 crops of 16)
_SMALL = ["--arch", "deeplabv3+", "--backbone", "resnet18", "--output-stride", "16", "--iterations", "1",
          "--batch-size", "2", "--crop", "16", "--min-size", "16", "--max-size", "24", "--workers", "0",
          "--no-progress"]
_SMALL_API = dict(arch="deeplabv3+", backbone="resnet18", output_stride=16, iterations=1, batch_size=2, crop=16,
                  min_size=16, max_size=24, workers=0, progress=False, device="cpu")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("loss_fields"), n=2, size=20)


def _argv(tree: Path, out: Path, *extra: str, loss: str = "ce") -> List[str]:
    labels = tree / ("pseudo" if loss == "ce" else "debiased")
    return ["train", "--images", str(tree / "images"), "--labels", str(labels), "--out", str(out),
            "--num-classes", str(C), "--loss", loss, *_SMALL, *extra]


def test_every_loss_setting_is_probed_and_has_its_row() -> None:
    """The cases below are generated from the table: each setting of the MARS loss has values
    here and a row of ``recipe_uses.UNUSED`` for ``loss="ce"``."""
    assert set(GIVEN) == set(LOSS_DEFAULTS) == {"refine", "crf_params", "ema"}
    for field in LOSS_DEFAULTS:
        assert any(row.field == field and row.by == "with loss='ce'" for row in UNUSED), field


#: the fields of what a run is whose default is a plain value: each read by every run
_ALWAYS_READ = {"recipe": "the recipe every field left out comes from", "loss": "the loss itself",
                "seed": "the initialisation, the data order and the augmentation", "amp": "recorded as used"}


def test_a_setting_with_a_default_value_is_read_by_every_run_or_a_paper_default() -> None:
    """The door: a setting whose default is a value cannot tell a value given from none, so it
    must be one every run reads, or default to a PaperDefault (and have its rows in the table).
    A new MARS-only field with a plain default fails here."""
    import dataclasses

    from mars_plugin.commands.recipe_uses import PaperDefault

    plain = {f.name for f in dataclasses.fields(TrainSettings) if f.init and not f.metadata.get("run")
             and f.default is not None and f.default is not dataclasses.MISSING
             and not isinstance(f.default, PaperDefault)}
    assert plain == set(_ALWAYS_READ)
    paper = {f.name for f in dataclasses.fields(TrainSettings) if isinstance(f.default, PaperDefault)}
    assert paper == set(LOSS_DEFAULTS)
    from mars_plugin.commands.cli_parser import build_parser

    args = build_parser().parse_args(["train", "--images", "i", "--labels", "l", "--out", "o"])
    assert all(getattr(args, k) is LOSS_DEFAULTS[k] for k in LOSS_DEFAULTS)  # the flags' defaults too


@pytest.mark.parametrize("field, text, value", _CASES, ids=_IDS)
def test_a_loss_setting_given_with_ce_is_refused_on_the_command_line(tree, tmp_path, capsys, field, text,
                                                                     value) -> None:
    """``mars train --loss ce --ema 0.5`` trained bit-identically to ``--loss ce``: exit 2, one
    line naming the flag and ``--loss ce``, nothing written."""
    out = tmp_path / "run"
    code = cli.main(_argv(tree, out, _flag(field), text))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(rf"mars train: error: {_flag(field)} is not used with --loss ce \({_WHY[field]}.*\); "
                        "leave it out", err[0]), err[0]
    assert not out.exists()


@pytest.mark.parametrize("field, text, value", _CASES, ids=_IDS)
def test_a_loss_setting_given_with_ce_is_refused_in_python(tree, tmp_path, field, text, value) -> None:
    """The same in Python: the settings record (``mars reproduce --train`` and the API build
    one) and ``train``'s keywords, before anything is written."""
    line = rf"^{field} is not used with loss='ce' \({_WHY[field]}.*\); leave it out$"
    with pytest.raises(ValueError, match=line):
        TrainSettings(num_classes=C, loss="ce", **{field: value})
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=line):
        train(tree / "images", tree / "pseudo", out, C, loss="ce", **_SMALL_API, **{field: value})
    assert not out.exists()


@pytest.mark.parametrize("text, value", GIVEN["crf_params"], ids=[t for t, _ in GIVEN["crf_params"]])
def test_crf_params_without_a_crf_is_refused(tree, tmp_path, capsys, text, value) -> None:
    """``--loss mars --refine none --crf-params psa``: no CRF runs, its parameters were dropped."""
    out = tmp_path / "run"
    code = cli.main(_argv(tree, out, "--refine", "none", "--crf-params", text, loss="mars"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("mars train: error: --crf-params is not used with --refine none (the teacher's labels "
                             "are not refined"), err[0]
    assert not out.exists()
    for refine in ("none", None):
        with pytest.raises(ValueError, match=r"^crf_params is not used with refine='none' \("):
            TrainSettings(num_classes=C, refine=refine, crf_params=value)


def test_none_is_no_value() -> None:
    """None is what a plain-CE run records for these settings (and what its record gives back):
    giving it is giving nothing."""
    for field in LOSS_DEFAULTS:
        s = TrainSettings(num_classes=C, loss="ce", **{field: None})
        assert (s.refine, s.crf_params, s.ema) == (None, None, None)
    assert TrainSettings(num_classes=C, refine=None, crf_params=None).crf_params is None


@pytest.mark.slow
def test_left_out_ce_trains_and_records_what_it_recorded(tree, tmp_path, capsys) -> None:
    """Without these flags ``--loss ce`` trains, and records the same settings as before (a
    folder of an older run resumes: ``open_run`` compares these keys)."""
    out = tmp_path / "run"
    assert cli.main(_argv(tree, out)) == 0, capsys.readouterr().err
    rec = json.loads((out / "train.json").read_text())
    assert (rec["refine"], rec["crf_params"], rec["ema"], rec["loss"]) == (None, None, None, "ce")
    assert rec["overrides"] == ["arch", "backbone", "output_stride", "iterations", "batch_size", "crop", "min_size",
                                "max_size"]
    assert "refine" not in rec["sources"] and "ema" not in rec["sources"]
    s = TrainSettings.from_record(rec)
    assert s == TrainSettings(num_classes=C, loss="ce", amp=False,  # amp as used: the CPU's
                              **{k: v for k, v in _SMALL_API.items() if k not in ("progress", "device", "workers")})
    assert s.replace(loss="mars").ema == 0.999  # left out: the paper's, whatever the loss was
    # the same folder, the same flags: resumed (nothing left to do), not refused as another run
    assert cli.main(_argv(tree, out)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("extra, want", [
    ((), {"refine": "crf", "crf_params": "mars", "ema": 0.999, "overrides": []}),
    (("--ema", "0.5", "--crf-params", "psa"), {"refine": "crf", "crf_params": "psa", "ema": 0.5, "overrides": []}),
    (("--ema", "0.999", "--refine", "crf", "--crf-params", "mars"),
     {"refine": "crf", "crf_params": "mars", "ema": 0.999, "overrides": []}),
    (("--refine", "none"), {"refine": None, "crf_params": None, "ema": 0.999, "overrides": []}),
])
def test_mars_takes_them_as_before(extra, want) -> None:
    """With ``--loss mars`` the flags are read as they always were and recorded the same: the
    record says the values, not whether they were typed (``overrides`` names recipe fields)."""
    from mars_plugin.commands.cli_parser import build_parser

    args = build_parser().parse_args(["train", "--images", "i", "--labels", "l", "--out", "o", *extra])
    s = TrainSettings.from_args(args, C)
    rec = s.record()
    assert {k: rec[k] for k in want} == want
    assert TrainSettings.from_record(rec).record() == rec


@pytest.mark.slow
def test_the_refused_settings_change_nothing_in_a_ce_run(tree, tmp_path, monkeypatch) -> None:
    """Why they are refused: with the check lifted, a plain-CE step given every one of them
    trains bit-identically to one given none (while another seed does not)."""
    import mars_plugin.commands.recipe_uses as uses

    def student(name: str, **fields: Any) -> Dict[str, torch.Tensor]:
        train(tree / "images", tree / "pseudo", tmp_path / name, C, loss="ce", **_SMALL_API, **fields)
        return load_checkpoint(tmp_path / name / CHECKPOINT_NAME)["student"]

    plain = student("plain")
    monkeypatch.setattr(uses, "check_used", lambda s: None)
    given = student("given", refine="crf", crf_params="psa", ema=0.5)
    other_seed = student("seed", seed=1)
    assert plain.keys() == given.keys()
    assert all(torch.equal(plain[k], given[k]) for k in plain)
    assert not all(torch.equal(plain[k], other_seed[k]) for k in plain)


def test_reproduce_train_options_meet_the_same_check(tmp_path) -> None:
    """``mars reproduce --train`` builds its settings from ``train_options`` through the same
    record: a loss setting given with ``loss="ce"`` is refused there too, before any work."""
    from mars_plugin.commands.reproduce_train import train_after_reproduce

    root, out = tmp_path / "root", tmp_path / "out"
    (root / "VOC2012").mkdir(parents=True)
    (out / "debiased").mkdir(parents=True)
    (out / "image_labels.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^ema is not used with loss='ce'"):
        train_after_reproduce(root, out, train_options={"loss": "ce", "ema": 0.5}, progress=False, log=lambda m: None)
    assert not (out / "train").exists()


# ----------------------------------------------------------------------------------------------
# the library's teacher: momentum 1 never moves it (a random initialisation at the start)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))


def _frozen_warnings(make) -> List[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make()
    return [w for w in seen if issubclass(w.category, UserWarning) and "never moves" in str(w.message)]


@pytest.mark.parametrize("momentum, count", [(1.0, 1), (1, 1), (0.999, 0), (0.0, 0)])
def test_a_teacher_of_momentum_1_is_taken_with_one_warning(momentum, count) -> None:
    """EMATeacher and MARSTrainingHook accept momentum 1 (a frozen reference, as test_ema uses
    it) with one UserWarning per construction that says the teacher never moves; none otherwise."""
    from mars_plugin import EMATeacher
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    for make in (lambda: EMATeacher(_net(), momentum=momentum), lambda: MARSTrainingHook(_net(), momentum=momentum)):
        seen = _frozen_warnings(make)
        assert len(seen) == count, [str(w.message) for w in seen]
        if count:
            assert "the paper's momentum is 0.999" in str(seen[0].message)
            assert not seen[0].filename.endswith("ema.py")  # it points at the caller


def test_a_restored_momentum_of_1_warns_too() -> None:
    """A hook restored from a state of momentum 1 freezes its teacher from there on: said once."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    hook = MARSTrainingHook(_net())
    state = dict(hook.state_dict(), momentum=1.0)
    assert len(_frozen_warnings(lambda: hook.load_state_dict(state))) == 1
    assert hook.teacher.momentum == 1.0
    assert _frozen_warnings(lambda: hook.load_state_dict(dict(state, momentum=0.9))) == []
