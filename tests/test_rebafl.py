"""ReBaFL: feature augmentation (eq. 15-16), prototype override (eq. 18) and aggregation
(eq. 23), single-class clients, and the messages of a run."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from protofl.nn.prototypes import class_means
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.rebafl import (
    ReBaFL,
    ReBaFLHyper,
    ReBaFLState,
    augment_features,
    client_prototypes,
)
from protofl.config import ConfigError, check_dataclass
from protofl.messages import Record

from conftest import record_run
from protofl.models.base import FLModel

C, D = 3, 2
INFO = TaskInfo(num_classes=C, num_clients=2, feature_dim=D, input_shape=(4,), seed=0, rounds=1)


def rebafl(**params) -> ReBaFL:
    return ReBaFL(check_dataclass(ReBaFLHyper, params, "algorithm"), INFO)


# ---------------------------------------------------------------------------------------
# eq. 15: augmentation
# ---------------------------------------------------------------------------------------
def test_augmentation_is_p_j_plus_lambda_h_minus_p_i_with_cyclic_targets():
    P = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])  # (C, d)
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    y = torch.tensor([0, 0, 1, 1])
    h_aug, j = augment_features(h, y, P, torch.tensor([0, 1, 2]), lam=0.5)
    assert j.tolist() == [0, 1, 2, 0]  # i mod A over the classes with prototypes
    expected = torch.tensor([
        [0.0 + 0.5 * 1, 0.0 + 0.5 * 2],  # p_0 + 0.5 (h - p_0)
        [10.0 + 0.5 * 3, 0.0 + 0.5 * 4],  # p_1 + 0.5 (h - p_0)
        [0.0 + 0.5 * (5 - 10), 10.0 + 0.5 * 6],  # p_2 + 0.5 (h - p_1)
        [0.0 + 0.5 * (7 - 10), 0.0 + 0.5 * 8],  # p_0 + 0.5 (h - p_1)
    ])
    assert torch.allclose(h_aug, expected)
    # targets skip classes without a prototype
    _, j = augment_features(h, y, P, torch.tensor([0, 2]), lam=1.0)
    assert j.tolist() == [0, 2, 0, 2]


def test_eq18_own_prototypes_replace_the_global_ones():
    local = torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]])
    n = torch.tensor([4, 0, 2])
    glob = torch.tensor([[9.0, 9.0], [8.0, 8.0], [0.0, 0.0]])
    glob_n = torch.tensor([10, 5, 0])
    P, available = client_prototypes(local, n, glob, glob_n)
    assert torch.equal(P, torch.tensor([[1.0, 1.0], [8.0, 8.0], [3.0, 3.0]]))
    assert available.tolist() == [0, 1, 2]
    _, available = client_prototypes(local, torch.tensor([4, 0, 0]), glob, torch.tensor([0, 0, 0]))
    assert available.tolist() == [0]


# ---------------------------------------------------------------------------------------
# the local objective on a tiny model
# ---------------------------------------------------------------------------------------
def tiny_model() -> FLModel:
    torch.manual_seed(0)
    return FLModel(nn.Sequential(nn.Linear(4, D), nn.Tanh()), nn.Linear(D, C), D, C)


class FakeClient(SimpleNamespace):
    num_classes = C

    def embed(self, body, x=None):
        with torch.no_grad():
            return body(self.data[0])


def client(y, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(y), 4, generator=g)
    return FakeClient(data=(x, y), class_counts=torch.bincount(y, minlength=C))


def message(protos=None, counts=None) -> Record:
    return Record(arrays={"proto": torch.zeros(C, D) if protos is None else protos,
                          "proto_counts": torch.zeros(C, dtype=torch.int64) if counts is None else counts})


GLOBAL = message(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]), torch.tensor([5, 5, 5]))


def grads(algo, model, msg, ctx):
    model.zero_grad()
    x, y = ctx.data
    local = class_means(ctx.embed(model.body), y, C) if algo.augments(msg) else None
    loss_fn, extras = algo.local_objective(msg, ctx, local)
    loss = loss_fn(model, x, y, extras)
    loss.backward()
    return loss.item(), {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                         for k, p in model.named_parameters()}


def test_augmentation_loss_reaches_only_the_classifier():
    model, ctx = tiny_model(), client(torch.tensor([0, 0, 1, 1, 0, 1]))
    l0, g0 = grads(rebafl(mu_aug=0.0), model, GLOBAL, ctx)
    l1, g1 = grads(rebafl(mu_aug=1.0), model, GLOBAL, ctx)
    assert l1 > l0
    for k in g0:
        diff = (g1[k] - g0[k]).abs().max().item()
        if k.startswith("body."):
            assert diff == 0.0, k  # detached features: l_aug does not move the body
        else:
            assert diff > 0.0, k  # ... but trains the head


def test_no_augmentation_before_the_server_has_prototypes():
    model, ctx = tiny_model(), client(torch.tensor([0, 0, 1, 1]))
    l_no, _ = grads(rebafl(mu_aug=1.0), model, message(), ctx)  # round 1: all counts 0
    l_bsm, _ = grads(rebafl(mu_aug=0.0), model, message(), ctx)
    assert l_no == l_bsm


def test_rbsm_off_is_plain_cross_entropy():
    model, ctx = tiny_model(), client(torch.tensor([0, 0, 0, 1]))
    loss, _ = grads(rebafl(rbsm=False, faug=False), model, message(), ctx)
    expected = nn.functional.cross_entropy(model(ctx.data[0]), ctx.data[1]).item()
    assert math.isclose(loss, expected, rel_tol=1e-6)
    loss_rbsm, _ = grads(rebafl(faug=False), model, message(), ctx)
    assert not math.isclose(loss, loss_rbsm, rel_tol=1e-3)


def test_single_class_client_gradient():
    """eps = 0 without augmentation: zero loss and gradient; eps > 0 or the augmentation
    (other classes from the global prototypes) each give a non-zero gradient."""
    model, ctx = tiny_model(), client(torch.tensor([2, 2, 2, 2, 2]))
    loss, g = grads(rebafl(epsilon=0.0, faug=False), model, message(), ctx)
    assert loss == 0.0 and all(v.abs().max() == 0 for v in g.values())
    loss, g = grads(rebafl(epsilon=0.01, faug=False), model, message(), ctx)
    assert loss > 0 and all(v.abs().max() > 0 for v in g.values())
    loss, g = grads(rebafl(epsilon=0.0, mu_aug=0.1), model, GLOBAL, ctx)
    assert loss > 0
    assert g["head.weight"].abs().max() > 0 and g["head.bias"].abs().max() > 0
    assert all(v.abs().max() == 0 for k, v in g.items() if k.startswith("body."))


# ---------------------------------------------------------------------------------------
# server: eq. 23 and eq. 24
# ---------------------------------------------------------------------------------------
class FakeServer:
    def __init__(self):
        self.logs = {}

    def log(self, key, value):
        self.logs[key] = float(value)


def reply(w, protos, counts, n):
    return Record(weights={"a": torch.tensor(w)}, arrays={"proto": torch.tensor(protos), "counts": torch.tensor(counts)},
                  num_samples=n)


def test_aggregation_of_weights_and_prototypes():
    old = ReBaFLState({"a": torch.tensor([0.0, 0.0])}, torch.tensor([[0.0, 0.0], [7.0, 7.0], [9.0, 9.0]]),
                      torch.tensor([0, 4, 4]))
    replies = [
        (0, reply([1.0, 0.0], [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], [1, 0, 0], 1)),
        (1, reply([0.0, 1.0], [[3.0, 5.0], [2.0, 2.0], [0.0, 0.0]], [3, 1, 0], 4)),
    ]
    srv = FakeServer()
    new = rebafl().aggregate(old, 1, replies, srv)
    assert torch.allclose(new.weights["a"], torch.tensor([0.2, 0.8]))  # n_k weighted
    # eq. 23 over the arriving clients: class 0: (1 * [1, 1] + 3 * [3, 5]) / 4; class 1 only
    # from client 1; class 2 (nobody sent it): no global prototype, as in the paper and the code
    assert torch.allclose(new.prototypes, torch.tensor([[2.5, 4.0], [2.0, 2.0], [0.0, 0.0]]))
    assert new.counts.tolist() == [4, 1, 0]
    assert srv.logs == {}  # eq. (24) is logged by the engine for every method (test_engine.py)
    kept = rebafl(prototype_memory=True).aggregate(old, 1, replies, FakeServer())  # the option: class 2 kept
    assert torch.allclose(kept.prototypes, torch.tensor([[2.5, 4.0], [2.0, 2.0], [9.0, 9.0]]))
    assert kept.counts.tolist() == [4, 1, 4]


def test_prototype_memory_is_off_by_default_and_in_the_fingerprint():
    from protofl.config import from_dict

    assert ReBaFLHyper().prototype_memory is False
    base = {"data": {"name": "digits"}, "model": {"name": "mlp"}}
    fp = {v: from_dict({**base, "algorithm": {"name": "rebafl", "prototype_memory": v}}).fingerprint()
          for v in (True, False)}
    assert fp[True] != fp[False]  # a run made with the old default is never taken for a new one
    assert from_dict({**base, "algorithm": {"name": "rebafl"}}).fingerprint() == fp[False]


def test_check_reply_requires_proto_and_counts():
    algo = rebafl()
    good = reply([1.0, 0.0], [[1.0, 1.0]] * C, [1] + [0] * (C - 1), 1)
    assert algo.check_reply(good, None) is None
    for drop in ("proto", "counts"):
        r = Record(weights=good.weights, num_samples=1, arrays={k: v for k, v in good.arrays.items() if k != drop})
        assert "must carry the arrays 'proto' and 'counts'" in algo.check_reply(r, None)
    # without the augmentation (ablation "R-BSM only") the clients send no prototypes
    assert rebafl(faug=False).check_reply(Record(weights=good.weights, num_samples=1), None) is None


def test_nobody_arrived_keeps_the_state_and_logs_nothing():
    old = ReBaFLState({"a": torch.ones(2)}, torch.ones(C, D), torch.ones(C, dtype=torch.int64))
    srv = FakeServer()
    assert rebafl().aggregate(old, 1, [], srv) is old and srv.logs == {}


@pytest.mark.parametrize("key,value", [("epsilon", 1.5), ("mu_aug", -0.1), ("lam", -1.0)])
def test_hyper_parameters_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        check_dataclass(ReBaFLHyper, {key: value}, "algorithm")


# ---------------------------------------------------------------------------------------
# a run on digits: the messages
# ---------------------------------------------------------------------------------------
def test_messages_of_a_run(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=rebafl", "rounds=2", "eval.personal=false")
    sim, res, seen = record_run(cfg.replace(**{"execution.threads": 1}), tmp_path / "r")
    counts = torch.from_numpy(sim.fed.class_counts())
    d = sim.info.feature_dim
    first = [(cid, rep) for rnd, cid, msg, rep, _ in seen if rnd == 1]
    for rnd, cid, msg, rep, _ in seen:
        assert msg.arrays["proto"].shape == (10, d) and rep.arrays["proto"].shape == (10, d)
        assert torch.equal(rep.arrays["counts"].cpu(), counts[cid])  # n_kc of the client
        assert torch.all(rep.arrays["proto"][counts[cid] == 0] == 0)
        if rnd == 1:
            assert int(msg.arrays["proto_counts"].sum()) == 0  # no prototypes yet
        else:  # the round-1 senders' classes, with their total counts
            assert torch.equal(msg.arrays["proto_counts"].cpu(), sum(counts[c] for c, _ in first))
    assert all("weight_diversity" in row and row["weight_diversity"] > 0 for row in res.rows)


def test_ablation_without_augmentation_sends_no_prototypes(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    cfg = digits_cfg("algorithm.name=rebafl", "algorithm.faug=false", "rounds=1", "eval.personal=false")
    sim = Simulation(cfg, run_dir=tmp_path / "r")
    state = sim.algorithm.server_init(sim.server)
    msg = sim.algorithm.configure(state, 1, sim.server)
    assert set(msg.weights) == set(state.weights) and not msg.arrays
    assert sim.run().summary["status"] == "complete"
