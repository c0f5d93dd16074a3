"""``mars reproduce``'s settings record (:mod:`mars_plugin.commands.reproduce_settings`): every field
checked once, before anything is read or written, naming it; the command line's record equals the
Python API's; the record's identity is what ``reproduce.json`` has always stored, and reads back
equal (a recorded run resumes, another setting is refused)."""
from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from mars_plugin import cli
from mars_plugin.commands import reproduce as reproduce_module
from mars_plugin.commands.reproduce import reproduce
from mars_plugin.commands.reproduce_settings import ReproduceSettings, prepare
from mars_plugin.commands.reproduce_state import _State
from mars_plugin.runs.run_record import settings_diff

PATHS = ("R", "P", "O")

# (field, a bad value, what the message says besides the field's name)
BAD = [
    ("root", 3, "must be a path"),
    ("pseudo_dir", "", "must be a path"),
    ("out_dir", None, "must be a path"),
    ("uss", "bogus", "must be one of stego"),
    ("checkpoint", 1.5, "must be a path"),
    ("backbone", ["b.pth"], "must be a path"),
    ("heads", b"h.pt", "must be a path"),
    ("trust_pickle", "yes", "must be True or False"),
    ("features_dir", 7, "must be a path"),
    ("data", "", "must be a non-empty string"),
    ("domain", 5, "must be a non-empty string"),
    ("scales", [], "must hold at least one scale"),
    ("flip", 1, "must be True or False"),
    ("alpha", 0.0, "must lie in (0.0, 1.0]"),
    ("k_fg", 0, "must be an integer in 1..1000"),
    ("k_bg", -1, "must be an integer in 1..1000"),
    ("seed", -1, "must be an integer in 0..4294967295"),
    ("refine", "bogus", "must be 'crf' or 'threshold'"),
    ("crf_params", "bogus", "is not a preset"),
    ("device", 3, "must be a non-empty string"),
    ("fp16", None, "must be True or False"),
    ("feature_batch_size", 0, "must be an integer in 1..4096"),
    ("batch_size", 0, "must be an integer in 1..4096"),
    ("workers", 0, "must be an integer in 1..256"),
    ("num_examples", -1, "must be an integer in 0..100"),
    ("references", "no", "must be True or False"),
    ("on_error", "bogus", "must be one of ('stop', 'skip')"),
    ("train", {"weigths": "w.pth"}, "has the unknown key 'weigths'"),
]


def test_every_field_has_a_bad_value_below():
    """A field added to the record without a check (and a case here) fails this."""
    assert [f.name for f in fields(ReproduceSettings)] == [name for name, _, _ in BAD]


@pytest.mark.parametrize("name, value, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_named_once_before_anything_is_written(name, value, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(zip(("root", "pseudo_dir", "out_dir"), PATHS), features_dir="F")
    kw[name] = value
    with pytest.raises((ValueError, TypeError)) as e:
        ReproduceSettings(**kw)
    text = str(e.value)
    assert message in text and len(text.splitlines()) == 1
    assert len(re.findall(rf"(?<![\w-]){name}\b", text.replace("--", ""))) == 1, text  # the field, once
    # reproduce() refuses it the same way, before it reads or writes anything (no tree here)
    root, pseudo, out = (kw.pop(k) for k in ("root", "pseudo_dir", "out_dir"))
    with pytest.raises(type(e.value), match=re.escape(text)):
        reproduce(root, pseudo, out, progress=False, log=lambda line: None, **kw)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_keyword_of_reproduce_is_refused():
    with pytest.raises(TypeError, match="alhpa"):
        reproduce("R", "P", "O", features_dir="F", alhpa=0.5)


def test_refine_crf_params_on_error_and_device_are_refused_before_any_stage(tmp_path):
    """Found only by the stage that used them before the record: after the centroids."""
    from test_reproduce import DATA, make_tree

    _, root, pseudo, feats = make_tree(tmp_path, n=3, size=32)
    for kw, message in ((dict(refine="bogus"), "refine must be"), (dict(crf_params="bogus"), "is not a preset"),
                        (dict(on_error="bogus"), "on_error must be"), (dict(device="bogus"), "device must be")):
        out = tmp_path / f"out_{next(iter(kw))}"
        with pytest.raises(ValueError, match=message):
            reproduce(root, pseudo, out, features_dir=feats, data=DATA, progress=False, log=lambda line: None, **kw)
        assert not out.exists()


# --------------------------------------------------------------------------------------------
# the command line's record is the API's
# --------------------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def _captured(monkeypatch, call):
    """The (settings, dry_run, progress) that ``call`` hands to run_reproduce."""
    seen = []

    def fake(settings, *, dry_run=False, progress=True, log=print):
        seen.append((settings, dry_run, progress))
        raise _Stop

    monkeypatch.setattr(reproduce_module, "run_reproduce", fake)
    with pytest.raises(_Stop):
        call()
    return seen[0]


CASES = {
    "defaults": ([], dict(features_dir="F")),
    "every flag": (
        ["--uss", "cause", "--uss-backbone", "b.pth", "--uss-heads", "h.pt", "--trust-pickle", "--data", "COCO2014",
         "--domain", "train", "--scales", "1,0.5", "--no-flip", "--alpha", "0.5", "--k-fg", "3", "--k-bg", "4",
         "--seed", "7", "--refine", "threshold", "--crf-params", '{"iterations": 2}', "--device", "auto", "--fp16",
         "--batch-size", "16", "--workers", "2", "--num-examples", "3", "--no-references", "--on-error", "skip",
         "--dry-run", "--no-progress", "--train", "--weights", "w.pth", "--arch", "deeplabv2", "--train-backbone",
         "resnet50", "--val-domain", "val", "--no-masks"],
        dict(uss="cause", backbone="b.pth", heads="h.pt", trust_pickle=True, data="COCO2014", domain="train",
             scales=[1.0, 0.5], flip=False, alpha=0.5, k_fg=3, k_bg=4, seed=7, refine="threshold",
             crf_params={"iterations": 2}, device="auto", fp16=True, batch_size=16, workers=2, num_examples=3,
             references=False, on_error="skip", dry_run=True, progress=False,
             train=dict(val_domain="val", weights="w.pth", arch="deeplabv2", backbone="resnet50", masks=False)),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_command_line_builds_the_record_the_api_takes(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, kw = CASES[case]
    if "--uss" not in argv:
        argv = argv + ["--features", "F"]
    argv = ["reproduce", "--root", "R", "--pseudo", "P", "--out", "O"] + argv
    from_cli = _captured(monkeypatch, lambda: cli.main(argv))
    from_api = _captured(monkeypatch, lambda: reproduce(*PATHS, log=print, **kw))
    assert from_cli == from_api
    settings, dry_run, progress = from_cli
    assert (dry_run, progress) == (kw.get("dry_run", False), kw.get("progress", True))
    # and the API's keywords, as a record, are that record (Paths as their str)
    record = {k: v for k, v in kw.items() if k not in ("dry_run", "progress")}
    assert settings == ReproduceSettings(Path("R"), Path("P"), "O", **record)
    if case == "every flag":  # no field left at its default: every flag reaches the record
        default = ReproduceSettings("elsewhere", "else", "other")
        same = [f.name for f in fields(settings) if getattr(settings, f.name) == getattr(default, f.name)]
        assert same == ["checkpoint", "features_dir", "feature_batch_size"], same  # flags the CLI does not have


# --------------------------------------------------------------------------------------------
# the identity reproduce.json stores
# --------------------------------------------------------------------------------------------


def _tree(tmp_path):
    from test_reproduce import DATA, _tiny_stego_files, make_tree

    world, root, pseudo, feats = make_tree(tmp_path, n=3, size=32)
    b, h = _tiny_stego_files(tmp_path)
    return DATA, root, pseudo, feats, b, h


def test_the_identity_is_the_record_earlier_runs_wrote(tmp_path):
    """The keys and values reproduce.json has stored since it exists: a run recorded by an
    earlier mars compares equal, and resumes."""
    data, root, pseudo, feats, b, h = _tree(tmp_path)
    given = prepare(ReproduceSettings(root, pseudo, tmp_path / "o", features_dir=feats, data=data))
    assert given.identity == {
        "root": str(root.resolve()), "data": data, "domain": "train_aug", "pseudo": str(pseudo.resolve()),
        "alpha": 0.4, "k_fg": 2, "k_bg": 2, "seed": 0, "refine": "crf", "crf_params": "mars",
        "features": str(feats.resolve())}
    model = prepare(ReproduceSettings(root, pseudo, tmp_path / "o", backbone=b, heads=h, data=data, scales=[1, 2],
                                      refine="threshold", crf_params={"iterations": 2}))
    from mars_plugin.runs.identities import weight_file_id

    assert model.identity == {
        "root": str(root.resolve()), "data": data, "domain": "train_aug", "pseudo": str(pseudo.resolve()),
        "alpha": 0.4, "k_fg": 2, "k_bg": 2, "seed": 0, "refine": "threshold", "crf_params": {"iterations": 2},
        "uss": "stego", "backbone": weight_file_id(b), "heads": weight_file_id(h), "trust_pickle": False,
        "scales": [1.0, 2.0], "flip": True, "fp16": False}
    assert model.feature_settings == {"uss": "stego", "backbone": weight_file_id(b), "heads": weight_file_id(h),
                                      "trust_pickle": False, "scales": [1.0, 2.0], "flip": True, "dhr": True}


@pytest.mark.slow
def test_the_identity_round_trips_through_reproduce_json(tmp_path):
    data, root, pseudo, feats, _, _ = _tree(tmp_path)
    out = tmp_path / "out"
    settings = ReproduceSettings(root, pseudo, out, features_dir=feats, data=data, refine="threshold")
    reproduce_module.run_reproduce(settings, progress=False, log=lambda line: None)
    stored = json.loads((out / "reproduce.json").read_text())["settings"]
    identity = prepare(settings).identity
    assert stored == json.loads(json.dumps(identity)) and settings_diff(stored, identity) == []
    # What changes no output is no part of it: the run resumes with every stage kept.
    other = replace(settings, device="auto", workers=2, batch_size=3, num_examples=1, on_error="skip",
                    train={"masks": False})
    assert prepare(other).identity == identity
    logs = []
    reproduce_module.run_reproduce(other, progress=False, log=logs.append)
    assert [line for line in logs if line.startswith("[") and "kept" not in line] == ["[report] ..."], logs
    # What changes an output is: refused, by name.
    with pytest.raises(ValueError, match=r"other settings \(alpha: 0.4 -> 0.5\)"):
        _State(out / "reproduce.json", prepare(replace(settings, alpha=0.5)).identity)


@pytest.mark.parametrize("flag", ["--data", "--domain", "--device"])
def test_an_empty_name_on_the_command_line_is_one_line_naming_the_flag(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["reproduce", "--root", "R", "--pseudo", "P", "--out", "O", "--features", "F", flag, ""]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mars reproduce: error: {flag} must be a non-empty string, got str ''"
    assert list(tmp_path.iterdir()) == []
