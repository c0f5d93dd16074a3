"""Moving an output aside: the one door through which a ``mars`` command takes a file it wrote
out of its output folder, never deleting it and never overwriting another.

Two rules send an output aside (issue 41, classes 5 and 6): the output of an input that is gone
(:meth:`~mars_plugin.runs.run_record.FolderRecord.open`: ``mars features``, ``predict``,
``debias``, ``crf``; ``mars reproduce``'s debiased label of an id it leaves out), and every
output of the earlier run that a ``--restart`` will not write itself (``mars crf``, ``mars
train``). Either way the file leaves the folder, where ``mars evaluate`` would score it and
``mars train`` train on it, and nothing computed is lost.

Each run that moves something gets its own subfolder, ``<folder>/.mars-stale/<UTC time>-<run
id>/`` (``20261205T014215.123456Z-3f9a1c``: the names sort by time, to the microsecond, and a
random id makes two runs of one instant two folders), made on the first move: a file whose input goes away a second time, or a
second restart, never overwrites what an earlier run moved. A move is a rename within the folder
(no copy, the file's bytes and mtime unchanged); a name already in the subfolder is refused, not
replaced. The command's summary names the subfolder (:attr:`OutputAside.where`). Readers never
see it: every folder listing skips names starting with a dot
(:func:`~mars_plugin.formats.files.list_stems`).
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import List, Optional, Union

from mars_plugin.runs.errors import JobError, one_line

__all__ = ["STALE_DIR", "OutputAside"]

PathLike = Union[str, os.PathLike]

#: The folder, inside an output folder, of the outputs moved aside (one subfolder per run).
STALE_DIR = ".mars-stale"
#: How many random run ids a run tries before giving up (a collision of 24 random bits in one second).
_TRIES = 8


class OutputAside:
    """One run's subfolder of ``<folder>/.mars-stale/``, made when :meth:`move` first needs it.

    Args:
        folder: the output folder (``--out``) whose files this run moves aside.
        what: how a message names the folder (``"--out /runs/crf"``).

    Errors: :class:`~mars_plugin.runs.errors.JobError`, one line naming the file and the folder,
    when a file cannot be moved (the run stops before it writes anything that would sit beside
    it)."""

    def __init__(self, folder: PathLike, what: str):
        self.folder = Path(folder)
        self.what = what
        #: the subfolder, once made
        self.path: Optional[Path] = None
        #: the names moved, in order
        self.moved: List[str] = []

    @property
    def where(self) -> str:
        """The subfolder relative to the output folder (``.mars-stale/20261205T014215.123456Z-3f9a1c/``),
        as summaries print it; ``.mars-stale/`` before anything moved."""
        return f"{STALE_DIR}/" + (f"{self.path.name}/" if self.path is not None else "")

    def move(self, name: str) -> None:
        """Move ``<folder>/<name>`` (a file directly in the folder) into this run's subfolder."""
        if self.path is None:
            self.path = self._new_subfolder()
        dst = self.path / name
        # os.rename replaces an existing file on POSIX: a name is checked first (the subfolder is
        # this run's own, made by it, so only this run could have put the name there)
        if os.path.lexists(dst):
            raise JobError(f"{self.what}: cannot move {name} to {self.where}: that folder already holds a {name}")
        try:
            os.rename(self.folder / name, dst)
        except OSError as e:
            raise JobError(f"{self.what}: cannot move {name} to {self.where} ({one_line(e)})") from None
        self.moved.append(name)

    def _new_subfolder(self) -> Path:
        """``.mars-stale/<UTC time>-<run id>/``, made here (never one that exists: mkdir refuses it)."""
        stale = self.folder / STALE_DIR
        try:
            stale.mkdir(exist_ok=True)
        except OSError as e:  # e.g. a file of that name
            raise JobError(f"{self.what}: cannot make {STALE_DIR}/ to move outputs aside ({one_line(e)})") from None
        ns = time.time_ns()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
        for _ in range(_TRIES):
            path = stale / f"{stamp}-{secrets.token_hex(3)}"
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
            except OSError as e:
                raise JobError(f"{self.what}: cannot make {STALE_DIR}/{path.name}/ ({one_line(e)})") from None
        raise JobError(f"{self.what}: no free name in {STALE_DIR}/ for this run after {_TRIES} tries")
