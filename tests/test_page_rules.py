"""What a results page may say: runs that are no result (diverged, collapsed) are named and
never averaged; "shown" needs an effect of a size and survives Holm's correction; the
recipe is read from the configs; records are one file a page, readable with pandas."""
import gzip
import json
import os
from pathlib import Path

import pytest
import yaml

from protofl.config import ConfigError
from protofl.errors import InputError
from protofl.records import carried, finished_runs, pack, read_packed, unpack
from protofl.report.recipe import method_lines, recipe_lines, setting
from protofl.reproduce import stats
from protofl.reproduce.render import filled as render_filled, markdown_page
from protofl.reproduce.run import collect
from protofl.reproduce.spec import load_spec
from protofl.run_folder import collapsed, health, read_rows

from test_reproduce import by_seed, row, traps_plan, write_spec


def run_folder(d: Path, accs, key="gm", classes=10, losses=None, status="complete", error=None) -> Path:
    d.mkdir(parents=True)
    rows = []
    for r, a in enumerate(accs, start=1):
        row_ = {"round": r, "train_loss": (losses or [1.0] * len(accs))[r - 1]}
        if a is not None:
            row_[key] = a
        rows.append(row_)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (d / "clients.json").write_text(json.dumps({"num_clients": 2, "num_classes": classes,
                                                "train_counts": [[1] * classes, [1] * classes]}))
    (d / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "rounds": len(accs), "data": {"name": "digits"}}))
    done = len(accs) if status == "complete" else len(accs) - 1
    (d / "summary.json").write_text(json.dumps({"status": status, "rounds": len(accs), "rounds_completed": done,
                                                "seed": 0, "fingerprint": "f", "error": error}))
    return d


# ---------------------------------------------------------------------------------------
# run health
# ---------------------------------------------------------------------------------------
def test_a_run_at_chance_collapsed_one_above_the_margin_did_not(tmp_path):
    # 10 classes: chance 10 %; the margin is 2 points either side
    at = run_folder(tmp_path / "a", [0.5, 0.119], losses=[0.8, 120.0])
    assert collapsed(at) == ("collapsed: its last GM (11.90 % in round 2) is within 2 points of chance (10.00 % "
                             "for 10 classes); its training loss jumped to 120 in round 2 (0.8 in round 1)")
    assert health(at) == collapsed(at)
    assert collapsed(run_folder(tmp_path / "b", [0.5, 0.121])) is None  # 2.1 points above chance
    assert collapsed(run_folder(tmp_path / "c", [0.5, 0.081])) is not None  # below chance, within 2
    # no global model: its GA; 3 classes: chance 33.33 %
    ga = run_folder(tmp_path / "d", [0.9, 0.34], key="ga", classes=3)
    assert collapsed(ga) == "collapsed: its last GA (34.00 % in round 2) is within 2 points of chance (33.33 % for 3 classes)"
    assert collapsed(run_folder(tmp_path / "e", [None, None])) is None  # never evaluated: not this rule's
    assert collapsed(run_folder(tmp_path / "f", [0.5, float("nan")])) is None
    # a loss that did not jump is not named
    assert "jumped" not in collapsed(run_folder(tmp_path / "g", [0.5, 0.1], losses=[1.0, 50.0]))


def test_health_names_a_divergence_and_passes_a_result(tmp_path):
    div = run_folder(tmp_path / "div", [0.5, 0.6], status="diverged", error="non-finite training loss (nan) in round 2")
    assert health(div) == "diverged: non-finite training loss (nan) in round 2"
    assert health(run_folder(tmp_path / "ok", [0.5, 0.9])) is None
    cut = run_folder(tmp_path / "cut", [0.5, 0.1], status="running")
    assert health(cut) is None  # not finished: not a result either way, and not this function's to say


# ---------------------------------------------------------------------------------------
# verdicts with a size, and Holm
# ---------------------------------------------------------------------------------------
def test_a_constant_difference_of_one_test_image_is_never_shown():
    a, b = by_seed(80.01, 81.01, 82.01), by_seed(80.0, 81.0, 82.0)
    # one test image of 10,000 is 0.01 points: it counts as a difference, but not as an effect
    assert stats.greater(a, b, step=0.01).verdict == stats.SHOWN  # no minimum effect: the old rule
    v = stats.greater(a, b, step=0.01, min_effect=0.5)
    assert v.verdict == stats.NOT_SHOWN and "only at 0.5 pts or more" in v.detail


def test_shown_needs_the_interval_above_the_minimum_effect():
    base = by_seed(80.0, 81.0, 82.0)
    # +2.0, +2.2, +1.8: mean 2, sd 0.2, 90 % CI 2 -/+ 2.92 * 0.2 / sqrt(3) = [1.66, 2.34]
    clear = stats.greater(by_seed(82.0, 83.2, 83.8), base, min_effect=0.5)
    assert clear.verdict == stats.SHOWN and clear.tests[0].ci90[0] == pytest.approx(2 - 2.919986 * 0.2 / 3 ** 0.5)
    assert "one-sided paired t-test of > 0.5 pts p =" in clear.detail
    # +0.3 on every seed give or take 0.01: surely above 0, not by 0.5: not shown, and not contradicted
    small = stats.greater(by_seed(80.3, 81.31, 82.29), base, min_effect=0.5)
    assert small.verdict == stats.NOT_SHOWN and stats.greater(by_seed(80.3, 81.31, 82.29), base).verdict == stats.SHOWN
    # below b is still contradicted (against 0, not against the minimum effect)
    assert stats.greater(by_seed(78.0, 79.1, 79.9), base, min_effect=0.5).verdict == stats.CONTRADICTED
    # "best": every rival past the minimum effect
    v = stats.best(by_seed(85.0, 86.0, 87.1), {"x": base, "y": by_seed(84.6, 85.6, 86.6)}, min_effect=0.5)
    assert v.verdict == stats.NOT_SHOWN and "not above y" in v.detail


def test_holm_keeps_a_shown_only_below_its_step_down_cut():
    def v(p, verdict=stats.SHOWN):
        return stats.Verdict(verdict, "d", p=p)

    # m = 3: cuts 0.0167, 0.025, 0.05 for the sorted p 0.001, 0.02, 0.04: all hold
    vs = [v(0.04), v(0.001), v(0.02)]
    assert stats.holm(vs) == 3 and [x.verdict for x in vs] == [stats.SHOWN] * 3
    # 0.01 < 0.0167 holds; 0.03 >= 0.025 falls, and so does 0.04 after it (step-down stops)
    vs = [v(0.04), v(0.01), v(0.03)]
    stats.holm(vs, "claims of the paper")
    assert [x.verdict for x in vs] == [stats.NOT_SHOWN, stats.SHOWN, stats.NOT_SHOWN]
    assert vs[2].note == "shown alone (p = 0.030), not after Holm's correction over 3 claims of the paper (needs p < 0.025)"
    assert vs[0].note.endswith("(a smaller p missed its cut, and Holm stops there)")  # 0.04 < 0.05, but after 0.03
    # a not-shown claim counts in m; a not-comparable one does not; contradicted is never changed
    vs = [v(0.02), v(0.6, stats.NOT_SHOWN), stats.Verdict(stats.NOT_COMPARABLE, "d"), v(0.99, stats.CONTRADICTED)]
    assert stats.holm(vs) == 3 and vs[0].verdict == stats.NOT_SHOWN and vs[3].verdict == stats.CONTRADICTED
    one = [v(0.04)]
    assert stats.holm(one) == 1 and one[0].verdict == stats.SHOWN  # alone, nothing to correct


def test_min_effect_is_checked_where_a_table_sets_it(tmp_path):
    path = write_spec(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["claims"][0]["min_effect"] = 2.5
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    assert spec.claims[0].effect == 2.5 and spec.claims[1].effect == stats.MIN_EFFECT
    for bad, kind in ((-1, "greater"), ("big", "greater"), (1.0, "equal")):
        raw["claims"][0].update(min_effect=bad, kind=kind)
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match="min_effect"):
            load_spec(path)


# ---------------------------------------------------------------------------------------
# a reproduction page with a collapsed run
# ---------------------------------------------------------------------------------------
def test_a_collapsed_run_leaves_its_cell_and_its_claims_but_not_the_others(tmp_path):
    p = traps_plan(tmp_path, seeds=())
    run = next(r for sp in p.settings for r in sp.runs if r.label == "FedBABU" and r.seed == 1)
    rows = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["gm"] = 0.101  # at chance for 10 classes
    (run.dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (run.dir / "clients.json").write_text(json.dumps({"num_clients": 4, "num_classes": 10}))
    res = collect(p)
    cell = res.cells["s1"]["FedBABU"]["gm"]
    assert cell.excluded == [1] and cell.values[1] is None and len(cell.present) == 2
    md = markdown_page(res, date="D", mach="M")
    assert "[2 of 3 seeds]" in row(md, "FedBABU")
    assert "* iid / FedBABU / seed 1: collapsed: its last GM (10.10 % in round" in md
    verdicts = {cr.claim.id: cr.verdict for cr in res.claims}
    assert verdicts["constant-small"].verdict == stats.NOT_COMPARABLE  # FedAvg > FedBABU
    assert "no result from FedBABU seed 1" in verdicts["constant-small"].detail
    assert verdicts["reversal"].verdict == stats.CONTRADICTED  # FedAvg vs FedProx: untouched
    assert res.complete("s1") and not res.missing  # a run that is no result is not a missing run
    assert "FedBABU" not in res.ranks["s1"].our_order  # its mean is over two seeds: not ranked


def test_a_page_says_how_its_claims_are_corrected(tmp_path):
    res = collect(traps_plan(tmp_path, seeds=()))
    assert res.holm == {"paper": 5, "ablation": 0}  # every claim of the traps is tested
    md = markdown_page(res, date="D", mach="M")
    assert "Holm's step-down at 0.05 over the paper's 5 claims" in md


# ---------------------------------------------------------------------------------------
# the recipe, read from configs
# ---------------------------------------------------------------------------------------
def cfg(**training):
    t = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "schedule": "exponential",
         "lr_decay": 1.0, "epochs": 5, "steps": None, "batch_size": 64, "clip_grad": None, **training}
    return {"rounds": 20, "data": {"name": "fmnist", "train_size": 20000}, "model": {"name": "cnn_fmnist"},
            "partition": {"name": "dirichlet", "num_clients": 100, "beta": 0.3, "min_size": 10},
            "participation": {"fraction": 0.1, "clients_per_round": None, "sampling": "fixed"},
            "training": t, "algorithm": {"name": "x"}, "eval": {"every": 10}}


def test_the_recipe_states_what_the_configs_say_and_who_differs():
    own = cfg()
    own["algorithm"]["clip_grad"] = 20.0
    lines = recipe_lines({"fedavg": [cfg(), cfg()], "fednh": [cfg(weight_decay=1e-5, lr_decay=0.99, clip_grad=10.0)],
                          "fedgela": [own]})
    assert lines[0] == ("Recipe, read from the configs of the 4 runs: SGD lr 0.01, momentum 0.9, weight decay 0; "
                        "constant lr; no gradient clip; 5 local epochs, batch 64; 20 rounds, 100 clients, a fraction "
                        "0.1 a round; fmnist, a seeded 20,000 training samples, model cnn_fmnist; Dirichlet(0.3), the "
                        "whole split redrawn until every client has at least 10 training samples; evaluated every 10 "
                        "rounds.")
    assert lines[1] == ("Where methods' runs differ from it: fednh: SGD lr 0.01, momentum 0.9, weight decay 1e-05; "
                        "fednh: lr x 0.99 a round; fednh: gradient clip 10; fedgela: gradient clip 20 (the method's "
                        "own).")
    assert recipe_lines({}) == [] and len(recipe_lines({"fedavg": [cfg()]})) == 1


def test_each_methods_own_settings_are_read_from_its_configs():
    def alg(name, **kw):
        return {"algorithm": {"name": name, "weighting": "samples", "server_opt": "none", "server_lr": None,
                              "server_momentum": 0.9, "server_beta2": 0.999, "server_tau": 0.001,
                              "clip_grad": None, **kw}}
    lines = method_lines({"FedAvg": [alg("fedavg")] * 2, "FedProx": [alg("fedprox", mu=0.01)],
                          "Scaffold": [alg("scaffold", server_lr=1.0, weighting="uniform")],
                          "FedUH": [alg("fednh", rho=1.0)], "Adam": [alg("fedavg", server_opt="adam")],
                          "AvgM": [alg("fedavg", server_opt="avgm", server_lr=0.5)]})
    # of the server optimizer's settings only those it reads (AvgM: no beta2, no tau), its
    # null step size as the optimizer's default; the clip is the recipe's
    assert lines == ["Methods' settings, read from the same configs (their algorithm section): every method that "
                     "has them: server_opt none, weighting samples, unless named; Adam (fedavg): server_beta2 0.999, "
                     "server_lr 0.01 (the optimizer's default), server_momentum 0.9, server_opt adam, server_tau "
                     "0.001; AvgM (fedavg): server_lr 0.5, server_momentum 0.9, server_opt avgm; FedProx: mu 0.01; "
                     "FedUH (fednh): rho 1; Scaffold: server_lr 1, weighting uniform."]
    assert method_lines({}) == []


def test_a_setting_for_the_prose_is_one_value_of_the_runs():
    runs = {"FedAvg": [cfg(), cfg()], "FedNH": [cfg(momentum=0.5)]}
    assert setting(runs, "training.lr") == "0.01" and setting(runs, "rounds") == "20"
    assert setting(runs, "training.momentum", "FedNH") == "0.5"
    assert setting(runs, "training.clip_grad") == "none"
    with pytest.raises(ValueError, match="training.momentum is not one value over the runs: 0.5, 0.9"):
        setting(runs, "training.momentum")
    with pytest.raises(ValueError, match="algorithm.mu of FedNH is not one value over the runs: absent"):
        setting(runs, "algorithm.mu", "FedNH")
    with pytest.raises(ValueError, match="no run of FedProx"):
        setting(runs, "training.lr", "FedProx")


def test_the_notes_state_the_settings_of_the_runs(tmp_path):
    """A table file's prose says {{key}} or {{Label: key}}; the page states the runs' value
    there, and in brackets what it cannot read."""
    import dataclasses

    p = traps_plan(tmp_path, seeds=())
    for sp in p.settings:
        for r in sp.runs:
            if (r.dir / "metrics.jsonl").exists():
                c = cfg(momentum=0.5)
                c["algorithm"] = {"name": r.label.lower(), **({"mu": 0.01} if r.label == "FedProx" else {})}
                (r.dir / "config.yaml").write_text(yaml.safe_dump(c))
    p.spec = dataclasses.replace(p.spec, notes="SGD momentum {{training.momentum}}, FedProx mu {{ FedProx : "
                                 "algorithm.mu }}; Ditto's {{Ditto: algorithm.mu}}; {{algorithm.mu}}; "
                                 "{{FedProxx: algorithm.mu}}.")
    md = markdown_page(collect(p), date="D", mach="M")
    assert ("SGD momentum 0.5, FedProx mu 0.01; Ditto's [unfilled setting: algorithm.mu of Ditto is not one value "
            "over the runs: absent]; [unfilled setting: algorithm.mu is not one value over the runs: 0.01, absent]; "
            "[unfilled setting: algorithm.mu: no run of FedProxx to read it from].") in md
    assert "Methods' settings, read from the same configs (their algorithm section): FedProx: mu 0.01." in md


def test_a_settings_note_is_filled_from_its_own_runs(tmp_path):
    """Two settings whose runs differ in a key: each setting's note reads its own runs."""
    import dataclasses

    from protofl.reproduce.render import UNFILLED

    p = traps_plan(tmp_path, seeds=())
    for sp in p.settings:
        for r in sp.runs:
            if (r.dir / "metrics.jsonl").exists():
                (r.dir / "config.yaml").write_text(yaml.safe_dump(cfg()))
    s = p.spec.settings[0]
    p.spec = dataclasses.replace(p.spec, settings=[dataclasses.replace(s, note="batch {{training.batch_size}}"),
                                                   dataclasses.replace(s, id="s2", label="other", note="x")])
    res = collect(p)
    assert f"{s.label}: batch 64" in markdown_page(res, date="D", mach="M")
    assert UNFILLED in render_filled("{{training.batch_size}}", res, "s2")  # no run of s2: said so


def test_no_published_page_has_a_setting_it_could_not_read():
    from protofl.reproduce.render import UNFILLED

    pages = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "reproductions").glob("*.md"))
    assert len(pages) == 8
    for page in pages:
        text = page.read_text()
        assert "{{" not in text and "}}" not in text and UNFILLED not in text, page


def test_a_paper_datasets_line_takes_no_setting(tmp_path):
    """paper_data.dataset is shown on the substitute's page too, beside the substitute's runs."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "src/protofl/reproduce/tables/"
                          "fedgela_table4.yaml").read_text())
    raw["paper_data"]["dataset"] = "CIFAR-10 with {{model.name}}"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    with pytest.raises(ConfigError, match="paper_data.dataset"):
        load_spec(path)


# ---------------------------------------------------------------------------------------
# records: one file a page
# ---------------------------------------------------------------------------------------
def test_a_records_file_round_trips_and_is_the_same_bytes_for_the_same_runs(tmp_path):
    import pandas as pd

    src = tmp_path / "runs"
    run_folder(src / "s1" / "FedAvg-s0-aaaa", [0.5, 0.6])
    run_folder(src / "s1" / "FedAvg-s1-bbbb", [0.5, 0.7])
    run_folder(src / "s1" / "FedAvg-s2-cccc", [0.5, 0.7], status="running")  # cut: not recorded
    assert pack(src, tmp_path / "r.jsonl.gz") == 2
    first = (tmp_path / "r.jsonl.gz").read_bytes()
    assert pack(src, tmp_path / "r.jsonl.gz") == 2 and (tmp_path / "r.jsonl.gz").read_bytes() == first
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "r.jsonl.gz").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0o600
    df = pd.read_json(tmp_path / "r.jsonl.gz", lines=True, precise_float=True)
    assert df.run.tolist() == ["s1/FedAvg-s0-aaaa", "s1/FedAvg-s1-bbbb"]
    assert df.metrics[1][-1] == {"round": 2, "train_loss": 1.0, "gm": 0.7}
    back = unpack(tmp_path / "r.jsonl.gz", tmp_path / "back")
    assert [p.relative_to(tmp_path / "back").as_posix() for p in back] == df.run.tolist()
    for p in back:
        orig = src / p.relative_to(tmp_path / "back")
        assert read_rows(p / "metrics.jsonl") == read_rows(orig / "metrics.jsonl")
        for name in ("summary.json", "clients.json"):
            assert json.loads((p / name).read_text()) == json.loads((orig / name).read_text())
        assert yaml.safe_load((p / "config.yaml").read_text())["data"] == {"name": "digits"}
    assert finished_runs(tmp_path / "back") == back
    with pytest.raises(InputError, match=r"\*\.jsonl\.gz"):
        pack(src, tmp_path / "r.json")


def test_a_damaged_or_hostile_records_file_is_refused(tmp_path):
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"run": "a"')[:-6])
    with pytest.raises(InputError, match="not a records file"):
        read_packed(tmp_path / "cut.jsonl.gz")
    (tmp_path / "odd.jsonl.gz").write_bytes(gzip.compress(b'{"run": "a"}\n'))
    with pytest.raises(InputError, match="not a run's record"):
        read_packed(tmp_path / "odd.jsonl.gz")
    entry = {"run": "../../escape", "config": {}, "summary": {}, "clients": {}, "metrics": []}
    (tmp_path / "up.jsonl.gz").write_bytes(gzip.compress((json.dumps(entry) + "\n").encode()))
    with pytest.raises(InputError, match="outside the records"):
        unpack(tmp_path / "up.jsonl.gz", tmp_path / "dest")
    assert not (tmp_path / "escape").exists()


def test_a_grid_goes_on_from_a_records_file(tmp_path):
    """carried() with a file: the runs in it are brought in as finished; the runs finished
    during the block are added to it, the others kept."""
    rec = tmp_path / "rec.jsonl.gz"
    out = tmp_path / "out"
    run_folder(tmp_path / "a" / "FedAvg-s0-aaaa", [0.5, 0.6])
    pack(tmp_path / "a", rec)
    logs = []
    with carried(rec, out, [Path("FedAvg-s0-aaaa"), Path("FedAvg-s1-bbbb")], logs.append):
        assert (out / "FedAvg-s0-aaaa" / "summary.json").is_file()  # brought in as finished
        run_folder(out / "FedAvg-s1-bbbb", [0.5, 0.7])  # "run" during the block
    assert [r["run"] for r in read_packed(rec)] == ["FedAvg-s0-aaaa", "FedAvg-s1-bbbb"]
    assert logs == [f"1 finished run(s) from the records in {rec}", f"1 run record(s) written to {rec}"]
    before = rec.read_bytes()
    with carried(rec, tmp_path / "elsewhere", [Path("FedAvg-s0-aaaa")]):
        pass
    assert rec.read_bytes() == before  # nothing new: the file is not rewritten


def test_a_table_refuses_a_records_file_of_another_table(tmp_path, monkeypatch):
    from protofl.reproduce import reproduce
    from test_records import load_spec_toy

    load_spec_toy(tmp_path, monkeypatch)
    entry = {"run": "other/FedAvg-s0-ffff", "config": {}, "summary": {}, "clients": {}, "metrics": []}
    (tmp_path / "other.jsonl.gz").write_bytes(gzip.compress((json.dumps(entry) + "\n").encode()))
    with pytest.raises(ConfigError, match="holds none of the runs of toy"):
        reproduce("toy", "smoke", out=tmp_path / "out", jobs=1, log=lambda m: None, run=False,
                  overrides=["execution.workers=0"], records=tmp_path / "other.jsonl.gz")


# ---------------------------------------------------------------------------------------
# the docs quote verdicts only through blocks filled from the pages
# ---------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
VERDICT_WORDS = ("*shown*", "*not shown*", "*contradicted*", "*shown equal*", "*shown different*")


def test_the_docs_quote_every_verdict_from_its_page():
    from protofl.reproduce.pages import fill_quotes, QUOTE

    docs = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    blocks = 0
    for f in docs:
        text = f.read_text(encoding="utf-8")
        assert fill_quotes(text, ROOT, str(f)) == text, f"{f}: stale quotes: protofl reproduce quotes --write"
        blocks += len(QUOTE.findall(text))
    assert blocks >= 30
    # a method page states no verdict of its own: every verdict word there is in a block
    for f in sorted((ROOT / "docs" / "methods").glob("*.md")):
        outside = QUOTE.sub("", f.read_text(encoding="utf-8"))
        assert not [w for w in VERDICT_WORDS if w in outside], f"{f}: a verdict typed by hand"


def test_a_quote_names_what_it_cannot_find(tmp_path):
    from protofl.reproduce.pages import fill_quotes

    page = tmp_path / "page.md"
    page.write_text('x\n<!-- protofl-reproduce {"claims": [{"id": "c1", "setting": "s", "verdict": "shown", '
                    '"label": "shown", "line": "+1.00 pts"}]} -->\n')
    text = "a <!-- verdicts: page.md c1 -->old<!-- /verdicts --> b"
    assert fill_quotes(text, tmp_path) == "a <!-- verdicts: page.md c1 -->*shown* on s (+1.00 pts)<!-- /verdicts --> b"
    with pytest.raises(InputError, match="no claim 'c2'"):
        fill_quotes(text.replace("c1", "c2"), tmp_path)
    with pytest.raises(InputError, match="no page other.md"):
        fill_quotes(text.replace("page.md", "other.md"), tmp_path)


def test_a_table_on_changed_paper_data_says_so(tmp_path):
    path = write_spec(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["data_changes"] = "the noise is smaller than the paper's"
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    assert spec.data_text() == "Data: the paper's own, changed: the noise is smaller than the paper's"
    raw["substitute"] = "digits for something"
    raw["paper_data"] = {"dataset": "the real thing"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="data_changes"):
        load_spec(path)


def test_the_published_spiral_says_its_data_is_changed():
    from protofl.reproduce.pages import read_summary

    page = ROOT / "benchmarks" / "reproductions" / "fednh-spiral.md"
    assert read_summary(page)["data_changed"] is True
    assert "Data: the paper's own, changed:" in page.read_text(encoding="utf-8")
    assert "| `paper`, changed |" in (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")


def test_every_cell_is_read_from_its_own_methods_runs(tmp_path):
    """No copied column (fedgela-table5 once showed FedProx's and FedRS's PA cells alike to
    the last digit): with every run of the real table given values of its own, each cell
    holds exactly its method's values, seed by seed, and no two methods' cells agree."""
    from protofl.reproduce import get_spec, plan as make_plan

    p = make_plan(get_spec("fedgela-table5"), "cpu", out=tmp_path / "t5")
    dirs = [r.dir for sp in p.settings for r in sp.runs]
    assert len(set(dirs)) == len(dirs)  # one folder a run
    labels = [m.label for m in p.spec.methods]
    want = {}
    for sp in p.settings:
        for r in sp.runs:
            i = labels.index(r.label)
            vals = {m.key.split("[")[0]: 0.5 + 0.01 * i + 0.001 * r.seed + 0.0001 * j for j, m in enumerate(p.metrics)}
            rows = [{"round": r.cfg.rounds, "train_loss": 0.5, "gm": vals.get("ga", 0.5), **vals}]
            r.dir.mkdir(parents=True)
            (r.dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
            (r.dir / "summary.json").write_text(json.dumps({"status": "complete", "rounds": r.cfg.rounds,
                                                             "rounds_completed": r.cfg.rounds, "seed": r.seed}))
            for met in p.metrics:
                want[(sp.setting.id, r.label, met.id, r.seed)] = 100 * vals[met.key.split("[")[0]]
    res = collect(p)
    for (sid, label, mid, seed), v in want.items():
        assert res.cells[sid][label][mid].values[seed] == pytest.approx(v), (label, mid, seed)
    for sid, per in res.cells.items():
        for met in p.metrics:
            columns = {label: tuple(cells[met.id].values.values()) for label, cells in per.items()}
            assert len(set(columns.values())) == len(columns) == len(labels), (sid, met.id)


def test_a_grid_table_leaves_a_collapsed_run_out_and_names_it(tmp_path):
    """protofl compare / sweep (api.finish_grid): a run at chance is no result in their
    tables either."""
    from protofl import api

    out = tmp_path / "grid"
    ok = [run_folder(out / f"fedavg-s{s}", [0.5, 0.8 + s / 100]) for s in (0, 1)]
    bad = run_folder(out / "fedavg-s2", [0.5, 0.1], losses=[1.0, 500.0])
    logs = []
    rows = api.finish_grid({"fedavg": [*ok, bad]}, out, "sweep", report=False, log=logs.append)
    assert rows[0]["count"]["gm"] == 2 and rows[0]["gm"][0] == pytest.approx(0.805)
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["groups"] == {"fedavg": ["fedavg-s0", "fedavg-s1"]}
    assert saved["collapsed"]["fedavg-s2"].startswith("fedavg: collapsed: its last GM (10.00 % in round 2)")
    assert "Left out, no result: fedavg-s2 (fedavg: collapsed:" in (out / "sweep.md").read_text()
    assert logs and logs[0].startswith("[collapsed] fedavg:") and "left out of the table" in logs[0]


def test_the_gap_to_the_paper_and_the_run_time_are_read_from_the_runs(tmp_path):
    """The traps' cells (ours (paper)): GM FedAvg 81.00 (80), FedProx 84.17 (79), Ditto
    80.60 (78); PA FedAvg 91.17 (90), the others without a paper value. Run time: each
    round's recorded wall_s, summed per run."""
    from protofl.reproduce.render import gap_lines, time_lines

    p = traps_plan(tmp_path, seeds=())
    for sp in p.settings:
        for r in sp.runs:
            path = r.dir / "metrics.jsonl"
            if path.exists():
                rows = [json.loads(x) for x in path.read_text().splitlines()]
                for x in rows:  # 30 s a round for seed 0, 60 s for the others
                    x["wall_s"] = 30.0 if r.seed == 0 else 60.0
                path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    res = collect(p)
    assert gap_lines(res) == ["Ours minus the paper's (iid, points): GM from +1.0 (FedAvg) to +5.2 (FedProx), "
                              "median +2.6 over 3 methods; PA +1.2 (FedAvg)."]
    n_rounds = {len(read_rows(r.dir / "metrics.jsonl")) for sp in p.settings for r in sp.runs if r.seed in (0, 1, 2)
                and (r.dir / "metrics.jsonl").exists()}
    assert len(n_rounds) == 1  # every traps run has the same rounds
    k, runs = n_rounds.pop(), sum(1 for sp in p.settings for r in sp.runs if r.seed in (0, 1, 2)
                                  and (r.dir / "metrics.jsonl").exists())
    assert time_lines(res) == [f"Run time (iid), the recorded rounds' wall-clock summed: median {k:.1f} minutes a "
                               f"run, {k / 2:.1f} to {k:.1f}, over {runs} runs."]
    assert gap_lines(res)[0] in markdown_page(res, date="D", mach="M")
