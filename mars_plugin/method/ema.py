"""EMA teacher of Sec. 3.4: theta_hat <- m * theta_hat + (1 - m) * theta."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn

from mars_plugin._checks import check_fraction, describe

__all__ = ["EMATeacher", "frozen_teacher_warning"]


def frozen_teacher_warning(momentum: float, stacklevel: int = 3) -> None:
    """Warn (``UserWarning``, once per call) where ``momentum`` is 1: such a teacher never moves
    from the weights it was copied from (at the start of training: a random initialisation), so
    it teaches what the student was, not what it learns. Not an error: a frozen teacher is a
    legitimate tool (a fixed reference network, tests), but never the paper's 0.999."""
    if momentum == 1.0:
        warnings.warn("EMA momentum 1: the teacher never moves from the weights it was copied from (at the start of "
                      "training, a random initialisation); the paper's momentum is 0.999", UserWarning,
                      stacklevel=stacklevel)


class EMATeacher(nn.Module):
    """A frozen copy of a student network, updated as an exponential moving average.

    The teacher is always in eval mode (BatchNorm uses running statistics, dropout is off) and
    has no gradient; calling it runs under ``torch.no_grad()``.

    Every floating parameter and buffer follows ``t = momentum * t + (1 - momentum) * s``;
    integer buffers (BatchNorm's ``num_batches_tracked``) are copied from the student.

    Args:
        model: the student network (deep-copied).
        momentum: EMA momentum m in [0, 1]; 0.999 by default. 1 keeps the teacher at the
            student's weights of now for ever: allowed (a frozen reference), with a
            ``UserWarning`` (:func:`frozen_teacher_warning`).
    """

    def __init__(self, model: nn.Module, momentum: float = 0.999) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {describe(model)}")
        self.momentum = check_fraction(momentum, "momentum", low_open=False)
        frozen_teacher_warning(self.momentum)  # pointing at the caller's line
        self.module = copy.deepcopy(model)
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.eval()  # the wrapper too, not only the wrapped module: teacher.training is False

    def train(self, mode: bool = True) -> "EMATeacher":
        # The teacher never trains: keep the wrapped module in eval mode whatever the caller does.
        super().train(False)
        return self

    @torch.no_grad()
    def update(self, student: nn.Module) -> None:
        """One EMA step towards ``student`` (same architecture as the teacher)."""
        t_state = self.module.state_dict()
        s_state = student.state_dict()
        if t_state.keys() != s_state.keys():
            missing = sorted(set(t_state) ^ set(s_state))[:5]
            raise ValueError(f"student does not match the teacher's architecture (differing keys: {missing})")
        # Check every shape before touching anything, so a mismatch never leaves the teacher
        # half-updated.
        for name, t in t_state.items():
            s = s_state[name]
            if t.shape != s.shape:
                raise ValueError(f"student {name} has shape {tuple(s.shape)}, teacher {tuple(t.shape)}")
        m = self.momentum
        ts, ss = [], []
        for name, t in t_state.items():
            s = s_state[name].detach()
            if t.is_floating_point():
                ts.append(t)
                ss.append(s.to(t.dtype))
            else:
                t.copy_(s)
        # One multi-tensor kernel per operation instead of two launches per tensor (a ResNet-101
        # has ~600 state tensors: the per-tensor loop cost a GPU training step several ms). The
        # same arithmetic as t.mul_(m).add_(s, alpha=1 - m), tensor by tensor.
        if ts:
            torch._foreach_mul_(ts, m)
            torch._foreach_add_(ts, ss, alpha=1.0 - m)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*args, **kwargs)
