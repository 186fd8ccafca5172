"""FedPer, FedRep, FedBABU, FedRoD, Ditto, FedAvg-FT: what is shared and what stays on the
client, each method's defining update by hand, resume and worker processes."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl import run
from protofl.algorithms.fedrod import FedRoD, TwoHeads, rod_losses
from protofl.cli import EXIT_BAD_INPUT, main
from protofl.engine.client import ClientContext, drive, run_update
from protofl.engine.simulation import Simulation
from protofl.messages import Record
from protofl.models.base import FLModel

from conftest import DIGITS, StopAfter, record_run, strip_timing, worker_path_executor

SIX = ["fedper", "fedrep", "fedbabu", "fedrod", "ditto", "fedavg_ft"]
FAST = ["training.epochs=1", "algorithm.head_epochs=1"]  # head_epochs: fedrep only


def fast(name):
    return FAST if name == "fedrep" else FAST[:1]


def params_of(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------
# what is averaged, what stays local
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,personal", [("fedper", "head."), ("fedrep", "head."),
                                           ("fedbabu", "head."), ("fedrod", "phead.")])
def test_personal_head_never_sent_and_body_is_the_sample_weighted_mean(name, personal, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", *fast(name))
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    shared = {k for k in init if not k.startswith(personal)}
    for _, _, msg, reply, _ in seen:
        assert set(msg.weights) == shared and set(reply.weights) == shared
        assert not msg.arrays and not reply.arrays
    # no tensor of any client's personal part appears in any message or reply
    sent = [t for _, _, msg, reply, _ in seen for rec in (msg, reply) for _, t in rec.tensors()]
    states = [s for *_, s in seen if s is not None]
    assert len(states) == (0 if name == "fedbabu" else len(seen))
    for s in states:
        assert set(s.weights) == {k for k in init if k.startswith(personal)}
        for t in s.weights.values():
            assert not any(u.shape == t.shape and torch.equal(u, t) for u in sent)
    # the round-2 message is sum_k n_k w_k / sum_k n_k over the round-1 replies, by hand
    r1 = [reply for rnd, _, _, reply, _ in seen if rnd == 1]
    msg2 = next(msg for rnd, _, msg, _, _ in seen if rnd == 2)
    n = [float(r.num_samples) for r in r1]
    for key in shared:
        expected = sum(nk * r.weights[key].double() for nk, r in zip(n, r1)) / sum(n)
        assert torch.allclose(msg2.weights[key].double(), expected, atol=1e-6), key
    # the server's personal entries never move (FedBABU's fixed head, the others' unused copy)
    final = res.server_state.weights
    assert all(torch.equal(final[k], init[k]) for k in init if k.startswith(personal))


def test_personal_head_carries_over_between_rounds(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedper", "rounds=3", "training.epochs=1", "participation.fraction=1.0")
    _, _, seen = record_run(cfg, tmp_path / "r")
    # client 0 trains in every round; its state after round r is the head it starts from in r+1
    states = {rnd: s for rnd, cid, _, _, s in seen if cid == 0}
    assert not same(states[1].weights, states[2].weights)  # it trains

    sim = Simulation(cfg, run_dir=tmp_path / "x")
    ctx = ClientContext(sim.runtime, 0, 3)
    msg = next(m for rnd, cid, m, _, _ in seen if cid == 0 and rnd == 3)
    out = run_update(sim.algorithm, msg, states[2], ctx)
    assert same(out.state.weights, states[3].weights)  # same start, same stream -> same head


# ---------------------------------------------------------------------------------------
# FedRep: the two phases
# ---------------------------------------------------------------------------------------
def recording(ctx):
    """ctx.execute that keeps every training request's (start weights, trained weights)."""
    fits = []

    def execute(req):
        out = ctx.execute(req)
        if hasattr(out, "stats"):
            fits.append(({k: v.clone() for k, v in req.weights.items()}, out.weights))
        return out

    return execute, fits


def test_fedrep_phases_touch_only_their_own_parameters(digits_cfg, tmp_path):
    sim = Simulation(digits_cfg("algorithm.name=fedrep", "algorithm.head_epochs=1", "training.epochs=1"),
                     run_dir=tmp_path / "r")
    algo = sim.algorithm
    ctx = ClientContext(sim.runtime, 0, 1)
    execute, fits = recording(ctx)
    msg = algo.configure(algo.server_init(sim.server), 1, sim.server)
    drive(algo.client_update(msg, algo.client_init(ctx), ctx), execute)
    (w0, w1), (w1_, w2) = fits  # phase 1 (head), then phase 2 (body) from where phase 1 ended
    part = lambda w, prefix: {k: v for k, v in w.items() if k.startswith(prefix)}  # noqa: E731
    assert same(w1_, w1)
    assert same(part(w1, "body."), part(w0, "body."))
    assert not any(torch.equal(w1[k], w0[k]) for k in part(w0, "head."))
    assert same(part(w2, "head."), part(w1, "head."))
    assert not any(torch.equal(w2[k], w1[k]) for k in part(w1, "body.") if k.endswith("weight"))


# ---------------------------------------------------------------------------------------
# FedBABU and FedAvg-FT: the fixed head, fine-tuning only for evaluation
# ---------------------------------------------------------------------------------------
def test_fedbabu_head_stays_at_its_initialization(digits_cfg, tmp_path):
    sim = Simulation(digits_cfg("algorithm.name=fedbabu", "training.epochs=1"), run_dir=tmp_path / "r")
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    head0 = {k: v for k, v in state.weights.items() if k.startswith("head.")}
    msg = algo.configure(state, 1, sim.server)
    outs = {}
    for evaluating in (False, True):
        ctx = ClientContext(sim.runtime, 0, 1, evaluating=evaluating)
        execute, fits = recording(ctx)
        outs[evaluating] = drive(algo.client_update(msg, None, ctx), execute), fits
    out, fits = outs[False]
    assert len(fits) == 1 and out.personal is None  # not evaluated: no fine-tuning at all
    trained = fits[0][1]  # the weights right after local training
    assert all(torch.equal(trained[k], v) for k, v in head0.items())  # the head: bit-identical
    assert out.state is None and not any(k.startswith("head.") for k in out.reply.weights)
    tuned_out, tuned_fits = outs[True]
    assert len(tuned_fits) == 2  # evaluated: the received global model is fine-tuned too
    assert same(tuned_out.reply.weights, out.reply.weights)  # ... after the reply, which it leaves alone
    tuned = tuned_fits[1][1]
    assert not torch.equal(tuned["head.weight"], head0["head.weight"])  # the head moves only here
    assert torch.equal(tuned_out.personal.head.weight, tuned["head.weight"])


@pytest.mark.parametrize("name", ["fedbabu", "fedavg_ft"])
def test_finetuning_for_evaluation_changes_nothing_training_reads(name, digits_cfg, tmp_path):
    on = run(digits_cfg(f"algorithm.name={name}", "rounds=2", "training.epochs=1"), run_dir=tmp_path / "on")
    off = run(digits_cfg(f"algorithm.name={name}", "rounds=2", "training.epochs=1", "eval.personal=false"),
              run_dir=tmp_path / "off")
    assert same(on.server_state.weights, off.server_state.weights)
    assert [r["train_loss"] for r in on.rows] == [r["train_loss"] for r in off.rows]
    assert [r["gm"] for r in on.rows] == [r["gm"] for r in off.rows]
    assert "pa" in on.rows[-1] and "pa" not in off.rows[-1]


def test_ditto_and_fedavg_ft_global_model_is_fedavgs(digits_cfg, tmp_path):
    """Ditto's global solver and FedAvg-FT's training are FedAvg: same global model, bit for bit."""
    ref = run(digits_cfg("algorithm.name=fedavg", "rounds=2", "training.epochs=1"), run_dir=tmp_path / "fedavg")
    for name in ("ditto", "fedavg_ft"):
        res = run(digits_cfg(f"algorithm.name={name}", "rounds=2", "training.epochs=1"), run_dir=tmp_path / name)
        assert same(res.server_state.weights, ref.server_state.weights), name
        assert [r["gm"] for r in res.rows] == [r["gm"] for r in ref.rows]


# ---------------------------------------------------------------------------------------
# FedRoD: two heads
# ---------------------------------------------------------------------------------------
def tiny_two_head_model():
    torch.manual_seed(0)
    model = FLModel(nn.Linear(3, 2), nn.Linear(2, 3), feature_dim=2, num_classes=3)
    model = FedRoD(None, None).adapt_model(model)
    with torch.no_grad():
        model.phead.weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0]]))
        model.phead.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return model


def test_fedrod_personal_prediction_is_the_sum_of_both_heads():
    model = tiny_two_head_model()
    x = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.5, 3.0]])
    Wb, bb = model.body.weight.detach(), model.body.bias.detach()
    Wg, bg = model.head.weight.detach(), model.head.bias.detach()
    Wp, bp = model.phead.weight.detach(), model.phead.bias.detach()
    h = x @ Wb.T + bb
    expected = (h @ Wg.T + bg) + (h @ Wp.T + bp)
    assert torch.allclose(TwoHeads(model)(x), expected, atol=1e-6)
    assert torch.allclose(model(x), h @ Wg.T + bg, atol=1e-6)  # the generic (global) prediction


def test_fedrod_losses_by_hand_and_their_gradients():
    model = tiny_two_head_model()
    x = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.5, 3.0], [0.0, 1.0, 1.0]])
    y = torch.tensor([0, 2, 2])
    prior = torch.tensor([0.25, 0.0, 0.75])  # class 1 absent on this client
    generic, personal = rod_losses(model, x, y, prior)
    with torch.no_grad():
        h = model.body(x)
        zg, zp = model.head(h), model.phead(h)
    # balanced softmax: -log(pi_y e^{z_y} / sum_j pi_j e^{z_j}), one sample at a time
    bsm = []
    for i in range(3):
        num = float(prior[y[i]]) * math.exp(float(zg[i, y[i]]))
        den = sum(float(prior[j]) * math.exp(float(zg[i, j])) for j in range(3))
        bsm.append(-math.log(num / den))
    assert abs(float(generic.detach()) - sum(bsm) / 3) < 1e-5
    ce = []
    for i in range(3):
        z = zg[i] + zp[i]
        ce.append(-float(z[y[i]]) + math.log(sum(math.exp(float(z[j])) for j in range(3))))
    assert abs(float(personal.detach()) - sum(ce) / 3) < 1e-5
    # L_P reaches only the personal head, L_G never reaches it
    personal.backward()
    assert model.phead.weight.grad is not None
    assert model.body.weight.grad is None and model.head.weight.grad is None
    model.zero_grad(set_to_none=True)
    generic, _ = rod_losses(model, x, y, prior)
    generic.backward()
    assert model.phead.weight.grad is None and model.body.weight.grad is not None


# ---------------------------------------------------------------------------------------
# Ditto: one step of each model, by hand
# ---------------------------------------------------------------------------------------
def test_ditto_one_step_is_sgd_on_ce_plus_proximal_term(digits_cfg, tmp_path):
    lam, lr = 0.5, 0.05
    cfg = digits_cfg("algorithm.name=ditto", f"algorithm.lam={lam}", f"training.lr={lr}", "training.momentum=0",
                     "training.weight_decay=0", "training.steps=1", "training.batch_size=100000")
    sim = Simulation(cfg, run_dir=tmp_path / "r")
    ctx = ClientContext(sim.runtime, 0, 1)
    x, y = ctx.data
    w_t = sim.server.init_weights()
    g = torch.Generator().manual_seed(1)
    v = {k: t + 0.1 * torch.randn(t.shape, generator=g) for k, t in w_t.items()}  # v != w_t

    def ce_grads(weights):  # gradient of the full-batch CE (one step = one batch = all data)
        model = ctx.shared_model(weights)
        names = [n for n, _ in model.named_parameters()]
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        return dict(zip(names, (gr.clone() for gr in grads)))

    gw, gv = ce_grads(w_t), ce_grads(v)
    out = run_update(sim.algorithm, Record(weights=w_t), Record(weights=v), ctx)
    for k in gw:
        # global model: one FedAvg step from w_t
        assert torch.allclose(out.reply.weights[k], w_t[k] - lr * gw[k], atol=1e-6), k
        # personal model: v - lr (grad CE(v) + lam (v - w_t))
        assert torch.allclose(out.state.weights[k], v[k] - lr * (gv[k] + lam * (v[k] - w_t[k])), atol=1e-6), k


# ---------------------------------------------------------------------------------------
# engine guarantees: resume and worker processes; config errors
# ---------------------------------------------------------------------------------------

# real worker processes for a method with a two-phase personal head and one with a whole
# personal model; the others go through the workers' code path in this process
# (conftest.worker_path_executor), which starts no processes
REAL_WORKERS = ("fedrep", "ditto")


@pytest.mark.slow
@pytest.mark.parametrize("name", SIX)
def test_resume_with_worker_processes_is_bit_identical(name, digits_cfg, tmp_path):
    """Killed after round 2, resumed from its checkpoint with 2 workers: the rows and the
    server state equal an uninterrupted sequential run (personal states included)."""
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "output.checkpoint_every=1", *fast(name))
    full = run(cfg, run_dir=tmp_path / "full")
    d = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        Simulation(cfg, callbacks=[StopAfter(2)], run_dir=d).run()
    if name in REAL_WORKERS:
        resumed = Simulation(cfg.replace(**{"execution.workers": 2}), run_dir=d).run(resume=True)
    else:
        resumed = Simulation(cfg, run_dir=d, executor_factory=worker_path_executor).run(resume=True)
    assert [r["round"] for r in resumed.rows] == [1, 2, 3]
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    assert same(resumed.server_state.weights, full.server_state.weights)
    assert json.loads((d / "summary.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("name,key,value", [("fedrep", "head_epochs", 0), ("fedrep", "body_epochs", 0),
                                            ("fedbabu", "finetune_epochs", 0), ("fedavg_ft", "finetune_epochs", 0),
                                            ("ditto", "lam", -0.1), ("ditto", "personal_epochs", 0)])
def test_bad_hyper_parameters_exit_2_with_one_line(name, key, value, tmp_path, capsys):
    rc = main(["run", str(DIGITS), f"algorithm.name={name}", f"algorithm.{key}={value}", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert key in err and len(err.splitlines()) == 1
