"""Every command's flags and Python keywords come from one settings record (issue 33): the
command line builds the record (``SETTINGS.from_args``) and the Python function takes its
fields as keywords (or the record as ``settings=``), so a flag and a keyword cannot drift apart.

Each command's flags module (``<command>_settings.py``, :data:`COMMANDS`) declares ``SETTINGS``
(a frozen dataclass), ``API`` (``"module:function"``, the Python entry point), and where a flag
and its keyword differ: ``FLAG_KEYWORDS`` (dest -> keyword), ``CLI_ONLY`` (dest -> why no
keyword takes it) and ``PYTHON_ONLY`` (keyword -> why no flag sets it)."""
import argparse
import dataclasses
import importlib
import inspect

import pytest

from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.commands.command_table import COMMANDS, flags_module

#: the flags every command has that are not the command's settings (cli.main applies them)
_EVERY = {"help", "threads"}
#: what from_args needs beyond the flags (train: the class count, resolved from the files)
_EXTRA = {"train": {"num_classes": 3}}


class _Reads(argparse.Namespace):
    """A namespace that remembers which attributes were read."""

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__").setdefault("_read", set()).add(name)
        return object.__getattribute__(self, name)


def _subparser(name):
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _minimal_argv(name):
    """The command with each required flag given a valid value."""
    argv = [name]
    for a in _subparser(name)._actions:
        if a.required and a.option_strings:
            argv += [a.option_strings[0], str(a.choices[0]) if a.choices else "2"]
    return argv


def _dests(name):
    return {a.dest for a in _subparser(name)._actions} - _EVERY


def _api(flags):
    module, function = flags.API.split(":")
    return getattr(importlib.import_module(module), function)


def _keywords(flags):
    """The Python entry point's keywords, with the record's fields where it takes ``settings``."""
    params = inspect.signature(_api(flags)).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"settings"}
    if "settings" in params:
        names |= {f.name for f in dataclasses.fields(flags.SETTINGS) if f.init}
    return names


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_settings_record_is_a_frozen_dataclass(name):
    cls = flags_module(name).SETTINGS
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
    assert callable(getattr(cls, "from_args", None)), f"{name}: SETTINGS.from_args"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_sets_a_keyword(name):
    """Each flag is a keyword of the Python entry point (or a field of its record), under its own
    name or the one FLAG_KEYWORDS gives, or is declared CLI_ONLY with a reason."""
    flags = flags_module(name)
    rename, cli_only = getattr(flags, "FLAG_KEYWORDS", {}), getattr(flags, "CLI_ONLY", {})
    keywords = _keywords(flags)
    stray = sorted(d for d in _dests(name) if d not in cli_only and rename.get(d, d) not in keywords)
    assert not stray, f"mars {name}: flags with no keyword: {stray}"
    assert all(isinstance(why, str) and why for why in cli_only.values())
    assert set(rename) | set(cli_only) <= _dests(name), "declared for flags that do not exist"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_keyword_has_a_flag(name):
    flags = flags_module(name)
    rename, python_only = getattr(flags, "FLAG_KEYWORDS", {}), getattr(flags, "PYTHON_ONLY", {})
    set_by_flags = {rename.get(d, d) for d in _dests(name)}
    stray = sorted(k for k in _keywords(flags) if k not in set_by_flags and k not in python_only)
    assert not stray, f"{flags.API}: keywords no flag sets: {stray}"
    assert all(isinstance(why, str) and why for why in python_only.values())
    assert set(python_only) <= _keywords(flags), "declared for keywords that do not exist"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_from_args_reads_the_flags_of_its_fields(name):
    """The command line builds the record from the flags: every field a flag sets is read."""
    flags = flags_module(name)
    rename = getattr(flags, "FLAG_KEYWORDS", {})
    ns = build_parser().parse_args(_minimal_argv(name), namespace=_Reads())
    ns.__dict__["_read"] = set()
    flags.SETTINGS.from_args(ns, **_EXTRA.get(name, {}))
    read = ns.__dict__["_read"]
    fields = {f.name for f in dataclasses.fields(flags.SETTINGS) if f.init}
    unread = sorted(d for d in _dests(name) if rename.get(d, d) in fields and d not in read
                    and d not in _EXTRA.get(name, {}))
    assert not unread, f"mars {name}: SETTINGS.from_args leaves the flags {unread}"


def test_a_flag_left_unread_is_caught():
    """The check above fails for a from_args that forgets a flag."""
    flags = flags_module("crf")
    ns = build_parser().parse_args(_minimal_argv("crf"), namespace=_Reads())
    ns.__dict__["_read"] = set()
    flags.SETTINGS.from_args(ns)
    read = ns.__dict__["_read"]
    assert "batch_size" in read and "write" in read
    ns2 = build_parser().parse_args(_minimal_argv("crf"), namespace=_Reads())
    ns2.__dict__["_read"] = set()
    getattr(ns2, "write")
    assert "batch_size" not in ns2.__dict__["_read"]


def test_an_unknown_command_is_refused_by_name():
    from mars_plugin.commands.command_table import command

    with pytest.raises(ValueError, match=r"command must be one of \('demo', .*\), got 'nope'"):
        command("nope")
    assert command("crf").sharded == "crf" and flags_module("crf").SETTINGS.__name__ == "CrfSettings"
