"""SphereFed: the fixed orthonormal classifier, the clients' statistics and the server's
closed-form calibration by hand, its distributed form, the local losses; a run on digits."""
import pytest
import torch

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.spherefed import SphereFed, SphereFedHyper, least_squares_classifier
from protofl.nn.heads import max_separated_prototypes, orthonormal_prototypes


def test_orthonormal_prototypes():
    W = orthonormal_prototypes(10, 64, seed=3)
    assert W.shape == (10, 64) and W.dtype == torch.float32
    assert torch.allclose(W @ W.T, torch.eye(10), atol=1e-6)  # unit rows, pairwise cosine 0
    assert torch.equal(W, orthonormal_prototypes(10, 64, seed=3))  # the same in every process
    assert not torch.allclose(W, orthonormal_prototypes(10, 64, seed=4))
    assert torch.allclose(orthonormal_prototypes(4, 4) @ orthonormal_prototypes(4, 4).T, torch.eye(4), atol=1e-6)
    with pytest.raises(ValueError, match="d >= C"):
        orthonormal_prototypes(10, 9)


def test_least_squares_calibration_by_hand():
    # class 0: h = (1, 0), (0.6, 0.8); class 1: h = (0, 1)
    H = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    gram = H.T @ H  # [[1.36, 0.48], [0.48, 1.64]], det 2
    sums = torch.tensor([[1.6, 0.8], [0.0, 1.0]])  # per class, the sum of its h
    W = least_squares_classifier(gram, sums)
    # W^T = gram^-1 sums^T = [[0.82, -0.24], [-0.24, 0.68]] [[1.6, 0], [0.8, 1]]
    assert torch.allclose(W, torch.tensor([[1.12, 0.16], [-0.24, 0.68]], dtype=torch.float64), atol=1e-12)
    Y = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert torch.allclose(W.T, torch.linalg.lstsq(H.double(), Y.double()).solution, atol=1e-12)  # the least squares
    # singular H^T H (every feature the same): the minimum-norm solution
    W = least_squares_classifier(torch.tensor([[3.0, 0.0], [0.0, 0.0]]), torch.tensor([[2.0, 0.0], [1.0, 0.0]]))
    assert torch.allclose(W, torch.tensor([[2 / 3, 0.0], [1 / 3, 0.0]], dtype=torch.float64), atol=1e-12)
    # ridge: (H^T H + lambda I)^-1
    W = least_squares_classifier(gram, sums, ridge=1.0)
    assert torch.allclose(W.T, torch.linalg.solve(gram.double() + torch.eye(2, dtype=torch.float64), sums.double().T))


def algo(C=2, d=2, **hp):
    return SphereFed(SphereFedHyper(**hp), TaskInfo(num_classes=C, num_clients=2, feature_dim=d, input_shape=(d,),
                                                    seed=0, rounds=1))


def test_statistics_of_the_normalized_features_and_the_distributed_solution():
    z = torch.tensor([[2.0, 0.0], [3.0, 4.0], [0.0, 0.5]])  # normalized: the three h above
    y = torch.tensor([0, 0, 1])
    stats = algo().statistics(z, y)
    assert torch.allclose(stats["gram"], torch.tensor([[1.36, 0.48], [0.48, 1.64]]))
    assert torch.allclose(stats["sums"], torch.tensor([[1.6, 0.8], [0.0, 1.0]]))
    # two clients: the server adds their sums; the same classifier as from all samples at once
    from protofl.messages import Record

    parts = [algo().statistics(z[:2], y[:2]), algo().statistics(z[2:], y[2:])]
    w = {"head.weight": torch.eye(2), "head.scale": torch.tensor(10.0)}
    head = algo().calibrate(w, [Record(arrays=p) for p in parts], 1, None)
    assert torch.allclose(head["head.weight"], torch.tensor([[1.12, 0.16], [-0.24, 0.68]]), atol=1e-6)
    assert float(head["head.scale"]) == 1.0


def test_local_losses():
    from protofl.models import build_model

    model = algo(C=2, d=2).adapt_model(build_model("mlp", (2,), 2, hidden=[4], feature_dim=2))
    model.head.weight.copy_(torch.eye(2))
    model.body = torch.nn.Identity()
    x, y = torch.tensor([[3.0, 4.0]]), torch.tensor([0])
    # squared error of W h, h = (0.6, 0.8): (0.6 - 1)^2 + 0.8^2 = 0.8
    assert torch.isclose(SphereFed.squared_error(model, x, y, {}), torch.tensor(0.8))
    # cross-entropy of s W h, s = 10: -log softmax(6, 8)_0
    assert torch.isclose(torch.nn.functional.cross_entropy(model(x), y), torch.log1p(torch.exp(torch.tensor(2.0))))


def test_run_keeps_the_fixed_classifier_and_evaluates_the_calibrated_one(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    sim = Simulation(digits_cfg("algorithm.name=spherefed", "rounds=2", "eval.personal=false"), run_dir=tmp_path / "r")
    res = sim.run()
    W = orthonormal_prototypes(sim.info.num_classes, sim.info.feature_dim, seed=sim.info.seed)
    state = res.server_state
    assert torch.equal(state.weights["head.weight"], W) and float(state.weights["head.scale"]) == 10.0
    assert torch.equal(state.head["head.weight"], W)  # w_2's own classifier, kept for gm@uncalibrated
    assert not torch.allclose(state.calibrated["head.weight"], W) and float(state.calibrated["head.scale"]) == 1.0
    assert {"gm", "gm@uncalibrated"} <= set(res.rows[-1])


def test_fewer_dimensions_than_classes_use_maximally_separated_vectors(digits_cfg):
    from protofl.engine.task import Task

    task = Task.build(digits_cfg("algorithm.name=spherefed", "model.feature_dim=8"))
    model = task.models("cpu").get(task.arch(0))
    assert torch.equal(model.head.weight, max_separated_prototypes(10, 8, task.info.seed))


def test_bad_hyper_parameters_are_one_line_errors(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="scale"):
        digits_cfg("algorithm.name=spherefed", "algorithm.scale=0")
    with pytest.raises(ConfigError, match="ridge"):
        digits_cfg("algorithm.name=spherefed", "algorithm.ridge=-1")
    with pytest.raises(ConfigError, match="loss"):
        digits_cfg("algorithm.name=spherefed", "algorithm.loss=hinge")


def test_a_reply_without_the_statistics_calibrate_reads_is_refused():
    """calibrate reads every reply's gram and sums: a reply without one, or with a group in
    its place, is refused by check_reply (it raised KeyError on the server)."""
    from protofl.messages import Record

    m = algo(C=3, d=2)
    good = {"gram": torch.zeros(2, 2), "sums": torch.zeros(3, 2)}
    assert m.check_reply(Record(arrays=good), Record()) is None
    assert "must carry" in m.check_reply(Record(arrays={"gram": good["gram"]}), Record())
    assert "must carry" in m.check_reply(Record(arrays={**good, "sums": {"s": torch.zeros(3, 2)}}), Record())
    assert "shape" in m.check_reply(Record(arrays={**good, "gram": torch.zeros(3, 3)}), Record())
