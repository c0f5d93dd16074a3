"""The segmentation networks' memory: a model of what ``mars predict`` (multi-scale + flip
inference, then the CRF) and ``mars train`` (one training step) take, the budget ``max_bytes``
checked against it before any work, and the errors that name the image or the flags, the
numbers and ``--max-memory``, the flag that raises the budget. The dense CRF's own model is
:mod:`mars_plugin.engines.crf_memory`; this module uses it for the CRF's share and follows its
conventions (bytes, ``max_bytes``, ``_gb``'s GiB in messages).

How the network's share is counted, per architecture, without a formula per layer: the network
that :func:`~mars_plugin.networks.deeplab.build_model` builds runs once on the ``meta`` device
(shapes, no memory, no arithmetic) under a dispatch mode that adds every tensor an operator
allocates and subtracts it when it dies (:class:`_LiveBytes`): the peak of live bytes of the
forward (inference, ``torch.no_grad``) or of the forward and backward (training, the saved
activations included). It is traced once per setting at a side :data:`_TRACE_SIDE` that every
stride divides, where each feature map has exactly ``h w / s^2`` positions; any other size is
scaled by ``(h + 16) (w + 16)``, which bounds every ``ceil(h / s)`` of strides up to 16
(:func:`_padded_pixels`). What the trace cannot see is added by hand: the tensors made around
the network (the input at each scale and its mirror, the softmax sum over scales, the labels;
the batch, the loss, the teacher's maps), the weights, their gradients and the optimizer's state,
and :data:`_SLACK` for the CPU convolutions' own buffers (oneDNN's reorders) and the allocator.
Measured peak RSS growth over this model on the CPU: tests/test_memory_budget.py.

The default budget (:func:`default_max_bytes`) is 80% of the memory of the device the network
runs on: the machine's RAM (or the container's limit, cgroup ``memory.max``) on the CPU, the
GPU's memory on CUDA.
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from mars_plugin.engines.crf_memory import crf_memory_bytes

__all__ = [
    "MEMORY_FLAG",
    "default_max_bytes",
    "inference_memory_bytes",
    "train_memory_bytes",
    "check_inference_memory",
    "check_train_memory",
    "check_train_budget",
    "resolve_max_bytes",
]

#: The flag of every command that sets the budget (GiB; ``max_bytes`` in the Python API).
MEMORY_FLAG = "--max-memory"
#: The fraction of the device's memory the default budget takes: the rest is the process itself
#: (torch's libraries, about 0.5 GiB), the page cache and whatever else runs beside it.
_DEFAULT_FRACTION = 0.8
#: The side of the traced images: a multiple of 16, so that every feature map is exactly
#: (side / stride)^2 positions and the scaling by pixels is exact.
_TRACE_SIDE = 128
#: What the traced tensors leave out, per device type. CPU: convolutions reorder their input and
#: output into blocked layouts (oneDNN) and the allocator keeps freed pages: peak RSS growth /
#: the traced tensors measured 1.0-1.5 on ResNet-18/50 DeepLabs at 200-300 px
#: (tests/test_memory_budget.py), and 2.06 in one run of the suite (DeepLabv3+ R18, 256x192,
#: three scales and flip): 2.5 keeps a margin over that. CUDA: the caching allocator's rounding and cuDNN's workspaces,
#: an estimate not yet measured against ``torch.cuda.max_memory_allocated`` (no GPU in the
#: session that wrote this; benchmarks/ is where such a row belongs).
_SLACK = {"cpu": 2.5, "cuda": 1.25}


def _slack(device: Union[str, torch.device]) -> float:
    return _SLACK.get(torch.device(device).type, _SLACK["cpu"])

Config = Mapping[str, Any]


def _gb(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


# ---------------------------------------------------------------------------------- the budget
def _cgroup_limit() -> Optional[int]:
    """The container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's "no limit" 2^63 rounded to pages
            return int(text)
    return None


def default_max_bytes(device: Union[str, torch.device] = "cpu") -> int:
    """The default budget: 80% of the memory of ``device`` (a GPU's total memory; on the CPU
    the machine's RAM, or the container's limit when lower)."""
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device.index if device.index is not None else
                                                 torch.cuda.current_device()).total_memory
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # no sysconf (Windows): the CRF's own default
            from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES

            return int(DEFAULT_MAX_BYTES)
        limit = _cgroup_limit()
        total = min(total, limit) if limit else total
    return int(_DEFAULT_FRACTION * total)


def resolve_max_bytes(max_bytes: Union[None, str, int, float], device: Union[str, torch.device]) -> Optional[int]:
    """A command's ``max_bytes`` argument -> bytes: ``"auto"`` is :func:`default_max_bytes` of
    ``device``, None no limit (as the CRF's ``max_bytes``), a positive number itself (the
    command line's ``--max-memory GIB`` times 2^30)."""
    if isinstance(max_bytes, str) and max_bytes == "auto":
        return default_max_bytes(device)
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, float)) or not math.isfinite(max_bytes) \
            or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive number of bytes, 'auto' or None (no limit), got {max_bytes!r}")
    return int(max_bytes)


# ---------------------------------------------------------------------------------- the trace
class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the tensors alive, and their peak, over the operators run under it: each
    new tensor an operator returns (not a view, not an in-place result) is added, and
    subtracted when it dies (autograd's saved tensors live as long as the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                n = t.numel() * t.element_size()
                self.live += n
                weakref.finalize(t, self._free, n)
        self.peak = max(self.peak, self.live)
        return out


def _key(config: Config) -> Tuple[Any, ...]:
    # (arch, backbone, stride, classes, MSC's extra scales: () without MSC)
    return (str(config["arch"]), str(config["backbone"]),
            None if config.get("output_stride") is None else int(config["output_stride"]), int(config["num_classes"]),
            tuple(float(v) for v in config.get("msc_scales") or ()))


def _meta_model(key: Tuple[Any, ...], dtype: torch.dtype) -> torch.nn.Module:
    from mars_plugin.networks.deeplab import build_model

    arch, backbone, stride, classes, msc = key
    with torch.device("meta"):
        model = build_model(arch, backbone, classes, stride)
        if msc:  # deeplab-pytorch's MSC: the network on every scale
            from mars_plugin.networks.deeplabv2 import MSC

            model = MSC(model, msc)
        return model.to(dtype)


@functools.lru_cache(maxsize=None)
def _weights(key: Tuple[Any, ...]) -> Tuple[int, int]:
    """(bytes of the float32 parameters and buffers, bytes of the parameters alone)."""
    m = _meta_model(key, torch.float32)
    params = sum(p.numel() * 4 for p in m.parameters())
    return params + sum(b.numel() * b.element_size() for b in m.buffers()), params


@functools.lru_cache(maxsize=None)
def _forward_per_pixel(key: Tuple[Any, ...], half: bool) -> float:
    """Peak live bytes of one image's inference forward (eval mode, no gradient) per input pixel."""
    m = _meta_model(key, torch.bfloat16 if half else torch.float32).eval()
    x = torch.empty(1, 3, _TRACE_SIDE, _TRACE_SIDE, device="meta", dtype=next(m.parameters()).dtype)
    with torch.no_grad(), _LiveBytes() as t:
        m(x)
    return t.peak / _TRACE_SIDE ** 2


@functools.lru_cache(maxsize=None)
def _train_per_pixel(key: Tuple[Any, ...], half: bool, frozen_bn: bool) -> Tuple[float, float]:
    """(peak over the forward and backward, live after the forward) of a training step per
    input pixel of a batch of 2 (the network's gradients included)."""
    m = _meta_model(key, torch.bfloat16 if half else torch.float32).train()
    if key[0] == "deeplabv1-wr38":  # as mars train runs it: batch statistics everywhere, conv1a trained
        from mars_plugin.networks.deeplabv1 import seam_train_mode

        seam_train_mode(m)
    if frozen_bn:
        for mod in m.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                mod.eval()
                for p in mod.parameters():
                    p.requires_grad_(False)
    x = torch.empty(2, 3, _TRACE_SIDE, _TRACE_SIDE, device="meta", dtype=next(m.parameters()).dtype)
    with _LiveBytes() as t:
        y = m(x)
        after_forward = t.live
        sum(o.float().sum() for o in (y if isinstance(y, list) else [y])).backward()  # MSC: a list
    return t.peak / (2 * _TRACE_SIDE ** 2), after_forward / (2 * _TRACE_SIDE ** 2)


def _padded_pixels(h: int, w: int) -> int:
    """An upper bound of ``h w`` that every feature map of stride s <= 16 fits in s^2 times:
    ceil(h / s) s <= h + 15."""
    return (int(h) + 16) * (int(w) + 16)


# ---------------------------------------------------------------------------------- the models
def inference_memory_bytes(config: Config, height: int, width: int, *, scales: Sequence[float] = (1.0,),
                           flip: bool = True, fp16: bool = False, batch: int = 1,
                           crf_labels: Optional[int] = None, crf_params: Any = None,
                           crf_max_bytes: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> int:
    """The memory (bytes) of :func:`~mars_plugin.networks.inference.multiscale_probs` then
    :func:`~mars_plugin.networks.inference.labels_from_probs` on ``batch`` images of
    ``height`` x ``width`` with the network of ``config`` (``{"arch", "backbone",
    "output_stride", "num_classes"}``, a checkpoint's ``"model"``): its weights, the images
    (normalised float32, RGB bytes), per scale the scaled input and its mirror, the network's
    activations, the logits upsampled to the image and their softmax, the softmax sum over
    scales, the labels; with ``crf_labels`` the dense CRF's share
    (:func:`~mars_plugin.engines.crf_memory.crf_memory_bytes`, images grouped within
    ``crf_max_bytes``). ``fp16``: the network under bfloat16 autocast (its weights cached in
    half precision). ``device``: where it runs (what the trace leaves out differs, :data:`_SLACK`)."""
    key = _key(config)
    L, B, H, W = key[3] + 1, int(batch), int(height), int(width)
    per_px = _forward_per_pixel(key, bool(fp16))
    weights = _weights(key)[0] * (1.5 if fp16 else 1.0)  # autocast keeps a half copy of each weight
    held = B * H * W * (12 + 3 + 4 * L)  # images, RGB bytes, the sum over scales
    peak = 0.0
    n = 2 * B if flip else B
    for s in scales:
        h, w = max(1, int(H * s)), max(1, int(W * s))
        resize = B * h * w * 12 + n * h * w * 12 * (2 if flip else 0)  # resized, its mirror, the batch of both
        forward = n * h * w * 12 + n * per_px * _padded_pixels(h, w)
        # logits (and their float32 copy under fp16), softmax, softmax at H x W, mirror, their sum
        after = n * h * w * (12 + 4 * L * (3 if fp16 else 2)) + (n + 2 * B) * 4 * L * H * W
        peak = max(peak, resize, forward, after)
    last = B * H * W * (4 * L + 8)  # the finite check's bools, the labels (int64)
    if crf_labels is not None:
        one = crf_memory_bytes(H, W, int(crf_labels), crf_params)
        group = B * one if crf_max_bytes is None else min(B * one, max(one, int(crf_max_bytes)))
        last += group + 2 * B * 4 * L * H * W  # the CRF's unary and its marginals
    return int(_slack(device) * (weights + held + max(peak, last)))


def train_memory_bytes(config: Config, crop: int, batch_size: int, *, amp: bool = False, loss: str = "mars",
                       refine: Optional[str] = "crf", crf_params: Any = "mars", optimizer: str = "sgd",
                       bn: str = "train", device: Union[str, torch.device] = "cpu") -> int:
    """The memory (bytes) one process of ``mars train`` takes for a step on ``batch_size``
    crops of ``crop`` x ``crop``: the student's weights, gradients and the optimizer's state
    (SGD's momentum; AdamW's two moments), the traced forward and backward (the activations
    kept for backward), the batch and the loss's maps; with ``loss="mars"`` the EMA teacher's
    weights and its forward (while the student's activations are kept), and with
    ``refine="crf"`` its dense CRF on the batch (:func:`~mars_plugin.engines.crf_memory.crf_memory_bytes`,
    images grouped within :data:`~mars_plugin.engines.crf_params.DEFAULT_MAX_BYTES`). ``amp``:
    bfloat16 activations and a half copy of the weights. ``device``: as for
    :func:`inference_memory_bytes`."""
    from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES

    key = _key(config)
    L, B, N = key[3] + 1, int(batch_size), int(crop) ** 2
    state, params = _weights(key)
    peak_px, kept_px = _train_per_pixel(key, bool(amp), bn == "frozen")
    scale = max(B, 2) * _padded_pixels(crop, crop)
    weights = state + params * (2 if optimizer == "adamw" else 1) + params  # + state, + gradients
    weights += 0.5 * state if amp else 0
    data = B * N * (12 + 8 + 3 + 8)  # image, label (int64), RGB bytes, the weights of the loss
    ce = 3 * B * N * 4 * L  # the logits in float32, log-softmax and its gradient
    step = peak_px * scale
    if loss == "mars":
        weights += state
        teacher = B * _forward_per_pixel(key, bool(amp)) * _padded_pixels(crop, crop)
        teacher += 6 * B * N * 4 * L  # its logits, softmax, the allowed channels in float64
        if refine == "crf":
            one = crf_memory_bytes(crop, crop, L, crf_params)
            teacher = max(teacher, 6 * B * N * 4 * L + min(B * one, max(one, DEFAULT_MAX_BYTES)))
        step = max(step, kept_px * scale + teacher)
    return int(_slack(device) * (weights + data + ce + step))


# ---------------------------------------------------------------------------------- the checks
def _describe_net(config: Config) -> str:
    from mars_plugin.networks.deeplab import DEFAULT_OUTPUT_STRIDE

    arch = str(config["arch"])
    stride = config.get("output_stride") or DEFAULT_OUTPUT_STRIDE.get(arch)
    return f"{arch} {config['backbone']} at output stride {stride}"


def _example_size(height: int, width: int, fits: float) -> str:
    """An H x W at the aspect ratio of ``height`` x ``width`` scaled by sqrt(``fits``)."""
    f = math.sqrt(max(fits, 0.0))
    return f"{max(1, int(height * f))}x{max(1, int(width * f))}"


def _largest_fit(need: Any, max_bytes: float, hi: float = 1.0) -> float:
    """The largest f in (0, hi] with need(f) <= max_bytes (need increasing), by bisection."""
    lo = 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if need(mid) <= max_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def check_inference_memory(config: Config, height: int, width: int, max_bytes: int, *, name: str,
                           scales: Sequence[float] = (1.0,), flip: bool = True, fp16: bool = False,
                           crf_labels: Optional[int] = None, crf_params: Any = None,
                           device: Union[str, torch.device] = "cpu") -> int:
    """Refuse (ValueError) one ``height`` x ``width`` image, called ``name`` in the message,
    whose prediction (:func:`inference_memory_bytes`, one image a batch) needs more than
    ``max_bytes``: the message gives both numbers, the size that fits and ``--max-memory``.
    Returns the most images of this size a batch may hold within ``max_bytes`` (at least 1)."""
    kw: Dict[str, Any] = dict(scales=scales, flip=flip, fp16=fp16, crf_labels=crf_labels, crf_params=crf_params,
                              crf_max_bytes=max_bytes, device=device)
    need = inference_memory_bytes(config, height, width, **kw)
    if need > max_bytes:
        f = _largest_fit(lambda f: inference_memory_bytes(config, max(1, int(height * math.sqrt(f))),
                                                          max(1, int(width * math.sqrt(f))), **kw), max_bytes)
        scl = ",".join(f"{s:g}" for s in scales)
        raise ValueError(
            f"{name}: a {height}x{width} image needs about {_gb(need)} to predict ({_describe_net(config)}, "
            f"scales {scl}{' with flips' if flip else ''}, {'bfloat16' if fp16 else 'float32'}"
            f"{', CRF' if crf_labels is not None else ''}), more than {MEMORY_FLAG} {_gb(max_bytes)}; at most "
            f"about {_example_size(height, width, f)} fits; pass a larger {MEMORY_FLAG} GIB, smaller --scales, or "
            "downscale the image")
    lo, hi = 1, 1 << 10  # the most that fit, by bisection (the need grows with the batch)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if inference_memory_bytes(config, height, width, batch=mid, **kw) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_train_memory(config: Config, crop: int, batch_size: int, max_bytes: int, **kw: Any) -> int:
    """Refuse (ValueError) a training step (:func:`train_memory_bytes`, ``kw`` its settings)
    that needs more than ``max_bytes``, naming ``--crop``, ``--batch-size``, the network, AMP,
    the numbers, the largest batch or crop that fits and ``--max-memory``. Returns the need."""
    need = train_memory_bytes(config, crop, batch_size, **kw)
    if need <= max_bytes:
        return need
    fit_b = max((b for b in range(1, batch_size) if train_memory_bytes(config, crop, b, **kw) <= max_bytes),
                default=0)
    fit_c = max((c for c in range(32, crop, 32) if train_memory_bytes(config, c, batch_size, **kw) <= max_bytes),
                default=0)
    hints = ([f"--batch-size {fit_b}"] if fit_b else []) + ([f"--crop {fit_c}"] if fit_c else [])
    amp = kw.get("amp", False)
    raise ValueError(
        f"--crop {crop} --batch-size {batch_size}: a training step of {_describe_net(config)} "
        f"({'bfloat16 AMP' if amp else 'float32, no AMP'}, loss {kw.get('loss', 'mars')}) needs about {_gb(need)} "
        f"per process, more than {MEMORY_FLAG} {_gb(max_bytes)}; "
        + (f"{' or '.join(hints)} fits; " if hints else "")
        + f"pass a larger {MEMORY_FLAG} GIB, a smaller --crop or --batch-size, or a smaller --backbone")


def check_train_budget(max_bytes: Union[None, str, int], device: Union[str, torch.device], *, arch: str,
                       backbone: str, output_stride: Optional[int], num_classes: int, crop: int, batch_size: int,
                       world: int = 1, msc_scales: Sequence[float] = (), **kw: Any) -> None:
    """:func:`mars_plugin.commands.train.train`'s check before step 1: one process's share of the
    global batch (``ceil(batch_size / world)``) on ``device`` against ``max_bytes``
    (:func:`resolve_max_bytes`: ``"auto"``, bytes or None); ``kw``: :func:`train_memory_bytes`'s
    settings; ``msc_scales``: deeplab-pytorch's MSC around the network. A ValueError names the
    flags, the numbers and ``--max-memory``."""
    budget = resolve_max_bytes(max_bytes, device)
    if budget is None:
        return
    config = {"arch": arch, "backbone": backbone, "output_stride": output_stride, "num_classes": num_classes,
              "msc_scales": list(msc_scales)}
    check_train_memory(config, int(crop), -(-int(batch_size) // max(1, int(world))), budget, device=device, **kw)
