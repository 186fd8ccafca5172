"""FedFA: the anchor loss, the classifier calibration term, the anchors' initialization, the
clients' momentum update of their anchors and the server's average of them."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedfa import FedFA, FedFAHyper, anchor_loss, initial_anchors, local_anchors
from protofl.messages import Record
from protofl.models.base import FLModel

from conftest import record_run
from method_checks import assert_bad_value_exits_2


def info(C=2, d=2):
    return TaskInfo(num_classes=C, num_clients=3, feature_dim=d, input_shape=(d,), seed=0, rounds=2)


def test_anchor_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])  # class 2 is not in the batch
    # class 0: (0 + 4) / 2 = 2; class 1: 1 / 1 = 1; divided by C = 3, not by the 2 classes present
    assert float(anchor_loss(z, y, a)) == pytest.approx(1.0)
    # a class's term is its samples' mean: doubling every sample of the batch changes nothing
    assert float(anchor_loss(torch.cat([z, z]), torch.cat([y, y]), a)) == pytest.approx(1.0)


def test_the_local_loss_by_hand_and_the_calibration_reaches_only_the_classifier():
    body, head = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        body.weight.copy_(torch.eye(2))
        body.bias.zero_()
        head.weight.copy_(torch.eye(2))
        head.bias.zero_()
    model = FLModel(body, head, 2, 2)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1])
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    algo = FedFA(FedFAHyper(lam=2.0, calibration=0.5), info())
    got = algo.anchored_loss(model, x, y, {"anchors": a})
    ce = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-3))) / 2  # logits (1, 0) and (0, 3)
    l_a = (0 + 4) / 2  # ||z - a_y||^2 = 0 and 4, one sample per class, / C = 2
    calib = math.log(1 + math.exp(-1))  # h(a_c) = e_c for both anchors
    assert float(got.detach()) == pytest.approx(ce + 2.0 * l_a + 0.5 * calib)
    # the calibration term's gradient: none on the feature extractor, some on the classifier
    plain = FedFA(FedFAHyper(lam=2.0, calibration=0.0), info()).anchored_loss(model, x, y, {"anchors": a})
    grads = torch.autograd.grad(got - plain, [body.weight, body.bias, head.weight, head.bias], allow_unused=True)
    assert all(g is None or float(g.abs().max()) == 0 for g in grads[:2])
    assert float(grads[2].abs().max()) > 0


def test_initial_anchors_are_distinct_basis_rows_or_unit_gaussian_rows():
    a = initial_anchors(3, 5, np.random.default_rng(0))
    assert a.shape == (3, 5)
    assert set(a.unique().tolist()) == {0.0, 1.0} and torch.equal(a.sum(1), torch.ones(3))  # one-hot rows
    assert torch.equal(a @ a.T, torch.eye(3))  # distinct ones
    assert torch.equal(a, initial_anchors(3, 5, np.random.default_rng(0)))  # from the stream alone
    b = initial_anchors(4, 2, np.random.default_rng(0))  # more classes than dimensions
    assert b.shape == (4, 2)
    torch.testing.assert_close(b.norm(dim=1), torch.ones(4))


def test_local_anchors_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mu = torch.tensor([[3.0, 4.0], [9.0, 9.0]])
    counts = torch.tensor([2, 0])  # the client lacks class 1: its mean (here junk) is not used
    # two epochs with m = 0.5: m^2 = 1/4 on the received anchor
    got = local_anchors(a, mu, counts, 0.5, 2)
    torch.testing.assert_close(got, torch.tensor([[2.5, 3.0], [0.0, 1.0]]))
    torch.testing.assert_close(local_anchors(a, mu, counts, 0.0, 2)[0], mu[0])  # m = 0: the class mean
    torch.testing.assert_close(local_anchors(a, mu, counts, 1.0, 2), a)  # m = 1: fixed anchors


def test_server_averages_the_anchors_with_the_models_weights():
    algo = FedFA(FedFAHyper(), info())
    init = {"body.w": torch.zeros(1), "head.weight": torch.zeros(2, 2)}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=lambda *a: None, rng=lambda *k: np.random.default_rng(0),
                          init_weights=lambda: {k: v.clone() for k, v in init.items()})
    state = algo.server_init(ctx)
    assert torch.equal(algo.configure(state, 1, ctx).arrays["anchors"], state.anchors)

    def reply(n, anchors):
        return Record(weights={"body.w": torch.full((1,), float(n)), "head.weight": torch.zeros(2, 2)},
                      arrays={"anchors": torch.tensor(anchors)}, num_samples=n)

    replies = [(0, reply(1, [[4.0, 0.0], [0.0, 4.0]])), (2, reply(3, [[0.0, 0.0], [8.0, 0.0]]))]
    assert all(algo.check_reply(r, Record()) is None for _, r in replies)
    new = algo.aggregate(state, 1, replies, ctx)
    torch.testing.assert_close(new.weights["body.w"], torch.tensor([2.5]))  # (1 + 9) / 4
    torch.testing.assert_close(new.anchors, torch.tensor([[1.0, 0.0], [6.0, 1.0]]))  # (a_1 + 3 a_2) / 4
    assert algo.class_vectors(new) is new.anchors
    assert torch.equal(algo.aggregate(state, 1, [], ctx).anchors, state.anchors)  # nobody arrived
    uniform = FedFA(FedFAHyper(weighting="uniform"), info()).aggregate(state, 1, replies, ctx)
    torch.testing.assert_close(uniform.anchors, torch.tensor([[2.0, 0.0], [4.0, 2.0]]))


def test_a_reply_without_anchors_or_with_misshapen_ones_is_refused():
    algo = FedFA(FedFAHyper(), info(C=2, d=3))
    assert "must carry" in algo.check_reply(Record(weights={"w": torch.zeros(1)}), Record())
    assert "shape" in algo.check_reply(Record(arrays={"anchors": torch.zeros(2, 2)}), Record())
    assert algo.check_reply(Record(arrays={"anchors": torch.zeros(2, 3)}), Record()) is None


def test_a_run_sends_the_clients_updated_anchors_and_their_weighted_mean(digits_cfg, tmp_path):
    # digits: 2 epochs, so each held class's anchor keeps m^2 = 1/4 of the received one
    sim, _, seen = record_run(digits_cfg("algorithm.name=fedfa", "rounds=2"), tmp_path / "run")
    r1 = [(cid, msg, reply) for rnd, cid, msg, reply, _ in seen if rnd == 1]
    sent = r1[0][1].arrays["anchors"]
    assert torch.equal(sent @ sent.T, torch.eye(10))  # C = 10 <= d = 64: one-hot rows
    for cid, msg, reply in r1:
        x, y = sim.runtime.client_train_data(cid, 1)
        model = sim.server.shared_model(reply.weights).eval()
        with torch.no_grad():
            z = model.body(x)
        held = torch.bincount(y, minlength=10) > 0
        mu = torch.stack([z[y == c].mean(0) if held[c] else torch.zeros(z.shape[1]) for c in range(10)])
        expected = torch.where(held.unsqueeze(1), 0.25 * sent + 0.75 * mu, sent)
        torch.testing.assert_close(reply.arrays["anchors"], expected, atol=1e-5, rtol=1e-5)
    msg2 = next(msg for rnd, _, msg, _, _ in seen if rnd == 2)
    n = [float(reply.num_samples) for _, _, reply in r1]
    mean = sum(k * reply.arrays["anchors"] for k, (_, _, reply) in zip(n, r1)) / sum(n)
    torch.testing.assert_close(msg2.arrays["anchors"], mean, atol=1e-6, rtol=1e-6)


def test_bad_hyper_parameters_exit_2(tmp_path, capsys):
    assert_bad_value_exits_2("fedfa", "anchor_momentum", 1.5, tmp_path, capsys)
    assert_bad_value_exits_2("fedfa", "lam", -1, tmp_path, capsys)
    assert_bad_value_exits_2("fedfa", "calibration", -0.1, tmp_path, capsys)


def test_privacy_modes(digits_cfg, tmp_path, capsys):
    from protofl.cli import EXIT_BAD_INPUT, main
    from conftest import DIGITS

    # DP-SGD: the anchor loss couples a batch's samples (its anchors themselves would be a release)
    rc = main(["run", str(DIGITS), "algorithm.name=fedfa", "privacy.mode=sample", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_BAD_INPUT and "couples the samples" in err and len(err.splitlines()) == 1, err
