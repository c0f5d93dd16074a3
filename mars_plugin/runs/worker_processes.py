"""Worker processes (``--workers``): the one door through which every command starts them
(:func:`process_pool`), so that each one stops with its run and dies with its parent.

Three rules, kept here rather than in each command (issue 41: ``mars crf --workers 2`` and
``mars debias --workers 2`` left their workers, 400-460 MB each, and the resource tracker
alive for more than a minute after ``kill -9`` of the command):

* **A worker dies with its parent.** Each worker asks the kernel for SIGKILL when its parent
  ends (Linux ``prctl(PR_SET_PDEATHSIG)``), and a thread of its own watches ``os.getppid()``
  (every platform, and the case where the parent died before the ``prctl``): within
  :data:`WATCH_S` seconds the worker ends itself. The death signal follows the *thread* that
  started the process, so a pool takes work only from the thread that made it (others are
  refused), whose life is the command's. With its workers gone, multiprocessing's resource
  tracker (whose pipe the parent and the workers hold) reads the end of its pipe and exits.
* **Ctrl-C is the parent's.** A worker starts with SIGINT blocked (so that a Ctrl-C while it
  imports prints no traceback of its own), then takes :func:`mars_plugin._interrupt.install`'s
  handler in its recording form: the signal never raises in a worker, its compiled kernels
  stop at their next check (:func:`mars_plugin._interrupt.check`). The parent, on its own
  KeyboardInterrupt, passes the signal on to each worker (a ``kill -INT`` of the parent alone
  stops them too), waits up to :data:`STOP_GRACE_S` seconds for the tasks running (a write in
  progress ends whole) and kills those still running.
* **spawn, not fork**: forking a process whose torch already started OpenMP threads can hang.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence

from mars_plugin import _interrupt

__all__ = ["WorkerPool", "die_with_parent", "process_pool", "STOP_GRACE_S", "WATCH_S"]

#: How often (seconds) a worker checks that its parent is alive.
WATCH_S = 0.5
#: How long (seconds) an interrupted parent waits for its workers' running tasks.
STOP_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerPool(ProcessPoolExecutor):
    """A :class:`~concurrent.futures.ProcessPoolExecutor` of ``workers`` spawned processes that
    follow this module's rules; ``initializer(*initargs)`` runs in each after them."""

    def __init__(self, workers: int, initializer: Optional[Callable[..., Any]] = None,
                 initargs: Sequence[Any] = ()) -> None:
        super().__init__(workers, mp_context=mp.get_context("spawn"), initializer=_start_worker,
                         initargs=(os.getpid(), initializer, tuple(initargs)))
        self._owner = threading.get_ident()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker; a worker started here starts with SIGINT blocked
        (the mask is inherited; the signal waits and reaches this process when it is unblocked)."""
        if threading.get_ident() != self._owner:
            # a worker's death signal follows the thread that started it: never a shorter-lived one
            raise RuntimeError("a WorkerPool takes work only from the thread that made it")
        with _sigint_blocked():
            return super().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As the executor's; after a Ctrl-C (:func:`mars_plugin._interrupt.requested`) the
        workers are asked to stop, waited for up to :data:`STOP_GRACE_S` seconds, then killed."""
        if not (wait and _interrupt.requested()):
            super().shutdown(wait, cancel_futures=cancel_futures)
            return
        processes = list((self._processes or {}).values())  # the executor forgets them below
        manager = self._executor_manager_thread
        for p in processes:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGINT)  # recorded there: its kernels stop at their next check
        super().shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        if manager is not None:
            manager.join(max(0.1, deadline - time.monotonic()))


def process_pool(workers: int, initializer: Optional[Callable[..., Any]] = None,
                 initargs: Sequence[Any] = ()) -> Optional[WorkerPool]:
    """A :class:`WorkerPool` of ``workers`` processes, or None for 0 (the work stays here)."""
    if workers == 0:
        return None
    return WorkerPool(workers, initializer, initargs)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block (processes started in it inherit the mask)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_worker(parent: int, initializer: Optional[Callable[..., Any]], initargs: Sequence[Any]) -> None:
    """A worker's first step (the pool's initializer): die with ``parent``, take SIGINT as a
    request only, then the caller's ``initializer``."""
    die_with_parent(parent)
    _interrupt.install(raise_now=False)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a Ctrl-C that waited is recorded now
    if initializer is not None:
        initializer(*initargs)


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its parent's pid) ends: the kernel's death signal on
    Linux, and on every platform a daemon thread that sees ``os.getppid()`` change (the process
    was handed to another parent) within :data:`WATCH_S` seconds."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the thread below does it
            pass
    if os.getppid() != parent:  # the parent died before the death signal was asked for
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)  # no cleanup: the parent, which owns the run's files and record, is gone

    threading.Thread(target=watch, name="mars-parent-watch", daemon=True).start()
