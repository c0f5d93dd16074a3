"""What a new user reads in the first hour says what it means (issue 30, class 11): ``--help`` of every
command, the summary ``mars centroids`` prints, the class names ``mars evaluate`` prints."""
from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from mars_plugin.adapters.uss.extractor import USS_NAMES
from mars_plugin.cli import main
from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world


def _commands():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_says_required_and_never_default_none(command, capsys):
    text = _help([command], capsys)
    assert "(default: None)" not in text
    parser = _commands()[command]
    formatter = parser._get_formatter()
    required = [a for a in parser._actions if a.required and a.option_strings]
    for action in required:
        # the help line argparse prints for the flag
        line = formatter._expand_help(action) if action.help else ""
        assert line.endswith("(required)") and "default:" not in line, (action.option_strings, line)
        assert " ".join(line.split()) in text


def test_help_names_every_uss_model_of_the_registry(capsys):
    top = _help([], capsys)
    features = _help(["features"], capsys)
    for name in USS_NAMES.values():
        assert name in top and name in features, name
    for uss in USS_NAMES:
        assert uss in _help(["reproduce"], capsys)  # --uss choices


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    world = make_world(8, size=32, dim=16, seed=3)
    write_world(world, root)
    return root, world


def test_centroids_summary_explains_its_numbers(world_dir, tmp_path, capsys):
    root, world = world_dir
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--alpha", "0.3", "--k-fg", "3", "--out", str(tmp_path / "V.pt"),
                 "--class-names", str(root / "classes.json"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "alpha 0.3" in out and "up to 3 per image" in out and "farthest from" in out
    rows = re.findall(r"\((\w+)\): (\d+) of (\d+) candidate centroids kept", out)
    assert {name for name, _, _ in rows} >= {world.class_names[c] for c in world.problematic}
    for _, kept, found in rows:  # K = ceil(alpha N), as the explanation says
        assert int(kept) == max(1, math.ceil(0.3 * int(found)))


def _evaluate(argv, capsys) -> str:
    assert main(["evaluate", *map(str, argv), "--no-progress"]) == 0
    return capsys.readouterr().out


def test_evaluate_names_the_classes_from_the_json_beside_gt(world_dir, capsys):
    root, world = world_dir
    out = _evaluate(["--pred", root / "labels", "--gt", root / "gt", "--num-classes", "6"], capsys)
    assert all(name in out for name in world.class_names) and "class 1" not in out
    assert f"class names from {(root / 'classes.json').resolve()}" in out


def test_evaluate_names_the_classes_of_dhrs_tree_and_of_wsss(world_dir, tmp_path, capsys):
    root, world = world_dir
    mask = tmp_path / "root" / "SYN" / "train_aug" / "mask"
    mask.mkdir(parents=True)
    for p in (root / "gt").iterdir():
        (mask / p.name).write_bytes(p.read_bytes())
    names = ["background"] + [f"thing{c}" for c in range(1, 7)]
    (tmp_path / "root" / "SYN" / "SYN.json").write_text(json.dumps({"names": names, "ignore": 255}))
    out = _evaluate(["--pred", root / "labels", "--gt", mask, "--num-classes", "6"], capsys)
    assert all(n in out for n in names) and "class 1" not in out
    out = _evaluate(["--pred", root / "labels", "--gt", mask, "--num-classes", "6", "--wsss", "dhr"], capsys)
    assert all(n in out for n in names) and "class names from --wsss dhr" in out
    # VOC's names for SEAM's codebase; --class-names still wins over everything
    out = _evaluate(["--pred", root / "labels", "--gt", root / "gt", "--num-classes", "20", "--wsss", "seam"], capsys)
    assert "aeroplane" in out and "tvmonitor" in out and "class 20" not in out
    out = _evaluate(["--pred", root / "labels", "--gt", mask, "--num-classes", "6", "--wsss", "dhr",
                     "--class-names", root / "classes.json"], capsys)
    assert all(n in out for n in world.class_names) and "thing1" not in out and "class names from" not in out
    # a names file that does not fit --num-classes is not guessed from
    out = _evaluate(["--pred", root / "labels", "--gt", mask, "--num-classes", "7"], capsys)
    assert "class 7" in out and "thing1" not in out
