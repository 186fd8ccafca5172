"""SuperNode authentication and TLS over real Flower processes: registered SuperNodes train;
an unregistered one, and a registered one without TLS, are refused (``protofl flower
keys|register``, ``superlink --auth``)."""
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
def test_registered_tls_supernodes_train_and_unregistered_or_insecure_ones_are_refused(tmp_path):
    """One TLS deployment with SuperNode authentication and two intruders claiming client 0:
    a node with a key nobody registered (refused by authentication) and a registered node
    that talks plain HTTP (refused by TLS)."""
    from test_flower_deploy import digits, run_rows

    cfg = digits(tmp_path, "algorithm.name=fedavg", "rounds=1", "training.epochs=1")
    stranger, _ = supernode_keys(tmp_path / "stranger", ["stranger"])["stranger"]
    # Flower allows SuperNode auth only with TLS
    certs = throwaway_certificates(tmp_path / "certs", hosts=("127.0.0.1", "localhost"))
    with LocalDeployment(tmp_path / "deployment", num_nodes=3, tls=certs, auth=True) as dep:
        rogues = {"stranger": dep.start_node(0, name="stranger", auth_key=stranger, max_wait_time=15),
                  # gets a registered key pair, but no TLS
                  "insecure-supernode": dep.start_node(0, insecure=True, name="insecure-supernode",
                                                       max_wait_time=15)}
        res = dep.submit(cfg, tmp_path / "flower", timeout=300, round_timeout=150)
        rcs = {}
        for name, rogue in rogues.items():
            try:
                rcs[name] = rogue.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rcs[name] = None
    assert res.returncode == 0, res.stdout[-3000:]
    summary, rows = run_rows(tmp_path / "flower")
    assert summary["status"] == "complete" and (rows[0]["arrived"], rows[0]["lost"]) == (3, 0)
    assert "is now served by node" not in res.stdout  # client 0 was never taken over
    logs = {name: (tmp_path / "deployment" / f"{name}.log").read_text(errors="replace") for name in rogues}
    for name in rogues:  # neither intruder got in: each gave up with an error
        assert rcs[name] not in (None, 0), (name, logs[name][-2000:])
        assert "SuperNode ID" not in logs[name], (name, logs[name][-2000:])
    assert "Failed to activate SuperNode" in logs["stranger"], logs["stranger"][-2000:]
    for k in range(3):  # the registered ones did join
        assert "SuperNode ID" in (tmp_path / "deployment" / f"supernode-{k}.log").read_text(errors="replace")
