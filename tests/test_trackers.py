"""Trackers: what a run logs is read back with TensorBoard's, MLflow's and W&B's own readers."""
import json

import pytest

from protofl.cli import main
from protofl.engine.trackers import flat_params, metric_items

from conftest import DIGITS


def test_metric_items_and_params():
    row = {"round": 3, "gm": 0.5, "gm@head": 0.25, "gm_per_class": [1.0, 0.0], "pa": float("nan"), "x": True}
    assert dict(metric_items(row)) == {"gm": 0.5, "gm_head": 0.25, "gm_per_class/0": 1.0, "gm_per_class/1": 0.0}
    assert flat_params({"training": {"lr": 0.05}, "model": {"hidden": [64]}, "seed": 0}) == \
        {"training.lr": "0.05", "model.hidden": "[64]", "seed": "0"}


def test_unknown_tracker_is_a_config_error(tmp_path, capsys):
    assert main(["run", str(DIGITS), "output.trackers=[comet]", f"output.dir={tmp_path}", "--quiet"]) == 2
    assert "unknown tracker; known: tensorboard, mlflow, wandb" in capsys.readouterr().err


def _run(digits_cfg, tracker):
    import protofl

    cfg = digits_cfg("rounds=2", f"output.trackers=[{tracker}]")
    return cfg, protofl.run(cfg)


def test_tensorboard_events_hold_every_metric_of_every_round(digits_cfg):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, result = _run(digits_cfg, "tensorboard")
    acc = EventAccumulator(str(result.dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("gm", "pa", "train_loss", "bytes_up", "gm_per_class/9"):
        assert name in tags, sorted(tags)
    gm = acc.Scalars("gm")
    assert [e.step for e in gm] == [1, 2]
    assert [e.value for e in gm] == pytest.approx([r["gm"] for r in result.rows])
    text = {t for t in acc.Tags()["tensors"]}
    assert any(t.startswith("config") for t in text) and any(t.startswith("summary") for t in text)


def test_mlflow_run_holds_params_metrics_and_artifacts(digits_cfg, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("pandas")
    pytest.importorskip("sqlalchemy")

    cfg, result = _run(digits_cfg, "mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the default store: <output.dir>/mlflow.db
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["protofl"])
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["tags.mlflow.runName"] == result.dir.name
    assert run["params.training.lr"] == "0.05" and run["params.algorithm.name"] == "fedavg"
    assert run["metrics.gm"] == pytest.approx(result.rows[-1]["gm"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    hist = client.get_metric_history(run["run_id"], "pa")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [1, 2]
    arts = {a.path for a in client.list_artifacts(run["run_id"])}
    assert {"summary.json", "config.yaml"} <= arts
    local = client.download_artifacts(run["run_id"], "summary.json", str(tmp_path / "dl"))
    assert json.loads(open(local).read())["final"]["gm"] == pytest.approx(result.summary["final"]["gm"])


def read_wandb_run(path):
    """The config, history (step -> {metric: value}) and summary of a ``.wandb`` file, read
    with W&B's own reader of its transaction log (as ``wandb sync`` does)."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    def key(item):
        return item.key or "/".join(item.nested_key)

    config, history, summary = {}, {}, {}
    ds = datastore.DataStore()
    ds.open_for_scan(str(path))
    while (data := ds.scan_data()) is not None:
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({key(u): json.loads(u.value_json) for u in updates})
        elif kind == "history":
            history[rec.history.step.num] = {key(i): json.loads(i.value_json) for i in rec.history.item}
        elif kind == "summary":
            summary.update({key(u): json.loads(u.value_json) for u in rec.summary.update})
    return config, history, summary


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its settings and caches in tmp, and no connection from this process
    but to itself (W&B's own service listens on localhost)."""
    import socket

    for var, value in {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9",
                       "WANDB_ERROR_REPORTING": "false", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
                       "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(var, value)
    outside = []
    connect = socket.socket.connect

    def local_only(self, address):
        host = address[0] if isinstance(address, tuple) else "unix"
        if host not in ("unix", "127.0.0.1", "::1", "localhost"):
            outside.append(address)
            raise OSError("the test allows no network")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert not outside, outside


def test_wandb_offline_run_holds_config_every_metric_of_every_round_and_summary(digits_cfg, offline_wandb):
    wandb = pytest.importorskip("wandb")
    from protofl.engine.trackers import metric_items

    cfg, result = _run(digits_cfg, "wandb")
    wandb.teardown()  # W&B's service writes the run file on its own time: wait until it has closed it
    files = sorted(result.dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    config, history, summary = read_wandb_run(files[0])
    assert config["training"] == cfg.to_dict()["training"] and config["algorithm"]["name"] == "fedavg"
    assert config["seed"] == 0 and config["rounds"] == 2
    assert sorted(history) == [1, 2]
    for row in result.rows:
        logged = history[row["round"]]
        want = dict(metric_items(row))
        assert {"gm", "pa", "train_loss", "bytes_up", "gm_per_class/9"} <= set(want)
        for name, value in want.items():
            assert logged[name] == pytest.approx(value), name
    assert summary["status"] == "complete" and summary["rounds_completed"] == 2
    assert summary["fingerprint"] == cfg.fingerprint() and summary["protofl/start_round"] == 1
    assert summary["gm"] == pytest.approx(result.summary["final"]["gm"])  # the last value of each metric
    assert (files[0].parent / "files" / "config.yaml").read_text() == (result.dir / "config.yaml").read_text()


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch, capsys, offline_wandb):
    wandb = pytest.importorskip("wandb")

    def no_login(*a, **kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_login)
    args = ["run", str(DIGITS), "rounds=1", "output.trackers=[wandb]", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "W&B could not start a run: api_key not configured" in err, err
    assert "WANDB_MODE=offline" in err
