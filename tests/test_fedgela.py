"""FedGELA / FedGE: Phi_k and eq. (5) by hand, the fixed ETF head, GA/PA predictors, CLI."""
import json
import math

import pytest
import torch

from protofl.algorithms.fedgela import AdaptedETF, FedGELA, gela_loss, local_adaptation
from protofl.cli import EXIT_BAD_INPUT, main
from protofl.config import ConfigError
from protofl.engine.client import ClientContext, run_update
from protofl.engine.simulation import Simulation
from protofl.engine.task import Task
from protofl.messages import Record
from protofl.nn.heads import simplex_etf

from conftest import DIGITS


# ---------------------------------------------------------------------------------------
# local adaptation Phi_k and eq. (5)
# ---------------------------------------------------------------------------------------
def test_phi_by_hand():
    counts = torch.tensor([2, 0, 6, 2])  # n_k = 10, C = 4
    # gamma = 1/C: Phi_kc = C n_kc / n_k = 4 * [.2, 0, .6, .2]
    assert torch.allclose(local_adaptation(counts), torch.tensor([0.8, 0.0, 2.4, 0.8]))
    # gamma = 0.5: n_kc / (n_k * 0.5)
    assert torch.allclose(local_adaptation(counts, 0.5), torch.tensor([0.4, 0.0, 1.2, 0.4]))


def test_phi_averages_to_one_on_balanced_global_data():
    counts = torch.tensor([[5, 0, 3, 2], [0, 4, 1, 5], [5, 6, 6, 3]])  # every class: 10 samples
    p = counts.sum(1).float() / counts.sum()  # p_k = n_k / n = [.25, .25, .5]
    mix = sum(p[k] * local_adaptation(counts[k]) for k in range(3))
    assert torch.allclose(mix, torch.ones(4), atol=1e-6)
    skewed = torch.tensor([[5, 0, 3, 2], [0, 4, 1, 5], [9, 6, 6, 3]])  # class 0 has 14: not 1
    p = skewed.sum(1).float() / skewed.sum()
    mix = sum(p[k] * local_adaptation(skewed[k]) for k in range(3))
    assert not torch.allclose(mix, torch.ones(4), atol=1e-3)


def test_eq5_softmax_over_the_existing_classes_only():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])  # W^T h
    phi = torch.tensor([1.0, 0.0, 2.0, 1.0])  # class 1 is absent
    # z = Phi * logits over C_k = {0, 2, 3}: (1, 6, 0); loss = -log(e^1 / (e^1 + e^6 + e^0))
    expected = math.log(math.e + math.exp(6) + 1) - 1
    assert abs(float(gela_loss(logits, torch.tensor([0]), phi)) - expected) < 1e-5
    # the absent class's logit does not matter at all
    other = torch.tensor([[1.0, 50.0, 3.0, 0.0]])
    assert torch.allclose(gela_loss(other, torch.tensor([2]), phi), gela_loss(logits, torch.tensor([2]), phi))


# ---------------------------------------------------------------------------------------
# model, client, server on digits
# ---------------------------------------------------------------------------------------
def make_sim(digits_cfg, tmp_path, *overrides):
    return Simulation(digits_cfg(*overrides), run_dir=tmp_path / "run")


def test_head_is_the_scaled_etf_on_unit_features(digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path, "algorithm.name=fedgela", "algorithm.E_W=4")
    model = sim.server.shared_model()
    C, d = sim.info.num_classes, sim.info.feature_dim
    M = simplex_etf(C, d, sim.info.seed)  # (d, C)
    assert torch.allclose(model.head.weight, (2.0 * M).T.float())  # W = sqrt(E_W) M
    assert list(model.head.parameters()) == []  # nothing in the head trains
    h = torch.randn(5, d)
    expected = (h / h.norm(dim=1, keepdim=True)) @ (2.0 * M).float()  # W^T h with ||h|| = 1
    assert torch.allclose(model.head(h), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["fedgela", "fedge"])
def test_client_trains_the_backbone_only_and_returns_its_predictor(name, digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path, f"algorithm.name={name}")
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    msg = algo.configure(state, 1, sim.server)
    ctx = ClientContext(sim.runtime, 2, 1)
    res = run_update(algo, msg, None, ctx)
    personal = res.personal
    model = personal.model if name == "fedgela" else personal
    assert torch.equal(model.head.weight, msg.weights["head.weight"])  # the ETF never moves
    assert not any(k.startswith("head.") for k in res.reply.weights)
    key = next(k for k in res.reply.weights if k.endswith("weight"))
    assert not torch.equal(res.reply.weights[key], msg.weights[key])
    x = ctx.data[0][:7]
    if name == "fedgela":  # PA: the client's backbone with its adapted ETF, Phi_k W^T h
        assert isinstance(personal, AdaptedETF)
        phi = local_adaptation(ctx.class_counts)
        assert torch.allclose(personal.phi, phi)
        with torch.no_grad():
            assert torch.allclose(personal(x), model(x) * phi)
    else:  # FedGE: the client's backbone with the plain ETF
        assert personal is model


def test_server_averages_the_backbone_by_samples_and_keeps_the_etf(digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path, "algorithm.name=fedgela")
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    body = [k for k in state.weights if not k.startswith("head.")]
    replies = [(i, Record(weights={k: torch.full_like(state.weights[k], v) for k in body}, num_samples=n))
               for i, (n, v) in enumerate([(30, 1.0), (10, 5.0)])]
    new = algo.aggregate(state, 1, replies, sim.server)
    for k in body:  # (30 * 1 + 10 * 5) / 40 = 2
        assert torch.allclose(new.weights[k], torch.full_like(state.weights[k], 2.0))
    assert torch.equal(new.weights["head.weight"], state.weights["head.weight"])
    assert algo.aggregate(state, 1, [], sim.server) is state
    # GA: the global backbone with the plain ETF
    g = algo.global_predictor(new, sim.server)
    assert torch.equal(g.head.weight, state.weights["head.weight"])


# ---------------------------------------------------------------------------------------
# feature dimension: d >= C-1 needed
# ---------------------------------------------------------------------------------------
def test_feature_dim_c_minus_1_works_and_smaller_is_refused(digits_cfg, tmp_path, capsys):
    task = Task.build(digits_cfg("algorithm.name=fedgela", "model.feature_dim=9"))
    assert task.info.feature_dim == 9 and isinstance(task.algorithm, FedGELA)
    with pytest.raises(ConfigError, match="feature_dim >= num_classes - 1 = 9"):
        Task.build(digits_cfg("algorithm.name=fedge", "model.feature_dim=8"))
    rc = main(["run", str(DIGITS), "algorithm.name=fedgela", "model.feature_dim=8", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    assert "feature_dim >= num_classes - 1" in capsys.readouterr().err


def test_projection_option_and_paper_defaults(digits_cfg, tmp_path):
    hp = make_sim(digits_cfg, tmp_path, "algorithm.name=fedgela").algorithm.hp
    assert (hp.E_W, hp.projection, hp.clip_grad) == (1000.0, False, 20.0)
    sim = make_sim(digits_cfg, tmp_path, "algorithm.name=fedgela", "algorithm.projection=true")
    assert sim.algorithm.train_overrides() == {"clip_grad": 20.0}
    model = sim.server.shared_model()
    d = sim.info.feature_dim
    assert isinstance(model.body[1], torch.nn.Linear) and model.body[1].weight.shape == (d, d)
    with torch.no_grad():  # signed features: the ReLU body alone gives none below zero
        x = torch.randn(16, *sim.info.input_shape)
        assert (model.body(x) < 0).any() and not (model.body[0](x) < 0).any()
    plain = make_sim(digits_cfg, tmp_path, "algorithm.name=fedgela", "algorithm.clip_grad=null").server.shared_model()
    assert any(k.startswith("body.0.") for k in model.state_dict())  # Sequential(old body, Linear)
    assert not any(k.startswith("body.0.") for k in plain.state_dict())  # the mlp's body.0 is Flatten
    fednh = make_sim(digits_cfg, tmp_path, "algorithm.name=fednh", "algorithm.projection=true").server.shared_model()
    assert isinstance(fednh.body[1], torch.nn.Linear)


def test_hyper_parameters_are_validated(digits_cfg):
    with pytest.raises(ConfigError, match="E_W"):
        digits_cfg("algorithm.name=fedgela", "algorithm.E_W=0")
    with pytest.raises(ConfigError, match="gamma"):
        digits_cfg("algorithm.name=fedge", "algorithm.gamma=0.1")  # FedGE has no adaptation


# ---------------------------------------------------------------------------------------
# 3 rounds end to end through the CLI
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedgela", "fedge"])
def test_three_rounds_through_the_cli(name, tmp_path):
    out = tmp_path / "runs"
    rc = main(["run", str(DIGITS), f"algorithm.name={name}", "rounds=3", f"output.dir={out}",
               "output.name=r", "execution.threads=1", "--quiet"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["gm"] <= 1.0 and 0.0 <= r["pa"] <= 1.0 and r["ga"] == r["gm"]
    assert rows[-1]["gm"] > 0.3  # well above chance (0.1) after 3 rounds on digits
