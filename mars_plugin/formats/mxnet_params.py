"""MXNet's NDArray list file (``*.params``), read without MXNet and without unpickling.

The wide ResNet-38 ImageNet weights that SEAM and its segmentation codebase start from,
``ilsvrc-cls_rna-a1_cls1000_ep-0001.params``, are such a file (YudeWang/semantic-segmentation-codebase
lib/net/backbone/resnet38d.py:7 and :216-219 read it with ``mxnet.nd.load``). The layout is MXNet's
``NDArray::Save(Stream*, const std::vector<NDArray>&, const std::vector<std::string>&)``
(src/ndarray/ndarray.cc), little-endian:

* ``uint64`` 0x112 (``kMXAPINDArrayListMagic``), ``uint64`` reserved;
* ``uint64`` number of arrays, then each array:

  - ``uint32`` magic: 0xF993FAC9 (V2) or 0xF993FACA (V3) then ``int32`` storage type (0 dense;
    sparse arrays are refused); 0xF993FAC8 (V1); any other value is the legacy layout, where
    this word is already the number of dimensions;
  - the shape: ``uint32`` ndim then ndim ``int64`` (V1-V3) or ``uint32`` (legacy) sizes; an
    empty shape ends the array (a "none" array);
  - the context: ``int32`` device type, ``int32`` device id (ignored);
  - ``int32`` dtype flag (0 float32, 1 float64, 2 float16, 3 uint8, 4 int32, 5 int8, 6 int64);
  - the values, C order;

* ``uint64`` number of names, then each name: ``uint64`` length and its bytes (UTF-8).

Checkpoints that MXNet's ``Module`` saves prefix each name with ``arg:`` or ``aux:``; the
names are returned as stored.
"""
from __future__ import annotations

import os
import struct
from typing import BinaryIO, Dict, Union

import numpy as np

from mars_plugin.formats.bounded_load import check_declared

__all__ = ["read_mxnet_params", "LIST_MAGIC"]

#: The first word of an NDArray list file.
LIST_MAGIC = 0x112
_V1, _V2, _V3 = 0xF993FAC8, 0xF993FAC9, 0xF993FACA
_DTYPES = {0: np.float32, 1: np.float64, 2: np.float16, 3: np.uint8, 4: np.int32, 5: np.int8, 6: np.int64}
#: Sanity bounds that keep a damaged file from asking for absurd allocations.
_MAX_NDIM = 32
_MAX_NAME = 1 << 16


class _Truncated(Exception):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _Truncated()
    return b


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", _read(f, 4))[0]


def _i32(f: BinaryIO) -> int:
    return struct.unpack("<i", _read(f, 4))[0]


def _u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", _read(f, 8))[0]


def _array(f: BinaryIO, path: str, index: int) -> np.ndarray:
    magic = _u32(f)
    if magic in (_V2, _V3):
        stype = _i32(f)
        if stype != 0:
            raise ValueError(f"{path}: array {index} has sparse storage (type {stype}); expected dense weights")
    if magic in (_V1, _V2, _V3):
        ndim = _u32(f)
        if ndim > _MAX_NDIM and ndim != 0xFFFFFFFF:
            raise ValueError(f"{path}: array {index} claims {ndim} dimensions: not an MXNet .params file")
        ndim = 0 if ndim == 0xFFFFFFFF else ndim  # V3 writes -1 for an unknown shape
        shape = struct.unpack(f"<{ndim}q", _read(f, 8 * ndim))
    else:
        ndim = magic  # legacy layout: the first word is the number of dimensions
        if ndim > _MAX_NDIM:
            raise ValueError(f"{path}: array {index} starts with 0x{magic:08x}: not an MXNet .params file")
        shape = struct.unpack(f"<{ndim}I", _read(f, 4 * ndim))
    if ndim == 0:
        return np.zeros((0,), np.float32)
    if any(s < 0 for s in shape):
        raise ValueError(f"{path}: array {index} has the shape {shape}: not an MXNet .params file")
    _read(f, 8)  # context: device type, device id
    flag = _i32(f)
    if flag not in _DTYPES:
        raise ValueError(f"{path}: array {index} has the dtype flag {flag}; expected one of {sorted(_DTYPES)}")
    dtype = np.dtype(_DTYPES[flag]).newbyteorder("<")
    # Python integers (no overflow), checked against the file and the read's bound before the
    # values are read: a 40-byte header may declare 100 GiB or a count past 2**64.
    declared = check_declared(path, f"a {dtype.name} array", shape, dtype.itemsize, key=f"array {index}")
    left = os.fstat(f.fileno()).st_size - f.tell()
    if declared > left:
        raise ValueError(f"{path}: array {index}: declares a {dtype.name} array of shape {tuple(shape)} "
                         f"({declared:,} bytes), but the file has {max(left, 0):,} bytes left: a truncated or "
                         "damaged MXNet .params file")
    data = _read(f, declared)
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)


def read_mxnet_params(path: Union[str, os.PathLike]) -> Dict[str, np.ndarray]:
    """{name: array} of an MXNet ``.params`` file (``mxnet.nd.load``'s dict), no MXNet needed.

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file and what is wrong (not an NDArray list, truncated,
            sparse arrays, unnamed arrays, a name given twice), and for an array the key
            (``array 3``: the names come after the arrays): a shape whose bytes exceed what
            the file has left or the read's bound (:mod:`mars_plugin.formats.bounded_load`) is
            refused before anything of that size is read.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (an MXNet .params file)")
    with open(path, "rb") as f:
        try:
            head = _u64(f)
            if head != LIST_MAGIC:
                raise ValueError(f"{path}: starts with 0x{head:x}, not 0x{LIST_MAGIC:x}: not an MXNet .params file "
                                 "(NDArray list)")
            _u64(f)  # reserved
            n = _u64(f)
            size = os.path.getsize(path)
            if n > size:  # every array takes at least a word
                raise ValueError(f"{path}: claims {n} arrays in {size} bytes: not an MXNet .params file")
            arrays = [_array(f, path, i) for i in range(n)]
            m = _u64(f)
            if m != n:
                raise ValueError(f"{path}: holds {n} arrays but {m} names; expected one name per array")
            names = []
            for _ in range(m):
                k = _u64(f)
                if k > _MAX_NAME:
                    raise ValueError(f"{path}: a name of {k} bytes: not an MXNet .params file")
                names.append(_read(f, k).decode("utf-8", errors="replace"))
        except _Truncated:
            raise ValueError(f"{path}: ends early: a truncated or damaged MXNet .params file") from None
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a name is given twice; expected one array per name")
    return dict(zip(names, arrays))
