"""The Flower ServerApp: the engine's round loop with Flower as the executor.

``main`` rebuilds the run's protofl config from the run config (``protofl-config``),
then runs the same :class:`~protofl.engine.simulation.Simulation` as ``protofl run``:
sampling, participation, ``configure``/``aggregate``, global evaluation, metrics rows,
checkpoints and the run folder all happen here, on the SuperLink's machine. Only the
clients' turns go over the network (:class:`~protofl.flower.executor.FlowerExecutor`).
With every reply arriving, the logged metrics equal an in-process run of the same
config and seed.

Unlike Flower's built-in strategies (one ArrayRecord per reply), a protofl reply carries
any number of named tensors (prototypes, class counts, weights), numbers and settings:
the method's own Record, mapped 1:1 by :mod:`protofl.flower.records`.
"""
from __future__ import annotations

from logging import INFO
from pathlib import Path
from typing import Any, Optional

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import Config
from ..engine.callbacks import Callback, short_metrics
from .project import config_from_run, CONFIG_KEY, plain_flower_logs, run_config_for, setting

plain_flower_logs()  # colours only on a terminal
app = ServerApp()


def _log(msg: str) -> None:
    from flwr.supercore import log

    log(INFO, msg)


@app.main()
def main(grid: Grid, context: Context) -> None:
    _main(grid, context)


def server_app(cfg: Config, **settings: Any) -> ServerApp:
    """A ServerApp bound to ``cfg``: for runtimes that give it no run config.

    ``flwr.simulation.run_simulation`` (Flower's Python API) starts the apps with an
    empty run config; this app then runs ``cfg`` (with the ``run_config_for`` settings,
    e.g. ``run_dir=...``) and sends it to the ClientApps in its first message::

        from flwr.simulation import run_simulation
        from protofl.flower import client_app, server_app

        run_simulation(server_app.server_app(cfg, run_dir="runs/sim"), client_app.app,
                       num_supernodes=cfg.partition.num_clients)

    A run config that carries a protofl config (``flwr run``) still takes precedence.
    """
    bound = ServerApp()
    defaults = run_config_for(cfg, **settings)

    @bound.main()
    def _bound_main(grid: Grid, context: Context) -> None:
        _main(grid, context, defaults)

    return bound


def _main(grid: Grid, context: Context, defaults: Optional[dict] = None) -> None:
    from ..api import fresh_dir
    from ..engine.simulation import Simulation
    from .executor import FlowerExecutor

    rc = {**(defaults or {}), **{k: v for k, v in context.run_config.items() if v != ""}}
    cfg = config_from_run(rc)
    resume = setting(rc, "resume")
    if setting(rc, "run-dir"):
        run_dir = Path(setting(rc, "run-dir"))
    else:  # resume continues the config's own folder; a fresh run never overwrites one
        from ..engine.simulation import run_dir_for

        run_dir = run_dir_for(cfg) if resume else fresh_dir(cfg)
    if cfg.execution.threads > 0:
        import torch

        torch.set_num_threads(cfg.execution.threads)

    def executor(sim: Simulation) -> FlowerExecutor:
        from .node_state import run_key

        # which client state the nodes use (node_state.py): the run folder's, as of the start round
        run_info = {"key": run_key(run_dir, cfg.fingerprint()), "base-round": sim.start_round - 1}
        return FlowerExecutor(grid, sim.fed.num_clients, round_timeout=setting(rc, "round-timeout"),
                              discovery_timeout=setting(rc, "discovery-timeout"),
                              poll_interval=setting(rc, "poll-interval"), log=_log,
                              config_text=str(rc[CONFIG_KEY]), run_info=run_info,
                              stop_on_nonfinite=cfg.training.on_nonfinite == "stop",
                              bind_clients=setting(rc, "bind-clients"))

    _log(f"[protofl] {cfg.algorithm.name} on {cfg.data.name}, {cfg.partition.num_clients} clients, "
         f"{cfg.rounds} rounds -> {run_dir.resolve()}")
    cfg.output.progress = False  # a progress bar in a log stream is noise; rows are logged below
    result = Simulation(cfg, run_dir=run_dir, executor_factory=executor,
                        callbacks=[_RowLogger()]).run(resume=resume)
    _log(f"[protofl] {result.summary['status']}: {result.summary['rounds_completed']} rounds -> {result.dir}")


class _RowLogger(Callback):
    """One log line per round (visible with ``flwr run --stream`` / ``flwr log``)."""

    immediate = False  # records rows only

    def on_round(self, row: dict) -> None:
        parts = [f"arrived {row['arrived']}/{row['selected']}", f"lost {row['lost']}"]
        parts += [f"{k}={v}" for k, v in short_metrics(row).items()]
        _log(f"[protofl] round {row['round']}: " + ", ".join(parts) + f", {row['wall_s']:.1f} s")
