"""The shared check suite: every registered method must pass it.

Runs each method for 2 rounds on configs/digits.yaml (as `protofl run ... algorithm.name=<m>
rounds=2` does) and checks the messages, determinism and metrics.
"""
import math
import re

import pytest
import torch

from protofl.algorithms import ALGORITHMS
from protofl.engine.simulation import Simulation
from protofl.messages import Record

from conftest import record_run, StopAfter, strip_timing, worker_path_executor


def test_every_method_has_a_family_and_the_readme_table_names_none_wrongly():
    """The README's table is an overview read against the registry: every method it names
    is registered, under the family it has there (a method added since need not be in it:
    adding one is its module and its test; `protofl list` names them all)."""
    from conftest import REPO
    from protofl.algorithms.base import FAMILIES, by_family

    table = {}
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("| ") and "`" in line and line.split("|")[1].strip() in FAMILIES:
            family, names = line.split("|")[1:3]
            # the registry names in backticks (not a setting such as `algorithm.server_opt`)
            table[family.strip()] = {n for n in names.split("`")[1::2] if re.fullmatch(r"[a-z][a-z0-9_]*", n)}
    registered = by_family(ALGORITHMS.names())
    for family, names in registered.items():
        assert family in FAMILIES and family != "other", (family, names)
    assert table and set(table) <= set(registered)
    for family, names in table.items():
        assert names <= set(registered[family]), (family, names - set(registered[family]))


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_two_rounds_on_digits(name, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2")
    sim, res, seen = record_run(cfg, tmp_path / "a")
    assert res.summary["status"] == "complete" and len(res.rows) == 2
    algo = ALGORITHMS.get(name)
    for row in res.rows:
        assert row["arrived"] > 0 and math.isfinite(row["train_loss"])
        # an honest client's reply passes the server's checks (engine/validate.py)
        assert row["rejected"] == 0, row.get("rejected_reasons")
        assert ("gm" in row) == algo.has_global_model
        assert 0.0 <= row["pa"] <= 1.0
    for key in ("pm_v", "pm_l", "acc", "ga"):  # full-test personalized metrics: the last round
        assert 0.0 <= res.rows[-1][key] <= 1.0, (key, res.rows[-1][key])
    # messages, replies and client states are transport-agnostic Records
    assert seen
    for _, cid, msg, reply, state in seen:
        assert isinstance(msg, Record) and isinstance(reply, Record)
        assert state is None or isinstance(state, Record)
        for rec in (msg, reply):
            assert all(isinstance(t, torch.Tensor) for _, t in rec.tensors())
            assert all(isinstance(v, torch.Tensor) or all(isinstance(t, torch.Tensor) for t in v.values())
                       for v in rec.arrays.values())  # a tensor, or a group of them
        assert reply.num_samples == len(sim.fed.train_idx[cid])  # the engine attaches n_k
    # same seed -> identical results, also through the process workers' code path (the
    # method shipped and every task and reply pickled, two stand-in workers, largest client
    # first; tests/test_speed_invariance.py runs real worker processes), and when the run is
    # killed in round 2 (before its checkpoint) and resumed from round 1's: the server state,
    # the client states (clients 2, 3 and 9 are sampled in both rounds) and the generators
    # come back. The every-client evaluation after the last round left out: the rounds are the point
    cfg_b = cfg.replace(**{"eval.final_all_clients": False, "output.checkpoint_every": 1})
    with pytest.raises(KeyboardInterrupt):
        Simulation(cfg_b, run_dir=tmp_path / "b", callbacks=[StopAfter(2)], executor_factory=worker_path_executor).run()
    resumed = Simulation(cfg_b, run_dir=tmp_path / "b", executor_factory=worker_path_executor)
    again = resumed.run(resume=True)
    assert resumed.start_round == 2
    assert strip_timing(again.rows) == [{k: v for k, v in r.items() if not k.startswith("all_")}
                                        for r in strip_timing(res.rows)]


# ---------------------------------------------------------------------------------------
# both executors: every method's update, stated once, run client by client and as a stack
# ---------------------------------------------------------------------------------------
# methods the batched executor runs one client after another on this setting, and the
# reason its note gives (none today: every registered method batches on a homogeneous model)
FALLBACKS: dict[str, str] = {}


def float_tensors(sim, res) -> dict[str, torch.Tensor]:
    """Every tensor of the server state and of the clients' stored states, by path."""
    out: dict[str, torch.Tensor] = {}

    def walk(path, o):
        if isinstance(o, torch.Tensor):
            out[path] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(f"{path}.{k}", v)
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(f"{path}[{i}]", v)
        elif hasattr(o, "__dict__"):
            walk(path, vars(o))

    walk("server", res.server_state)
    for cid in range(sim.fed.num_clients):
        state = sim.store.get(cid)
        if state is not None:
            walk(f"client{cid}", {"weights": state.weights, "arrays": state.arrays})
    return out


def non_finite(sim, res) -> list[str]:
    """The paths of :func:`float_tensors` that hold a NaN or an infinity."""
    return [k for k, t in float_tensors(sim, res).items() if t.is_floating_point() and not bool(t.isfinite().all())]


def to64(tree):
    """A nested dict of tensors with its floating ones in float64."""
    return {k: to64(v) if isinstance(v, dict) else (v.double() if v.is_floating_point() else v)
            for k, v in tree.items()}


def separability(monkeypatch) -> list[tuple[str, float, float]]:
    """Wraps the sequential driver: before each ``ctx.fit`` of a client with a few samples,
    (loss, its value on the client's first 5 samples, the mean of its values on each of them
    alone), in float64 on copies of the model and extras, the torch stream left as it was.
    A method that does not declare ``couples_samples`` promises that the two are equal."""
    import copy

    import protofl.engine.client as client
    seen: list[tuple[str, float, float]] = []
    real = client.fit

    def checked(model, x, y, *, loss, extras, per_step=None, **kw):
        if per_step is None and len(y) >= 2 and x.is_floating_point():  # per-step rows: FedGen's, below
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                m, ex, xb, yb = copy.deepcopy(model).double(), to64(extras), x[:5].double(), y[:5]
                whole = loss(m, xb, yb, ex)
                alone = torch.stack([loss(m, xb[i:i + 1], yb[i:i + 1], ex) for i in range(len(yb))]).mean()
            seen.append((getattr(loss, "__qualname__", repr(loss)), float(whole), float(alone)))
        return real(model, x, y, loss=loss, extras=extras, per_step=per_step, **kw)

    monkeypatch.setattr(client, "fit", checked)
    return seen


# the padded comparison runs these with a setting changed, and why
PADDED_SETTINGS = {
    # eq. 7's cosines / tau with tau = 0.02 multiply the summation order's rounding by 50
    # through exp: measured 5e-6 on the weights and 1.7e-5 on the FINCH pool at 0.02, 1e-7 at 0.5
    "fpl": ["algorithm.tau=0.5"],
}


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_batched_equals_sequential(name, digits_cfg, tmp_path, monkeypatch):
    # 4 clients of different sizes, all sampled; batch 24: they take different numbers of
    # steps and end their epochs on smaller batches, so the stack refills its slots. The
    # batched run pads the short batches (execution.pad_batches) unless the method couples
    # its samples: each client's loss is then the weighted mean of its samples' losses
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.num_clients=4", "partition.beta=0.2",
                     "training.batch_size=24", "participation.fraction=1.0", "eval.final_all_clients=false",
                     *PADDED_SETTINGS.get(name, []))
    coupled = ALGORITHMS.get(name).couples_samples
    seen = [] if coupled else separability(monkeypatch)
    got = {}
    for ex in ("sequential", "batched"):
        sim = Simulation(cfg.replace(**{"execution.executor": ex, "execution.pad_batches": True}), run_dir=tmp_path / ex)
        res = sim.run()
        got[ex] = (res, float_tensors(sim, res))
        monkeypatch.undo()
    for loss, whole, alone in seen:  # not couples_samples: each loss is a mean over its samples
        assert math.isclose(whole, alone, rel_tol=1e-9, abs_tol=1e-12), (loss, whole, alone)
    assert coupled or seen
    (seq, a), (bat, b) = got["sequential"], got["batched"]
    mode = bat.summary["execution"]
    if name in FALLBACKS:
        assert mode["executor"] == "sequential" and FALLBACKS[name] in mode["executor_note"]
    else:
        assert mode["executor"] == "batched", mode.get("executor_note")
        assert 0.0 < mode["occupancy"] <= 1.0
        assert mode["padded"] is not coupled
    assert a.keys() == b.keys() and a
    for k in a:
        if a[k].is_floating_point():  # equal up to float rounding: <= 1e-5 relative, tensor by tensor
            err = float((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp(min=1e-12))
            assert err <= 1e-5, (k, err)
        else:
            assert torch.equal(a[k], b[k]), k  # counts, BatchNorm's num_batches_tracked
    assert [r["train_samples"] for r in seq.rows] == [r["train_samples"] for r in bat.rows]
    for ra, rb in zip(seq.rows, bat.rows):
        assert math.isclose(ra["train_loss"], rb["train_loss"], rel_tol=1e-5)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_takes_a_client_without_data_on_both_executors(name, digits_cfg, tmp_path):
    # Dirichlet(0.01) over 8 clients leaves client 3 without a sample: it is sampled, trains
    # nothing, and its reply (n_k = 0) must pass the checks and leave no NaN in the server state
    # (ctx.features answers it (0, d), as for any other client); 2 steps a round: the empty
    # client is the point, not the training
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.name=dirichlet", "partition.beta=0.01",
                     "partition.num_clients=8", "partition.min_size=0", "participation.fraction=1.0",
                     "training.steps=2", "eval.final_all_clients=false")
    for ex in ("sequential", "batched"):
        sim, res, seen = record_run(cfg, tmp_path / ex, batched=ex == "batched")
        assert [k for k in range(8) if len(sim.fed.train_idx[k]) == 0] == [3]
        assert res.summary["status"] == "complete" and all(row["rejected"] == 0 for row in res.rows), ex
        assert {rnd for rnd, cid, _, reply, _ in seen if cid == 3 and reply.num_samples == 0} == {1, 2}
        assert not non_finite(sim, res), (ex, non_finite(sim, res))


# methods that refuse a model reading token ids, and the words of their one-line error
REFUSE_TOKENS = {"fedbr": "needs real-valued inputs"}


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_on_token_ids_and_an_lstm(name, digits_cfg, tmp_path, monkeypatch):
    # 120 random sequences of 12 token ids, 4 classes, a one-layer LSTM: every method runs
    # (or refuses in one line); the batched executor asked for runs the clients one after
    # another, saying why (vmap has no rule for the fused LSTM: ctx.features failed under it)
    from protofl.config import ConfigError
    from protofl.data.dataset import Dataset
    from protofl.data.datasets import DATASETS

    def tokens(root, seed):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randint(0, 80, (120, 12), generator=g), torch.arange(120) % 4
        return Dataset("tokens", x, y, x[:40].clone(), y[:40].clone(), num_classes=4, kind="tokens")

    monkeypatch.setitem(DATASETS._items, "tokens", tokens)
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "data.name=tokens", "partition.name=iid",
                     "partition.num_clients=3", "participation.fraction=1.0", "model.name=lstm_shakespeare",
                     "model.hidden=8", "model.num_layers=1", "training.steps=2", "execution.executor=batched")
    if name in REFUSE_TOKENS:
        with pytest.raises(ConfigError, match=REFUSE_TOKENS[name]):
            Simulation(cfg, run_dir=tmp_path).run()
        return
    sim = Simulation(cfg, run_dir=tmp_path)
    res = sim.run()
    assert res.summary["status"] == "complete"
    mode = res.summary["execution"]
    assert mode["executor"] == "sequential" and "recurrent layer" in mode["executor_note"], mode
    assert not non_finite(sim, res) and all(0.0 <= r["pa"] <= 1.0 for r in res.rows), non_finite(sim, res)
