"""Trackers: what a run logs is read back with TensorBoard's and MLflow's own readers."""
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
    assert main(["run", str(DIGITS), "output.trackers=[wandb]", f"output.dir={tmp_path}", "--quiet"]) == 2
    assert "unknown tracker; known: tensorboard, mlflow" in capsys.readouterr().err


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
