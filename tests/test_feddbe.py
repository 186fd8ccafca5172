"""FedDBE: the running mean, the loss by hand, the initialization period that fixes the
global mean, and what never leaves the client."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.feddbe import FedDBE, FedDBEHyper, tracked_mean
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2
from conftest import record_run


def tiny(momentum=1.0, kappa=2.0):
    algo = FedDBE(FedDBEHyper(kappa=kappa, momentum=momentum), info=None)
    model = FLModel(nn.Flatten(), nn.Linear(2, 2), feature_dim=2, num_classes=2)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    return algo, algo.adapt_model(model)


def test_running_mean_is_an_ema_of_batch_means_from_zero():
    _, model = tiny()
    z1, z2 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.0, 0.0]])
    rm = tracked_mean(model, z1, 0.5)  # 0.5 * 0 + 0.5 * (2, 3)
    assert torch.allclose(rm, torch.tensor([1.0, 1.5])) and torch.equal(model.dbe.running_mean, rm.detach())
    rm = tracked_mean(model, z2, 0.5)  # 0.5 * (1, 1.5) + 0.5 * 0
    assert torch.allclose(model.dbe.running_mean, torch.tensor([0.5, 0.75]))


def test_dbe_loss_by_hand():
    algo, model = tiny(momentum=1.0, kappa=2.0)
    x, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1])
    loss = algo.dbe_loss(model, x, y, {"global_mean": torch.tensor([1.0, 1.0])})
    # zero head: CE = log 2; z-bar = (2, 3), reg = mean(0.5 (1, 4)) = 1.25, kappa = 2
    assert math.isclose(float(loss.detach()), math.log(2) + 2.5, rel_tol=1e-6)
    loss.backward()
    # the reg's gradient reaches z through the batch mean only; the PRBM gets the CE's
    assert model.dbe.bias.grad is not None and torch.equal(model.dbe.running_mean, torch.tensor([2.0, 3.0]))


def test_initialization_round_fixes_the_global_mean_then_dbe(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=feddbe", "rounds=3", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    d = sim.info.feature_dim
    r1 = [(msg, reply) for rnd, _, msg, reply, _ in seen if rnd == 1]
    assert all("global_mean" not in m.arrays and r.arrays["mean"].shape == (d,) for m, r in r1)
    n = [float(r.num_samples) for _, r in r1]
    g = sum(nk * r.arrays["mean"].double() for nk, (_, r) in zip(n, r1)) / sum(n)
    for rnd, _, msg, reply, state in seen:
        assert not any(k.startswith("dbe.") for k in (*msg.weights, *reply.weights))
        assert set(state.weights) == {"dbe.bias", "dbe.running_mean"}
        if rnd > 1:  # z-bar^g fixed after round 1; no means sent any more
            assert torch.allclose(msg.arrays["global_mean"].double(), g, atol=1e-6) and not reply.arrays
    assert torch.allclose(res.server_state.global_mean.double(), g, atol=1e-6)
    last = [s for rnd, _, _, _, s in seen if rnd == 3]
    assert any(float(s.weights["dbe.bias"].abs().sum()) > 0 for s in last)  # the PRBM trains
    assert "gm" in res.rows[-1]


@pytest.mark.parametrize("key,value", [("kappa", -1), ("momentum", 0), ("momentum", 1.5)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("feddbe", key, value, tmp_path, capsys)


def test_a_first_round_reply_without_its_mean_is_rejected():
    """Before z-bar^g is fixed, aggregate reads every reply's ``mean``: one without it (or
    with a group in its place) is refused by check_reply, not a KeyError in aggregate."""
    from protofl.algorithms.base import TaskInfo
    from protofl.messages import Record
    info = TaskInfo(num_classes=2, num_clients=2, feature_dim=3, input_shape=(2,), seed=0, rounds=2)
    algo = FedDBE(FedDBEHyper(), info)
    first, later = Record(weights={}), Record(weights={}, arrays={"global_mean": torch.zeros(3)})
    w = {"head.weight": torch.zeros(2, 3)}
    assert algo.check_reply(Record(weights=w, arrays={"mean": torch.zeros(3)}), first) is None
    assert "missing" in algo.check_reply(Record(weights=w), first)
    assert "missing" in algo.check_reply(Record(weights=w, arrays={"mean": {"m": torch.zeros(3)}}), first)
    assert "shape" in algo.check_reply(Record(weights=w, arrays={"mean": torch.zeros(4)}), first)
    assert algo.check_reply(Record(weights=w), later) is None
    assert "after the initialization period" in algo.check_reply(
        Record(weights=w, arrays={"mean": torch.zeros(3)}), later)
