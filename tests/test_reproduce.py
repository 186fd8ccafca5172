"""`protofl reproduce`: the paired tests and rank correlation on hand-computed inputs, the
table files (every shipped table plans at every scale; the paper scale is the paper's
setting), a page built from committed run folders holding every trap (unequal seeds, a
reversal, a constant difference, a missing metric), a small table built end to end and
rebuilt from its finished runs, the index of pages, the CLI, and `data.train_size`."""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.data.build import SUBSET_TAG, build_federated
from protofl.reproduce import all_specs, collect, get_spec, plan, reproduce, stats
from protofl.reproduce.render import index_text, INDEX_END, INDEX_START, markdown_page, read_summary, write_all
from protofl.reproduce.run import Cell, judge, run_value, sample_count
from protofl.reproduce.spec import TABLES_DIR, Claim, load_spec, Metric, parse_spec

TRAPS = Path(__file__).parent / "fixtures" / "reproduce_traps"


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------
def by_seed(*values):
    return dict(enumerate(values))


def t2_upper(t):
    """P(T > t) for Student's t with 2 degrees of freedom: (1 - t / sqrt(2 + t^2)) / 2."""
    return (1 - t / math.sqrt(2 + t * t)) / 2


def test_paired_t_test_by_hand():
    # d = (1, 2, 3): mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 with 2 degrees of freedom
    v = stats.greater(by_seed(11.0, 12.0, 13.0), by_seed(10.0, 10.0, 10.0))
    assert v.verdict == stats.SHOWN
    t = v.tests[0]
    assert t.n == 3 and t.mean == pytest.approx(2.0) and t.sd == pytest.approx(1.0)
    assert t.p_for == pytest.approx(t2_upper(2 * math.sqrt(3)), abs=1e-9)  # 0.03709
    assert t.p_against == pytest.approx(1 - t2_upper(2 * math.sqrt(3)), abs=1e-9)
    # the interval beside it is the two-sided 90 % one, the two one-sided 95 % bounds:
    # t_{0.95, 2} = 0.9 / sqrt(2 * 0.95 * 0.05) = 2.91999
    half = 0.9 / math.sqrt(2 * 0.95 * 0.05) / math.sqrt(3)
    assert t.ci90 == pytest.approx((2 - half, 2 + half), abs=1e-9)
    assert "90 % CI +0.31 to +3.69, n = 3" in v.detail
    assert t.w_for == pytest.approx(0.125)  # 1/2^3: the smallest a 3-seed Wilcoxon can give
    # a difference inside the spread is not shown
    assert stats.greater(by_seed(11.0, 9.0, 10.5), by_seed(10.0, 10.0, 10.0)).verdict == stats.NOT_SHOWN


def test_a_reversal_is_contradicted_not_hidden():
    # d = (-2, -1.5, -1): mean -1.5, sd 0.5, t = -1.5 / (0.5 / sqrt 3) = -5.196; the opposite
    # direction's p = P(T_2 > 5.196) = 0.01755 < 0.05
    v = stats.greater(by_seed(8.0, 8.5, 9.0), by_seed(10.0, 10.0, 10.0))
    assert v.verdict == stats.CONTRADICTED
    assert v.tests[0].p_against == pytest.approx(t2_upper(1.5 * math.sqrt(3) / 0.5), abs=1e-9)
    # "each of" k rivals: contradicted when the opposite holds against one at 0.05 / k.
    # Against z, d = (-1, -2, -3): the opposite's p = 0.03709, below 0.05 but not 0.05 / 2
    hi = by_seed(80.0, 81.0, 82.0)
    z = by_seed(81.0, 83.0, 85.0)
    assert stats.greater(hi, z).verdict == stats.CONTRADICTED
    two = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "z": z})
    assert two.verdict == stats.NOT_SHOWN and "not above z" in two.detail
    far = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "w": by_seed(90.0, 91.5, 92.0)})
    assert far.verdict == stats.CONTRADICTED and "against w at p < 0.05 / 2 = 0.025 (Bonferroni" in far.detail


def test_three_seeds_at_least_and_constant_differences_by_their_size():
    a, b = {0: 1.0, 1: 2.0, 2: None, 3: 5.0}, {0: 0.0, 1: 1.0, 2: 7.0}
    d, seeds = stats.pairs(a, b)
    assert seeds == [0, 1] and d.tolist() == [1.0, 1.0]
    two = stats.greater(a, b, step=0.01)
    assert two.verdict == stats.NOT_COMPARABLE and "2 paired seed(s); a verdict needs 3" in two.detail
    # the same difference on every seed: it counts when at least one test sample in size
    a, b = by_seed(81.0, 82.0, 83.0), by_seed(80.0, 81.0, 82.0)
    assert stats.greater(a, b, step=0.5).verdict == stats.SHOWN
    small = stats.greater(a, b, step=2.0)
    assert small.verdict == stats.NOT_SHOWN and "one test sample (2 pts) in size; it is not" in small.detail
    assert stats.greater(a, b).verdict == stats.NOT_SHOWN  # the sample's size unknown: nothing counts
    assert stats.greater(b, a, step=0.5).verdict == stats.CONTRADICTED
    # 80.0 - 79.9 is not exactly 0.1 on every seed in floats: still a constant difference
    near = stats.greater(by_seed(80.0, 81.0, 82.0), by_seed(79.9, 80.9, 81.9), step=100 / 450)
    assert near.verdict == stats.NOT_SHOWN and near.tests[0].constant
    # the size is looked up only for a constant difference (it needs the data)
    def boom():
        raise AssertionError("looked up without need")
    assert stats.greater(by_seed(11.0, 12.0, 13.0), by_seed(10.0, 10.0, 10.0), step=boom).verdict == stats.SHOWN


def test_equal_three_ways_against_the_margin():
    a = by_seed(70.1, 70.0, 70.2)
    v = stats.equal(a, by_seed(70.0, 70.1, 70.1), margin=1.0)
    assert v.verdict == stats.SHOWN and "TOST with margin ±1 pts" in v.detail
    # 2 points apart, the 90 % interval (-2.29, -1.71) wholly beyond -1: shown different
    assert stats.equal(a, by_seed(72.0, 72.2, 72.1), margin=1.0).verdict == stats.CONTRADICTED
    # d = (-1.5, -1.0, -0.5): the interval (-1.84, -0.16) excludes 0 but reaches inside the
    # margin, so neither equality nor a difference beyond the margin is shown
    half = 0.9 / math.sqrt(2 * 0.95 * 0.05) * 0.5 / math.sqrt(3)
    v = stats.equal(by_seed(68.5, 69.0, 69.5), by_seed(70.0, 70.0, 70.0), margin=1.0)
    assert v.verdict == stats.NOT_SHOWN and v.tests[0].ci90 == pytest.approx((-1 - half, -1 + half))
    assert stats.equal(by_seed(70, 72, 68), by_seed(70, 70, 70), margin=1.0).verdict == stats.NOT_SHOWN
    # identical values on every seed are equal
    assert stats.equal(a, a, margin=1.0, step=0.01).verdict == stats.SHOWN


def test_not_worse_is_one_sided_against_the_margin():
    base = by_seed(70.0, 70.0, 70.0)
    assert stats.not_worse(by_seed(69.8, 70.1, 70.0), base, margin=1.0).verdict == stats.SHOWN
    assert stats.not_worse(by_seed(90.0, 80.0, 95.0), base, margin=1.0).verdict != stats.CONTRADICTED  # far above
    assert stats.not_worse(by_seed(67.0, 67.5, 66.5), base, margin=1.0).verdict == stats.CONTRADICTED
    v = stats.not_worse(by_seed(68.5, 70.5, 69.5), base, margin=1.0)  # d + 1 = (-0.5, 1.5, 0.5): t = 0.866
    assert v.verdict == stats.NOT_SHOWN and v.tests[0].p_for == pytest.approx(t2_upper(0.5 * math.sqrt(3)))
    # against several methods, the methods it is not shown for, without a double negative
    v = stats.each_of(base, {"x": by_seed(70.0, 70.5, 70.2), "y": by_seed(68.5, 70.5, 69.5)},
                      lambda a, b: stats.not_worse(a, b, margin=1.0), "not worse than")
    assert v.verdict == stats.NOT_SHOWN and v.detail.startswith("not worse than y: not shown at p < 0.05. vs x:")


def test_smaller_std_is_the_pitman_morgan_test():
    from scipy import stats as st

    xa, xb = [10.0, 11.0, 9.0, 10.5], [10.0, 14.0, 6.0, 11.0]
    s = [x + y for x, y in zip(xa, xb)]
    d = [x - y for x, y in zip(xa, xb)]
    ms, md = sum(s) / 4, sum(d) / 4
    sxy = sum((x - ms) * (y - md) for x, y in zip(s, d))
    r = sxy / math.sqrt(sum((x - ms) ** 2 for x in s) * sum((y - md) ** 2 for y in d))
    # cov(a + b, a - b) = var a - var b: the sign of r says which spreads more
    var = lambda x: sum((v - sum(x) / 4) ** 2 for v in x) / 3  # noqa: E731
    assert sxy / 3 == pytest.approx(var(xa) - var(xb))
    t = r * math.sqrt(2) / math.sqrt(1 - r * r)  # n - 2 = 2 degrees of freedom
    v = stats.smaller_std(dict(enumerate(xa)), dict(enumerate(xb)))
    test = v.tests[0]
    assert test.r == pytest.approx(r) and test.p_for == pytest.approx(st.t.cdf(t, 2))
    assert v.verdict == (stats.SHOWN if st.t.cdf(t, 2) < 0.05 else stats.NOT_SHOWN)
    assert "std over seeds 0.85 vs 3.30 pts (n = 4); Pitman-Morgan" in v.detail
    assert stats.smaller_std(dict(enumerate(xa)), dict(enumerate(xa))).verdict == stats.NOT_SHOWN


def test_best_keeps_the_intersection_union_rule():
    hi = by_seed(80.0, 81.0, 82.0)
    v = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "y": by_seed(60.0, 60.5, 62.0)})
    assert v.verdict == stats.SHOWN and "above each of them at p < 0.05" in v.detail
    v = stats.best(hi, {"x": by_seed(70.0, 71.0, 71.5), "z": by_seed(79.0, 83.0, 80.0)})
    assert v.verdict == stats.NOT_SHOWN and "not above z" in v.detail


def test_a_lower_is_better_claim_wins_with_the_smaller_values():
    claim = Claim(id="spread", text="", source="", kind="best", metric="pa_std", a="P",
                  among=["x", "y"], better="lower", min_effect=0.0)
    # P's spread is below both others by (1, 2, 3) and (2, 2.5, 4) points: shown
    cells = {"P": {"pa_std": Cell(by_seed(1.0, 1.0, 1.0), None)},
             "x": {"pa_std": Cell(by_seed(2.0, 3.0, 4.0), None)},
             "y": {"pa_std": Cell(by_seed(3.0, 3.5, 5.0), None)}}
    v = judge(claim, cells)
    assert v.verdict == stats.SHOWN and "vs x: +2.00 pts" in v.detail and "lower is better" in v.detail
    # a larger spread than y's, by 2 to 2.5 points (p = 0.003 < 0.05 / 2), contradicts it; against x
    # the gap is 3 on every seed, which counts for nothing while the test set's size is unknown
    cells["P"]["pa_std"] = Cell(by_seed(5.0, 6.0, 7.0), None)
    v = judge(claim, cells)
    assert v.verdict == stats.CONTRADICTED and "the opposite holds against y at" in v.detail


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
    # PM(V)/PM(L) over every client at scale paper, as in the paper; over the last round's at cpu
    assert c.eval.final_all_clients and plan(get_spec("fednh-table1"), "paper").metric("pm_v").key == "all_pm_v"
    cpu = plan(get_spec("fednh-table1"), "cpu")
    assert not cpu.settings[0].runs[0].cfg.eval.final_all_clients and cpu.metric("pm_v").key == "pm_v"
    # MP-FedCL's Table V runs K = 4, the paper's value for Digit-5 (its Table IV)
    dom = plan(get_spec("mpfedcl-table5-domains"), "cpu").settings[0].runs
    assert {r.cfg.algorithm.params["k"] for r in dom if r.label == "MP-FedCL"} == {4}
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
    for name, spec in all_specs().items():  # a verdict needs three seeds: every table fixes them
        assert len(spec.scales["cpu"].seeds) >= 3 and len(spec.scales["paper"].seeds) >= 3, name


def test_the_claims_of_the_tables_are_the_papers():
    for name, spec in all_specs().items():
        for c in spec.claims:
            if c.role == "paper":
                assert c.scope, (name, c.id)
                # a claim read off a table says so; a quotation carries no numbers of ours
                assert c.quoted or c.source.startswith("from Table"), (name, c.id)
    rebafl = {c.id: c for c in get_spec("rebafl-table1").claims}
    steady = rebafl["rebafl-stabilizes"]
    assert steady.kind == "steadier" and get_spec("rebafl-table1").metric(steady.metric).select == "spread:10"
    assert rebafl["fedavg-strong-baseline"].kind == "not_worse"
    kinds = {(n, c.id): c.kind for n, spec in all_specs().items() for c in spec.claims}
    assert kinds[("fedproto-table1", "fedproto-mh-equals-fedproto")] == "equal"
    assert kinds[("fednh-spiral", "uniformity-does-not-hurt-balanced")] == "not_worse"
    assert kinds[("mpfedcl-table5-domains", "mpfedcl-smaller-std-domains")] == "smaller_std"
    assert kinds[("fedgela-table5", "fedgela-ga-above-best-baseline")] == "best"


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
        "claims": [{"id": "c1", "text": "FedAvg beats FedProx", "source": "here", "scope": "there", "kind": "greater",
                    "metric": "gm", "a": "FedAvg", "b": "FedProx"},
                   {"id": "c2", "text": "Local has a GM", "source": "here", "kind": "greater",
                    "metric": "gm", "a": "Local", "b": "FedAvg", "role": "ablation"}],
        "scales": {"smoke": {"seeds": [0, 1], "config": {"rounds": 2}}, "cpu": {"seeds": [0, 1, 2]},
                   "paper": {"seeds": [0, 1, 2]}},
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
    ({"scales": {"smoke": {"seeds": [0]}, "cpu": {"seeds": [0, 1, 2]}}}, "scales.paper"),
    ({"scales": {"smoke": {"seeds": [0]}, "cpu": {"seeds": [0, 1]}, "paper": {"seeds": [0, 1, 2]}}},
     "scales.cpu.seeds"),
    ({"scales": {"smoke": {"seeds": [0, 0]}, "cpu": {"seeds": [0, 1, 2]}, "paper": {"seeds": [0, 1, 2]}}},
     "scales.smoke.seeds"),
    ({"scales": {"smoke": {"seeds": [0]}, "cpu": {"seeds": [0, 1, 2]},
                 "paper": {"seeds": [0, 1, 2], "metrics": {"nope": "all_pa"}}}}, "scales.paper.metrics"),
    ({"claims": [{"id": "x", "text": "t", "source": "s", "kind": "greater", "metric": "gm", "a": "FedAvg",
                  "b": "FedProx"}]}, "claims[0].scope"),
    ({"claims": [{"id": "x", "text": "t", "source": "Table 9", "scope": "s", "quoted": False, "kind": "greater",
                  "metric": "gm", "a": "FedAvg", "b": "FedProx"}]}, "claims[0].source"),
    ({"claims": [{"id": "x", "text": "t", "source": "s", "scope": "s", "kind": "steadier", "metric": "gm",
                  "a": "FedAvg", "b": "FedProx"}]}, "claims[0].metric"),
    ({"claims": [{"id": "x", "text": "t", "source": "s", "scope": "s", "kind": "not_worse", "metric": "gm",
                  "a": "FedAvg"}]}, "claims[0].b"),
    ({"metrics": [{"id": "gm", "label": "GM", "select": "spread:1"}]}, "metrics[0].select"),
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
    c1 = next(c for c in res.claims if c.claim.id == "c1")  # two seeds: no verdict
    assert c1.verdict.verdict == stats.NOT_COMPARABLE and "a verdict needs 3" in c1.verdict.detail
    c2 = next(c for c in res.claims if c.claim.id == "c2")
    assert c2.verdict.verdict == stats.NOT_COMPARABLE and "Local has no GM" in c2.verdict.detail
    assert res.ranks["s1"].n == 2  # FedAvg and FedProx have a paper GM
    rows = (tmp_path / "out" / "table.csv").read_text().splitlines()
    assert rows[0].startswith("setting,method,role,metric") and len(rows) == 1 + 3 * 2
    assert read_summary(tmp_path / "out" / "table.md")["seeds"] == [0, 1]
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
    assert "**Incomplete:** 6 run(s) of the planned seeds not finished" in markdown_page(res, date="D", mach="M")


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
    assert done == set() and len(res.missing) == 4  # the other rows: listed as missing, not invented
    # the rows that ran are listed apart (no cell: not every method finished those seeds)
    assert set(res.explore["s1"]) == {"FedProx"} and res.seeds["s1"] == []


# ---------------------------------------------------------------------------------------
# a page from committed run folders, every trap in them
# ---------------------------------------------------------------------------------------
def traps_plan(tmp_path, seeds=(3, 4), drop=()):
    """The traps table at scale cpu (seeds 0, 1, 2) with exploratory ``seeds``, its run
    folders copied from the fixture into the planned folders (``drop``: folders left out)."""
    p = plan(load_spec(TRAPS / "traps.yaml"), "cpu", seeds=list(seeds), out=tmp_path / "traps")
    for sp in p.settings:
        for r in sp.runs:
            src = TRAPS / "run_folders" / f"{r.label}-s{r.seed}"
            if src.is_dir() and src.name not in drop:
                shutil.copytree(src, r.dir)
    return p


def row(md: str, first: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {first} |"))


def test_a_page_from_run_folders_with_every_trap(tmp_path):
    p = traps_plan(tmp_path)
    assert p.planned == [0, 1, 2] and p.extra == [3, 4]
    res = collect(p)
    md = markdown_page(res, date="D", mach="M")
    # unequal seeds: FedAvg ran seeds 0-4, FedProx 0-2. Every cell is over 0, 1, 2 (FedAvg's
    # GM 80, 81, 82; with seeds 3 and 4 mixed in it would read 82.00 ± 1.58)
    assert res.seeds["s1"] == [0, 1, 2] and not res.missing
    assert row(md, "FedAvg") == "| FedAvg | 81.00 ± 1.00 (80.00) | 91.17 ± 1.26 (90.00) |"
    assert row(md, "Local") == "| Local | – (–) | 81.00 ± 1.00 (–) |"  # no global model: no GM
    assert "Seeds: 0, 1, 2, fixed for scale `cpu` in the table file before any run" in md
    assert "Exploratory seeds 3, 4: listed apart at the end" in md
    assert "protofl reproduce traps --scale cpu --seeds 3,4" in md
    assert "ours: FedProx 84.17 > FedAvg 81.00 > Ditto 80.60" in md  # the ranking, same seeds
    verdicts = {cr.claim.id: cr.verdict for cr in res.claims}
    # FedAvg - Ditto = +1.0, -0.2, +0.4 on the planned seeds: not shown. Seeds 3 and 4 (+1.0,
    # +0.9) would make it p = 0.027 if they were let in; they stay in the exploratory part
    assert verdicts["unequal-seeds"].verdict == stats.NOT_SHOWN
    assert stats.greater(by_seed(80.0, 81.0, 82.0, 83.0, 84.0), by_seed(79.0, 81.2, 81.6, 82.0, 83.1)).verdict \
        == stats.SHOWN
    assert row(md, "unequal-seeds").startswith("| unequal-seeds | iid | GM | FedAvg > Ditto | not shown | "
                                               "mean difference +0.40 pts (90 % CI -0.61 to +1.41, n = 3)")
    # a reversal: FedProx is 3.17 points above FedAvg, so "FedAvg > FedProx" is contradicted
    assert row(md, "reversal").startswith("| reversal | iid | GM | FedAvg > FedProx | **contradicted** | "
                                          "mean difference -3.17 pts (90 % CI -3.65 to -2.68, n = 3)")
    # a constant difference: +0.1 GM points on every seed is less than one test image of the
    # 450-image digits test set (100 / 450 = 0.222 points): not shown; +5 PA points is more
    n_test = len(build_federated(p.settings[0].runs[0].cfg).dataset.y_test)
    assert row(md, "constant-small") == (
        f"| constant-small | iid | GM | FedAvg > FedBABU | not shown | mean difference +0.10 pts on every one of "
        f"n = 3 seeds; zero spread, so no t-test: a constant difference counts only when at least one test sample "
        f"({100 / n_test:.3g} pts) in size; it is not |")
    assert verdicts["constant-large"].verdict == stats.SHOWN and verdicts["constant-large"].tests[0].constant
    # a missing metric: the verdict itself says FedProx is best against fewer rivals than claimed
    assert row(md, "missing-metric").startswith("| missing-metric | iid | GM | FedProx > each of FedAvg, Local | "
                                                "**shown**, against 1 of 2: no GM for Local | above each of them")
    # the claims as stated: the paper's words in quotation marks, a table's reading without
    assert '* `reversal`: "FedAvg beats FedProx." (Section 2) Scope: here' in md
    assert "* `constant-small`: FedAvg's GM is above FedBABU's. (from Table 9) Scope: here" in md
    # the exploratory part: per seed, never a mean across methods, never a verdict
    ex = md[md.index("## Exploratory: runs on other seeds"):]
    assert "| FedAvg | 83.00 (s3), 84.00 (s4) | 93.00 (s3), 94.00 (s4) |" in ex
    assert "* `unequal-seeds`, FedAvg − Ditto (GM): +1.00 (s3), +0.90 (s4)" in ex
    assert "Not finished on the exploratory seeds: s1 / FedProx / seed 3" in ex
    assert "**Incomplete" not in md and "shown" not in ex.split("<!--")[0]
    # the page's verdicts, machine-readable, for the index
    out = write_all(res, date="D")
    summary = read_summary(out[0])
    assert summary["seeds"] == [0, 1, 2] and summary["exploratory"] == [3, 4] and summary["complete"]
    assert {c["id"]: c["label"] for c in summary["claims"]}["missing-metric"] == \
        "shown, against 1 of 2: no GM for Local"
    csv = (tmp_path / "traps" / "table.csv").read_text()
    assert "s1,FedAvg,paper,gm,final,3,81.0000,1.0000,80.0000,,col,0:80.0000;1:81.0000;2:82.0000," \
           "3:83.0000;4:84.0000" in csv


def test_a_setting_without_all_its_planned_runs_gives_no_verdict(tmp_path):
    res = collect(traps_plan(tmp_path, seeds=(), drop=("FedBABU-s2",)))
    # the cells: the planned seeds every method finished; seed 2's other runs: apart
    assert res.seeds["s1"] == [0, 1] and res.missing == ["s1 / FedBABU / seed 2"]
    assert res.cells["s1"]["FedAvg"]["gm"].values == {0: pytest.approx(80.0), 1: pytest.approx(81.0)}
    assert res.explore["s1"]["FedAvg"]["gm"] == {2: pytest.approx(82.0)}
    assert all(cr.verdict.verdict == stats.NOT_COMPARABLE and "FedBABU seed 2" in cr.verdict.detail
               for cr in res.claims)
    md = markdown_page(res, date="D", mach="M")
    assert "Not every method finished them all, so the cells use the seeds every method of the setting " \
           "finished (iid: 0, 1) and the claims there get no verdict." in md
    assert "**Incomplete:** 1 run(s) of the planned seeds not finished: s1 / FedBABU / seed 2" in md


def test_a_spread_metric_and_the_test_set_behind_a_metric():
    rows = [{"round": r, "gm": g} for r, g in enumerate([0.70, 0.80, 0.82, 0.81, 0.85], start=1)]
    # the last 3 GM values 82, 81, 85: mean 82.667, sample std sqrt((0.444 + 2.778 + 5.444) / 2)
    assert run_value(rows, Metric("s", "gm", "spread", "spread:3")) == pytest.approx(math.sqrt(13 / 3))
    assert run_value(rows[:1], Metric("s", "gm", "spread", "spread:3")) is None  # one value has no spread
    fed = SimpleNamespace(num_clients=3, test_idx=[np.arange(5), np.arange(7), np.arange(11)],
                          feature_groups=np.array([0, 1, 1]), feature_group_names=["mnist", "digits"],
                          test_groups={"mnist": np.arange(40), "digits": np.arange(60)},
                          dataset=SimpleNamespace(y_test=np.array([0, 1, 1, 2] * 25)))
    assert sample_count("gm", fed) == 100 and sample_count("all_pm_v_std", fed) == 100
    assert sample_count("gm@logits", fed) == 100 and sample_count("gm_per_class[1]", fed) == 50
    assert sample_count("gm:digits", fed) == 60 and sample_count("pa", fed) == 23
    assert sample_count("pa:digits", fed) == 18 and sample_count("all_pa", fed) == 23


def test_the_index_of_pages_comes_from_the_pages(tmp_path, capsys):
    res = collect(traps_plan(tmp_path))
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "traps.md").write_text(markdown_page(res, date="D", mach="M"))
    (pages / "old.md").write_text("# a page made before pages carried their verdicts\n")
    text = index_text(pages, {"traps": None, "fednh-table1": None}, tmp_path)
    # the traps table has no paper_data: it runs the paper's own data, and its page says so
    assert "| [traps](pages/traps.md) | Traps: unequal seeds, a reversal, a constant difference, a missing metric | " \
           "`paper` | `cpu`: 0, 1, 2 (exploratory: 3, 4) |" in text
    assert "`reversal` (iid): contradicted" in text and "`missing-metric` (iid): shown, against 1 of 2" in text
    assert "| [old](pages/old.md) | – | – | – | made before pages carried their verdicts: regenerate it | – |" in text
    assert "No page yet: `fednh-table1`." in text
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# head\n\n{INDEX_START}\nold table\n{INDEX_END}\n\ntail\n")
    assert main(["reproduce", "index", "--pages", str(pages), "--write", str(results)]) == 0
    written = results.read_text()
    assert written.startswith("# head\n\n" + INDEX_START) and written.endswith(INDEX_END + "\n\ntail\n")
    assert "old table" not in written and "`reversal` (iid): contradicted" in written
    assert main(["reproduce", "index", "--pages", str(pages)]) == 0 and "`reversal` (iid)" in capsys.readouterr().out
    (tmp_path / "bare.md").write_text("no block\n")
    assert main(["reproduce", "index", "--pages", str(pages), "--write", str(tmp_path / "bare.md")]) == 2
    assert "no <!-- reproduce-index: start -->" in capsys.readouterr().err
    assert main(["reproduce", "index", "--pages", str(tmp_path / "nope")]) == 2


def test_exploratory_seeds_add_to_the_planned_ones(tmp_path):
    spec = load_spec(TRAPS / "traps.yaml")
    p = plan(spec, "cpu", seeds=[4, 0, 3], out=tmp_path)
    assert p.seeds == [0, 1, 2, 4, 3] and p.extra == [4, 3] and p.planned == [0, 1, 2]
    assert plan(spec, "cpu", seeds=[0, 1], out=tmp_path).extra == []


def test_cli_list_dry_run_and_a_real_tables_smoke_scale(tmp_path, capsys):
    assert main(["reproduce", "list"]) == 0
    out = capsys.readouterr().out
    assert "{{" not in out and "unfilled setting" not in out  # the settings filled from the planned configs
    assert "| MNIST (2,000 training images), mlp_mnist |" in out  # mpfedcl-table6's {{data.train_size}}, ...
    for name, spec in all_specs().items():
        assert f"| {name} |" in out
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| {name} |"))
        paper = spec.variant("paper")  # runs: "substitute / paper data" where the two differ
        assert line.rstrip(" |").split(" | ")[-3:] == [
            str(spec.runs(s)) + (f" / {paper.runs(s)}" if spec.has_paper_data else "") for s in ("smoke", "cpu", "paper")]
    assert main(["reproduce", "fednh-table1", "--scale", "paper", "--data", "substitute", "--dry-run",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "66 runs in all" in out and "{{" not in out
    assert main(["reproduce", "fednh-table1", "--scale", "paper", "--data", "paper", "--dry-run",
                 "--out", str(tmp_path / "p")]) == 0
    assert "198 runs in all" in capsys.readouterr().out  # six columns x 11 methods x 3 seeds
    assert main(["reproduce", "nosuch"]) == 2
    assert "no reproducible table" in capsys.readouterr().err
    # the spiral needs no data files: its smoke scale, end to end, from the command line
    assert main(["reproduce", "fednh-spiral", "--scale", "smoke", "--out", str(tmp_path / "sp"), "--jobs", "1",
                 "execution.workers=0"]) == 0
    md = (tmp_path / "sp" / "table.md").read_text()
    assert "**central, imbalanced**" in md and "fixed-head-protects-minority" in md
    grid = json.loads((tmp_path / "sp" / "federated" / "sweep.json").read_text())
    # two rounds leave some of the three at chance: named as collapsed, out of the table's rows
    collapsed = {why.split(":")[0] for why in grid.get("collapsed", {}).values()}
    assert set(grid["groups"]) | collapsed == {"FedAvg", "FedUH", "FedNH"}
    assert not set(grid["groups"]) & collapsed


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
