"""The engine's one training step (engine/train.py ``train_step``), which both executors take:
the sequential driver with one slot on the live model (plain autograd), the batched driver
with a stack of slots (vmapped gradients, flat rows). The sequential driver must be torch's
own loop bit for bit; one step of each driver on the same batch must agree up to float
rounding, a parameter the loss does not reach included."""
import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import TaskInfo
from protofl.algorithms.base import cross_entropy
from protofl.config import load_config
from protofl.data.build import build_federated
from protofl.engine.batched import BatchedExecutor, Stack
from protofl.engine.client import ClientRuntime
from protofl.engine.task import Task
from protofl.engine.train import (StepCode, TrainSettings, batch_rows, batch_sizes, fit, live_gradients, one_client,
                                  optimizer_state, train_step)
from protofl.models.base import FLModel

from conftest import DIGITS


def _model(seed: int = 0, bn: bool = False) -> FLModel:
    """A small MLP (with ``bn``, BatchNorm in its body) whose ``spare`` layer no loss reaches
    (autograd gives it no gradient)."""
    torch.manual_seed(seed)
    body = [nn.Flatten(), nn.Linear(12, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU()]
    model = FLModel(nn.Sequential(*body), nn.Linear(8, 3), 8, 3)
    model.spare = nn.Linear(2, 2)
    return model


def _data(n: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def _transform(grads, extras, params):
    """A gradient transform that reads the parameters (as FedDyn's and SCAFFOLD's do)."""
    return {k: g + 0.01 * params[k] for k, g in grads.items()}


@pytest.mark.parametrize("bn", [False, True], ids=["mlp", "batchnorm, a batch of one"])
@pytest.mark.parametrize("transform", [False, True], ids=["no transform", "transform"])
def test_fit_is_torchs_own_loop_bit_for_bit(transform, bn):
    """fit (train_step with one slot on the live model) against the loop a user would write:
    the same batches, backward, the transform, clip_grad_norm_, torch.optim.SGD with momentum
    and weight decay. Without a transform the spare layer gets no gradient and torch.optim
    leaves it alone (weight decay included); with one it gets zeros, transformed, and moves.
    With BatchNorm, 41 samples in batches of 8 end each epoch in a batch of one, which the
    schedule leaves out (BatchNorm cannot train on it); the running statistics must match too."""
    n = 41 if bn else 40
    x, y = _data(n)
    s = TrainSettings(lr=0.1, momentum=0.9, weight_decay=0.01, batch_size=8 if bn else 16, epochs=3, clip_grad=0.5)
    ours, ref = _model(bn=bn), _model(bn=bn)
    names = [k for k, _ in ours.named_parameters()]
    stats = fit(ours, x, y, loss=cross_entropy, extras={}, names=names, settings=s,
                generator=torch.Generator().manual_seed(7), grad=_transform if transform else None)

    params = dict(ref.named_parameters())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sizes = batch_sizes(n, s.batch_size, 3 * (5 if bn else 3), drop_single=bn)  # 3 epochs
    assert (1 in sizes) is False and len(sizes) == (15 if bn else 9)
    rows = batch_rows(n, s.batch_size, len(sizes), torch.Generator().manual_seed(7), drop_single=bn)
    ref.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for step, b in enumerate(sizes):
        idx = torch.from_numpy(rows[step, :b])
        opt.zero_grad(set_to_none=True)
        value = cross_entropy(ref, x[idx], y[idx], {})
        value.backward()
        if transform:
            new = _transform({k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}, {},
                             {k: p.detach() for k, p in params.items()})
            for k, p in params.items():
                p.grad = new[k]
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        loss_sum += value.detach() * b
    for (k, v), w in zip(ours.state_dict().items(), ref.state_dict().values()):  # parameters and BatchNorm's buffers
        assert torch.equal(v, w), k
    assert torch.equal(ours.spare.weight, _model(bn=bn).spare.weight) != transform  # moved only with the transform
    assert stats.loss == float(loss_sum) / sum(sizes) and stats.steps == len(sizes) and stats.samples == sum(sizes)


def _batched() -> BatchedExecutor:
    cfg = load_config(DIGITS, ["output.progress=false", "execution.threads=1"])
    fed = build_federated(cfg)
    info = TaskInfo(num_classes=10, num_clients=fed.num_clients, feature_dim=64, input_shape=(1, 8, 8),
                    seed=cfg.seed, rounds=cfg.rounds)
    return BatchedExecutor(ClientRuntime(Task(cfg, fed, ALGORITHMS.get("fedavg")(None, info), info)))


@pytest.mark.parametrize("transform", [False, True], ids=["no transform", "transform"])
def test_both_executors_take_the_same_step(transform):
    """Three steps of train_step with one slot on the live model (the sequential driver's
    code) and with a stack of two slots on flat rows (the batched driver's code: vmapped
    gradients; the spare layer's columns idle without a transform), each slot a copy of the
    same client on the same batches: the same weights up to float rounding, and without a
    transform the spare layer and its momentum untouched in both."""
    x, y = _data()
    s = TrainSettings(lr=0.1, momentum=0.9, weight_decay=0.01, batch_size=16, clip_grad=0.5)
    live = _model()
    names = [k for k, _ in live.named_parameters()]
    start = {k: v.clone() for k, v in live.state_dict().items()}
    values = {k: p.detach() for k, p in live.named_parameters()}
    one = StepCode(live_gradients(live, cross_entropy, names), one_client(_transform, values) if transform else None,
                   tuple(names), None, s, "fp32", False, live)
    rows = [v.unsqueeze(0) for v in values.values()]
    one_state = optimizer_state(s, rows)

    stacked = _model()
    ex = _batched()
    stack = Stack(stacked, names, 2, s, {}, torch.device("cpu"))
    for slot in (0, 1):
        stack.all.params[slot] = torch.cat([start[k].reshape(-1) for k in names])
    flat = stack.all.params
    many = StepCode(ex._step_fn(stacked, cross_entropy, s), torch.func.vmap(_transform) if transform else None,
                    tuple(names), stack.layout, s, "fp32", False, stacked)
    many_state = optimizer_state(s, [flat])
    idle = None if transform else stack.columns(["spare.weight", "spare.bias"])
    for step in range(3):
        idx = torch.arange(step * 12, step * 12 + 12)
        v1, _, n1 = train_step(one, rows, one_state, {}, {}, {}, {}, x[idx].unsqueeze(0), y[idx].unsqueeze(0),
                               None, None, None, None, None)
        v2, _, n2 = train_step(many, [flat], many_state, {}, {}, {}, {}, x[idx].expand(2, -1, -1),
                               y[idx].expand(2, -1), None, None, idle, None, None)
        torch.testing.assert_close(v2, v1.expand(2), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(n2, n1.expand(2), rtol=1e-6, atol=1e-7)
    for slot in (0, 1):
        views = stack.views(flat[slot:slot + 1])
        for k, p in live.named_parameters():
            torch.testing.assert_close(views[k][0], p.detach(), rtol=1e-5, atol=1e-6, msg=k)
    moved = not torch.equal(live.spare.weight, start["spare.weight"])
    assert moved == transform
    if not transform:  # no gradient, no weight decay, no momentum: in both drivers
        assert torch.equal(stack.views(flat)["spare.weight"][1], start["spare.weight"])
        m = stack.views(many_state["momentum"][0])
        assert not m["spare.weight"].any() and not one_state["momentum"][names.index("spare.weight")].any()
    assert np.isfinite(float(v1.sum()))
