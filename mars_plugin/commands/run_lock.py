"""One run at a time: the lock of a resumable ``mars`` command's output.

Each output (a folder, or ``V.pt``) has a lock file, ``.mars-run.lock``
in the folder (``.V.pt.lock`` beside a centroid file), taken with ``fcntl.flock``: the kernel
releases it when the process ends, however it ends, so a lock left by a killed run never blocks
and there is no stale-lock logic. A second run is refused with one line naming the lock and the
process holding it (pid, host, start time). The lock file is removed when the run ends. Under
torchrun, rank 0 takes the lock and writes the shared records; a refusal on rank 0 stops every
rank (:func:`~mars_plugin.commands.distributed.share_error`). On a network file system the lock is as good as
the file system's locking: Linux NFS clients pass ``flock`` to the server as a whole-file lock
that other machines see; a mount with ``nolock`` or ``local_lock=flock`` (or a cluster file
system mounted with local locks only) keeps it on each machine, and two runs on two machines
into one folder are then not detected (a lock held by a machine that died is the server's to
release); where the call fails (``ENOLCK``, not supported) the run goes on unlocked with a
warning on stderr. Holding the lock, a run removes the ``.tmp-*`` files a killed run left in its
output folder (the temporary files of atomic writes, only names ``tempfile.mkstemp`` makes).
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
from typing import Any, List, Optional, Union

from mars_plugin.commands.errors import JobError, one_line

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


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {info['pid']} on host {info['host']}, started {started}, {info.get('command', 'mars')}"
    except Exception:  # noqa: BLE001 -- the holder may not have written its name yet
        return "a process that has not written its name yet"


class RunLock:
    """An exclusive ``fcntl.flock`` on ``path`` for the length of a run (see the module
    docstring). ``what`` names the output in messages (``"--out features"``)."""

    #: errno values of a file system that does not support flock (the run goes on unlocked).
    UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOSYS,
                   errno.EINVAL}

    def __init__(self, path: PathLike, what: str, command: str = "mars"):
        self.path = Path(path)
        self.what = what
        self.command = command
        self.fd: Optional[int] = None
        self.locked = False

    def acquire(self) -> "RunLock":
        import fcntl

        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise JobError(f"{self.what}: cannot create the lock file {self.path} "
                               f"({e.strerror or one_line(e)})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = _holder(fd)
                    os.close(fd)
                    raise JobError(f"{self.what} is in use by another run ({holder}; lock {self.path}): wait for "
                                   "it to end, or stop it") from None
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
            # and our flock, we locked a file no one else will open. Lock the one on disk.
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
        self.fd, self.locked = fd, True
        return self

    def release(self) -> None:
        """Remove the lock file, then unlock (in this order: a run that opens the file after
        the removal creates a new one, see :meth:`acquire`)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
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
