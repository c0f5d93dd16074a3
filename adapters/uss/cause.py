"""CAUSE features (Kim et al., Pattern Recognition 2024) as DHR computes them, for MARS, from DHR's
heads file or from CAUSE's own release.

DHR (shjo-april/DHR @ 94d5189, the MARS authors' follow-up) trains with CAUSE features on a
DINOv2 backbone. What it computes, read from its code (file:line of that commit):

* ``CAUSE`` (``core/uss/models.py:115-150``) holds ``backbone = DINOv2(arch, 14)`` (l. 119; the
  torch.hub ``dinov2_vit?14`` model, l. 78-84) and ``segment = Segment_TR(D, 90, 322**2 // 14**2)``
  (l. 125: 529 queries). The heads file ``weights/CAUSE_<dataset>.pt`` is ``{'decoder': ...,
  'codebook': ...}``: ``segment.load_state_dict(checkpoint['decoder'])`` (default ``strict=True``)
  and ``segment.head_ema.codebook = checkpoint['codebook']`` (l. 127-129), a plain attribute,
  not a parameter. ``pe`` is a copy of ``head_ema.query_pos`` (l. 131).
* ``forward`` (l. 143-150): ``z = backbone.forward_features(images)[:, 1:, :]``, the tokens after
  DINOv2's final LayerNorm without [CLS] (l. 102-113); ``pe = interpolate_pe(pe, fh * fw)``
  (``core/uss/utils.py:7-8``: ``F.interpolate(pe.T[None], N, mode='linear')``, align_corners
  False, so the 529 rows are resampled linearly to N rows); ``segment.head_ema(z, (fh, fw), pe)``.
* ``Segment_TR`` (``core/uss/layers.py:84-92``) holds only ``head_ema``, a ``CauseDecoder``
  (l. 68-82): ``query_pos`` (529, D) and ``tr = TRDecoder(D, 90)`` (l. 36-66): ``self_attn`` and
  ``multihead_attn`` = ``nn.MultiheadAttention(D, 1, dropout=0.0)`` in (N, B, D) layout,
  ``linear1`` (D -> 2048), ``linear2`` (2048 -> D), ``norm1..3`` = ``nn.LayerNorm(D)`` (eps
  1e-5), ``f1`` = ``Conv2d(D, 90, 1)``, ``f2`` = ``Sequential(Conv2d(D, D, 1), ReLU, Conv2d(D,
  90, 1))``.
* ``CauseDecoder.forward`` (l. 77-82): the target is ``vqt(z, codebook)``: each token replaced by
  the codebook row of largest cosine similarity (``layers.py:20-34``: both sides
  ``F.normalize``-d, ``argmax``, which takes the first row on ties); memory = z; pos = pe.
* ``TRDecoder.forward`` (l. 52-66), post-norm, no dropout in the layer:
  ``t = norm1(tgt + self_attn(q=tgt+pe, k=tgt+pe, v=tgt))``;
  ``t = norm2(t + multihead_attn(q=t+pe, k=z, v=z))`` (no positional term on the key);
  ``t = norm3(t + linear2(relu(linear1(t))))``; ``u = z + t`` (the *unquantised* tokens added
  after the last norm, l. 62); nothing else is normalised; the code is ``f1(u) + f2(u)`` on the
  (B, D, fh, fw) map (tokens row-major, ``transform``, l. 5-11), a (B, 90, fh, fw) map (l. 63-65,
  82).
* DHR's features: ``inference(model, Normalize(image))`` (``produce_uss_features.py:12,17,32-34``,
  ``core/uss/__init__.py:54-74``), i.e. :func:`~mars_plugin.adapters.uss.multiscale.multiscale` on the
  full-resolution image, not L2-normalised: ``CAUSEExtractor.from_files(b, h, **DHR_SETTINGS)``.

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
  resampled as DHR does, the code is the same there (:func:`resample_queries` is the identity at
  529) and defined at any size.
* Backbones: CAUSE releases CAUSE-TR for DINO ViT-S/8, S/16, B/8, DINOv2 ViT-B/14, iBOT ViT-B/16,
  MSN ViT-S/16 and MAE ViT-B/16 (``README.md:67-117``). Only DINOv2 ViT/14 is supported here
  (DHR's backbone family, and the one our DINOv2 ViT loads): a release folder named for another
  baseline or a ``head_ema.query_pos`` of other than 529 rows is refused. CAUSE's DINOv2 model
  returns the final-LayerNorm tokens, ``[:, 1:]`` taken as in DHR (``models/dinov2vit.py:631-640``,
  ``train_front_door_tr.py:58``).

What we do differently: our modules run attention in (B, N, D) layout (``batch_first=True``; the
state-dict keys do not depend on it) and without the attention-weight output DHR discards, so the
numbers agree to float32 rounding; the quantisation always runs in float32 (also under fp16
autocast, where near ties could otherwise flip). Our backbone drops DINOv2's register tokens as
well as [CLS] (``patch_token_sequence``); DHR's ``[:, 1:]`` would keep registers, but DHR's hub
models have none. ``patch_size`` is the backbone's (14 for DINOv2); the queries are resampled to
any token count, as in DHR.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.adapters.uss.code_extractor import CodeExtractor, load_tensor_file, what_is
from mars_plugin.adapters.uss.multiscale import DHR_SETTINGS
from mars_plugin.adapters.uss.vit import DinoViT, describe_vit
from mars_plugin.adapters.uss.vit_weights import vit_from_state_dict

__all__ = [
    "CAUSEExtractor",
    "CAUSESegment",
    "CAUSEHead",
    "CAUSEDecoderLayer",
    "quantize_cosine",
    "resample_queries",
    "load_codebook_npy",
    "DHR_SETTINGS",
]

PathLike = Union[str, os.PathLike]

#: DHR's decoder sizes: 90 output channels (``core/uss/models.py:116``), 322**2 // 14**2 = 529
#: queries (l. 125), FFN width 2048 and one attention head (``core/uss/layers.py:37``).
CAUSE_DIM, CAUSE_QUERIES, CAUSE_HIDDEN = 90, 529, 2048
#: The file names of CAUSE's own release (``train_front_door_tr.py:299``, ``utils/utils.py:61``).
RELEASE_SEGMENT, RELEASE_CODEBOOK = "segment_tr.pth", "modular.npy"


def quantize_cosine(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Each token replaced by the codebook row most cosine-similar to it (CAUSE's ``vqt``).

    Shapes: ``z`` (..., D), ``codebook`` (K, D) -> (..., D), rows of ``codebook``. Both sides are
    L2-normalised (``F.normalize``, eps 1e-12) and the row of largest dot product wins; on ties the
    first such row (``argmax``), as ``core/uss/layers.py:20-34``. Computed in float32 at least
    (also under fp16 autocast, where near ties could flip).
    """
    dtype = torch.promote_types(torch.promote_types(z.dtype, codebook.dtype), torch.float32)
    c = codebook.to(dtype)
    sim = F.normalize(z.to(dtype), dim=-1) @ F.normalize(c, dim=-1).t()
    return c[sim.argmax(dim=-1)]


def resample_queries(query_pos: torch.Tensor, n: int) -> torch.Tensor:
    """The (Q, D) learned query positions resampled to (n, D) along the first axis.

    DHR's ``interpolate_pe`` (``core/uss/utils.py:7-8``): 1-D linear interpolation with
    align_corners False over the row index (not over a 2-D grid: the tokens' row-major order is
    treated as one sequence), the identity when ``n == Q``.
    """
    return F.interpolate(query_pos.t()[None], size=int(n), mode="linear", align_corners=False)[0].t()


class CAUSEDecoderLayer(nn.Module):
    """CAUSE's one-layer transformer decoder and its two projection heads (DHR's ``TRDecoder``,
    ``core/uss/layers.py:36-66``); submodule names as upstream, so state-dict keys match.

    Shapes: ``forward(tgt, memory, pos, grid)``: ``tgt``, ``memory`` (B, N, D), ``pos`` (N, D),
    ``grid`` = (h, w) with h * w = N -> (B, reduced_dim, h, w).
    """

    def __init__(self, dim: int, reduced_dim: int = CAUSE_DIM, hidden_dim: int = CAUSE_HIDDEN, nhead: int = 1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, nhead, batch_first=True)
        self.multihead_attn = nn.MultiheadAttention(dim, nhead, batch_first=True)
        self.linear1 = nn.Linear(dim, hidden_dim)
        self.linear2 = nn.Linear(hidden_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.f1 = nn.Conv2d(dim, reduced_dim, 1)
        self.f2 = nn.Sequential(nn.Conv2d(dim, dim, 1), nn.ReLU(), nn.Conv2d(dim, reduced_dim, 1))

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, pos: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        q = tgt + pos
        t = self.norm1(tgt + self.self_attn(q, q, tgt, need_weights=False)[0])
        t = self.norm2(t + self.multihead_attn(t + pos, memory, memory, need_weights=False)[0])
        t = self.norm3(t + self.linear2(F.relu(self.linear1(t))))
        # the unquantised tokens come back here, after the last norm (layers.py:62)
        u = (memory + t).transpose(1, 2).reshape(memory.shape[0], memory.shape[2], *grid)
        return self.f1(u) + self.f2(u)


class CAUSEHead(nn.Module):
    """DHR's ``CauseDecoder`` (``core/uss/layers.py:68-82``): ``query_pos`` (Q, D) and ``tr``.

    Shapes: ``forward(z, grid, codebook)``: ``z`` (B, N, D) backbone tokens, row-major over
    ``grid`` = (h, w); ``codebook`` (K, D) -> (B, reduced_dim, h, w). The positional term is
    ``query_pos`` resampled to N rows (:func:`resample_queries`), the target the quantised tokens
    (:func:`quantize_cosine`), the memory the tokens themselves.
    """

    def __init__(self, num_queries: int, dim: int, reduced_dim: int = CAUSE_DIM, hidden_dim: int = CAUSE_HIDDEN):
        super().__init__()
        self.query_pos = nn.Parameter(torch.zeros(num_queries, dim))
        self.tr = CAUSEDecoderLayer(dim, reduced_dim, hidden_dim)

    def forward(self, z: torch.Tensor, grid: Tuple[int, int], codebook: torch.Tensor) -> torch.Tensor:
        pos = resample_queries(self.query_pos, z.shape[1]).to(z.dtype)
        tgt = quantize_cosine(z, codebook).to(z.dtype)
        return self.tr(tgt, z, pos, grid)


class CAUSESegment(nn.Module):
    """DHR's ``Segment_TR`` (``core/uss/layers.py:84-92``): only the EMA head ``head_ema``, so the
    state-dict keys are ``head_ema.query_pos`` and ``head_ema.tr.*``, those of ``checkpoint['decoder']``.

    Shapes: as :class:`CAUSEHead`.
    """

    def __init__(self, dim: int, reduced_dim: int = CAUSE_DIM, num_queries: int = CAUSE_QUERIES,
                 hidden_dim: int = CAUSE_HIDDEN):
        super().__init__()
        self.head_ema = CAUSEHead(num_queries, dim, reduced_dim, hidden_dim)

    @property
    def width(self) -> int:
        return int(self.head_ema.query_pos.shape[1])

    @property
    def dim(self) -> int:
        return int(self.head_ema.tr.f1.out_channels)

    def forward(self, z: torch.Tensor, grid: Tuple[int, int], codebook: torch.Tensor) -> torch.Tensor:
        return self.head_ema(z, grid, codebook)


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
        arr = np.load(name, allow_pickle=False)
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


class CAUSEExtractor(CodeExtractor):
    """CAUSE's 90-d code for whole images: (B, 3, H, W) -> (B, dim, h, w).

    Args:
        backbone: the DINOv2 ViT: an ``nn.Module`` with ``patch_size``, ``embed_dim`` and
            ``patch_token_sequence(x) -> (B, N, D)`` (final-LayerNorm patch tokens, row-major).
        segment: a :class:`CAUSESegment` of width D (the backbone's).
        codebook: (K, D) float tensor, CAUSE's concept codebook (kept as a non-persistent buffer, so
            it follows ``.to(device)`` but ``state_dict()`` holds only ``backbone.*`` and
            ``segment.*``, as DHR keeps it outside the decoder's state dict).
        res: None (default: the image's own resolution, each side rounded to the nearest patch
            multiple; with ``scales``, the image exactly as it is, as DHR feeds it) or the shorter
            side fed to the network.
        scales: None (one scale) or DHR's multi-scale inference at these scales of the base image
            (:func:`~mars_plugin.adapters.uss.multiscale.multiscale`); the first sets the output grid.
        flip_average: average with the horizontally flipped image's code, flipped back (default;
            DHR's ``hflip=True``).
        normalize: L2-normalise each pixel's code after the final resize (default; DHR does not).
        interpolation: the resize to ``res`` (``"bilinear"`` default, or ``"nearest"``).

    ``CAUSEExtractor.from_files(backbone, heads, **DHR_SETTINGS)`` reproduces DHR's features.
    """

    def __init__(
        self,
        backbone: nn.Module,
        segment: CAUSESegment,
        codebook: torch.Tensor,
        *,
        res: Optional[int] = None,
        scales: Optional[Sequence[float]] = None,
        flip_average: bool = True,
        normalize: bool = True,
        interpolation: str = "bilinear",
    ):
        super().__init__()
        if not isinstance(backbone, nn.Module) or not callable(getattr(backbone, "patch_token_sequence", None)):
            raise TypeError(f"backbone must be an nn.Module with patch_token_sequence(x) -> (B, N, D) (the DINOv2 "
                            f"DinoViT), got {type(backbone).__name__}")
        patch, width = getattr(backbone, "patch_size", None), getattr(backbone, "embed_dim", None)
        if not isinstance(patch, int) or patch < 1 or not isinstance(width, int) or width < 1:
            raise TypeError(f"backbone must have integer patch_size and embed_dim, got {patch!r} and {width!r}")
        if not isinstance(segment, CAUSESegment):
            raise TypeError(f"segment must be a CAUSESegment (DHR's Segment_TR), got {type(segment).__name__}")
        if segment.width != width:
            raise ValueError(f"segment is {segment.width} wide but the backbone is {width} wide")
        if not isinstance(codebook, torch.Tensor) or not codebook.is_floating_point():
            raise TypeError(f"codebook must be a float (K, D) tensor, got {what_is(codebook) if not isinstance(codebook, torch.Tensor) else codebook.dtype}")
        if codebook.ndim != 2 or codebook.shape[0] < 1 or codebook.shape[1] != width:
            raise ValueError(f"codebook must be (K, {width}) with K >= 1 (D = the backbone width), "
                             f"got shape {tuple(codebook.shape)}")
        if not torch.isfinite(codebook).all():
            raise ValueError("codebook holds NaN or infinite values")
        self._set_inputs(patch, res=res, flip_average=flip_average, normalize=normalize,
                         interpolation=interpolation, scales=scales)
        self.backbone = backbone
        self.segment = segment
        self.register_buffer("codebook", codebook.detach().float().clone(), persistent=False)
        self.eval()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_files(cls, backbone: PathLike, heads: PathLike, **kwargs: Any) -> "CAUSEExtractor":
        """CAUSE from its files: the DINOv2 backbone weights and the heads, in DHR's or CAUSE's form.

        ``backbone``: a flat state dict of DINOv2 weights (the torch.hub model's ``state_dict()``,
        or CAUSE's ``checkpoint/dinov2_vit_base_14.pth``), built and loaded strictly by
        :func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict` (variant from the shapes); it must
        be a DINOv2 model with 14-pixel patches, as DHR's ``DINOv2(arch, 14)``
        (``core/uss/models.py:119``). DINO v1, iBOT, MSN and MAE backbones are refused.

        ``heads``, told apart by what is on disk:

        1. DHR's ``CAUSE_<dataset>.pt``, ``{'decoder': Segment_TR state dict (keys head_ema.*),
           'codebook': (K, D) tensor}`` (``core/uss/models.py:127-129``); other top-level keys are
           not read, as in DHR.
        2. CAUSE's release folder ``CAUSE/<dataset>/<baseline>/<num_codebook>/`` holding
           ``segment_tr.pth``: the state dict of CAUSE's whole ``Segment_TR``
           (``modules/segment.py:27-47``: ``head.*``, ``projection_head.f.*``, ``head_ema.*``,
           ``projection_head_ema.f.*``, ``linear.f.*``, no ``module.`` prefix), of which the EMA
           head ``head_ema.*`` is what CAUSE's inference runs (``test_tr.py:26-28``) and what we
           build; the codebook is ``modular.npy`` in
           ``CAUSE/<dataset>/modularity/<baseline>/<num_codebook>/`` (where CAUSE's scripts read
           it, ``utils/utils.py:54-62``) or beside ``segment_tr.pth``. ``cluster_tr.pth`` is not
           read: it holds CAUSE's ``Cluster`` (``segment_module.py:92-110``), the cluster probe
           used for CAUSE's own evaluation and a copy of the codebook, not needed for the features.
        3. That ``segment_tr.pth`` file itself, its codebook found as in 2.

        Only releases for DINOv2 ViT/14 are read: a folder named for another baseline
        (``dino_vit_base_8``, ...) or a ``head_ema.query_pos`` of other than 529 = 322**2 // 14**2
        rows (CAUSE's 320**2 // 8**2 = 1600 or 320**2 // 16**2 = 400 for its other backbones) is
        refused.

        The decoder is loaded strictly (a missing, unexpected or mis-shaped key is a ValueError
        naming the key and the file), its sizes read from the shapes (90 channels, 529 queries, FFN
        2048 in DHR's and CAUSE's files); the codebook must be a finite float (K, D) with D the
        backbone's width (errors name the file and the shapes). ``.pt``/``.pth`` files are opened
        with ``torch.load(map_location="cpu", weights_only=True)`` only and ``.npy`` files with
        ``np.load(allow_pickle=False)`` only: a file holding pickled Python objects is refused
        with a PermissionError and never unpickled (there is no trust option). Keyword arguments
        go to the constructor.

        Shapes: the codebook (K, D), the decoder's ``head_ema.query_pos`` (529, D).
        """
        bname = os.fspath(backbone)
        bsd = load_tensor_file(backbone, "DINOv2 backbone file")
        if not isinstance(bsd, Mapping) or not all(isinstance(k, str) for k in bsd):
            raise ValueError(f"{bname}: the DINOv2 backbone file must hold a flat state dict, got {what_is(bsd)}")
        not_tensors = sorted(k for k, v in bsd.items() if not isinstance(v, torch.Tensor))
        if not_tensors:
            raise ValueError(f"{bname}: the DINOv2 backbone file must map names to tensors; {not_tensors[:5]} are "
                             f"not tensors")
        model = vit_from_state_dict(bsd, what=f"{bname} (DINOv2 backbone)")
        if model.patch_size != 14 or not model.is_dinov2:
            raise ValueError(f"{bname}: DHR's CAUSE runs on a DINOv2 ViT with 14-pixel patches "
                             f"(core/uss/models.py:74-119); this file holds a {describe_vit(model)}")
        decoder, codebook, what = _read_heads(heads, model.embed_dim, bname)
        segment = _decoder_from_state_dict(decoder, model.embed_dim, what)
        return cls(model, segment, codebook, **kwargs)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.segment.dim

    @property
    def patch_size(self) -> int:
        return int(self.backbone.patch_size)

    def describe(self) -> str:
        net = describe_vit(self.backbone) if isinstance(self.backbone, DinoViT) else type(self.backbone).__name__
        size = "full resolution" if self.res is None else f"shorter side {self.res}, {self.interpolation} resize"
        scales = "" if self.scales is None else f"scales {', '.join(f'{s:g}' for s in self.scales)}, "
        return (
            f"CAUSE on {net}, codebook of {self.codebook.shape[0]}, decoder to dim {self.dim}; {size}, "
            f"{scales}flip averaging {'on' if self.flip_average else 'off'}, "
            f"L2 normalisation {'on' if self.normalize else 'off'}"
        )

    # -- computation -----------------------------------------------------------------------

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """CAUSE's code of normalised images whose sides are multiples of the patch (14).

        Shapes: (B, 3, H, W) -> (B, dim, H / 14, W / 14); DHR's ``CAUSE.forward``
        (``core/uss/models.py:143-150``).
        """
        p = self.patch_size
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"x must be a normalised (B, 3, H, W) batch, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._check_patch_multiple(x)
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        z = self.backbone.patch_token_sequence(x)
        if z.ndim != 3 or z.shape[0] != x.shape[0] or z.shape[1] != grid[0] * grid[1] or z.shape[2] != self.segment.width:
            raise ValueError(f"backbone.patch_token_sequence gave {tuple(z.shape)} for a {tuple(x.shape)} batch; "
                             f"expected ({x.shape[0]}, {grid[0] * grid[1]}, {self.segment.width})")
        return self.segment(z, grid, self.codebook)
