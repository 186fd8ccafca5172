"""FedBR: the random sample means, the balancing cross-entropy on the pseudo-data, the
min-max contrastive loss and its pairing, the projection layer's ascent, the server's
pseudo-data, the reply checks, mu = lam = 0 being FedAvg, and the privacy modes it refuses."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedbr import (balancing_loss, contrastive_loss, FedBR, FedBRHyper, projection,
                                      random_sample_means)
from protofl.cli import EXIT_BAD_INPUT, main
from protofl.messages import Record
from protofl.models.base import FLModel

from conftest import DIGITS, record_run
from method_checks import assert_bad_value_exits_2


def info(C=2, d=2):
    return TaskInfo(num_classes=C, num_clients=3, feature_dim=d, input_shape=(d,), seed=0, rounds=2)


def identity_model(d=2):
    body, head = nn.Linear(d, d), nn.Linear(d, d)
    for m in (body, head):
        with torch.no_grad():
            m.weight.copy_(torch.eye(d))
            m.bias.zero_()
    return FLModel(body, head, d, d)


def test_random_sample_means_by_hand():
    x = torch.tensor([[0.0], [2.0], [4.0], [6.0]])
    idx = torch.tensor([[0, 1], [2, 3], [0, 0]])  # drawn with replacement: row 0 twice is allowed
    assert torch.equal(random_sample_means(x, idx), torch.tensor([[1.0], [5.0], [0.0]]))


def test_the_balancing_loss_is_the_cross_entropy_with_the_uniform_label():
    assert float(balancing_loss(torch.zeros(1, 2))) == pytest.approx(math.log(2))  # already balanced
    # logits (ln 3, 0): softmax (3/4, 1/4); CE with (1/2, 1/2) = (ln(4/3) + ln 4) / 2
    got = balancing_loss(torch.tensor([[math.log(3.0), 0.0]]))
    assert float(got) == pytest.approx((math.log(4 / 3) + math.log(4)) / 2)
    z = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.isclose(balancing_loss(z), nn.functional.cross_entropy(z, torch.full((5, 4), 0.25)))


def test_the_contrastive_loss_by_hand_and_tau2_zero_drops_the_negative():
    a, g = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]])  # s(a, g) = 1
    n = torch.tensor([[-1.0, 0.0]])  # s(a, n) = -1
    # -log e^{2} / (e^{2} + e^{-2}) = log(1 + e^{-4})
    assert float(contrastive_loss(a, g, n, 2.0, 2.0)) == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-5)
    assert float(contrastive_loss(3 * a, g, n, 2.0, 2.0)) == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-5)  # cosine
    # tau2 = 0: the negative's term is e^0 = 1 whatever n is
    for n in (torch.tensor([[-1.0, 0.0]]), torch.tensor([[1.0, 0.0]])):
        assert float(contrastive_loss(a, g, n, 2.0, 0.0)) == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-5)


def test_the_local_loss_by_hand_pairs_pseudo_datum_j_with_sample_j_mod_b():
    model = identity_model()
    model.proj = nn.Identity()  # psi = identity: the cosines of the raw features
    algo = FedBR(FedBRHyper(mu=0.5, lam=2.0), info())
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    x_p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # P = 3 > B = 2
    got = algo.fedbr_loss(model, x, y, {"pseudo": x_p, "glob": x_p.clone()})
    ce = math.log(1 + math.exp(-1))  # logits (1, 0) with label 0 and (0, 1) with label 1
    bal = (2 * (math.log(1 + math.e) - 0.5) + math.log(2)) / 3  # logits (1, 0), (0, 1), (1, 1)
    # s(a_j, g_j) = 1; negatives: x_0 for j = 0 and 2, x_1 for j = 1: s = 1, 1, 1/sqrt 2
    con = (2 * math.log(2) + math.log(1 + math.exp(2 / math.sqrt(2) - 2))) / 3
    assert float(got.detach()) == pytest.approx(ce + 2.0 * bal + 0.5 * con)
    only_ce = FedBR(FedBRHyper(mu=0.0, lam=0.0), info()).fedbr_loss(model, x, y, {"pseudo": x_p, "glob": x_p})
    assert float(only_ce.detach()) == pytest.approx(ce)


def test_the_projection_ascends_the_contrastive_loss_and_the_models_gradients_pass_unchanged():
    torch.manual_seed(0)
    model = identity_model(3)
    model.proj = projection(3)
    algo = FedBR(FedBRHyper(mu=0.5), info(C=3, d=3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=g), torch.tensor([0, 1, 2, 0])
    extras = {"pseudo": torch.randn(4, 3, generator=g), "glob": torch.randn(4, 3, generator=g)}
    names = [k for k, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    grads = dict(zip(names, torch.autograd.grad(algo.fedbr_loss(model, x, y, extras), list(params.values()))))
    moved = algo.ascend_projection(grads, extras, params)
    for k in names:  # psi: -(1/mu) of its gradient; the model's gradients unchanged
        expected = -grads[k] / 0.5 if k.startswith("proj.") else grads[k]
        assert torch.equal(moved[k], expected), k

    def l_con():
        z, z_p = model.body(x), model.body(extras["pseudo"])
        return float(contrastive_loss(model.proj(z_p), model.proj(extras["glob"]), model.proj(z), 2.0, 2.0).detach())

    before = l_con()
    with torch.no_grad():  # one plain SGD step of psi alone on the transformed gradient
        for k in names:
            if k.startswith("proj."):
                params[k].sub_(1e-2 * moved[k])
    assert l_con() > before


def test_the_server_fills_each_slot_from_a_client_of_the_pseudo_data_round(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedbr", "algorithm.num_pseudo=6", "rounds=2", "eval.personal=false")
    _, result, seen = record_run(cfg, tmp_path / "run")
    r1 = [(cid, reply) for rnd, cid, _, reply, _ in seen if rnd == 1]
    msg2 = next(msg for rnd, _, msg, _, _ in seen if rnd == 2)
    assert all(reply.arrays["pseudo"].shape == (6, 1, 8, 8) for _, reply in r1)
    x_p = msg2.arrays["pseudo"]
    assert x_p.shape == (6, 1, 8, 8)
    for j in range(6):  # slot j is the j-th random sample mean of one of round 1's clients
        assert any(torch.equal(x_p[j], reply.arrays["pseudo"][j].to(x_p.device)) for _, reply in r1), j
    assert all("pseudo" not in reply.arrays for rnd, _, _, reply, _ in seen if rnd == 2)
    assert torch.equal(result.server_state.pseudo.to(x_p.device), x_p)


def test_check_reply_asks_for_the_means_in_the_pseudo_data_round_only():
    algo = FedBR(FedBRHyper(num_pseudo=2), info())
    first, later = Record(weights={}), Record(weights={}, arrays={"pseudo": torch.zeros(2, 2)})
    assert "missing" in algo.check_reply(Record(weights={}), first)
    assert algo.check_reply(Record(weights={}, arrays={"pseudo": torch.zeros(2, 2)}), first) is None
    assert "shape" in algo.check_reply(Record(weights={}, arrays={"pseudo": torch.zeros(3, 2)}), first)
    assert "after" in algo.check_reply(Record(weights={}, arrays={"pseudo": torch.zeros(2, 2)}), later)
    assert algo.check_reply(Record(weights={}), later) is None
    assert algo.check_reply(Record(weights={}, num_samples=0), first) is None  # no data, no means


def test_a_client_without_data_sends_no_means_and_the_round_goes_on(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedbr", "algorithm.num_pseudo=4", "rounds=2", "eval.personal=false",
                     "partition.name=dirichlet", "partition.beta=0.01", "partition.num_clients=8",
                     "partition.min_size=0", "participation.fraction=1.0")
    _, result, seen = record_run(cfg, tmp_path / "run")
    r1 = [reply for rnd, _, _, reply, _ in seen if rnd == 1]
    assert any(reply.num_samples == 0 and "pseudo" not in reply.arrays for reply in r1)  # the empty client
    assert result.server_state.pseudo.shape == (4, 1, 8, 8)
    assert all(row["rejected"] == 0 for row in result.rows)


def test_mu_and_lam_zero_train_fedavgs_model_bit_for_bit(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    got = {}
    for name, extra in (("fedavg", []), ("fedbr", ["algorithm.mu=0", "algorithm.lam=0"])):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "eval.personal=false", *extra)
        got[name] = Simulation(cfg, run_dir=tmp_path / name).run().server_state.weights
    assert all(torch.equal(got["fedavg"][k], got["fedbr"][k]) for k in got["fedavg"])
    assert any(k.startswith("proj.") for k in got["fedbr"])


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_no_privacy_mode_covers_the_pseudo_data(mode, tmp_path, capsys):
    rc = main(["run", str(DIGITS), "algorithm.name=fedbr", f"privacy.mode={mode}", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "fedbr" in err and len(err.splitlines()) == 1, err


def test_a_model_reading_token_ids_is_refused():
    from types import SimpleNamespace

    from protofl.config import ConfigError

    text = FLModel(nn.Sequential(nn.Embedding(5, 2), nn.Flatten()), nn.Linear(2, 2), 2, 2)
    ctx = SimpleNamespace(shared_model=lambda: text, init_weights=lambda: {})
    with pytest.raises(ConfigError, match="token ids"):
        FedBR(FedBRHyper(), info()).server_init(ctx)


@pytest.mark.parametrize("key,value", [("tau1", -1), ("mu", -0.5), ("num_pseudo", 0), ("mean_of", 0)])
def test_bad_hyper_parameters_exit_2(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("fedbr", key, value, tmp_path, capsys)
