"""CAUSE's heads on disk, in DHR's form (``weights/CAUSE_<dataset>.pt``: ``{'decoder', 'codebook'}``,
``core/uss/models.py:127-129`` of shjo-april/DHR @ 94d5189) or in CAUSE's own release, read
strictly into the EMA head's state dict and the codebook; the decoder is built from them by
:func:`_decoder_from_state_dict`.

CAUSE's own release (ByungKwanLee/Causal-Unsupervised-Segmentation @ ee0aa84; file:line of that
commit) is read too, from the files as its scripts write and read them:

* ``segment_tr.pth`` in ``CAUSE/<dataset>/<baseline>/<num_codebook>/`` (``train_front_door_tr.py:
  291-300``, ``fine_tuning_tr.py:253-261``; ``<baseline>`` the backbone file's stem, e.g.
  ``dinov2_vit_base_14``, ``<num_codebook>`` 2048 by default) is ``segment.state_dict()`` of the
  whole ``Segment_TR`` (``modules/segment.py:27-47``), DistributedDataParallel unwrapped first
  (l. 208), so without ``module.``: ``head.*`` (the student), ``projection_head.f.*``,
  ``head_ema.*`` (the EMA head, the same ``Decoder`` as DHR's ``CauseDecoder``, same keys:
  ``modules/segment_module.py:38-90``), ``projection_head_ema.f.*``, ``linear.f.*``. Inference
  runs ``head_ema`` (``test_tr.py:26-28``); we build it from the ``head_ema.*`` keys only and
  check that the others are exactly those.
* The codebook, ``modular.npy`` in ``CAUSE/<dataset>/modularity/<baseline>/<num_codebook>/``
  (``utils/utils.py:54-62``): ``np.save`` of the float32 (num_codebook, D) codebook
  (``train_mediator.py:103-106``), loaded by ``np.load`` + ``torch.from_numpy`` into
  ``head_ema.codebook``, a plain attribute (``train_front_door_tr.py:217-226``,
  ``test_tr.py:215-225``).
* ``cluster_tr.pth`` (``fine_tuning_tr.py:263-264``) is CAUSE's ``Cluster``
  (``segment_module.py:92-110``): a copy of the codebook and the cluster probe used by CAUSE's own
  evaluation. The features do not need it and it is not read.
* Sizes: reduced_dim 90, FFN 2048, one head (``segment_module.py:40``); ``num_queries =
  train_resolution**2 // patch**2`` with train_resolution 322 for DINOv2, else 320
  (``train_front_door_tr.py:342-349``): 529 for DINOv2 ViT/14, 1600 for patch 8, 400 for patch 16.
  CAUSE's ``Decoder`` adds ``query_pos`` unresampled (l. 86-90), so it runs on 23 x 23 grids only;
  resampled as DHR does, the code is the same there
  (:func:`~mars_plugin.adapters.uss.cause_decoder.resample_queries` is the identity at 529) and
  defined at any size.
* Backbones: CAUSE releases CAUSE-TR for DINO ViT-S/8, S/16, B/8, DINOv2 ViT-B/14, iBOT ViT-B/16,
  MSN ViT-S/16 and MAE ViT-B/16 (``README.md:67-117``). Only DINOv2 ViT/14 is supported here
  (DHR's backbone family, and the one our DINOv2 ViT loads): a release folder named for another
  baseline or a ``head_ema.query_pos`` of other than 529 rows is refused. CAUSE's DINOv2 model
  returns the final-LayerNorm tokens, ``[:, 1:]`` taken as in DHR (``models/dinov2vit.py:631-640``,
  ``train_front_door_tr.py:58``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, List, Mapping, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.adapters.uss.cause_decoder import CAUSE_DIM, CAUSE_HIDDEN, CAUSE_QUERIES, CAUSESegment
from mars_plugin.adapters.uss.code_extractor import load_tensor_file, what_is
from mars_plugin.formats.bounded_load import ReadRefused, numpy_load

__all__ = [
    "heads_files",
    "load_codebook_npy",
]

PathLike = Union[str, os.PathLike]

#: The file names of CAUSE's own release (``train_front_door_tr.py:299``, ``utils/utils.py:61``).
RELEASE_SEGMENT, RELEASE_CODEBOOK = "segment_tr.pth", "modular.npy"


def _key_mismatch(head: str, missing: Sequence[str], unexpected: Sequence[str]) -> ValueError:
    """One error naming the first 8 missing and unexpected state-dict keys (and how many more)."""
    msg = [head]
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            msg.append(f"{what} key(s) {list(keys[:8])}" + (f" and {len(keys) - 8} more" if len(keys) > 8 else ""))
    return ValueError(" ".join(msg))


def _decoder_from_state_dict(sd: Any, width: int, what: str) -> CAUSESegment:
    """A :class:`CAUSESegment` sized by ``sd``'s shapes and loaded strictly; errors name the keys.

    ``sd`` holds the EMA head only (keys ``head_ema.*``), whichever file it came from: DHR's
    ``checkpoint['decoder']`` or the ``head_ema.*`` part of CAUSE's ``segment_tr.pth``.
    """
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) for k in sd):
        raise ValueError(f"{what}: must be the state dict of CAUSE's Segment_TR (keys 'head_ema.*'), got {what_is(sd)}")
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{what}: {k!r} is a {type(v).__name__}, not a tensor")
    q = sd.get("head_ema.query_pos")
    if isinstance(q, torch.Tensor) and (q.ndim != 2 or q.shape[1] != width):
        # the decoder's width is the backbone's (Decoder(args.dim), segment_module.py:83): say which side is wrong
        raise ValueError(f"{what}: 'head_ema.query_pos' has shape {tuple(q.shape)}, expected (Q, {width}) for the "
                         f"{width}-wide backbone: this decoder was trained on another backbone")

    def size(key: str, axis: int, default: int) -> int:
        v = sd.get(key)
        return int(v.shape[axis]) if isinstance(v, torch.Tensor) and v.ndim > axis else default

    seg = CAUSESegment(
        width,
        reduced_dim=size("head_ema.tr.f1.weight", 0, CAUSE_DIM),
        num_queries=size("head_ema.query_pos", 0, CAUSE_QUERIES),
        hidden_dim=size("head_ema.tr.linear1.weight", 0, CAUSE_HIDDEN),
    )
    expected = set(seg.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise _key_mismatch(f"{what} does not match the EMA head of CAUSE's Segment_TR (DHR "
                            f"core/uss/layers.py:36-92) of width {width}:", missing, unexpected)
    try:
        seg.load_state_dict(dict(sd), strict=True)
    except RuntimeError as e:  # shape mismatches, each named by torch with its key
        raise ValueError(f"{what} (backbone width {width}): {' '.join(str(e).split())}") from e
    return seg.eval()


def _check_codebook(codebook: Any, width: int, what: str, backbone: str) -> torch.Tensor:
    """The (K, D) concept codebook, whichever file it came from: float, 2-D, D = the backbone width,
    finite; errors name ``what`` (the file, and the key in it) and the shapes got and expected."""
    if not isinstance(codebook, torch.Tensor) or not codebook.is_floating_point():
        raise ValueError(f"{what}: must be a float (K, {width}) tensor, got "
                         + (f"dtype {codebook.dtype}" if isinstance(codebook, torch.Tensor) else what_is(codebook)))
    if codebook.ndim != 2 or codebook.shape[0] < 1 or codebook.shape[1] != width:
        raise ValueError(f"{what}: must be (K, {width}), D = the width of the backbone in {backbone}; "
                         f"got shape {tuple(codebook.shape)}")
    bad = int((~torch.isfinite(codebook)).sum())
    if bad:
        raise ValueError(f"{what}: holds {bad} NaN or infinite value(s) of {codebook.numel()}")
    return codebook


# -- CAUSE's own release ---------------------------------------------------------------------

#: CAUSE's checkpoint names, ``<method>_vit_<size>_<patch>`` (``run:29-48``; the method is the
#: first ``_`` field, ``utils/utils.py:162-164``; the patch the last, ``train_front_door_tr.py:349``).
_CAUSE_BASELINE = re.compile(r"^(dino|dinov2|ibot|msn|mae)_vit_(small|base|large)_(\d+)$")
_METHODS = {"dino": "DINO", "dinov2": "DINOv2", "ibot": "iBOT", "msn": "MSN", "mae": "MAE"}
#: The modules of CAUSE's Segment_TR besides the EMA head (``modules/segment.py:27-47``): the student
#: ``head`` (same keys as ``head_ema``), two projection heads and the linear probe, ``ProjectionSegment``
#: holding one conv ``f`` (``modules/segment_module.py:27-36``). Read for the key check only.
_RELEASE_EXTRA_KEYS = tuple(f"{m}.f.{p}" for m in ("projection_head", "projection_head_ema", "linear")
                            for p in ("weight", "bias"))
#: CAUSE-TR's DINOv2 query count: train_resolution 322 for DINOv2 and 322**2 // 14**2 queries
#: (``train_front_door_tr.py:342-349``, ``fine_tuning_tr.py:305-312``, ``test_tr.py:301-308``);
#: its other backbones train at 320 with patch 8 (1600 queries) or 16 (400).
_QUERIES_OF_PATCH = {320 ** 2 // 8 ** 2: 8, 320 ** 2 // 16 ** 2: 16}


def _describe_baseline(m: "re.Match[str]") -> str:
    return f"{_METHODS[m.group(1)]} ViT-{m.group(2)[0].upper()}/{m.group(3)}"


def _head_ema_keys() -> Tuple[str, ...]:
    """The state-dict keys of the EMA head (any size: a width-1 module is enough to name them)."""
    return tuple(CAUSESegment(1, 1, 1, 1).state_dict())


def _release_codebook_paths(folder: str) -> Tuple[str, str]:
    """Where the codebook of the release in ``folder`` is looked for, in this order.

    CAUSE writes ``segment_tr.pth`` to ``CAUSE/<dataset>/<baseline>/<num_codebook>/``
    (``train_front_door_tr.py:293-300``, ``fine_tuning_tr.py:254-261``) and reads the codebook from
    ``CAUSE/<dataset>/modularity/<baseline>/<num_codebook>/modular.npy`` (``utils/utils.py:54-62``),
    i.e. ``../../modularity/<baseline>/<num_codebook>/modular.npy`` from that folder; also
    accepted: ``modular.npy`` beside ``segment_tr.pth`` (both Drive folders downloaded into one).
    """
    f = Path(os.path.abspath(folder))
    return (str(f.parent.parent / "modularity" / f.parent.name / f.name / RELEASE_CODEBOOK),
            str(f / RELEASE_CODEBOOK))


def heads_files(heads: PathLike) -> List[str]:
    """Every file that reading ``heads`` may open, without opening any: the file itself, or for
    CAUSE's release (a folder, or its ``segment_tr.pth``) that file and the ``modular.npy``
    candidates of :func:`_release_codebook_paths` that exist. What a resumable run records as
    the identity of its model (``mars reproduce``)."""
    name = os.fspath(heads)
    if os.path.isdir(name):
        folder, files = name, [os.path.join(name, RELEASE_SEGMENT)]
    else:
        folder, files = os.path.dirname(os.path.abspath(name)), [name]
        if os.path.basename(name) != RELEASE_SEGMENT:
            return files
    return files + [p for p in _release_codebook_paths(folder) if os.path.isfile(p)]


def load_codebook_npy(path: PathLike) -> torch.Tensor:
    """CAUSE's ``modular.npy`` as a tensor: ``np.load(path, allow_pickle=False)`` only.

    CAUSE writes it with ``np.save(path, codebook.numpy())`` (``train_mediator.py:103-106``: a
    float32 (num_codebook, D) array) and reads it back with ``np.load`` and ``torch.from_numpy``
    (``train_front_door_tr.py:217-226``, ``test_tr.py:215-225``). A file that needs unpickling (an
    object array, or a pickle) is a PermissionError and is never unpickled; a non-float or
    unreadable file a ValueError naming it. Shape and values are checked by the caller.
    """
    name = os.fspath(path)
    try:
        arr = numpy_load(name, what="CAUSE's codebook")
    except ReadRefused:
        raise
    except ValueError as e:
        with open(name, "rb") as fh:
            head = fh.read(6)
        # numpy names allow_pickle both for object arrays in a .npy and for plain pickles
        if "allow_pickle" in str(e) and (head == b"\x93NUMPY" or head[:1] == b"\x80"):
            raise PermissionError(
                f"{name}: this codebook file holds pickled Python objects, not a plain float array; CAUSE saves its "
                f"codebook with np.save (train_mediator.py:105), and it is only read with np.load(allow_pickle=False), "
                f"so this file is refused and nothing in it was run") from None
        raise ValueError(f"{name}: cannot read CAUSE's codebook with np.load (not a .npy file: {e})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"{name}: cannot read CAUSE's codebook with np.load ({type(e).__name__}: {e})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        arr.close()
        raise ValueError(f"{name}: an .npz archive; CAUSE's codebook is one (K, D) array written by np.save")
    if arr.dtype.kind != "f":
        raise ValueError(f"{name}: CAUSE's codebook must be a float (K, D) array, got dtype {arr.dtype} and shape "
                         f"{arr.shape}")
    if arr.dtype not in (np.float16, np.float32, np.float64):  # big-endian or extended: torch needs native floats
        arr = arr.astype(np.float64)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _neither_form(path: str, found: str) -> ValueError:
    return ValueError(
        f"{path}: not CAUSE heads in either form; found {found}. Expected (1) DHR's CAUSE_<dataset>.pt, a dict with "
        f"'decoder' (a Segment_TR state dict, keys 'head_ema.*') and 'codebook' (K, D) (core/uss/models.py:127-129); "
        f"(2) CAUSE's release folder CAUSE/<dataset>/<baseline>/<num_codebook>/ holding {RELEASE_SEGMENT}, with "
        f"its codebook in CAUSE/<dataset>/modularity/<baseline>/<num_codebook>/{RELEASE_CODEBOOK} or beside it; "
        f"or (3) that {RELEASE_SEGMENT} file itself")


def _listing(folder: str) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(folder))
    return "an empty folder" if not names else (
        f"a folder holding {names[:10]}" + (f" and {len(names) - 10} more" if len(names) > 10 else ""))


def _read_dhr_heads(name: str, obj: Mapping, width: int, backbone: str) -> Tuple[Mapping, torch.Tensor, str]:
    """DHR's ``CAUSE_<dataset>.pt``: ``{'decoder': Segment_TR state dict, 'codebook': (K, D)}``."""
    missing = [k for k in ("decoder", "codebook") if k not in obj]
    if missing:
        raise ValueError(f"{name}: the CAUSE heads file has no key(s) {missing} (keys: {sorted(map(str, obj))[:8]}); "
                         f"DHR's CAUSE_<dataset>.pt holds 'decoder' and 'codebook' (core/uss/models.py:127-129)")
    codebook = _check_codebook(obj["codebook"], width, f"{name} ['codebook']", backbone)
    return obj["decoder"], codebook, f"{name} ['decoder']"


def _read_release(segment_file: str, sd: Mapping, width: int, backbone: str) -> Tuple[Mapping, torch.Tensor, str]:
    """CAUSE's ``segment_tr.pth`` (a whole Segment_TR's state dict) and its ``modular.npy``."""
    folder = os.path.dirname(os.path.abspath(segment_file))
    m = _CAUSE_BASELINE.match(os.path.basename(os.path.dirname(folder)))
    if m and m.group(1) != "dinov2":
        raise ValueError(f"{segment_file}: this is CAUSE's release for {m.group(0)} ({_describe_baseline(m)}); "
                         f"CAUSEExtractor runs on DINOv2 ViTs with 14-pixel patches only (CAUSE's dinov2_vit_base_14 "
                         f"releases, or DHR's CAUSE_<dataset>.pt)")
    if not all(isinstance(k, str) for k in sd):
        raise ValueError(f"{segment_file}: must be a state dict with string keys, got {what_is(sd)}")
    if any(k.startswith("module.") for k in sd):
        # CAUSE unwraps DistributedDataParallel before saving (train_front_door_tr.py:208, fine_tuning_tr.py:178)
        raise ValueError(f"{segment_file}: keys start with 'module.' ({sorted(sd)[:3]}...), a DistributedDataParallel "
                         f"wrapper's state dict; CAUSE saves segment.state_dict() of the unwrapped Segment_TR "
                         f"(train_front_door_tr.py:208,292-300) and its strict=False loader (netloader.py:62) would "
                         f"skip every such key. Save the unwrapped module's state dict instead")
    not_tensors = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{segment_file}: must map names to tensors; {not_tensors[:5]} are not tensors")
    # Strict on the whole file (CAUSE's own loader is strict=False, netloader.py:62, and would pass
    # a file that is not a Segment_TR): the EMA head is checked where it is built, the rest here.
    head = _head_ema_keys()
    expected = {"head." + k[len("head_ema."):] for k in head} | set(_RELEASE_EXTRA_KEYS)
    rest = {k for k in sd if not k.startswith("head_ema.")}
    missing, unexpected = sorted(expected - rest), sorted(rest - expected)
    if missing or unexpected:
        raise _key_mismatch(f"{segment_file} does not match CAUSE's Segment_TR (modules/segment.py:27-47):",
                            missing, unexpected)
    q = sd.get("head_ema.query_pos")
    if isinstance(q, torch.Tensor) and q.ndim == 2 and q.shape[0] != CAUSE_QUERIES:
        patch = _QUERIES_OF_PATCH.get(int(q.shape[0]))
        trained = (f" = 320**2 // {patch}**2: CAUSE trained it for a backbone with {patch}-pixel patches (DINO, "
                   f"iBOT, MSN or MAE)") if patch else ""
        raise ValueError(f"{segment_file}: 'head_ema.query_pos' has {q.shape[0]} rows{trained}; CAUSE's DINOv2 "
                         f"release has {CAUSE_QUERIES} = 322**2 // 14**2 (train_front_door_tr.py:342-349), and "
                         f"CAUSEExtractor runs on DINOv2 ViTs with 14-pixel patches only")
    codebook = None
    found = []
    for path in _release_codebook_paths(folder):
        if os.path.isfile(path):
            cb = _check_codebook(load_codebook_npy(path), width, path, backbone)
            if codebook is not None and not torch.equal(cb, codebook):
                raise ValueError(f"{found[0]} and {path} are both CAUSE codebooks for {segment_file} and they differ; "
                                 f"remove the wrong one")
            codebook = codebook if codebook is not None else cb
            found.append(path)
    if codebook is None:
        upstream, beside = _release_codebook_paths(folder)
        raise FileNotFoundError(f"{segment_file}: CAUSE's codebook {RELEASE_CODEBOOK} was not found; looked for "
                                f"{upstream} (CAUSE's layout, utils/utils.py:54-62) and {beside}")
    return {k: v for k, v in sd.items() if k.startswith("head_ema.")}, codebook, segment_file


def _read_heads(heads: PathLike, width: int, backbone: str) -> Tuple[Mapping, torch.Tensor, str]:
    """(EMA-head state dict, codebook, what to call the decoder in errors) from any of the three
    forms of ``heads``, told apart by what is on disk (a folder, or the keys of a file)."""
    name = os.fspath(heads)
    if os.path.isdir(name):
        segment_file = os.path.join(name, RELEASE_SEGMENT)
        if not os.path.isfile(segment_file):
            found = _listing(name)
            if os.path.isfile(os.path.join(name, "segment_mlp.pth")):
                found += " (a CAUSE-MLP release; CAUSEExtractor reads CAUSE-TR, the decoder DHR uses)"
            raise _neither_form(name, found)
        return _read_release(segment_file, load_tensor_file(segment_file, "CAUSE segment_tr.pth"), width, backbone)
    if not os.path.exists(name):
        raise FileNotFoundError(f"CAUSE heads file or folder {name} does not exist")
    obj = load_tensor_file(name, "CAUSE heads file")
    if not isinstance(obj, Mapping):
        raise _neither_form(name, f"{what_is(obj)} (the heads file must be a dict)")
    keys = [k for k in obj if isinstance(k, str)]
    if "cluster_probe" in obj:
        raise ValueError(f"{name}: this is CAUSE's cluster_tr.pth (its Cluster: 'codebook' and 'cluster_probe', "
                         f"modules/segment_module.py:92-110), not the decoder; pass {RELEASE_SEGMENT} beside it, or "
                         f"their folder")
    if "decoder" in obj or "codebook" in obj:
        return _read_dhr_heads(name, obj, width, backbone)
    if any(k.startswith(("head_ema.", "module.head_ema.")) for k in keys):
        return _read_release(name, obj, width, backbone)
    raise _neither_form(name, what_is(obj))
