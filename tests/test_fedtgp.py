"""FedTGP: the adaptive margin, the ACL loss, the trainable prototypes on the server."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedtgp import (FedTGP, FedTGPHyper, TrainablePrototypes, acl_loss, adaptive_margin)
from protofl.messages import Record
from protofl.nn.prototypes import prototype_rows


def test_adaptive_margin_by_hand():
    Q = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0], [9.0, 9.0]])
    present = torch.tensor([True, True, True, False])  # class 3 uploaded nothing: left out
    # each class's nearest other centre: 3, 3, 4 -> the largest, 4, capped by tau
    assert adaptive_margin(Q, present, 100.0) == pytest.approx(4.0)
    assert adaptive_margin(Q, present, 2.5) == pytest.approx(2.5)
    assert adaptive_margin(Q, torch.tensor([True, False, False, False]), 100.0) == 0.0  # one class: no margin


def test_acl_loss_by_hand():
    generated = torch.tensor([[0.0, 0.0], [3.0, 4.0]])  # distances 0 and 5 from the client prototype
    P, y = torch.tensor([[0.0, 0.0]]), torch.tensor([0])
    # -log(e^{-(0 + 1)} / (e^{-(0 + 1)} + e^{-5}))
    assert float(acl_loss(P, y, generated, 1.0)) == pytest.approx(math.log(1 + math.exp(-4.0)), rel=1e-5)
    # the margin is added to the own class only: with y = 1 the distances are 5 + 1 and 0
    assert float(acl_loss(P, torch.tensor([1]), generated, 1.0)) == pytest.approx(6 + math.log(1 + math.exp(-6.0)),
                                                                                   rel=1e-5)
    g = generated.clone().requires_grad_(True)
    acl_loss(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([0, 1]), g, 1.0).backward()
    assert torch.isfinite(g.grad).all()  # coincident points: no nan from the square root


def test_prototype_rows_lists_the_held_classes_table_by_table():
    a, b = torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]]), torch.tensor([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]])
    P, y = prototype_rows([a, b], [torch.tensor([4, 0, 1]), torch.tensor([0, 2, 0])])
    torch.testing.assert_close(P, torch.tensor([[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]))
    assert y.tolist() == [0, 2, 1]


def reply(protos, classes):
    r = Record(arrays={"protos": torch.tensor(protos), "classes": torch.tensor(classes),
                       "counts": torch.full((len(classes),), 5, dtype=torch.int64)})
    r.num_samples = 5 * len(classes)
    return r


def info():
    return TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0, rounds=2)


def test_server_learns_separated_prototypes_only_for_uploaded_classes():
    algo = FedTGP(FedTGPHyper(server_epochs=100, server_lr=0.1, server_batch=4), info())
    logged = {}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=logged.__setitem__,
                          rng=lambda rnd, *keys: np.random.default_rng(rnd))
    state = algo.server_init(ctx)
    assert state.counts.tolist() == [0, 0, 0] and TrainablePrototypes(3, 2, 4)().shape == (3, 2)
    replies = [(0, reply([[1.0, 0.0], [0.0, 1.0]], [0, 1])), (1, reply([[1.2, 0.1], [0.1, 1.1]], [0, 1]))]
    new = algo.aggregate(state, 1, replies, ctx)
    assert new.counts.tolist() == [10, 10, 0]
    assert new.protos[2].abs().sum() == 0  # no client uploaded class 2: no global prototype
    # margin: the two class centres (1.1, 0.05) and (0.05, 1.05)
    assert logged["tgp_margin"] == pytest.approx(math.hypot(1.05, 1.0), rel=1e-5)
    # every client prototype is nearer its own class's learned prototype than the other's
    P = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.2, 0.1], [0.1, 1.1]])
    assert torch.cdist(P, new.protos[:2]).argmin(1).tolist() == [0, 1, 0, 1]
    # the generator persists: a round without replies keeps everything
    assert algo.aggregate(new, 2, [], ctx) is new


def test_bad_hyper_parameter_is_a_config_error(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="server_batch"):
        digits_cfg("algorithm.name=fedtgp", "algorithm.server_batch=0")


def test_a_round_whose_replies_hold_no_prototype_keeps_the_tgp_and_logs_only_the_margin():
    algo = FedTGP(FedTGPHyper(server_epochs=3), info())
    logged = {}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=logged.__setitem__,
                          rng=lambda rnd, *keys: np.random.default_rng(rnd))
    state = algo.server_init(ctx)
    # clients without data (or private counts rounded to 0) reply zero rows
    empty = Record(arrays={"protos": torch.zeros(0, 2), "classes": torch.zeros(0, dtype=torch.int64),
                           "counts": torch.zeros(0, dtype=torch.int64)})
    assert algo.check_reply(empty, Record()) is None
    new = algo.aggregate(state, 1, [(0, empty), (1, empty)], ctx)
    assert new is state and logged == {"tgp_margin": 0.0}
