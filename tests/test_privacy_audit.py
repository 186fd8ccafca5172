"""Differential privacy, tried as an auditor would (docs/privacy.md, "How the guarantee is
tested").

* **Empirical audits** (the practice of Jagielski et al., NeurIPS 2020, and Nasr et al.,
  IEEE S&P 2021 and USENIX Security 2023): each released mechanism runs many times on two
  neighbouring inputs, a worst-case canary (a record, or a client) in and out, with its
  real noise (fresh secret keys, as the runs draw them). A threshold on the canary's
  direction tells the two apart; Clopper-Pearson bounds on its true and false positive
  rates give a lower bound on epsilon (with 95 % confidence, Bonferroni over the
  thresholds). The bound must stay under the epsilon protofl claims for the mechanism, and
  the same audit must flag the broken variants: half the noise, prototypes of a model
  trained without privacy (the earlier ``privacy.mode: prototype``), a loss reading the
  exact label counts.
* **The noise's secrecy**: two runs with the same seed release different noise, the key is
  in the checkpoint (mode 0600) and nowhere else, a resume from a run's own checkpoint
  equals the uninterrupted run, a Flower node keeps its own key.
* **What leaves a client**: no exact count, loss or sample total under DP; a rejected
  reply's spend is counted; a seeded run says it is not private.
* **The plan is the spend**: for every method sample-level DP covers, a turn spends what
  the method declares (its fits, its releases).
"""
from __future__ import annotations

import math
import os
import shutil
import stat

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("dp_accounting")

from scipy import stats  # noqa: E402

from protofl import run  # noqa: E402
from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.algorithms.base import cross_entropy, TaskInfo  # noqa: E402
from protofl.cli import main  # noqa: E402
from protofl.config import from_dict  # noqa: E402
from protofl.engine.callbacks import Callback  # noqa: E402
from protofl.engine.client import ClientOutput, ClientTask  # noqa: E402
from protofl.engine.participation import Participation  # noqa: E402
from protofl.engine.privacy import (Accountant, ClientPrivacy, new_secret, noisy_label_counts,  # noqa: E402
                                    ServerPrivacy)
from protofl.engine.simulation import Simulation  # noqa: E402
from protofl.engine.train import sample_gradients  # noqa: E402
from protofl.messages import Record  # noqa: E402
from protofl.nn.privacy import clip_rows, private_gradient, private_sums  # noqa: E402

from conftest import DIGITS, strip_timing  # noqa: E402

# ---------------------------------------------------------------------------------------
# the auditor
# ---------------------------------------------------------------------------------------
DELTA = 1e-3  # the audits' delta: an epsilon claimed at any delta must hold at this one
SIGMA = 1.5  # the noise multiplier audited: claimed epsilon 2.17 for one Gaussian release at DELTA
N = 10_000  # releases per side (in, out)
# thresholds on the score, in units of the claimed noise's std along the canary's direction,
# fixed before any run; a sound mechanism's score is N(0, 1) without the canary and N(shift,
# 1) with it, shift <= 1 / SIGMA
GRID = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0)


def epsilon_lower_bound(score_in: np.ndarray, score_out: np.ndarray, delta: float = DELTA, alpha: float = 0.05,
                        grid=GRID) -> float:
    """The largest ln((TPR_lo - delta) / FPR_hi) over the thresholds of ``grid``: the rule
    "canary in iff score >= t" has true positive rate TPR and false positive rate FPR, and
    (epsilon, delta)-DP forces TPR <= e^epsilon FPR + delta. TPR_lo and FPR_hi are
    Clopper-Pearson bounds, each at 1 - alpha / (2 len(grid)): the bound holds with
    probability 1 - alpha for all thresholds together."""
    a = alpha / (2 * len(grid))
    best = 0.0
    for t in grid:
        k1, n1 = int((score_in >= t).sum()), len(score_in)
        k0, n0 = int((score_out >= t).sum()), len(score_out)
        tpr_lo = stats.beta.ppf(a, k1, n1 - k1 + 1) if k1 > 0 else 0.0
        fpr_hi = stats.beta.ppf(1 - a, k0 + 1, n0 - k0) if k0 < n0 else 1.0
        if tpr_lo - delta > 0:
            best = max(best, math.log((tpr_lo - delta) / fpr_hi))
    return best


def gaussian_claim(*sigmas: float) -> float:
    """protofl's accountant's epsilon at DELTA for Gaussian releases of these multipliers."""
    ledger: dict = {}
    for s in sigmas:
        ledger[("gaussian", s)] = ledger.get(("gaussian", s), 0) + 1
    return Accountant("rdp", DELTA).epsilon(ledger)


def test_the_auditor_on_gaussians_of_known_privacy():
    rng = np.random.default_rng(0)
    out, inn = rng.normal(0, 1, N), rng.normal(1 / SIGMA, 1, N)
    assert 0.8 < epsilon_lower_bound(inn, out) < gaussian_claim(SIGMA) - 0.5  # sound: below its claim
    half = epsilon_lower_bound(rng.normal(1 / SIGMA, 0.5, N), rng.normal(0, 0.5, N))
    assert half > gaussian_claim(SIGMA) + 0.2  # half the noise: above the claim
    assert epsilon_lower_bound(out, out) == 0.0  # the same distribution: nothing


def keys(n: int) -> list[bytes]:
    return [new_secret() for _ in range(n)]


# ---------------------------------------------------------------------------------------
# audit 1: client-level DP (DP-FedAvg), one round; the canary: one client's update
# ---------------------------------------------------------------------------------------
class _Server:
    def log(self, *args):
        pass


def client_release_scores(canary: bool, half_noise: bool = False) -> tuple[np.ndarray, float]:
    """Scores of N rounds of ServerPrivacy.release (every round its own noise from the
    server's secret): three clients with fixed updates, and the canary client whose update
    (10 e_1, clipped to C e_1) is in or out. Score: the release's e_1 coordinate, its
    noise-free value without the canary taken away, over the claimed noise std sigma C / m."""
    cfg = from_dict({"participation": {"fraction": 1.0},
                     "privacy": {"mode": "client", "clip": 1.0, "noise_multiplier": SIGMA, "delta": DELTA}})
    algo = ALGORITHMS.get("fedavg")(ALGORITHMS.get("fedavg").Hyper(), None)
    part = Participation(cfg.participation, 4, 0)
    server = ServerPrivacy(cfg, algo, part, [[1]] * 4)
    claim = server.accountant.epsilon({server.round_event: 1})
    if half_noise:  # the broken variant: half the noise, the same claim
        server.z_update = SIGMA / 2
    w_t = {"w": torch.zeros(3)}
    shared = Record(weights=w_t)
    updates = [torch.tensor([0.3, -0.2, 0.1]), torch.tensor([-0.1, 0.4, 0.0]), torch.tensor([0.2, 0.2, -0.5])]
    if canary:
        updates.append(torch.tensor([10.0, 0.0, 0.0]))
    kept = [(ClientTask(c, 1, shared, None, None, False), ClientOutput(Record(weights={"w": u}), None))
            for c, u in enumerate(updates)]
    base = float(sum(u[0] for u in updates[:3])) / 4
    out = np.empty(N)
    for r in range(N):
        ((_, rel),) = server.release(r + 1, shared, kept, _Server())
        out[r] = (float(rel.weights["w"][0]) - base) / (SIGMA * 1.0 / 4)
    return out, claim


def test_audit_client_level_dp_holds_and_flags_half_the_noise():
    out, claim = client_release_scores(False)
    inn, _ = client_release_scores(True)
    eps = epsilon_lower_bound(inn, out)
    assert eps < claim - 0.5, ("client-level DP's release spends more than it claims", eps, out.mean(), out.std(),
                               inn.mean(), inn.std(), [(t, (inn >= t).sum(), (out >= t).sum()) for t in GRID])
    out, _ = client_release_scores(False, half_noise=True)
    inn, _ = client_release_scores(True, half_noise=True)
    assert epsilon_lower_bound(inn, out) > claim, "the audit cannot see half the noise"


# ---------------------------------------------------------------------------------------
# audit 2: DP-SGD, one step (q = 1); the canary: one record
# ---------------------------------------------------------------------------------------
C, B, LR = 1.0, 16, 0.1
X = torch.tensor([[0.5, -0.2], [0.1, 0.9], [-0.7, 0.3], [0.4, 0.4], [-0.2, -0.8], [0.9, 0.1], [0.0, 0.6],
                  [-0.5, -0.5]])
Y = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # classes 0 and 1; class 2 is the canary's own
CANARY_X, CANARY_Y = torch.tensor([[10.0, 0.0]]), torch.tensor([2])


def linear(bias2: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.bias[2] += bias2  # (FedRS's audit: class 2's logit large, so restricting it matters)
    return model


def first_noise(key: bytes, n: int, cfg) -> torch.Tensor:
    """The (n,) noise a client with ``key`` adds to its first DP-SGD step (private_fit's draw)."""
    return ClientPrivacy(cfg, 1, 0, key=key).noise_generator().normal((n,))


def dp_sgd_scores(loss, extras_of, canary: bool, trials: int, sigma: float,
                  bias2: float = 0.0) -> tuple[np.ndarray, torch.Tensor]:
    """The private gradient of one DP-SGD step (q = 1: every record in the batch) over
    ``trials`` clients' keys, as (trials, p) rows; ``extras_of(canary, key)``: the loss's
    extras the client would build. Returns the rows and their noise-free value."""
    model = linear(bias2)
    names = [k for k, _ in model.named_parameters()]
    x, y = (torch.cat([X, CANARY_X]), torch.cat([Y, CANARY_Y])) if canary else (X, Y)
    cfg = from_dict({"privacy": {"mode": "sample", "noise_multiplier": sigma, "delta": DELTA}})
    p = sum(v.numel() for v in model.parameters())
    out = torch.empty(trials, p)
    fixed = None
    for i, key in enumerate(keys(trials)):
        ex = extras_of(canary, key)
        if fixed is None or ex:  # extras that vary per client: its own per-sample gradients
            per, _ = sample_gradients(model, loss, names, x, y, ex)
            fixed = per
        z = first_noise(key, p, cfg).unsqueeze(0)
        g = private_gradient([t.unsqueeze(0) for t in fixed], C, sigma, z, batch=B)
        out[i] = torch.cat([t.reshape(-1) for t in g])
    clean = torch.cat([t.reshape(-1) for t in private_gradient([t.unsqueeze(0) for t in fixed], C, 0.0, batch=B)])
    return out, clean


def along(rows_in, rows_out, clean_in, clean_out, sigma_claimed) -> tuple[np.ndarray, np.ndarray]:
    """Scores: each row's projection on the noise-free difference's direction, from the
    noise-free value without the canary, over the claimed noise std sigma C / B."""
    d = clean_in - clean_out
    u = d / d.norm()
    s = lambda rows: ((rows - clean_out) @ u / (sigma_claimed * C / B)).numpy()  # noqa: E731
    return s(rows_in), s(rows_out)


def no_extras(canary, key):
    return {}


def test_audit_dp_sgd_holds_and_flags_half_the_noise():
    claim = Accountant("rdp", DELTA).epsilon({("poisson", 1.0, SIGMA): 1})
    assert claim == gaussian_claim(SIGMA)
    for sigma, sound in ((SIGMA, True), (SIGMA / 2, False)):
        rin, cin = dp_sgd_scores(cross_entropy, no_extras, True, N, sigma)
        rout, cout = dp_sgd_scores(cross_entropy, no_extras, False, N, sigma)
        eps = epsilon_lower_bound(*along(rin, rout, cin, cout, SIGMA))
        if sound:
            assert eps < claim - 0.5, f"DP-SGD's step spends more than it claims ({eps:.2f} > {claim:.2f})"
        else:
            assert eps > claim, f"the audit cannot see half the noise ({eps:.2f} <= {claim:.2f})"


def fedrs():
    info = TaskInfo(num_classes=3, num_clients=1, feature_dim=2, input_shape=(2,), seed=0, rounds=1)
    cls = ALGORITHMS.get("fedrs")
    return cls(cls.Hyper(alpha=0.0), info)  # a missing class's logit scaled to 0


def test_audit_a_loss_reading_label_counts_exact_is_flagged_and_released_holds():
    """FedRS's restricted softmax reads the client's label counts: the canary's class is
    absent without it (its logit, large here, then scaled to 0), so every other record's
    gradient changes with it. With the exact
    counts (what protofl did before) the step moves by far more than C; with the counts the
    client releases once under privacy.mode: sample (noise std label_noise) it holds, at the
    composed claim of the count release and the step."""
    method, label_noise = fedrs(), 10.0
    loss = method.adjusted_cross_entropy

    def exact(canary, key):
        return {"adjust": torch.bincount(torch.cat([Y, CANARY_Y]) if canary else Y, minlength=3)}

    def released(canary, key):
        counts = np.bincount((torch.cat([Y, CANARY_Y]) if canary else Y).numpy(), minlength=3)
        return {"adjust": torch.from_numpy(noisy_label_counts(counts, label_noise, key, 0, 0))}

    claim = gaussian_claim(SIGMA)
    rin, cin = dp_sgd_scores(loss, exact, True, 1000, SIGMA, bias2=6.0)
    rout, cout = dp_sgd_scores(loss, exact, False, 1000, SIGMA, bias2=6.0)
    assert float((cin - cout).norm()) * B > 3 * C  # one record moved the clipped sum by far more than C
    assert epsilon_lower_bound(*along(rin, rout, cin, cout, SIGMA)) > claim, "exact counts in a loss not flagged"

    composed = Accountant("rdp", DELTA).epsilon({("gaussian", SIGMA): 1, ("gaussian", label_noise): 1})
    rin, _ = dp_sgd_scores(loss, released, True, 1500, SIGMA, bias2=6.0)
    rout, _ = dp_sgd_scores(loss, released, False, 1500, SIGMA, bias2=6.0)
    # the direction an auditor would look in: the exact variant's, which the canary would move most
    assert epsilon_lower_bound(*along(rin, rout, cin, cout, SIGMA)) < composed - 0.5


# ---------------------------------------------------------------------------------------
# audit 3: prototypes (per-class clipped sums and counts); the canary: one record
# ---------------------------------------------------------------------------------------
def sums_scores(z_of, canary: bool, trials: int, sigma: float, clip: float = C,
                direction=None) -> np.ndarray:
    """Scores of ``trials`` releases of private_sums (what release_class_means noises), each
    from a client key's ``class_means`` stream: the statistic (class 0's sum along
    ``direction``, over its std sqrt(2) sigma C, plus its count over sqrt(2) sigma) / sqrt(2),
    from their noise-free values without the canary. ``z_of(canary, key)``: the features
    (n, d) and labels the client would release (``key`` None: their noise-free value)."""
    cfg = from_dict({"privacy": {"mode": "sample", "noise_multiplier": sigma, "delta": DELTA}})
    z0, y0 = z_of(False, None)
    base_sum, base_n = clip_rows(z0, clip)[y0 == 0].sum(0), float((y0 == 0).sum())
    direction = torch.eye(z0.shape[1])[0] if direction is None else direction
    out = np.empty(trials)
    for i, key in enumerate(keys(trials)):
        z, y = z_of(canary, key)
        sums, counts = private_sums(clip_rows(z, clip), y, 2, clip, sigma,
                                    ClientPrivacy(cfg, 1, 0, key=key).generator("class_means"))
        a = float((sums[0] - base_sum) @ direction) / (math.sqrt(2) * SIGMA * clip)
        b = (float(counts[0]) - base_n) / (math.sqrt(2) * SIGMA)
        out[i] = (a + b) / math.sqrt(2)
    return out


FEATS = torch.tensor([[0.2, 0.1, -0.3], [-0.4, 0.5, 0.1], [0.3, -0.3, 0.3], [0.1, 0.1, 0.1], [0.5, 0.0, 0.2]])
FEAT_Y = torch.tensor([0, 0, 1, 0, 1])


def fixed_features(canary, key):
    if canary:  # a record whose feature points along e_1 with norm >= C: clipped to C e_1
        return torch.cat([FEATS, torch.tensor([[5.0, 0.0, 0.0]])]), torch.cat([FEAT_Y, torch.tensor([0])])
    return FEATS, FEAT_Y


def test_audit_the_prototype_release_holds_and_flags_half_the_noise():
    claim = gaussian_claim(SIGMA)  # one release, sensitivity sqrt(2) C
    for sigma, sound in ((SIGMA, True), (SIGMA / 2, False)):
        eps = epsilon_lower_bound(sums_scores(fixed_features, True, N, sigma),
                                  sums_scores(fixed_features, False, N, sigma))
        if sound:
            assert eps < claim - 0.5, f"the prototype release spends more than it claims ({eps:.2f})"
        else:
            assert eps > claim, f"the audit cannot see half the noise ({eps:.2f})"


# the features of a linear map W x of 8 records x = e_1 of class 0, each starting at -C u
# (u = e_2), after one step (lr 3) on a loss that only the canary (8 e_1, class 1) feels:
# -<W x, u> for class 1. Plain SGD then moves every class-0 feature to +C u (after the clip)
RECORDS = torch.tensor([[1.0, 0.0]]).repeat(8, 1)
U = torch.tensor([0.0, 1.0])
W0 = torch.tensor([[0.0, 0.0], [-C, 0.0]])
STEP = 3.0


def push(W, x, y):
    return -((x @ W.T) @ U) * (y == 1).to(x.dtype)


def trained_features(canary: bool, key, private: bool, sigma: float = SIGMA):
    """The records' features after one step from W0 on ``push``: plain SGD (the model behind
    the earlier privacy.mode: prototype) or DP-SGD (q = 1, clip C, noise from the client's
    key), and their labels."""
    x = torch.cat([RECORDS, 8 * torch.tensor([[1.0, 0.0]])]) if canary else RECORDS
    y = torch.tensor([0] * 8 + [1] * canary)
    per = torch.func.vmap(torch.func.grad(lambda W, xi, yi: push(W, xi, yi)), in_dims=(None, 0, 0))(W0, x, y)
    if private:  # (no key: the noise-free value the score is measured from)
        cfg = from_dict({"privacy": {"mode": "sample", "noise_multiplier": sigma, "delta": DELTA}})
        z = torch.zeros(1, W0.numel()) if key is None else first_noise(key, W0.numel(), cfg).unsqueeze(0)
        (g,) = private_gradient([per.unsqueeze(0)], C, sigma, z, batch=len(RECORDS))
        g = g[0]
    else:
        g = per.mean(0)
    return x @ (W0 - STEP * g).T, y


def test_audit_flags_prototypes_of_a_model_trained_without_privacy_and_the_composition_holds():
    """The earlier privacy.mode: prototype released the class means of a model trained on the
    same records without privacy and claimed one Gaussian release: one record then moves
    every feature (here each of the 8 of class 0 flips from -C u to +C u, though the canary
    is of class 1), and the audit sees it. Under
    privacy.mode: sample the model is DP-SGD's, and the release composed with its step holds."""
    claim_old = gaussian_claim(SIGMA)

    def old(canary, key):
        return trained_features(canary, key, private=False)

    zin, _ = old(True, None)
    zout, _ = old(False, None)
    moved = float((clip_rows(zin, C)[:8].sum(0) - clip_rows(zout, C).sum(0)).norm())
    assert moved == pytest.approx(16 * C)  # vs the sqrt(2) C the noise was scaled for
    eps = epsilon_lower_bound(sums_scores(old, True, 1000, SIGMA, direction=U),
                              sums_scores(old, False, 1000, SIGMA, direction=U))
    assert eps > claim_old, f"the earlier prototype mechanism was not flagged ({eps:.2f} <= {claim_old:.2f})"

    def new(canary, key):
        return trained_features(canary, key, private=True)

    composed = gaussian_claim(SIGMA, SIGMA)  # the DP-SGD step and the release
    eps = epsilon_lower_bound(sums_scores(new, True, 3000, SIGMA, direction=U),
                              sums_scores(new, False, 3000, SIGMA, direction=U))
    assert eps < composed - 0.5, f"DP-SGD + the release spends more than it claims ({eps:.2f} >= {composed:.2f})"


# ---------------------------------------------------------------------------------------
# audit 4: the one release of the label counts
# ---------------------------------------------------------------------------------------
def test_audit_the_label_count_release():
    label_noise = 1.5  # audited at the audits' multiplier (the default, 10, is far more private)
    claim = gaussian_claim(label_noise)
    counts = np.array([5, 3, 0])
    plus = counts + np.array([1, 0, 0])
    score = lambda c, k: (noisy_label_counts(c, label_noise, k, 0, 0)[0] - 5) / label_noise  # noqa: E731
    out = np.array([score(counts, k) for k in keys(N)])
    inn = np.array([score(plus, k) for k in keys(N)])
    assert epsilon_lower_bound(inn, out) < claim - 0.5


# ---------------------------------------------------------------------------------------
# the noise's secrecy
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["client", "sample"])
def test_two_runs_with_the_same_seed_release_different_noise(mode, digits_cfg):
    over = ("rounds=1", f"privacy.mode={mode}", "privacy.noise_multiplier=1.0", "eval.final_all_clients=false")
    a, b = run(digits_cfg(*over, "output.name=a")), run(digits_cfg(*over, "output.name=b"))
    wa, wb = torch.load(a.dir / "model.pt"), torch.load(b.dir / "model.pt")
    assert any(not torch.equal(wa[k], wb[k]) for k in wa if wa[k].is_floating_point())
    seeded = ("privacy.noise=seeded",)
    c, d = run(digits_cfg(*over, *seeded, "output.name=c")), run(digits_cfg(*over, *seeded, "output.name=d"))
    wc, wd = torch.load(c.dir / "model.pt"), torch.load(d.dir / "model.pt")
    assert all(torch.equal(wc[k], wd[k]) for k in wc)  # seeded noise replays: that is why it is not private


def test_the_key_is_in_the_checkpoint_only(digits_cfg):
    res = run(digits_cfg("rounds=2", "privacy.mode=sample", "privacy.noise_multiplier=1.0", "output.name=k"))
    ck = torch.load(res.dir / "checkpoint.pt", weights_only=False)
    key = ck["privacy"]["secret"]
    assert isinstance(key, bytes) and len(key) == 32
    assert stat.S_IMODE(os.stat(res.dir / "checkpoint.pt").st_mode) == 0o600
    for f in res.dir.rglob("*"):
        if f.is_file() and f.name != "checkpoint.pt":
            data = f.read_bytes()
            assert key not in data and key.hex() not in data.decode("latin-1"), f.name


class _CopyAt(Callback):
    """Copies the run folder when the row of round ``at`` arrives (its checkpoint on disk:
    the round before, with output.checkpoint_every at that round)."""

    def __init__(self, at: int, to) -> None:
        self.at, self.to, self.dir = at, to, None

    def on_start(self, info):
        self.dir = info["dir"]

    def on_round(self, row):
        if row["round"] == self.at:
            shutil.copytree(self.dir, self.to)


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_a_resume_from_the_runs_own_checkpoint_equals_the_uninterrupted_run(mode, digits_cfg, tmp_path):
    """A run under secret noise, its folder copied as it was after round 3 (its checkpoint:
    round 2) and resumed there: rows and model equal the uninterrupted run's, bit for bit
    (the checkpoint holds the key, from which the clients' keys are derived, and under
    privacy.calibrate the sigma the run chose)."""
    cfg = digits_cfg(f"privacy.mode={mode}", "privacy.clip=0.5", "privacy.noise_multiplier=0.6", "rounds=4",
                     "output.checkpoint_every=2", *(("privacy.adaptive_clip=true", "privacy.count_noise=1.0",
                                                     "participation.sampling=poisson") if mode == "client" else
                                                    ("privacy.calibrate=true", "privacy.target_epsilon=30")))
    full = Simulation(cfg, callbacks=[_CopyAt(3, tmp_path / "copy")], run_dir=tmp_path / "full").run()
    resumed = Simulation(cfg, run_dir=tmp_path / "copy").run(resume=True)
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    a, b = torch.load(full.dir / "model.pt"), torch.load(resumed.dir / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    if mode == "client":
        clips = [r["privacy_clip"] for r in full.rows]
        assert clips[0] == 0.5 and len(set(clips)) == 4  # the clip follows the updates' norms


def test_a_flower_node_keeps_its_own_key(tmp_path):
    pytest.importorskip("flwr")
    from protofl.flower.node_state import noise_key

    k1 = noise_key(tmp_path / "client-3")
    assert len(k1) == 32 and noise_key(tmp_path / "client-3") == k1  # a restart reads it back
    assert stat.S_IMODE(os.stat(tmp_path / "client-3" / "noise-key").st_mode) == 0o600
    assert noise_key(tmp_path / "client-4") != k1


def test_a_seeded_run_says_it_is_not_private(digits_cfg, tmp_path, capsys):
    code = main(["run", str(DIGITS), "rounds=1", "privacy.mode=sample", "privacy.noise=seeded",
                 f"output.dir={tmp_path}", "--quiet"])
    assert code == 0 and "(not private: seeded noise)" in capsys.readouterr().out
    from protofl.engine.callbacks import short_metrics
    from protofl.report.html import privacy_section
    from protofl.report.tables import compare_rows, to_markdown

    runs = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert "not private: seeded noise" in to_markdown(compare_rows({"fedavg": runs}), with_caption=True)
    assert "Not private" in privacy_section({"fedavg": runs}, compare_rows({"fedavg": runs}))
    assert short_metrics({"epsilon": 3.1, "privacy_seeded": 1.0})["eps"] == "3.10 (not private)"
    assert short_metrics({"epsilon": 3.1})["eps"] == "3.10"
    secret = run(digits_cfg("rounds=1", "privacy.mode=sample", "output.name=secret"))
    assert "privacy_seeded" not in secret.rows[0]
    assert "not private" not in to_markdown(compare_rows({"fedavg": [secret.dir]}), with_caption=True)


def test_the_final_evaluation_is_skipped_when_it_would_pass_the_target(digits_cfg):
    """The final evaluation of every client trains each once more (it spends): a target the
    rounds stay under but that turn would pass skips it, with the run complete."""
    over = ("rounds=2", "privacy.mode=sample", "privacy.noise=seeded", "privacy.noise_multiplier=1.5")
    full = run(digits_cfg(*over, "output.name=full"))
    without = run(digits_cfg(*over, "eval.final_all_clients=false", "output.name=without"))
    before, after = without.rows[-1]["epsilon"], full.rows[-1]["epsilon"]
    assert after > before and "all_pa" in full.rows[-1]
    res = run(digits_cfg(*over, f"privacy.target_epsilon={(before + after) / 2}", "output.name=t"))
    assert res.summary["status"] == "complete" and "all_pa" not in res.rows[-1]
    assert res.rows[-1]["epsilon"] == before


def test_a_flower_node_without_a_state_folder_keeps_its_key_in_memory(tmp_path):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from protofl.flower.client_app import _noise_key
    from protofl.flower.node_state import NodeStateStore

    ctx = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    k = _noise_key(ctx, None)
    assert len(k) == 32 and _noise_key(ctx, None) == k  # the node's own, kept for the run
    other = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})
    assert _noise_key(other, None) != k
    store = NodeStateStore(tmp_path, "run-key", 5, 0)
    assert _noise_key(ctx, store) == _noise_key(other, store) == (store.dir / "noise-key").read_bytes()


# ---------------------------------------------------------------------------------------
# what leaves a client
# ---------------------------------------------------------------------------------------
def test_no_exact_count_loss_or_total_leaves_a_client_under_dp(digits_cfg, tmp_path):
    from conftest import record_run
    from protofl.engine.privacy import released_size

    cfg = digits_cfg("rounds=2", "privacy.mode=sample", "privacy.noise_multiplier=1.0", "privacy.noise=seeded")
    sim, res, seen = record_run(cfg, tmp_path / "s")
    counts = sim.fed.class_counts()
    for rnd, cid, msg, reply, state in seen:
        n_tilde = released_size(noisy_label_counts(counts[cid], 10.0, None, cfg.seed, cid))
        assert reply.num_samples == n_tilde != int(counts[cid].sum())
    for r in res.rows:
        assert not {"train_loss", "train_samples"} & set(r)
    client = run(digits_cfg("rounds=1", "privacy.mode=client", "output.name=c"))
    assert not {"train_loss", "train_samples", "weight_diversity", "rejected", "pa"} & set(client.rows[0])


def test_a_rejected_reply_still_spends(digits_cfg, monkeypatch):
    cfg = digits_cfg("rounds=1", "privacy.mode=sample", "privacy.noise_multiplier=1.0", "privacy.noise=seeded",
                     "eval.final_all_clients=false")
    ref = Simulation(cfg, run_dir=cfg.output.dir + "/ref")
    ref.run()
    monkeypatch.setattr(Simulation, "check_reply", lambda self, task, out: "refused by the test")
    sim = Simulation(cfg, run_dir=cfg.output.dir + "/rej")
    res = sim.run()
    assert res.rows[0]["rejected"] == res.rows[0]["arrived"] + res.rows[0]["rejected"] > 0
    assert sim.privacy.ledgers == ref.privacy.ledgers and res.rows[0]["epsilon"] > 0


def test_fedrs_under_sample_reads_its_released_counts_and_accounts_them(digits_cfg, tmp_path):
    from conftest import record_run

    cfg = digits_cfg("algorithm.name=fedrs", "rounds=1", "privacy.mode=sample", "privacy.noise_multiplier=1.0",
                     "privacy.noise=seeded", "eval.final_all_clients=false")
    seen_counts = []
    original = ALGORITHMS.get("fedrs").logit_adjustment

    def spy(self, ctx):
        seen_counts.append((ctx.cid, ctx.class_counts.clone()))
        return original(self, ctx)

    import unittest.mock as mock
    with mock.patch.object(ALGORITHMS.get("fedrs"), "logit_adjustment", spy):
        sim, res, _ = record_run(cfg, tmp_path / "rs")
    counts = sim.fed.class_counts()
    for cid, c in seen_counts:
        assert np.array_equal(c.numpy(), noisy_label_counts(counts[cid], 10.0, None, cfg.seed, cid))
    assert all(("labels", 10.0) in led for led in sim.privacy.ledgers.values())


# ---------------------------------------------------------------------------------------
# the plan is the spend, for every method sample-level DP covers
# ---------------------------------------------------------------------------------------
def covered() -> list[str]:
    from protofl.engine.privacy import check_privacy

    info = TaskInfo(num_classes=10, num_clients=4, feature_dim=16, input_shape=(64,), seed=0, rounds=2)
    cfg = from_dict({"privacy": {"mode": "sample"}})
    out = []
    for n in ALGORITHMS.names():
        try:
            check_privacy(cfg, ALGORITHMS.get(n)(ALGORITHMS.get(n).Hyper(), info))
        except Exception:  # noqa: BLE001 - refused: not covered
            continue
        out.append(n)
    return out


@pytest.mark.parametrize("name", covered())
def test_a_turn_spends_what_the_method_plans(name, digits_cfg, monkeypatch):
    """Each client's first turn (an evaluating one) spends exactly the plan built from the
    method's declared fits (``private_fits``) and releases (``prototype_releases``): the
    target and the noise calibration read the plan, so a method that spends more than it
    declares would pass a target unseen."""
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=1", "privacy.mode=sample", "privacy.noise=seeded",
                     "privacy.noise_multiplier=1.0", "partition.num_clients=4", "participation.fraction=0.5",
                     "training.epochs=1", "eval.final_all_clients=false")
    sim = Simulation(cfg)
    plans = {c: sim.privacy.planned(c, evaluating=True) for c in range(4)}
    sim.run()
    assert sim.privacy.ledgers and all(sim.privacy.ledgers[c] == plans[c] for c in sim.privacy.ledgers), \
        (sim.privacy.ledgers, plans)
