"""FedNova: ||a_i||_1 of SGD with momentum against the engine's optimizer, the normalized
averaging by hand for clients with different step counts, FedAvg when the steps agree."""
import pytest
import torch
from torch import nn

from protofl import run
from protofl.algorithms.base import WeightsState
from protofl.algorithms.fednova import a_norm, FedNova, FedNovaHyper
from protofl.config import check_dataclass
from protofl.engine.train import fit, TrainSettings
from protofl.errors import ConfigError
from protofl.messages import Record


def test_a_norm_by_hand():
    assert a_norm(3, 0.0) == 3.0  # vanilla SGD: ||a||_1 = tau
    # rho = 0.5, tau = 3: a = [(1 - rho^3), (1 - rho^2), (1 - rho)] / (1 - rho) = [1.75, 1.5, 1]
    assert a_norm(3, 0.5) == pytest.approx(4.25)
    assert a_norm(1, 0.9) == pytest.approx(1.0)  # one step: no momentum yet


@pytest.mark.parametrize("rho,tau", [(0.0, 4), (0.5, 3), (0.9, 7)])
def test_a_norm_is_what_the_engines_sgd_accumulates(rho, tau):
    # a constant gradient c: tau steps of the engine's heavy-ball SGD move w by -lr c ||a||_1
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    c = 2.0
    stats = fit(model, torch.zeros(1, 1), torch.zeros(1, dtype=torch.long),
                loss=lambda m, x, y, e: c * m.weight.sum(), extras={}, names=["weight"],
                settings=TrainSettings(lr=0.1, momentum=rho, batch_size=1, steps=tau),
                generator=torch.Generator().manual_seed(0))
    assert stats.steps == tau
    assert float(-model.weight.detach()) / (0.1 * c) == pytest.approx(a_norm(tau, rho), rel=1e-6)


def reply(d, a, n, rest=None):
    arrays = {"d": {"w": torch.tensor(d)}}
    if rest is not None:
        arrays["rest"] = {"bn": torch.tensor(rest)}
    return Record(arrays=arrays, metrics={"a": a, "tau": a}, num_samples=n)


def aggregate(replies, weighting="samples"):
    state = WeightsState({"w": torch.tensor([0.0, 0.0]), "bn": torch.tensor([9.0])})
    return FedNova(FedNovaHyper(weighting=weighting), None).aggregate(state, 1, list(enumerate(replies)), None)


def test_normalized_averaging_of_clients_with_different_step_counts():
    # client A: 1 step, update [-1, 0] -> d_A = [1, 0]; client B: 4 steps, update [0, -4] -> d_B = [0, 1]
    # (plain SGD: ||a_i||_1 = tau_i). FedAvg, equal sizes: [-0.5, -2], pulled toward B's objective.
    s = aggregate([reply([1.0, 0.0], 1.0, 5, [1.0]), reply([0.0, 1.0], 4.0, 5, [3.0])])
    # tau_eff = (1 + 4) / 2 = 2.5, sum p_i d_i = [0.5, 0.5]: x = -2.5 [0.5, 0.5]
    assert torch.allclose(s.weights["w"], torch.tensor([-1.25, -1.25]))
    assert torch.allclose(s.weights["bn"], torch.tensor([2.0]))  # buffers: FedAvg's mean
    # sizes 3 : 1: p = [0.75, 0.25], tau_eff = 0.75 + 1 = 1.75, sum p_i d_i = [0.75, 0.25]
    s = aggregate([reply([1.0, 0.0], 1.0, 3), reply([0.0, 1.0], 4.0, 1)])
    assert torch.allclose(s.weights["w"], torch.tensor([-1.3125, -0.4375]))
    assert torch.equal(s.weights["bn"], torch.tensor([9.0]))  # in no reply: kept
    # uniform weighting ignores the sizes
    s = aggregate([reply([1.0, 0.0], 1.0, 3), reply([0.0, 1.0], 4.0, 1)], weighting="uniform")
    assert torch.allclose(s.weights["w"], torch.tensor([-1.25, -1.25]))


def test_a_reply_whose_d_holds_other_weights_than_the_others_is_left_out():
    # two honest clients (d = {w}) and one that moved w into rest and sent a d of bn alone:
    # the server averages the honest two and does not crash on the missing term
    odd = Record(arrays={"d": {"bn": torch.tensor([5.0])}, "rest": {"w": torch.tensor([7.0, 7.0])}},
                 metrics={"a": 1.0, "tau": 1.0}, num_samples=5)
    s = aggregate([odd, reply([1.0, 0.0], 1.0, 5), reply([0.0, 1.0], 4.0, 5)])
    assert torch.allclose(s.weights["w"], torch.tensor([-1.25, -1.25]))
    assert torch.equal(s.weights["bn"], torch.tensor([9.0]))


def test_equal_steps_are_fedavg_and_nobody_arriving_keeps_the_model():
    # both took 2 steps: d_i = update_i / 2, tau_eff = 2: x = mean of the updates, FedAvg's
    s = aggregate([reply([0.5, 0.0], 2.0, 1), reply([0.0, 1.5], 2.0, 3)])
    assert torch.allclose(s.weights["w"], -(torch.tensor([1.0, 0.0]) * 0.25 + torch.tensor([0.0, 3.0]) * 0.75))
    state = WeightsState({"w": torch.zeros(2)})
    assert FedNova(FedNovaHyper(), None).aggregate(state, 1, [], None) is state


def test_same_steps_everywhere_is_fedavg_end_to_end(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=2", "training.steps=3", "training.momentum=0.5", "partition.num_clients=3",
                     "participation.fraction=1.0", "eval.final_all_clients=false")
    nova = run(cfg.replace(**{"algorithm.name": "fednova"}), run_dir=tmp_path / "nova").server_state.weights
    avg = run(cfg, run_dir=tmp_path / "avg").server_state.weights
    assert all(torch.allclose(nova[k], avg[k], atol=1e-6) for k in avg)


def test_replies_without_a_and_adam_are_refused_and_bad_settings_are_config_errors(digits_cfg, tmp_path):
    algo = FedNova(FedNovaHyper(), None)
    sent = Record(weights={"w": torch.zeros(2)})
    assert algo.check_reply(reply([1.0, 0.0], 1.0, 1), sent) is None
    assert "metric 'a'" in algo.check_reply(Record(arrays={"d": {"w": torch.zeros(2)}}), sent)
    assert "metric 'a'" in algo.check_reply(reply([1.0, 0.0], -1.0, 1), sent)
    assert "shaped like" in algo.check_reply(Record(arrays={"d": {"w": torch.zeros(3)}}, metrics={"a": 1.0}), sent)
    # every weight once, in d or in rest: one left out, or sent twice, is refused
    sent = Record(weights={"w": torch.zeros(2), "v": torch.zeros(1), "bn": torch.zeros(1)})
    split = {"d": {"w": torch.zeros(2), "v": torch.zeros(1)}, "rest": {"bn": torch.zeros(1)}}
    assert algo.check_reply(Record(arrays=split, metrics={"a": 1.0}), sent) is None
    for arrays in ({"d": {"w": torch.zeros(2)}, "rest": {"bn": torch.zeros(1)}},
                   {**split, "rest": {"bn": torch.zeros(1), "v": torch.zeros(1)}}):
        assert "split the model's weights" in algo.check_reply(Record(arrays=arrays, metrics={"a": 1.0}), sent)
    assert "no normalized update d" in algo.check_reply(Record(arrays={"d": {}, "rest": split["d"]},
                                                               metrics={"a": 1.0}), sent)
    # rest as one array instead of a group: refused (aggregate would call .items() on it)
    assert "rest is one array" in algo.check_reply(Record(arrays={"d": split["d"], "rest": torch.zeros(1)},
                                                          metrics={"a": 1.0}), sent)
    with pytest.raises(ConfigError, match="algorithm.weighting"):
        check_dataclass(FedNovaHyper, {"weighting": "steps"}, "algorithm")
    cfg = digits_cfg("algorithm.name=fednova", "rounds=1", "training.optimizer=adam", "training.momentum=0")
    with pytest.raises(ConfigError, match="training.optimizer='adam': FedNova normalizes SGD"):
        run(cfg, run_dir=tmp_path)
