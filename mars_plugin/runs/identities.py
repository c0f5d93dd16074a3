"""What identifies an input of a ``mars`` run: files, model weights, arrays, settings.

The records of :mod:`mars_plugin.runs.run_record` compare these on a resumed run.

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
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = [
    "file_id",
    "content_id",
    "digest",
    "array_digest",
    "json_digest",
    "roles_digest",
    "weight_file_id",
    "model_files_id",
    "centroids_digest",
]

PathLike = Union[str, os.PathLike]


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


def roles_digest(ids: Mapping[str, Any]) -> str:
    """Digest of ``{id: identity}`` (one input role of a run: every pseudo label, every mask...)."""
    return json_digest(sorted((str(k), v) for k, v in ids.items()))
