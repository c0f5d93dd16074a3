"""What every folder job reports: :class:`JobError` (a one-line message naming the file or the
flag), :class:`JobSummary` (written, already there, skipped), and ``on_error``'s two policies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

ON_ERROR = ("stop", "skip")


class JobError(RuntimeError):
    """A file could not be processed and ``on_error="stop"``, or the run cannot go on (a
    worker process died, an input named by a flag is unreadable). The message is one line
    that names the file or the flag."""


@dataclass
class JobSummary:
    """What a folder job did: files written, files already there (resume), files skipped.

    ``pixels`` / ``removed`` (debias only): per class id, pseudo-label pixels of the images
    written by this run, and those of them marked biased. ``redone``: of the ``done``, files
    that existed and were computed again because their inputs changed or were not recorded
    (:mod:`mars_plugin.runs.run_record`)."""

    done: int = 0
    existing: int = 0
    failed: List[Tuple[str, str]] = field(default_factory=list)
    pixels: Dict[int, int] = field(default_factory=dict)
    removed: Dict[int, int] = field(default_factory=dict)
    redone: int = 0
    #: files that were used but add nothing (a label with no valid pixel), with the reason
    warnings: List[Tuple[str, str]] = field(default_factory=list)
    #: outputs of inputs that are gone, moved aside by this run (file names; see
    #: :meth:`mars_plugin.runs.run_record.FolderRecord.open`)
    stale: List[str] = field(default_factory=list)
    #: outputs of the earlier run that ``--restart`` moved aside (file names)
    earlier: List[str] = field(default_factory=list)
    #: where this run moved them, relative to the output folder (``.mars-stale/<UTC time>-<run id>/``:
    #: :class:`mars_plugin.runs.output_aside.OutputAside`); "" when nothing moved
    aside: str = ""
    #: one-line warnings about the output folder (files of no input that this run keeps)
    notes: List[str] = field(default_factory=list)

    def line(self, verb: str = "written") -> str:
        """Counts on one line; the skipped files are listed by :meth:`skipped_lines`."""
        s = f"{self.done} {verb}"
        if self.redone:
            s += f" ({self.redone} again: inputs changed or not recorded)"
        if self.existing:
            s += f", {self.existing} already done"
        s += f", {len(self.failed)} skipped"
        if self.stale:
            s += f", {len(self.stale)} stale moved to {self.aside} (their inputs are gone: {few(self.stale)})"
        if self.earlier:
            s += f", {len(self.earlier)} of the earlier run moved to {self.aside} (--restart: {few(self.earlier)})"
        return s

    def skipped_lines(self) -> List[str]:
        """Every skipped file with its reason, one line each (empty when none)."""
        if not self.failed:
            return []
        return [f"skipped {len(self.failed)} file(s):"] + [f"  {stem}: {why}" for stem, why in self.failed]

    def warning_lines(self) -> List[str]:
        """Every file that was read but adds nothing, one line each, and the notes on the output
        folder (empty when none)."""
        lines = [f"warning: {note}" for note in self.notes]
        if not self.warnings:
            return lines
        return lines + [f"warning: {len(self.warnings)} file(s) add nothing:"] + \
            [f"  {s}: {why}" for s, why in self.warnings]


def few(names: Sequence[str], show: int = 3) -> str:
    """The first ``show`` of ``names``, then ``...`` when there are more (a message names a few)."""
    names = list(names)
    return ", ".join(names[:show]) + (", ..." if len(names) > show else "")


#: The longest line :func:`one_line` gives: a message past it keeps its head and its tail (the
#: hint), the middle (a list of hundreds of keys, files) said as a count of characters left out.
MAX_LINE = 1200


def one_line(e: BaseException) -> str:
    """An exception's message on one line (what the command line prints), at most
    :data:`MAX_LINE` characters."""
    msg = " ".join(str(e).split())
    if len(msg) > MAX_LINE:
        head, tail = msg[:MAX_LINE - 320], msg[-250:]
        msg = f"{head} ... ({len(msg) - len(head) - len(tail):,} characters left out) ... {tail}"
    return msg or type(e).__name__


#: What reading and checking one image's files may raise: a per-file failure, which
#: ``on_error`` stops on or skips. (Numpy raises EOFError on a 0-byte .npy, PIL a
#: DecompressionBombError, an Exception subclass, on a huge declared size.)
FILE_ERRORS = (Exception,)


def _fail(stem: str, e: BaseException, on_error: str, summary: JobSummary) -> None:
    """Apply ``on_error`` to a per-file failure of ``stem``."""
    if isinstance(e, JobError):
        raise e
    msg = one_line(e)
    if on_error == "stop":
        raise file_failure(stem, msg) from None
    summary.failed.append((stem, msg))


def file_failure(stem: str, why: str) -> JobError:
    """The :class:`JobError` of one file that stops a run: ``"<stem>: <why>"``, with ``stem`` and
    ``core`` (``why``, the library's words) kept apart, so that the command line rewrites
    ``why`` in its flags' words (:mod:`mars_plugin.commands.flag_language`) and not the name."""
    err = JobError(f"{stem}: {why}")
    err.stem, err.core = stem, why  # type: ignore[attr-defined]
    return err


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
