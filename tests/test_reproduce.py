"""`protofl reproduce`: the paired tests and rank correlation on hand-computed inputs, the
table files (every shipped table plans at every scale; the paper scale is the paper's
setting), a small table built end to end and rebuilt from its finished runs, the CLI, and
`data.train_size`."""
import json
import math

import numpy as np
import pytest
import yaml

from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.data.build import SUBSET_TAG, build_federated
from protofl.reproduce import all_specs, collect, get_spec, plan, reproduce, stats
from protofl.reproduce.render import markdown_page
from protofl.reproduce.run import Cell, judge
from protofl.reproduce.spec import TABLES_DIR, Claim, load_spec, parse_spec


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------
def by_seed(*values):
    return dict(enumerate(values))


def test_paired_t_test_by_hand():
    # d = (1, 2, 3): mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 with 2 degrees of freedom;
    # one-sided p = P(T_2 > 3.4641) = (1 - 3.4641 / sqrt(2 + 3.4641^2)) / 2 = 0.03709
    v = stats.greater(by_seed(11.0, 12.0, 13.0), by_seed(10.0, 10.0, 10.0))
    assert v.verdict == stats.SHOWN
    t = v.tests[0]
    assert t.n == 3 and t.mean == pytest.approx(2.0) and t.sd == pytest.approx(1.0)
    assert t.p_greater == pytest.approx((1 - 3.4641016 / math.sqrt(2 + 12)) / 2, abs=1e-6)
    # the 95 % interval: 2 ± t_{0.975, 2} / sqrt 3 = 2 ± 4.3027 / 1.7321
    assert t.ci95 == pytest.approx((2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)), abs=1e-5)
    assert t.p_wilcoxon == pytest.approx(0.125)  # 1/2^3: the smallest a 3-seed Wilcoxon can give
    # a difference inside the spread is not shown; the wrong direction is not shown either
    assert stats.greater(by_seed(11.0, 9.0, 10.5), by_seed(10.0, 10.0, 10.0)).verdict == stats.NOT_SHOWN
    assert stats.greater(by_seed(8.0, 8.5, 9.0), by_seed(10.0, 10.0, 10.0)).verdict == stats.NOT_SHOWN


def test_pairs_use_only_seeds_both_have():
    a, b = {0: 1.0, 1: 2.0, 2: None, 3: 5.0}, {0: 0.0, 1: 1.0, 2: 7.0}
    d, seeds = stats.pairs(a, b)
    assert seeds == [0, 1] and d.tolist() == [1.0, 1.0]
    # a constant difference has no spread: shown when positive, not when zero
    assert stats.greater(a, b).verdict == stats.SHOWN
    assert stats.greater({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0}).verdict == stats.NOT_SHOWN
    one = stats.greater({0: 3.0}, {0: 1.0})
    assert one.verdict == stats.NOT_COMPARABLE and "1 paired seed" in one.detail


def test_equivalence_and_best():
    a = by_seed(70.1, 70.0, 70.2)
    assert stats.equal(a, by_seed(70.0, 70.1, 70.1), margin=1.0).verdict == stats.SHOWN
    # 2 points apart, or too noisy to bound within the margin: not shown
    assert stats.equal(a, by_seed(72.0, 72.2, 72.1), margin=1.0).verdict == stats.NOT_SHOWN
    assert stats.equal(by_seed(70, 72, 68), by_seed(70, 70, 70), margin=1.0).verdict == stats.NOT_SHOWN
    # best: shown only when every pairwise test is (intersection-union)
    hi = by_seed(80.0, 81.0, 82.0)
    v = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "y": by_seed(60.0, 60.5, 62.0)})
    assert v.verdict == stats.SHOWN
    v = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "z": by_seed(79.0, 83.0, 80.0)})
    assert v.verdict == stats.NOT_SHOWN and "not above z" in v.detail


def test_a_lower_is_better_claim_wins_with_the_smaller_values():
    claim = Claim(id="spread", text="", source="", kind="best", metric="pa_std", a="P",
                  among=["x", "y"], better="lower")
    # P's spread is below both others by (1, 2, 3) and (2, 2.5, 4) points: shown
    cells = {"P": {"pa_std": Cell(by_seed(1.0, 1.0, 1.0), None)},
             "x": {"pa_std": Cell(by_seed(2.0, 3.0, 4.0), None)},
             "y": {"pa_std": Cell(by_seed(3.0, 3.5, 5.0), None)}}
    v = judge(claim, cells)
    assert v.verdict == stats.SHOWN and "vs x: +2.00 pts" in v.detail and "lower is better" in v.detail
    # a larger spread than x's is not shown, whatever its size
    cells["P"]["pa_std"] = Cell(by_seed(5.0, 6.0, 7.0), None)
    assert judge(claim, cells).verdict == stats.NOT_SHOWN


def test_rank_correlation_kendall_tau_b():
    same = stats.rank_correlation({"a": 3.0, "b": 2.0, "c": 1.0}, {"a": 30.0, "b": 20.0, "c": 10.0})
    assert same.tau == pytest.approx(1.0) and same.paper_order == ["a", "b", "c"]
    rev = stats.rank_correlation({"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.0}, {"a": 1, "b": 2, "c": 3, "d": 4})
    assert rev.tau == pytest.approx(-1.0)
    # a tie in the paper (Ditto's GM = FedAvg's): tau-b = (C - D) / sqrt((n0 - t)(n0)), here
    # pairs (a,b) tied; C = 2, D = 0, n0 = 3, t = 1 -> 2 / sqrt(2 * 3)
    tie = stats.rank_correlation({"a": 2.0, "b": 2.0, "c": 1.0}, {"a": 5.0, "b": 4.0, "c": 3.0})
    assert tie.tau == pytest.approx(2 / math.sqrt(6))
    assert stats.rank_correlation({"a": 1.0}, {"a": 2.0, "b": 3.0}).n == 1
    assert stats.format_order(["a", "b", "c"], {"a": 2.0, "b": 2.0, "c": 1.0}) == "a 2.00 = b 2.00 > c 1.00"


# ---------------------------------------------------------------------------------------
# the shipped tables
# ---------------------------------------------------------------------------------------
ISSUE_TABLES = {"fedproto-table1", "mpfedcl-table6", "mpfedcl-table5-domains", "rebafl-table1", "fedgela-table4",
                "fedgela-table5", "fednh-table1", "fednh-spiral"}


def test_every_shipped_table_plans_at_every_scale():
    specs = all_specs()
    assert ISSUE_TABLES <= set(specs)
    for name, spec in specs.items():
        assert spec.path.stem.replace("_", "-") == name
        for scale in ("smoke", "cpu", "paper"):
            p = plan(spec, scale)  # builds and validates every run's config
            assert p.num_runs == spec.runs(scale) > 0
            names = [r.dir.name for sp in p.settings for r in sp.runs]
            assert len(set(names)) == len(names)
        for s in spec.settings:  # every paper column a setting points at has a value
            for m in spec.methods_of(s):
                if s.paper and m.paper:
                    assert any(spec.paper_value(s, m, met) is not None for met in spec.metrics), (name, s.id, m.label)


def test_paper_scale_is_the_papers_setting():
    nh = {sp.setting.id: sp for sp in plan(get_spec("fednh-table1"), "paper").settings}
    assert set(nh) == {"dir0.3", "dir1.0"}
    c = nh["dir0.3"].runs[0].cfg
    assert (c.rounds, c.partition.num_clients, c.participation.fraction, c.training.epochs) == (200, 100, 0.1, 5)
    assert (c.training.weight_decay, c.training.lr_decay, c.training.clip_grad) == (1e-5, 0.99, 10.0)
    assert c.partition.params["beta"] == 0.3 and c.data.train_size is None
    g = {sp.setting.id: sp for sp in plan(get_spec("fedgela-table5"), "paper").settings}
    c = g["p50c2"].runs[0].cfg
    assert (c.rounds, c.partition.name, c.partition.num_clients, c.participation.clients_per_round) == \
        (100, "pathological", 50, 10)
    assert c.partition.params == {"classes_per_client": 2, "samples_per_client": None}
    assert (c.training.epochs, c.training.batch_size, c.training.weight_decay) == (10, 100, 1e-4)
    rounds = {r.label: r.cfg.rounds for r in plan(get_spec("mpfedcl-table6"), "paper").settings[0].runs}
    assert rounds == {"FedAvg": 110, "FedProx": 100, "FedProto": 100, "SP-FedCL": 60, "DP-FedCL": 60,
                      "MP-FedCL": 60}
    assert {r.cfg.rounds for sp in plan(get_spec("rebafl-table1"), "paper").settings for r in sp.runs} == {200}


def test_the_phi_ablation_is_phi_one_on_balanced_two_class_clients():
    import torch

    from protofl.algorithms.fedgela import local_adaptation

    spec = get_spec("fedgela-table5")
    gamma = spec.method("FedGELA, Φ = 1").params["gamma"]
    phi = local_adaptation(torch.tensor([0, 150, 0, 0, 150, 0, 0, 0, 0, 0]), gamma)
    assert phi.tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 0, 0]
    assert local_adaptation(torch.tensor([0, 150, 0, 0, 150, 0, 0, 0, 0, 0])).tolist()[1] == 5.0  # default 1/C


def write_spec(tmp_path, **change):
    raw = {
        "name": "toy", "title": "a toy table",
        "paper": {"title": "T", "authors": "A", "venue": "V", "table": "Table 9", "setting": "S",
                  "numbers": {"col": {"FedAvg": {"gm": [50.0, 1.0]}, "FedProx": {"gm": 40.0},
                                      "Local": {"gm": None, "pa": 90.0}}}},
        "dataset": "digits", "base": "digits",
        "config": {"partition.name": "iid", "partition.num_clients": 4, "model.hidden": [16],
                   "model.feature_dim": 8, "eval.final_all_clients": False, "output.checkpoint_every": 0},
        "settings": [{"id": "s1", "label": "iid", "paper": "col"}],
        "methods": [{"label": "FedAvg", "name": "fedavg", "paper": "FedAvg"},
                    {"label": "FedProx", "name": "fedprox", "params": {"mu": 0.01}, "paper": "FedProx"},
                    {"label": "Local", "name": "local", "paper": "Local", "role": "ablation"}],
        "metrics": [{"id": "gm", "label": "GM"}, {"id": "pa", "label": "PA"}],
        "rank": "gm",
        "claims": [{"id": "c1", "text": "FedAvg beats FedProx", "source": "here", "kind": "greater",
                    "metric": "gm", "a": "FedAvg", "b": "FedProx"},
                   {"id": "c2", "text": "Local has a GM", "source": "here", "kind": "greater",
                    "metric": "gm", "a": "Local", "b": "FedAvg"}],
        "scales": {"smoke": {"seeds": [0, 1], "config": {"rounds": 2}}, "cpu": {"seeds": [0]},
                   "paper": {"seeds": [0]}},
    }
    raw.update(change)
    p = tmp_path / "toy.yaml"
    p.write_text(yaml.safe_dump(raw, allow_unicode=True))
    return p


@pytest.mark.parametrize("change, key", [
    ({"methods": [{"label": "FedAvg", "name": "fedavg", "colour": 1}]}, "methods[0].colour"),
    ({"claims": [{"id": "x", "text": "t", "source": "s", "kind": "greater", "metric": "gm", "a": "Nope",
                  "b": "FedAvg"}]}, "claims[0]"),
    ({"claims": [{"id": "x", "text": "t", "source": "s", "kind": "greater", "metric": "gm", "a": "FedAvg"}]},
     "claims[0].b"),
    ({"settings": [{"id": "s1", "label": "iid", "paper": "nocol"}]}, "settings[0].paper"),
    ({"scales": {"smoke": {"seeds": [0]}, "cpu": {"seeds": [0]}}}, "scales.paper"),
])
def test_a_bad_table_file_names_the_key(tmp_path, change, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_spec(write_spec(tmp_path, **change))


def test_a_table_end_to_end_and_rebuilt_from_its_runs(tmp_path, monkeypatch):
    spec = load_spec(write_spec(tmp_path))
    monkeypatch.setattr("protofl.reproduce.get_spec", lambda name: spec)
    logs = []
    res, files, failed = reproduce("toy", "smoke", out=tmp_path / "out", jobs=1, log=logs.append,
                                   overrides=["execution.workers=0"])
    assert not failed and [f.name for f in files] == ["table.md", "table.csv", "report.html"]
    cells = res.cells["s1"]
    fedavg = cells["FedAvg"]["gm"]
    assert set(fedavg.values) == {0, 1} and fedavg.paper == 50.0 and fedavg.paper_std == 1.0
    # the cell: ours mean ± std over the two seeds, the paper's value in parentheses
    md = (tmp_path / "out" / "table.md").read_text()
    assert f"| FedAvg | {fedavg.mean:.2f} ± {fedavg.std:.2f} (50.00) |" in md
    assert "| Local† | – (–) |" in md  # no global model: no GM
    assert "protofl reproduce toy --scale smoke execution.workers=0" in md
    c1 = next(c for c in res.claims if c.claim.id == "c1")
    assert c1.verdict.verdict in (stats.SHOWN, stats.NOT_SHOWN) and "paired t-test" in c1.verdict.detail
    c2 = next(c for c in res.claims if c.claim.id == "c2")
    assert c2.verdict.verdict == stats.NOT_COMPARABLE
    assert res.ranks["s1"].n == 2  # FedAvg and FedProx have a paper GM
    rows = (tmp_path / "out" / "table.csv").read_text().splitlines()
    assert rows[0].startswith("setting,method,role,metric") and len(rows) == 1 + 3 * 2
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Table</h2>" in html and "data:image/png;base64" in html
    # a second call runs nothing (every run is complete) and writes the same table
    again = []
    reproduce("toy", "smoke", out=tmp_path / "out", jobs=1, log=again.append, overrides=["execution.workers=0"])
    assert sum("skip" in m for m in again) == 6 and not any(m.startswith("[run") for m in again)
    p = plan(spec, "smoke", out=tmp_path / "out", overrides=["execution.workers=0"])
    assert markdown_page(collect(p), date="D", mach="M") == markdown_page(res, date="D", mach="M")


def test_missing_runs_are_reported_not_invented(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    res = collect(plan(spec, "smoke", out=tmp_path / "none"))
    assert len(res.missing) == 6
    assert all(not c.present for per in res.cells["s1"].values() for c in per.values())
    assert all(c.verdict.verdict == stats.NOT_COMPARABLE for c in res.claims)
    assert "**Incomplete:** 6 run(s) not finished" in markdown_page(res, date="D", mach="M")


def test_methods_runs_only_the_rows_asked_for(tmp_path):
    from protofl.reproduce import execute, row_labels

    spec = load_spec(write_spec(tmp_path))
    p = plan(spec, "smoke", out=tmp_path / "out", overrides=["execution.workers=0"])
    with pytest.raises(ConfigError, match="rows of toy: FedAvg, FedProx, Local"):
        execute(p, jobs=1, log=lambda m: None, methods=["FedNH"])
    assert row_labels(p, "FedProx, Local") == ["FedProx", "Local"]
    assert execute(p, jobs=1, log=lambda m: None, methods=["FedProx"]) == []
    res = collect(p)
    done = {label for label, per in res.cells["s1"].items() if any(c.present for c in per.values())}
    assert done == {"FedProx"} and len(res.missing) == 4  # the other rows: listed as missing, not invented


def test_cli_list_dry_run_and_a_real_tables_smoke_scale(tmp_path, capsys):
    assert main(["reproduce", "list"]) == 0
    out = capsys.readouterr().out
    for name, spec in all_specs().items():
        assert f"| {name} |" in out
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| {name} |"))
        assert line.rstrip(" |").split(" | ")[-3:] == [str(spec.runs(s)) for s in ("smoke", "cpu", "paper")]
    assert main(["reproduce", "fednh-table1", "--scale", "paper", "--dry-run", "--out", str(tmp_path)]) == 0
    assert "66 runs in all" in capsys.readouterr().out
    assert main(["reproduce", "nosuch"]) == 2
    assert "no reproducible table" in capsys.readouterr().err
    # the spiral needs no data files: its smoke scale, end to end, from the command line
    assert main(["reproduce", "fednh-spiral", "--scale", "smoke", "--out", str(tmp_path / "sp"), "--jobs", "1",
                 "execution.workers=0"]) == 0
    md = (tmp_path / "sp" / "table.md").read_text()
    assert "**central, imbalanced**" in md and "fixed-head-protects-minority" in md
    assert json.loads((tmp_path / "sp" / "federated" / "sweep.json").read_text())["groups"].keys() == \
        {"FedAvg", "FedUH", "FedNH"}


# ---------------------------------------------------------------------------------------
# data.train_size
# ---------------------------------------------------------------------------------------
def test_train_size_subsets_before_the_partition(tmp_path):
    base = ["data.name=digits", "partition.name=iid", "partition.num_clients=4"]
    full = load_config(None, base)
    cfg = load_config(None, base + ["data.train_size=200"])
    assert "train_size" not in full.to_dict()["data"]  # unset: older fingerprints unchanged
    assert cfg.fingerprint() != full.fingerprint()
    fed = build_federated(cfg)
    assert sum(len(i) for i in fed.train_idx) == 200 and len(fed.dataset.y_train) == 200
    ref = build_federated(full).dataset
    keep = np.sort(np.random.default_rng(np.random.SeedSequence([0, SUBSET_TAG])).choice(len(ref.y_train), 200,
                                                                                          replace=False))
    assert np.array_equal(fed.dataset.y_train.numpy(), ref.y_train.numpy()[keep])
    assert len(fed.dataset.y_test) == len(ref.y_test)  # the test split stays whole
    with pytest.raises(ConfigError, match="data.train_size"):
        build_federated(load_config(None, base + ["data.train_size=100000"]))
    with pytest.raises(ConfigError, match="data.train_size"):
        load_config(None, base + ["data.train_size=0"])


def test_parse_spec_rejects_unknown_scales_and_setting_scales(tmp_path):
    raw = yaml.safe_load(write_spec(tmp_path).read_text())
    raw["settings"][0]["scales"] = {"huge": {"rounds": 9}}
    with pytest.raises(ConfigError, match="unknown scale"):
        parse_spec(raw, TABLES_DIR / "toy.yaml")
