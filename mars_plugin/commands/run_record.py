"""A run's identity: what made the outputs of a resumable ``mars`` command, and one run at a time.

``mars features``, ``mars centroids``, ``mars debias`` and ``mars reproduce`` resume: an output
already written is kept. This module makes "kept" mean "made from the same inputs": every input
that shapes a result is recorded beside the result, compared on the next run, and a second run
into the same output while one is running is refused.

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

**A file's identity** is its name, size and modification time in nanoseconds, not a hash of its
content: a resume must cost a ``stat`` per file (microseconds), not a read of every input (COCO's
82,783 feature files of DHR's inference are about 300 GB: minutes of hashing on every resume). What
this misses: an edit that keeps the size within the file system's timestamp granularity
(milliseconds on ext4/xfs, whose clock ticks coarser than their nanosecond field; 2 s on FAT),
or a copy that restores another file's size and mtime
(``cp -p``/``rsync -a`` of other content): touch such a file. Copying a whole tree with
``cp -a``/``rsync -a`` keeps every identity. Files ``mars`` writes itself (features, debiased
labels) carry a digest of their content in their journal: a deleted feature file computed again
to the same values keeps its identity, so nothing made from it is redone. Small files whose
content is the input are hashed (the image-label JSON, the centroids' tensors). Model weights
keep :func:`weight_file_id`: size and a hash of the first and last MiB.

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
nothing                                  every output kept (``already done``)
======================================  ====================================================

``mars reproduce`` reruns a stage whose recorded inputs differ and every stage after it (the
report always); each job it calls then keeps the outputs whose own inputs did not change. A
debiased label of an id whose pseudo label is gone is removed.

**One run at a time.** Each output (a folder, or ``V.pt``) has a lock file, ``.mars-run.lock``
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
import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mars_plugin.commands.errors import JobError, one_line

__all__ = [
    "RECORD_NAME",
    "LOCK_NAME",
    "RunLock",
    "FolderRecord",
    "CentroidsRecord",
    "read_centroids_run",
    "OutputIds",
    "file_id",
    "content_id",
    "digest",
    "array_digest",
    "json_digest",
    "roles_digest",
    "weight_file_id",
    "model_files_id",
    "settings_diff",
    "centroids_digest",
    "remove_stale_tmp",
    "broadcast_object",
]

PathLike = Union[str, os.PathLike]

#: The settings record of a per-file job's output folder.
RECORD_NAME = ".mars-run.json"
#: The lock file of an output folder (removed when the run ends).
LOCK_NAME = ".mars-run.lock"
#: The journal of the files one rank wrote into the folder.
JOURNAL_NAME = ".mars-run.files.{rank}.jsonl"
#: The names :func:`tempfile.mkstemp` gives the temporary files of atomic writes
#: (:func:`~mars_plugin.formats.files.atomic_write`, ``report_job``): ``.tmp-`` and 8 random characters.
_TMP_NAME = re.compile(r"^\.tmp-[a-z0-9_]{8}(\.[A-Za-z0-9]+)?$")


# --------------------------------------------------------------------------------------------
# identities
# --------------------------------------------------------------------------------------------


def digest(*parts: Union[bytes, str]) -> str:
    """A 128-bit BLAKE2b hex digest of ``parts`` (each length-prefixed: ``("ab", "c")`` and
    ``("a", "bc")`` differ)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def json_digest(obj: Any) -> str:
    """Digest of a JSON-able object (keys sorted: the same dict gives the same digest)."""
    return digest(json.dumps(obj, sort_keys=True, separators=(",", ":")))


def array_digest(a: Any) -> str:
    """Digest of an array's or tensor's dtype, shape and values (what a file holds, whatever
    the container around it: ``torch.save`` writes the temporary file's name into the file)."""
    try:
        import torch

        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    a = np.ascontiguousarray(a)
    return digest(str(a.dtype), str(a.shape), a.tobytes())


def _stat_key(path: Optional[PathLike]) -> Optional[Tuple[str, int, int]]:
    """(name, size, mtime_ns) of a file, or None when it does not exist (or ``path`` is None)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Path(path).name, st.st_size, st.st_mtime_ns


def file_id(path: Optional[PathLike]) -> Optional[str]:
    """``name:size:mtime_ns`` of a file (None when it does not exist, or ``path`` is None): see
    the module docstring for why not a content hash."""
    key = _stat_key(path)
    return None if key is None else f"{key[0]}:{key[1]}:{key[2]}"


def content_id(path: PathLike) -> Optional[str]:
    """``b2:<digest of the bytes>`` of a small file (None when it does not exist)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return "b2:" + digest(data)


def weight_file_id(path: PathLike) -> Dict[str, Any]:
    """Name, size and a hash of the first and last MiB: enough to tell two weight files apart
    without reading gigabytes on every resume. A folder (CAUSE's release folder) is the ids of
    the files under it, sorted by relative path."""
    p = Path(path)
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        return {"path": os.fspath(p.resolve()),
                "files": {os.fspath(q.relative_to(p)): weight_file_id(q)["sha256_ends"] + f":{q.stat().st_size}"
                          for q in files}}
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        if st.st_size > 2 << 20:
            fh.seek(-(1 << 20), os.SEEK_END)
            h.update(fh.read(1 << 20))
    return {"path": os.fspath(p.resolve()), "bytes": st.st_size, "sha256_ends": h.hexdigest()[:16]}


def model_files_id(uss: str, checkpoint: Optional[PathLike] = None, backbone: Optional[PathLike] = None,
                   heads: Optional[PathLike] = None) -> Dict[str, Any]:
    """``{"uss": ..., "checkpoint"/"backbone"/"heads": weight_file_id(...)}`` of a USS model's
    files (the given ones), and for CAUSE's release folder every file :func:`heads_files` reads."""
    files = {"checkpoint": checkpoint, "backbone": backbone, "heads": heads}
    out: Dict[str, Any] = {"uss": uss, **{k: weight_file_id(v) for k, v in files.items() if v is not None}}
    if uss == "cause" and heads is not None:
        from mars_plugin.adapters.uss.cause_files import heads_files

        # CAUSE's release keeps its codebook in a sibling folder: record every file read.
        out["heads_files"] = [weight_file_id(f) for f in heads_files(heads) if Path(f).is_file()]
    return out


def centroids_digest(state: Mapping[str, Any]) -> str:
    """Digest of a centroid file's content (``DebiasedCentroids.state_dict()``: the tensors,
    ``num_images``, ``config``), not of its bytes: centroids computed again to the same values
    keep their identity, so the debiased labels made from them are kept."""
    parts: List[str] = []
    for k in sorted(state):
        v = state[k]
        parts += [k, array_digest(v) if hasattr(v, "shape") else json.dumps(v, sort_keys=True)]
    return "c:" + digest(*parts)


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


def _read_journals(folder: Path) -> Iterable[Dict[str, Any]]:
    """Every well-formed line of every rank's journal in ``folder``."""
    for p in sorted(folder.glob(JOURNAL_NAME.format(rank="*"))):
        try:
            text = p.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                e = json.loads(line)
            except ValueError:  # a torn line of a killed run
                continue
            if isinstance(e, dict) and isinstance(e.get("out"), list) and len(e["out"]) == 3:
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


def roles_digest(ids: Mapping[str, Any]) -> str:
    """Digest of ``{id: identity}`` (one input role of a run: every pseudo label, every mask...)."""
    return json_digest(sorted((str(k), v) for k, v in ids.items()))


# --------------------------------------------------------------------------------------------
# one run at a time
# --------------------------------------------------------------------------------------------


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

    def open(self) -> None:
        """Rank 0: take the lock, refuse other settings, remove stale temporary files."""
        self.lock.acquire()
        try:
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
        except BaseException:
            self.lock.release()
            raise

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
        d = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
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
