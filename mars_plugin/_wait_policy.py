"""How the ``mars`` command shares the CPU: OpenMP threads that sleep at a barrier, not spin.

torch's CPU operations (and numba's OpenMP kernels) run on a pool of OpenMP threads, and each
parallel operation ends in a barrier. By default GNU OpenMP (libgomp) lets a waiting thread spin
for about 300,000 rounds (a few ms) before it sleeps; on a machine whose cores also run other
processes, a spinning thread takes the time slice its own team's late thread needs, so every
barrier waits for the scheduler: with other processes keeping 2 cores at a load of 2-3, the
torch dense CRF ran 5-9x slower than pydensecrf and ``mars demo`` took 6-8 minutes instead of
35-50 s (issue 24). With
``OMP_WAIT_POLICY=PASSIVE`` the threads sleep at once (see docs/decisions.md for the numbers).

libgomp reads the variable once, when torch loads it, so it has to be in the environment
before ``import torch``. ``mars_plugin/__init__.py`` imports this module before anything else,
and importing it calls :func:`command_line_default`: in the ``mars`` command (the console
script, ``python -m mars_plugin.cli``, each rank under torchrun) it sets
``OMP_WAIT_POLICY=PASSIVE`` unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``; the
worker processes of ``--workers`` inherit it.
Imported as a library, mars_plugin changes nothing; the same effect is one line before torch
is imported (README, "Sharing the CPU")::

    import os; os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

This module imports nothing but the standard library: it runs before torch.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

#: The variables that decide how libgomp's threads wait; a user who set either keeps it.
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: The module whose ``python -m`` runs the mars command.
_COMMAND_MODULES = ("mars_plugin.cli",)


def _command_line() -> Sequence[str]:
    """This process's command line as the interpreter got it (``sys.orig_argv``, Python 3.10+;
    /proc/self/cmdline on Linux before that)."""
    orig = getattr(sys, "orig_argv", None)
    if orig is not None:
        return list(orig)
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def is_mars_command(argv: Optional[Sequence[str]] = None, command_line: Optional[Sequence[str]] = None) -> bool:
    """Whether this process runs the ``mars`` command: the console script (``sys.argv[0]``
    named ``mars``) or ``python [options] -m mars_plugin.cli`` (as torchrun starts each rank)."""
    argv = sys.argv if argv is None else argv
    name = argv[0].replace("\\", "/").rsplit("/", 1)[-1] if argv else ""  # either separator (Windows)
    if os.path.splitext(name)[0] in ("mars", "mars-script"):
        return True
    line = _command_line() if command_line is None else list(command_line)
    i = 1
    while i < len(line):  # the interpreter's options, up to the script, -c or -m
        a = line[i]
        if a == "-m":
            return i + 1 < len(line) and line[i + 1] in _COMMAND_MODULES
        if a.startswith("-m"):
            return a[2:] in _COMMAND_MODULES
        if a in ("-c", "-") or not a.startswith("-"):
            return False  # a script, -c or stdin: not the mars command
        i += 2 if a in ("-W", "-X") else 1  # options with a separate argument
    return False


def command_line_default(argv: Optional[Sequence[str]] = None, command_line: Optional[Sequence[str]] = None) -> bool:
    """In the ``mars`` command, set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``. Returns whether it set it. Effective only when
    called before torch (libgomp) is loaded."""
    if any(v in os.environ for v in USER_VARIABLES) or not is_mars_command(argv, command_line):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


command_line_default()
