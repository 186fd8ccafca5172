"""The README's promises: every command of its Quick start runs as shown.

Each command of the Quick start block runs in an empty folder, in this process, in the
order the README gives. Only the length changes: runs, compares and sweeps get
``rounds=1`` (``--resume`` then ``rounds=2``, one more round) and the sweep ``--jobs 1``;
``runs/<run-a>`` and ``runs/<run-b>`` become two run folders the earlier commands made.
The tracker command runs with its extras installed and, with them hidden, must stop with
the one-line ``pip install`` error the README's comment promises. The tests never reach
the network (conftest sets ``PROTOFL_OFFLINE=1``), so a command that would download
(``protofl data fetch``, a run whose comment says it fetches) must stop with the offline
one-line error, exit code 2, that says where to place the files by hand; the fetch
itself is tested against a local server in test_fetch.py. Where the tracker extras are
not installed (only ``.[dev]``), the run of every command leaves that one out and ends as
skipped, naming it and the missing packages.
"""
import importlib.util
import re
import shlex

import pytest

from protofl.cli import main

from conftest import REPO


def quick_start() -> list[tuple[list[str], str]]:
    """(argv, comment) of each command in the README's Quick start block."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    out = []
    for line in block.splitlines():
        if not line.strip():
            continue
        argv = shlex.split(line, comments=True)  # a quoted '#' would stay; ">" is a word of its own
        comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
        out.append((argv, comment))
    return out


def shorter(argv: list[str]) -> list[str]:
    """The command with a short run length (see the module docstring)."""
    if argv[1] not in ("run", "compare", "sweep"):
        return argv
    extra = ["rounds=2" if "--resume" in argv else "rounds=1"]
    if argv[1] == "sweep":
        extra += ["--jobs", "1"]
    return [*argv, *extra]


def missing_trackers(argv: list[str]) -> list[str]:
    """The packages of the trackers a command asks for that are not installed."""
    from protofl.config import TRACKERS

    asked = [a.split("=", 1)[1].strip("[]").split(",") for a in argv if a.startswith("output.trackers=")]
    modules = [TRACKERS[t.strip()][0] for names in asked for t in names if t.strip() in TRACKERS]
    return [m for m in modules if importlib.util.find_spec(m) is None]


def test_every_quick_start_command_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = quick_start()
    assert len(commands) >= 10 and all(argv[0] == "protofl" for argv, _ in commands), commands
    ran, left_out = [], []
    for argv, comment in commands:
        argv = list(argv)
        missing = missing_trackers(argv)
        if missing:  # an extra that is not installed: the next test checks its one-line error
            left_out.append(f"`{' '.join(argv)}` needs {', '.join(missing)} ({comment})")
            continue
        if any("<run-" in a for a in argv):
            runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if (p / "metrics.jsonl").exists())
            argv = [a.replace("<run-a>", runs[0]).replace("<run-b>", runs[1]) for a in argv]
        redirect = argv.index(">") if ">" in argv else None
        target = argv[redirect + 1] if redirect is not None else None
        argv = shorter(argv[:redirect] if redirect is not None else argv)
        code = main(argv[1:])
        cap = capsys.readouterr()
        if argv[1:3] == ["data", "fetch"] or "fetches" in comment:  # would download: offline here
            assert code == 2 and cap.err.count("\n") == 1, (argv, cap.err)
            assert "PROTOFL_OFFLINE=1" in cap.err and "place the files by hand" in cap.err, cap.err
            ran.append(argv)
            continue
        assert code == 0, (argv, cap.err)
        assert "Traceback" not in cap.err, (argv, cap.err)
        if target:
            (tmp_path / target).write_text(cap.out)
        ran.append(argv)
        then = re.search(r"then: (protofl .+)$", comment)
        if then:  # "a copy to edit; then: protofl run my.yaml"
            follow = shorter(shlex.split(then.group(1)))
            assert main(follow[1:]) == 0, (follow, capsys.readouterr().err)
            capsys.readouterr()
            ran.append(follow)
        if "--resume" in argv:
            assert "rounds=" in cap.out or "2 rounds" in cap.out, cap.out
    assert (tmp_path / "my.yaml").read_text() == (REPO / "src/protofl/configs/digits.yaml").read_text()
    assert (tmp_path / "runs" / "compare" / "report.html").exists() and (tmp_path / "curves.png").exists()
    assert any(a[1:3] == ["run", "my.yaml"] for a in ran)
    if left_out:
        pytest.skip(f"ran {len(commands) - len(left_out)} of {len(commands)} commands; left out: "
                    + "; ".join(left_out))


def test_the_tracker_command_without_its_extras_stops_with_the_promised_line(tmp_path, monkeypatch, capsys):
    (argv, comment), = [(a, c) for a, c in quick_start() if any("trackers" in x for x in a)]
    assert "pip install 'protofl[tensorboard,mlflow]'" in comment
    monkeypatch.chdir(tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "mlflow") else find_spec(name, *a))
    assert main(shorter(argv)[1:]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'protofl[tensorboard]'" in err, err


def test_the_readme_states_the_suite_size_and_what_skips_without_data():
    text = (REPO / "README.md").read_text()
    m = re.search(r"runs\s+the\s+whole\s+suite\s+\((\d+)\s+tests;", text)
    assert m, "README.md: the suite's size is missing"
    passed, skipped = map(int, re.search(r"(\d+)\s+passed\s+and\s+(\d+)\s+skipped", text).groups())
    assert passed + skipped == int(m.group(1))
    assert re.search(r"without\s+the\s+real\s+datasets[^.]*?(\d+)\s+more\s+tests?\s+skip", text, re.I), \
        "README.md must say how many more tests skip without the real data"


@pytest.mark.parametrize("argv", [["run", "digits", "partition.name=iid", "model.name=lenet5"]])
def test_the_example_the_readme_used_to_show_fails_in_one_line(argv, tmp_path, monkeypatch, capsys):
    """`model.name=lenet5` on 8x8 digits (the old Quick start line) stops at once."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs inputs of at least 16x16" in err and "cnn_fmnist" in err
    assert not (tmp_path / "runs").exists()
