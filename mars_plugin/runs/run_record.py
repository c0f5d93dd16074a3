"""A run's identity: what made the outputs of a resumable ``mars`` command.

``mars features``, ``mars centroids``, ``mars debias`` and ``mars reproduce`` resume: an output
already written is kept. This module makes "kept" mean "made from the same inputs": every input
that shapes a result is recorded beside the result, compared on the next run, and a second run
into the same output while one is running is refused (the lock: :mod:`mars_plugin.runs.run_lock`).

**The record.** Settings (the flags that shape a result, the model files; for ``mars reproduce``
also its ``--root`` and ``--pseudo`` folders, as before) are refused when they differ: the output
would mix two settings. Input *files* that differ are recomputed where they matter; the jobs do
not record the folders they read, only each file's identity, so a tree moved or copied with its
times is the same run, and another folder is other inputs. Each command keeps its record beside
its outputs:

* ``mars features --out F`` and ``mars debias --out D``: ``.mars-run.json`` in the folder (the
  settings) and ``.mars-run.files.<rank>.jsonl`` (one line per file written: the output's
  name, size and mtime, a digest of its content, and the identity of every input it was made
  from). An append-only journal per rank, not one JSON rewritten per file: rewriting a record of
  82,783 entries after each image would be quadratic, and each torchrun rank appends its own
  lines as it writes, so a killed run of any world size loses no record of a finished file. A
  line whose output's size and mtime are no longer those recorded describes another file and
  is ignored; a torn last line (a kill mid-write) is ignored.
* ``mars centroids --out V.pt``: inside ``V.pt`` (a ``"run"`` string of JSON, read with
  ``weights_only=True``), so that the record and the centroids are replaced by one rename and
  can never describe different files; it also travels with the file.
* ``mars reproduce --out O``: ``O/reproduce.json`` (settings, a digest of each input role, and
  per finished stage the digests it was made from), and the records of ``O/features``,
  ``O/centroids.pt`` and ``O/debiased`` above.

**A file's identity**: see :mod:`mars_plugin.runs.identities`.

**What a resumed run does** (a changed file: another size or mtime; a new or removed id: a file
added to or removed from the pseudo-label folder):

======================================  ====================================================
changed between two runs                 what the next run does
======================================  ====================================================
a setting: a model file, ``--fp16``,      refused, one line naming the first differing keys
``--scales``, Eq. 1-5's parameters,      (``--out X holds ... other settings (alpha: 0.4 ->
the CRF's, reproduce's folders           0.5)``); use another ``--out``
an image                                 features: that image's features recomputed;
                                         debias (CRF): that image's label recomputed
a pseudo label, a new or removed id,     centroids recomputed (any change), then every
a feature file, a tag (xml / image-      debiased label whose features, label or tags
label file)                              changed, or all of them when the centroids changed
the centroids' content                   every debiased label recomputed
a ground-truth mask, a reference         reproduce: evaluate and report only
folder or one of its masks
an input removed: an image (features,    its output moved to ``.mars-stale/<run>/``, when
predict, crf, debias with the CRF), a    the journal recorded it and it is as recorded
pseudo label or a feature file (debias)  (size, mtime); any other file of no input kept and
                                         named
``--restart`` (crf)                      the earlier run's record, journals and every
                                         output moved to ``.mars-stale/<run>/`` first
nothing                                  every output kept (``already done``)
======================================  ====================================================

``mars reproduce`` reruns a stage whose recorded inputs differ and every stage after it (the
report always); each job it calls then keeps the outputs whose own inputs did not change. A
debiased label of an id whose pseudo label is gone is moved aside (by ``mars debias``, below),
and so is one of an id ``mars reproduce`` leaves out (e.g. one whose tags are unreadable).

**Stale outputs.** ``mars features``, ``mars predict``, ``mars crf`` and ``mars debias`` give
:meth:`FolderRecord.open` the ids whose inputs exist now (every image of ``--images``; for crf
every file of ``--cams``/``--probs``; for debias the ids with a pseudo label, a feature file and,
with the CRF, an image). Holding the
lock, before any rank writes, rank 0 moves into ``--out/.mars-stale/<UTC time>-<run id>/``
(:mod:`mars_plugin.runs.output_aside`: out of every command's sight, but not lost, one subfolder
per run, so that an input gone a second time never overwrites the first one's output; an
``--out`` reused with another input folder keeps the first one's work) each output of another
id that a journal line describes as it is (the command wrote it and nobody changed it since), drops the journal lines
of such ids, and names every other file of no input in a warning: a file put there by the user,
or changed since it was written, is never moved. The ids are those of the input folders, not
of a run's ``stems``: a run on some ids is a filter and never removes an output whose input
exists (another run may have made it). Under torchrun only rank 0 removes (it alone holds the
lock); the other ranks wait for it where they share its errors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from mars_plugin.runs.errors import JobError, JobSummary, few, one_line
from mars_plugin.runs.identities import _stat_key, file_id, json_digest, roles_digest
from mars_plugin.runs.output_aside import STALE_DIR, OutputAside
from mars_plugin.runs.run_lock import LOCK_NAME, RunLock, remove_stale_tmp

__all__ = [
    "RECORD_NAME",
    "STALE_DIR",
    "FolderRecord",
    "CentroidsRecord",
    "read_centroids_run",
    "OutputIds",
    "settings_diff",
    "broadcast_object",
]

PathLike = Union[str, os.PathLike]

#: The settings record of a per-file job's output folder.
RECORD_NAME = ".mars-run.json"
#: The journal of the files one rank wrote into the folder.
JOURNAL_NAME = ".mars-run.files.{rank}.jsonl"


# --------------------------------------------------------------------------------------------
# settings and journals
# --------------------------------------------------------------------------------------------


def _flat(d: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested dicts as dotted keys (``model.flip``), so that a diff names the leaf that differs."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    """``key: old -> new`` for every key whose value differs, nested keys dotted
    (``model.checkpoint.sha256_ends: '0a60...' -> '9f1c...'``), sorted by key."""
    old, new = _flat(old), _flat(new)
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists), so that a recorded value and a
    fresh one compare equal."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _journal_lines(path: Path) -> List[Tuple[str, Optional[Dict[str, Any]]]]:
    """Each line of one journal with its entry (None: not a well-formed entry, e.g. the torn
    last line of a killed run); no lines when the file cannot be read."""
    try:
        text = path.read_text()
    except (OSError, ValueError):  # ValueError: not UTF-8, no journal of ours
        return []
    lines: List[Tuple[str, Optional[Dict[str, Any]]]] = []
    for line in text.splitlines():
        try:
            e = json.loads(line)
        except ValueError:  # a torn line of a killed run
            e = None
        out = e.get("out") if isinstance(e, dict) else None  # [name, size, mtime_ns]
        ok = (isinstance(out, list) and len(out) == 3 and isinstance(out[0], str)
              and all(isinstance(v, int) and not isinstance(v, bool) for v in out[1:]))
        lines.append((line, e if ok else None))
    return lines


def _journals(folder: Path) -> List[Path]:
    return sorted(folder.glob(JOURNAL_NAME.format(rank="*")))


def _read_journals(folder: Path) -> Iterable[Dict[str, Any]]:
    """Every well-formed line of every rank's journal in ``folder``."""
    for p in _journals(folder):
        for _, e in _journal_lines(p):
            if e is not None:
                yield e


class OutputIds:
    """Identities of the files of a folder a ``mars`` job wrote (features): a file whose size
    and mtime are those its journal recorded is identified by the digest of its content
    (``name:d:<digest>``), so that the same content written again keeps its identity; any
    other file (a folder given by the user, a file changed since) by :func:`file_id`."""

    def __init__(self, folder: PathLike):
        self.known: Dict[Tuple[str, int, int], str] = {}
        folder = Path(folder)
        if folder.is_dir():
            for e in _read_journals(folder):
                name, size, mtime = e["out"]
                self.known[(str(name), int(size), int(mtime))] = str(e.get("d"))

    def __call__(self, path: Optional[PathLike]) -> Optional[str]:
        key = _stat_key(path)
        if key is None:
            return None
        d = self.known.get(key)
        return f"{key[0]}:d:{d}" if d is not None else f"{key[0]}:{key[1]}:{key[2]}"


def broadcast_object(obj: Any, group: Optional[Any] = None) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without torch.distributed): the ranks act
    on one decision, rank 0's, even when they see a shared file system differently."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


# --------------------------------------------------------------------------------------------
# the record of a per-file job's folder
# --------------------------------------------------------------------------------------------


class FolderRecord:
    """The record of a folder of per-image outputs (``mars features``, ``mars debias``).

    Use: rank 0 calls :meth:`open` (lock, settings check, stale ``.tmp-*`` removal) and, once
    the job's own checks passed, :meth:`write_settings`; the ranks share a failure of
    :meth:`open` (``share_error``); every rank calls :meth:`load`, asks :meth:`current` for each
    output before computing it, calls :meth:`add` after writing it, and :meth:`close` at the
    end. ``inputs`` are ``{role: identity}`` dicts of JSON values, taken *before* the inputs
    are read (a file changed while the run reads it is then seen as changed next time)."""

    def __init__(self, folder: PathLike, command: str, settings: Mapping[str, Any], *, rank: int = 0,
                 flag: str = "--out"):
        self.folder = Path(folder)
        self.command = command
        self.settings = _jsonable({"command": command, **settings})
        self.key = json_digest(self.settings)
        self.rank = rank
        self.what = f"{flag} {self.folder}"
        self.flag = flag
        self.lock = RunLock(self.folder / LOCK_NAME, self.what, f"mars {command}")
        self._entries: Dict[Tuple[str, int, int], Dict[str, Any]] = {}
        self._journal = None
        #: where :meth:`open` moves outputs aside (this run's subfolder of STALE_DIR)
        self.aside = OutputAside(self.folder, self.what)
        #: outputs :meth:`open` moved aside: of inputs that are gone, of the earlier run (restart);
        #: and the files of no input it kept
        self.stale: List[str] = []
        self.earlier: List[str] = []
        self.strays: List[str] = []

    def open(self, ids: Optional[Collection[str]] = None, extensions: Sequence[str] = (), *,
             restart: Optional[Sequence[str]] = None) -> None:
        """Rank 0: take the lock, refuse other settings, remove stale temporary files and, given
        ``ids`` (every id whose inputs exist now) and the outputs' ``extensions``, move aside the
        stale outputs (:meth:`_remove_stale`), before any rank appends to a journal.

        ``restart`` (``--restart``): the extensions of every output the command can write (all
        its ``--write`` kinds); first, holding the lock, the earlier run's record, journals and
        every file of those extensions are moved aside (:meth:`_move_earlier_run`), so that its
        settings are no longer compared and none of its files sits beside the new run's."""
        self.lock.acquire()
        try:
            if restart is not None:
                self._move_earlier_run(restart)
            path = self.folder / RECORD_NAME
            if path.is_file():
                try:
                    old = json.loads(path.read_text())["settings"]
                    if not isinstance(old, dict):
                        raise TypeError("settings is not an object")
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise JobError(f"{path}: not a record this command wrote ({one_line(e)}); use another "
                                   f"{self.flag}") from None
                diff = settings_diff(old, self.settings)
                if diff:
                    raise JobError(f"{self.what} holds files made with other settings ({'; '.join(diff[:4])}); use "
                                   f"another {self.flag}, or delete that folder to start over")
            remove_stale_tmp(self.folder)
            if ids is not None:
                self._remove_stale(set(ids), extensions)
        except BaseException:
            self.lock.release()
            raise

    def _remove_stale(self, ids: Set[str], extensions: Sequence[str]) -> None:
        """Move to ``.mars-stale/`` the outputs of ids no longer among ``ids``, where this command wrote them: a
        file of ``extensions`` whose size and mtime are those a journal line recorded. Their
        journal lines (and those of such files already gone) are dropped, each journal rewritten
        atomically. Any other file of ``extensions`` without an id in ``ids`` (put there by the
        user, or changed since it was written) is kept, and named in :attr:`strays`.

        ``ids`` are the ids whose inputs exist, not the ids a run was asked for (``stems``): an
        output of an existing input is never stale, so that a run on a part of a folder never
        removes the rest, which another run may have made."""
        if not self.folder.is_dir():
            return
        journals = {p: _journal_lines(p) for p in _journals(self.folder)}
        recorded = {(str(e["out"][0]), int(e["out"][1]), int(e["out"][2]))
                    for lines in journals.values() for _, e in lines if e is not None}
        exts = tuple(x.lower() for x in extensions)
        for p in sorted(self.folder.iterdir()):
            if p.name.startswith(".") or p.suffix.lower() not in exts or p.stem in ids or not p.is_file():
                continue
            key = _stat_key(p)
            if key is not None and key in recorded:
                # Moved aside, not deleted: an --out reused with another input folder would
                # otherwise lose hours of features; out of the folder, no command reads it.
                self.aside.move(p.name)
                self.stale.append(p.name)
            else:
                self.strays.append(p.name)
        from mars_plugin.formats.files import atomic_write

        for path, lines in journals.items():
            # an entry of a gone id whose file is no longer as recorded describes nothing
            keep = [line for line, e in lines if e is not None and (
                e.get("id") in ids or _stat_key(self.folder / str(e["out"][0])) == tuple(e["out"]))]
            if len(keep) < len(lines):
                text = "".join(line + "\n" for line in keep)
                atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    def _move_earlier_run(self, extensions: Sequence[str]) -> None:
        """``--restart``: the earlier run's record, journals and every file of ``extensions``
        (recorded or not: a file of a killed run's last moment, or of an older restart) moved
        aside, together, so that the subfolder describes its files as the folder did."""
        if not self.folder.is_dir():
            return
        exts = tuple(x.lower() for x in extensions)
        records = {RECORD_NAME, *(j.name for j in _journals(self.folder))}
        for p in sorted(self.folder.iterdir()):
            if p.is_file() and (p.name in records or (
                    not p.name.startswith(".") and p.suffix.lower() in exts)):
                self.aside.move(p.name)
                if not p.name.startswith("."):
                    self.earlier.append(p.name)

    def tell(self, summary: JobSummary) -> None:
        """Add what :meth:`open` found in the folder to ``summary`` (rank 0's; the others' is
        empty): the outputs moved aside and where, a warning naming the files it kept."""
        summary.stale += self.stale
        summary.earlier += self.earlier
        if self.aside.path is not None:
            summary.aside = self.aside.where
        if self.strays:
            summary.notes.append(f"{self.what} holds {len(self.strays)} file(s) with no input ({few(self.strays)}): "
                                 f"not made by this command or changed since, so kept; move them")

    def write_settings(self) -> None:
        """Rank 0: write ``.mars-run.json`` (once the job's checks passed: a run refused before
        any work leaves no record behind)."""
        from mars_plugin import __version__
        from mars_plugin.formats.files import atomic_write

        path = self.folder / RECORD_NAME
        text = json.dumps({"settings": self.settings, "mars": __version__}, indent=2, sort_keys=True)
        try:
            if path.read_text() == text:
                return
        except OSError:
            pass
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    def load(self) -> None:
        """Read every rank's journal (the lines of this folder's settings)."""
        self._entries.clear()
        if not self.folder.is_dir():
            return
        for e in _read_journals(self.folder):
            if e.get("s") != self.key:
                continue
            name, size, mtime = e["out"]
            self._entries[(str(name), int(size), int(mtime))] = e

    def current(self, stem: str, out: PathLike, inputs: Mapping[str, Any]) -> Tuple[bool, bool]:
        """(kept, exists): whether ``out`` exists and was recorded as made from ``inputs``."""
        try:
            st = os.stat(out)
        except OSError:
            return False, False
        e = self._entries.get((Path(out).name, st.st_size, st.st_mtime_ns))
        return (e is not None and e.get("id") == stem and e.get("in") == _jsonable(dict(inputs))), True

    def add(self, stem: str, out: PathLike, inputs: Mapping[str, Any], content: str) -> None:
        """Record that ``out`` (just written, ``content`` the digest of what it holds) was made
        from ``inputs``: one line appended to this rank's journal."""
        st = os.stat(out)
        line = json.dumps({"id": stem, "out": [Path(out).name, st.st_size, st.st_mtime_ns], "d": content,
                           "in": _jsonable(dict(inputs)), "s": self.key}, sort_keys=True) + "\n"
        if self._journal is None:
            path = self.folder / JOURNAL_NAME.format(rank=self.rank)
            self._journal = open(path, "a+b")
            # A kill mid-line leaves a torn last line: start on a line of our own.
            self._journal.seek(0, os.SEEK_END)
            if self._journal.tell():
                self._journal.seek(-1, os.SEEK_END)
                if self._journal.read(1) != b"\n":
                    self._journal.write(b"\n")
        self._journal.write(line.encode())
        self._journal.flush()
        self._entries[(Path(out).name, st.st_size, st.st_mtime_ns)] = json.loads(line)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self.lock.release()


# --------------------------------------------------------------------------------------------
# the record of a centroid file
# --------------------------------------------------------------------------------------------


def read_centroids_run(path: PathLike) -> Optional[Dict[str, Any]]:
    """The ``"run"`` record inside a centroid file (None: no file, not a centroid file, or one
    written without a record, e.g. by ``DebiasedCentroids.save``)."""
    if not os.path.isfile(path):
        return None
    import torch

    try:
        from mars_plugin.formats.bounded_load import torch_load

        d = torch_load(path)
        run = json.loads(d["run"])
    except Exception:  # noqa: BLE001 -- any unreadable record is no record: computed again
        return None
    return run if isinstance(run, dict) and isinstance(run.get("settings"), dict) else None


class CentroidsRecord:
    """The record of ``mars centroids --out V.pt``, kept inside ``V.pt`` (see the module
    docstring), and its lock ``.V.pt.lock`` beside it. Rank 0 calls :meth:`open`, then
    :meth:`save` or nothing (kept), and every rank :meth:`close`."""

    def __init__(self, out: PathLike, settings: Mapping[str, Any], flag: str = "--out"):
        self.out = Path(out)
        self.settings = _jsonable({"command": "centroids", **settings})
        self.what = f"{flag} {self.out}"
        self.flag = flag
        parent = self.out.parent if str(self.out.parent) else Path(".")
        self.lock = RunLock(parent / f".{self.out.name}.lock", self.what, "mars centroids")
        self.inputs: Dict[str, Any] = {}
        self._made: List[Path] = []  # folders made for the lock, removed again when nothing is saved
        self._saved = False

    def open(self, stems: Sequence[str], features_dir: PathLike, labels_dir: PathLike,
             tags: Optional[Mapping[str, Any]], on_error: str) -> Optional[List[Any]]:
        """Take the lock, take the inputs' identities (before anything is read), refuse other
        settings; returns the skipped files recorded when ``out`` is current (keep it), else None."""
        from mars_plugin.formats.files import find_features

        p = self.out.parent.absolute()
        while not p.exists():
            self._made.append(p)
            p = p.parent
        for d in reversed(self._made):
            d.mkdir()
        self.lock.acquire()
        try:
            feature_id = OutputIds(features_dir)
            feats, labels = {}, {}
            for s in stems:
                try:
                    feats[s] = feature_id(find_features(features_dir, s))
                except (ValueError, OSError):  # missing or clashing: the read names it
                    feats[s] = None
                labels[s] = file_id(Path(labels_dir) / f"{s}.png")
            self.inputs = {"ids": json_digest(list(stems)), "features": roles_digest(feats),
                           "labels": roles_digest(labels), "tags": json_digest(tags), "count": len(stems)}
            old = read_centroids_run(self.out)
            if old is None:
                return None
            diff = settings_diff(old["settings"], self.settings)
            if diff:
                raise JobError(f"{self.what} holds centroids made with other settings ({'; '.join(diff[:4])}); use "
                               f"another {self.flag}, or delete it to compute them again")
            failed = old.get("failed") or []
            if old.get("inputs") != self.inputs or (failed and on_error == "stop"):
                return None
            return list(failed)
        except BaseException:
            self.close()
            raise

    def save(self, V: Any, failed: Sequence[Any]) -> None:
        """Write ``V`` with its record, atomically (one rename: the two always agree)."""
        import torch

        from mars_plugin import __version__
        from mars_plugin.formats.files import atomic_write

        state = V.state_dict()
        state["run"] = json.dumps({"settings": self.settings, "inputs": self.inputs, "failed": list(failed),
                                   "mars": __version__}, sort_keys=True)
        atomic_write(self.out, lambda tmp: torch.save(state, tmp))
        self._saved = True

    def close(self) -> None:
        self.lock.release()
        if not self._saved:  # a run that wrote nothing leaves no folder behind
            for d in self._made:
                try:
                    d.rmdir()
                except OSError:
                    break
