"""Tests for the EMA teacher of MARS Sec. 3.4: theta_hat <- m * theta_hat + (1 - m) * theta."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from mars_plugin import EMATeacher

SEEDS = [0, 1, 2]
TOL = 1e-5


def small_net(width=6, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(width, 4, 1),
    )


def train_steps(net, steps, seed):
    """A few SGD steps on random data in train mode: parameters and BN buffers move."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.train()
    for _ in range(steps):
        x = torch.randn(4, 3, 5, 5, generator=g) * 2 + 1
        y = torch.randint(0, 4, (4, 5, 5), generator=g)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_np(module):
    return {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("momentum", [0.9, 0.5, 0.999])
def test_update_is_exponential_moving_average(seed, momentum):
    student = small_net(seed=seed)
    teacher = EMATeacher(student, momentum=momentum)
    assert teacher.momentum == momentum
    for step in range(3):
        train_steps(student, 2, seed * 10 + step)
        t_old = state_np(teacher.module)
        s = state_np(student)
        teacher.update(student)
        t_new = state_np(teacher.module)
        assert t_new.keys() == s.keys()
        n_float = 0
        for k in t_new:
            if np.issubdtype(t_new[k].dtype, np.floating):
                n_float += 1
                ref = momentum * t_old[k].astype(np.float64) + (1 - momentum) * s[k].astype(np.float64)
                np.testing.assert_allclose(t_new[k], ref, atol=TOL, rtol=0, err_msg=k)
                # the student moved away from the teacher, so the update is informative
                assert np.abs(s[k] - t_old[k]).max() > 1e-4, k
            else:
                np.testing.assert_array_equal(t_new[k], s[k], err_msg=k)
        # conv0 weight, BN weight/bias/running_mean/running_var, conv4 weight+bias
        assert n_float == 7
    # num_batches_tracked was copied: 3 rounds of 2 student steps
    assert int(teacher.module[1].num_batches_tracked) == 6
    # the update does not touch the student
    s_before = state_np(student)
    teacher.update(student)
    for k, v in state_np(student).items():
        np.testing.assert_array_equal(v, s_before[k])


def test_teacher_is_a_copy():
    student = small_net()
    teacher = EMATeacher(student, momentum=0.9)
    before = state_np(teacher.module)
    train_steps(student, 2, 0)
    for k, v in state_np(teacher.module).items():
        np.testing.assert_array_equal(v, before[k])
    assert teacher.module is not student


def test_teacher_stays_in_eval_mode():
    student = small_net()
    teacher = EMATeacher(student)
    assert not teacher.training and all(not m.training for m in teacher.modules())
    assert teacher.train() is teacher
    assert not teacher.training and all(not m.training for m in teacher.modules())
    teacher.train(True)
    assert all(not m.training for m in teacher.modules())
    # also when a parent module is put in train mode
    parent = nn.ModuleDict({"student": student, "teacher": teacher})
    parent.train()
    assert student.training
    assert all(not m.training for m in teacher.modules())
    # student's train mode is not changed by the teacher
    student.train()
    teacher.update(student)
    assert student.training


def test_parameters_frozen_and_forward_has_no_grad():
    student = small_net()
    train_steps(student, 2, 1)
    teacher = EMATeacher(student, momentum=0.5)
    assert all(not p.requires_grad for p in teacher.parameters())
    assert all(p.requires_grad for p in student.parameters())
    train_steps(student, 1, 2)
    teacher.update(student)
    assert all(not p.requires_grad for p in teacher.parameters())
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    out = teacher(x)
    assert out.grad_fn is None and not out.requires_grad
    # eval-mode forward: deterministic (dropout off) and equal to the wrapped module in eval
    out2 = teacher(x)
    np.testing.assert_array_equal(out.numpy(), out2.numpy())
    ref_net = copy.deepcopy(teacher.module).eval()
    with torch.no_grad():
        np.testing.assert_allclose(out.numpy(), ref_net(x).numpy(), atol=TOL, rtol=0)


def test_momentum_zero_copies_student_and_one_keeps_teacher():
    student = small_net(seed=3)
    zero = EMATeacher(student, momentum=0.0)
    with pytest.warns(UserWarning, match="never moves"):  # a frozen teacher: allowed, said
        one = EMATeacher(student, momentum=1.0)
    kept = state_np(one.module)
    train_steps(student, 3, 4)
    zero.update(student)
    one.update(student)
    s = state_np(student)
    for k, v in state_np(zero.module).items():
        np.testing.assert_array_equal(v, s[k], err_msg=k)
    for k, v in state_np(one.module).items():
        if np.issubdtype(v.dtype, np.floating):
            np.testing.assert_array_equal(v, kept[k], err_msg=k)
            assert np.abs(s[k] - kept[k]).max() > 1e-4  # the student did move
        else:
            np.testing.assert_array_equal(v, s[k], err_msg=k)  # counters are copied anyway
    # with momentum 0 the teacher predicts exactly like the student in eval mode
    student.eval()
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        np.testing.assert_array_equal(zero(x).numpy(), student(x).numpy())


@pytest.mark.parametrize("bad", [-0.1, 1.5, 2])
def test_momentum_out_of_range_rejected(bad):
    with pytest.raises(ValueError, match="momentum"):
        EMATeacher(small_net(), momentum=bad)


@pytest.mark.parametrize("bad", [float("nan"), "0.9", None, True])
def test_momentum_wrong_type_rejected(bad):
    with pytest.raises(TypeError, match="momentum"):
        EMATeacher(small_net(), momentum=bad)


def test_model_must_be_module():
    with pytest.raises(TypeError, match="model"):
        EMATeacher(lambda x: x)


def test_mismatched_architecture_rejected():
    teacher = EMATeacher(small_net(width=6), momentum=0.9)
    before = state_np(teacher.module)
    with pytest.raises(ValueError, match="shape"):
        teacher.update(small_net(width=8))  # same keys, different shapes
    with pytest.raises(ValueError, match="architecture"):
        teacher.update(nn.Sequential(nn.Conv2d(3, 6, 3, padding=1)))  # missing keys
    extra = nn.Sequential(*small_net(width=6), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="architecture"):
        teacher.update(extra)  # extra keys
    # a rejected update did not half-modify the teacher for the key-mismatch cases
    for k, v in state_np(teacher.module).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_failed_update_leaves_teacher_unchanged():
    """A shape mismatch deep in the network must not leave the earlier layers half-updated."""
    teacher = EMATeacher(small_net(width=6), momentum=0.5)
    before = state_np(teacher.module)
    student = small_net(width=6, seed=1)
    student[4] = nn.Conv2d(6, 5, 1)  # same keys, only the last layer's shape differs
    with pytest.raises(ValueError, match="shape"):
        teacher.update(student)
    for k, v in state_np(teacher.module).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
