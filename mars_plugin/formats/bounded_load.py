"""The one door through which every reader takes a tensor or an array from a file.

A small file must never become a large allocation. A ``.pt`` of 1.9 KB can declare a
(2, 30000, 30000) tensor as a stride-0 view of one value; a ``.npy`` header can declare 100 GiB
over a few bytes; a zip record can inflate; a pickle can hold any of these. Whatever reads them
then copies, widens or converts the declared size (``.contiguous()``, ``.float()``,
``np.asarray``), and the process grows to what the file declares, not what it holds. So every
``torch.load``, ``np.load`` and ``pickle.load`` of the package is here (tests/test_bounded_reads.py
fails on one anywhere else), and each checks, before anything of the declared size exists:

* a ``.npy`` header: the bytes its shape and dtype declare against the bytes the file holds after
  the header and against the read's bound (:func:`numpy_load`); a ``.npz`` (zip) where one
  array is expected is refused, naming the file;
* a torch zip archive: the bytes its records declare, uncompressed, against the bound
  (:func:`torch_load`);
* everything a file held, walked through dicts, lists, tuples and object arrays
  (:func:`check_loaded`): a meta tensor (a shape without data), a sparse tensor, a view whose
  values overlap (stride 0, expanded), a storage smaller than the view, larger than the file,
  and the declared bytes of all its tensors and arrays together against the bound.

The bound is the innermost :func:`read_limit` (a reader that knows the image sets one from its
size, :func:`image_read_bytes`, and a command its ``--max-memory``), else
:data:`DEFAULT_MAX_READ_BYTES`. A refusal is a :class:`ReadRefused` (a ValueError): one line
naming the file, the key inside it, the declared shape and bytes and the bound. An allocation
that fails all the same (a legacy torch file declares its storages in the pickle) is one too.
Nothing is unpickled unless the caller passes its user's opt-in (``weights_only=False``,
``allow_pickle=True``, :func:`pickle_load`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import zipfile
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "DEFAULT_MAX_READ_BYTES",
    "ReadRefused",
    "read_limit",
    "current_limit",
    "image_read_bytes",
    "torch_load",
    "numpy_load",
    "pickle_load",
    "check_loaded",
    "check_declared",
    "overlapping",
]

PathLike = Union[str, os.PathLike]

#: The bound of one file's declared bytes when no reader or command set one: above every weight
#: file the recipes read (a ResNet-101 is 170 MB, a ViT-L 1.2 GB), far below what a crafted
#: header declares (100 GiB and up).
DEFAULT_MAX_READ_BYTES = 8 << 30
#: Channels a map file may hold (class ids are bytes) and how much larger than its image, per
#: side, a map may be, for :func:`image_read_bytes`.
_MAX_CHANNELS, _MAX_SIDE_FACTOR, _MAX_ITEM = 256, 2, 8
#: How deep the walk goes into nested containers (a pickle can nest without end).
_MAX_DEPTH = 64

_LIMIT: contextvars.ContextVar[Optional[Tuple[int, str]]] = contextvars.ContextVar("mars_read_limit", default=None)


class ReadRefused(ValueError):
    """A file whose tensors or arrays declare more than they hold or than the read allows; the
    message is one line naming the file (and the key inside it)."""


@contextlib.contextmanager
def read_limit(max_bytes: Optional[int], why: str) -> Iterator[None]:
    """Within the block, no file read through this module may declare more than ``max_bytes``
    (None: no new bound); ``why`` says where the bound comes from (``--max-memory 2``, ``maps of
    a 500x375 image``). Nested limits take the smaller. Per thread and task (a context variable)."""
    outer = _LIMIT.get()
    new = outer
    if max_bytes is not None and (outer is None or int(max_bytes) < outer[0]):
        new = (int(max_bytes), why)
    token = _LIMIT.set(new)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def current_limit() -> Tuple[int, str]:
    """(bytes, where the bound comes from) of the reads made now."""
    return _LIMIT.get() or (DEFAULT_MAX_READ_BYTES, "the default bound of one file's arrays, 8 GiB")


def image_read_bytes(height: int, width: int) -> int:
    """The most bytes a file of maps for one (height, width) image may declare: 256 channels
    (class ids are bytes), maps up to twice the image's side, 8-byte values."""
    return _MAX_CHANNELS * (_MAX_SIDE_FACTOR * int(height)) * (_MAX_SIDE_FACTOR * int(width)) * _MAX_ITEM


def _where(path: str, key: str) -> str:
    return f"{path}: {key}: " if key else f"{path}: "


def check_declared(path: PathLike, what: str, shape: Sequence[int], itemsize: int, key: str = "") -> int:
    """The bytes ``shape`` x ``itemsize`` declares, or a ReadRefused naming ``path`` when they
    exceed the current bound (:func:`current_limit`). Python integers: no overflow."""
    declared = int(itemsize)
    for s in shape:
        declared *= int(s)
    limit, why = current_limit()
    if declared > limit:
        raise ReadRefused(f"{_where(os.fspath(path), key)}{what} of shape {tuple(int(s) for s in shape)} declares "
                          f"{declared:,} bytes, above the {limit:,} bytes this read allows ({why})")
    return declared


def overlapping(size: Sequence[int], stride: Sequence[int], item: int = 1) -> bool:
    """Whether two elements of a strided view share storage (a stride-0 or expanded view, or
    strides that overlap): by increasing stride, each dimension must step past everything the
    smaller ones span. ``item``: the bytes of one element when the strides are in bytes."""
    if any(s == 0 for s in size):
        return False
    extent = item
    for st, sz in sorted((abs(st), sz) for sz, st in zip(size, stride) if sz > 1):
        if st < extent:
            return True
        extent += st * (sz - 1)
    return False


def _check_tensor(path: str, size: int, t: torch.Tensor, key: str, what: str) -> int:
    """The declared bytes of ``t`` if its values are in the file, each once; else ReadRefused."""
    shape, dtype, where = tuple(t.shape), t.dtype, _where(path, key)
    if t.device.type == "meta":
        raise ReadRefused(f"{where}{what} must be a CPU tensor whose values are in the file; it holds a meta-device "
                          f"{dtype} tensor of shape {shape} (a meta tensor: a shape without data)")
    if t.layout != torch.strided:
        raise ReadRefused(f"{where}holds a {t.layout} {dtype} tensor of shape {shape}; readers take dense tensors "
                          "as torch.save writes them")
    storage, item = t.untyped_storage().nbytes(), t.element_size()
    if storage > size:  # a mapped (mmap=True) storage is only what the file declares
        raise ReadRefused(f"{where}declares a storage of {storage:,} bytes, but the file has {size:,}: a truncated "
                          "or altered file")
    declared = t.numel() * item
    if overlapping(shape, t.stride()):
        raise ReadRefused(f"{where}declares a {dtype} tensor of shape {shape} ({declared:,} bytes) over a storage of "
                          f"{storage:,} bytes, with strides {tuple(t.stride())} whose values overlap (a stride-0 or "
                          "expanded view); a file holds each value once, as torch.save of a tensor writes it")
    if t.numel():
        need = (t.storage_offset() + 1 + sum((sz - 1) * st for sz, st in zip(shape, t.stride()))) * item
        if need > storage:
            raise ReadRefused(f"{where}declares a {dtype} tensor of shape {shape} that needs {need:,} bytes of "
                              f"storage, but its storage holds {storage:,}")
    return declared


def _check_array(path: str, a: np.ndarray, key: str) -> int:
    """The declared bytes of a numpy array that owns its values once; else ReadRefused."""
    if overlapping(a.shape, a.strides, a.itemsize):
        raise ReadRefused(f"{_where(path, key)}declares a {a.dtype} array of shape {a.shape} ({a.nbytes:,} bytes) "
                          f"with strides {a.strides} whose values overlap (a stride-0 or broadcast view)")
    return int(a.nbytes)


def _children(obj: Any) -> List[Tuple[str, Any]]:
    """(key, value) of a container the walk enters; [] for a leaf."""
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray) and obj.dtype == object:
        return [(f"[{i}]", v) for i, v in enumerate(obj.reshape(-1))] if obj.size <= 1 << 16 else []
    d = getattr(obj, "__dict__", None)  # an unpickled object (the opt-in): what it holds
    return [(str(k), v) for k, v in d.items()] if isinstance(d, dict) and not isinstance(obj, type) else []


def check_loaded(path: PathLike, obj: Any, what: str = "each tensor") -> Any:
    """``obj`` (what ``path`` held) after checking every tensor and array in it (see the module
    docstring): ReadRefused naming the file and the key (``state_dict/conv1.weight``, ``[0]``)."""
    path = os.fspath(path)
    total, seen, stack = 0, set(), [("", obj, 0)]
    limit, why = current_limit()
    size = os.path.getsize(path)
    while stack:
        key, o, depth = stack.pop()
        if isinstance(o, torch.Tensor):
            total += _check_tensor(path, size, o, key, what)
        elif isinstance(o, np.ndarray) and o.dtype != object:
            total += _check_array(path, o, key)
        elif id(o) not in seen and depth < _MAX_DEPTH:
            seen.add(id(o))
            stack.extend((f"{key}/{k}" if key else k, v, depth + 1) for k, v in reversed(_children(o)))
        if total > limit:
            raise ReadRefused(f"{_where(path, key)}its tensors and arrays declare {total:,} bytes (up to this one), "
                              f"above the {limit:,} bytes this read allows ({why})")
    return obj


def _alloc_error(path: str, e: BaseException) -> ReadRefused:
    return ReadRefused(f"{path}: reading it needs more memory than this process can have ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:160]}); the file declares more than it holds, or is too large")


def _is_alloc_failure(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "alloc" in str(e).lower())


def _check_zip(path: str) -> None:
    """A torch zip archive whose records declare, uncompressed, more than the bound: ReadRefused
    (before torch inflates or maps any of them)."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch.load says what is wrong with it, in the caller's words
    total = sum(i.file_size for i in infos)
    limit, why = current_limit()
    if total > limit:
        big = max(infos, key=lambda i: i.file_size)
        raise ReadRefused(f"{path}: its zip records declare {total:,} bytes uncompressed ({big.filename}: "
                          f"{big.file_size:,}), above the {limit:,} bytes this read allows ({why})")


def torch_load(path: PathLike, *, map_location: Any = "cpu", weights_only: bool = True, mmap: bool = False,
               pickle_module: Any = None, what: str = "each tensor") -> Any:
    """``torch.load`` of ``path``, bounded: the zip records checked first, what it held walked
    after (:func:`check_loaded`). ``weights_only=False`` (unpickling: may run code) only on the
    user's opt-in. torch's own errors pass through unchanged (each caller words them); a refusal
    or a failed allocation is a :class:`ReadRefused`."""
    path = os.fspath(path)
    _check_zip(path)
    kw = {"map_location": map_location, "weights_only": weights_only}
    if mmap:
        kw["mmap"] = True
    if pickle_module is not None:
        kw["pickle_module"] = pickle_module
    try:
        obj = torch.load(path, **kw)
    except Exception as e:  # noqa: BLE001 -- only an allocation failure (MemoryError too) is ours to word
        if _is_alloc_failure(e):
            raise _alloc_error(path, e) from None
        raise
    return check_loaded(path, obj, what)


def _npy_header(path: str) -> Optional[Tuple[Tuple[int, ...], np.dtype, int]]:
    """(shape, dtype, offset of the data) of a ``.npy`` file, None when it is no ``.npy``."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return None
        f.seek(0)
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(f)
        else:
            shape, _, dtype = fmt._read_array_header(f, version)  # 3.0: no public reader
        return tuple(shape), dtype, f.tell()


def numpy_load(path: PathLike, *, allow_pickle: bool = False, mmap_mode: Optional[str] = None,
               what: str = "an array") -> Any:
    """``np.load`` of one ``.npy`` array, bounded: its header's declared bytes checked against
    the bytes after it and the bound first; a ``.npz`` (zip) is a ReadRefused, as a pickled file
    unless ``allow_pickle`` (the user's opt-in); what a pickle held is walked after. numpy's own
    errors on an unreadable header pass through (each caller words them)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        raise ReadRefused(f"{path}: a .npz archive (a zip of arrays), not one .npy array; {what} is written by "
                          "np.save (np.savez writes archives)")
    header = _npy_header(path)
    if header is not None and not header[1].hasobject:
        shape, dtype, offset = header
        declared = check_declared(path, f"{what} ({dtype})", shape, dtype.itemsize)
        held = os.path.getsize(path) - offset
        if declared > held:
            raise ReadRefused(f"{path}: declares a {dtype} array of shape {shape} ({declared:,} bytes), but the file "
                              f"holds {held:,} bytes after its header: a truncated or altered file")
    try:
        obj = np.load(path, allow_pickle=allow_pickle, mmap_mode=mmap_mode)
    except MemoryError as e:
        raise _alloc_error(path, e) from None
    return check_loaded(path, obj) if allow_pickle else obj


def pickle_load(path: PathLike) -> Any:
    """A plain pickle file, unpickled (may run code: only on the user's opt-in), then walked
    (:func:`check_loaded`)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            obj = pickle.load(fh)
    except MemoryError as e:
        raise _alloc_error(path, e) from None
    return check_loaded(path, obj)
