"""Differential privacy (privacy.*, docs/privacy.md): the mechanisms on hand-computed
tensors, the noise's calibration, the accountant against published values, the three
modes end to end (off-switch bit for bit, both executors, resume, Flower's transport),
the budget and every bad input."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("dp_accounting")

from protofl import run  # noqa: E402
from protofl.algorithms.base import cross_entropy  # noqa: E402
from protofl.cli import main  # noqa: E402
from protofl.config import ConfigError, ParticipationConfig, from_dict  # noqa: E402
from protofl.engine.participation import Participation  # noqa: E402
from protofl.engine.privacy import Accountant, ClientPrivacy, clip_update, ServerPrivacy  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402
from protofl.engine.train import TrainSettings, fit  # noqa: E402
from protofl.nn.privacy import clip_rows, private_class_means, private_gradient, private_kmeans  # noqa: E402
from protofl.nn.prototypes import class_means  # noqa: E402
from protofl.rng import torch_gen  # noqa: E402

from conftest import DIGITS, kill_and_resume, strip_timing  # noqa: E402

PRIVACY_KEYS = {"epsilon", "privacy_clip", "privacy_unclipped"}


def results(rows):
    """The rows without timing and without the privacy logs (what the two runs share)."""
    return [{k: v for k, v in r.items() if k not in PRIVACY_KEYS} for r in strip_timing(rows)]


# ---------------------------------------------------------------------------------------
# the mechanisms, by hand
# ---------------------------------------------------------------------------------------
def test_private_gradient_clips_each_sample_then_averages():
    g = torch.tensor([[[3.0, 4.0], [0.3, 0.4]]])  # (S=1, b=2, 2): norms 5 and 0.5
    (out,) = private_gradient([g], clip=1.0, sigma=0.0)
    f = 1.0 / (5.0 + 1e-6)  # Opacus' factor: C / (||g|| + 1e-6), at most 1
    expect = (torch.tensor([3.0, 4.0]) * f + torch.tensor([0.3, 0.4])) / 2
    assert torch.allclose(out[0], expect, atol=1e-7)
    # the norm runs over all parameters of a sample together: (3, 4) and (12,) -> 13
    (a, b) = private_gradient([torch.tensor([[[3.0, 4.0]]]), torch.tensor([[[12.0]]])], clip=1.0, sigma=0.0)
    assert torch.allclose(torch.cat([a[0], b[0]]), torch.tensor([3.0, 4.0, 12.0]) / (13 + 1e-6), atol=1e-7)
    # the noise: sigma C z on the sum, then / b
    z = torch.tensor([[1.0, -2.0]])
    (noisy,) = private_gradient([g], clip=1.0, sigma=0.5, noise=z)
    assert torch.allclose(noisy[0], expect + 0.5 * z[0] / 2, atol=1e-7)


def test_clip_update_bounds_the_update_and_keeps_small_ones_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    sent = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen), "n": torch.tensor(4)}
    for scale in (0.01, 1.0, 100.0):
        w = {k: (v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1)
             for k, v in sent.items()}
        out, norm = clip_update(w, sent, clip=0.5)
        clipped = math.sqrt(sum(float((out[k] - sent[k]).double().pow(2).sum()) for k in ("w", "b")))
        if norm <= 0.5:
            assert all(out[k] is w[k] for k in w)  # untouched: the same tensors
        else:
            assert clipped == pytest.approx(0.5, rel=1e-6) and clipped <= 0.5 * (1 + 1e-6)
        assert torch.equal(out["n"], w["n"])  # integer buffers are not an update


def test_private_class_means_without_noise_is_class_means_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    z, y = torch.randn(40, 6, generator=gen), torch.randint(0, 5, (40,), generator=gen)
    m, n = private_class_means(z, y, 7, clip=math.inf, sigma=0.0, generator=gen)
    m0, n0 = class_means(z, y, 7)
    assert torch.equal(m, m0) and torch.equal(n, n0) and n.dtype == torch.int64
    # clipping: every feature's norm at most C before the mean
    zc = clip_rows(z * 10, 2.0)
    assert float(zc.norm(dim=1).max()) <= 2.0 + 1e-5
    assert torch.equal(clip_rows(z * 1e-3, 2.0), z * 1e-3)


def test_private_kmeans_without_noise_finds_two_separated_groups():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(30, 2, generator=gen) * 0.05 + torch.tensor([1.0, 0.0])
    b = torch.randn(30, 2, generator=gen) * 0.05 + torch.tensor([0.0, 1.0])
    z, y = torch.cat([a, b]), torch.zeros(60, dtype=torch.int64)
    centers, counts = private_kmeans(z, y, 1, k=2, steps=5, clip=10.0, sigma=0.0, generator=gen)
    got = sorted(centers[0].tolist())
    assert torch.allclose(torch.tensor(got), torch.tensor(sorted([a.mean(0).tolist(), b.mean(0).tolist()])),
                          atol=1e-5)
    assert sorted(counts[0].tolist()) == [30, 30]


# ---------------------------------------------------------------------------------------
# the noise is calibrated
# ---------------------------------------------------------------------------------------
def test_prototype_noise_has_std_sqrt2_sigma_c_on_sums_and_sqrt2_sigma_on_counts():
    # zero features: the released sums are the noise alone; 2,000 x 50 = 100,000 draws, so the
    # empirical std is within 2 % of its value (the estimate's relative std is 0.22 %)
    C, sigma, K, d = 3.0, 0.7, 2000, 50
    z, y = torch.zeros(1, d), torch.zeros(1, dtype=torch.int64)
    gen = torch_gen(0, "test")
    from protofl.nn.privacy import private_sums

    sums, counts = private_sums(z, y, K, C, sigma, gen)
    assert float(sums.std()) == pytest.approx(math.sqrt(2) * sigma * C, rel=0.02)
    assert float(counts[1:].std()) == pytest.approx(math.sqrt(2) * sigma, rel=0.05)  # 1,999 draws: 5 %
    assert abs(float(sums.mean())) < 0.02


def test_client_update_noise_has_std_sigma_c_over_m(digits_cfg):
    # updates of zero (every reply is the broadcast): the release is w_t + N(0, (sigma C / m)^2)
    cfg = digits_cfg("privacy.mode=client", "privacy.clip=2.0", "privacy.noise_multiplier=0.8",
                     "algorithm.weighting=uniform")
    sim = Simulation(cfg)
    shared = sim.privacy.broadcast(sim.algorithm.configure(sim.algorithm.server_init(sim.server), 1, sim.server))
    from protofl.engine.client import ClientOutput, ClientTask
    from protofl.messages import Record

    kept = [(ClientTask(c, 1, shared, None, None, False), ClientOutput(Record(weights=dict(shared.weights)), None))
            for c in range(sim.participation.m)]
    ((cid, rel),) = sim.privacy.release(1, shared, kept, sim.server)
    noise = torch.cat([(rel.weights[k] - shared.weights[k]).reshape(-1) for k in rel.weights])
    assert cid == -1 and noise.numel() > 10_000
    assert float(noise.std()) == pytest.approx(0.8 * 2.0 / sim.participation.m, rel=0.03)


def test_dp_sgd_noise_has_std_sigma_c_over_b():
    z = torch.randn(1, 200_000, generator=torch.Generator().manual_seed(3))
    (out,) = private_gradient([torch.zeros(1, 8, 200_000)], clip=1.5, sigma=1.2, noise=z)
    assert float(out.std()) == pytest.approx(1.2 * 1.5 / 8, rel=0.01)


# ---------------------------------------------------------------------------------------
# the accountant
# ---------------------------------------------------------------------------------------
def test_accountant_matches_published_values():
    # Opacus' documentation of compute_dp_sgd_privacy: sample rate 1 %, noise 1.0, 300 steps,
    # delta 1e-5, RDP orders 2, 5, 10, 20, 100 -> epsilon = 2.39 (optimal order 5)
    opacus = Accountant("rdp", 1e-5, orders=[2, 5, 10, 20, 100]).epsilon({("poisson", 0.01, 1.0): 300})
    assert round(opacus, 2) == 2.39
    # Abadi et al. (CCS 2016), section 3.1: q = 0.01, sigma = 4, T = 10,000, delta = 1e-5 give
    # epsilon ~ 1.26 by the moments accountant; RDP (with the tighter conversion) can only be lower
    rdp = Accountant("rdp", 1e-5).epsilon({("poisson", 0.01, 4.0): 10_000})
    pld = Accountant("pld", 1e-5).epsilon({("poisson", 0.01, 4.0): 10_000})
    assert 0.9 < pld <= rdp <= 1.26


def test_pld_matches_the_exact_gaussian_mechanism():
    # one Gaussian mechanism: delta(eps) = Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s)) exactly
    # (Balle & Wang, ICML 2018); PLD reproduces it, RDP is an upper bound
    from scipy.optimize import brentq
    from scipy.stats import norm

    s, delta = 2.0, 1e-5
    exact = brentq(lambda e: norm.cdf(-e * s + 1 / (2 * s)) - math.exp(e) * norm.cdf(-e * s - 1 / (2 * s)) - delta,
                   1e-6, 50)
    assert Accountant("pld", delta).epsilon({("gaussian", s): 1}) == pytest.approx(exact, rel=0.01)
    assert exact < Accountant("rdp", delta).epsilon({("gaussian", s): 1}) < 1.3 * exact
    assert Accountant("rdp", delta).epsilon({}) == 0.0
    assert Accountant("rdp", delta).epsilon({("gaussian", 0.0): 1}) == math.inf


# ---------------------------------------------------------------------------------------
# participation: Poisson sampling
# ---------------------------------------------------------------------------------------
def test_poisson_sampling_asks_each_client_with_probability_q():
    pm = Participation(ParticipationConfig(fraction=0.25, sampling="poisson"), 40, seed=3)
    sizes = [len(pm.selected(r)) for r in range(1, 401)]
    assert pm.q == 0.25 and len(set(sizes)) > 3  # a random number of clients
    assert np.mean(sizes) == pytest.approx(10, abs=0.5)
    assert pm.selected(7) == pm.selected(7) == sorted(pm.selected(7))  # a pure function of (seed, round)


# ---------------------------------------------------------------------------------------
# noise streams
# ---------------------------------------------------------------------------------------
def test_noise_streams_are_per_seed_round_client_and_purpose():
    cfg = from_dict({"privacy": {"mode": "prototype"}})

    def draw(rnd, cid, purpose, seed=0):
        cfg.seed = seed
        p = ClientPrivacy(cfg, rnd, cid)
        return torch.randn(4, generator=p.generator(purpose))

    assert torch.equal(draw(1, 2, "a"), draw(1, 2, "a"))
    for other in (draw(2, 2, "a"), draw(1, 3, "a"), draw(1, 2, "b"), draw(1, 2, "a", seed=1)):
        assert not torch.equal(draw(1, 2, "a"), other)
    p = ClientPrivacy(cfg, 1, 2)
    assert not torch.equal(torch.randn(4, generator=p.generator("a")), torch.randn(4, generator=p.generator("a")))


# ---------------------------------------------------------------------------------------
# end to end: off-switch, executors, resume, Flower
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, mode", [("fedavg", "client"), ("fedproto", "prototype"), ("fednh", "prototype"),
                                        ("fedgh", "prototype"), ("feddistill", "prototype")])
def test_no_noise_and_no_clip_equal_the_plain_run_bit_for_bit(name, mode, digits_cfg, tmp_path):
    base = (f"algorithm.name={name}", "rounds=2", "algorithm.weighting=uniform" if name == "fedavg" else "seed=0")
    plain = run(digits_cfg(*base, "output.name=plain"))
    dp = run(digits_cfg(*base, f"privacy.mode={mode}", "privacy.clip=.inf", "privacy.noise_multiplier=0",
                        "output.name=dp"))
    for r in (*dp.rows, *plain.rows):
        r.pop("bytes_down")  # the broadcast carries the clip under client mode
    assert results(dp.rows) == results(plain.rows)
    assert all(r["epsilon"] == math.inf for r in dp.rows)
    if name in ("fedavg", "fednh"):  # the global model, every bit (FedProto and FedGH have none)
        a, b = torch.load(plain.dir / "model.pt"), torch.load(dp.dir / "model.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_dp_sgd_without_noise_and_clip_is_sgd_up_to_float_rounding(digits_cfg):
    plain = run(digits_cfg("rounds=2", "output.name=plain"))
    dp = run(digits_cfg("rounds=2", "privacy.mode=sample", "privacy.clip=.inf", "privacy.noise_multiplier=0",
                        "output.name=dp"))
    for a, b in zip(plain.rows, dp.rows):
        assert b["gm"] == pytest.approx(a["gm"], abs=1 / 450) and b["train_loss"] == pytest.approx(a["train_loss"],
                                                                                                    rel=1e-4)


@pytest.mark.parametrize("name, mode", [("fedavg", "sample"), ("fedproto", "prototype"), ("fedavg", "client")])
def test_both_executors_give_equal_results_under_dp(name, mode, digits_cfg):
    over = (f"algorithm.name={name}", "rounds=2", f"privacy.mode={mode}", "privacy.clip=1.0",
            "privacy.noise_multiplier=0.7")
    seq = run(digits_cfg(*over, "execution.executor=sequential", "output.name=seq"))
    bat = run(digits_cfg(*over, "execution.executor=batched", "output.name=bat"))
    assert bat.summary["execution"]["executor"] == "batched"
    for a, b in zip(strip_timing(seq.rows), strip_timing(bat.rows)):
        assert a["epsilon"] == b["epsilon"]
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5, rel=1e-5), k


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_resume_after_kill_is_bit_identical(mode, digits_cfg, tmp_path):
    cfg = digits_cfg(f"privacy.mode={mode}", "privacy.clip=0.5", "privacy.noise_multiplier=0.6", "rounds=4",
                     "output.checkpoint_every=2", *(("privacy.adaptive_clip=true", "privacy.count_noise=1.0",
                                                     "participation.sampling=poisson") if mode == "client" else ()))
    full, resumed = kill_and_resume(cfg, tmp_path, after=3)  # last checkpoint: round 2
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    if mode == "sample":
        return
    clips = [r["privacy_clip"] for r in full.rows]
    assert clips[0] == 0.5 and len(set(clips)) == 4  # the clip follows the updates' norms
    eps = [r["epsilon"] for r in full.rows]
    assert eps == sorted(eps) and eps[0] > 0


def test_clients_clip_their_updates_and_prototype_releases_are_counted(digits_cfg, monkeypatch):
    norms = []
    original = ServerPrivacy.release

    def spy(self, rnd, shared, kept, server):
        for t, o in kept:
            norms.append(clip_update(o.reply.weights, t.msg.weights, math.inf)[1])
        return original(self, rnd, shared, kept, server)

    monkeypatch.setattr(ServerPrivacy, "release", spy)
    run(digits_cfg("rounds=2", "privacy.mode=client", "privacy.clip=0.05", "privacy.noise_multiplier=0.5",
                   "output.name=c"))
    assert len(norms) == 10 and max(norms) <= 0.05 * (1 + 1e-6) and min(norms) > 0.049  # as they left the clients


def test_target_epsilon_stops_the_run_with_a_status(digits_cfg, capsys, tmp_path):
    res = run(digits_cfg("rounds=10", "privacy.mode=prototype", "algorithm.name=fedproto",
                         "privacy.noise_multiplier=3", "privacy.target_epsilon=3", "output.name=t"))
    assert res.summary["status"] == "stopped" and 1 <= res.summary["rounds_completed"] < 10
    assert "privacy budget" in res.summary["error"] and res.rows[-1]["epsilon"] <= 3
    code = main(["run", str(DIGITS), "rounds=10", "privacy.mode=prototype", "algorithm.name=fedproto",
                 "privacy.noise_multiplier=3", "privacy.target_epsilon=3", f"output.dir={tmp_path}", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "privacy budget: round" in out and "epsilon=" in out


@pytest.mark.parametrize("args, fragment", [
    (["privacy.mode=client", "privacy.noise_multiplier=-1"], "privacy.noise_multiplier=-1.0: must be a number >= 0"),
    (["privacy.mode=client", "privacy.clip=0"], "privacy.clip=0.0: must be > 0"),
    (["privacy.mode=client", "privacy.delta=1"], "privacy.delta=1.0: must be in (0, 1)"),
    (["privacy.mode=client", "privacy.clip=.inf"], "needs noise_multiplier 0"),
    (["privacy.mode=client", "privacy.target_epsilon=0.5"], "round 1 alone would spend epsilon"),
    (["privacy.mode=client", "algorithm.name=scaffold"], "does more with the replies than average"),
    (["privacy.mode=client", "algorithm.name=fednh"], "does more with the replies"),
    (["privacy.mode=prototype", "algorithm.name=fedavg"], "sends no prototypes"),
    (["privacy.mode=prototype", "algorithm.name=dpfedcl"], "sends no prototypes"),
    (["privacy.mode=sample", "algorithm.name=fedproto"], "replies carry arrays"),
    (["privacy.mode=sample", "algorithm.name=feddecorr"], "couples the samples of a batch"),
    (["privacy.mode=prototype", "algorithm.name=fedpac"], "sends no prototypes"),
    (["privacy.mode=client", "privacy.adaptive_clip=true", "privacy.count_noise=0.1"], "must exceed"),
    (["privacy.mode=sample", "privacy.adaptive_clip=true"], "needs privacy.mode: client"),
    (["privacy.mode=client", "privacy.accountant=pld"], "no sampling without replacement"),
    (["privacy.mode=secret"], "expected one of"),
])
def test_bad_privacy_input_exits_2_with_one_line(tmp_path, capsys, args, fragment):
    code = main(["run", str(DIGITS), "rounds=2", *args, f"output.dir={tmp_path}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err and err.count("\n") == 1, err


def test_batchnorm_models_are_refused_for_dp_sgd():  # (digits are too small for the zoo's BatchNorm models)
    from protofl.engine.privacy import check_privacy
    from protofl.algorithms import ALGORITHMS

    cfg = from_dict({"privacy": {"mode": "sample"}})
    algo = ALGORITHMS.get("fedavg")(ALGORITHMS.get("fedavg").Hyper(), None)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match="batch normalization in 1 \\(BatchNorm1d\\)"):
        check_privacy(cfg, algo, model)
    check_privacy(cfg, algo, nn.Sequential(nn.Linear(3, 4), nn.GroupNorm(2, 4)))


def test_the_prototype_mode_refusal_names_every_method_it_serves():
    """The refusal's list of methods that privacy.mode: prototype serves is the registry's."""
    import re
    from protofl.engine.privacy import check_privacy
    from protofl.algorithms import ALGORITHMS
    from protofl.algorithms.base import TaskInfo

    info = TaskInfo(num_classes=10, num_clients=4, feature_dim=16, input_shape=(64,), seed=0, rounds=2)
    cfg = from_dict({"privacy": {"mode": "prototype"}})
    made = {n: ALGORITHMS.get(n)(ALGORITHMS.get(n).Hyper(), info) for n in ALGORITHMS.names()}
    serves = {n for n, algo in made.items() if algo.prototype_releases(cfg.privacy) > 0}
    with pytest.raises(ConfigError) as e:
        check_privacy(cfg, made["fedavg"])
    named = set(re.search(r"methods that do: ([a-z_, ]+)\)", str(e.value)).group(1).split(", "))
    assert named == serves and "fedfa" in serves


def test_fingerprint_and_saved_config_unchanged_without_privacy():
    assert "privacy" not in from_dict({}).to_dict()
    assert from_dict({"privacy": {"mode": "none", "clip": 3}}).fingerprint() == from_dict({}).fingerprint()
    assert from_dict({"participation": {"sampling": "fixed"}}).fingerprint() == from_dict({}).fingerprint()
    assert from_dict({"privacy": {"mode": "client"}}).fingerprint() != from_dict({}).fingerprint()


# ---------------------------------------------------------------------------------------
# Opacus: one DP-SGD step
# ---------------------------------------------------------------------------------------
def test_one_dp_sgd_step_equals_opacus():
    pytest.importorskip("opacus")
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    theirs = GradSampleModule(copy.deepcopy(model))
    opt = DPOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.5), noise_multiplier=0.0, max_grad_norm=0.1,
                      expected_batch_size=16)
    F.cross_entropy(theirs(x), y).backward()
    opt.step()
    names = [k for k, _ in model.named_parameters()]
    plain = copy.deepcopy(model)
    fit(model, x, y, loss=cross_entropy, extras={}, names=names, generator=torch.Generator().manual_seed(0),
        settings=TrainSettings(lr=0.5, batch_size=16, dp_clip=0.1, dp_noise=0.0))
    ours, ref = dict(model.named_parameters()), dict(theirs._module.named_parameters())
    for k in names:
        assert torch.allclose(ours[k], ref[k], atol=1e-6), k
    # the clip was active: a plain SGD step lands elsewhere
    fit(plain, x, y, loss=cross_entropy, extras={}, names=names, generator=torch.Generator().manual_seed(0),
        settings=TrainSettings(lr=0.5, batch_size=16))
    assert max(float((p - ours[k]).abs().max()) for k, p in plain.named_parameters()) > 1e-3


def test_flower_transport_carries_the_clip_and_the_spend():
    pytest.importorskip("flwr")
    from protofl.flower import records

    from protofl.engine.client import ClientOutput, ClientTask
    from protofl.messages import Record
    from protofl.engine.privacy import CLIP_KEY, UNCLIPPED_KEY

    w = {"w": torch.ones(3)}
    task = ClientTask(4, 2, Record(weights=w, config={CLIP_KEY: 0.25}), None, None, False)
    back = records.content_to_task(records.task_to_content(task))
    assert back.msg.config[CLIP_KEY] == 0.25
    out = ClientOutput(Record(weights=w, metrics={UNCLIPPED_KEY: 1.0}), None,
                       train={"loss": 0.1, "dp_steps": 12.0, "dp_q": 0.25, "dp_releases": 2.0})
    got = records.content_to_output(records.output_to_content(out))
    assert got.train["dp_steps"] == 12 and got.train["dp_q"] == 0.25 and got.reply.metrics[UNCLIPPED_KEY] == 1.0


@pytest.mark.parametrize("mode", ["client", "prototype"])
def test_dp_over_flower_equals_in_process(mode, digits_cfg, tmp_path):
    """Every message crosses Flower's wire format (test_flower_records.py's loopback Grid): the
    clients clip (client) or noise (prototype) before their reply leaves, the server adds its noise."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity

    from test_flower_records import loopback_sim

    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 77, 1, 1
    try:
        cfg = digits_cfg("algorithm.name=" + ("fedavg" if mode == "client" else "fedproto"), f"privacy.mode={mode}",
                         "privacy.clip=0.5", "privacy.noise_multiplier=0.7", "rounds=2", "partition.num_clients=3",
                         "participation.fraction=1.0")
        ref = Simulation(cfg, run_dir=tmp_path / "ref").run()
        sim, _, _ = loopback_sim(cfg, tmp_path / "flower", discovery_timeout=5)
        got = sim.run()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old
    assert strip_timing(got.rows) == strip_timing(ref.rows)
    assert got.rows[-1]["epsilon"] > got.rows[0]["epsilon"] > 0


@pytest.mark.parametrize("name, releases", [("fedproto", 1), ("mpfedcl", 3)])
def test_prototype_epsilon_counts_each_clients_releases(name, releases, digits_cfg):
    # MP-FedCL: the private class means that start k-means, then 2 Lloyd steps = 3 releases a round;
    # epsilon after round t: the Gaussian mechanism composed releases x (most turns of one client by t)
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "privacy.mode=prototype", "privacy.clip=5",
                     "privacy.noise_multiplier=2", "privacy.kmeans_steps=2")
    res = run(cfg)
    part = Participation(cfg.participation, cfg.partition.num_clients, cfg.seed)
    turns = [np.bincount([c for r in range(1, t + 1) for c in part.arriving(r, part.selected(r))]).max()
             for t in (1, 2, 3)]
    acc = Accountant("rdp", 1e-5)
    assert [r["epsilon"] for r in res.rows] == [acc.epsilon({("gaussian", 2.0): releases * int(n)}) for n in turns]
    assert turns[-1] >= 2  # some client took part more than once: the composition is tested


def test_dp_sgd_epsilon_is_the_most_exposed_clients(digits_cfg):
    # round 1: client k took E ceil(n_k / B) steps with q_k = B / n_k; epsilon is the largest of theirs
    cfg = digits_cfg("rounds=1", "privacy.mode=sample", "privacy.clip=1", "privacy.noise_multiplier=1.5",
                     "eval.final_all_clients=false")
    sim = Simulation(cfg)
    res = sim.run()
    part, acc, B, E = sim.participation, Accountant("rdp", 1e-5), cfg.training.batch_size, cfg.training.epochs
    sizes = [len(i) for i in sim.fed.train_idx]
    want = max(acc.epsilon({("poisson", min(1.0, B / sizes[c]), 1.5): E * math.ceil(sizes[c] / B)})
               for c in part.arriving(1, part.selected(1)))
    assert res.rows[0]["epsilon"] == want > 0
