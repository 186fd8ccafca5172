"""Every method under the conditions a user can create that the shared suite
(tests/test_algorithms_common.py) does not: rounds where nobody is sampled or nobody
arrives, one client a round, one class a client, a batch of one, Adam on both executors,
every privacy mode, heterogeneous models, real worker processes, and a kill and resume
compared tensor by tensor.

``long``: each test runs every registered method (about 13 minutes in all on 2 busy cores);
run them with ``pytest -m long tests/test_conditions.py`` after adding a method or
changing the engine. Each test collects every method that fails and names them all.
A condition a method cannot meet is refused up front in one line (a ``ConfigError``);
anything else that stops a run is a failure.
"""
import math

import pytest
import torch

from protofl.algorithms import ALGORITHMS
from protofl.config import ConfigError
from protofl.engine.simulation import Simulation

from conftest import StopAfter, strip_timing
from test_algorithms_common import float_tensors, non_finite

pytestmark = pytest.mark.long

METHODS = ALGORITHMS.names()


def sweep(check) -> None:
    """``check(name)`` for every method; one assertion naming every method that failed."""
    failed = {}
    for name in METHODS:
        try:
            problem = check(name)
        except Exception as e:  # noqa: BLE001 -- any error is this method's failure, named below
            problem = f"{type(e).__name__}: {e}"
        if problem:
            failed[name] = str(problem)[:300]
    assert not failed, failed


def completes(digits_cfg, tmp_path, *overrides, refusals: dict[str, str] = {}):
    """A check: the run completes with finite states and a PA in [0, 1], or (for the
    methods in ``refusals``) is refused up front in one line with those words."""
    def check(name):
        try:
            cfg = digits_cfg(f"algorithm.name={name}", "eval.final_all_clients=false", *overrides)
            sim = Simulation(cfg, run_dir=tmp_path / name)
            res = sim.run()
        except ConfigError as e:
            ok = name in refusals and refusals[name] in str(e) and "\n" not in str(e)
            return None if ok else f"refused: {e}"
        if name in refusals:
            return "ran, where it should refuse"
        if res.summary["status"] != "complete":
            return res.summary
        bad = non_finite(sim, res)
        pa = [r["pa"] for r in res.rows if "pa" in r]
        return bad or (None if all(0.0 <= p <= 1.0 for p in pa) else f"pa {pa}")
    return check


def test_rounds_where_nobody_is_sampled_or_nobody_arrives(digits_cfg, tmp_path):
    # Poisson sampling of 4 clients at q = 0.5 with replies arriving at p = 0.3: rounds 1-5
    # sample (1, 3, 0, 1, 3) clients and (0, 1, 0, 0, 2) arrive (seed 0)
    sweep(completes(digits_cfg, tmp_path, "rounds=5", "partition.num_clients=4", "participation.fraction=0.5",
                    "participation.sampling=poisson", "participation.p=0.3", "eval.personal_every=1"))


def test_one_client_a_round_with_clients_without_data(digits_cfg, tmp_path):
    sweep(completes(digits_cfg, tmp_path, "rounds=3", "partition.num_clients=6", "partition.beta=0.05",
                    "partition.min_size=0", "participation.clients_per_round=1", "eval.personal_every=1"))


def test_one_class_a_client(digits_cfg, tmp_path):
    # no negatives for a contrastive loss, one prototype a client, a one-class softmax prior
    sweep(completes(digits_cfg, tmp_path, "rounds=2", "partition.num_clients=6", "participation.fraction=1.0",
                    "partition.name=pathological", "partition.classes_per_client=1"))


def test_a_batch_of_one(digits_cfg, tmp_path):
    # batch statistics of one sample (FedDecorr's correlation, FedUV's spread, MOON's negatives)
    sweep(completes(digits_cfg, tmp_path, "rounds=2", "partition.num_clients=6", "participation.fraction=1.0",
                    "training.batch_size=1", "training.steps=3"))


def test_heterogeneous_models_run_or_are_refused_in_one_line(digits_cfg, tmp_path):
    runs = {"fedproto", "fedpcl", "fedgh", "fedtgp", "feddistill", "local"}  # they exchange no weights
    refusals = {n: "must share one architecture" for n in METHODS if n not in runs}
    sweep(completes(digits_cfg, tmp_path, "rounds=2", "partition.num_clients=4", "participation.fraction=1.0",
                    "model.per_client={hidden: [[16], [24]]}", refusals=refusals))


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_every_privacy_mode_runs_or_is_refused_in_one_line(mode, digits_cfg, tmp_path):
    def check(name):
        for ex in ("sequential", "batched"):
            try:
                cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.num_clients=4",
                                 "participation.fraction=1.0", f"privacy.mode={mode}", "privacy.noise_multiplier=0.5",
                                 f"execution.executor={ex}", "eval.final_all_clients=false")
                sim = Simulation(cfg, run_dir=tmp_path / f"{name}-{ex}")
                res = sim.run()
            except ConfigError as e:
                if "\n" in str(e):
                    return f"a refusal of more than one line: {e}"
                continue
            eps = res.rows[-1].get("epsilon")
            if res.summary["status"] != "complete" or non_finite(sim, res) or not (eps and math.isfinite(eps)):
                return (ex, res.summary["status"], non_finite(sim, res), eps)
        return None
    sweep(check)


def test_adam_gives_the_same_run_on_both_executors(digits_cfg, tmp_path):
    def check(name):
        got = {}
        for ex in ("sequential", "batched"):
            try:
                cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.num_clients=4", "partition.beta=0.2",
                                 "training.batch_size=24", "participation.fraction=1.0", "training.optimizer=adam",
                                 "training.momentum=0", "training.lr=0.001", f"execution.executor={ex}",
                                 "eval.final_all_clients=false")
                sim = Simulation(cfg, run_dir=tmp_path / f"{name}-{ex}")
                got[ex] = float_tensors(sim, sim.run())
            except ConfigError as e:  # FedNova's normalization is SGD's
                return None if name == "fednova" and "adam" in str(e) else f"refused: {e}"
        a, b = got["sequential"], got["batched"]
        worse = {k: float((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp(min=1e-12))
                 for k in a if a[k].is_floating_point()}
        worse = {k: e for k, e in worse.items() if e > 1e-5}
        return worse or (None if a.keys() == b.keys() else "different states")
    sweep(check)


def test_real_worker_processes_give_the_same_run(digits_cfg, tmp_path):
    def check(name):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "partition.num_clients=6",
                         "participation.fraction=0.5", "eval.final_all_clients=false")
        ref = Simulation(cfg, run_dir=tmp_path / f"{name}-seq").run()
        got = Simulation(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / f"{name}-wk").run()
        return None if strip_timing(got.rows) == strip_timing(ref.rows) else "rows differ"
    sweep(check)


def test_a_resumed_run_has_every_state_tensor_of_an_uninterrupted_one(digits_cfg, tmp_path):
    # 4 rounds, checkpoints after rounds 2 and 4, killed in round 3: rounds 3-4 are redone
    def check(name):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=4", "output.checkpoint_every=2",
                         "partition.num_clients=6", "eval.personal_every=1")
        full_sim = Simulation(cfg, run_dir=tmp_path / f"{name}-full")
        full = full_sim.run()
        with pytest.raises(KeyboardInterrupt):
            Simulation(cfg, callbacks=[StopAfter(3)], run_dir=tmp_path / f"{name}-k").run()
        sim = Simulation(cfg, run_dir=tmp_path / f"{name}-k")
        res = sim.run(resume=True)
        if sim.start_round != 3 or strip_timing(res.rows) != strip_timing(full.rows):
            return f"rows differ (resumed at {sim.start_round})"
        a, b = float_tensors(full_sim, full), float_tensors(sim, res)
        return [k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])]
    sweep(check)
