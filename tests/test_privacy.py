"""Differential privacy (privacy.*, docs/privacy.md): the mechanisms on hand-computed
tensors, the noise's calibration, the accountant against published values, both modes
end to end (off-switch bit for bit, both executors, Flower's transport), the ledger
against a recount, the budget and every bad input. The noise's secrecy, resume under a
secret and the empirical audits: tests/test_privacy_audit.py."""
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
from protofl.nn.privacy import (clip_rows, NoiseStream, private_class_means, private_gradient,  # noqa: E402
                                private_kmeans)
from protofl.nn.prototypes import class_means  # noqa: E402

from conftest import DIGITS, strip_timing  # noqa: E402

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
            assert all(out[k] is w[k] for k in ("w", "b"))  # untouched: the same tensors
        else:
            assert clipped == pytest.approx(0.5, rel=1e-6) and clipped <= 0.5 * (1 + 1e-6)
        # integer buffers (a count of batches says how much data there was) go back as sent
        assert torch.equal(out["n"], sent["n"]) and not torch.equal(w["n"], sent["n"])


def test_private_class_means_without_noise_is_class_means_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    z, y = torch.randn(40, 6, generator=gen), torch.randint(0, 5, (40,), generator=gen)
    m, n = private_class_means(z, y, 7, clip=math.inf, sigma=0.0, generator=NoiseStream(b"k" * 32, ()))
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
    centers, counts = private_kmeans(z, y, 1, k=2, steps=5, clip=10.0, sigma=0.0, generator=NoiseStream(b"k" * 32, ()))
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
    gen = NoiseStream(b"t" * 32, ("test",))
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
    # Poisson batches: divided by the expected batch size, whatever the batch drew
    (out,) = private_gradient([torch.zeros(1, 3, 200_000)], clip=1.5, sigma=1.2, noise=z, batch=8)
    assert float(out.std()) == pytest.approx(1.2 * 1.5 / 8, rel=0.01)


def test_private_gradient_masks_padding_and_bounds_a_non_finite_sample():
    g = torch.tensor([[[3.0, 4.0], [0.3, 0.4], [float("nan"), 1.0], [100.0, 0.0]]])  # (1, 4, 2)
    mask = torch.tensor([[True, True, True, False]])  # the last row is padding
    (out,) = private_gradient([g], clip=1.0, sigma=0.0, mask=mask, batch=10)
    # sample 0 clipped to 1, sample 1 as it is, the NaN sample counts as 0, the padding as nothing
    expect = (torch.tensor([3.0, 4.0]) / (5 + 1e-6) + torch.tensor([0.3, 0.4])) / 10
    assert torch.allclose(out[0], expect, atol=1e-7) and torch.isfinite(out).all()


def test_poisson_batches_draw_each_sample_with_probability_q():
    from protofl.engine.train import poisson_rows

    rows = poisson_rows(50, 0.2, 2000, NoiseStream(b"k" * 32, ()))  # (steps, widest), -1 padded
    drawn = rows >= 0
    sizes = drawn.sum(1)
    assert rows.shape[0] == 2000 and rows.shape[1] == sizes.max()
    assert sizes.mean() == pytest.approx(10, abs=0.3) and sizes.min() < 5 < 15 < sizes.max()  # Binomial(50, 0.2)
    counts = np.bincount(rows[drawn], minlength=50)
    assert counts.min() > 300 and counts.max() < 500  # each sample ~ 400 times of 2000
    assert all(np.all(np.diff(r[r >= 0]) > 0) for r in rows[:50])  # each sample at most once a step


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
def test_noise_streams_are_per_key_round_client_and_purpose():
    cfg = from_dict({"privacy": {"mode": "sample"}})
    k1, k2 = b"1" * 32, b"2" * 32

    def draw(rnd, cid, purpose, key=k1, seed=0):
        cfg.seed = seed
        p = ClientPrivacy(cfg, rnd, cid, key=key)
        return p.generator(purpose).normal((4,))

    assert torch.equal(draw(1, 2, "a"), draw(1, 2, "a"))
    assert torch.equal(draw(1, 2, "a"), draw(1, 2, "a", seed=1))  # the seed plays no part: the key does
    for other in (draw(2, 2, "a"), draw(1, 3, "a"), draw(1, 2, "b"), draw(1, 2, "a", key=k2)):
        assert not torch.equal(draw(1, 2, "a"), other)
    p = ClientPrivacy(cfg, 1, 2, key=k1)
    assert not torch.equal(p.generator("a").normal((4,)), p.generator("a").normal((4,)))
    with pytest.raises(RuntimeError, match="has no noise key"):
        ClientPrivacy(cfg, 1, 2)
    # privacy.noise: seeded: keyed by the seed, replayable (for tests only)
    cfg = from_dict({"privacy": {"mode": "sample", "noise": "seeded"}})
    assert torch.equal(draw(1, 2, "a", key=None), draw(1, 2, "a", key=None))
    assert not torch.equal(draw(1, 2, "a", key=None), draw(1, 2, "a", key=None, seed=1))


def test_noise_streams_are_shake256_gaussians_no_32_bit_seed_can_replay():
    a, b = NoiseStream(b"k" * 32, ("x", 1)), NoiseStream(b"k" * 32, ("x", 1))
    z = a.normal((200_000,))
    assert torch.equal(z, b.normal((200_000,)))  # the same key and label: the same draws
    assert not torch.equal(a.normal((4,)), NoiseStream(b"k" * 32, ("x", 1)).normal((4,)))  # the next block
    assert float(z.mean()) == pytest.approx(0, abs=0.01) and float(z.std()) == pytest.approx(1, rel=0.01)
    assert stats_normal_pvalue(z.double().numpy()) > 1e-4  # a Gaussian (Kolmogorov-Smirnov)
    u = NoiseStream(b"k" * 32, ("u",)).uniform((100_000,))
    assert 0 <= float(u.min()) and float(u.max()) < 1 and float(u.mean()) == pytest.approx(0.5, abs=0.005)
    # every bit of the key counts (a torch.Generator would keep 32 bits of a seed)
    for i in range(32):
        for bit in (1, 128):
            k = bytearray(b"k" * 32)
            k[i] ^= bit
            assert not torch.equal(NoiseStream(bytes(k), ("x", 1)).normal((4,)), z[:4])


def stats_normal_pvalue(x: np.ndarray) -> float:
    from scipy import stats

    return float(stats.kstest(x, "norm").pvalue)


# ---------------------------------------------------------------------------------------
# end to end: off-switch, executors, Flower
# ---------------------------------------------------------------------------------------
SEEDED = "privacy.noise=seeded"  # replayable noise: two runs can be compared


def test_client_level_without_noise_and_clip_equals_the_plain_run_bit_for_bit(digits_cfg):
    base = ("rounds=2", "algorithm.weighting=uniform")
    plain = run(digits_cfg(*base, "output.name=plain"))
    dp = run(digits_cfg(*base, "privacy.mode=client", "privacy.clip=.inf", "privacy.noise_multiplier=0", SEEDED,
                        "output.name=dp"))
    for a, b in zip(results(plain.rows), results(dp.rows)):
        b.pop("bytes_down"), b.pop("privacy_seeded")  # the broadcast carries the clip
        assert b.pop("privacy_sigma") == 0.0  # the sigma the run used, in every row
        # what client-level DP leaves out of a row: its values were computed without noise
        assert set(a) - set(b) == {"train_loss", "train_samples", "rejected", "pa", "pa_std", "evaluated_clients",
                                   "bytes_down", "pm_v", "pm_v_std", "pm_l", "pm_l_std", "acc", "acc_std",
                                   "weight_diversity", "pa_clients", *(k for k in a if k.startswith("all_"))} & set(a)
        assert all(a[k] == v for k, v in b.items())
    assert all(r["epsilon"] == math.inf for r in dp.rows)
    x, y = torch.load(plain.dir / "model.pt"), torch.load(dp.dir / "model.pt")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_dp_sgd_of_every_sample_without_noise_or_clip_is_gradient_descent():
    # q = B / n~ = 1 (the released count within a batch): every sample in every batch, so DP-SGD
    # without noise or clip is full-batch gradient descent, up to float rounding
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    names = [k for k, _ in model.named_parameters()]
    plain = copy.deepcopy(model)
    fit(plain, x, y, loss=cross_entropy, extras={}, names=names, generator=torch.Generator().manual_seed(0),
        settings=TrainSettings(lr=0.3, momentum=0.9, batch_size=20, epochs=3))
    fit(model, x, y, loss=cross_entropy, extras={}, names=names, generator=NoiseStream(b"k" * 32, ()),
        settings=TrainSettings(lr=0.3, momentum=0.9, batch_size=20, epochs=3, dp_clip=math.inf, dp_n=20))
    for (k, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), k


@pytest.mark.parametrize("name, mode", [("fedavg", "sample"), ("fedproto", "sample"), ("fedavg", "client")])
def test_both_executors_give_equal_results_under_dp(name, mode, digits_cfg):
    over = (f"algorithm.name={name}", "rounds=2", f"privacy.mode={mode}", "privacy.clip=1.0",
            "privacy.noise_multiplier=0.7", SEEDED)
    seq = run(digits_cfg(*over, "execution.executor=sequential", "output.name=seq"))
    bat = run(digits_cfg(*over, "execution.executor=batched", "output.name=bat"))
    assert bat.summary["execution"]["executor"] == "batched"
    for a, b in zip(strip_timing(seq.rows), strip_timing(bat.rows)):
        assert a["epsilon"] == b["epsilon"]
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5, rel=1e-5), k


def test_clients_clip_their_updates(digits_cfg, monkeypatch):
    norms = []
    original = ServerPrivacy.release

    def spy(self, rnd, shared, kept, server):
        for t, o in kept:
            norms.append(clip_update(o.reply.weights, t.msg.weights, math.inf)[1])
            assert o.reply.num_samples == 1  # the public weight, not n_k
        return original(self, rnd, shared, kept, server)

    monkeypatch.setattr(ServerPrivacy, "release", spy)
    run(digits_cfg("rounds=2", "privacy.mode=client", "privacy.clip=0.05", "privacy.noise_multiplier=0.5",
                   "output.name=c"))
    assert len(norms) == 10 and max(norms) <= 0.05 * (1 + 1e-6) and min(norms) > 0.049  # as they left the clients


def test_target_epsilon_stops_the_run_with_a_status(digits_cfg, capsys, tmp_path):
    over = ("rounds=10", "privacy.mode=sample", "algorithm.name=fedproto", "privacy.noise_multiplier=3",
            "privacy.target_epsilon=3")
    res = run(digits_cfg(*over, "output.name=t"))
    assert res.summary["status"] == "stopped" and 1 <= res.summary["rounds_completed"] < 10
    assert "privacy budget" in res.summary["error"] and res.rows[-1]["epsilon"] <= 3
    code = main(["run", str(DIGITS), *over, f"output.dir={tmp_path}", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "privacy budget: round" in out and "epsilon=" in out and "not private" not in out


def test_a_ditto_run_with_a_target_stops_there(digits_cfg):
    """Ditto fits twice a turn (its reply's update, then its personal model): the plan counts
    both, so the run stops before the target, and round 1 alone is refused when it passes it."""
    over = ("algorithm.name=ditto", "privacy.mode=sample", "privacy.noise_multiplier=1.5", "rounds=8", SEEDED)
    one = run(digits_cfg(*over, "rounds=1", "eval.final_all_clients=false", "output.name=one"))
    eps1 = one.rows[0]["epsilon"]  # (seeded: the same released counts, so the same ledger, in every run)
    with pytest.raises(ConfigError, match="round 1 alone would spend"):  # the plan is the spend, both fits
        Simulation(digits_cfg(*over, f"privacy.target_epsilon={eps1 * 0.999}", "output.name=refused"))
    Simulation(digits_cfg(*over, f"privacy.target_epsilon={eps1 * 1.001}", "output.name=accepted"))
    target = eps1 * 1.6
    res = run(digits_cfg(*over, f"privacy.target_epsilon={target}", "output.name=t"))
    assert res.summary["status"] == "stopped" and 1 <= res.summary["rounds_completed"] < 8
    assert res.rows[0]["epsilon"] == eps1 and res.rows[-1]["epsilon"] <= target


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_a_calibrated_run_ends_at_its_target(mode, digits_cfg):
    """privacy.calibrate: the run picks its sigma at its start from its plan (its own released
    counts under sample) and ends at privacy.target_epsilon, within the bisection's 0.5 %;
    the sigma is in every row and in the broadcast its clients noise with."""
    over = (f"privacy.mode={mode}", "privacy.calibrate=true", "privacy.target_epsilon=6", "rounds=3",
            "participation.sampling=poisson" if mode == "client" else "privacy.noise=secret")
    res = run(digits_cfg(*over))
    eps = [r["epsilon"] for r in res.rows]
    assert 6 * 0.99 <= eps[-1] <= 6 and res.summary["status"] == "complete"
    sigmas = {r["privacy_sigma"] for r in res.rows}
    assert len(sigmas) == 1 and sigmas.pop() != 1.0  # chosen, not the config's default


@pytest.mark.parametrize("args, fragment", [
    (["privacy.mode=client", "privacy.noise_multiplier=-1"], "privacy.noise_multiplier=-1.0: must be a number >= 0"),
    (["privacy.mode=client", "privacy.clip=0"], "privacy.clip=0.0: must be > 0"),
    (["privacy.mode=client", "privacy.delta=1"], "privacy.delta=1.0: must be in (0, 1)"),
    (["privacy.mode=client", "privacy.clip=.inf"], "needs noise_multiplier 0"),
    (["privacy.mode=client", "privacy.target_epsilon=0.5"], "round 1 alone would spend epsilon"),
    (["privacy.mode=client", "algorithm.name=scaffold"], "does more with the replies than average"),
    (["privacy.mode=client", "algorithm.name=fednh"], "does more with the replies"),
    (["privacy.mode=prototype", "algorithm.name=fedproto"], "is no longer offered"),
    (["privacy.mode=sample", "algorithm.name=dpfedcl"], "does not release privately"),
    (["privacy.mode=sample", "algorithm.name=fedpac"], "does not release privately"),
    (["privacy.mode=sample", "algorithm.name=feddecorr"], "couples the samples of a batch"),
    (["privacy.mode=sample", "algorithm.name=rebafl"], "couples the samples of a batch"),
    (["privacy.mode=client", "privacy.adaptive_clip=true", "privacy.count_noise=0.1"], "must exceed"),
    (["privacy.mode=sample", "privacy.adaptive_clip=true"], "needs privacy.mode: client"),
    (["privacy.mode=client", "privacy.accountant=pld"], "no sampling without replacement"),
    (["privacy.mode=sample", "privacy.label_noise=0"], "privacy.label_noise=0.0: must be a number > 0"),
    (["privacy.mode=sample", "privacy.noise=public"], "expected one of"),
    (["privacy.mode=sample", "privacy.calibrate=true"], "chooses the noise for privacy.target_epsilon: set one"),
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


def test_the_refusal_of_unreleased_arrays_names_every_method_whose_prototypes_are_private():
    """The refusal's list of methods whose arrays sample-level DP covers is the registry's."""
    import re
    from protofl.engine.privacy import check_privacy
    from protofl.algorithms import ALGORITHMS
    from protofl.algorithms.base import TaskInfo

    info = TaskInfo(num_classes=10, num_clients=4, feature_dim=16, input_shape=(64,), seed=0, rounds=2)
    cfg = from_dict({"privacy": {"mode": "sample"}})
    made = {n: ALGORITHMS.get(n)(ALGORITHMS.get(n).Hyper(), info) for n in ALGORITHMS.names()}
    serves = {n for n, algo in made.items() if algo.prototype_releases(cfg.privacy) > 0}
    with pytest.raises(ConfigError) as e:
        check_privacy(cfg, made["fedpac"])
    named = set(re.search(r"methods whose prototypes are: ([a-z_, ]+)\)", str(e.value)).group(1).split(", "))
    assert named == serves and {"fedproto", "fednh", "mpfedcl"} <= serves


def test_fingerprint_and_saved_config_unchanged_without_privacy():
    assert "privacy" not in from_dict({}).to_dict()
    assert from_dict({"privacy": {"mode": "none", "clip": 3}}).fingerprint() == from_dict({}).fingerprint()
    assert from_dict({"participation": {"sampling": "fixed"}}).fingerprint() == from_dict({}).fingerprint()
    assert from_dict({"privacy": {"mode": "client"}}).fingerprint() != from_dict({}).fingerprint()


# ---------------------------------------------------------------------------------------
# Opacus: several DP-SGD steps with noise, the same batches and the same noise
# ---------------------------------------------------------------------------------------
def test_dp_sgd_steps_equal_opacus_with_noise_on(monkeypatch):
    """Five steps of protofl's DP-SGD (``fit`` with Poisson sampling and noise) against Opacus
    given the same batches (protofl's Poisson draws, replayed from the same generator) and
    the same noise (Opacus' draws replaced by protofl's): each step's clipped sum equals
    GradSampleModule's ``summed_grad`` to 1e-6, the parameters after the five steps equal
    DPOptimizer's, and the epsilon equals Opacus' RDP accountant's."""
    pytest.importorskip("opacus")
    import opacus.optimizers.optimizer as opt_mod
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.optimizers import DPOptimizer
    from protofl.engine.train import poisson_rows, sample_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    names = [k for k, _ in model.named_parameters()]
    n_params = sum(p.numel() for p in model.parameters())
    C, sigma, B, lr, steps = 0.5, 1.3, 6, 0.2, 5
    rows = poisson_rows(24, B / 24, steps, NoiseStream(b"b" * 32, ("batches",)))  # what fit will draw
    noise_gen = NoiseStream(b"n" * 32, ("noise",))
    z = torch.stack([noise_gen.normal((n_params,)) for _ in range(steps)])  # ... and its noise
    theirs = GradSampleModule(copy.deepcopy(model))
    noise_at = {"step": 0, "at": 0}

    def shared_noise(std, reference, generator=None, secure_mode=False):  # protofl's draw, parameter by parameter
        i, at = noise_at["step"], noise_at["at"]
        noise_at["at"] = at + reference.numel()
        return std * z[i, at:at + reference.numel()].view_as(reference)

    monkeypatch.setattr(opt_mod, "_generate_noise", shared_noise)
    opt = DPOptimizer(torch.optim.SGD(theirs.parameters(), lr=lr), noise_multiplier=sigma, max_grad_norm=C,
                      expected_batch_size=B)
    frozen, start = copy.deepcopy(model), copy.deepcopy(model)
    for s in range(steps):
        idx = torch.from_numpy(rows[s][rows[s] >= 0])
        noise_at.update(step=s, at=0)
        opt.zero_grad()
        F.cross_entropy(theirs(x[idx]), y[idx]).backward()
        opt.pre_step()
        # protofl's per-sample gradients at Opacus' current parameters, clipped and summed
        frozen.load_state_dict(theirs._module.state_dict())
        per, _ = sample_gradients(frozen, cross_entropy, names, x[idx], y[idx], {})
        clipped = private_gradient([g.unsqueeze(0) for g in per], C, 0.0, batch=1)
        for k, c, p in zip(names, clipped, theirs.parameters()):
            assert torch.allclose(c[0], p.summed_grad, atol=1e-6), (s, k)
        opt.original_optimizer.step()
    assert len({int((r >= 0).sum()) for r in rows}) > 1  # batches of different sizes
    # protofl's own driver: the same five steps from the same streams
    fit(model, x, y, loss=cross_entropy, extras={}, names=names, generator=NoiseStream(b"b" * 32, ("batches",)),
        settings=TrainSettings(lr=lr, batch_size=B, steps=steps, dp_clip=C, dp_noise=sigma, dp_n=24),
        noise=NoiseStream(b"n" * 32, ("noise",)))
    for (k, a), b in zip(model.named_parameters(), theirs._module.parameters()):
        assert torch.allclose(a, b, atol=1e-6), k
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), start.parameters())) > 1e-2  # moved
    acc = RDPAccountant()
    acc.history = [(sigma, B / 24, steps)]
    assert Accountant("rdp", 1e-5).epsilon({("poisson", B / 24, sigma): steps}) == pytest.approx(
        acc.get_epsilon(1e-5), rel=1e-3)


def test_flower_transport_carries_the_clip_and_the_spend():
    pytest.importorskip("flwr")
    from protofl.flower import records

    from protofl.engine.client import ClientOutput, ClientTask
    from protofl.messages import Record
    from protofl.engine.privacy import CLIP_KEY, UNCLIPPED_KEY

    w = {"w": torch.ones(3)}
    task = ClientTask(4, 2, Record(weights=w, config={CLIP_KEY: 0.25}), None, None, False, noise_key=b"k" * 32)
    content = records.task_to_content(task)
    back = records.content_to_task(content)
    assert back.msg.config[CLIP_KEY] == 0.25 and back.noise_key is None  # a key never travels
    out = ClientOutput(Record(weights=w, metrics={UNCLIPPED_KEY: 1.0}), None,
                       train={"dp_steps0": 12.0, "dp_q0": 0.25, "dp_releases": 2.0, "dp_labels": 1.0})
    got = records.content_to_output(records.output_to_content(out))
    assert got.train == out.train and got.reply.metrics[UNCLIPPED_KEY] == 1.0


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_dp_over_flower_equals_in_process(mode, digits_cfg, tmp_path):
    """Every message crosses Flower's wire format (test_flower_records.py's loopback Grid): the
    clients clip (client) or train by DP-SGD and noise their prototypes (sample) before their
    reply leaves, the server adds its noise. Seeded noise, so that the two can be compared."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity

    from test_flower_records import loopback_sim

    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 77, 1, 1
    try:
        cfg = digits_cfg("algorithm.name=" + ("fedavg" if mode == "client" else "fedproto"), f"privacy.mode={mode}",
                         "privacy.clip=0.5", "privacy.noise_multiplier=0.7", "rounds=2", "partition.num_clients=3",
                         "participation.fraction=1.0", SEEDED)
        ref = Simulation(cfg, run_dir=tmp_path / "ref").run()
        sim, _, _ = loopback_sim(cfg, tmp_path / "flower", discovery_timeout=5)
        got = sim.run()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old
    assert strip_timing(got.rows) == strip_timing(ref.rows)
    assert got.rows[-1]["epsilon"] > got.rows[0]["epsilon"] > 0


# ---------------------------------------------------------------------------------------
# the ledger, recounted
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, releases", [("fedavg", 0), ("fedproto", 1), ("mpfedcl", 3)])
def test_sample_epsilon_is_each_clients_ledger_recounted(name, releases, digits_cfg):
    """Each client's ledger, recounted from the run's config: its label counts released once
    (a Gaussian of std label_noise), and per turn E ceil(n~_k / B) DP-SGD steps at q = B / n~_k
    plus the method's prototype releases (MP-FedCL: the private class means that start
    k-means and 2 Lloyd steps); the final evaluation's turn of every client too. epsilon
    after round t is the largest ledger's."""
    from protofl.engine.privacy import noisy_label_counts, released_size

    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "privacy.mode=sample", "privacy.clip=5",
                     "privacy.noise_multiplier=2", "privacy.kmeans_steps=2", SEEDED)
    sim = Simulation(cfg)
    plan = sim.privacy.predicted(1, 3, then_final=True)  # the budget's plan of the whole run, before it
    res = sim.run()
    part, acc, tc, p = sim.participation, Accountant("rdp", 1e-5), cfg.training, cfg.privacy
    counts = sim.fed.class_counts()
    n = [released_size(noisy_label_counts(counts[c], p.label_noise, None, cfg.seed, c)) for c in range(len(counts))]
    assert n != [int(c.sum()) for c in counts]  # the released counts, not the true ones

    def turn(c):
        q, T = min(1.0, tc.batch_size / n[c]), tc.epochs * math.ceil(n[c] / tc.batch_size)
        return {("poisson", q, 2.0): T, **({("gaussian", 2.0): releases} if releases else {})}

    ledgers: dict = {}
    want = []
    for r in (1, 2, 3):
        for c in part.arriving(r, part.selected(r)):
            led = ledgers.setdefault(c, {("gaussian", p.label_noise): 1})
            for ev, k in turn(c).items():
                led[ev] = led.get(ev, 0) + k
        want.append(max(acc.epsilon(led) for led in ledgers.values()))
    for c in range(len(counts)):  # the final evaluation: every client trains once more
        led = ledgers.setdefault(c, {("gaussian", p.label_noise): 1})
        for ev, k in turn(c).items():
            led[ev] = led.get(ev, 0) + k
    want[-1] = max(acc.epsilon(led) for led in ledgers.values())
    assert [r["epsilon"] for r in res.rows] == pytest.approx(want, rel=1e-12)
    assert plan == pytest.approx(want[-1], rel=1e-12)  # the plan counts each client's label release once


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_the_final_evaluation_of_every_client_noises_with_the_calibrated_sigma(executor, digits_cfg, monkeypatch):
    """The turn after the last round (eval.final_all_clients) trains every client with DP-SGD
    and its spend is accounted with the run's calibrated sigma: its clients must noise with
    that sigma too (they used privacy.noise_multiplier, so the epsilon the run reported was
    not a bound whenever the calibrated sigma was the larger)."""
    from protofl.engine.client import ClientContext

    used: list[tuple[int, float]] = []
    settings = ClientContext.fit_settings

    def spy(self, req):
        s = settings(self, req)
        used.append((self.rnd, s.dp_noise))
        return s

    monkeypatch.setattr(ClientContext, "fit_settings", spy)
    result = run(digits_cfg("rounds=1", "privacy.mode=sample", "privacy.noise_multiplier=0.5", "privacy.calibrate=true",
                            "privacy.target_epsilon=2", "eval.final_all_clients=true",
                            f"execution.executor={executor}"))
    assert "all_pm_l" in result.summary["final"]  # the final evaluation ran
    assert {r for r, _ in used} == {1, 2}
    sigmas = {s for _, s in used}
    assert len(sigmas) == 1 and sigmas.pop() > 0.5  # the calibrated one, every turn
