"""Ctrl-C in the ``mars`` command: one line and status 130, from the first moment on.

:func:`mars_plugin.cli.main` turns a KeyboardInterrupt into the line :func:`interrupt_line` makes
and status 130 (128 + SIGINT). But the console script (``mars = mars_plugin.cli:main``) and
``python -m mars_plugin.cli`` import the package, torch with it, before ``main`` runs: a second or
more in which a Ctrl-C raised KeyboardInterrupt inside some import and printed its traceback
(issue 30). ``mars_plugin/__init__.py`` imports this module first; in the ``mars`` command (the
test of :func:`mars_plugin._wait_policy.is_mars_command`) it installs a SIGINT handler that writes
the same line and ends the process with status 130 at once (nothing has been written yet, no lock
taken), and ``main`` puts Python's own handler back (:func:`restore`) as it starts. Imported as
a library, it changes nothing. This module imports nothing but the standard library: it runs
before torch.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional, Sequence

from mars_plugin._wait_policy import is_mars_command

__all__ = ["AFTER_INTERRUPT", "COMMANDS", "interrupt_line", "restore"]

#: The sub-commands of ``mars``.
COMMANDS = ("demo", "centroids", "debias", "evaluate", "features", "report", "reproduce", "sample", "predict",
            "train")
#: What an interrupted command leaves (the others write their outputs atomically at the end).
AFTER_INTERRUPT = {c: "run it again to resume (finished files are kept)" for c in ("features", "debias", "reproduce",
                                                                                   "predict")}
AFTER_INTERRUPT["train"] = "run it again to resume from the last checkpoint"
AFTER_INTERRUPT["demo"] = "run it again to start over"


def interrupt_line(argv: Optional[Sequence[str]] = None, started: bool = True) -> str:
    """The line of an interrupted command (``argv``: its arguments, default ``sys.argv[1:]``);
    ``started=False``: interrupted before it began, when nothing was written."""
    words = list(sys.argv[1:] if argv is None else argv)
    name = next((w for w in words if w in COMMANDS), None)
    after = AFTER_INTERRUPT.get(name, "nothing was written") if started else "nothing was written"
    return f"mars{' ' + name if name else ''}: interrupted; {after}"


def _before_main(signum: int, frame: object) -> None:
    """SIGINT while the command's modules load: the line, then exit 130 at once (os._exit: an
    exception would unwind through half-imported modules, and nothing needs cleaning up yet)."""
    try:
        os.write(2, (interrupt_line(started=False) + "\n").encode())
    finally:
        os._exit(130)


def restore() -> None:
    """Python's own SIGINT handler again (KeyboardInterrupt), where :func:`_before_main` is set."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _before_main:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if is_mars_command() and threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _before_main)
