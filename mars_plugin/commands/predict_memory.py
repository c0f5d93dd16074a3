"""``mars predict``'s memory plan: every image still to predict checked against the memory
budget (``--max-memory``) from its header alone, before any work
(:func:`mars_plugin.networks.memory.check_inference_memory`)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from mars_plugin.runs.errors import one_line
from mars_plugin.networks.memory import check_inference_memory

__all__ = ["memory_plan"]


def memory_plan(model: Any, items: List[Tuple[str, Path]], out_dir: Path, record: Any, max_bytes: Optional[int], *,
                 scales: Tuple[float, ...], flip: bool, fp16: bool, params: Optional[Dict[str, float]],
                 num_classes: Optional[int], device: torch.device
                 ) -> Tuple[Dict[str, str], Dict[Tuple[int, int], int]]:
    """Each image still to predict against ``max_bytes``, from its header (PIL reads the size
    without decoding): ({stem: why} of those refused, {(H, W): the most images of that size a
    batch holds}). Only a network that says what it is (``model.config``, the DeepLabs of
    :func:`~mars_plugin.networks.deeplab.build_model`) is modelled; an unreadable file is left
    to the reading, which names it."""
    from PIL import Image
    from mars_plugin.runs.identities import file_id

    config = getattr(model, "config", None)
    if max_bytes is None or not isinstance(config, dict) or "arch" not in config:
        return {}, {}
    refused: Dict[str, str] = {}
    limits: Dict[Tuple[int, int], int] = {}
    crf_labels = num_classes + 1 if params is not None and num_classes is not None else None
    for stem, path in items:
        if record.current(stem, out_dir / f"{stem}.png", {"image": file_id(path)})[0]:
            continue
        try:
            with warnings.catch_warnings():  # a size PIL warns of is what this check is for
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(path) as im:
                    W, H = im.size
        except Exception:  # noqa: BLE001 -- read_image names an unreadable file with its reason
            continue
        if (H, W) in limits:
            continue
        try:
            limits[(H, W)] = check_inference_memory(config, H, W, max_bytes, name=str(path), scales=scales, flip=flip,
                                                    fp16=fp16, crf_labels=crf_labels, crf_params=params,
                                                    device=device)
        except ValueError as e:
            refused[stem] = one_line(e)
    return refused, limits
