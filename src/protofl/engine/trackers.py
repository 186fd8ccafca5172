"""Experiment trackers as callbacks, chosen in the config::

    output:
      trackers: [tensorboard, mlflow, wandb]
      tracking_uri: null   # MLflow: null = a local SQLite store, <output.dir>/mlflow.db
      experiment: protofl  # MLflow experiment name; W&B project

Each tracker records the resolved config (TensorBoard: as text; MLflow: as params with
dotted names, ``training.lr``; W&B: as its nested config), every numeric metric of every
round at step = round (per-class lists as ``<metric>/<class>``), and at the end the
summary, the config and any ``report.*`` of the run folder (MLflow: as artifacts;
TensorBoard: the summary as text; W&B: the run summary, the files saved with the run).
Each is an optional extra: ``pip install 'protofl[tensorboard]'`` / ``'protofl[mlflow]'``
/ ``'protofl[wandb]'``; asking for one that is not installed is a config error.

W&B runs online by default (after ``wandb login``); ``WANDB_MODE=offline`` keeps
everything in the run folder (``<run>/wandb/offline-run-*``) for ``wandb sync`` later.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ..run_folder import CONFIG, SUCCEEDED, SUMMARY
from ..config.machine import check_trackers, TRACKERS  # noqa: F401  (re-exported)
from ..errors import ConfigError, one_line
from .callbacks import Callback

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

    from ..config import Config

log = logging.getLogger("protofl")

_BAD = re.compile(r"[^\w\-. /]")


def metric_items(row: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """Every numeric metric of a row, lists as ``name/i``, names safe for MLflow."""
    for k, v in row.items():
        if k == "round" or isinstance(v, bool):
            continue
        name = _BAD.sub("_", k)
        if isinstance(v, (int, float)):
            if not math.isnan(v):
                yield name, float(v)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x):
                    yield f"{name}/{i}", float(x)


def flat_params(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as ``{"training.lr": "0.05", ...}`` (lists as their JSON text)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v)
    return out


def _reports(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("report.*") if p.is_file())


class TensorBoardTracker(Callback):
    """Event files in the run folder: ``tensorboard --logdir <output.dir>`` shows every run."""

    immediate = False  # records rows only

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.writer: Optional[SummaryWriter] = None

    def on_start(self, info: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=info["dir"])
        self.writer.add_text("config", "```yaml\n" + self.cfg.to_yaml() + "```", global_step=info["start_round"] - 1)

    def on_round(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name, v in metric_items(row):
            self.writer.add_scalar(name, v, global_step=row["round"])
        self.writer.flush()

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.writer is None:
            return
        text = json.dumps({k: v for k, v in summary.items() if k != "final"}, indent=1, default=str)
        self.writer.add_text("summary", "```json\n" + text + "\n```", global_step=summary.get("rounds_completed", 0))
        self.writer.close()
        self.writer = None


class MLflowTracker(Callback):
    """One MLflow run per protofl run: params, per-round metrics, artifacts at the end."""

    immediate = False  # records rows only

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        out = cfg.output
        root = Path(out.dir).resolve()
        # MLflow 3 keeps its file store in maintenance mode and refuses it by default: the
        # local default is therefore its recommended SQLite store, artifacts beside it
        self.uri = out.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.artifacts = None if out.tracking_uri else (root / "mlartifacts").as_uri()
        self.experiment = out.experiment
        self.client: Optional[MlflowClient] = None
        self.run_id: Optional[str] = None
        self.dir: Optional[Path] = None

    def experiment_id(self) -> str:
        """The experiment's id, creating the store and the experiment on first use."""
        from mlflow.tracking import MlflowClient

        if self.client is None:
            self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        return self.client.create_experiment(self.experiment, artifact_location=self.artifacts)

    def on_start(self, info: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.dir = Path(info["dir"])
        exp_id = self.experiment_id()
        assert self.client is not None  # experiment_id() made it
        run = self.client.create_run(exp_id, run_name=info["name"], tags={
            "protofl.fingerprint": self.cfg.fingerprint(), "protofl.dir": str(self.dir.resolve()),
            "protofl.start_round": str(info["start_round"])})
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_params(self.cfg.to_dict()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def on_round(self, row: dict[str, Any]) -> None:
        if self.client is None:
            return
        assert self.run_id is not None  # on_start set it
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, row["round"]) for k, v in metric_items(row)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.client is None:
            return
        assert self.run_id is not None and self.dir is not None  # on_start set them
        self.client.log_dict(self.run_id, summary, SUMMARY)
        for p in [self.dir / CONFIG, *_reports(self.dir)]:
            if p.exists():
                self.client.log_artifact(self.run_id, str(p))
        status = summary.get("status")  # stopped (privacy.target_epsilon reached) finished too
        status = "FINISHED" if status in SUCCEEDED else "KILLED" if status == "interrupted" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)
        self.client = None


class WandbTracker(Callback):
    """One Weights & Biases run per protofl run, in project ``output.experiment``.

    Its files go to the run folder (``<run>/wandb``). The W&B run id is derived from the
    run folder and the config's fingerprint, so online a ``--resume`` continues the same
    W&B run (rounds the checkpoint did not count are logged again, with equal values);
    offline each session is its own offline run of that id, which ``wandb sync`` merges.
    W&B's own console output is silenced: protofl's progress and errors stay readable.
    """

    immediate = False  # records rows only

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run: Optional[Run] = None
        self.dir: Optional[Path] = None

    def on_start(self, info: dict[str, Any]) -> None:
        import wandb

        self.dir = Path(info["dir"])
        key = f"{self.dir.resolve()}|{self.cfg.fingerprint()}"
        try:
            mode = wandb.setup().settings.mode
            self.run = wandb.init(
                project=self.cfg.output.experiment, name=info["name"], dir=str(self.dir),
                id=hashlib.sha256(key.encode()).hexdigest()[:16],
                # W&B refuses (with a warning) to resume a run offline: each session is one
                resume="allow" if mode not in ("offline", "dryrun", "disabled") else None,
                reinit="create_new",  # runs of a sweep or compare follow one another in a process
                config=self.cfg.to_dict(),
                tags=[self.cfg.algorithm.name, self.cfg.data.name],
                settings=wandb.Settings(console="off", silent=True, disable_git=True))
        except Exception as e:  # noqa: BLE001 - no login, a server that cannot be reached, ...
            raise ConfigError("output.trackers", "wandb", f"W&B could not start a run: {one_line(e, 200)} "
                              "(run `wandb login`, or set WANDB_MODE=offline to keep the run in the run "
                              "folder)") from None
        self.run.summary.update({"protofl/fingerprint": self.cfg.fingerprint(),
                                 "protofl/dir": str(self.dir.resolve()), "protofl/start_round": info["start_round"]})
        if not self.run.offline:
            log.info("W&B run: %s", self.run.url)

    def on_round(self, row: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log(dict(metric_items(row)), step=row["round"])

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        assert self.dir is not None  # on_start set it before the run
        # the latest value of every metric is W&B's summary already; the rest of protofl's
        self.run.summary.update({k: v for k, v in summary.items() if k != "final"})
        for p in [self.dir / CONFIG, *_reports(self.dir)]:
            if p.exists():  # the run's files folder is uploaded (synced) with the run
                shutil.copy2(p, Path(self.run.dir) / p.name)
        self.run.finish(exit_code=0 if summary.get("status") in SUCCEEDED else 1)
        self.run = None


def prepare_trackers(cfg: Config) -> None:
    """Create the trackers' stores once, before runs in parallel processes share them
    (two processes creating one MLflow database at once would race)."""
    if "mlflow" in cfg.output.trackers:
        check_trackers(list(cfg.output.trackers))
        MLflowTracker(cfg).experiment_id()


def make_trackers(cfg: Config) -> list[Callback]:
    """The callbacks for ``cfg.output.trackers``."""
    check_trackers(list(cfg.output.trackers))
    classes = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}
    return [classes[name](cfg) for name in cfg.output.trackers]
