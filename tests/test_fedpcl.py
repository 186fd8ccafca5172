"""FedPCL: the prototype-wise softmax losses, the projection on top of the backbone, the
server's tables (missing classes filled with the global prototypes), the frozen backbone."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedpcl import FedPCL, FedPCLHyper, PCLState, prototype_softmax
from protofl.messages import Record
from protofl.models.base import FLModel

from conftest import record_run


def test_prototype_softmax_by_hand():
    # s = <z / ||z||, c> / tau with the prototype as it is (the authors' and PFLlib's code): the
    # length of z does not count, that of c does (a mean of unit vectors is shorter than 1)
    z, y = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    tables = torch.tensor([[[0.5, 0.0], [0.0, 3.0]],  # <z/||z||, c> = 0.5 and 0
                           [[1.0, 0.0], [0.0, 1.0]],  # class 1 missing
                           [[0.0, 0.0], [0.0, 1.0]],  # class 0 missing
                           [[0.5, 0.0], [0.6, 0.8]]])  # 0.5 and 0.6 (cosines 1 and 0.6)
    has = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    got = prototype_softmax(z, y, tables, has, tau=0.5)
    # -log(e^{0.5/0.5} / (e^{0.5/0.5} + e^{0})); a table with the own class alone gives 0; a table
    # without the own class leaves the sample out (0); -log(e^{1} / (e^{1} + e^{1.2}))
    torch.testing.assert_close(got, torch.tensor([math.log(1 + math.exp(-1.0)), 0.0, 0.0,
                                                  math.log(1 + math.exp(0.2))]))


def info(C=2, N=3):
    return TaskInfo(num_classes=C, num_clients=N, feature_dim=2, input_shape=(2,), seed=0, rounds=2)


def test_projection_ends_in_unit_features_of_the_same_dimension():
    algo = FedPCL(FedPCLHyper(), info())
    model = algo.adapt_model(FLModel(nn.Linear(3, 2), nn.Linear(2, 2), 2, 2))
    z = model.body(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) + 3)
    assert z.shape == (5, 2)
    nonzero = z.norm(dim=1) > 0
    torch.testing.assert_close(z.norm(dim=1)[nonzero], torch.ones(int(nonzero.sum())))
    assert any(k.startswith("body.0.") for k in model.state_dict()) and "body.1.0.weight" in model.state_dict()


def test_server_tables_filled_with_global_prototypes():
    algo = FedPCL(FedPCLHyper(), info(C=3))
    state = algo.server_init(None)
    assert not algo.configure(state, 1, None).arrays["has"].any()  # round 1: nothing to contrast with

    def reply(protos, classes):
        return Record(arrays={"protos": torch.tensor(protos), "classes": torch.tensor(classes),
                              "counts": torch.ones(len(classes), dtype=torch.int64)})

    state = algo.aggregate(state, 1, [(0, reply([[1.0, 0.0], [0.0, 1.0]], [0, 1])), (2, reply([[3.0, 0.0]], [0]))],
                           None)
    assert isinstance(state, PCLState)
    msg = algo.configure(state, 2, None).arrays
    torch.testing.assert_close(msg["global"], torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))  # plain means
    assert msg["has"].tolist() == [True, True, False]
    # clients 0 and 2 uploaded (client 1 never did); client 2 lacks class 1: the global prototype fills it
    torch.testing.assert_close(msg["locals"][:, :2], torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[3.0, 0.0], [0.0, 1.0]]]))
    assert msg["locals_has"].tolist() == [[True, True, False], [True, True, False]]


def test_frozen_backbone_trains_only_the_projection(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedpcl", "algorithm.backbone=frozen", "rounds=2")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    second = [(cid, state) for rnd, cid, _, _, state in seen if rnd == 2]
    assert second and res.rows[1]["train_loss"] > 0
    for cid, state in second:
        for k, v in state.weights.items():
            moved = not torch.equal(v.cpu(), init[k].cpu())
            assert moved == k.startswith("body.1."), k  # the projection g_i moves; the backbone and head stay


def test_bad_hyper_parameter_is_a_config_error(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="tau"):
        digits_cfg("algorithm.name=fedpcl", "algorithm.tau=0")
