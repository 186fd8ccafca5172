"""execution.pack_runs: a sweep's runs in one process, their clients in shared stacks.

Every run must compute what it computes alone (with the batched executor), bit for bit;
a run that fails stops alone; resume is per run."""
import json

import pytest
import torch

from protofl.api import parse_methods
from protofl.config import load_config
from protofl.engine.simulation import Simulation
from protofl.sweeps import sweep

from conftest import DIGITS, TIMING_KEYS


def small(tmp_path, *overrides):
    return load_config(DIGITS, ["rounds=3", "execution.executor=batched", "output.progress=false", "execution.threads=1",
                                "partition.num_clients=6", "participation.fraction=0.5", "training.clip_grad=5",
                                "output.checkpoint_every=1", f"output.dir={tmp_path}", *overrides])


def rows(d):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (d / "metrics.jsonl").read_text().splitlines()]


def same_runs(a_dir, b_dir, names):
    for name in names:
        assert rows(a_dir / name) == rows(b_dir / name), name
        wa, wb = torch.load(a_dir / name / "model.pt"), torch.load(b_dir / name / "model.pt")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name


def done(out):
    return sorted(p.name for p in out.iterdir() if (p / "summary.json").exists())


def test_packed_runs_equal_the_same_runs_one_by_one_bit_for_bit(tmp_path):
    cfg, methods = small(tmp_path), parse_methods("fedavg,fedprox(mu=0.1)")
    _, packed, failed = sweep(cfg.replace(**{"execution.pack_runs": True}), {}, [0, 1], tmp_path / "packed",
                              methods=methods, log=lambda m: None)
    _, alone, _ = sweep(cfg, {}, [0, 1], tmp_path / "alone", methods=methods, jobs=1, log=lambda m: None)
    names = done(alone)
    assert not failed and len(names) == 4 and done(packed) == names
    same_runs(alone, packed, names)
    execution = json.loads((packed / names[0] / "summary.json").read_text())["execution"]
    assert execution["executor"] == "batched" and execution["packed_runs"] == 4


def test_a_run_that_diverges_stops_alone(tmp_path):
    lines = []
    cfg = small(tmp_path, "training.clip_grad=null").replace(**{"execution.pack_runs": True})
    _, out, failed = sweep(cfg, {"training.lr": [0.05, 1e30]}, [0], tmp_path / "packed",
                           methods=parse_methods("fedavg,fedprox(mu=0.1)"), log=lines.append)
    assert sorted(r.label for r in failed) == ["fedavg lr=1e+30", "fedprox lr=1e+30"]
    assert sum(x.startswith("[diverged]") and "non-finite training loss" in x for x in lines) == 2
    status = {r: json.loads((out / r / "summary.json").read_text())["status"] for r in done(out)}
    assert sorted(status.values()) == ["complete", "complete", "diverged", "diverged"]
    ok = [r for r in done(out) if status[r] == "complete"]  # the other two finished every round
    # the sweep again: a diverged run is a result (it would diverge again), skipped and named
    again = []
    _, _, failed2 = sweep(cfg, {"training.lr": [0.05, 1e30]}, [0], out,
                          methods=parse_methods("fedavg,fedprox(mu=0.1)"), log=again.append)
    assert sorted(r.label for r in failed2) == ["fedavg lr=1e+30", "fedprox lr=1e+30"]
    assert sum(x.startswith("[skip") and ": diverged (non-finite training loss" in x for x in again) == 2
    assert sum(x.startswith("[skip") and ": complete in" in x for x in again) == 2
    assert not any(x.startswith(("[run", "[resume", "[pack")) for x in again)
    _, alone, _ = sweep(small(tmp_path, "training.clip_grad=null", "training.lr=0.05"), {}, [0], tmp_path / "alone",
                        methods=parse_methods("fedavg,fedprox(mu=0.1)"), jobs=1, log=lambda m: None)
    for name in done(alone):  # equal to the runs alone: the failed runs took nothing with them
        packed_name = next(n for n in ok if n.split("-s0-")[0].startswith(name.split("-s0-")[0]))
        assert rows(alone / name) == rows(out / packed_name)


def test_an_interrupted_pack_resumes_each_run_from_its_own_checkpoint(tmp_path, monkeypatch):
    cfg, methods = small(tmp_path).replace(**{"execution.pack_runs": True}), parse_methods("fedavg,fednh")
    run_round = Simulation.run_round

    def interrupted(self, rnd, *a, **kw):
        if rnd == 3 and self.cfg.algorithm.name == "fednh" and self.cfg.seed == 1:
            raise KeyboardInterrupt
        return run_round(self, rnd, *a, **kw)

    monkeypatch.setattr(Simulation, "run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep(cfg, {}, [0, 1], tmp_path / "packed", methods=methods, log=lambda m: None)
    summaries = [json.loads((p / "summary.json").read_text()) for p in (tmp_path / "packed").iterdir()
                 if (p / "summary.json").exists()]
    assert {s["status"] for s in summaries} == {"interrupted"}  # every run in flight recorded it
    monkeypatch.undo()
    _, packed, failed = sweep(cfg, {}, [0, 1], tmp_path / "packed", methods=methods, log=lambda m: None)
    _, alone, _ = sweep(small(tmp_path), {}, [0, 1], tmp_path / "alone", methods=methods, jobs=1, log=lambda m: None)
    assert not failed
    same_runs(alone, packed, done(alone))


def test_a_run_that_fails_on_the_one_by_one_path_stops_alone_with_its_error(tmp_path, monkeypatch):
    """A packed run whose clients cannot be stacked (dropout, an LSTM) runs one client after
    another inside the pack; its failure is its own result, as on the stacked path (the
    error was lost there: the run went on as if none of its clients had replied)."""
    import protofl.engine.batched as batched

    stackable = batched.why_not_batched
    monkeypatch.setattr(batched, "why_not_batched", lambda rt: "one by one here" if rt.cfg.training.lr > 1
                        else stackable(rt))
    lines = []
    cfg = small(tmp_path, "training.clip_grad=null").replace(**{"execution.pack_runs": True})
    _, out, failed = sweep(cfg, {"training.lr": [0.05, 1e30]}, [0], tmp_path / "packed",
                           methods=parse_methods("fedavg"), log=lines.append)
    assert [r.label for r in failed] == ["fedavg lr=1e+30"]
    status = sorted(json.loads((out / r / "summary.json").read_text())["status"] for r in done(out))
    assert status == ["complete", "diverged"]
    assert sum(x.startswith("[diverged]") and "non-finite training loss" in x for x in lines) == 1


def test_packed_runs_that_differ_in_augmentation_train_as_they_would_alone(tmp_path):
    """A stack applies one augmentation: packed runs with and without one train in different
    stacks, each as it would alone (job 0's augmentation was applied to every run)."""
    cfg = small(tmp_path)
    grid = {"data.augment": [{}, {"flip": True, "crop": 1}]}
    _, packed, failed = sweep(cfg.replace(**{"execution.pack_runs": True}), grid, [0], tmp_path / "packed",
                              methods=parse_methods("fedavg"), log=lambda m: None)
    _, alone, _ = sweep(cfg, grid, [0], tmp_path / "alone", methods=parse_methods("fedavg"), jobs=1,
                        log=lambda m: None)
    names = done(alone)
    assert not failed and len(names) == 2 and done(packed) == names
    same_runs(alone, packed, names)


def test_packed_runs_under_dp_sgd_stack_only_with_their_own_noise(tmp_path, monkeypatch):
    """DP-SGD's noise multiplier is one per stack: packed runs whose calibrated sigmas differ
    (targets 2 and 8, the same configured noise_multiplier) never share one (job 0's sigma
    was used for every run of the stack)."""
    from protofl.engine.batched import BatchedExecutor

    fit, seen = BatchedExecutor._fit, []

    def spy(self, jobs):
        seen.append({j.ctx.privacy.sigma for j in jobs})
        return fit(self, jobs)

    monkeypatch.setattr(BatchedExecutor, "_fit", spy)
    cfg = small(tmp_path, "privacy.mode=sample", "privacy.clip=1.0", "privacy.calibrate=true", "privacy.target_epsilon=4",
                "rounds=1").replace(
        **{"execution.pack_runs": True})
    _, _, failed = sweep(cfg, {"privacy.target_epsilon": [2.0, 8.0]}, [0], tmp_path / "packed",
                         methods=parse_methods("fedavg"), log=lambda m: None)
    assert not failed
    assert seen and all(len(s) == 1 for s in seen) and len(set().union(*seen)) == 2


def test_packed_compiled_runs_with_batchnorm_train_it_in_training_mode(tmp_path, monkeypatch):
    """execution.compile with packed runs: one compiled step serves every stack of its
    signature less the learning rate, whichever run's, and was built over the first stack's
    model object (each run has its own). BatchNorm reads that object's training flag: it
    must be in training mode whoever's stack steps, even once its own run has stopped (here
    it diverges at once), or the other runs would train on running statistics. Each run's
    model is left in eval mode between stacks, as evaluation may leave it. torch.compile is
    the identity (what is tested is the module the step runs, not the compiler)."""
    from protofl.engine.batched import BatchedExecutor
    from protofl.models import MODELS
    from test_gpu_execution import _tiny_bn_cnn

    monkeypatch.setitem(MODELS._items, "tiny_bn_cnn", _tiny_bn_cnn)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    seen, fit = [], BatchedExecutor._fit

    def fit_then_eval(self, jobs):
        seen.extend(j.ctx.architecture for j in jobs)
        try:
            return fit(self, jobs)
        finally:
            for m in seen:
                m.eval()
    monkeypatch.setattr(BatchedExecutor, "_fit", fit_then_eval)
    cfg = small(tmp_path, "model.name=tiny_bn_cnn", "training.clip_grad=null").replace(**{"execution.compile": True})
    methods = parse_methods("fedavg")
    _, packed, failed = sweep(cfg.replace(**{"execution.pack_runs": True}), {"training.lr": [1e30, 0.01]}, [0],
                              tmp_path / "packed", methods=methods, log=lambda m: None)
    assert [r.label for r in failed] == ["fedavg lr=1e+30"]
    (name,) = [n for n in done(packed) if json.loads((packed / n / "summary.json").read_text())["status"] == "complete"]
    _, alone, _ = sweep(small(tmp_path, "model.name=tiny_bn_cnn", "training.clip_grad=null", "training.lr=0.01").replace(
        **{"execution.compile": True}), {}, [0], tmp_path / "alone", methods=methods, jobs=1, log=lambda m: None)
    (other,) = done(alone)
    # within float rounding: the stacks' grouped convolutions differ in their slot counts
    for a, b in zip(rows(alone / other), rows(packed / name), strict=True):
        assert a["train_samples"] == b["train_samples"] and abs(a["train_loss"] - b["train_loss"]) < 1e-5, (a, b)
    wa, wb = torch.load(alone / other / "model.pt"), torch.load(packed / name / "model.pt")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)


def test_packed_runs_that_differ_in_epochs_or_learning_rate_share_one_compiled_step(tmp_path, monkeypatch):
    """The compiled step does not read the epochs or the learning rate (an input of it): packed
    runs that differ only in them train in stacks of their own, compiled once between them."""
    compiled: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    cfg = small(tmp_path).replace(**{"execution.compile": True, "execution.pack_runs": True})
    _, out, failed = sweep(cfg, {"training.epochs": [1, 2], "training.lr": [0.05, 0.02]}, [0], tmp_path / "packed",
                           methods=parse_methods("fedavg"), log=lambda m: None)
    assert not failed and len(done(out)) == 4 and len(compiled) == 1
