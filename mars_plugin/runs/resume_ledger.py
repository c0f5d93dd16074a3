"""The resume bookkeeping of a folder job, written once (:class:`ResumeLedger`): for each output
file, whether this run keeps it (recorded as made from the same inputs: ``existing``), makes it
again (an existing file whose inputs changed, or with no record: ``redone``) or makes it for the
first time; each file written is recorded; a file that fails, fails alone (``--on-error``).
``mars features``, ``debias``, ``predict`` and ``crf`` use it with their
:class:`~mars_plugin.runs.run_record.RunRecord`.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Set, Union

from mars_plugin import _interrupt
from mars_plugin.runs.errors import JobSummary, _check_on_error, file_failure

__all__ = ["ResumeLedger"]

PathLike = Union[str, "os.PathLike[str]"]


class ResumeLedger:
    """One folder job's resume bookkeeping: ``record`` (a
    :class:`~mars_plugin.runs.run_record.RunRecord`: ``current`` and ``add``) and the job's
    ``summary`` (its ``existing``, ``done``, ``redone`` and ``failed``), kept together.
    ``tick``: called once per file settled (kept, written or failed: a progress bar's step);
    None: no progress here (the job counts its own)."""

    def __init__(self, record: Any, summary: JobSummary, on_error: str = "stop",
                 tick: Optional[Callable[[], Any]] = None) -> None:
        _check_on_error(on_error)
        self.record, self.summary, self.on_error = record, summary, on_error
        self._tick = tick
        #: the stems whose existing output this run makes again
        self.again: Set[str] = set()

    def tick(self) -> None:
        if self._tick is not None:
            self._tick()

    def needs(self, stem: str, out: PathLike, inputs: Mapping[str, Any]) -> bool:
        """Whether ``out`` must be made (from ``inputs``, identities taken before they are
        read, so that a file changed while the run reads it shows as changed next time); one
        kept is counted (and ticked) here."""
        kept, exists = self.record.current(stem, out, inputs)
        if kept:
            self.summary.existing += 1
            self.tick()
            return False
        if exists:
            self.again.add(stem)
        return True

    def written(self, stem: str, out: PathLike, inputs: Mapping[str, Any], content: str) -> None:
        """``out`` is written, whole, from ``inputs``; ``content``: the digest of what it holds."""
        self.record.add(stem, out, inputs, content)
        _interrupt.wrote()  # what the line of an interrupted run counts
        self.summary.done += 1
        self.summary.redone += stem in self.again
        self.tick()

    def fail(self, stem: str, why: str) -> None:
        """``stem`` failed: with ``on_error="stop"`` the run stops naming it (:class:`JobError`),
        with ``"skip"`` it is listed and the run goes on."""
        if self.on_error == "stop":
            raise file_failure(stem, why)
        self.summary.failed.append((stem, why))
        self.tick()
