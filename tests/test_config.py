"""Config validation: every failure names the key, the value and what is allowed."""
import pytest

from protofl.algorithms.serveropt import SERVER_OPT_DEFAULTS
from protofl.config import ConfigError, from_dict, load_config, parse_override

from conftest import DIGITS


def err(raw):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    return e.value


def test_defaults_and_yaml_round_trip():
    cfg = load_config(DIGITS)
    assert cfg.data.name == "digits" and cfg.partition.params["beta"] == 0.5
    again = from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config(DIGITS, ["training.lr=1e-3", "algorithm.name=fedprox", "algorithm.mu=0.1",
                               "eval.personal=false", "model.hidden=[32, 16]"])
    assert cfg.training.lr == 1e-3 and cfg.algorithm.params == {"mu": 0.1, "weighting": "samples",
                                                                **dict(SERVER_OPT_DEFAULTS)}
    assert cfg.eval.personal is False and cfg.model.params["hidden"] == [32, 16]
    assert parse_override("a.b=False") == ("a.b", False)  # a real bool, not the string


@pytest.mark.parametrize("raw, key, fragment", [
    ({"training": {"lr": -1}}, "training.lr", "must be > 0"),
    ({"training": {"lr": "fast"}}, "training.lr", "expected a number"),
    ({"training": {"lrr": 0.1}}, "training.lrr", "allowed: alpha, batch_size"),
    ({"eval": {"personal": "yes"}}, "eval.personal", "true or false"),
    ({"algorithm": {"name": "fedfoo"}}, "algorithm.name", "known: "),
    ({"algorithm": {"name": "fedavg", "mu": 0.1}}, "algorithm.mu", "server_opt, server_tau, weighting"),
    ({"algorithm": {"name": "fedprox", "mu": -0.1}}, "algorithm.mu", "must be >= 0"),
    ({"algorithm": {"name": "fedavg", "weighting": "bytes"}}, "algorithm.weighting", "'samples'"),
    ({"data": {"name": "imagenet"}}, "data.name", "known: "),
    ({"model": {"name": "vgg"}}, "model.name", "known: "),
    ({"model": {"name": "mlp", "depth": 3}}, "model.depth",
     "allowed: model's keys name, per_client, pretrained; the model's parameters: feature_dim, hidden"),
    ({"partition": {"name": "dirichlet", "alpha": 0.1}}, "partition.alpha", "the partitioner's parameters: beta"),
    # every accepted key is named: the section's own (augment, train_size, ...) and the loader's
    ({"data": {"name": "cifar10", "foo": 1}}, "data.foo",
     "allowed: data's keys augment, download, mirrors, name, root, train_size, verify; the dataset's parameters: none"),
    ({"partition": {"name": "dirichlet", "beta": "x"}}, "partition.beta", "expected a number"),
    ({"rounds": 0}, "rounds", "must be >= 1"),
    ({"training": {"batch_size": 10**12}}, "training.batch_size", "must be in [1, 1,048,576]"),  # 14.6 TiB of indices
    ({"eval": {"batch_size": 0}}, "eval.batch_size", "must be in [1, 1,048,576]"),
    ({"participation": {"p": 1.5}}, "participation.p", "[0, 1]"),
    ({"bogus": 1}, "bogus", "unknown section"),
    ({"model": {"name": "mlp", "per_client": {"feature_dim": [8, 16]}}}, "model.per_client", "share"),
])
def test_invalid_values_name_key_value_and_allowed(raw, key, fragment):
    e = err(raw)
    assert e.key == key and fragment in str(e), str(e)
    assert "\n" not in str(e)


def test_natural_partition_users_come_from_the_dataset():
    cfg = from_dict({"data": {"name": "femnist"}, "partition": {"name": "natural", "num_clients": 5}})
    assert cfg.partition.params == {}


def test_resolved_config_holds_defaults_and_fingerprint_ignores_where_and_how():
    cfg = load_config(DIGITS)
    assert cfg.data.params == {"test_fraction": 0.25}
    # a default changes the fingerprint (the server optimizer's, added later, do not at theirs)
    assert cfg.algorithm.params == {"weighting": "samples", "server_opt": "none", "server_lr": None,
                                    "server_momentum": 0.9, "server_beta2": 0.999, "server_tau": 1e-3}
    assert cfg.model.params["hidden"] == [128]
    same = cfg.replace(**{"data.root": "/elsewhere", "execution.workers": 2, "output.dir": "x", "rounds": 3})
    assert same.fingerprint() == cfg.fingerprint()
    assert cfg.replace(**{"partition.beta": 0.3}).fingerprint() != cfg.fingerprint()


def test_replace_switches_components_and_drops_old_params():
    cfg = load_config(DIGITS, ["algorithm.name=fedprox", "algorithm.mu=0.5"])
    avg = cfg.replace(**{"algorithm.name": "local"})
    assert avg.algorithm.params == {}
    iid = cfg.replace(**{"partition.name": "iid"})
    assert iid.partition.params == {} and iid.partition.num_clients == 10


def _fields_of(obj, kind: type) -> list[str]:
    """The fields of a settings dataclass that hold a ``kind`` (``kind``, or ``kind`` or null)."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(type(obj))
    return [f.name for f in dataclasses.fields(obj) if hints.get(f.name) is kind
            or (typing.get_origin(hints.get(f.name)) in (typing.Union, types.UnionType)
                and kind in typing.get_args(hints.get(f.name)))]


def _float_fields(obj) -> list[str]:
    return _fields_of(obj, float)


def test_no_numeric_setting_accepts_inf_or_nan():
    """Every float setting of every section and of every method's hyper-parameters: .inf and
    .nan are one-line config errors, except the clips where .inf means no clipping."""
    from protofl.algorithms import ALGORITHMS
    from protofl.config import load_config
    from protofl.config.coerce import INFINITE_ALLOWED
    from protofl.config.schema import method

    base = load_config(DIGITS)
    cases = [("fedavg", f"{sec}.{name}") for sec in ("training", "participation", "eval", "privacy", "data",
                                                      "partition", "model")
             for name in _float_fields(getattr(base, sec))]
    for name in ALGORITHMS.names():
        hp = method(load_config(DIGITS, [f"algorithm.name={name}"]))[1]
        cases += [(name, f"algorithm.{k}") for k in _float_fields(hp)]
    checked = 0
    for name, key in cases:
        for bad in (".inf", ".nan", "-.inf"):
            if bad == ".inf" and key in INFINITE_ALLOWED:
                continue
            with pytest.raises(ConfigError) as e:
                load_config(DIGITS, [f"algorithm.name={name}", f"{key}={bad}"])
            assert "must be a finite number" in str(e.value) and "\n" not in str(e.value), (name, key, bad)
            checked += 1
    assert checked > 300  # every method's float hyper-parameters, not a handful


def test_a_section_written_as_a_name_and_a_config_from_a_pipe(tmp_path):
    import os
    import threading

    from protofl.config import load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: fednh\n")
    with pytest.raises(ConfigError, match=r"expected a mapping: write `algorithm: \{name: fednh\}`"):
        load_config(bad)  # was an internal error
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(tmp_path)
    fifo = tmp_path / "config.fifo"  # what `protofl run <(...)` passes
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("rounds: 3\nalgorithm: {name: fedprox}\n"))
    writer.start()
    cfg = load_config(fifo)
    writer.join(5)
    assert cfg.rounds == 3 and cfg.algorithm.name == "fedprox"


# every integer hyper-parameter of every method: a size (allocated at its value: bounded)
# or an amount of work (epochs, steps, iterations, a layer index: costs time, not memory)
SIZES = {"ccvr": {"num_virtual", "calibration_batch"}, "creff": {"num_features", "retrain_batch", "batch_real"},
         "fedgen": {"noise_dim", "hidden", "gen_batch"}, "fedgh": {"server_batch"},
         "fedtgp": {"server_batch", "hidden"}, "fedbr": {"num_pseudo", "mean_of"}, "fedetf": {"proj_dim"},
         "moon": {"proj_dim"}, "mpfedcl": {"k", "max_clusters"}, "dpfedcl": {"max_clusters"},
         "fesem": {"centers"}}
WORK = {"calibration_epochs", "match_steps", "retrain_epochs", "repeats", "personal_epochs", "min_samples",
        "layer_idx", "num_pre_loss", "max_init_epochs", "finetune_epochs", "spread_steps", "finetune_rounds",
        "gen_steps", "server_epochs", "head_epochs", "body_epochs", "n_init", "max_iter", "K"}


def test_every_size_setting_is_bounded_and_every_integer_setting_is_classified():
    from protofl.algorithms import ALGORITHMS
    from protofl.config import load_config
    from protofl.config.schema import method
    from protofl.errors import MAX_SIZE

    checked = 0
    for name in ALGORITHMS.names():
        hp = method(load_config(DIGITS, [f"algorithm.name={name}"]))[1]
        for key in _fields_of(hp, int):
            sizes = SIZES.get(name, set())
            assert key in sizes or key in WORK, f"{name}.{key}: a size (bound it: require_size) or work? list it"
            if key not in sizes:
                continue
            for bad in (10**12, MAX_SIZE + 1, 0):
                with pytest.raises(ConfigError) as e:
                    load_config(DIGITS, [f"algorithm.name={name}", f"algorithm.{key}={bad}"])
                assert f"must be in [1, {MAX_SIZE:,}]" in str(e.value) and "\n" not in str(e.value), (name, key)
            load_config(DIGITS, [f"algorithm.name={name}", f"algorithm.{key}={MAX_SIZE}"])  # the bound itself
            checked += 1
    assert checked >= 15
    for key in ("training.batch_size", "eval.batch_size"):
        with pytest.raises(ConfigError, match="must be in"):
            load_config(DIGITS, [f"{key}=1000000000000"])


def test_a_model_too_large_for_any_machine_is_a_config_error_not_a_data_mismatch(tmp_path, capsys):
    from protofl.cli import main

    code = main(["run", str(DIGITS), "model.feature_dim=1000000000000", "rounds=1", f"output.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "needs more memory than this machine can allocate" in err, err
    assert "models that take them" not in err and len(err.strip().splitlines()) == 1, err
