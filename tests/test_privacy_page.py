"""benchmarks/privacy/accuracy_epsilon.py: the page built from finished run folders (no
training): the table, the leaders per epsilon with their paired tests, the rejected
replies, and no folder of the machine on the page."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "privacy"
SCRIPT = RESULTS / "accuracy_epsilon.py"
pytest.importorskip("matplotlib")


@pytest.fixture
def page_script():
    spec = importlib.util.spec_from_file_location("privacy_accuracy_epsilon", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake(out: Path, name: str, seed: int, ga: float, pa, eps=None, sigma=None, rejected=0) -> None:
    """A finished run folder; ``pa`` None: not logged (client-level DP), ``rejected`` None:
    not logged either."""
    d = out / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"status": "complete", "seed": seed, "rounds_completed": 3}))
    counts = {} if rejected is None else {"rejected": rejected}
    arrived = 4 - (rejected or 0)
    rows = [{"round": r, "arrived": arrived, **counts, "wall_s": 60.0} for r in (1, 2)]
    rows.append({"round": 3, "arrived": arrived, **counts, "wall_s": 60.0, "ga": ga, **({"pa": pa} if pa else {}),
                 **({"epsilon": eps} if eps is not None else {})})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"seed": seed, **({"privacy": {"noise_multiplier": sigma}} if sigma is not None else {})}
    (d / "config.yaml").write_text(json.dumps(cfg))


def stable(text: str) -> str:
    """A page without what a rebuild changes: the date and command line, the invocation's time."""
    text = re.sub(r"Measured .*?; seeds", "Measured ...; seeds", text)
    return re.sub(r"this invocation [0-9.]+ min", "this invocation ... min", text)


def test_the_committed_page_is_made_of_its_committed_records(page_script, tmp_path, monkeypatch):
    records = RESULTS / "records" / "accuracy_epsilon_cpu.jsonl.gz"
    monkeypatch.setattr(sys, "argv", ["accuracy_epsilon.py", "--scale", "cpu", "--no-run", "--records", str(records),
                                      "--results", str(tmp_path)])
    page_script.main()
    assert stable((tmp_path / "accuracy_epsilon_cpu.md").read_text()) == \
        stable((RESULTS / "accuracy_epsilon_cpu.md").read_text())


def test_the_page_from_finished_runs(page_script, tmp_path, monkeypatch):
    runs, results = tmp_path / "machine-folder" / "runs", tmp_path / "out"
    out = runs / "smoke"
    # three seeds at epsilon 8 (the smoke scale's), chosen on the command line
    for s in (0, 1, 2):
        fake(out, f"fedavg-s{s}", s, 0.70, 0.90)
        fake(out, f"fedavg-client-level_dp-eps8-s{s}", s, 0.20 + s / 100, None, 7.9, 0.7, rejected=None)
        fake(out, f"fedavg-dp-sgd-eps8-s{s}", s, 0.40 + s / 100, 0.80, 7.9, 3.5, rejected=1)
        # FedProto's runs end at chance level (10 classes: GA within 2 points of 10 %)
        fake(out, f"fedproto-dp-sgd_+_private_prototypes-eps8-s{s}", s, 0.10 + s / 100, 0.80, 7.9, 1.5)
        fake(out, f"fednh-dp-sgd_+_private_prototypes-eps8-s{s}", s, 0.75 + s * s / 50, 0.85, 7.9, 1.5)
    labels = ("FedAvg;FedAvg, client-level DP;FedAvg, DP-SGD;FedProto, DP-SGD + private prototypes;"
              "FedNH, DP-SGD + private prototypes")
    argv = ["accuracy_epsilon.py", "--scale", "smoke", "--seeds", "0,1,2", "--mechanisms", labels,
            "--runs", str(runs), "--results", str(results), "--records", str(tmp_path / "records.jsonl.gz")]
    monkeypatch.setattr(sys, "argv", argv)
    page_script.main()
    text = (results / "accuracy_epsilon_smoke.md").read_text()
    # the same page from the records alone (no run folder), but the command line and the time
    monkeypatch.setattr(sys, "argv", [*argv[:-6], "--no-run", "--records", str(tmp_path / "records.jsonl.gz"),
                                      "--results", str(tmp_path / "again")])
    page_script.main()
    assert stable((tmp_path / "again" / "accuracy_epsilon_smoke.md").read_text()) == stable(text)
    assert str(tmp_path) not in (tmp_path / "records.jsonl.gz").read_bytes().decode("latin-1")
    assert (results / "accuracy_epsilon_smoke.png").exists()
    assert str(tmp_path) not in text and "--runs RUNS --results RESULTS" in text
    assert "chosen on the command line: exploratory" in text
    # client-level DP: no PA and no rejections logged (not private), so none on the page
    assert "| FedAvg, client-level DP | 8 | 7.90 | 0.7 | 21.00 ± 1.00 | – | – | – | 3 |" in text
    assert "every run's ε is within 1.2 % of its target" in text  # 7.9 of 8
    assert "| FedAvg, DP-SGD | 8 | 7.90 | 3.5 | 41.00 ± 1.00 | 80.00 ± 0.00 | 25.0 | – | 3 |" in text
    assert "| FedAvg | – | – | – | 70.00 ± 0.00 | 90.00 ± 0.00 | 0.0 | – | 3 |" in text
    # runs that ended at chance level are named, with the rule
    assert "| FedProto, DP-SGD + private prototypes | 8 | 7.90 | 1.5 | 11.00 ± 1.00 | 80.00 ± 0.00 | 0.0 | 3 of 3 | 3 |" \
        in text
    assert "within 2 points of chance (10 %, 10 classes)" in text
    # the leaders at epsilon 8. GA: FedNH, above the others by differences that vary over the
    # seeds (t-tests: shown). PA is constant over the seeds: a zero-spread difference of unknown
    # step counts for nothing (not shown); client-level DP has no PA and is left out of it
    row = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    cells = [c.strip() for c in row.strip("| ").split(" | ")]
    assert cells[1] == "FedNH, DP-SGD + private prototypes (78.33 %): **shown**"
    assert cells[2] == "FedNH, DP-SGD + private prototypes (85.00 %): **not shown**"
    assert "* ε = 8, GA: FedNH, DP-SGD + private prototypes: above each of them at p < 0.05." in text
    assert "vs FedAvg, client-level DP" in text.split("* ε = 8, PA")[0]
    assert "client-level" not in text.split("* ε = 8, PA")[1]
