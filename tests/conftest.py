import json
import os
from pathlib import Path

import pytest

# No test reaches the network: a dataset that is missing stops with the offline one-line
# error instead of being fetched. The fetch tests serve their files from 127.0.0.1 and
# lift this for themselves (tests/test_fetch.py).
os.environ.setdefault("PROTOFL_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """``long`` tests (longer variants of what the default suite covers) run only when the
    ``-m`` expression names them, e.g. ``pytest -m long``."""
    if "long" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a long variant: run with `pytest -m long`")
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "configs" / "digits.yaml"


def shared_data() -> Path:
    """Real datasets: $PROTOFL_TEST_DATA, else ../shared/data next to the checkout."""
    env = os.environ.get("PROTOFL_TEST_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture
def digits_cfg(tmp_path):
    """configs/digits.yaml with output in tmp, no progress bar, 1 intra-op thread."""
    from protofl.config import load_config

    def make(*overrides: str):
        return load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false",
                                    "execution.threads=1", *overrides])

    return make


@pytest.fixture
def published(monkeypatch):
    """``published(name, root)``: the catalog entry of ``name`` pinned to the checksums of
    the files a test placed under ``root`` (tiny stand-ins in the published format), so
    that the checksum check before reading (protofl.data.fetch.check_before_reading) stays
    on and passes for them. Returns the entry."""
    import hashlib
    from dataclasses import replace

    from protofl.data.catalog import CATALOG

    def pin(name: str, root: Path):
        src = CATALOG[name]
        files = tuple(replace(f, md5=hashlib.md5((Path(root) / src.folder / f.name).read_bytes()).hexdigest(),
                              sha256=None)
                      if (Path(root) / src.folder / f.name).is_file() else f for f in src.files)
        monkeypatch.setitem(CATALOG, name, replace(src, files=files))
        return CATALOG[name]

    return pin


# metrics that measure time, not results
TIMING_KEYS = {"train_s", "eval_s", "wall_s", "cpu_s"}


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def record_run(cfg, run_dir, batched: bool = False):
    """Run ``cfg`` sequentially (or on the batched executor), keeping every task's (round,
    cid, msg, reply, state).

    Returns (simulation, result, seen).
    """
    from protofl.engine.batched import BatchedExecutor
    from protofl.engine.executor import SequentialExecutor
    from protofl.engine.simulation import Simulation

    seen = []

    class Recording(BatchedExecutor if batched else SequentialExecutor):
        def run(self, tasks):
            outs = super().run(tasks)
            seen.extend((t.rnd, t.cid, t.msg, o.reply, o.state) for t, o in zip(tasks, outs))
            return outs

    ex = cfg.execution
    sim = Simulation(cfg, run_dir=run_dir, executor_factory=lambda s: (
        Recording(s.runtime, ex.batch_clients, ex.threads) if batched else Recording(s.runtime, ex.threads)))
    return sim, sim.run(), seen



def StopAfter(rnd):
    """A callback that interrupts a run after round ``rnd`` (a kill, for resume tests)."""
    from protofl.engine.callbacks import Callback

    class _StopAfter(Callback):
        def on_round(self, row):
            if row["round"] == rnd:
                raise KeyboardInterrupt

    return _StopAfter()


def recorded_update(sim, cid, rnd, msg, state, evaluating: bool = False):
    """Drive the method's ``client_update`` for client ``cid`` in round ``rnd``, keeping
    every (request, result) it awaited: (the client's result, those pairs)."""
    from protofl.engine.client import ClientContext, drive

    ctx = ClientContext(sim.runtime, cid, rnd, evaluating=evaluating)
    fits = []

    def execute(req):
        out = ctx.execute(req)
        fits.append((req, out))
        return out

    return drive(sim.algorithm.client_update(msg, state, ctx), execute), fits


def kill_and_resume(cfg, tmp_path, after: int):
    """(full, resumed): ``cfg`` run uninterrupted into ``tmp_path/full``, and the same run
    killed after round ``after`` in ``tmp_path/killed`` (its summary says "interrupted"),
    then resumed there from its last checkpoint."""
    from protofl import run
    from protofl.engine.simulation import Simulation

    full = run(cfg, run_dir=tmp_path / "full")
    d = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        Simulation(cfg, callbacks=[StopAfter(after)], run_dir=d).run()
    assert json.loads((d / "summary.json").read_text())["status"] == "interrupted"
    return full, Simulation(cfg, run_dir=d).run(resume=True)


def worker_path_executor(sim, workers: int = 2):
    """The process workers' code path, in this process: ``execution.workers`` without the processes.

    What :class:`~protofl.engine.executor.ProcessExecutor` does, minus the spawning: the method
    is shipped as the pool ships it (``ship_to_workers``), the config, data and task info are
    pickled, and each of ``workers`` stand-in workers builds its own runtime from them with
    the workers' initializer. Tasks go largest client first, dealt round-robin to the
    stand-ins, and every task and reply crosses as pickled bytes through the workers' own
    entry point. A method that keeps state outside its messages, or whose objects do not
    survive pickling, gives other results than the sequential executor.
    """
    import pickle

    from protofl.engine import executor as ex

    rt = sim.runtime
    shipped = ex.ship_to_workers(rt)
    init_args = pickle.dumps((rt.cfg, rt.fed, rt.info), protocol=pickle.HIGHEST_PROTOCOL)

    class WorkerPath(ex.Executor):
        def __init__(self):
            self.runtimes = []
            for _ in range(workers):
                cfg, fed, info = pickle.loads(init_args)
                ex._init_worker(cfg, fed, shipped, info)  # sets ex._WORKER
                self.runtimes.append(ex._WORKER)
            ex._WORKER = None

        def run(self, tasks):
            sizes = [len(rt.fed.train_idx[t.cid]) for t in tasks]
            order = sorted(range(len(tasks)), key=lambda i: -sizes[i])
            outs = {}
            for k, i in enumerate(order):
                ex._WORKER = self.runtimes[k % workers]
                try:
                    outs[i] = pickle.loads(ex._run_task(pickle.dumps(tasks[i], protocol=pickle.HIGHEST_PROTOCOL)))
                finally:
                    ex._WORKER = None
            return [outs[i] for i in range(len(tasks))]

    return WorkerPath()
