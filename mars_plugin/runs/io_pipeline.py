"""Folder jobs with their file I/O overlapped with the device: ``--io-workers`` threads read and
decode the next inputs ahead and encode and write the outputs behind, while this thread runs
the device compute batch after batch (``mars debias``, ``mars crf``, ``mars predict``).

Threads, not processes: what the workers do (PIL's JPEG/PNG decode and encode, zlib,
``np.load``, torch's CPU ops) releases the GIL, and a thread hands its arrays over without a
copy, where ``mars crf --workers`` processes pickle each (L, H, W) map through a pipe (slower
than this process alone on an H100: 7-8 images/s against 10-18). ``benchmarks/bench_io.py``
measures both.

The contract the jobs rely on:

- results come back in input order (:meth:`IOPipeline.reads`, :meth:`IOPipeline.written`),
  so the run record and the progress bar see what the serial path sees;
- a read that raises is that item's failure: its exception is raised by ``result()`` in this
  thread, where the job's own ``except`` (``--on-error``) takes it, as in the serial path;
- a write that raises stops the job (it is not the file's fault: a full disk), naming the cause;
- at most ``ahead`` reads and ``behind`` writes are in flight, so memory stays bounded;
- on any exception here (a failed write, the compute, Ctrl-C), the reads and writes not begun
  are cancelled and those running are waited for (each a whole atomic write: no half file);
  :meth:`IOPipeline.settled` then hands over the writes that finished, for the job to record
  before the error goes on (a resumed run keeps them).

``workers=0`` runs everything in this thread, in the same order: the serial path, the same
functions, so the outputs do not depend on the worker count.

Every thread that reads a file is made by :func:`reading_threads`: its work runs in a copy of
the submitting thread's context, so a read there is under the same bound as in the thread that
asked for it (:func:`mars_plugin.formats.bounded_load.read_limit`, ``--max-memory``: a context
variable, which a new thread would otherwise start without).
"""
from __future__ import annotations

import contextvars
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Iterable, Iterator, Optional, Tuple, TypeVar

__all__ = ["IOPipeline", "Done", "check_io_workers", "default_io_workers", "reading_threads", "IO_WORKERS_HELP"]

T = TypeVar("T")

#: The ``--io-workers`` help of every command that has the flag (one wording).
IO_WORKERS_HELP = ("threads that read and decode the next inputs and encode and write the outputs while the "
                   "device computes (0: all in turn in this thread; default: min(4, CPU cores) with a cuda "
                   "--device, 0 on the CPU); the outputs do not depend on it")


def default_io_workers(device: Any) -> int:
    """``--io-workers`` left out: min(4, CPU cores) when the compute runs on a GPU (the CPU is
    then free for the files), 0 on the CPU (the compute takes the cores itself)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return min(4, os.cpu_count() or 1) if kind == "cuda" else 0


def check_io_workers(io_workers: Optional[int], device: Any, processes: int = 0) -> int:
    """``--io-workers`` checked where it enters: an integer in 0..MAX_WORKERS, or None for
    :func:`default_io_workers`. ``processes``: the ``--workers`` processes the job runs instead
    (``mars debias`` > 1, ``mars crf`` > 0), which read and write themselves: the default is
    then 0 and an explicit ``io_workers`` > 0 is refused (one kind of worker per run)."""
    from mars_plugin._checks import MAX_WORKERS, check_int_param

    if io_workers is None:
        return 0 if processes else default_io_workers(device)
    io_workers = check_int_param(io_workers, "io_workers", 0, MAX_WORKERS)
    if io_workers and processes:
        raise ValueError(f"io_workers={io_workers} with {processes} --workers processes: give --workers (processes "
                         "that each run whole batches) or --io-workers (threads beside one device), not both")
    return io_workers


class Done:
    """A finished call in the shape of a future: its value, or its exception raised again by
    :meth:`result` (the serial path's ``workers=0``)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.value: Any = None
        self.error: Optional[BaseException] = None
        try:
            self.value = fn(*args)
        except Exception as e:  # noqa: BLE001 -- raised again by result(), where the caller decides
            self.error = e

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self) -> Optional[BaseException]:
        return self.error


class _ContextThreads(ThreadPoolExecutor):
    """A thread pool whose work runs in a copy of the context of the thread that submitted it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def reading_threads(workers: int, name: str) -> ThreadPoolExecutor:
    """``workers`` threads (prefix ``name``) for work that reads files: each task runs under the
    submitting thread's context (its read bound, ``--max-memory``), as if it ran there."""
    return _ContextThreads(max_workers=int(workers), thread_name_prefix=name)


class IOPipeline:
    """Reads ahead and writes behind in ``workers`` threads (0: in this thread).

    Use as a context manager (its exit cancels what has not begun and waits for what runs)::

        with IOPipeline(workers, ahead=2 * batch_size, behind=2 * batch_size) as io:
            for item, got in io.reads(read, items):   # in order; got.result() raises a read's error
                ... compute a batch ...
                io.write(key, write, *args)           # queued behind; at most ``behind`` in flight
                for key, value in io.written():       # finished writes, in submission order
                    ... record key ...
            for key, value in io.written(0): ...      # the rest, at the end
    """

    def __init__(self, workers: int, *, ahead: int, behind: int, executor: Any = None) -> None:
        from mars_plugin._checks import check_int_param

        check_int_param(workers, "io_workers", 0)
        self.ahead, self.behind = max(1, int(ahead)), max(0, int(behind))
        # ``executor``: another pool to run the reads and writes in, shut down by close()
        # (``mars crf --workers``' processes, for a CPU-bound prepare); else ``workers`` threads
        self.pool = executor
        if workers and executor is None:
            self.pool = reading_threads(workers, "mars-io")
        self.pending: Deque[Tuple[Any, Any]] = deque()  # (key, future) of the writes, oldest first

    def __enter__(self) -> "IOPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the reads and writes not begun and wait for those running (a thread cannot
        be stopped mid-file, and each write is atomic: no half file is left)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return Done(fn, *args) if self.pool is None else self.pool.submit(fn, *args)

    def reads(self, read: Callable[[T], Any], items: Iterable[T]) -> Iterator[Tuple[T, Any]]:
        """``(item, future)`` for each of ``items`` (any iterable, taken lazily), in order, with
        ``read(item)`` running at most ``ahead`` items ahead of the one handed out;
        ``future.result()`` is its value or raises its error. Serial (``workers=0``): each
        read runs when its item is handed out."""
        if self.pool is None:
            for item in items:
                yield item, Done(read, item)
            return
        ahead: Deque[Tuple[T, Any]] = deque()
        for item in items:
            ahead.append((item, self.pool.submit(read, item)))
            if len(ahead) > self.ahead:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()

    def write(self, key: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` behind (serial: now); its value comes back, under ``key``, from
        :meth:`written`, which is also where the oldest writes are waited for while more than
        ``behind`` are in flight (call it after each batch's writes)."""
        self.pending.append((key, self._submit(fn, *args)))

    def written(self, limit: Optional[int] = None) -> Iterator[Tuple[Any, Any]]:
        """``(key, value)`` of the finished writes, in the order they were queued: all those
        already done, and the oldest waited for while more than ``limit`` (default ``behind``)
        are in flight; ``written(0)`` waits for them all. A write that raised raises here."""
        limit = self.behind if limit is None else limit
        while self.pending and (len(self.pending) > limit or self.pending[0][1].done()):
            key, fut = self.pending[0]
            value = fut.result()  # raises a failed write: the job stops
            self.pending.popleft()
            yield key, value

    def settled(self) -> Iterator[Tuple[Any, Any]]:
        """After an error (the compute's, Ctrl-C): :meth:`close`, then ``(key, value)`` of each
        queued write that finished, in order, so that the job records the outputs already
        whole on disk (a resumed run keeps them) before the error goes on; the others are
        left out (cancelled, or failed: their file is the one there before)."""
        self.close()
        while self.pending:
            key, fut = self.pending.popleft()
            if not fut.cancelled() and fut.done() and fut.exception() is None:
                yield key, fut.result()

