"""SuperNode authentication and TLS over real Flower processes: registered SuperNodes train;
an unregistered one, and a registered one without TLS, are refused (``protofl flower
keys|register``, ``superlink --auth``); a killed node rejoins and its client cannot be
claimed by another registered node."""
import math
import subprocess

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from protofl.flower.launch import LocalDeployment, supernode_keys, throwaway_certificates  # noqa: E402


def test_supernode_keys_are_openssh_ecdsa_p384_pairs(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    keys = supernode_keys(tmp_path / "keys", ["a", "b"])
    priv, pub = keys["a"]
    sk = load_ssh_private_key(priv.read_bytes(), None)
    pk = load_ssh_public_key(pub.read_bytes())
    assert isinstance(sk, ec.EllipticCurvePrivateKey) and sk.curve.name == "secp384r1"
    assert sk.public_key().public_numbers() == pk.public_numbers()
    assert priv.stat().st_mode & 0o777 == 0o600
    assert keys["a"][1].read_bytes() != keys["b"][1].read_bytes()
    # an existing pair is kept
    assert supernode_keys(tmp_path / "keys", ["a"])["a"][1].read_bytes() == pub.read_bytes()


@pytest.mark.flower
def test_authenticated_nodes_train_intruders_are_refused_and_a_killed_node_rejoins_unclaimed(tmp_path):
    """One TLS deployment with SuperNode authentication. Two intruders claim client 0: a
    node with a key nobody registered (refused by authentication) and a registered node
    that talks plain HTTP (refused by TLS); neither gets in. Under authentication a node's
    id is its key's. SuperNode 1 is killed
    (SIGKILL: no goodbye) during the run: its client is lost in that round (the round waits
    no longer than round-timeout) and skipped at once in the next ones, and the run goes
    on. Restarted at once, the node is refused by the SuperLink while it still counts the
    old session online (about 60 s); its supervisor tries again until it is let in, and
    the client is back within four rounds of that (the query that readmits it and its
    answer each wait for Flower's 3-s polls; rounds here take about 4 s). Meanwhile a
    registered node claims
    client 1: refused and logged (the run binds each client to its first node), never
    given client 1's work."""
    import threading
    import time

    from test_flower_deploy import digits, run_rows

    from protofl.engine.simulation import read_rows

    # enough rounds to outlast the SuperLink's heartbeat patience: the node is let in 36-65 s
    # after the kill (2 x 30 s after its last heartbeat, which came up to 24 s before the
    # kill, + a 5 s retry), about round 12-20 at Flower's 3-4 s a round (its nodes poll every 3 s)
    cfg = digits(tmp_path, "algorithm.name=fedavg", "rounds=26", "training.epochs=1", "eval.personal=false")
    certs = throwaway_certificates(tmp_path / "certs", hosts=("127.0.0.1", "localhost"))
    metrics = tmp_path / "flower" / "metrics.jsonl"

    def rows() -> int:
        return len(read_rows(metrics)) if metrics.exists() else 0

    def wait_for(cond, timeout):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.2)

    stranger, _ = supernode_keys(tmp_path / "stranger", ["stranger"])["stranger"]
    with LocalDeployment(tmp_path / "deployment", num_nodes=3, tls=certs, auth=True) as dep:
        # (rejoin_wait=0: a refused node gives up at once instead of trying again as a restarted one would)
        rogues = {"stranger": dep.start_node(0, name="stranger", auth_key=stranger, max_wait_time=15,
                                             rejoin_wait=0),
                  # gets a registered key pair, but no TLS
                  "insecure-supernode": dep.start_node(0, insecure=True, name="insecure-supernode",
                                                       max_wait_time=15, rejoin_wait=0)}
        box = {}
        submit = threading.Thread(target=lambda: box.setdefault("res", dep.submit(
            cfg, tmp_path / "flower", timeout=600, round_timeout=10)))
        submit.start()
        wait_for(lambda: rows() >= 1, 240)
        dep.kill_node(1)
        wait_for(lambda: any(json_row["lost"] for json_row in read_rows(metrics)), 120)  # client 1 is late
        dep.start_node(1, name="hijacker")  # a registered key of its own, claiming client 1
        dep.restart_node(1)
        log1 = tmp_path / "deployment" / "supernode-1.log"
        wait_for(lambda: "SuperNode ID" in log1.read_text(errors="replace"), 180)
        up = rows()  # the round in progress when the restarted node was let in
        submit.join(timeout=600)
        rcs = {}
        for name, rogue in rogues.items():
            try:
                rcs[name] = rogue.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rcs[name] = None
    res = box["res"]
    assert res.returncode == 0, res.stdout[-3000:]
    summary, got = run_rows(tmp_path / "flower")
    assert summary["status"] == "complete", summary
    assert "refused to activate this SuperNode" in log1.read_text(errors="replace")  # tried again, then let in
    # back within four rounds of the round in progress when it was let in (measured: in round
    # up + 2 in one run; three or more rounds after in another): every round from up + 5 on
    assert up + 5 <= len(got), (up, len(got))  # rounds were left to see it back
    back = [(r["round"], r["lost"]) for r in got]
    assert all(r["lost"] == 0 and r["arrived"] == 3 for r in got[up + 4:]), (up, back)
    assert all(r["lost"] <= 1 and math.isfinite(r["train_loss"]) for r in got)
    first = next(i for i, r in enumerate(got) if r["lost"])
    assert got[first]["wall_s"] < 10 + 8, got[first]["wall_s"]  # round-timeout (10 s) bounds the wait ...
    assert all(r["wall_s"] < 10 for r in got[first + 1:up]), [r["wall_s"] for r in got]  # ... then skipped at once
    assert "which is bound to node" in res.stdout and "refused" in res.stdout, res.stdout[-3000:]
    assert "is now served by node" not in res.stdout  # no takeover, by the hijacker or anyone
    logs = {name: (tmp_path / "deployment" / f"{name}.log").read_text(errors="replace") for name in rogues}
    for name in rogues:  # neither intruder got in: each gave up with an error
        assert rcs[name] not in (None, 0), (name, logs[name][-2000:])
        assert "SuperNode ID" not in logs[name], (name, logs[name][-2000:])
    assert "Failed to activate SuperNode" in logs["stranger"], logs["stranger"][-2000:]
    for k in (0, 2):  # the registered ones did join
        assert "SuperNode ID" in (tmp_path / "deployment" / f"supernode-{k}.log").read_text(errors="replace")
