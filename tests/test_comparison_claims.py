"""benchmarks/comparison/family.py: the papers' claims tested on run folders, in points,
over the planned seeds only, one row per claim with a verdict per setting."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

FAMILY = Path(__file__).resolve().parents[1] / "benchmarks" / "comparison" / "family.py"


@pytest.fixture(scope="module")
def family():
    spec = importlib.util.spec_from_file_location("comparison_family", FAMILY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def fake_run(root: Path, name: str, seed: int, gm: list[float], classes: int = 10) -> Path:
    d = root / f"{name}-s{seed}"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"status": "complete", "seed": seed, "rounds_completed": len(gm),
                                                "rounds": len(gm)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": r + 1, "gm": g}) + "\n" for r, g in enumerate(gm)))
    (d / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "rounds": len(gm), "algorithm": {"name": name},
                                                   "training": {"lr": 0.01, "momentum": 0.9, "epochs": 5,
                                                                "batch_size": 64}}))
    (d / "clients.json").write_text(json.dumps({"num_clients": 2, "num_classes": classes}))
    return d


def test_per_seed_is_the_final_value_in_points_for_the_planned_seeds(family, tmp_path):
    dirs = [fake_run(tmp_path, "a", s, [0.5, 0.70 + s / 100]) for s in (0, 1, 2, 7)]
    assert family.per_seed(dirs, "gm", [0, 1, 2]) == pytest.approx({0: 70.0, 1: 71.0, 2: 72.0})


def test_a_claim_gets_a_verdict_per_setting(family, tmp_path, monkeypatch):
    claim = family.Claim("x", "X (2023)", "X | beats FedAvg", "abstract", "scope", "gm", "x", "fedavg")
    monkeypatch.setattr(family, "CLAIMS", [claim])
    # dir0.3: x above FedAvg by 2, 3 and 4 points; p50c2: only two seeds of x
    dir03 = {"x": [fake_run(tmp_path / "d", "x", s, [0.80 + (2 + s) / 100]) for s in (0, 1, 2)],
             "fedavg": [fake_run(tmp_path / "d", "fedavg", s, [0.80]) for s in (0, 1, 2)]}
    p50 = {"x": [fake_run(tmp_path / "p", "x", s, [0.9]) for s in (0, 1)],
           "fedavg": [fake_run(tmp_path / "p", "fedavg", s, [0.8]) for s in (0, 1, 2)]}
    lines = family.claim_lines({"dir0.3": dir03, "p50c2": p50}, [0, 1, 2], 20)
    row = next(line for line in lines if line.startswith("| X (2023)"))
    cells = [c.strip() for c in row.split(" | ")]
    assert '"X \\| beats FedAvg" (abstract)' in cells[1]  # a | in the paper's words is escaped
    assert cells[2].startswith("**shown**: +3.00 pts")
    assert cells[3].startswith("**not comparable**: 2 paired seed(s)")
    assert "20 rounds" in " ".join(lines) and "* X (2023), x above fedavg: scope" in lines


def test_exploratory_runs_are_shown_apart_without_a_verdict(family, tmp_path, monkeypatch):
    e = family.Exploratory("x-strong=x(beta=6.2)", "fedavg", "gm", "asked after the verdict")
    monkeypatch.setattr(family, "EXPLORATORY", [e])
    assert family.exploratory_lines({"dir0.3": {}, "p50c2": {}}, [0, 1, 2]) == []  # none run: no section
    # x-strong above FedAvg by 1, 2 and 3 points on dir0.3; nothing on p50c2
    dir03 = {"x-strong": [fake_run(tmp_path, "x-strong", s, [0.80 + (1 + s) / 100]) for s in (0, 1, 2)],
             "fedavg": [fake_run(tmp_path, "fedavg", s, [0.80]) for s in (0, 1, 2)]}
    lines = family.exploratory_lines({"dir0.3": dir03, "p50c2": {}}, [0, 1, 2])
    assert lines[0] == "## Exploratory (outside the plan: no verdicts)"
    row = next(line for line in lines if line.startswith("| `x-strong=x(beta=6.2)`"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[1] == "fedavg"
    assert cells[2].startswith("GM 82.00; vs fedavg: +2.00 pts (90 % CI")
    assert cells[3].startswith("GM –; vs fedavg: 0 paired seed(s)")
    assert "**" not in row  # no verdict words in bold, unlike a claim's row
    assert "* `x-strong=x(beta=6.2)`: asked after the verdict" in lines


def test_the_page_counts_only_the_planned_runs(family, tmp_path, monkeypatch):
    e = family.Exploratory("x-strong=fedavg(lr=1)", "fedavg", "gm", "asked after the verdict")
    monkeypatch.setattr(family, "EXPLORATORY", [e])
    monkeypatch.setattr(family, "CLAIMS", [])
    dir03 = {"fedavg": [fake_run(tmp_path, "fedavg", s, [0.80]) for s in (0, 1, 2)],
             "x-strong": [fake_run(tmp_path, "x-strong", s, [0.81]) for s in (0, 1, 2)]}
    text = family.page(["fedavg"], "cpu", {"dir0.3": dir03, "p50c2": {}}, 0.0)
    assert "3 of 3 runs finished." in text and "0 of 3 runs finished." in text
    assert "## Exploratory (outside the plan: no verdicts)" in text


def timed_run(root: Path, name: str, seed: int, wall: list[float], cpu: list[float] | None) -> Path:
    d = fake_run(root, name, seed, [0.8] * len(wall))
    rows = [{"round": r + 1, "gm": 0.8, "wall_s": w, **({"cpu_s": cpu[r]} if cpu else {})} for r, w in enumerate(wall)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return d


def test_s_per_round_is_cpu_time_where_every_seed_has_it_else_wall_clock_marked(family, tmp_path):
    from protofl.report import tables
    # the first round pays the start-up and is left out: CPU (2 + 4) / 2 = 3 and (1 + 3) / 2 = 2
    cpu = {"x": [timed_run(tmp_path / "a", "x", 0, [9, 5, 7], [8, 2, 4]),
                 timed_run(tmp_path / "a", "x", 1, [9, 5, 7], [8, 1, 3])]}
    row = tables.compare_rows(cpu, metrics=["gm"])[0]
    assert row["cpu_per_round"] == pytest.approx(2.5) and family.per_round(row) == "2.50"
    # one seed's run predates cpu_s: no CPU mean over the other seed alone; wall clock, marked
    mixed = {"x": [timed_run(tmp_path / "b", "x", 0, [9, 5, 7], [8, 2, 4]),
                   timed_run(tmp_path / "b", "x", 1, [9, 3, 5], None)]}
    row = tables.compare_rows(mixed, metrics=["gm"])[0]
    assert row["cpu_per_round"] != row["cpu_per_round"]  # NaN
    assert family.per_round(row) == "5.00 (wall)"  # (5 + 7) / 2 and (3 + 5) / 2, averaged


def diverged_run(root: Path, name: str, seed: int, rnd: int) -> tuple[Path, str]:
    d = fake_run(root, name, seed, [0.5] * (rnd - 1))
    (d / "summary.json").write_text(json.dumps({"status": "diverged", "seed": seed, "rounds": 20,
                                                "rounds_completed": rnd - 1,
                                                "error": f"non-finite training loss (nan) in round {rnd} on client 4"}))
    from protofl.run_folder import health
    return d, health(d)


def test_a_diverged_run_is_counted_and_named_apart_from_the_cells(family, tmp_path, monkeypatch):
    monkeypatch.setattr(family, "CLAIMS", [])
    monkeypatch.setattr(family, "EXPLORATORY", [])
    dir03 = {"fedavg": [fake_run(tmp_path / "d", "fedavg", s, [0.80]) for s in (0, 1, 2)],
             "fedprox": [fake_run(tmp_path / "d", "fedprox", s, [0.70 + s / 100]) for s in (0, 1)]}
    bad = {"dir0.3": {"fedprox": [diverged_run(tmp_path / "d", "fedprox", 2, 2)],
                      "fedproto": [diverged_run(tmp_path / "d", "fedproto", 0, 1)]},
           "p50c2": {"fedavg": [diverged_run(tmp_path / "p", "fedavg", s, 3) for s in (0, 1, 2)]}}
    text = family.page(["fedavg", "fedprox", "fedproto"], "cpu", {"dir0.3": dir03, "p50c2": {}}, 0.0, bad=bad)
    assert "5 of 9 runs finished; 2 diverged (below)." in text
    assert "0 of 9 runs finished; 3 diverged (below)." in text
    row = next(line for line in text.splitlines() if line.startswith("|") and " fedproto | " in line)
    assert row.endswith("| fedproto | – | diverged (1 of 3 seeds) | diverged (1 of 3 seeds) | diverged (1 of 3 seeds) | – |")
    row = next(line for line in text.splitlines() if line.startswith("|") and " fedprox | " in line)
    assert "| 70.50 ± 0.71 (2 of 3 seeds; 1 diverged) | – | – | = GM |" in row  # the metrics it lacks: –
    assert "* fedprox seed 2: non-finite training loss (nan) in round 2 on client 4" in text
    p50 = text.split("## P50C2")[1]
    row = next(line for line in p50.splitlines() if line.startswith("|") and " fedavg | " in line)
    assert row.count("diverged (3 of 3 seeds)") == 3 and row.endswith("| = GM | – |")  # FedAvg has a global model
    assert [f"* fedavg seed {s}: non-finite training loss (nan) in round 3 on client 4" in p50 for s in (0, 1, 2)] \
        == [True] * 3


def test_the_published_page_is_rebuilt_from_its_records(family, tmp_path, monkeypatch, capsys):
    """fmnist.md's own command with --no-run on a copy of its committed records (one file):
    the same page but its date, its command line and its wall time; nothing is written into
    the records; the recipe it states is the one every recorded config has."""
    import re
    import shutil

    from protofl.records import read_packed
    root = FAMILY.parents[2]
    text = (FAMILY.parent / "fmnist.md").read_text(encoding="utf-8")
    command = re.search(r"^```\n(python benchmarks/comparison/family\.py .*)\n```$", text, re.M).group(1).split()
    assert "--no-run" in command and "--records" in command, "the page is made from its records alone"
    packed = root / command[command.index("--records") + 1]
    recs = tmp_path / packed.name
    shutil.copyfile(packed, recs)
    args = command[2:]
    args[args.index("--records") + 1] = str(recs)
    monkeypatch.setattr(sys, "argv", ["family.py", *args, "--runs", str(tmp_path / "runs"),
                                      "--out", str(tmp_path / "page.md")])
    assert family.main() == 0
    capsys.readouterr()
    drop = re.compile(r"^Written \d{4}-\d\d-\d\d from |^python benchmarks/comparison/family\.py .*$|^Wall time .*$",
                      re.M)
    assert drop.sub("", (tmp_path / "page.md").read_text(encoding="utf-8")) == drop.sub("", text)
    assert recs.read_bytes() == packed.read_bytes()
    # the recipe line of each setting against the configs themselves (not only against the
    # page's own generator): no weight decay, a constant lr, no shared clip, FedGELA's own
    runs = read_packed(packed)
    planned = [r for r in runs if r["run"].split("/")[1].rsplit("-", 2)[0] in family.ALGORITHMS.names()]
    assert len(planned) == 342
    assert {(r["config"]["training"]["weight_decay"], r["config"]["training"]["lr_decay"],
             r["config"]["training"]["clip_grad"]) for r in planned} == {(0.0, 1.0, None)}
    assert text.count("SGD lr 0.01, momentum 0.9, weight decay 0; constant lr; no gradient clip; 5 local epochs, "
                      "batch 64") == 2
    own = {r["config"]["algorithm"]["name"] for r in planned if r["config"]["algorithm"].get("clip_grad")}
    assert own == {"fedge", "fedgela"} and text.count("fedge, fedgela: gradient clip 20 (the method's own)") == 2
    assert "weight decay 1e-5" not in text and "lr decay 0.99" not in text and "clip 10" not in text


def test_a_collapsed_run_is_named_and_never_averaged(family, tmp_path, monkeypatch):
    """A run that ended at chance (10 classes: GM 10.5 %) is no result: out of the cells, named
    with its reason, and a claim on its method is not comparable."""
    claim = family.Claim("x", "X (2023)", "X beats FedAvg", "abstract", "scope", "gm", "x", "fedavg")
    monkeypatch.setattr(family, "CLAIMS", [claim])
    monkeypatch.setattr(family, "EXPLORATORY", [])
    from protofl.run_folder import health
    runs = {"x": [fake_run(tmp_path, "x", s, [0.5, g]) for s, g in ((0, 0.80), (1, 0.105), (2, 0.82))],
            "fedavg": [fake_run(tmp_path, "fedavg", s, [0.5, 0.7]) for s in (0, 1, 2)]}
    why = health(runs["x"][1])
    assert why.startswith("collapsed: its last GM (10.50 % in round 2) is within 2 points of chance (10.00 %")
    assert health(runs["x"][0]) is None
    bad = {"dir0.3": {"x": [(runs["x"][1], why)]}}
    done = {"dir0.3": {"x": [runs["x"][0], runs["x"][2]], "fedavg": runs["fedavg"]}, "p50c2": {}}
    monkeypatch.setattr(family, "by_family", lambda names: {"f": names})
    text = family.page(["x", "fedavg"], "cpu", done, 0.0, bad=bad)
    row = next(line for line in text.splitlines() if line.startswith("| f | x |"))
    assert "| 81.00 ± 1.41 (2 of 3 seeds; 1 collapsed) |" in row  # seeds 0 and 2 only, never the 10.5
    assert "5 of 6 runs finished; 1 collapsed (below)." in text
    assert f"* x seed 1: {why}" in text
    claim_row = next(line for line in text.splitlines() if line.startswith("| X (2023)"))
    assert "**not comparable**: no result from x seed 1 (below)" in claim_row
