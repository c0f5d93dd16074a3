"""Ranks that share a job under ``torchrun`` (torch.distributed): who am I, where do I run, and
meeting at the end (no-ops in one process, so a job calls them unconditionally)."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch

from mars_plugin.runs.errors import JobError, one_line

def _rank_world() -> Tuple[int, int]:
    """(rank, world size) under an initialised torch.distributed, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Ranks that share a job meet at its end. The helpers below are no-ops (or return their local
# answer) without an initialised torch.distributed, so a job calls them unconditionally.

#: How long :func:`sync_group`'s collectives wait for the slowest rank. torchrun's default group
#: waits 30 minutes and then raises; a rank whose shard was mostly done by an earlier run (resume)
#: may wait longer than that for the others at the end of a feature extraction of hours.
SYNC_TIMEOUT = timedelta(hours=24)


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def sync_group(timeout: timedelta = SYNC_TIMEOUT) -> Optional[Any]:
    """A gloo process group of every rank whose collectives wait up to ``timeout``, for
    :func:`barrier`, :func:`all_ok` and :func:`share_error` at the end of a long job (None
    without torch.distributed: the helpers then use no group). A collective itself: every rank
    calls it at the same point, best at the start of the job, where the ranks are together.
    Free it with ``torch.distributed.destroy_process_group(group)``. Gloo also works beside a
    NCCL default group (the helpers exchange small CPU objects)."""
    if not _dist_ready():
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timeout)


def _free(group: Optional[Any]) -> None:
    """Destroy a group made by :func:`sync_group` (None: nothing to do)."""
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group(group)


def barrier(group: Optional[Any] = None) -> None:
    """Wait until every rank (of ``group``, default: all) gets here; a no-op without
    torch.distributed."""
    if _dist_ready():
        import torch.distributed as dist

        dist.barrier(group=group)


def _gather_errors(error: Optional[str], group: Optional[Any]) -> List[Tuple[int, str]]:
    """(rank, message) of every rank that passed a message; every rank gets the same list."""
    import torch.distributed as dist

    got: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, error, group=group)
    return [(r, e) for r, e in enumerate(got) if e is not None]


def all_ok(ok: bool, group: Optional[Any] = None) -> bool:
    """True when ``ok`` is true on every rank (without torch.distributed: ``ok``).

    A barrier that carries one bit: every rank calls it at the same point, a rank that failed
    with ``ok=False`` instead of returning early and leaving the others waiting for it."""
    if not _dist_ready():
        return bool(ok)
    return not _gather_errors(None if ok else "failed", group)


def share_error(error: Optional[BaseException], group: Optional[Any] = None) -> None:
    """Make a failure on one rank a failure on every rank.

    Every rank calls it at the same point with the exception it caught (None: it succeeded);
    it returns on every rank when none failed. Otherwise every rank raises: a rank that failed
    raises its own ``error``, the others a :class:`JobError` ``"rank R stopped: <its message>"``
    naming the lowest failed rank. Without torch.distributed it raises ``error`` if any.
    """
    failed = _gather_errors(None if error is None else one_line(error), group) if _dist_ready() else []
    if error is not None:
        raise error
    if failed:
        r, msg = failed[0]
        more = f" ({len(failed) - 1} other rank(s) failed too)" if len(failed) > 1 else ""
        raise JobError(f"rank {r} stopped: {msg}{more}")


def resolve_device(device: str) -> torch.device:
    """``"auto"``: under torchrun, GPU ``LOCAL_RANK`` (mod the GPU count) when CUDA is available,
    else the CPU; anything else is passed to ``torch.device``."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use cpu or auto")
    return dev
