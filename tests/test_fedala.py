"""FedALA: the element-wise aggregation, one projected weight-learning step by hand, and the
rounds: no ALA at first, the start phase at the next turn, one epoch afterwards."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.fedala import FedALA, FedALAHyper, local_aggregation
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2, assert_dp_sgd_refused
from conftest import record_run, recorded_update


def test_local_aggregation_element_wise():
    local, glob = {"a": torch.tensor([1.0, 2.0, 3.0])}, {"a": torch.tensor([3.0, 0.0, 3.0])}
    W = {"a": torch.tensor([0.5, 1.0, 0.0])}
    assert torch.equal(local_aggregation(local, glob, W)["a"], torch.tensor([2.0, 0.0, 3.0]))


@pytest.mark.parametrize("eta,expected", [(1.0, 0.5 + 0.2384058), (5.0, 1.0)])  # 5.0: clipped to 1
def test_one_weight_step_is_projected_gradient_descent_by_hand(eta, expected):
    """Head H (2, 2), body = identity. Theta_i = 0, Theta = G, W = 1/2: Theta^ = G / 2. With
    x = (1, 0), y = 0: logits = G[:, 0] / 2 = (1, -1), dL/dTheta^ = (p - e_0) x^T, and
    dL/dW = dL/dTheta^ (.) (G - 0): column 0 = (p_0 - 1) 2, (1 - p_0) (-2) = -2 (1 - p_0) twice."""
    algo = FedALA(FedALAHyper(eta=eta), info=None)
    model = FLModel(nn.Flatten(), nn.Linear(2, 2, bias=False), feature_dim=2, num_classes=2)
    G = torch.tensor([[2.0, 1.0], [-2.0, 3.0]])
    with torch.no_grad():
        model.head.weight.fill_(0.5)  # the parameter slot holds W
    extras = {"local": {"head.weight": torch.zeros(2, 2)}, "global": {"head.weight": G}}
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    loss = algo.ala_loss(model, x, y, extras)
    p0 = math.exp(1) / (math.exp(1) + math.exp(-1))
    assert math.isclose(float(loss.detach()), -math.log(p0), rel_tol=1e-6)
    loss.backward()
    with torch.no_grad():  # the ALA call's plain SGD step with lr = eta
        W = model.head.weight - eta * model.head.weight.grad
    assert math.isclose(2 * (1 - p0), 0.2384058, rel_tol=1e-5)
    assert torch.allclose(W, torch.tensor([[expected, 0.5], [expected, 0.5]]), atol=1e-6)


def test_rounds_skip_then_start_phase_then_one_epoch(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedala", "rounds=2", "participation.fraction=1.0", "training.epochs=1",
                     "algorithm.max_init_epochs=15")
    sim, _, seen = record_run(cfg, tmp_path / "r")
    hp = sim.algorithm.hp
    top = ["head.weight", "head.bias"]  # layer_idx = 2: the head
    first = {cid: s for rnd, cid, _, _, s in seen if rnd == 1}
    second = {cid: s for rnd, cid, _, _, s in seen if rnd == 2}
    assert all(not s.config["started"] and all(torch.equal(w, torch.ones_like(w)) for w in s.arrays["W"].values())
               for s in first.values())  # first turn: Theta_i = Theta, no ALA
    for s in second.values():
        assert s.config["started"] and sorted(s.arrays["W"]) == sorted(top)
        W = torch.cat([w.flatten() for w in s.arrays["W"].values()])
        assert float(W.min()) >= 0.0 and float(W.max()) <= 1.0 and float(W.min()) < 1.0
    # round 2 of client 0 again, by hand: the start phase, then local training from Theta^
    msg2 = next(m for rnd, cid, m, _, _ in seen if rnd == 2 and cid == 0)
    out, fits = recorded_update(sim, 0, 2, msg2, first[0])
    ala, (train, _) = fits[:-1], fits[-1]
    assert hp.num_pre_loss < len(ala) <= 15
    n = sim.runtime.client_train_data(0)[1].numel()
    assert all(req.settings["steps"] == math.ceil(int(0.8 * n) / 32) and req.settings["lr"] == hp.eta
               and req.trainable == tuple(top) for req, _ in ala)
    W = out.state.arrays["W"]
    local = first[0].weights
    for k, v in train.weights.items():  # lower layers: Theta; top: Theta_i + (Theta - Theta_i) W
        expected = local[k] + (msg2.weights[k] - local[k]) * W[k] if k in top else msg2.weights[k]
        assert torch.allclose(v, expected), k
    # a later turn: one ALA epoch only
    _, fits = recorded_update(sim, 0, 3, msg2, out.state)
    assert len(fits) == 2


@pytest.mark.parametrize("key,value", [("eta", 0), ("rand_percent", 0), ("rand_percent", 101), ("layer_idx", 0),
                                       ("threshold", 0), ("num_pre_loss", 1), ("max_init_epochs", 0)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("fedala", key, value, tmp_path, capsys)


def test_dp_sgd_is_refused_in_one_line(tmp_path, capsys):
    """ALA's projected step is nonlinear in the batch's gradient: per-sample gradients would change it."""
    assert_dp_sgd_refused("fedala", tmp_path, capsys)
