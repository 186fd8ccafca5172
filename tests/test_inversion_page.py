"""benchmarks/privacy/inversion.py: the page and its figure are made from the measurement's
records alone, and the committed page is its committed records' word for word."""
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "privacy"
RECORDS = RESULTS / "records" / "inversion.jsonl.gz"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("privacy_inversion", RESULTS / "inversion.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_page_is_made_of_its_committed_records(script, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["inversion.py", "--no-run", "--records", str(RECORDS),
                                      "--results", str(tmp_path)])
    assert script.main() == 0
    assert (tmp_path / "inversion.md").read_text() == (RESULTS / "inversion.md").read_text()
    assert (tmp_path / "inversion.png").read_bytes() == (RESULTS / "inversion.png").read_bytes()


def records_of(own, other, eps=None):
    meta = {"kind": "meta", "measured": "Measured 2026-01-01 on a machine.", "command": "python inversion.py",
            "minutes": 1.0, "test_acc": 0.5, "classes": 3, "cases": [[1, 0, 0], [1, 1, 0], [1, 2, 0]],
            "delta": 1e-5, "settings": {"seed": 0, "trials": 1, "epochs": 1, "steps": 3, "lr": 0.1, "tv": 0.0}}
    img = {"shape": [2, 2], "b64": "AAAAAA=="}
    fig = {"kind": "figure", "map": "m", "n": 1, "rows": [{"name": "own", "images": [img, img]}]}
    rel = {"kind": "release", "map": "m", "epsilon": eps, "sigma": 0.0 if eps is None else 1.5,
           "own": own, "other": other}
    return [meta, rel, fig]


def test_a_row_is_the_paired_gap_of_its_cases(script, tmp_path):
    # gaps 0.2, 0.4, 0.3: mean 0.3, std 0.1; t = 0.3 / (0.1 / sqrt 3) = 5.196, df 2
    text = script.render(records_of([0.5, 0.6, 0.4], [0.3, 0.2, 0.1], eps=8.0), tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| m |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["m", "8", "1.5", "1"]
    assert cells[4] == "0.500 ± 0.100" and cells[5] == "0.200 ± 0.100"
    assert cells[6].startswith("+0.300 (90 % CI +0.131 to +0.469)")  # 0.3 ± t_0.95,2 (2.920) x 0.0577 = 0.169
    from scipy import stats
    assert float(cells[7]) == pytest.approx(stats.t.sf(0.3 / (0.1 / np.sqrt(3)), 2), abs=5e-4)  # printed to 2 digits


def test_an_image_keeps_its_grey_levels(script):
    img = torch.tensor([[-1.0, 0.0], [1.0, 3.0]])  # 3.0 is past the range: clamped
    back = script.ungrey(script.grey(img, -1.0, 1.0))
    assert back.tolist() == [[0, 128], [255, 255]]


def write(path, records):
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    return path


def test_other_records_are_refused(script, tmp_path):
    path = write(tmp_path / "r.jsonl.gz", [{"kind": "release"}])
    with pytest.raises(SystemExit, match="not the records of inversion.py"):
        script.read_records(path)
    good = records_of([0.5, 0.6, 0.4], [0.3, 0.2, 0.1])
    assert script.read_records(write(tmp_path / "good.jsonl.gz", good)) == good
    short = records_of([0.5, 0.6], [0.3, 0.2])  # two correlations for three cases: pairs misread
    twice = good[:2] + good[1:]  # one (map, epsilon) released twice
    fewer = [{**good[0], "cases": good[0]["cases"][:2]}, *good[1:]]  # cases that are not trials x classes
    bad_img = [*good[:2], {**good[2], "rows": [{"name": "own", "images": [{"shape": [3, 3], "b64": "AAAA"}]}]}]
    for name, recs in (("short", short), ("twice", twice), ("fewer", fewer), ("image", bad_img)):
        with pytest.raises(SystemExit, match="not the records of inversion.py"):
            script.read_records(write(tmp_path / f"{name}.jsonl.gz", recs))
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit, match="unreadable"):
        script.read_records(tmp_path / "junk.jsonl.gz")


def test_no_run_needs_records(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["inversion.py", "--no-run"])
    with pytest.raises(SystemExit):
        script.main()
    assert "--no-run needs --records" in capsys.readouterr().err
