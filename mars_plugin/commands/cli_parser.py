"""The ``mars`` command line's parser (:func:`build_parser`): one subparser per row of
:data:`~mars_plugin.commands.command_table.COMMANDS`, its flags declared by the command next to
its settings (``<command>_settings.py``: ``HELP``, ``DESCRIPTION``, ``add_arguments``), plus
``--threads``.

Every flag states its default in ``--help`` (:class:`~mars_plugin.commands.cli_flags.HelpFormatter`);
numeric flags are parsed and bounded by :mod:`mars_plugin.commands.cli_types`. :mod:`mars_plugin.cli`
parses with it and dispatches.
"""
from __future__ import annotations

import argparse

from mars_plugin.commands.cli_flags import HelpFormatter, add_threads
from mars_plugin.commands.command_table import COMMANDS, flags_module

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``mars`` parser: ``--version`` and every command of the table, with its flags."""
    from mars_plugin import __version__

    ap = argparse.ArgumentParser(
        prog="mars",
        description="MARS: model-agnostic biased object removal for weakly-supervised semantic segmentation.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"mars {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        flags = flags_module(name)
        p = sub.add_parser(name, formatter_class=HelpFormatter, help=flags.HELP, description=flags.DESCRIPTION)
        flags.add_arguments(p)
        add_threads(p)
    return ap
