"""The paper-literal baseline of Eq. 1-3, kept only as the benchmarks' point of comparison.

Exactly what a reader of Sec. 3.2 would write first: one scikit-learn ``KMeans(n_init=10)`` per
image and class on the normalised pixel embeddings, every centroid kept, Eq. 1 as the full
N_fg x N_bg matrix of (1 - cos) / 2, then the stable top-ceil(alpha N) mean of Eq. 2-3.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Tuple

import numpy as np
from sklearn.cluster import KMeans


def _cos_dist_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    an = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    bn = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (1.0 - an @ bn.T) / 2.0


def paper_literal_select(
    samples: Iterable[Tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    *,
    alpha: float = 0.4,
    k_fg: int = 2,
    k_bg: int = 2,
    ignore_index: int = 255,
    seed: int = 0,
) -> Dict[int, np.ndarray]:
    """class id -> debiased centroid (D,), from (features (D,h,w), label (h,w)) numpy pairs."""
    fg: Dict[int, List[np.ndarray]] = {}
    bg: List[np.ndarray] = []
    for feats, label in samples:
        D = feats.shape[0]
        x = feats.reshape(D, -1).T.astype(np.float64)
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        y = label.reshape(-1)
        for c in np.unique(y):
            if c == ignore_index:
                continue
            pts = x[y == c]
            k = min(k_bg if c == 0 else k_fg, len(np.unique(pts, axis=0)))
            cents = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(pts).cluster_centers_
            if c == 0:
                bg.append(cents)
            else:
                fg.setdefault(int(c), []).append(cents)
    bg_all = np.concatenate(bg)
    out: Dict[int, np.ndarray] = {}
    for c, lst in fg.items():
        v = np.concatenate(lst)
        dist = _cos_dist_matrix(v, bg_all).mean(1)  # Eq. 1, the full matrix
        order = np.argsort(-dist, kind="stable")
        n = max(1, math.ceil(round(len(v) * alpha, 9)))
        out[c] = v[order[:n]].mean(0)
    return out
