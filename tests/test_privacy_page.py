"""benchmarks/privacy/accuracy_epsilon.py: the page built from finished run folders (no
training): the table, the leaders per epsilon with their paired tests, the rejected
replies, and no folder of the machine on the page."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "privacy" / "accuracy_epsilon.py"
pytest.importorskip("matplotlib")


@pytest.fixture
def page_script():
    spec = importlib.util.spec_from_file_location("privacy_accuracy_epsilon", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake(out: Path, name: str, seed: int, ga: float, pa: float, eps=None, sigma=None, rejected=0) -> None:
    d = out / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"status": "complete", "seed": seed, "rounds_completed": 3}))
    rows = [{"round": r, "arrived": 4 - rejected, "rejected": rejected, "wall_s": 60.0} for r in (1, 2)]
    rows.append({"round": 3, "arrived": 4 - rejected, "rejected": rejected, "wall_s": 60.0, "ga": ga, "pa": pa,
                 **({"epsilon": eps} if eps is not None else {})})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"seed": seed, **({"privacy": {"noise_multiplier": sigma}} if sigma is not None else {})}
    (d / "config.yaml").write_text(json.dumps(cfg))


def test_the_page_from_finished_runs(page_script, tmp_path, monkeypatch):
    runs, results = tmp_path / "machine-folder" / "runs", tmp_path / "out"
    out = runs / "smoke"
    # three seeds at epsilon 8 (the smoke scale's), chosen on the command line
    for s in (0, 1, 2):
        fake(out, f"fedavg-s{s}", s, 0.70, 0.90)
        fake(out, f"fedavg-client-level_dp-eps8-s{s}", s, 0.20 + s / 100, 0.50, 7.9, 0.7, rejected=1)
        fake(out, f"fedproto-private_prototypes-eps8-s{s}", s, 0.30 + s * s / 100, 0.80, 7.9, 1.5)
        fake(out, f"fednh-private_prototypes-eps8-s{s}", s, 0.75 + s * s / 50, 0.85, 7.9, 1.5)
    labels = "FedAvg;FedAvg, client-level DP;FedProto, private prototypes;FedNH, private prototypes"
    monkeypatch.setattr(sys, "argv", ["accuracy_epsilon.py", "--scale", "smoke", "--seeds", "0,1,2",
                                      "--mechanisms", labels, "--runs", str(runs), "--results", str(results)])
    page_script.main()
    text = (results / "accuracy_epsilon_smoke.md").read_text()
    assert (results / "accuracy_epsilon_smoke.png").exists()
    assert str(tmp_path) not in text and "--runs RUNS --results RESULTS" in text
    assert "chosen on the command line: exploratory" in text
    assert "| FedAvg, client-level DP | 8 | 7.90 | 0.7 | 21.00 ± 1.00 | 50.00 ± 0.00 | 25.0 | 3 |" in text
    assert "| FedAvg | – | – | – | 70.00 ± 0.00 | 90.00 ± 0.00 | 0.0 | 3 |" in text
    # the leaders at epsilon 8. GA: FedNH among all, FedProto among the fully protected, each
    # above the others by differences that vary over the seeds (t-tests: shown). PA is constant
    # over the seeds: a zero-spread difference of unknown step counts for nothing (not shown)
    row = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    cells = [c.strip() for c in row.strip("| ").split(" | ")]
    assert cells[1] == "FedNH, private prototypes (78.33 %): **shown**"
    assert cells[2] == "FedProto, private prototypes (31.67 %): **shown**"
    assert cells[3] == "FedNH, private prototypes (85.00 %): **not shown**"
    assert cells[4] == "FedProto, private prototypes (80.00 %): **not shown**"
    assert ("* ε = 8, GA, among the mechanisms that protect all they send: FedProto, private prototypes: "
            "above each of them at p < 0.05. vs FedAvg, client-level DP: +10.67 pts") in text
