"""FD (federated distillation): per-label average outputs go up, each client's teachers (the
other clients' averages) come down, and the local loss adds a distillation term."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.feddistill import (distillation, DistillState, FedDistill, FedDistillHyper, on_simplex,
                                          outputs, teachers)
from protofl.messages import expect_indices, Record

from conftest import record_run


def state(rows):
    """DistillState from (owner, class, logits) rows."""
    return DistillState(torch.tensor([r[2] for r in rows], dtype=torch.float32),
                      torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))


S = state([(0, 0, [1.0, 2.0, 3.0]), (1, 0, [3.0, 2.0, 1.0]), (2, 0, [5.0, 5.0, 5.0]), (1, 2, [0.0, 0.0, 6.0])])


def test_a_clients_teachers_leave_its_own_logits_out():
    t, n = teachers(S, 1, 3)  # class 0 from clients 0 and 2; class 2 only client 1 has: none
    torch.testing.assert_close(t, torch.tensor([[3.0, 3.5, 4.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert n.tolist() == [2, 0, 0]
    t, n = teachers(S, 7, 3)  # a client that uploaded nothing: every client's average
    torch.testing.assert_close(t, torch.tensor([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 6.0]]))
    assert n.tolist() == [3, 0, 1]


def test_distillation_terms_by_hand():
    # teacher distribution (1/4, 3/4); student outputs (0, 0): log softmax (-ln 2, -ln 2)
    ce = distillation(torch.zeros(1, 2), torch.tensor([[0.25, 0.75]]), "ce")
    torch.testing.assert_close(ce, torch.tensor([math.log(2.0)]))
    # student (1, 0.5): -(1/4 log s_0 + 3/4 log s_1), s = softmax(1, 0.5)
    s = torch.tensor([[1.0, 0.5]])
    z = math.exp(1.0) + math.exp(0.5)
    want = -(0.25 * math.log(math.exp(1.0) / z) + 0.75 * math.log(math.exp(0.5) / z))
    torch.testing.assert_close(distillation(s, torch.tensor([[0.25, 0.75]]), "ce"), torch.tensor([want]))
    mse = distillation(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 2.0]]), "mse")
    torch.testing.assert_close(mse, torch.tensor([2.0]))  # ((1 - 3)^2 + 0) / 2
    with pytest.raises(ValueError, match="unknown distillation"):
        distillation(s, s, "kl")
    # what is averaged: the softmax (the paper's F) for ce, the raw outputs for mse
    torch.testing.assert_close(outputs(torch.tensor([[0.0, math.log(3.0)]]), "ce"), torch.tensor([[0.25, 0.75]]))
    assert torch.equal(outputs(s, "mse"), s)


def method(**hp):
    return FedDistill(FedDistillHyper(**hp), TaskInfo(num_classes=3, num_clients=4, feature_dim=2,
                                                      input_shape=(2,), seed=0, rounds=2))


def test_a_clients_upload_replaces_its_previous_one_and_the_others_stay():
    def reply(classes, logits):
        return Record(arrays={"protos": torch.tensor(logits), "classes": torch.tensor(classes),
                              "counts": torch.ones(len(classes), dtype=torch.int64)})

    new = method().aggregate(S, 2, [(1, reply([0], [[9.0, 9.0, 9.0]])), (5, reply([0, 1], [[1.0, 1.0, 1.0],
                                                                                          [2.0, 0.0, 0.0]]))], None)
    rows = sorted(zip(new.owner.tolist(), new.classes.tolist(), new.averages.tolist()))
    # client 1's upload (label 0 only) replaces both its rows; clients 0 and 2 did not reply: theirs stay
    assert rows == [(0, 0, [1.0, 2.0, 3.0]), (1, 0, [9.0, 9.0, 9.0]), (2, 0, [5.0, 5.0, 5.0]),
                    (5, 0, [1.0, 1.0, 1.0]), (5, 1, [2.0, 0.0, 0.0])]
    t, n = teachers(new, 5, 3)  # label 0 from clients 0, 1, 2; nobody else has label 1
    torch.testing.assert_close(t[0], torch.tensor([15.0, 16.0, 17.0]) / 3)
    assert n.tolist() == [3, 0, 0]
    assert method().aggregate(S, 2, [], None) is S


def test_a_noisy_teacher_is_put_back_on_the_simplex():
    t = torch.tensor([[0.5, 0.25, 0.25], [1.2, -0.2, 0.0], [-0.1, -0.3, -0.2], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(on_simplex(t), torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0],
                                                             [0.0, 0.0, 0.0]]))


def test_a_reply_naming_a_class_twice_or_outside_the_classes_is_refused():
    def rec(classes):
        n = len(classes)
        return Record(arrays={"protos": torch.full((n, 3), 1 / 3), "classes": torch.tensor(classes),
                              "counts": torch.ones(n, dtype=torch.int64)})

    m = method()
    assert m.check_reply(rec([0, 2]), Record()) is None
    assert "more than once" in m.check_reply(rec([0, 0]), Record())
    assert "outside the class indices" in m.check_reply(rec([3]), Record())
    assert "outside the class indices" in m.check_reply(rec([-1]), Record())
    # aggregate reads all three arrays: a reply without one, or with a group in its place, is refused
    assert "must carry" in m.check_reply(Record(), Record())
    assert "must carry" in m.check_reply(Record(arrays={**rec([0]).arrays, "protos": {"p": torch.zeros(1, 3)}}),
                                         Record())
    assert m.check_reply(rec([]), Record()) is None  # a client without data sends them empty
    assert expect_indices(rec([0, 0]), "classes", 3) is None  # duplicates refused only when asked


def test_the_local_loss_is_cross_entropy_plus_gamma_times_the_mean_distillation_term():
    model = nn.Linear(2, 3)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = torch.tensor([0, 2, 0])
    has = torch.tensor([True, False, False])  # label 0 has a teacher, label 2 none
    scores = model(x)
    ce = nn.functional.cross_entropy(scores, y)
    for kind, row in (("ce", [0.5, 0.25, 0.25]), ("mse", [2.0, 0.0, -1.0])):
        teacher = torch.tensor([row, [0.0] * 3, [0.2, 0.3, 0.5]])  # label 2's row is masked out
        loss = method(lam=0.5, distill=kind).distill_loss(model, x, y, {"teacher": teacher, "has": has})
        term = distillation(scores[[0, 2]], teacher[[0, 0]], kind).sum() / 3  # sample 1 counts as 0
        torch.testing.assert_close(loss, ce + 0.5 * term)
        # without any teacher (round 1) the loss is the cross entropy
        nothing = {"teacher": teacher, "has": torch.zeros(3, dtype=torch.bool)}
        none = method(distill=kind).distill_loss(model, x, y, nothing)
        torch.testing.assert_close(none, ce, rtol=0, atol=0)


def test_only_average_outputs_travel_and_each_teacher_is_the_others(digits_cfg, tmp_path):
    # heterogeneous models: two widths of MLP, only the C outputs shared
    cfg = digits_cfg("algorithm.name=feddistill", "rounds=3", "model.per_client={hidden: [[32], [64]]}")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    assert {state.weights["body.1.weight"].shape[0] for _, _, _, _, state in seen} == {32, 64}
    C = sim.info.num_classes
    uploads = {}  # round -> {cid: set of classes}
    for rnd, cid, msg, reply, state in seen:
        assert not msg.weights and not reply.weights  # no weights, either way
        assert set(reply.arrays) == {"protos", "classes", "counts"} and reply.arrays["protos"].shape[1] == C
        means = reply.arrays["protos"]  # averages of softmax outputs: each row sums to 1
        torch.testing.assert_close(means.sum(1), torch.ones(len(means)))
        assert "body.1.weight" in state.weights  # the model stays on the client
        uploads.setdefault(rnd, {})[cid] = set(reply.arrays["classes"].tolist())
        if rnd == 1:
            assert len(msg.arrays["classes"]) == 0  # nothing to distill from yet
    sent = {(rnd, cid): reply for rnd, cid, _, reply, _ in seen}
    for rnd, cid, msg, _, _ in seen:
        if rnd == 2:  # each teacher is the mean of the other clients' round-1 averages of its label
            want = {}
            for c in range(C):
                rows = [sent[1, j].arrays["protos"][sent[1, j].arrays["classes"] == c]
                        for j in uploads[1] if j != cid and c in uploads[1][j]]
                if rows:
                    want[c] = (len(rows), torch.cat(rows).mean(0))
            classes = msg.arrays["classes"].tolist()
            assert classes == sorted(want)
            for c, k, row in zip(classes, msg.arrays["counts"].tolist(), msg.arrays["protos"]):
                assert k == want[c][0]
                torch.testing.assert_close(row, want[c][1])
    assert "gm" not in res.rows[0] and 0 <= res.rows[-1]["pa"] <= 1


def test_bad_hyper_parameters_are_config_errors(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="lam"):
        digits_cfg("algorithm.name=feddistill", "algorithm.lam=-1")
    with pytest.raises(ConfigError, match="distill"):
        digits_cfg("algorithm.name=feddistill", "algorithm.distill=kl")
