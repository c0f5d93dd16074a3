"""Images of one size batched together for one forward pass (``mars features``, ``mars predict``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, List, Optional

class SizeBatches:
    """Items grouped by image size into batches of ``batch_size``: ``compute(batch)`` runs on each
    and ``write(batch, result)`` takes its result; a few sizes are buffered at once (at most
    ``4 * batch_size`` items): when the buffer is full the fullest size runs, so a folder of many
    sizes never holds more than that in memory. When ``compute`` raises on a batch, each of its
    items is computed alone, so that one bad image (too small for a scale, say) fails alone:
    ``failed(item, error)`` is called for it and the others are written. Call :meth:`flush` at
    the end for the partial batches. (``mars features`` and ``mars predict``.)"""

    def __init__(self, batch_size: int, compute: Callable[[List[Any]], Any],
                 write: Callable[[List[Any], Any], None], failed: Callable[[Any, Exception], None]) -> None:
        self.batch_size = int(batch_size)
        self.compute, self.write, self.failed = compute, write, failed
        self.buckets: "OrderedDict[Any, List[Any]]" = OrderedDict()
        self.buffered = 0

    def add(self, key: Any, item: Any, limit: Optional[int] = None) -> None:
        """Buffer ``item`` of size ``key``; ``limit``: at most this many of this size in one batch
        (``mars predict``: the most its memory budget holds), fewer than ``batch_size``."""
        self.buckets.setdefault(key, []).append(item)
        self.buffered += 1
        full = self.batch_size if limit is None else max(1, min(self.batch_size, int(limit)))
        if len(self.buckets[key]) >= full:
            self.buffered -= len(self.buckets[key])
            self.run(self.buckets.pop(key))
        elif self.buffered >= 4 * self.batch_size:  # many sizes: run the fullest bucket
            b = self.buckets.pop(max(self.buckets, key=lambda k: len(self.buckets[k])))
            self.buffered -= len(b)
            self.run(b)

    def flush(self) -> None:
        while self.buckets:
            b = self.buckets.pop(next(iter(self.buckets)))
            self.buffered -= len(b)
            self.run(b)

    def run(self, batch: List[Any]) -> None:
        try:
            result = self.compute(batch)
        except Exception as e:  # noqa: BLE001 -- a per-image failure, found by computing each alone
            if len(batch) > 1:
                for item in batch:
                    self.run([item])
                return
            self.failed(batch[0], e)
            return
        # Outside the try: a failure to write is not an image's fault, and stops or is reported
        # by the caller's write.
        self.write(batch, result)
