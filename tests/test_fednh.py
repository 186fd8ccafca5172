"""FedNH / FedUH: eq. (3) and (4) by hand, the fixed head, and 3 rounds through the CLI."""
import json
import math

import pytest
import torch

from protofl.algorithms.fednh import HEAD_W, FedNH, prototype_update
from protofl.cli import main
from protofl.config import ConfigError
from protofl.engine.client import ClientContext, run_update
from protofl.engine.simulation import Simulation
from protofl.messages import Record
from protofl.nn.heads import FixedHead, max_separated_prototypes

from conftest import DIGITS

# ---------------------------------------------------------------------------------------
# eq. (4) on 3 clients, 4 classes (class 3 reported by nobody), d = 2
# ---------------------------------------------------------------------------------------
W0 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
MU = torch.zeros(3, 4, 2)
COUNTS = torch.zeros(3, 4, dtype=torch.int64)
MU[0, 0], COUNTS[0, 0] = torch.tensor([0.0, 0.6]), 2  # client 0: classes 0, 1
MU[0, 1], COUNTS[0, 1] = torch.tensor([0.3, 0.0]), 1
MU[1, 0], COUNTS[1, 0] = torch.tensor([0.0, 0.3]), 1  # client 1: classes 0, 2
MU[1, 2], COUNTS[1, 2] = torch.tensor([0.0, 0.9]), 3
MU[2, 1], COUNTS[2, 1] = torch.tensor([0.0, 0.6]), 2  # client 2: classes 1, 2
MU[2, 2], COUNTS[2, 2] = torch.tensor([-0.3, 0.0]), 1


def unit(x, y):
    n = math.hypot(x, y)
    return [x / n, y / n]


def test_eq4_uniform_alpha_by_hand():
    # alpha_k = 1/3, rho = 0.5: W_c <- normalize(0.5 W_c + 0.5 * (1/3) sum_k mu_kc)
    # class 0: avg = ([0, .6] + [0, .3]) / 3 = [0, .3];    0.5*[1, 0] + 0.5*[0, .3]  = [.5, .15]
    # class 1: avg = ([.3, 0] + [0, .6]) / 3 = [.1, .2];   0.5*[0, 1] + 0.5*[.1, .2] = [.05, .6]
    # class 2: avg = ([0, .9] + [-.3, 0]) / 3 = [-.1, .3]; 0.5*[-1, 0] + 0.5*[-.1, .3] = [-.55, .15]
    # class 3: nobody reported it -> unchanged
    new = prototype_update(W0, MU, COUNTS, rho=0.5, weighting="uniform")
    expected = torch.tensor([unit(0.5, 0.15), unit(0.05, 0.6), unit(-0.55, 0.15), [0.0, -1.0]])
    assert torch.allclose(new, expected, atol=1e-6)


def test_eq4_count_weights_by_hand():
    # alpha_kc = n_kc / sum_j n_jc
    # class 0: (2*[0, .6] + 1*[0, .3]) / 3 = [0, .5];        -> [.5, .25]
    # class 1: (1*[.3, 0] + 2*[0, .6]) / 3 = [.1, .4];       -> [.05, .7]
    # class 2: (3*[0, .9] + 1*[-.3, 0]) / 4 = [-.075, .675]; -> [-.5375, .3375]
    new = prototype_update(W0, MU, COUNTS, rho=0.5, weighting="counts")
    expected = torch.tensor([unit(0.5, 0.25), unit(0.05, 0.7), unit(-0.5375, 0.3375), [0.0, -1.0]])
    assert torch.allclose(new, expected, atol=1e-6)


def test_eq4_official_aggregation_by_hand():
    # the authors' server: each mu_kc renormalized, weighted by n_kc / sum_j n_jc, the average
    # renormalized, then the moving average (rho = 0.5) and the final normalization
    # class 0: [0, 1] (both clients' means point up)              -> 0.5 [1, 0] + 0.5 [0, 1]
    # class 1: (1 [1, 0] + 2 [0, 1]) / 3 -> unit(1, 2)              -> 0.5 [0, 1] + 0.5 unit(1, 2)
    # class 2: (3 [0, 1] + 1 [-1, 0]) / 4 -> unit(-1, 3)            -> 0.5 [-1, 0] + 0.5 unit(-1, 3)
    new = prototype_update(W0, MU, COUNTS, rho=0.5, weighting="official")
    u1, u2 = unit(1, 2), unit(-1, 3)
    expected = torch.tensor([unit(0.5, 0.5), unit(0.5 * u1[0], 0.5 + 0.5 * u1[1]),
                             unit(-0.5 + 0.5 * u2[0], 0.5 * u2[1]), [0.0, -1.0]])
    assert torch.allclose(new, expected, atol=1e-6)
    # differs from "counts", which averages the un-normalized means
    assert not torch.allclose(new, prototype_update(W0, MU, COUNTS, rho=0.5, weighting="counts"), atol=1e-3)


def test_eq4_extremes():
    assert torch.equal(prototype_update(W0, MU, COUNTS, rho=1.0), W0)  # FedUH: never moves
    new = prototype_update(W0, MU, COUNTS, rho=0.0)  # only the normalized client average
    assert torch.allclose(new[0], torch.tensor([0.0, 1.0]))
    assert torch.allclose(new[1], torch.tensor(unit(0.1, 0.2)))
    assert torch.equal(new[3], W0[3])


# ---------------------------------------------------------------------------------------
# the model, the client (eq. 3) and the server on digits
# ---------------------------------------------------------------------------------------
@pytest.fixture
def fednh_sim(digits_cfg, tmp_path):
    def make(*overrides):
        cfg = digits_cfg("algorithm.name=fednh", *overrides)
        return Simulation(cfg, run_dir=tmp_path / "run")

    return make


def test_adapt_model_fixes_the_max_separated_head(fednh_sim):
    sim = fednh_sim()
    model = sim.server.shared_model()
    C, d = sim.info.num_classes, sim.info.feature_dim
    assert isinstance(model.head, FixedHead)
    assert torch.equal(model.head.weight, max_separated_prototypes(C, d, sim.info.seed))
    names = [n for n, _ in model.named_parameters()]
    assert "head.scale" in names and HEAD_W not in names and HEAD_W in model.state_dict()


def test_client_keeps_the_head_fixed_and_reports_eq3_means(fednh_sim):
    sim = fednh_sim()
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    msg = algo.configure(state, 1, sim.server)
    ctx = ClientContext(sim.runtime, 3, 1)
    res = run_update(algo, msg, None, ctx)
    model = res.personal
    # W did not move; theta and s did
    assert torch.equal(model.head.weight, msg.weights[HEAD_W])
    assert HEAD_W not in res.reply.weights  # the client never changes W: not sent back
    assert not torch.equal(res.reply.weights["head.scale"], msg.weights["head.scale"])
    assert not torch.equal(res.reply.weights["body.1.weight"], msg.weights["body.1.weight"])
    # eq. (3): the mean of normalized features per owned class, zero for the others
    x, y = ctx.data
    with torch.no_grad():
        model.eval()
        f = model.body(x)
        f = f / f.norm(dim=1, keepdim=True)
    counts = ctx.class_counts
    assert torch.equal(res.reply.arrays["counts"], counts)
    proto = res.reply.arrays["proto"]
    assert proto.shape == (sim.info.num_classes, sim.info.feature_dim)
    for c in range(sim.info.num_classes):
        if counts[c] > 0:
            assert torch.allclose(proto[c], f[y == c].mean(0), atol=1e-5)
        else:
            assert torch.equal(proto[c], torch.zeros(sim.info.feature_dim))


def test_fixed_scale_option(fednh_sim):
    sim = fednh_sim("algorithm.scale=30", "algorithm.learn_scale=false")
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    res = run_update(algo, algo.configure(state, 1, sim.server), None, ClientContext(sim.runtime, 0, 1))
    assert float(res.reply.weights["head.scale"]) == 30.0


@pytest.mark.parametrize("weighting,body", [("uniform", 1.5), ("samples", 1.75)])
def test_server_averages_the_body_and_sets_W_by_eq4(fednh_sim, weighting, body):
    sim = fednh_sim("algorithm.rho=0.5", f"algorithm.weighting={weighting}")
    algo = sim.algorithm
    state = algo.server_init(sim.server)
    C, d = sim.info.num_classes, sim.info.feature_dim
    keys = [k for k in state.weights if k != HEAD_W]
    replies = []
    for cid, (n, fill) in enumerate([(10, 1.0), (30, 2.0)]):
        counts = torch.zeros(C, dtype=torch.int64)
        counts[cid] = n
        mu = torch.zeros(C, d)
        mu[cid] = 0.5 * torch.ones(d) / math.sqrt(d)
        replies.append((cid, Record(weights={k: torch.full_like(state.weights[k], fill) for k in keys},
                                    arrays={"proto": mu, "counts": counts}, num_samples=n)))
    new = algo.aggregate(state, 1, replies, sim.server)
    # Algorithm 1 line 9 (default): (1 + 2) / 2 = 1.5; sample-weighted: (10 * 1 + 30 * 2) / 40 = 1.75
    for k in keys:
        assert torch.allclose(new.weights[k], torch.full_like(state.weights[k], body))
    mu = torch.stack([r.arrays["proto"] for _, r in replies])
    counts = torch.stack([r.arrays["counts"] for _, r in replies])
    expected = prototype_update(state.weights[HEAD_W], mu, counts, 0.5)
    assert torch.equal(new.weights[HEAD_W], expected)
    assert torch.equal(new.weights[HEAD_W][2:], state.weights[HEAD_W][2:])  # unreported classes
    assert not torch.allclose(new.weights[HEAD_W][:2], state.weights[HEAD_W][:2])
    assert algo.aggregate(state, 1, [], sim.server) is state  # nobody arrived


def test_paper_defaults(digits_cfg):
    hp = Simulation(digits_cfg("algorithm.name=fednh")).algorithm.hp
    assert (hp.weighting, hp.proto_weighting, hp.rho, hp.projection) == ("uniform", "uniform", 0.9, False)
    assert Simulation(digits_cfg("algorithm.name=feduh")).algorithm.hp.weighting == "uniform"


def test_hyper_parameters_are_validated(digits_cfg):
    with pytest.raises(ConfigError, match="rho"):
        digits_cfg("algorithm.name=fednh", "algorithm.rho=1.5")
    with pytest.raises(ConfigError, match="rho"):  # FedUH has no rho: it is fixed at 1
        digits_cfg("algorithm.name=feduh", "algorithm.rho=0.5")
    with pytest.raises(ConfigError, match="scale"):
        digits_cfg("algorithm.name=fednh", "algorithm.scale=0")


# ---------------------------------------------------------------------------------------
# 3 rounds end to end through the CLI
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fednh", "feduh"])
def test_three_rounds_through_the_cli(name, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = main(["run", str(DIGITS), f"algorithm.name={name}", "rounds=3", f"output.dir={out}",
               "output.name=r", "execution.threads=1", "--quiet"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["gm"] <= 1.0 and 0.0 <= r["pa"] <= 1.0 for r in rows)
    W = torch.load(out / "r" / "model.pt")[HEAD_W]
    W_init = max_separated_prototypes(W.shape[0], W.shape[1], 0)
    assert torch.allclose(W.norm(dim=1), torch.ones(W.shape[0]), atol=1e-5)
    if name == "feduh":
        assert torch.equal(W, W_init) and "head_min_dist" not in rows[-1]
    else:
        assert not torch.allclose(W, W_init) and rows[-1]["head_min_dist"] > 0
    assert "gm=" in capsys.readouterr().out


def test_cifar10_config_runs_on_a_tiny_stand_in(tmp_path):
    """configs/fednh_cifar10.yaml (the paper's setting) on random images in CIFAR's format."""
    import pickle

    import numpy as np

    d = tmp_path / "data" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 40) for i in range(1, 6)] + [("test_batch", 30)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        with open(d / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    out = tmp_path / "runs"
    rc = main(["run", str(DIGITS.parent / "fednh_cifar10.yaml"), "rounds=1", "partition.num_clients=4",
               "partition.min_size=5", "participation.fraction=0.5", "training.epochs=1", f"output.dir={out}",
               "output.name=r", "execution.threads=1", "execution.workers=0", "--data-dir", str(tmp_path / "data"), "--quiet"])
    assert rc == 0
    W = torch.load(out / "r" / "model.pt")[HEAD_W]
    assert W.shape == (10, 192)  # conv2cifar: d = 192 >= C - 1, the regular simplex
    import yaml

    # the authors' augmentation (random crop with padding 4, horizontal flip) is in the recipe
    assert yaml.safe_load((out / "r" / "config.yaml").read_text())["data"]["augment"] == {"crop": 4, "flip": True}


def test_fednh_is_registered_with_its_ablation():
    from protofl.algorithms import ALGORITHMS

    assert ALGORITHMS.get("fednh") is FedNH
    assert issubclass(ALGORITHMS.get("feduh"), FedNH)


def test_a_reply_without_its_prototypes_is_refused_while_the_head_moves():
    """aggregate reads "proto" and "counts" when rho < 1: a reply that lacks them, or sends
    a group in their place, is refused by check_reply (not a KeyError on the server)."""
    from protofl.algorithms.base import TaskInfo
    from protofl.algorithms.fednh import FedNHHyper

    info = TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(4,), seed=0, rounds=1)
    good = {"proto": torch.zeros(3, 2), "counts": torch.ones(3)}
    nh = FedNH(FedNHHyper(), info)
    assert nh.check_reply(Record(arrays=good), Record()) is None
    assert "must carry" in nh.check_reply(Record(), Record())
    assert "must carry" in nh.check_reply(Record(arrays={**good, "proto": {"p": torch.zeros(3, 2)}}), Record())
    assert "shape" in nh.check_reply(Record(arrays={**good, "proto": torch.zeros(2, 2)}), Record())
    uh = FedNH(FedNHHyper(rho=1.0), info)  # FedUH: W stays, the clients send no prototypes
    assert uh.check_reply(Record(), Record()) is None
