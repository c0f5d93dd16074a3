"""Reading DINO/DINOv2 ViT weights: checkpoint files (:func:`load_checkpoint`, refusing to unpickle
unless told to), Lightning state dicts and prefixes, and a :class:`~mars_plugin.adapters.uss.vit.DinoViT`
of the variant a state dict's shapes and names describe (:func:`vit_from_state_dict`, strict).

The variants and their upstream sources are described in :mod:`mars_plugin.adapters.uss.vit`.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import types
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from mars_plugin.adapters.uss.vit import DinoViT, describe_vit, heads_for_width
from mars_plugin.formats.bounded_load import ReadRefused, torch_load

__all__ = [
    "vit_from_state_dict",
    "vit_state_dict_keys",
    "load_checkpoint",
    "select_prefix",
    "state_dict_of",
]

PathLike = Union[str, os.PathLike]


def vit_state_dict_keys(depth: int, qkv_bias: bool = True) -> List[str]:
    """The state-dict keys of a DINO ViT of ``depth`` blocks (DINO's and timm's names)."""
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    for i in range(depth):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            if layer == "attn.qkv" and not qkv_bias:
                keys.append(f"blocks.{i}.{layer}.weight")
                continue
            keys += [f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"]
    return keys + ["norm.weight", "norm.bias"]


_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.")
_LS_RE = re.compile(r"^blocks\.\d+\.ls[12]\.gamma$")
_W12_RE = re.compile(r"^blocks\.\d+\.mlp\.w12\.weight$")
_FC1_RE = re.compile(r"^blocks\.\d+\.mlp\.fc1\.weight$")


def _need(sd: Mapping[str, Any], key: str, what: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"{what}: missing key {key!r}; this is not a DINO ViT state dict (keys start with "
                         f"{sorted(sd)[:5]}...)")
    v = sd[key]
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{what}: {key!r} is a {type(v).__name__}, not a tensor")
    return v


def vit_from_state_dict(
    sd: Mapping[str, torch.Tensor],
    *,
    num_heads: Optional[int] = None,
    qkv_bias: Optional[bool] = True,
    what: str = "ViT state dict",
    interpolate_offset: Optional[float] = None,
    interpolate_antialias: Optional[bool] = None,
) -> DinoViT:
    """Build a :class:`DinoViT` of the variant the weights' shapes describe, and load them strictly.

    Read from the shapes: patch size and width from ``patch_embed.proj.weight`` (D, 3, p, p),
    depth from the ``blocks.N`` indices (which must run 0..depth-1), MLP width from
    ``blocks.N.mlp.fc1.weight``, position grid from ``pos_embed`` (1, 1 + N, D). Heads:
    ``num_heads`` or :func:`heads_for_width`. ``qkv_bias``: every DINO/STEGO/Leopart/DINOv2
    variant has one (``qkv_bias=True``, DINO l. 243-254), so a missing ``attn.qkv.bias`` is an
    error; None reads it from ``blocks.0`` (timm models without it).

    DINOv2 (``dinov2_vit{s,b,l,g}14[_reg4]_pretrain.pth``, flat state dicts) is read from the
    names: any ``blocks.N.ls{1,2}.gamma`` -> LayerScale; ``mask_token`` -> the (1, D) mask token;
    ``register_tokens`` (1, R, D) -> R registers; any ``blocks.N.mlp.w12.weight`` -> ViT-g's
    SwiGLU MLP (hidden width = half its rows). The position-embedding interpolation follows the
    hub's builders (``dinov2/hub/backbones.py``): with registers ``interpolate_offset=0.0,
    interpolate_antialias=True`` (l. 107-108 and the other ``_reg`` builders), else 0.1 and no
    antialias (l. 27-28, also DINO v1's); ``interpolate_offset`` / ``interpolate_antialias``
    override that.

    Every key of the model must be in ``sd`` and ``sd`` must hold nothing else: a
    :class:`ValueError` names the missing and the unexpected keys (callers strip prefixes and
    drop heads first).
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"{what} must be a mapping of names to tensors, got {type(sd).__name__}")
    dim, in_chans, patch, num_patches = _patch_shapes(sd, what)
    depth = _depth(sd, what)
    # DINOv2's parts are detected from any block, so that one missing key is reported as missing
    # (not as a family of unexpected ones).
    layer_scale = any(_LS_RE.match(k) for k in sd)
    hidden, swiglu = _mlp_width(sd, dim, what)
    regs = _register_count(sd, dim, what)
    # dinov2/hub/backbones.py:27-28 (plain) and 107-108 (every _reg builder).
    offset = (0.0 if regs else 0.1) if interpolate_offset is None else interpolate_offset
    antialias = bool(regs) if interpolate_antialias is None else interpolate_antialias
    if qkv_bias is None:
        qkv_bias = "blocks.0.attn.qkv.bias" in sd
    heads = num_heads if num_heads is not None else heads_for_width(dim)
    model = DinoViT(
        patch, dim, depth, heads, hidden, num_patches, qkv_bias, in_chans,
        layer_scale=layer_scale, num_register_tokens=regs, mask_token="mask_token" in sd,
        ffn="swiglu" if swiglu else "mlp", interpolate_offset=offset, interpolate_antialias=antialias,
    )
    _check_same_keys(model, sd, what)
    try:
        model.load_state_dict(dict(sd), strict=True)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{what}: {e}") from e
    return model.eval()


def _patch_shapes(sd: Mapping[str, Any], what: str) -> Tuple[int, int, int, int]:
    """(width D, input channels, patch p, patch positions N) from ``patch_embed.proj.weight`` and ``pos_embed``."""
    w = _need(sd, "patch_embed.proj.weight", what)
    if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"{what}: patch_embed.proj.weight must be (D, C, p, p), got {tuple(w.shape)}")
    dim, in_chans, patch = int(w.shape[0]), int(w.shape[1]), int(w.shape[-1])
    pos = _need(sd, "pos_embed", what)
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != dim:
        raise ValueError(f"{what}: pos_embed must be (1, 1 + N, {dim}), got {tuple(pos.shape)}")
    num_patches = int(pos.shape[1]) - 1
    if math.isqrt(num_patches) ** 2 != num_patches:
        raise ValueError(f"{what}: pos_embed holds {num_patches} patch positions, not a square grid")
    return dim, in_chans, patch, num_patches


def _depth(sd: Mapping[str, Any], what: str) -> int:
    """The number of transformer blocks, from the ``blocks.N`` indices (which must run 0..depth-1)."""
    indices = sorted({int(m.group(1)) for k in sd for m in [_BLOCK_RE.match(k)] if m})
    if not indices:
        raise ValueError(f"{what}: no 'blocks.N.*' keys, so no transformer blocks to load")
    depth = indices[-1] + 1
    if indices != list(range(depth)):
        gaps = sorted(set(range(depth)) - set(indices))
        raise ValueError(f"{what}: blocks {gaps} are missing (found blocks {indices[0]}..{indices[-1]})")
    return depth


def _mlp_width(sd: Mapping[str, Any], dim: int, what: str) -> Tuple[int, bool]:
    """(hidden width, SwiGLU or not) of the blocks' MLP: from ``mlp.w12`` (ViT-g's SwiGLU) or ``mlp.fc1``."""
    swiglu = [k for k in sd if _W12_RE.match(k)]
    if swiglu:
        w12 = _need(sd, min(swiglu, key=_natural), what)
        if w12.ndim != 2 or w12.shape[0] % 2:
            raise ValueError(f"{what}: {min(swiglu, key=_natural)!r} must be (2 * hidden, {dim}), got {tuple(w12.shape)}")
        return int(w12.shape[0]) // 2, True
    fc1 = [k for k in sd if _FC1_RE.match(k)]
    return int(_need(sd, min(fc1, key=_natural) if fc1 else "blocks.0.mlp.fc1.weight", what).shape[0]), False


def _register_count(sd: Mapping[str, Any], dim: int, what: str) -> int:
    """R, DINOv2's register tokens (``register_tokens`` (1, R, D)); 0 without them."""
    if "register_tokens" not in sd:
        return 0
    r = _need(sd, "register_tokens", what)
    if r.ndim != 3 or r.shape[0] != 1 or r.shape[2] != dim or r.shape[1] < 1:
        raise ValueError(f"{what}: register_tokens must be (1, R, {dim}), got {tuple(r.shape)}")
    return int(r.shape[1])


def _check_same_keys(model: DinoViT, sd: Mapping[str, Any], what: str) -> None:
    """Refuse a state dict that lacks a key of ``model`` or holds one it does not have, naming them."""
    expected = set(model.state_dict())
    missing = sorted(expected - set(sd), key=_natural)
    unexpected = sorted(set(sd) - expected, key=_natural)
    if missing or unexpected:
        msg = [f"{what} does not match a {'' if model.is_dinov2 else 'DINO '}{describe_vit(model)}:"]
        if missing:
            msg.append(f"missing keys {_short(missing)}")
        if unexpected:
            msg.append(f"unexpected keys {_short(unexpected)}")
        raise ValueError(" ".join(msg))


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _short(keys: List[str], n: int = 8) -> str:
    s = ", ".join(repr(k) for k in keys[:n])
    return f"[{s}{', ... %d more' % (len(keys) - n) if len(keys) > n else ''}]"


# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------


class _Stub:
    """Stand-in for a class whose module is not installed (an omegaconf DictConfig, a Lightning
    AttributeDict...): it swallows whatever the pickle passes (constructor arguments, state,
    dict items, list items), so the tensors next to it load. A plain ``object`` underneath, so
    pickle can build it by NEWOBJ, REDUCE or copyreg's reconstructor alike."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.__dict__["args"] = args

    def __setstate__(self, state):
        self.__dict__["state"] = state

    def __setitem__(self, key, value):  # SETITEM(S) of a dict subclass
        self.__dict__.setdefault("items", {})[key] = value

    def __getitem__(self, key):
        return self.__dict__.get("items", {})[key]

    def append(self, item):  # APPEND(S) of a list subclass
        self.__dict__.setdefault("elements", []).append(item)

    def extend(self, items):
        self.__dict__.setdefault("elements", []).extend(items)

    def __call__(self, *args, **kwargs):  # a stubbed function used as a REDUCE callable
        return _Stub(*args)


def _lenient_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` whose unpickler stubs out classes it cannot import."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return type(name, (_Stub,), {"__module__": f"missing:{module}"})

    mod = types.ModuleType("mars_lenient_pickle")
    mod.Unpickler = Unpickler
    mod.load = pickle.load
    mod.loads = pickle.loads
    mod.UnpicklingError = pickle.UnpicklingError
    return mod


def load_checkpoint(path: PathLike, *, trust_pickle: bool = False, what: str = "checkpoint") -> Any:
    """``torch.load`` a checkpoint on the CPU, refusing to unpickle unless told to.

    First ``weights_only=True`` (tensors, dicts, lists, numbers only: never runs code). Lightning
    checkpoints usually need more: STEGO's ``hyper_parameters`` hold an omegaconf ``DictConfig``
    (``src/train_segmentation.py:106``, ``save_hyperparameters()``). Such a file raises a
    :class:`PermissionError` naming the Python objects it holds, unless ``trust_pickle=True``;
    then it is unpickled (``weights_only=False``) with classes whose modules are not installed
    (omegaconf, pytorch_lightning) replaced by inert stubs, since only the state dict is used.
    A file torch cannot read at all raises a :class:`ValueError`.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return torch_load(path)
    except ReadRefused:
        raise
    except pickle.UnpicklingError as e:
        first_error = e
    except Exception as e:  # noqa: BLE001 - torch raises many kinds on non-checkpoint files
        raise ValueError(f"{path}: cannot read {what} with torch.load ({type(e).__name__}: {_first_line(e)})") from e
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except pickle.UnpicklingError:  # a pickle the weights-only parser cannot scan (protocol 0/1)
        unsafe = ["objects in an old pickle protocol"]
    except Exception:  # noqa: BLE001 - not a zip checkpoint at all
        raise ValueError(
            f"{path}: cannot read {what} with torch.load ({_first_line(first_error)})"
        ) from first_error
    if not unsafe:
        raise ValueError(f"{path}: cannot read {what} with torch.load ({_first_line(first_error)})") from first_error
    if trust_pickle is not True:
        raise PermissionError(
            f"{path}: this {what} holds pickled Python objects besides its weights ({', '.join(unsafe[:6])}"
            f"{', ...' if len(unsafe) > 6 else ''}); unpickling can run arbitrary code, so it is only opened with "
            f"trust_pickle=True (CLI: --trust-pickle). Pass it if you trust where the file comes from "
            f"(Lightning checkpoints store their hyper-parameters this way)."
        )
    try:
        return torch_load(path, weights_only=False, pickle_module=_lenient_pickle_module())
    except ReadRefused:
        raise
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: cannot unpickle {what} ({type(e).__name__}: {_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def select_prefix(sd: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    """The entries of ``sd`` under ``prefix``, with the prefix removed."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def state_dict_of(obj: Any, path: PathLike, what: str) -> Dict[str, Any]:
    """A Lightning checkpoint's ``state_dict``, or the object itself when it is a flat dict of tensors."""
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        return dict(obj["state_dict"])
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj)
    keys = sorted(obj)[:10] if isinstance(obj, Mapping) else None
    raise ValueError(
        f"{os.fspath(path)}: expected a Lightning checkpoint with a 'state_dict' or a flat dict of tensors as the "
        f"{what}, got {type(obj).__name__}" + (f" with keys {keys}" if keys is not None else "")
    )
