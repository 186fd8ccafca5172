"""Feature-skew scenarios (data/features.py): the math of each transform, the sizes of the
domains, and that every process / a resumed run sees the same pixels."""
import json

import numpy as np
import pytest
import torch

from protofl import run
from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import TaskInfo
from protofl.cli import main
from protofl.config import ConfigError, load_config, parse_override
from protofl.data.dataset import Dataset
from protofl.data.features import noise, resize_digits, rotate
from protofl.data.build import build_federated
from protofl.data.federated import FederatedData
from protofl.engine.client import ClientRuntime
from protofl.engine.task import Task
from protofl.engine.simulation import Simulation

from conftest import DIGITS, shared_data, strip_timing


def _digits(*overrides):
    """configs/digits.yaml, 4 iid clients; the feature options come as overrides."""
    cfg = load_config(DIGITS, ["output.progress=false", "execution.threads=1"])
    return cfg.replace(**{"partition.name": "iid", "partition.num_clients": 4},
                       **dict(parse_override(o) for o in overrides))


def _runtime(cfg, fed):
    info = TaskInfo(num_classes=10, num_clients=fed.num_clients, feature_dim=64, input_shape=(1, 8, 8),
                    seed=cfg.seed, rounds=cfg.rounds)
    algo = ALGORITHMS.get("fedavg")(None, info)
    return ClientRuntime(Task(cfg, fed, algo, info))


def test_noise_std_is_sigma_k_over_k_minus_1_and_global_test_stays_clean():
    cfg = _digits("features.name=noise", "features.sigma=0.4")
    fed = build_federated(cfg)
    rt = _runtime(cfg, fed)
    ds = fed.dataset
    std = ds.std[0]
    for k, want in enumerate([0.0, 0.4 / 3, 0.8 / 3, 0.4]):
        x, _ = rt.client_train_data(k, rnd=1)
        clean = ds.normalize(ds.x_train[torch.from_numpy(fed.train_idx[k])])
        n = (x - clean) * std  # back in [0, 1] pixel units
        if want == 0:
            assert torch.equal(x, clean)
        else:  # ~20k draws: the sample std is within 2 % of sigma_k
            assert abs(float(n.std()) / want - 1) < 0.02 and abs(float(n.mean())) < 0.01
        lx, _ = rt.client_test_data(k, rnd=1)  # the local test set is noisy too
        lclean = ds.normalize(ds.x_test[torch.from_numpy(fed.test_idx[k])])
        assert torch.equal(lx, lclean) == (want == 0)
    tx, _ = rt.test_data
    assert torch.equal(tx, ds.normalize(ds.x_test))  # the global test set is clean


def test_noise_redraw_per_round_or_fixed_per_sample():
    redraw = build_federated(_digits("features.name=noise"))
    fixed = build_federated(_digits("features.name=noise", "features.redraw=false"))
    r1, r2 = (_runtime(_digits(), redraw).client_train_data(3, rnd) for rnd in (1, 2))
    f1, f2 = (_runtime(_digits(), fixed).client_train_data(3, rnd) for rnd in (1, 2))
    assert not torch.equal(r1[0], r2[0])
    assert torch.equal(f1[0], f2[0]) and torch.equal(f1[1], r1[1])


def test_rotate_is_exact_rot90_per_group_and_global_test_is_the_union():
    plain = build_federated(_digits())
    fed = build_federated(_digits("features.name=rotate"))  # 4 groups, round-robin
    assert fed.feature_groups.tolist() == [0, 1, 2, 3]
    assert fed.feature_group_names == ["rot0", "rot90", "rot180", "rot270"]
    n = len(plain.dataset.y_test)
    assert len(fed.dataset.y_test) == 4 * n
    for k in range(4):
        orig = plain.dataset.x_train[torch.from_numpy(plain.train_idx[k])]
        assert torch.equal(fed.dataset.x_train[torch.from_numpy(fed.train_idx[k])], torch.rot90(orig, k, (2, 3)))
        loc = plain.dataset.x_test[torch.from_numpy(plain.test_idx[k])]
        assert torch.equal(fed.dataset.x_test[torch.from_numpy(fed.test_idx[k])], torch.rot90(loc, k, (2, 3)))
        block = fed.test_groups[fed.feature_group_names[k]]
        assert torch.equal(fed.dataset.x_test[torch.from_numpy(block)], torch.rot90(plain.dataset.x_test, k, (2, 3)))
        assert torch.equal(fed.dataset.y_test[torch.from_numpy(block)], plain.dataset.y_test)
    # 180 degrees twice is the identity; an explicit assignment is used as given
    two = build_federated(_digits("features.name=rotate", "features.groups=2", "features.assign=[1,1,0,0]"))
    assert two.feature_groups.tolist() == [1, 1, 0, 0]
    x = two.dataset.x_train[torch.from_numpy(two.train_idx[0])]
    assert torch.equal(torch.rot90(x, 2, (2, 3)), plain.dataset.x_train[torch.from_numpy(plain.train_idx[0])])


def test_rotate_run_logs_accuracy_per_group(tmp_path):
    cfg = _digits("features.name=rotate", "features.groups=2", "rounds=1", "participation.fraction=1.0",
                  f"output.dir={tmp_path}")
    row = run(cfg).rows[-1]
    assert abs(row["gm"] - (row["gm:rot0"] + row["gm:rot180"]) / 2) < 1e-12  # equal blocks
    assert {"pa:rot0", "pa:rot180"} <= set(row)


def test_resize_digits_maps_0_16_to_0_1_bilinearly():
    x = torch.full((1, 1, 8, 8), 16, dtype=torch.uint8)
    assert torch.equal(resize_digits(x), torch.full((1, 1, 28, 28), 255, dtype=torch.uint8))
    x = torch.zeros((1, 1, 8, 8), dtype=torch.uint8)
    x[..., 4:] = 8  # left half 0, right half 0.5: a ramp only around the edge
    y = resize_digits(x)
    assert y.shape == (1, 1, 28, 28) and int(y[0, 0, 0, 0]) == 0 and int(y[0, 0, 0, -1]) == 128
    want = torch.nn.functional.interpolate(x.float() / 16, size=(28, 28), mode="bilinear", align_corners=False)
    assert torch.equal(y, want.mul(255).round().to(torch.uint8))


def test_domains_equal_train_sizes_one_test_set_per_domain():
    data = shared_data()
    if not (data / "mnist").exists() or not (data / "femnist").exists():
        pytest.skip("real MNIST/FEMNIST not available")
    cfg = load_config(None, [f"data.root={data}", "partition.name=iid", "partition.num_clients=6",
                             "features.name=domains", "features.test_size=100"])
    fed = build_federated(cfg)
    info = fed.dataset.info
    n = info["train_per_domain"]
    assert n == 1347  # sklearn digits' training split (1797 - 450 test) bounds it
    assert fed.feature_groups.tolist() == [0, 1, 2, 0, 1, 2]
    for d, name in enumerate(["mnist", "femnist", "digits"]):
        members = np.flatnonzero(fed.feature_groups == d)
        own = np.concatenate([fed.train_idx[k] for k in members])
        assert sorted(own.tolist()) == list(range(d * n, (d + 1) * n))  # iid: the domain's samples, split
        assert fed.test_groups[name].tolist() == list(range(d * 100, (d + 1) * 100))
        for k in members:  # local tests come from the client's own domain
            assert set(fed.test_idx[k].tolist()) <= set(fed.test_groups[name].tolist())
    assert len(fed.dataset.y_test) == 300 and fed.dataset.y_train.max() <= 9
    x = fed.dataset.x_train.float() / 255
    assert float(x[n:2 * n].mean()) > 0.8 > float(x[:n].mean())  # FEMNIST: white background
    with pytest.raises(ConfigError, match="exceeds the smallest domain"):
        build_federated(cfg.replace(**{"features.train_size": 5000}))


def test_writers_groups_are_a_seeded_partition_of_the_writers():
    data = shared_data()
    if not (data / "femnist").exists():
        pytest.skip("real FEMNIST not available")
    cfg = load_config(None, [f"data.root={data}", "data.name=femnist", "partition.name=iid",
                             "partition.num_clients=7", "features.name=writers"])
    fed = build_federated(cfg)
    groups = fed.dataset.info["writer_groups"]
    names = [w for g in groups for w in g]
    assert len(groups) == 7 and sorted(names) == sorted(fed.dataset.user_names)
    users = {u: k for k, u in enumerate(fed.dataset.user_names)}
    for k, g in enumerate(groups):
        own = np.sort(np.concatenate([fed.dataset.users_train[users[u]] for u in g]))
        assert np.array_equal(fed.train_idx[k], own)
        tests = np.concatenate([fed.dataset.users_test[users[u]] for u in g])
        assert set(fed.test_idx[k].tolist()) <= set(tests.tolist())
    other = build_federated(cfg.replace(seed=1), dataset=fed.dataset).dataset.info["writer_groups"]
    assert other != groups
    # a dataset with users but no names for them (a plugin's): its writers are named by index
    from dataclasses import replace

    unnamed = build_federated(cfg, dataset=replace(fed.dataset, user_names=None)).dataset.info["writer_groups"]
    assert unnamed == [[str(users[u]) for u in g] for g in groups]


def test_same_pixels_with_workers_and_after_resume(tmp_path):
    cfg = _digits("features.name=noise", "features.sigma=0.3", "rounds=3", "output.checkpoint_every=1",
                  "participation.fraction=0.5")
    seq = run(cfg, run_dir=tmp_path / "seq")
    par = run(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / "par")
    assert strip_timing(seq.rows) == strip_timing(par.rows)
    short = run(cfg.replace(rounds=2), run_dir=tmp_path / "res")
    resumed = Simulation(cfg, run_dir=tmp_path / "res").run(resume=True)
    assert resumed.rows[:2] == short.rows
    assert strip_timing(resumed.rows[2:]) == strip_timing(seq.rows[2:])


def test_config_section_default_none_keeps_fingerprints_and_bad_values_exit_2(capsys):
    cfg = load_config(DIGITS)
    assert "features" not in cfg.to_dict()
    assert cfg.fingerprint() == cfg.replace(**{"features.name": "none"}).fingerprint()
    assert _digits("features.name=noise").to_dict()["features"] == {"name": "noise", "sigma": 0.1, "redraw": True}
    for bad, msg in [("features.sigma=-1", "sigma must be"), ("features.groups=0", "groups must be"),
                     ("features.sources=[mnist,cifar10]", "unknown domain 'cifar10'"), ("features.name=blur", "unknown")]:
        name = {"sigma": "noise", "groups": "rotate", "sources": "domains"}.get(bad.split("=")[0].split(".")[1])
        args = ["run", str(DIGITS), bad] + ([f"features.name={name}"] if name else [])
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1
    tokens = Dataset("t", torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                     torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 2, kind="tokens")
    fed = FederatedData(tokens, [np.arange(4)], [np.arange(2)])
    with pytest.raises(ValueError, match="tokens"):
        noise(0.1).apply(fed, 0)
    with pytest.raises(ValueError, match="square images"):
        rotate(2).apply(fed, 0)


def test_clients_json_names_the_feature_group(tmp_path):
    cfg = _digits("features.name=rotate", "rounds=1", f"output.dir={tmp_path}")
    res = run(cfg)
    assert json.loads((res.dir / "clients.json").read_text())["feature_groups"] == ["rot0", "rot90", "rot180", "rot270"]
    assert "-rotate-" in res.dir.name


def test_data_shipped_to_ray_actors_keeps_the_feature_skew():
    """execution.data: ship sends the federated data through Ray's object store: the
    transform and the feature groups travel with the split (they were dropped, so the
    actors trained on clean inputs and a per-group run failed on the nodes)."""
    import cloudpickle

    from protofl.engine.ray_executor import _pack, _unpack

    fed = build_federated(_digits("features.name=rotate"))
    back = _unpack(cloudpickle.loads(cloudpickle.dumps(_pack(fed))))  # as Ray serializes it
    assert back.feature_group_names == fed.feature_group_names
    assert np.array_equal(back.feature_groups, fed.feature_groups)
    assert back.test_groups.keys() == fed.test_groups.keys()
    assert all(np.array_equal(back.test_groups[k], fed.test_groups[k]) for k in fed.test_groups)
    assert torch.equal(back.dataset.x_train, fed.dataset.x_train)  # rotate: rotated at load time
    fed = build_federated(_digits("features.name=noise"))  # noise: a load-time transform
    back = _unpack(cloudpickle.loads(cloudpickle.dumps(_pack(fed))))
    x = fed.dataset.normalize(fed.dataset.x_train[fed.train_idx[1]])
    assert torch.equal(back.transform(x, 1, 1, "train"), fed.transform(x, 1, 1, "train"))
    assert not torch.equal(back.transform(x, 1, 1, "train"), x)  # client 1's noise
