"""FedETF: the fixed ETF head with its projection and temperature, the balanced feature loss
by hand, what moves in training and in the fine-tuning, and both executors with it."""
import math

import pytest
import torch

from protofl.algorithms.fedetf import ETFHead, FedETF
from protofl.engine.client import ClientContext, run_update
from protofl.engine.simulation import Simulation
from protofl.nn.heads import simplex_etf
from protofl.nn.losses import relaxed_prior


def make_sim(digits_cfg, tmp_path, *overrides):
    return Simulation(digits_cfg("algorithm.name=fedetf", *overrides), run_dir=tmp_path / "run")


def test_model_projects_normalizes_and_scores_with_the_fixed_etf(digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path, "algorithm.proj_dim=12", "algorithm.scale=3")
    model = sim.server.shared_model()
    C, d = sim.info.num_classes, sim.info.feature_dim
    assert isinstance(model.body[1], torch.nn.Linear) and model.body[1].weight.shape == (12, d)  # P: d -> p
    V = model.head.weight  # (C, p): unit rows, pairwise cosine -1/(C-1)
    assert isinstance(model.head, ETFHead) and torch.equal(V, simplex_etf(C, 12, sim.info.seed).T.float())
    cos = V @ V.T
    assert torch.allclose(cos.diagonal(), torch.ones(C), atol=1e-6)
    assert torch.allclose(cos[~torch.eye(C, dtype=torch.bool)], torch.full((C * (C - 1),), -1 / (C - 1)), atol=1e-6)
    assert {k for k, _ in model.head.named_parameters()} == {"weight", "scale"}  # V (for fine-tuning) and beta
    h = torch.randn(4, 12)
    assert torch.allclose(model.head(h), 3.0 * (h / h.norm(dim=1, keepdim=True)) @ V.T, atol=1e-5)


def test_balanced_feature_loss_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.5]])  # beta V^T mu
    counts = torch.tensor([3, 0, 1])  # class 1 absent: counts as one sample (the authors' code)
    prior = relaxed_prior(counts.clamp(min=1), 0.0)
    loss = FedETF.balanced_feature_loss(lambda x: logits, None, torch.tensor([0]), {"prior": prior})
    expected = -math.log(3 * math.e / (3 * math.e + math.exp(2.0) + math.exp(0.5)))
    assert abs(float(loss) - expected) < 1e-6


def test_training_moves_body_projection_and_temperature_never_the_etf(digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path)
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    msg = algo.configure(state, 1, sim.server)
    res = run_update(algo, msg, None, ClientContext(sim.runtime, 2, 1, evaluating=True))
    assert "head.weight" not in res.reply.weights  # V travels down only
    for k in ("body.1.weight", "head.scale"):
        assert not torch.equal(res.reply.weights[k], msg.weights[k])
    # in a training round the personalized model is the locally updated one, V untouched
    assert torch.equal(res.personal.head.weight, msg.weights["head.weight"])
    res.reply.num_samples = 50
    new = algo.aggregate(state, 1, [(2, res.reply)], sim.server)
    assert torch.equal(new.weights["head.weight"], state.weights["head.weight"])


def test_fine_tuning_after_training_moves_only_the_etf_and_the_projection(digits_cfg, tmp_path):
    sim = make_sim(digits_cfg, tmp_path, "rounds=3", "algorithm.finetune_rounds=2", "algorithm.finetune_epochs=1")
    algo = sim.algorithm
    msg = algo.configure(algo.server_init(sim.server), 4, sim.server)
    # round R + 1: the final evaluation of every client, after training
    res = run_update(algo, msg, None, ClientContext(sim.runtime, 2, 4, evaluating=True))
    tuned = {k: v.detach().clone() for k, v in res.personal.state_dict().items()}
    plain = run_update(algo, msg, None, ClientContext(sim.runtime, 2, 4, evaluating=False))
    assert plain.personal is None and torch.equal(plain.reply.weights["body.1.weight"], res.reply.weights["body.1.weight"])
    local = {**res.reply.weights, "head.weight": msg.weights["head.weight"]}  # the locally updated model
    moved = {k for k in tuned if not torch.equal(tuned[k], local[k])}
    assert moved == {"head.weight", "body.1.weight", "body.1.bias"}


def test_batched_fine_tuning_equals_sequential(digits_cfg, tmp_path):
    rows = {}
    for ex in ("sequential", "batched"):
        cfg = digits_cfg("algorithm.name=fedetf", "rounds=1", "partition.num_clients=4", "participation.fraction=1.0",
                         "training.batch_size=24", "algorithm.finetune=every_eval", "algorithm.finetune_rounds=2",
                         "algorithm.finetune_epochs=1", "eval.final_all_clients=false", f"execution.executor={ex}")
        res = Simulation(cfg, run_dir=tmp_path / ex).run()
        assert ex == "sequential" or res.summary["execution"]["executor"] == "batched"
        rows[ex] = res.rows[-1]
    for key in ("pa", "pm_v", "pm_l", "train_loss", "gm"):
        assert math.isclose(rows["sequential"][key], rows["batched"][key], rel_tol=1e-5), key


def test_projection_too_narrow_for_the_etf_is_a_one_line_error(digits_cfg, tmp_path, capsys):
    from protofl.cli import EXIT_BAD_INPUT, main
    from protofl.config import ConfigError
    from protofl.engine.task import Task

    assert Task.build(digits_cfg("algorithm.name=fedetf", "algorithm.proj_dim=9")).algorithm.hp.proj_dim == 9
    with pytest.raises(ConfigError, match="p >= num_classes - 1 = 9"):
        Task.build(digits_cfg("algorithm.name=fedetf", "algorithm.proj_dim=8"))
    from conftest import DIGITS

    rc = main(["run", str(DIGITS), "algorithm.name=fedetf", "algorithm.proj_dim=8", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT and "algorithm.proj_dim" in capsys.readouterr().err


def test_bad_hyper_parameters_are_one_line_errors(digits_cfg):
    from protofl.config import ConfigError

    for bad in ("scale=0", "finetune_epochs=0", "finetune_rounds=-1", "etf_lr=0", "proj_dim=0", "finetune=never"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            digits_cfg("algorithm.name=fedetf", f"algorithm.{bad}")
