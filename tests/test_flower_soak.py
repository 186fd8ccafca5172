"""Soak: many SuperNodes, SuperNodes killed (SIGKILL) and restarted during the run.

The short form (the default, part of ``pytest -m flower``): 5 SuperNodes, 8 rounds, 2
kills. The full form of the reliability goal -- 20 SuperNodes, 30 rounds, a kill every few
rounds -- is the same test with

    PROTOFL_SOAK_NODES=20 PROTOFL_SOAK_ROUNDS=30 PROTOFL_SOAK_KILLS=8 \\
        pytest -m soak tests/test_flower_soak.py

Checked: the run finishes every round; the clients counted as lost are exactly the
killed ones, each from the round it died in (or, if it had replied already, the next
one, whose message went to the dead node) until its restarted SuperNode is readmitted,
at the latest two rounds after the round in which it was up (registered with the
SuperLink, its ClientApp worker ready); no process of the deployment outlives it; the test
process's file descriptors are back to what they were; the SuperLink's open file
descriptors and memory, and every SuperNode's, stay within bounds while nodes come and go.
"""
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from protofl.engine.simulation import read_rows  # noqa: E402
from protofl.flower.launch import LocalDeployment, _group_alive  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.soak]

NODES = int(os.environ.get("PROTOFL_SOAK_NODES", 5))
ROUNDS = int(os.environ.get("PROTOFL_SOAK_ROUNDS", 8))
KILLS = int(os.environ.get("PROTOFL_SOAK_KILLS", 2))


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d.name)] = (int(fields[1]), fields[0])
    return out


def descendants(roots) -> set[int]:
    table = _proc_table()
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {p for p, (pp, _) in table.items() if pp in frontier and p not in found}
        found |= frontier
    return {p for p in found if p in table and table[p][1] != "Z"}


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss_mb(pid: int) -> float:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
def test_soak_supernodes_killed_and_restarted(tmp_path):
    from test_flower_deploy import digits

    rng = random.Random(int(os.environ.get("PROTOFL_SOAK_SEED", 0)))
    # kill rounds in the run's first part (leaving rounds to see the node back), each a random node
    kill_rounds = sorted(rng.sample(range(2, ROUNDS - 2), min(KILLS, ROUNDS - 4)))
    victims = [rng.randrange(NODES) for _ in kill_rounds]
    cfg = digits(tmp_path, "algorithm.name=fedproto", f"partition.num_clients={NODES}", f"rounds={ROUNDS}",
                 "training.epochs=1", "partition.min_size=10", "output.checkpoint_every=2")
    run_dir = tmp_path / "flower"
    fd_before = fds("self")
    events, samples, problems, joined = [], {}, [], {}

    with LocalDeployment(tmp_path / "deployment", num_nodes=NODES) as dep:

        def rows() -> int:
            return len(read_rows(run_dir / "metrics.jsonl"))

        def wait_rows(n: int, timeout: float = 600) -> bool:
            deadline = time.monotonic() + timeout
            while rows() < n and time.monotonic() < deadline:
                time.sleep(0.1)
            return rows() >= n

        def sample(tag: str) -> None:
            pids = {"superlink": dep.superlink.pid}
            pids.update({f"node-{i}": p.pid for i, p in enumerate(dep.nodes)})
            samples[tag] = {}
            for name, pid in pids.items():
                tree = descendants([pid])
                samples[tag][name] = (sum(rss_mb(p) for p in tree if alive(p)),
                                      sum(fds(p) for p in tree if alive(p)))

        def chaos() -> None:
            try:
                if not wait_rows(1):
                    return
                sample("early")
                for rnd, victim in zip(kill_rounds, victims):
                    if not wait_rows(rnd - 1):  # round rnd's messages go out right after row rnd-1
                        return
                    rnd = rows() + 1  # later than planned when a restart took long (a loaded machine)
                    if rnd >= ROUNDS:  # no kill in the last round: its loss would not be seen
                        break
                    dep.kill_node(victim)  # SIGKILL: the SuperLink is not told
                    events.append((rnd, victim))
                    if not wait_rows(rnd):
                        return
                    proc = dep.restart_node(victim)
                    log = dep.workdir / f"supernode-{victim}.log"
                    deadline = time.monotonic() + 300  # registered and able to answer during round `joined`
                    while not all(m in log.read_text(errors="replace") for m in ("SuperNode ID", "worker ready")) \
                            and proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    joined[len(events) - 1] = rows() + 1
                wait_rows(ROUNDS - 1)
                sample("late")
            except Exception as e:  # seen by the main thread
                problems.append(repr(e))

        watcher = threading.Thread(target=chaos, daemon=True)
        watcher.start()
        res = dep.submit(cfg, run_dir, timeout=300 + ROUNDS * 60 + KILLS * 60, round_timeout=15)
        watcher.join(timeout=30)
        started = [dep.superlink] + dep.nodes + dep._others
        tree = descendants([p.pid for p in started if p.poll() is None])
    # after the with block: every process of the deployment is gone (Flower's SuperExec,
    # in a session of its own, exits by itself when it sees its SuperLink gone: allow it time)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in tree if alive(p)}
    assert not leaked, leaked
    assert not any(_group_alive(p.pid) for p in started)
    assert fds("self") <= fd_before + 2, (fd_before, fds("self"))

    assert not problems and res.returncode == 0, (problems, res.stdout[-3000:])
    assert events and len(events) <= len(kill_rounds), (events, res.stdout[-3000:])
    data = read_rows(run_dir / "metrics.jsonl")
    assert [r["round"] for r in data] == list(range(1, ROUNDS + 1)), res.stdout[-3000:]
    # who was lost when, from the server's log: exactly the killed clients, 1..3 rounds per kill
    lost_by_round = {int(r): [int(c) for c in re.findall(r"\d+", cs)]
                     for r, cs in re.findall(r"round (\d+): no reply from client\(s\) \[([\d, ]*)\]", res.stdout)}
    # (a node restarted late can miss the pass over every client after the last round, logged as
    # round R + 1, which has no row of its own)
    assert {r["round"]: r["lost"] for r in data if r["lost"]} == {r: len(c) for r, c in lost_by_round.items()
                                                                   if r <= ROUNDS}
    killed = {v for _, v in events}
    lost_clients = [c for cs in lost_by_round.values() for c in cs]
    assert set(lost_clients) == killed, (events, lost_by_round)
    for r, cs in lost_by_round.items():  # every loss belongs to a kill: from its round until readmitted
        for c in cs:
            assert any(x == c and k <= r <= joined.get(i, ROUNDS) + 1 for i, (k, x) in enumerate(events)), \
                (r, c, events, joined, lost_by_round)
    for i, (k, x) in enumerate(events):  # each kill cost its client at least one round
        assert any(x in lost_by_round.get(r, []) for r in (k, k + 1)), (k, x, lost_by_round)
    assert sum(r["arrived"] + r["lost"] for r in data) == NODES * ROUNDS
    # bounded resources while nodes came and went (generous bounds: no timing, only leaks)
    early, late = samples["early"], samples["late"]
    for name in early:
        rss0, fd0 = early[name]
        rss1, fd1 = late[name]
        assert rss1 < 2048, (name, early[name], late[name])
        if name == "superlink":
            assert rss1 <= rss0 + 300 and fd1 <= fd0 + 20 + 4 * NODES, (early[name], late[name])
