"""LG-FedAvg: the body (local representation) stays on the client, the head is averaged."""
import torch


from method_checks import assert_bad_value_exits_2, assert_round_2_is_the_weighted_mean
from conftest import record_run


def test_body_stays_local_and_the_head_is_the_sample_weighted_mean(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=lgfedavg", "rounds=2", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    head = {k for k in init if k.startswith("head.")}
    for _, _, msg, reply, state in seen:
        assert set(msg.weights) == set(reply.weights) == head
        assert set(state.weights) == set(init) - head
    assert_round_2_is_the_weighted_mean(seen, head)
    # the server's body is never updated: nobody sends one
    assert all(torch.equal(res.server_state.weights[k], init[k]) for k in set(init) - head)
    assert "gm" not in res.rows[-1]


def test_bad_weighting_exits_2_with_one_line(tmp_path, capsys):
    assert_bad_value_exits_2("lgfedavg", "weighting", "median", tmp_path, capsys)
