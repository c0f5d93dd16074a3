"""The one door of a job's ``settings=``: the job's own record, or (where a job documents it) a
mapping; anything else is a ``TypeError`` naming the job, the record and what came, before any
work (a record of another command or a dict would otherwise fail deep inside, a string be
recorded as the model). Every job of :mod:`mars_plugin.commands` that takes ``settings=`` calls
:func:`own_record` first."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["own_record"]


def own_record(job: str, record: Optional[type], settings: Any, *, mapping: str = "") -> Any:
    """``settings`` if it is None, a ``record`` or (with ``mapping``, the mapping's meaning, e.g.
    "the model's description") a Mapping; else ``TypeError("<job>(settings=...) takes a <Record>,
    got <type>")``; ``record`` None: only the mapping."""
    if settings is None or (record is not None and isinstance(settings, record)) or (
            mapping and isinstance(settings, Mapping)):
        return settings
    what = " or ".join(([record.__name__] if record is not None else []) + ([f"mapping ({mapping})"] if mapping else []))
    value = f" {settings!r}"[:60] if isinstance(settings, (str, int, float)) else ""
    raise TypeError(f"{job}(settings=...) takes a {what}, got {type(settings).__name__}{value}")
