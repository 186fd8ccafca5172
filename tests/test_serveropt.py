"""The server optimizers (algorithm.server_opt; FedAvgM, FedAdam, FedYogi, FedAdagrad): their
steps by hand on tiny tensors, `none` leaving every method as it was, the moments in the
server state of every method with one global model, and a bit-identical resume."""

import pytest
import torch
from torch import nn

from protofl import run
from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import GlobalModel, weighted_mean, WeightsState
from protofl.algorithms.fedavg import FedAvg, FedAvgHyper
from protofl.algorithms.serveropt import ServerOptHyper
from protofl.config import check_dataclass
from protofl.errors import ConfigError
from protofl.messages import Record

from conftest import kill_and_resume, strip_timing


class Tiny(nn.Module):
    """Parameters w (2,) and ``fixed`` (in no reply); buffers bn (float) and n (int)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.fixed = nn.Parameter(torch.zeros(1))
        self.register_buffer("bn", torch.zeros(1))
        self.register_buffer("n", torch.tensor(0))


class Ctx:
    def shared_model(self, weights=None):
        return Tiny()


def start():
    return WeightsState({"w": torch.tensor([1.0, 2.0]), "fixed": torch.tensor([7.0]), "bn": torch.tensor([5.0]),
                         "n": torch.tensor(3)})


# one reply: x_bar = w [0, 2.25], so Delta_0 = x_bar - x_0 = [-1, 0.25]
REPLY = [(0, Record(weights={"w": torch.tensor([0.0, 2.25]), "bn": torch.tensor([1.0]), "n": torch.tensor(5)},
                    num_samples=2))]


def step(opt, state=None, **hp):
    algo = FedAvg(FedAvgHyper(server_opt=opt, **hp), None)
    return algo.aggregate(start() if state is None else state, 1, REPLY, Ctx())


def close(t, values):
    return torch.allclose(t, torch.tensor(values), atol=1e-6, rtol=0)


def test_avgm_is_server_momentum_over_two_rounds():
    s1 = step("avgm", server_momentum=0.5, server_lr=1.0)  # m_0 = Delta_0; x_1 = x_0 + m_0 = x_bar
    assert close(s1.weights["w"], [0.0, 2.25]) and close(s1.server_opt_state["m"]["w"], [-1.0, 0.25])
    s2 = step("avgm", s1, server_momentum=0.5, server_lr=1.0)  # Delta_1 = 0: m_1 = 0.5 m_0
    assert close(s2.weights["w"], [-0.5, 2.375]) and close(s2.server_opt_state["m"]["w"], [-0.5, 0.125])
    s = step("avgm", server_momentum=0.5, server_lr=2.0)  # eta = 2: x_1 = x_0 + 2 Delta_0
    assert close(s.weights["w"], [-1.0, 2.5])


def test_yogi_second_moment_takes_each_sign_of_v_minus_delta_squared():
    # beta_1 = 0.4, beta_2 = 0.76, tau = 0.5: v_{-1} = tau^2 = 0.25, Delta_0^2 = [1, 0.0625]
    hp = dict(server_momentum=0.4, server_beta2=0.76, server_tau=0.5, server_lr=1.0)
    s1 = step("yogi", **hp)
    m, v = s1.server_opt_state["m"]["w"], s1.server_opt_state["v"]["w"]
    assert close(m, [-0.6, 0.15])  # (1 - beta_1) Delta_0
    # v < Delta^2: v + 0.24 * 1 = 0.49;   v > Delta^2: v - 0.24 * 0.0625 = 0.235
    assert close(v, [0.49, 0.235])
    assert close(s1.weights["w"], [1 - 0.6 / (0.7 + 0.5), 2 + 0.15 / (0.235 ** 0.5 + 0.5)])
    # round 2: Delta_1[0] = 0 - 0.5 = -0.5, Delta^2 = 0.25 < v = 0.49: v = 0.49 - 0.24 * 0.25 = 0.43
    s2 = step("yogi", s1, **hp)
    assert abs(float(s2.server_opt_state["v"]["w"][0]) - 0.43) < 1e-6


def test_adam_and_adagrad_steps():
    hp = dict(server_momentum=0.4, server_beta2=0.68, server_tau=0.5, server_lr=1.0)
    s = step("adam", **hp)  # v_0 = 0.68 * 0.25 + 0.32 * Delta^2 = [0.49, 0.19]
    assert close(s.server_opt_state["v"]["w"], [0.49, 0.19])
    assert close(s.weights["w"], [1 - 0.6 / (0.7 + 0.5), 2 + 0.15 / (0.19 ** 0.5 + 0.5)])
    s = step("adam", server_lr=0.5, **{k: v for k, v in hp.items() if k != "server_lr"})  # eta scales the step
    assert close(s.weights["w"], [1 - 0.5 * 0.6 / 1.2, 2 + 0.5 * 0.15 / (0.19 ** 0.5 + 0.5)])
    s = step("adagrad", server_momentum=0.5, server_tau=0.75, server_lr=1.0)  # v_0 = 0.5625 + [1, 0.0625]
    assert close(s.server_opt_state["v"]["w"], [1.5625, 0.625])
    assert close(s.weights["w"], [1 - 0.5 / (1.25 + 0.75), 2 + 0.125 / (0.625 ** 0.5 + 0.75)])


@pytest.mark.parametrize("opt", ["avgm", "adam", "yogi", "adagrad"])
def test_buffers_come_from_the_average_and_entries_in_no_reply_keep_their_value(opt):
    s = step(opt)
    assert s.weights["bn"].item() == 1.0 and s.weights["n"].item() == 5 and s.weights["fixed"].item() == 7.0
    assert set(s.server_opt_state["m"]) == {"w"}  # parameters the replies carried, only
    algo = FedAvg(FedAvgHyper(server_opt=opt), None)
    assert algo.aggregate(s, 2, [], Ctx()) is s  # nobody arrived: no step, moments kept


def test_none_is_the_weighted_average_exactly():
    replies = REPLY + [(1, Record(weights={"w": torch.tensor([3.0, 1.0]), "bn": torch.tensor([2.0]),
                                           "n": torch.tensor(4)}, num_samples=1))]
    s = FedAvg(FedAvgHyper(), None).aggregate(start(), 1, replies, None)  # no ctx needed: no optimizer
    avg = weighted_mean([(2, replies[0][1].weights), (1, replies[1][1].weights)])
    assert all(torch.equal(s.weights[k], avg[k]) for k in avg) and s.server_opt_state is None


def test_the_named_methods_are_fedavg_with_their_optimizer_and_the_authors_notes_defaults():
    for name, opt, eta in (("fedavgm", "avgm", 1.0), ("fedadam", "adam", 1e-2), ("fedyogi", "yogi", 1e-2),
                           ("fedadagrad", "adagrad", 1e-1)):
        algo = ALGORITHMS.get(name)
        hp = check_dataclass(algo.Hyper, {}, "algorithm")
        assert issubclass(algo, FedAvg) and algo.family == "server optimizers"
        assert (hp.server_opt, hp.eta, hp.server_momentum, hp.server_beta2, hp.server_tau) == (opt, eta, 0.9,
                                                                                                0.999, 1e-3)
        with pytest.raises(ConfigError, match=f"this method is FedAvg with server_opt {opt}"):
            check_dataclass(algo.Hyper, {"server_opt": "none"}, "algorithm")


@pytest.mark.parametrize("key,value,why", [
    ("server_opt", "sgd", "expected one of"), ("server_lr", 0.0, "must be > 0"),
    ("server_momentum", 1.0, r"must be in \[0, 1\)"), ("server_beta2", -0.1, r"must be in \[0, 1\)"),
    ("server_tau", 0.0, "must be > 0"), ("server_tau", 1e30, "at most 1e18"),
    ("server_tau", float("inf"), "must be a finite number")])
def test_bad_settings_are_one_line_config_errors(key, value, why):
    with pytest.raises(ConfigError, match=why) as e:
        check_dataclass(FedAvgHyper, {key: value}, "algorithm")
    assert str(e.value).startswith(f"invalid config: algorithm.{key}=") and "\n" not in str(e.value)


def test_every_global_model_method_has_the_settings_and_none_keeps_its_fingerprint(digits_cfg):
    for name in ALGORITHMS.names():
        algo = ALGORITHMS.get(name)
        if issubclass(algo, GlobalModel):
            assert issubclass(algo.Hyper, ServerOptHyper), name
    # the fingerprints these configs had before server_opt existed (run folders keep their names)
    cfg = digits_cfg()
    assert cfg.fingerprint() == "b8086ca6"
    assert cfg.replace(**{"algorithm.name": "scaffold"}).fingerprint() == "b6f6b3c8"  # its own server_lr: 1.0
    explicit = cfg.replace(**{"algorithm.server_opt": "none", "algorithm.server_lr": None,
                              "algorithm.server_momentum": 0.9, "algorithm.server_tau": 1e-3})
    assert explicit.fingerprint() == cfg.fingerprint()
    assert len({cfg.fingerprint(), cfg.replace(**{"algorithm.server_opt": "avgm"}).fingerprint(),
                cfg.replace(**{"algorithm.server_opt": "avgm", "algorithm.server_lr": 0.5}).fingerprint()}) == 3


# methods with their own server step (SCAFFOLD's eta_g, FedDyn's h) pass it through the optimizer:
# avgm with beta = 0 and eta = 1 is x_bar itself, up to float rounding
@pytest.mark.parametrize("name", ["fedavg", "scaffold", "feddyn"])
def test_avgm_without_momentum_is_the_methods_own_step(name, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.num_clients=3", "participation.fraction=1.0",
                     "eval.final_all_clients=false")
    own = run(cfg, run_dir=tmp_path / "own").server_state
    opt = run(cfg.replace(**{"algorithm.server_opt": "avgm", "algorithm.server_momentum": 0.0,
                             "algorithm.server_lr": 1.0}), run_dir=tmp_path / "opt").server_state
    assert opt.server_opt_state is not None and own.server_opt_state is None
    for k, v in own.weights.items():
        assert torch.allclose(v.float(), opt.weights[k].float(), atol=1e-5), k


# every method with one global model (fedadam stands for the three other named optimizers)
GLOBAL = [n for n in ALGORITHMS.names() if issubclass(ALGORITHMS.get(n), GlobalModel)
          and n not in ("fedavgm", "fedyogi", "fedadagrad")]


@pytest.mark.parametrize("name", GLOBAL)
def test_every_global_model_method_keeps_the_moments_in_its_state(name, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "algorithm.server_opt=adam", "rounds=1", "partition.num_clients=2",
                     "participation.fraction=1.0", "eval.final_all_clients=false")
    state = run(cfg, run_dir=tmp_path).server_state
    moments = state.server_opt_state
    assert moments is not None and moments["m"] and moments["m"].keys() == moments["v"].keys(), name


def test_resume_with_a_server_optimizer_is_bit_identical(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedyogi", "rounds=4", "output.checkpoint_every=2")
    full, resumed = kill_and_resume(cfg, tmp_path, after=3)  # last checkpoint: round 2
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    a, b = full.server_state, resumed.server_state
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    for part in ("m", "v"):
        assert all(torch.equal(a.server_opt_state[part][k], b.server_opt_state[part][k])
                   for k in a.server_opt_state[part])
