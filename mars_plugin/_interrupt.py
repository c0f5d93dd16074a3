"""Ctrl-C in the ``mars`` command: one line and status 130, from the first moment on.

:func:`mars_plugin.cli.main` turns a KeyboardInterrupt into the line :func:`interrupt_line` makes
and status 130 (128 + SIGINT). But the console script (``mars = mars_plugin.cli:main``) and
``python -m mars_plugin.cli`` import the package, torch with it, before ``main`` runs: a second or
more in which a Ctrl-C raised KeyboardInterrupt inside some import and printed its traceback
(issue 30). ``mars_plugin/__init__.py`` imports this module first; in the ``mars`` command (the
test of :func:`mars_plugin._wait_policy.is_mars_command`) it installs a SIGINT handler that writes
the same line and ends the process with status 130 at once (nothing has been written yet, no lock
taken), and ``main`` replaces it by the run's (:func:`install`) as it starts. Imported as a
library, it changes nothing. This module imports nothing but the standard library: it runs
before torch.

It is also the one door for stopping on a signal once the command runs (issue 41):

* :func:`install` (``main``'s first step) sets :func:`_on_sigint`, which records the request and
  raises KeyboardInterrupt, as Python's own handler does, except inside :func:`polled`;
* :func:`polled` marks code that calls compiled kernels (numba) and checks :func:`check` between
  their calls: there the handler only records the request. A KeyboardInterrupt raised by a
  handler while numba's dispatcher runs Python code on a kernel's return becomes a
  ``SystemError`` (a traceback, or a file's "failure" that ``--on-error`` and the CRF's retries
  swallowed, so that the run went on: issue 41 saw 5 of 6 Ctrl-C lost);
* :func:`check` raises KeyboardInterrupt once a stop was asked for (a kernel's loop calls it
  between chunks, in any thread);
* worker processes record the request and never raise from the handler (``raise_now=False``):
  their kernels' checks stop them, the parent decides (:mod:`mars_plugin.runs.worker_processes`);
* :func:`wrote` counts the files a run made whole (every folder job records them through
  :class:`~mars_plugin.runs.resume_ledger.ResumeLedger`), :func:`begin` notes the command's
  output and whether it existed, so that :func:`interrupt_line` says what was written: "N files
  written to OUT; run it again to resume", or "nothing was written" (no promise of a resume
  where there is nothing to resume).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, Optional, Sequence

from mars_plugin._wait_policy import is_mars_command

__all__ = ["AFTER_INTERRUPT", "COMMANDS", "RESUMABLE", "begin", "check", "install", "interrupt_line", "polled",
           "requested", "uninstall", "wrote"]

#: The sub-commands of ``mars``.
COMMANDS = ("demo", "centroids", "crf", "debias", "evaluate", "features", "report", "reproduce", "sample", "predict",
            "train")
#: The folder jobs that keep each finished file and resume after it (they count what they write).
RESUMABLE = ("features", "crf", "debias", "reproduce", "predict")
#: What an interrupted command leaves when its output exists (the others write their outputs
#: atomically at the end: nothing).
AFTER_INTERRUPT = {c: "run it again to resume (finished files are kept)" for c in RESUMABLE}
AFTER_INTERRUPT["train"] = "run it again to resume from the last checkpoint"
AFTER_INTERRUPT["demo"] = "run it again to start over"

# The state of this process's run: whether a stop was asked for, how many kernel loops poll it
# (the handler raises only outside them), the files written whole, and the output.
_STOP = threading.Event()
_LOCK = threading.Lock()
_RUN: dict = {"polled": 0, "raise_now": True, "written": 0, "out": None, "existed": False}


def begin(out: Optional[os.PathLike], written: int = 0) -> None:
    """A command starts writing to ``out`` (its ``--out``; None: it writes no folder): noted with
    whether it exists now, for :func:`interrupt_line`."""
    _RUN.update(written=written, out=None if out is None else os.fspath(out),
                existed=out is not None and os.path.exists(out))


def wrote(n: int = 1) -> None:
    """``n`` more output files are written whole (and recorded: a rerun keeps them)."""
    with _LOCK:
        _RUN["written"] += n


def _files(n: int) -> str:
    return f"{n} file{'' if n == 1 else 's'}"


def _after(name: Optional[str]) -> str:
    """What the run left, from what it noted (:func:`begin`, :func:`wrote`)."""
    out, n = _RUN["out"], _RUN["written"]
    if name not in AFTER_INTERRUPT:
        return "nothing was written"
    if name not in RESUMABLE:  # train, demo: their output folder tells
        return "nothing was written" if out is not None and not os.path.exists(out) else AFTER_INTERRUPT[name]
    if n:
        return f"{_files(n)} written{'' if out is None else ' to ' + out}; {AFTER_INTERRUPT[name]}"
    if out is not None and _RUN["existed"] and os.path.exists(out):  # the files of earlier runs are kept
        return f"no file written by this run; {AFTER_INTERRUPT[name]}"
    return "nothing was written"  # no promise of a resume where there is nothing to resume


def interrupt_line(argv: Optional[Sequence[str]] = None, started: bool = True) -> str:
    """The line of an interrupted command (``argv``: its arguments, default ``sys.argv[1:]``);
    ``started=False``: interrupted before it began, when nothing was written."""
    words = list(sys.argv[1:] if argv is None else argv)
    name = next((w for w in words if w in COMMANDS), None)
    after = _after(name) if started else "nothing was written"
    return f"mars{' ' + name if name else ''}: interrupted; {after}"


def _on_sigint(signum: int, frame: Any) -> None:
    """SIGINT once the command runs: the request is recorded; KeyboardInterrupt is raised here
    unless a kernel loop polls it (:func:`polled`) or this is a worker process."""
    _STOP.set()
    if _RUN["raise_now"] and not _RUN["polled"]:
        raise KeyboardInterrupt


def install(raise_now: bool = True) -> Any:
    """This process's SIGINT handler from now on (:func:`_on_sigint`; in the main thread only,
    where Python runs handlers), and a fresh run: no stop asked, nothing written.
    ``raise_now=False`` (a worker process): the handler only records the request. Returns the
    handler to put back (:func:`uninstall`): Python's own where it was :func:`_before_main`."""
    _STOP.clear()
    _RUN.update(raise_now=raise_now, written=0, out=None, existed=False)
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGINT, _on_sigint)
    return signal.default_int_handler if previous is _before_main else previous


def uninstall(previous: Any) -> None:
    """``previous`` (what :func:`install` returned) as the SIGINT handler again: ``main`` called
    in a process that goes on (a test, a notebook) leaves its handler as it was."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous)
    _STOP.clear()


def requested() -> bool:
    """Whether a stop was asked for (SIGINT) in this process."""
    return _STOP.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if a stop was asked for: what a kernel's loop calls between its
    compiled chunks (in any thread; a worker thread's exception reaches the caller through its
    future)."""
    if _STOP.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def polled() -> Iterator[None]:
    """Code that calls compiled kernels and :func:`check` between them: SIGINT only records the
    request while it runs, and the request is raised (KeyboardInterrupt) at the next check or
    on leaving. Used as a library (Python's own handler set), :func:`_on_sigint` stands in for
    the time of the block, so that a Ctrl-C there stops it too, and is forgotten after it."""
    own = threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own:
        _STOP.clear()
        signal.signal(signal.SIGINT, _on_sigint)
    with _LOCK:
        _RUN["polled"] += 1
    try:
        yield
        check()
    finally:
        with _LOCK:
            _RUN["polled"] -= 1
        if own:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _STOP.clear()


def _before_main(signum: int, frame: object) -> None:
    """SIGINT while the command's modules load: the line, then exit 130 at once (os._exit: an
    exception would unwind through half-imported modules, and nothing needs cleaning up yet)."""
    try:
        os.write(2, (interrupt_line(started=False) + "\n").encode())
    finally:
        os._exit(130)


if is_mars_command() and threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _before_main)
