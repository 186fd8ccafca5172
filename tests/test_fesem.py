"""FeSEM (multi-center FL): the E-step and M-step by hand on 2-parameter models, the
options, and recovery of rotation groups."""
import numpy as np
import pytest
import torch

from protofl import run
from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fesem import FeSEM, FeSEMHyper, FeSEMState, assign_nearest, distance_keys
from protofl.config import ConfigError, load_config
from protofl.rng import seed_for
from protofl.messages import Record
from protofl.metrics import cluster_purity


class Ctx:
    def __init__(self):
        self.logs = {}

    def log(self, k, v):
        self.logs[k] = v


def W(a, b):
    return {"a": torch.tensor([float(a)]), "b": torch.tensor([float(b)])}


def reply(a, b, n):
    return Record(weights={"a": torch.tensor([float(a)]), "b": torch.tensor([float(b)])}, num_samples=n)


def algo(**hp):
    info = TaskInfo(num_classes=2, num_clients=4, feature_dim=1, input_shape=(2,), seed=0, rounds=1)
    return FeSEM(FeSEMHyper(**hp), info)


def state(centers, assignment, steps=1, keys=("a", "b")):
    return FeSEMState([W(*c) for c in centers], np.array(assignment), np.zeros(4, dtype=np.int64), list(keys),
                      steps)


REPLIES = [(0, reply(1, 0, 1)), (1, reply(0, 2, 3)), (2, reply(9, 9, 2)), (3, reply(12, 10, 2))]


def test_e_step_nearest_centre_and_m_step_mean_of_members_by_hand():
    # centres (0, 0), (10, 10), (100, 100); all clients start in centre 2
    ctx = Ctx()
    out = algo(centers=3).aggregate(state([(0, 0), (10, 10), (100, 100)], [2, 2, 2, 2]), 1, REPLIES, ctx)
    # squared distances: client 0 (1, 0): 1 vs 181 -> 0; client 1 (0, 2): 4 vs 164 -> 0;
    # client 2 (9, 9): 162 vs 2 -> 1; client 3 (12, 10): 244 vs 4 -> 1
    assert out.assignment.tolist() == [0, 0, 1, 1]
    assert ctx.logs["fesem_moved"] == 4 and ctx.logs["fesem_size2"] == 0
    # M-step (uniform): (1+0)/2, (0+2)/2 and (9+12)/2, (9+10)/2; centre 2 has no member: kept
    assert [float(out.centers[0][k]) for k in "ab"] == [0.5, 1.0]
    assert [float(out.centers[1][k]) for k in "ab"] == [10.5, 9.5]
    assert [float(out.centers[2][k]) for k in "ab"] == [100.0, 100.0]
    # generic model: centres weighted by their members' samples, 4 (1+3) and 4 (2+2)
    assert [float(out.weights[k]) for k in "ab"] == [5.5, 5.25]
    # sample-weighted M-step: (1*1 + 3*0)/4, (1*0 + 3*2)/4
    out = algo(centers=3, weighting="samples").aggregate(
        state([(0, 0), (10, 10), (100, 100)], [2, 2, 2, 2]), 1, REPLIES, Ctx())
    assert [float(out.centers[0][k]) for k in "ab"] == [0.25, 1.5]


def test_distance_on_named_layers_only():
    # on "b" alone: client 0 (b=0) and 1 (b=2) -> centre (0, 0); 2 (b=9), 3 (b=10) -> b=10;
    # centres chosen so that the full distance would say otherwise for client 0
    centers = [(50, 0), (0, 10)]
    full = algo(centers=2).aggregate(state(centers, [0, 0, 0, 0]), 1, REPLIES, Ctx())
    only_b = algo(centers=2, layers=["b"]).aggregate(state(centers, [0, 0, 0, 0], keys=["b"]), 1, REPLIES, Ctx())
    assert full.assignment.tolist() == [1, 1, 1, 1]
    assert only_b.assignment.tolist() == [0, 0, 1, 1]
    assert distance_keys(["body.0.weight", "body.0.bias", "head.weight"], ["body.0"]) == ["body.0.weight",
                                                                                          "body.0.bias"]
    with pytest.raises(ConfigError, match="matches no parameter"):
        distance_keys(["head.weight"], ["fc9"])


def test_no_recluster_and_first_round_keep_the_assignment():
    s = state([(0, 0), (10, 10)], [1, 1, 0, 0])
    kept = algo(centers=2, recluster=False).aggregate(s, 1, REPLIES, Ctx())
    assert kept.assignment.tolist() == [1, 1, 0, 0]
    assert [float(kept.centers[1][k]) for k in "ab"] == [0.5, 1.0]  # M-step over the fixed members
    # random_assignment: no E-step before the first M-step (all centres are equal then)
    first = algo(centers=2).aggregate(state([(0, 0), (0, 0)], [1, 1, 0, 0], steps=0), 1, REPLIES, Ctx())
    assert first.assignment.tolist() == [1, 1, 0, 0] and first.steps == 1


def test_assign_nearest_ties_go_to_the_lowest_index():
    pts = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    ctr = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    assert assign_nearest(pts, ctr).tolist() == [0, 0]


def test_a_reply_without_every_weight_is_refused():
    """The engine admits a subset of the weights sent; FeSEM's E-step would raise KeyError in
    flatten and its M-step would build a centre without the missing weight."""
    from protofl.engine.validate import check_reply

    sent = Record(weights=W(0, 0))
    partial = Record(weights={"a": torch.tensor([1.0])}, num_samples=1)
    assert check_reply(partial, sent, client_size=1, model_bytes=8, patterns=()) is None  # the engine's check
    assert "lacks model weights ['b']" in algo(centers=2).check_reply(partial, sent)
    assert algo(centers=2).check_reply(reply(1, 0, 1), sent) is None
    with pytest.raises(KeyError):  # what the check keeps out of the aggregate
        algo(centers=2).aggregate(state([(0, 0), (10, 10)], [0, 0, 0, 0]), 1, [(0, partial)], Ctx())


def test_cluster_purity():
    assert cluster_purity([0, 0, 1, 1], [5, 5, 7, 7]) == 1.0
    assert cluster_purity([0, 1, 0, 1], [5, 5, 7, 7]) == 0.5
    assert cluster_purity([0, 0, 0, 1], [0, 1, 0, 1]) == 0.75


def test_fesem_recovers_two_rotation_groups(tmp_path):
    # sklearn digits at 0 and 180 degrees (iid labels), 8 clients, 2 centres: the random
    # initial assignment mixes the groups; the E-step of round 2 separates them
    cfg = load_config(None, [
        "rounds=3", "data.name=digits", "partition.name=iid", "partition.num_clients=8",
        "features.name=rotate", "features.groups=2", "model.name=mlp", "model.hidden=[]",
        "model.feature_dim=32", "training.lr=0.05", "training.momentum=0.5", "training.epochs=5",
        "algorithm.name=fesem", "algorithm.centers=2", "eval.every=3", "eval.personal=false",
        "execution.workers=0", "execution.threads=1", "output.progress=false", f"output.dir={tmp_path}"])
    res = run(cfg)
    groups = np.arange(8) % 2  # round-robin rotation groups
    initial = np.random.default_rng(seed_for(0, "fesem-assign")).integers(0, 2, size=8)
    assert cluster_purity(initial, groups) < 1.0  # the random start mixes the groups
    assert cluster_purity(res.server_state.assignment, groups) == 1.0
    assert res.rows[1]["fesem_moved"] > 0 and res.rows[2]["fesem_moved"] == 0
    assert {res.rows[-1]["fesem_size0"], res.rows[-1]["fesem_size1"]} == {4}
    # the engine logs the purity against the rotation groups every round (round 1 has no
    # E-step yet: the random start), and the summary carries the final value
    assert res.rows[0]["cluster_purity"] == cluster_purity(initial, groups)
    assert [r["cluster_purity"] for r in res.rows[1:]] == [1.0, 1.0]
    assert res.summary["final"]["cluster_purity"] == 1.0


def test_cluster_purity_against_the_clustered_partitions_groups(tmp_path):
    # no feature skew: the known groups are the clustered partition's (clients 0-2 group 0,
    # 3-5 group 1); a method that does not cluster (FedAvg) logs no purity
    base = ["rounds=1", "data.name=digits", "partition.name=clustered", "partition.num_clients=6",
            "partition.groups=[{clients: 3, classes_per_client: 2}, {clients: 3, classes_per_client: 5}]",
            "model.name=mlp", "algorithm.name=fesem", "algorithm.centers=2", "eval.personal=false",
            "execution.workers=0", "output.progress=false", f"output.dir={tmp_path}"]
    cfg = load_config(None, base)
    res = run(cfg)
    initial = np.random.default_rng(seed_for(0, "fesem-assign")).integers(0, 2, size=6)
    assert res.rows[0]["cluster_purity"] == cluster_purity(initial, [0, 0, 0, 1, 1, 1])
    assert "cluster_purity" not in run(cfg.replace(**{"algorithm.name": "fedavg"})).rows[0]
    assert "cluster_purity" not in run(cfg.replace(**{"partition.name": "iid"})).rows[0]


def test_personal_model_is_the_centre_or_the_trained_model(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=1", "algorithm.name=fesem", "eval.personal_every=1")
    centre = run(cfg, run_dir=tmp_path / "c").rows[0]
    trained = run(cfg.replace(**{"algorithm.personal": "trained"}), run_dir=tmp_path / "t").rows[0]
    assert centre["train_loss"] == trained["train_loss"] and centre["gm"] == trained["gm"]
    # round 1: every centre is the initial model, so the centre's accuracy is the same for
    # every client (chance level); the trained models have learned something
    assert centre["acc_std"] == 0.0 and trained["pa"] > centre["pa"] + 0.2
