"""LG-FedAvg: the body (local representation) stays on the client, the head is averaged."""
import torch

from protofl.cli import EXIT_BAD_INPUT, main

from conftest import DIGITS, record_run


def test_body_stays_local_and_the_head_is_the_sample_weighted_mean(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=lgfedavg", "rounds=2", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    head = {k for k in init if k.startswith("head.")}
    for _, _, msg, reply, state in seen:
        assert set(msg.weights) == set(reply.weights) == head
        assert set(state.weights) == set(init) - head
    r1 = [reply for rnd, _, _, reply, _ in seen if rnd == 1]
    msg2 = next(msg for rnd, _, msg, _, _ in seen if rnd == 2)
    n = [float(r.num_samples) for r in r1]
    for key in head:
        expected = sum(nk * r.weights[key].double() for nk, r in zip(n, r1)) / sum(n)
        assert torch.allclose(msg2.weights[key].double(), expected, atol=1e-6), key
    # the server's body is never updated: nobody sends one
    assert all(torch.equal(res.server_state.weights[k], init[k]) for k in set(init) - head)
    assert "gm" not in res.rows[-1]


def test_bad_weighting_exits_2_with_one_line(tmp_path, capsys):
    rc = main(["run", str(DIGITS), "algorithm.name=lgfedavg", "algorithm.weighting=median", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "weighting" in err and len(err.splitlines()) == 1
