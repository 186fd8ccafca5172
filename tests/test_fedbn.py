"""FedBN: every BatchNorm layer (affine parameters and running statistics) stays on its
client; everything else is FedAvg's."""
import pytest
import torch
from torch import nn

from protofl.algorithms.fedbn import batchnorm_prefixes
from protofl.config import load_config
from protofl.engine.simulation import Simulation

from method_checks import assert_bad_value_exits_2, assert_round_2_is_the_weighted_mean
from conftest import DIGITS, record_run, shared_data


def test_batchnorm_layers_are_found_by_type_not_by_name():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(),
                          nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.GroupNorm(1, 2))
    assert batchnorm_prefixes(model) == ("1.", "3.1.")
    assert batchnorm_prefixes(nn.Linear(2, 2)) == ()


def lenet5_mnist(tmp_path, *extra):
    root = shared_data()
    if not (root / "mnist").exists():
        pytest.skip("MNIST not present (set PROTOFL_TEST_DATA)")
    return load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1",
                                "algorithm.name=fedbn", "data.name=mnist", f"data.root={root}",
                                "data.train_size=300", "model.name=lenet5", "partition.num_clients=3",
                                "participation.fraction=1.0", "rounds=2", "training.epochs=1",
                                "eval.final_all_clients=false", *extra])


def test_batchnorm_entries_never_travel_and_the_rest_is_the_sample_weighted_mean(tmp_path):
    sim, res, seen = record_run(lenet5_mnist(tmp_path), tmp_path / "r")
    init = sim.server.init_weights()
    bn = {k for k in init if k.startswith(("body.1.", "body.5."))}  # lenet5's two BatchNorm2d
    assert len(bn) == 2 * 5  # weight, bias, running_mean, running_var, num_batches_tracked
    for _, _, msg, reply, state in seen:
        assert set(msg.weights) == set(reply.weights) == set(init) - bn
        assert set(state.weights) == bn
    # each client's statistics are its own after training, not the initial ones
    states = [s for rnd, _, _, _, s in seen if rnd == 2]
    means = [s.weights["body.1.running_mean"] for s in states]
    assert not torch.equal(means[0], means[1]) and not torch.equal(means[0], init["body.1.running_mean"])
    assert_round_2_is_the_weighted_mean(seen, set(init) - bn)
    assert "gm" not in res.rows[-1] and 0.0 <= res.rows[-1]["ga"] <= 1.0


def test_batched_executor_equals_sequential_with_local_batchnorm(tmp_path):
    cfg = lenet5_mnist(tmp_path, "eval.personal=false", "eval.every=2")
    out = {}
    for ex in ("sequential", "batched"):
        sim = Simulation(cfg.replace(**{"execution.executor": ex}), run_dir=tmp_path / ex)
        res = sim.run()
        if ex == "batched":
            assert res.summary["execution"]["executor"] == "batched", res.summary["execution"]
        out[ex] = [sim.store.get(cid).weights for cid in range(3)]
    for a, b in zip(out["sequential"], out["batched"]):
        for k in a:
            if a[k].is_floating_point():
                assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k
            else:
                assert torch.equal(a[k], b[k]), k


def test_bad_weighting_exits_2_with_one_line(tmp_path, capsys):
    assert_bad_value_exits_2("fedbn", "weighting", "median", tmp_path, capsys)
