"""SCAFFOLD, FedDyn, MOON, CReFF, FedGen: the defining math on tiny hand-computed cases,
plus resume and worker-count determinism of the five on digits."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from protofl import run
from protofl.algorithms.base import Fit, Fitted, TaskInfo, weights_of
from protofl.algorithms.creff import (class_gradient, linear_class_gradients, matching_loss, retrain_linear,
                                      row_cosine_distance)
from protofl.algorithms.fedavg import FedAvg, FedAvgHyper
from protofl.algorithms.feddyn import FedDyn, FedDynHyper, FedDynState, dynamic_regularizer
from protofl.algorithms.fedgen import generator_objective
from protofl.algorithms.moon import MOON, MOONHyper, model_contrastive_loss
from protofl.algorithms.scaffold import Scaffold, ScaffoldHyper, ScaffoldState
from protofl.engine.client import run_update
from protofl.engine.train import TrainSettings, fit
from protofl.messages import Record
from protofl.models import build_model

from conftest import kill_and_resume, strip_timing


# ---------------------------------------------------------------------------------------
# a one-parameter model w and clients with quadratic objectives f_i(w) = a_i/2 (w - b_i)^2
# ---------------------------------------------------------------------------------------
def info(num_clients):
    return TaskInfo(num_classes=2, num_clients=num_clients, feature_dim=1, input_shape=(1,), seed=0, rounds=1)


class Server:
    def __init__(self, w0=0.0):
        self.m = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.m.weight.fill_(w0)
        self.init = {k: v.clone() for k, v in self.m.state_dict().items()}
        self.device = torch.device("cpu")

    def shared_model(self, weights=None):
        self.m.load_state_dict(self.init if weights is None else weights)
        return self.m

    def init_weights(self):
        return {k: v.clone() for k, v in self.init.items()}


class QuadClient:
    """Just enough ClientContext: K steps of plain SGD (the engine's loop) on f_i, which the
    quadratic methods below read from the extras this client adds to every request."""

    num_samples = 1

    def __init__(self, a, b, steps, lr, momentum=0.0):
        self.a, self.b, self.steps, self._lr, self.momentum = a, b, steps, lr, momentum
        self.m = nn.Linear(1, 1, bias=False)

    def shared_model(self, weights):
        self.m.load_state_dict(weights)
        return self.m

    def like_model(self, weights):
        return weights_of(self.shared_model(weights))

    def trainable(self, weights):
        return {k: weights[k] for k, p in self.m.named_parameters() if p.requires_grad}

    @property
    def lr(self):
        return self._lr

    @property
    def step_size(self):
        return self._lr / (1 - self.momentum)

    def fit(self, weights, loss, *, extras=None, trainable=None, grad=None, **settings):
        return Fit(weights, loss, {**(extras or {}), "quad": (self.a, self.b)}, trainable, grad)

    def execute(self, req):
        model = self.shared_model(req.weights)
        names = [k for k, _ in model.named_parameters() if req.trainable is None or k.startswith(req.trainable)]
        x, y = torch.zeros(1, 1), torch.zeros(1, dtype=torch.long)
        stats = fit(model, x, y, loss=req.loss, extras=req.extras, names=names, grad=req.grad,
                    settings=TrainSettings(lr=self._lr, momentum=self.momentum, batch_size=1, steps=self.steps),
                    generator=torch.Generator().manual_seed(0))
        return Fitted(weights_of(model), stats)


def quadratic(cls):
    class Quad(cls):
        def task_loss(self, model, x, y, extras):  # f_i(w) = a_i/2 (w - b_i)^2
            a, b = extras["quad"]
            return 0.5 * a * (model.weight.sum() - b) ** 2

        def objective(self, msg, ctx):  # FedAvg's local objective
            return self.task_loss, {}

    return Quad


def run_rounds(algo, clients, rounds, steps=5, lr=0.1, w0=0.0, momentum=0.0):
    server = Server(w0)
    state, states = algo.server_init(server), {}
    for rnd in range(1, rounds + 1):
        replies = []
        for cid, (a, b) in enumerate(clients):
            res = run_update(algo, algo.configure(state, rnd, server), states.get(cid),
                             QuadClient(a, b, steps, lr, momentum))
            states[cid] = res.state
            res.reply.num_samples = QuadClient.num_samples  # what the engine attaches
            replies.append((cid, res.reply))
        state = algo.aggregate(state, rnd, replies, server)
    return state


def w_of(state):
    return float(state.weights["weight"])


def test_scaffold_equals_fedavg_on_identical_clients():
    clients = [(2.0, 3.0)] * 3
    for rounds in (1, 2, 4):
        s = run_rounds(quadratic(Scaffold)(ScaffoldHyper(), info(3)), clients, rounds)
        f = run_rounds(quadratic(FedAvg)(FedAvgHyper(), info(3)), clients, rounds)
        assert w_of(s) == pytest.approx(w_of(f), abs=1e-6)


def test_scaffold_fixed_point_is_the_global_optimum_fedavgs_is_not():
    clients = [(1.0, 0.0), (3.0, 4.0)]  # sum_i f_i is minimal at (1*0 + 3*4) / 4 = 3
    K, lr = 5, 0.1
    q = [(1 - lr * a) ** K for a, _ in clients]  # K steps: w -> b + q (w - b)
    fedavg_fixed = sum(b * (1 - qi) for (_, b), qi in zip(clients, q)) / sum(1 - qi for qi in q)  # 2.6805
    f = run_rounds(quadratic(FedAvg)(FedAvgHyper(), info(2)), clients, 60, K, lr)
    s = run_rounds(quadratic(Scaffold)(ScaffoldHyper(), info(2)), clients, 60, K, lr)
    assert w_of(f) == pytest.approx(fedavg_fixed, abs=1e-4) and abs(fedavg_fixed - 3.0) > 0.3
    assert w_of(s) == pytest.approx(3.0, abs=1e-4)
    # at the fixed point c_i = grad f_i(x) and c = their mean (= 0 at the optimum)
    assert float(s.control["weight"]) == pytest.approx(0.0, abs=1e-4)


def test_scaffold_with_momentum_converges_to_the_global_optimum():
    # heavy-ball local steps: option II divides by lr / (1 - beta), so c_i estimates the
    # gradient; with lr alone it is 1/(1 - beta) too large and the rounds oscillate away
    clients = [(1.0, 0.0), (3.0, 4.0)]
    s = run_rounds(quadratic(Scaffold)(ScaffoldHyper(), info(2)), clients, 200, 10, 0.02, momentum=0.9)
    assert w_of(s) == pytest.approx(3.0, abs=1e-3)


def test_scaffold_corrected_step_and_option_ii_by_hand():
    algo = quadratic(Scaffold)(ScaffoldHyper(), info(4))
    msg = Record(weights={"weight": torch.tensor([[1.0]])}, arrays={"c": {"weight": torch.tensor([[0.7]])}})
    state = Record(arrays={"c": {"weight": torch.tensor([[-0.2]])}})
    # K = 1: y = x - lr (g(x) - c_i + c) with g(1) = 2 (1 - 3) = -4  ->  1.31
    res = run_update(algo, msg, state, QuadClient(2.0, 3.0, steps=1, lr=0.1))
    assert float(res.reply.arrays["dy"]["weight"]) == pytest.approx(0.31, abs=1e-6)
    # option II: c_i+ = c_i - c + (x - y) / (K lr) = -0.2 - 0.7 + (-0.31 / 0.1) = -4 (= g(x) when K = 1)
    assert float(res.state.arrays["c"]["weight"]) == pytest.approx(-4.0, abs=1e-5)
    assert float(res.reply.arrays["dc"]["weight"]) == pytest.approx(-3.8, abs=1e-5)
    # K = 2: y2 = 1.31 - 0.1 (2 (1.31 - 3) + 0.2 + 0.7) = 1.558; c_i+ = -0.9 + (1 - 1.558) / 0.2 = -3.69
    res = run_update(algo, msg, state, QuadClient(2.0, 3.0, steps=2, lr=0.1))
    assert float(res.reply.arrays["dy"]["weight"]) == pytest.approx(0.558, abs=1e-6)
    assert float(res.state.arrays["c"]["weight"]) == pytest.approx(-3.69, abs=1e-5)


def test_scaffold_server_update():
    algo = Scaffold(ScaffoldHyper(server_lr=0.5), info(4))
    state = ScaffoldState({"weight": torch.tensor([[1.0]])}, {"weight": torch.tensor([[0.4]])})
    replies = [(0, Record(arrays={"dy": {"weight": torch.tensor([[0.2]])}, "dc": {"weight": torch.tensor([[1.0]])}},
                          num_samples=10)),
               (3, Record(arrays={"dy": {"weight": torch.tensor([[0.6]])}, "dc": {"weight": torch.tensor([[-3.0]])}},
                          num_samples=30))]
    new = algo.aggregate(state, 1, replies, None)
    assert float(new.weights["weight"]) == pytest.approx(1.0 + 0.5 * 0.4)  # x + eta_g mean(dy)
    assert float(new.control["weight"]) == pytest.approx(0.4 + (1.0 - 3.0) / 4)  # c + sum(dc) / N


def test_scaffold_messages_carry_model_and_control_variates(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=1", "training.steps=1", "eval.personal=false")
    fedavg = run(cfg, run_dir=tmp_path / "a").rows[0]
    scaffold = run(cfg.replace(**{"algorithm.name": "scaffold"}), run_dir=tmp_path / "b").rows[0]
    ints = 8  # the MLP has no integer buffers; one number (the sample count) per reply
    assert scaffold["bytes_down"] == 2 * fedavg["bytes_down"]
    assert scaffold["bytes_up"] == 2 * (fedavg["bytes_up"] - ints * scaffold["arrived"]) + ints * scaffold["arrived"]


# ---------------------------------------------------------------------------------------
# FedDyn
# ---------------------------------------------------------------------------------------
def test_feddyn_linear_term_value_and_gradient():
    theta = torch.tensor([1.0, 2.0], requires_grad=True)
    g, anchor, alpha = torch.tensor([0.5, -1.0]), torch.tensor([0.0, 1.0]), 0.1
    value = dynamic_regularizer({"w": theta}, {"w": g}, {"w": anchor}, alpha)
    value.backward()
    # -<g, theta - theta0> + alpha/2 ||theta - theta0||^2 = -(0.5 - 1) + 0.05 * 2
    assert float(value.detach()) == pytest.approx(0.6)
    assert torch.allclose(theta.grad, torch.tensor([-0.5 + 0.1, 1.0 + 0.1]))  # -g + alpha (theta - theta0)


def test_feddyn_client_state_and_server_update():
    algo = quadratic(FedDyn)(FedDynHyper(alpha=0.1), info(4))
    msg = Record(weights={"weight": torch.tensor([[1.0]])})
    # one SGD step on f(w) - g w + alpha/2 (w - 1)^2 at w = 1: gradient 2 (1 - 3) - 0.5 = -4.5 -> 1.45
    res = run_update(algo, msg, Record(arrays={"grad": {"weight": torch.tensor([[0.5]])}}),
                     QuadClient(2.0, 3.0, steps=1, lr=0.1))
    assert float(res.reply.weights["weight"]) == pytest.approx(1.45)
    assert float(res.state.arrays["grad"]["weight"]) == pytest.approx(0.5 - 0.1 * 0.45)  # g - alpha (theta_k - theta)
    # server: h = 0.2 - 0.1 / 4 * ((2 - 1) + (4 - 1)) = 0.1; theta = mean(2, 4) - h / alpha = 2
    state = FedDynState({"weight": torch.tensor([[1.0]])}, {"weight": torch.tensor([[0.2]])})
    replies = [(cid, Record(weights={"weight": torch.tensor([[w]])}, num_samples=1)) for cid, w in ((0, 2.0), (2, 4.0))]
    new = algo.aggregate(state, 1, replies, None)
    assert float(new.h["weight"]) == pytest.approx(0.1)
    assert float(new.weights["weight"]) == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------
# MOON
# ---------------------------------------------------------------------------------------
def test_moon_loss_against_direct_computation():
    z, z_glob, z_prev = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])
    tau = 0.5
    pos, neg = math.exp((1 / math.sqrt(2)) / tau), math.exp(0.0 / tau)
    assert float(model_contrastive_loss(z, z_glob, z_prev, tau)) == pytest.approx(-math.log(pos / (pos + neg)))
    # no previous model yet (negative = positive): log 2 and no gradient
    zz = torch.tensor([[0.3, -1.2]], requires_grad=True)
    value = model_contrastive_loss(zz, z_glob, z_glob, tau)
    value.backward()
    assert float(value.detach()) == pytest.approx(math.log(2)) and torch.allclose(zz.grad, torch.zeros(1, 2), atol=1e-7)


def test_moon_projection_head():
    algo = MOON(MOONHyper(proj_dim=16), info(2))
    model = algo.adapt_model(build_model("mlp", (8,), 3, hidden=[12], feature_dim=6))
    x = torch.randn(5, 8)
    assert model.body(x).shape == (5, 16) and model(x).shape == (5, 3)
    linears = [m for m in model.body[1] if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(6, 6), (6, 16)]
    assert (model.head.in_features, model.head.out_features) == (16, 3)


# ---------------------------------------------------------------------------------------
# CReFF
# ---------------------------------------------------------------------------------------
def test_creff_class_gradients_closed_form_by_hand_and_autograd():
    W, b = torch.zeros(2, 2), torch.zeros(2)
    feats = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],  # class 0
                          [[2.0, 0.0], [0.0, 0.0]]])  # class 1
    g = linear_class_gradients(W, b, feats)
    # class 0: P = 1/2 everywhere, G = (P - e_0) / 2 = [[-1/4, 1/4]] * 2 rows
    assert torch.allclose(g["weight"][0], torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))
    assert torch.allclose(g["bias"][0], torch.tensor([-0.5, 0.5]))
    head = nn.Linear(2, 2)
    params = {"weight": torch.randn(2, 2, requires_grad=True), "bias": torch.randn(2, requires_grad=True)}
    g = linear_class_gradients(params["weight"].detach(), params["bias"].detach(), feats)
    for c in range(2):
        auto = class_gradient(head, params, feats[c], c)
        assert torch.allclose(auto["weight"], g["weight"][c], atol=1e-6)
        assert torch.allclose(auto["bias"], g["bias"][c], atol=1e-6)


def test_creff_matching_loss_by_hand():
    W, b = torch.zeros(2, 2), torch.zeros(2)
    feats = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 0.0]]])
    syn = linear_class_gradients(W, b, feats)  # class 0: rows [-1/4,-1/4], [1/4,1/4]; bias [-1/2, 1/2]
    opposite = {k: -v for k, v in syn.items()}
    orthogonal = {"weight": torch.tensor([[[1.0, -1.0], [1.0, -1.0]]] * 2), "bias": torch.tensor([[1.0, 1.0]] * 2)}
    only0 = torch.tensor([True, False])
    # D sums 1 - cos over the 2 weight rows and the bias row
    assert float(matching_loss(W, b, feats, syn, only0)) == pytest.approx(0.0, abs=1e-4)
    assert float(matching_loss(W, b, feats, opposite, only0)) == pytest.approx(6.0, abs=1e-4)
    assert float(matching_loss(W, b, feats, orthogonal, only0)) == pytest.approx(3.0, abs=1e-4)
    both = float(matching_loss(W, b, feats, opposite, torch.tensor([True, True])))
    assert both == pytest.approx(12.0, abs=1e-4)
    assert float(row_cosine_distance(torch.tensor([[3.0, 4.0]]), torch.tensor([[4.0, 3.0]]))) == \
        pytest.approx(1 - 24 / 25, abs=1e-5)
    # one matching step moves the features towards the target gradients
    f = feats.clone().requires_grad_(True)
    target = {k: v + 0.3 * torch.randn_like(v) for k, v in linear_class_gradients(torch.randn(2, 2), b, feats).items()}
    before = matching_loss(W + 0.1, b, f, target, torch.tensor([True, True]))
    before.backward()
    with torch.no_grad():
        f -= 0.01 * f.grad
    assert float(matching_loss(W + 0.1, b, f, target, torch.tensor([True, True])).detach()) < float(before.detach())


def test_creff_retraining_is_minibatch_sgd():
    torch.manual_seed(0)
    feats, labels = torch.randn(10, 3), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    W0, b0 = torch.randn(3, 3), torch.randn(3)
    W, b = retrain_linear(W0, b0, feats, labels, epochs=2, lr=0.5, batch=4, rng=np.random.default_rng(1))
    ref = nn.Linear(3, 3)
    with torch.no_grad():
        ref.weight.copy_(W0), ref.bias.copy_(b0)
    opt, rng = torch.optim.SGD(ref.parameters(), lr=0.5), np.random.default_rng(1)
    for _ in range(2):
        perm = torch.from_numpy(rng.permutation(10))
        for i in range(0, 10, 4):
            j = perm[i:i + 4]
            loss = nn.functional.cross_entropy(ref(feats[j]), labels[j])
            opt.zero_grad(), loss.backward(), opt.step()
    assert torch.allclose(W, ref.weight, atol=1e-5) and torch.allclose(b, ref.bias, atol=1e-5)


def test_creff_refuses_a_grad_mask_that_is_not_0_1():
    from protofl.algorithms.creff import CReFF, CReFFHyper

    algo = CReFF(CReFFHyper(), TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0,
                                        rounds=1))

    sent = Record(arrays={"head": {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}})

    def reply(mask):
        return Record(arrays={"grad_mask": torch.tensor(mask),
                              "grad": {"weight": torch.zeros(3, 3, 2), "bias": torch.zeros(3, 3)}})

    assert algo.check_reply(reply([1, 0, 1]), sent) is None
    for bad in ([1, 0, 2], [1, -1, 0]):
        assert "0/1 mask" in algo.check_reply(reply(bad), sent)


def test_creff_refuses_class_gradients_that_do_not_match_the_classifier_sent():
    """A grad group without the bias made aggregate raise KeyError; a weight gradient of another
    shape made it raise a RuntimeError: both are rejected before the aggregate."""
    from protofl.algorithms.creff import CReFF, CReFFHyper

    algo = CReFF(CReFFHyper(), TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0,
                                        rounds=1))
    sent = Record(arrays={"head": {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}})
    mask = torch.tensor([1, 1, 0])
    good = {"weight": torch.zeros(3, 3, 2), "bias": torch.zeros(3, 3)}
    assert algo.check_reply(Record(arrays={"grad_mask": mask, "grad": good}), sent) is None
    no_bias = {"weight": good["weight"]}
    assert "grad has ['weight']" in algo.check_reply(Record(arrays={"grad_mask": mask, "grad": no_bias}), sent)
    extra = dict(good, other=torch.zeros(3, 1))
    assert "grad has" in algo.check_reply(Record(arrays={"grad_mask": mask, "grad": extra}), sent)
    for wrong in ({"weight": torch.zeros(3, 3, 4), "bias": good["bias"]},  # feature dim
                  {"weight": good["weight"], "bias": torch.zeros(3, 2)},  # output rows
                  {"weight": torch.zeros(3, 6), "bias": good["bias"]}):  # flattened
        assert "shape" in algo.check_reply(Record(arrays={"grad_mask": mask, "grad": wrong}), sent)


# ---------------------------------------------------------------------------------------
# FedGen
# ---------------------------------------------------------------------------------------
def test_fedgen_generator_objective_on_a_toy_ensemble():
    head = nn.Linear(2, 2)
    heads = [{"weight": torch.eye(2), "bias": torch.zeros(2)}, {"weight": 2 * torch.eye(2), "bias": torch.zeros(2)}]
    z, y = torch.eye(2), torch.tensor([0, 1])
    # eq. 4: mean logits = 1.5 z; each sample has logits (1.5, 0) for its label -> log(1 + e^-1.5)
    assert float(generator_objective(head, heads, z, y)) == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-6)
    # label weights: head 1 alone votes on label 0, head 2 alone on label 1
    lw = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(-2.0))) / 2
    assert float(generator_objective(head, heads, z, y, lw)) == pytest.approx(expected, abs=1e-6)
    # gradients reach the generated features (the generator is trained through them)
    zg = z.clone().requires_grad_(True)
    generator_objective(head, heads, zg, y).backward()
    assert zg.grad is not None and float(zg.grad.abs().sum()) > 0


def test_fedgen_refuses_replies_without_integer_nonnegative_counts():
    """Without counts aggregate raised KeyError; float counts with a negative entry passed the
    engine's check (which refuses negative integers only) and broke torch.multinomial."""
    from protofl.algorithms.fedgen import FedGen, FedGenHyper

    algo = FedGen(FedGenHyper(), TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0,
                                          rounds=1))
    assert algo.check_reply(Record(arrays={"counts": torch.tensor([3, 0, 1])}), Record()) is None
    assert "integer label counts" in algo.check_reply(Record(), Record())
    for bad in (torch.tensor([3.0, -1.0, 1.0]), torch.tensor([3.0, 0.0, 1.0])):
        assert "integer label counts" in algo.check_reply(Record(arrays={"counts": bad}), Record())
    assert ">= 0" in algo.check_reply(Record(arrays={"counts": torch.tensor([3, -1, 1])}), Record())
    assert "shape" in algo.check_reply(Record(arrays={"counts": torch.tensor([3, 0])}), Record())


def test_fedgen_sends_the_generator_after_the_first_round(digits_cfg, tmp_path):
    from conftest import record_run

    cfg = digits_cfg("algorithm.name=fedgen", "rounds=2", "training.steps=2", "eval.personal=false",
                     "algorithm.gen_steps=3")
    _, res, seen = record_run(cfg, tmp_path)
    first = [msg for rnd, _, msg, _, _ in seen if rnd == 1]
    second = [msg for rnd, _, msg, _, _ in seen if rnd == 2]
    assert all("prior" not in m.arrays for m in first) and all("prior" in m.arrays for m in second)
    prior = second[0].arrays["prior"]
    assert float(prior.sum()) == pytest.approx(1.0) and bool((prior >= 0).all())
    assert "generator_loss" in res.rows[0]


# ---------------------------------------------------------------------------------------
# the five on digits: resume after a kill and worker count give identical results
# ---------------------------------------------------------------------------------------
FAST = {"creff": ["algorithm.retrain_epochs=3", "algorithm.match_steps=3"],
        "fedgen": ["algorithm.gen_steps=5"]}


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "moon", "creff", "fedgen"])
def test_resume_after_kill_is_bit_identical(name, digits_cfg, tmp_path):


    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "output.checkpoint_every=1", "training.epochs=1",
                     "eval.personal=false", *FAST.get(name, []))
    full, resumed = kill_and_resume(cfg, tmp_path, after=2)
    assert strip_timing(resumed.rows) == strip_timing(full.rows)


# per-client tensor state (SCAFFOLD's c_i) across worker processes; the other four pass
# too (add their names here), at ~20-40 s each on a loaded 2-core machine
@pytest.mark.parametrize("name", ["scaffold"])
def test_identical_with_workers(name, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "training.epochs=1", "eval.personal=false",
                     *FAST.get(name, []))
    seq = run(cfg, run_dir=tmp_path / "seq")
    par = run(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / "par")
    assert strip_timing(par.rows) == strip_timing(seq.rows)


def test_a_scaffold_reply_must_carry_both_updates_shaped_as_what_was_sent():
    """aggregate reads Delta y_i for every weight and Delta c_i for every entry of c: a reply
    without them, with one tensor in a group's place, another key or another shape, is
    refused by check_reply (they raised KeyError or a shape error on the server)."""
    algo = Scaffold(ScaffoldHyper(), info(2))
    sent = Record(weights={"w": torch.zeros(2), "bn": torch.zeros(1)}, arrays={"c": {"w": torch.zeros(2)}})
    good = {"dy": {"w": torch.ones(2), "bn": torch.ones(1)}, "dc": {"w": torch.ones(2)}}
    assert algo.check_reply(Record(arrays=good), sent) is None
    for bad in ({"dy": good["dy"]}, {**good, "dc": torch.ones(2)}, {**good, "dy": {"w": torch.ones(2)}},
                {**good, "dc": {"w": torch.ones(3)}}, {**good, "dc": {"v": torch.ones(2)}}):
        assert "must hold one entry per entry" in algo.check_reply(Record(arrays=bad), sent)
