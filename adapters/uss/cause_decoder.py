"""CAUSE's decoder as DHR runs it (``core/uss/layers.py:20-92`` of shjo-april/DHR @ 94d5189): the
cosine quantisation of the tokens, the resampled learned queries, the one-layer transformer decoder
and its two projection heads, and ``Segment_TR``'s EMA head. What DHR computes with them, and how we
differ, is described in :mod:`mars_plugin.adapters.uss.cause`.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CAUSESegment",
    "CAUSEHead",
    "CAUSEDecoderLayer",
    "quantize_cosine",
    "resample_queries",
]

#: DHR's decoder sizes: 90 output channels (``core/uss/models.py:116``), 322**2 // 14**2 = 529
#: queries (l. 125), FFN width 2048 and one attention head (``core/uss/layers.py:37``).
CAUSE_DIM, CAUSE_QUERIES, CAUSE_HIDDEN = 90, 529, 2048


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
