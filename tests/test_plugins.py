"""Third-party components through entry points: the example package under examples/."""
import os
import subprocess
import sys
import tomllib

from conftest import DIGITS, REPO

EXAMPLE = REPO / "examples" / "protofl-example-plugin"


def _install_metadata(site, name, entry_points: dict) -> None:
    """What `pip install` leaves for importlib.metadata: a dist-info with entry_points.txt."""
    d = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in entry_points.items()))


def test_example_plugin_adds_all_four_components(tmp_path):
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]
    assert set(eps) == {"protofl.algorithms", "protofl.models", "protofl.datasets", "protofl.partitioners"}
    site = tmp_path / "site"
    _install_metadata(site, meta["project"]["name"], eps)
    _install_metadata(site, "broken-plugin", {"protofl.models": {"broken": "no_such_module:model"}})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(EXAMPLE / "src"), str(site)]))
    run = lambda *a: subprocess.run([sys.executable, "-m", "protofl", *a], capture_output=True, text=True, env=env)

    out = run("list")
    assert out.returncode == 0, out.stderr
    for name in ("fedavgm_plugin", "small_mlp", "blobs", "power_law"):
        assert name in out.stdout
    assert "broken" not in out.stdout and "plugin 'broken'" in out.stderr and "failed to load" in out.stderr

    args = [str(DIGITS), "data.name=blobs", "data.classes=3", "partition.name=power_law",
            "partition.num_clients=4", "model.name=small_mlp", "model.width=16", "algorithm.name=fedavgm_plugin",
            "algorithm.beta=0.5", "execution.workers=0", f"output.dir={tmp_path / 'runs'}", "--quiet"]
    out = run("run", *args, "rounds=2")
    assert out.returncode == 0, out.stderr
    assert "fedavgm_plugin: 2 rounds" in out.stdout and "gm=" in out.stdout
    # its checkpoint holds the plugin's own state dataclass: allowed, with no list to edit
    out = run("run", *args, "rounds=3", "--resume")
    assert out.returncode == 0 and "fedavgm_plugin: 3 rounds" in out.stdout, out.stderr
    # the plugin's own validation is the config's: one line, exit 2
    out = run("run", str(DIGITS), "algorithm.name=fedavgm_plugin", "algorithm.beta=1.5", "--quiet")
    assert out.returncode == 2 and "algorithm.beta=1.5: must be in [0, 1)" in out.stderr


def test_example_server_momentum_by_hand_and_as_the_built_in_fedavgm():
    import pytest
    import torch

    sys.path.insert(0, str(EXAMPLE / "src"))
    try:
        from protofl_example.momentum import MomentumHyper, MomentumState, ServerMomentum
    finally:
        sys.path.remove(str(EXAMPLE / "src"))
    from protofl.algorithms.fedopt import FedAvgM, FedAvgMHyper
    from protofl.messages import Record

    algo = ServerMomentum(MomentumHyper(beta=0.5, server_lr=1.0), None)
    w = {"a": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    reps = [(0, Record(weights={"a": torch.tensor([0.0, 0.0]), "n": torch.tensor(5)}, num_samples=1)),
            (1, Record(weights={"a": torch.tensor([0.0, 4.0]), "n": torch.tensor(5)}, num_samples=3))]
    s1 = algo.aggregate(MomentumState(w), 1, reps, None)  # avg a = [0, 3]: Δ = [1, -1], v = Δ
    assert torch.allclose(s1.weights["a"], torch.tensor([0.0, 3.0])) and int(s1.weights["n"]) == 5
    s2 = algo.aggregate(s1, 2, reps, None)  # Δ = [0, 0], v = 0.5 [1, -1]
    assert torch.allclose(s2.weights["a"], torch.tensor([-0.5, 3.5]))
    # the same two rounds of protofl's own fedavgm (a parameter "a", the buffer "n")
    ctx = type("Ctx", (), {"shared_model": lambda self: torch.nn.ParameterDict({"a": torch.nn.Parameter(w["a"])})})()
    built_in = FedAvgM(FedAvgMHyper(server_momentum=0.5, server_lr=1.0), None)
    b2 = built_in.aggregate(built_in.aggregate(MomentumState(w), 1, reps, ctx), 2, reps, ctx)
    assert torch.allclose(b2.weights["a"], s2.weights["a"]) and int(b2.weights["n"]) == 5
    with pytest.raises(Exception):
        from protofl.config import check_dataclass

        check_dataclass(MomentumHyper, {"beta": 1.0}, "algorithm")
