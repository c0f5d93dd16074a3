"""One run at a time: the lock of a resumable ``mars`` command's output.

Each output (a folder, or ``V.pt``) has a lock file, ``.mars-run.lock``
in the folder (``.V.pt.lock`` beside a centroid file), taken with a POSIX record lock
(``fcntl.lockf``, ``F_SETLK`` on the whole file). Such a lock belongs to the process that took it:
the kernel releases it when that process ends, however it ends, so a lock left by a killed run
never blocks and there is no stale-lock logic; and the processes it forks (the data-loading
workers of ``mars train``) inherit the descriptor but not the lock, so a restart seconds after a
``kill -9`` is not refused while orphaned workers wind down (issue 30; an ``flock`` belongs to the
open file, which the workers share, and was held until the last of them exited). Two rules of
record locks shape this module: a process never conflicts with itself, and closing any
descriptor of the file drops the process's lock. So the locks this process holds are kept in a
registry (a second :class:`RunLock` on one of them is refused without opening the file again),
and nothing else in mars opens a lock file. A second run is refused with one line naming the lock
and the process holding it (pid, host, start time, and whether that pid still runs). The lock
file is removed when the run ends. Under torchrun, rank 0 takes the lock and writes the shared
records; a refusal on rank 0 stops every rank
(:func:`~mars_plugin.runs.distributed.share_error`). On a network file system the lock is as
good as the file system's locking: Linux NFS clients pass record locks to the server (the NLM
protocol, or NFSv4 locks) where other machines see them; a mount with ``nolock`` or
``local_lock=posix``/``all`` (or a cluster file system mounted with local locks only) keeps them on
each machine, and two runs on two machines into one folder are then not detected (a lock held by a
machine that died is the server's to release); where the call fails (``ENOLCK``, not supported)
the run goes on unlocked with a warning on stderr. Holding the lock, a run removes the ``.tmp-*``
files a killed run left in its output folder (the temporary files of atomic writes, only names
``tempfile.mkstemp`` makes).
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from mars_plugin.runs.errors import JobError, one_line

__all__ = [
    "LOCK_NAME",
    "RunLock",
    "remove_stale_tmp",
]

PathLike = Union[str, os.PathLike]

#: The lock file of an output folder (removed when the run ends).
LOCK_NAME = ".mars-run.lock"
#: The names :func:`tempfile.mkstemp` gives the temporary files of atomic writes
#: (:func:`~mars_plugin.formats.files.atomic_write`, ``report_job``): ``.tmp-`` and 8 random characters.
_TMP_NAME = re.compile(r"^\.tmp-[a-z0-9_]{8}(\.[A-Za-z0-9]+)?$")


#: The locks this process holds, by the (device, inode) of their file (see the module docstring:
#: a record lock never conflicts with its own process, and a second descriptor's close would drop it).
_HELD: Dict[Tuple[int, int], "RunLock"] = {}
#: How many times, 0.05 s apart, a refused run tries again while the recorded holder looks gone:
#: the holder died just now, or a new one has locked but not yet written its name.
_RETRIES = 20


def _read_holder(fd: int) -> Optional[Dict[str, Any]]:
    """What the holder wrote into the lock file, or None (it may not have written its name yet)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return info if isinstance(info, dict) and {"pid", "host", "started"} <= set(info) else None
    except Exception:  # noqa: BLE001 -- a file being written, or not a mars lock file
        return None


def _gone(info: Optional[Dict[str, Any]]) -> bool:
    """Whether the recorded holder is a process of this host that no longer runs (or none is recorded)."""
    if info is None:
        return True
    if info["host"] != socket.gethostname():
        return False  # another machine's pid says nothing here
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, OverflowError):
        return False  # alive under another user (EPERM), or not a pid: say what was recorded
    return False


def _describe(info: Optional[Dict[str, Any]]) -> str:
    """Who holds the lock, for the refusal."""
    if info is None:
        return "a process that has not written its name yet"
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
    except (TypeError, ValueError, OverflowError):
        started = "at an unknown time"
    text = f"pid {info['pid']} on host {info['host']}, started {started}, {info.get('command', 'mars')}"
    return text + (", which is no longer running" if _gone(info) else "")


class RunLock:
    """An exclusive POSIX record lock (``fcntl.lockf``) on ``path`` for the length of a run, held
    by this process only, never by the processes it forks (see the module docstring). ``what``
    names the output in messages (``"--out features"``)."""

    #: errno values of a file system that does not support record locks (the run goes on unlocked).
    UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOSYS,
                   errno.EINVAL}

    def __init__(self, path: PathLike, what: str, command: str = "mars"):
        self.path = Path(path)
        self.what = what
        self.command = command
        self.fd: Optional[int] = None
        self.locked = False
        self._key: Optional[Tuple[int, int]] = None
        self._owner: Optional[int] = None

    def _refuse(self, info: Optional[Dict[str, Any]]) -> JobError:
        return JobError(f"{self.what} is in use by another run ({_describe(info)}; lock {self.path}): wait for "
                        "it to end, or stop it")

    def acquire(self) -> "RunLock":
        import fcntl

        while True:
            # Held by this process already (lockf would grant it again): refuse without opening
            # the file, whose second descriptor would drop the lock when closed.
            try:
                st = os.stat(self.path)
                mine = _HELD.get((st.st_dev, st.st_ino))
            except OSError:
                mine = None
            if mine is not None and mine.fd is not None:
                raise self._refuse(_read_holder(mine.fd))
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise JobError(f"{self.what}: cannot create the lock file {self.path} "
                               f"({e.strerror or one_line(e)})") from None
            for attempt in range(_RETRIES + 1):
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        info = _read_holder(fd)
                        if attempt < _RETRIES and _gone(info):
                            time.sleep(0.05)
                            continue
                        os.close(fd)
                        raise self._refuse(info) from None
                    os.close(fd)
                    if e.errno in self.UNSUPPORTED:
                        try:  # a file no one can lock means nothing: leave none behind
                            os.unlink(self.path)
                        except OSError:
                            pass
                        print(f"mars: warning: {self.what}: this file system cannot lock {self.path} "
                              f"({e.strerror}); a second run into it at the same time would not be detected",
                              file=sys.stderr, flush=True)
                        return self
                    raise JobError(f"{self.what}: cannot lock {self.path} ({e.strerror or one_line(e)})") from None
            # The run that held it removes the file when it ends: if it did so between our open
            # and our lock, we locked a file no one else will open. Lock the one on disk.
            try:
                st, fst = os.stat(self.path), os.fstat(fd)
                same = (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd, self.locked, self._owner = fd, True, os.getpid()
        self._key = (fst.st_dev, fst.st_ino)
        _HELD[self._key] = self
        return self

    def release(self) -> None:
        """Remove the lock file, then unlock (in this order: a run that opens the file after
        the removal creates a new one, see :meth:`acquire`). In a forked child, which holds
        no lock, only close its copy of the descriptor."""
        if self.fd is None:
            return
        if self._owner == os.getpid():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        _HELD.pop(self._key, None)
        os.close(self.fd)
        self.fd, self.locked = None, False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def remove_stale_tmp(folder: PathLike) -> List[str]:
    """Remove the ``.tmp-*`` files of atomic writes a killed run left in ``folder`` (only names
    :func:`tempfile.mkstemp` makes; call it only while holding the folder's :class:`RunLock`,
    when no other run can be writing one). Returns the names removed."""
    gone: List[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return gone
    for e in entries:
        if _TMP_NAME.match(e.name) and e.is_file(follow_symlinks=False):
            try:
                os.unlink(e.path)
                gone.append(e.name)
            except OSError:
                pass
    return gone
