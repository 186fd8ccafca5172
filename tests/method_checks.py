"""Checks shared by the method tests: a bad hyper-parameter stops `protofl run` with one line,
as does DP-SGD for a method whose loss couples a batch's samples; a round's message is the sample-weighted mean of the previous round's replies."""
import torch

from protofl.cli import EXIT_BAD_INPUT, main

from conftest import DIGITS


def assert_bad_value_exits_2(method: str, key: str, value, tmp_path, capsys) -> None:
    """`protofl run digits algorithm.name=<method> algorithm.<key>=<value>` exits with code 2 and
    one line of error that names the key."""
    rc = main(["run", str(DIGITS), f"algorithm.name={method}", f"algorithm.{key}={value}", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert key in err and len(err.splitlines()) == 1, err


def assert_dp_sgd_refused(method: str, tmp_path, capsys) -> None:
    """`protofl run digits algorithm.name=<method> privacy.mode=sample` exits with code 2 and
    one line saying the method's loss couples the samples of a batch."""
    rc = main(["run", str(DIGITS), f"algorithm.name={method}", "privacy.mode=sample", "rounds=1",
               f"output.dir={tmp_path}", "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "couples the samples of a batch" in err and len(err.splitlines()) == 1, err


def assert_round_2_is_the_weighted_mean(seen, keys) -> None:
    """``seen`` from ``conftest.record_run``: for every floating entry of ``keys``, round 2's
    message is sum_k n_k w_k / sum_k n_k over the round-1 replies."""
    r1 = [reply for rnd, _, _, reply, _ in seen if rnd == 1]
    msg2 = next(msg for rnd, _, msg, _, _ in seen if rnd == 2)
    n = [float(r.num_samples) for r in r1]
    for key in keys:
        if r1[0].weights[key].is_floating_point():
            expected = sum(nk * r.weights[key].double() for nk, r in zip(n, r1)) / sum(n)
            assert torch.allclose(msg2.weights[key].double(), expected, atol=1e-6), key
