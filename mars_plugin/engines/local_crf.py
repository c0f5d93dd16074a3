"""A batched, GPU-able mean-field CRF with the dense CRF's kernels cut to a local window.

The teacher refinement R of Sec. 3.4 is a dense CRF (Krahenbuhl & Koltun) in the paper; the
``pydensecrf`` implementation runs one image at a time on the CPU, which stalls a GPU training
step. This module runs the same mean-field update for a whole batch in torch, on the tensors'
device, with the pairwise kernels truncated to a ``window`` x ``window`` neighbourhood evaluated
exactly (the idea of ConvCRF, Teichmann & Cipolla 2019), optionally on a grid ``scale`` times
coarser:

    Q_0 = softmax(log p)
    Q_t = softmax(log p + sum_{j in window(i), j != i} k(i, j) Q_{t-1}(j))
    k(i, j) = w_g exp(-|p_i - p_j|^2 / (2 s_g^2))
            + w_b exp(-|p_i - p_j|^2 / (2 s_b^2) - |I_i - I_j|^2 / (2 s_rgb^2))

with p the clipped (1e-5) probabilities, positions p in full-resolution pixels and I the RGB
values in 0..255: pydensecrf's Potts update without its kernel normalisation or permutohedral
approximation. It is an approximation of the dense CRF (the bilateral kernel is cut at the
window), not a copy; README quotes how often its labels agree with ``pydensecrf``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

import torch
import torch.nn.functional as F

from mars_plugin._checks import as_tensor, check_finite, describe, rgb_layout
from mars_plugin.engines.crf_params import DEFAULT_CRF_PARAMS, DEFAULT_MAX_BYTES, check_crf_params

__all__ = ["LOCAL_CRF_DEFAULTS", "local_crf", "check_local_crf_params"]

#: The dense CRF's defaults plus the window (odd, in grid cells) and the grid coarsening.
LOCAL_CRF_DEFAULTS: Dict[str, float] = dict(DEFAULT_CRF_PARAMS, window=11, scale=4)


def check_local_crf_params(params: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    """Merge user overrides into :data:`LOCAL_CRF_DEFAULTS`; unknown keys and bad values are errors."""
    out = check_crf_params(params, LOCAL_CRF_DEFAULTS, ("iterations", "window", "scale"))
    if int(out["window"]) < 3 or int(out["window"]) % 2 == 0:
        raise ValueError(f"crf_params['window'] must be an odd integer >= 3, got {out['window']!r}")
    return out


def _rgb(image: Any, B: int, H: int, W: int, device: torch.device) -> torch.Tensor:
    """(B, 3, H, W) float RGB in 0..255 from uint8 or [0, 1] float, (B, H, W, 3) or (B, 3, H, W)."""
    t = as_tensor(image, "image")
    if t.ndim == 3:
        t = t[None]
    layout = rgb_layout(t.shape[1:], "image", (H, W)) if t.ndim == 4 and t.shape[0] == B else None
    if layout == "chw":
        pass
    elif layout == "hwc":
        t = t.permute(0, 3, 1, 2)
    else:
        raise ValueError(f"image must be (B, H, W, 3) or (B, 3, H, W) with (B, H, W) = {(B, H, W)}, got {describe(t)}")
    if t.dtype == torch.uint8:
        return t.to(device=device, dtype=torch.float32)
    if not t.is_floating_point():
        raise TypeError(f"image must be uint8 or float in [0, 1], got {describe(t)}")
    check_finite(t, "image")
    if float(t.min()) < 0 or float(t.max()) > 1:
        raise ValueError(f"image as a float image must hold values in [0, 1], got {describe(t)}")
    return (t.to(device=device, dtype=torch.float32) * 255).round()


def local_crf(
    probs: torch.Tensor,
    image: Any,
    params: Optional[Mapping[str, Any]] = None,
    *,
    valid: Optional[torch.Tensor] = None,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
) -> torch.Tensor:
    """Windowed mean-field CRF marginals for a batch, on the device of ``probs``.

    Shapes:
        probs: (B, L, H, W) probabilities (each pixel sums to 1 over its valid labels).
        image: (B, H, W, 3) or (B, 3, H, W), uint8 or float in [0, 1].
        valid: optional (B, L) bool; a label that is not valid for an image gets Q = 0 there
            and sends no message, exactly as if the image had only its valid labels.

    Args:
        params: overrides of :data:`LOCAL_CRF_DEFAULTS` (``iterations``, ``gaussian_sxy``,
            ``gaussian_compat``, ``bilateral_sxy``, ``bilateral_srgb``, ``bilateral_compat`` in
            full-resolution pixels, as for :func:`mars_plugin.engines.crf.dense_crf`; ``window``, odd, in
            cells of the coarse grid; ``scale``, the coarsening: probabilities and colours are
            average-pooled by ``scale`` and Q is upsampled bilinearly at the end).

    Returns:
        (B, L, H, W) float32 marginals Q. Memory: about B * (2 L + 8) * window^2 * (H/scale) *
        (W/scale) floats (the kernel, the colour and the message windows); more than
        ``max_bytes`` (default :data:`mars_plugin.engines.crf_params.DEFAULT_MAX_BYTES`, 6 GiB; None: no
        limit) is refused before any work, with the largest window that fits.
    """
    p = as_tensor(probs, "probs")
    if p.ndim != 4 or not p.is_floating_point():
        raise ValueError(f"probs must be a (B, L, H, W) floating tensor, got {describe(p)}")
    check_finite(p, "probs")
    prm = check_local_crf_params(params)
    B, L, H, W = p.shape
    dev = p.device
    rgb = _rgb(image, B, H, W, dev)
    if valid is None:
        ok = torch.ones(B, L, dtype=torch.bool, device=dev)
    else:
        ok = as_tensor(valid, "valid").to(dev)
        if tuple(ok.shape) != (B, L) or ok.dtype != torch.bool:
            raise ValueError(f"valid must be a (B, L) = {(B, L)} bool tensor, got {describe(ok)}")
        if not bool(ok.any(1).all()):
            raise ValueError("valid must allow at least one label per image, got an image with none")
    s, win = int(prm["scale"]), int(prm["window"])
    r = win // 2
    # bytes per window position: the message windows and their product with the kernel (2 L),
    # the colour windows and their differences (6), the kernel (2)
    cells = B * (2 * L + 8) * -(-H // s) * -(-W // s) * 4
    if max_bytes is not None and cells * win * win > max_bytes:
        fit = int(math.isqrt(int(max_bytes // cells)))
        fit -= 1 - fit % 2
        raise ValueError(f"crf_params['window'] = {win} needs about {cells * win * win / 2 ** 30:.2f} GiB for {B} "
                         f"image(s) of {H}x{W} with {L} labels at scale {s}, more than max_bytes = "
                         f"{max_bytes / 2 ** 30:.2f} GiB; " + (f"at most window = {fit} fits" if fit >= 3 else
                                                             "no window fits: use a larger scale or fewer images"))
    p = p.detach().float()
    if s > 1:
        p = F.avg_pool2d(p, s, ceil_mode=True)
        rgb = F.avg_pool2d(rgb, s, ceil_mode=True)
    h, w = p.shape[-2:]
    # Pairwise weights of every (pixel, offset), computed once: (B, window^2, h * w).
    dy, dx = torch.meshgrid(torch.arange(-r, r + 1, device=dev), torch.arange(-r, r + 1, device=dev), indexing="ij")
    pos2 = ((dy.square() + dx.square()).float() * (s * s)).reshape(-1, 1)  # squared distance, full-res pixels
    colours = F.unfold(rgb, win, padding=r).view(B, 3, win * win, h * w)
    col2 = (colours - rgb.view(B, 3, 1, h * w)).square().sum(1)
    inside = F.unfold(torch.ones(1, 1, h, w, device=dev), win, padding=r).view(1, win * win, h * w)
    kernel = (prm["gaussian_compat"] * torch.exp(-pos2 / (2 * prm["gaussian_sxy"] ** 2))
              + prm["bilateral_compat"] * torch.exp(-pos2 / (2 * prm["bilateral_sxy"] ** 2)
                                                    - col2 / (2 * prm["bilateral_srgb"] ** 2)))
    kernel = kernel * inside
    kernel[:, (win * win) // 2] = 0  # no message from a pixel to itself
    log_p = p.clamp_min(1e-5).log().masked_fill(~ok[:, :, None, None], float("-inf"))
    q = log_p.softmax(1)
    for _ in range(int(prm["iterations"])):
        msg = (F.unfold(q, win, padding=r).view(B, L, win * win, h * w) * kernel[:, None]).sum(2)
        q = (log_p + msg.view(B, L, h, w)).softmax(1)
    if s > 1:
        q = F.interpolate(q, size=(H, W), mode="bilinear", align_corners=False)
    return q
