"""The ``mars`` commands, one row each (:data:`COMMANDS`): the module declaring its flags next to
its settings (``HELP``, ``DESCRIPTION``, ``add_arguments``), the function running it on the
parsed flags, and how it runs under torchrun. :mod:`mars_plugin.commands.cli_parser` builds the
parser from it, :mod:`mars_plugin.cli` dispatches with it; modules are imported by name, when
they are needed.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Union

__all__ = ["Command", "CommandResult", "COMMANDS", "command", "flags_module"]


@dataclass(frozen=True)
class Command:
    """One ``mars`` command. ``flags``: the module of its flags (``HELP``, ``DESCRIPTION``,
    ``add_arguments(parser)``); ``runner``: ``"module:function"``, the function taking the parsed
    flags and returning a :class:`CommandResult` (or a job summary, or None); ``joins``: whether
    it joins torchrun's process group (``"gloo"``; ``"device"``: nccl when ``--device`` is a GPU);
    ``sharded``: the word a one-process run's line starts with, for the folder jobs that
    torchrun shards file by file (their runner returns the summary and the folder written)."""

    name: str
    flags: str
    runner: str
    joins: Optional[str] = None
    sharded: Optional[str] = None

    def run(self, args: Any) -> "CommandResult":
        """The runner on ``args``, its result as a :class:`CommandResult`."""
        module, function = self.runner.split(":")
        result = CommandResult.of(getattr(importlib.import_module(module), function)(args))
        if self.sharded and result.out is None:
            result.out = args.out
        return result


@dataclass
class CommandResult:
    """What a command's run leaves for :func:`mars_plugin.cli.main`: its job ``summary`` (files
    skipped make the exit status 1), an exit ``status`` that overrides that rule, the folder it
    wrote (``out``, the sharded jobs' line), and ``after``: work to do once the summary is held
    (a failed ``--json`` write still lists the skipped files)."""

    summary: Any = None
    status: Optional[int] = None
    out: Union[None, str, Path] = None
    after: Optional[Callable[[], None]] = None
    #: under torchrun with several ranks: each rank names its skipped files, then all leave
    #: together (torchrun stops every rank as soon as one exits non-zero)
    meet: bool = False

    @classmethod
    def of(cls, value: Any) -> "CommandResult":
        if isinstance(value, CommandResult):
            return value
        if isinstance(value, tuple):  # (summary, folder written)
            return cls(summary=value[0], out=value[1])
        # a job summary (its failed files set the exit status); any other value (mars train's
        # result dict) is for Python callers
        return cls(summary=value if hasattr(value, "failed") else None)


_C = "mars_plugin.commands."
#: Every command, in ``mars --help``'s order.
COMMANDS: Dict[str, Command] = {c.name: c for c in (
    Command("demo", _C + "demo_settings", _C + "demo:run_demo_command"),
    Command("sample", _C + "sample_settings", _C + "sample_trees:run_sample_command"),
    Command("centroids", _C + "centroids_settings", _C + "centroids:run_centroids_command", joins="gloo"),
    Command("debias", _C + "debias_settings", _C + "debias:run_debias_command", joins="gloo"),
    Command("evaluate", _C + "evaluate_settings", _C + "evaluate:run_evaluate_command"),
    Command("features", _C + "features_settings", _C + "features:run_features", joins="gloo",
            sharded="features"),
    Command("report", _C + "report_settings", _C + "report:run_report_command"),
    Command("reproduce", _C + "reproduce_settings", _C + "reproduce_command:run_reproduce_command", joins="gloo"),
    Command("train", _C + "train_settings", _C + "train:run_train_command", joins="device"),
    Command("predict", _C + "predict_settings", _C + "predict:run_predict", joins="gloo", sharded="predictions"),
    Command("crf", _C + "crf_settings", _C + "crf_job:run_crf_command", joins="gloo", sharded="crf"),
)}


def command(name: str) -> Command:
    """The row of the command ``name``."""
    if name not in COMMANDS:
        raise ValueError(f"command must be one of {tuple(COMMANDS)}, got {name!r}")
    return COMMANDS[name]


def flags_module(name: str) -> ModuleType:
    """The module declaring the flags of the command ``name``."""
    return importlib.import_module(command(name).flags)
