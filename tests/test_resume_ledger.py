"""The resume bookkeeping written once (runs/resume_ledger.py): with a real FolderRecord, a file
recorded from the same inputs is kept, one whose inputs changed (or with no record) is made
again and counted as redone, a new one is made; failures follow on_error."""
import pytest

from mars_plugin.runs.errors import JobError, JobSummary
from mars_plugin.runs.resume_ledger import ResumeLedger
from mars_plugin.runs.run_record import FolderRecord


def _record(folder):
    rec = FolderRecord(folder, "test", {"k": 1})
    rec.open()
    rec.write_settings()
    rec.load()
    return rec


def _write(folder, stem, text):
    path = folder / f"{stem}.txt"
    path.write_text(text)
    return path


def test_kept_again_and_new_are_told_apart(tmp_path):
    rec = _record(tmp_path)
    first = ResumeLedger(rec, JobSummary())
    for stem in ("a", "b"):
        assert first.needs(stem, tmp_path / f"{stem}.txt", {"in": stem})
        first.written(stem, _write(tmp_path, stem, stem), {"in": stem}, stem)
    assert (first.summary.done, first.summary.redone, first.summary.existing) == (2, 0, 0)
    _write(tmp_path, "c", "no record")  # an output no run recorded
    rec.close()

    rec = _record(tmp_path)
    ticks = []
    second = ResumeLedger(rec, JobSummary(), tick=lambda: ticks.append(1))
    assert not second.needs("a", tmp_path / "a.txt", {"in": "a"})  # same inputs: kept
    assert second.needs("b", tmp_path / "b.txt", {"in": "changed"})  # its inputs changed
    assert second.needs("c", tmp_path / "c.txt", {"in": "c"})  # exists, never recorded
    assert second.needs("d", tmp_path / "d.txt", {"in": "d"})  # new
    assert second.again == {"b", "c"} and second.summary.existing == 1 and len(ticks) == 1
    for stem in ("b", "c", "d"):
        second.written(stem, _write(tmp_path, stem, stem + "2"), {"in": stem}, stem)
    assert (second.summary.done, second.summary.redone) == (3, 2) and len(ticks) == 4
    rec.close()


def test_fail_stops_or_skips(tmp_path):
    rec = _record(tmp_path)
    with pytest.raises(JobError, match="^x: broken$"):
        ResumeLedger(rec, JobSummary()).fail("x", "broken")
    ticks = []
    skip = ResumeLedger(rec, JobSummary(), on_error="skip", tick=lambda: ticks.append(1))
    skip.fail("x", "broken")
    skip.fail("y", "gone")
    assert skip.summary.failed == [("x", "broken"), ("y", "gone")] and len(ticks) == 2
    rec.close()


def test_a_bad_on_error_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="on_error must be one of"):
        ResumeLedger(None, JobSummary(), on_error="ignore")
