"""Run records (protofl.records): what of a finished run is recorded, without machine paths;
a cut run is never taken for a finished one; a disagreeing record is refused; a table run
again from its records runs nothing and gives the same page; every published page whose
records are committed is rebuilt from them, word for word."""
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.errors import InputError
from protofl.records import CONFIG, copy_records, DATA_ROOT, finished, finished_runs, METRICS, RECORD, SUMMARY
from protofl.reproduce import reproduce
from protofl.reproduce.pages import read_summary
from protofl.reproduce.render import markdown_page

from conftest import shared_data
from test_reproduce import write_spec

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "benchmarks" / "reproductions"


def fake_run(folder: Path, status="complete", done=3, rounds=3, fp="abcd1234", gm=(0.5, 0.6, 0.7)) -> Path:
    folder.mkdir(parents=True)
    (folder / METRICS).write_text("".join(json.dumps({"round": r + 1, "gm": g}) + "\n" for r, g in enumerate(gm)))
    (folder / "clients.json").write_text(json.dumps({"num_clients": 2, "train_counts": [[1, 0], [0, 1]]}))
    (folder / CONFIG).write_text(yaml.safe_dump({"seed": 0, "rounds": rounds, "data": {"name": "digits",
                                                 "root": "/home/someone/data"},
                                                 "output": {"dir": str(folder.parent), "name": folder.name}}))
    (folder / SUMMARY).write_text(json.dumps({"status": status, "rounds_completed": done, "rounds": rounds,
                                              "fingerprint": fp}))
    (folder / "checkpoint.pt").write_bytes(b"\0" * 64)
    (folder / "model.pt").write_bytes(b"\0" * 64)
    return folder


def test_only_finished_runs_are_recorded_and_no_machine_path(tmp_path):
    src = tmp_path / "runs"
    fake_run(src / "s1" / "FedAvg-s0-aaaa")
    fake_run(src / "s1" / "FedAvg-s1-bbbb", status="running", done=2)  # cut: never recorded
    fake_run(src / "s1" / "FedAvg-s2-cccc", status="complete", done=2)  # a summary that lacks rounds
    (src / "s1" / "sweep.md").write_text("a table")
    assert finished_runs(src) == [src / "s1" / "FedAvg-s0-aaaa"]
    written = copy_records(src, tmp_path / "rec")
    run = tmp_path / "rec" / "s1" / "FedAvg-s0-aaaa"
    assert written == [run]
    assert sorted(p.name for p in run.iterdir()) == sorted(RECORD)  # no checkpoint, no model
    assert not (tmp_path / "rec" / "s1" / "sweep.md").exists()
    assert (run / METRICS).read_bytes() == (src / "s1" / "FedAvg-s0-aaaa" / METRICS).read_bytes()
    cfg = yaml.safe_load((run / CONFIG).read_text())
    assert cfg["data"]["root"] == DATA_ROOT and cfg["output"] == {"dir": "s1", "name": "FedAvg-s0-aaaa"}
    assert str(tmp_path) not in (run / CONFIG).read_text() and "/home/someone" not in (run / CONFIG).read_text()
    # copying again writes nothing; only= limits the copy to the runs named
    assert copy_records(src, tmp_path / "rec") == []
    assert copy_records(src, tmp_path / "other", only=[Path("s1/FedAvg-s1-bbbb")]) == []


def test_a_diverged_run_is_recorded_as_the_result_it_is(tmp_path):
    src = tmp_path / "runs"
    div = fake_run(src / "FedAvg-s0-aaaa", status="diverged", done=1, gm=(0.5,))  # NaN in round 2 of 3
    fake_run(src / "FedAvg-s1-bbbb", status="failed", done=1, gm=(0.5,))  # an error of the machine: not a result
    fake_run(src / "FedAvg-s2-cccc", status="diverged", done=3)  # every round done: not a divergence
    assert finished(div)["status"] == "diverged" and finished_runs(src) == [div]
    assert copy_records(src, tmp_path / "rec") == [tmp_path / "rec" / "FedAvg-s0-aaaa"]
    assert finished(tmp_path / "rec" / "FedAvg-s0-aaaa")["rounds_completed"] == 1


def test_a_cut_copy_is_not_finished_and_is_completed_later(tmp_path):
    src = fake_run(tmp_path / "runs" / "FedAvg-s0-aaaa").parent
    cut = fake_run(tmp_path / "rec" / "FedAvg-s0-aaaa", status="running", done=1)
    assert finished(cut) is None
    assert copy_records(src, tmp_path / "rec") == [cut]
    assert finished(cut)["status"] == "complete" and (cut / METRICS).read_text().count("\n") == 3


def test_a_record_that_disagrees_is_refused_never_overwritten(tmp_path):
    src = fake_run(tmp_path / "runs" / "FedAvg-s0-aaaa").parent
    # the same run made twice: other timings, the same results: accepted, nothing written
    twice = fake_run(tmp_path / "twice" / "FedAvg-s0-aaaa")
    (twice / METRICS).write_text((twice / METRICS).read_text().replace("}", ', "wall_s": 1.5}'))
    assert copy_records(src, tmp_path / "twice") == [] and "wall_s" in (twice / METRICS).read_text()
    other = fake_run(tmp_path / "rec" / "FedAvg-s0-aaaa", gm=(0.5, 0.6, 0.8))
    with pytest.raises(InputError, match="differs .* other results"):
        copy_records(src, tmp_path / "rec")
    assert (other / METRICS).read_text().endswith('"gm": 0.8}\n')
    (src / "FedAvg-s0-aaaa" / SUMMARY).unlink()
    fake_run(tmp_path / "runs2" / "FedAvg-s0-aaaa", fp="ffff0000")
    with pytest.raises(InputError, match="differs"):
        copy_records(tmp_path / "runs2", tmp_path / "rec")
    (tmp_path / "runs2" / "FedAvg-s0-aaaa" / "clients.json").unlink()
    with pytest.raises(InputError, match="without clients.json"):
        copy_records(tmp_path / "runs2", tmp_path / "rec3")


def test_a_table_run_again_from_its_records_runs_nothing(tmp_path, monkeypatch):
    load_spec_toy(tmp_path, monkeypatch)
    logs = []
    res, files, failed = reproduce("toy", "smoke", out=tmp_path / "out", jobs=1, log=logs.append,
                                   overrides=["execution.workers=0"], records=tmp_path / "rec")
    assert not failed and len(finished_runs(tmp_path / "rec")) == 6
    assert not list((tmp_path / "rec").rglob("*.pt"))
    # the recorded config is the run's config: the same fingerprint, read back
    for run in finished_runs(tmp_path / "rec"):
        assert load_config(run / CONFIG).fingerprint() == finished(run)["fingerprint"]
    # elsewhere, from the records alone: every run is skipped, and the page is the same
    again = []
    res2, _, _ = reproduce("toy", "smoke", out=tmp_path / "elsewhere", jobs=1, log=again.append,
                           overrides=["execution.workers=0"], records=tmp_path / "rec")
    assert sum("skip" in m for m in again) == 6 and not any(m.startswith("[run") for m in again)
    assert markdown_page(res2, date="D", mach="M") == markdown_page(res, date="D", mach="M")
    assert "--records RECORDS" in markdown_page(res, date="D", mach="M")  # an absolute folder is not shown
    # a records folder of another table is refused before anything runs
    (tmp_path / "rec" / "reproduce.json").write_text(json.dumps({"table": "other", "data": "substitute"}))
    with pytest.raises(ConfigError, match="--records"):
        reproduce("toy", "smoke", out=tmp_path / "third", jobs=1, log=again.append,
                  overrides=["execution.workers=0"], records=tmp_path / "rec")


def load_spec_toy(tmp_path, monkeypatch):
    from protofl.reproduce.spec import load_spec
    spec = load_spec(write_spec(tmp_path))
    monkeypatch.setattr("protofl.reproduce.get_spec", lambda name: spec)
    return spec


# pages published before run records existed: their runs are not kept anywhere (a page made
# since must come with its records, and leaves this list when it is made again with them)
BEFORE_RECORDS: set[str] = set()


def test_every_page_made_since_has_its_records():
    pages = {page.stem for page in PAGES.glob("*.md")}
    with_records = {page.stem for page, _ in published_with_records()}
    assert pages - with_records <= BEFORE_RECORDS, "a page published without its run records (--records)"
    assert not (with_records & BEFORE_RECORDS), "a page now has records: take it off BEFORE_RECORDS"


def published_with_records():
    """(page, records file) of every published page whose run records are committed: one
    file a page, ``records/<table>-<scale>.jsonl.gz`` (protofl.records.pack)."""
    out = []
    for page in sorted(PAGES.glob("*.md")):
        s = read_summary(page) or {}
        packed = PAGES / "records" / f"{page.stem}-{s.get('scale', '')}.jsonl.gz"
        if s and packed.is_file():
            out.append((page, packed))
    return out


def test_records_are_published_packed():
    """One file a page: no run folders under benchmarks/ (a page's records folder was
    hundreds of files); every records file of the reproductions and the comparison reads
    with one line of pandas (the privacy pages keep rows of their own: benchmarks/privacy)."""
    import pandas as pd

    assert not [p for p in (ROOT / "benchmarks").rglob(SUMMARY)], "unpacked run records: pack them"
    files = sorted(f for where in ("reproductions", "comparison") for f in (ROOT / "benchmarks" / where).rglob("*.jsonl.gz"))
    assert files
    for f in files:
        df = pd.read_json(f, lines=True, precise_float=True)
        assert list(df.columns) == ["run", "config", "summary", "clients", "metrics"] and len(df) > 0, f
        assert df.run.is_unique and all(isinstance(m, list) for m in df.metrics), f


def test_every_published_page_with_records_is_rebuilt_from_them(tmp_path):
    """The page's own command with --no-run, on a copy of its records: the same page but
    the line naming the date and machine it was made on."""
    pages = published_with_records()
    for page, folder in pages:
        text = page.read_text(encoding="utf-8")
        command = re.search(r"^```\n(protofl reproduce .*)\n```$", text, re.M).group(1).split()
        assert "--records" in command and (ROOT / command[command.index("--records") + 1]) == folder
        recs = tmp_path / page.stem / folder.name
        recs.parent.mkdir(parents=True)
        shutil.copyfile(folder, recs)
        args = command[1:]  # protofl reproduce TABLE ...: main() takes what follows "protofl"
        args[args.index("--records") + 1] = str(recs)
        if "--data-dir" in args:  # read only where a claim's difference is the same on every seed
            args[args.index("--data-dir") + 1] = str(shared_data())
        assert main(args + ["--no-run", "--out", str(tmp_path / page.stem / "out")]) == 0
        made = (tmp_path / page.stem / "out" / "table.md").read_text(encoding="utf-8")
        drop = re.compile(r"^Made by `protofl reproduce` on .*$|^protofl reproduce .*$", re.M)
        assert drop.sub("", made) == drop.sub("", text), page.name
        # nothing was written into the records: the check only reads them
        assert recs.read_bytes() == folder.read_bytes()
    if not pages:
        pytest.skip("no published page has committed run records yet")


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_sweep_goes_on_from_its_records_elsewhere(tmp_path, capsys, kind):
    """`protofl sweep --records`: one seed on one machine, both seeds on another from the
    first's records (a folder, or one records file): only the new seed runs, and the table
    is the one run in one go."""
    from conftest import DIGITS
    from protofl.records import read_packed

    args = ["sweep", str(DIGITS), "rounds=1", "partition.num_clients=4", "--grid", "algorithm.name=fedavg,local",
            "--jobs", "1"]
    rec = tmp_path / ("rec" if kind == "folder" else "rec.jsonl.gz")
    count = (lambda: len(finished_runs(rec))) if kind == "folder" else (lambda: len(read_packed(rec)))
    assert main([*args, "--seeds", "0", "--out", str(tmp_path / "a"), "--records", str(rec)]) == 0
    assert count() == 2
    capsys.readouterr()
    assert main([*args, "--seeds", "0,1", "--out", str(tmp_path / "b"), "--records", str(rec)]) == 0
    err = capsys.readouterr().err
    assert len(re.findall(r"^\[skip", err, re.M)) == 2 and len(re.findall(r"^\[run", err, re.M)) == 2, err
    assert count() == 4
    if kind == "file":
        return
    assert main([*args, "--seeds", "0,1", "--out", str(tmp_path / "c")]) == 0

    def table(folder):  # all but the seconds per round
        lines = (tmp_path / folder / "sweep.csv").read_text().splitlines()
        col = lines[0].split(",").index("s_per_round")
        return [[v for i, v in enumerate(ln.split(",")) if i != col] for ln in lines]

    assert table("b") == table("c")
