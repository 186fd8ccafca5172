"""Packaged example configs, the defaults the README shows, version and extras.

(The built wheel itself is exercised in test_wheel.py.)
"""
import os
import re
import subprocess
import sys

import pytest
import yaml

import protofl
from protofl.cli import main
from protofl.config import (PACKAGED_CONFIGS, ConfigError, config_description, defaults_yaml,
                            from_dict, load_config, packaged_configs)

from conftest import REPO


def test_every_packaged_config_validates_and_has_a_one_line_description():
    configs = packaged_configs()
    assert "digits" in configs and len(configs) >= 10
    for name, path in configs.items():
        desc = config_description(path)
        assert desc and len(desc) <= 80, (name, desc)
        load_config(name)  # names, types and every component's parameters are valid


def test_configs_lists_one_line_per_packaged_config(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(packaged_configs())
    (digits,) = [ln for ln in lines if ln.split()[0] == "digits"]
    assert digits.split(None, 1)[1] == config_description(PACKAGED_CONFIGS / "digits.yaml")


def test_configs_without_packaged_files_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("protofl.packaged_configs.PACKAGED_CONFIGS", tmp_path)  # an install without package data
    assert main(["configs"]) == 2
    assert "no example configs installed" in capsys.readouterr().err


def test_configs_show_prints_the_file_and_unknown_names_exit_2(capsys):
    assert main(["configs", "show", "spiral"]) == 0
    assert capsys.readouterr().out == (PACKAGED_CONFIGS / "spiral.yaml").read_text()
    assert main(["configs", "show", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no packaged config" in err and "digits" in err and err.count("\n") == 1


def test_bare_name_resolves_to_the_packaged_config_and_an_existing_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("digits").rounds == 20  # the packaged file
    assert load_config("digits.yaml").rounds == 20
    (tmp_path / "digits.yaml").write_text("rounds: 3\n")
    assert load_config("digits.yaml").rounds == 3  # a file in the current folder wins
    (tmp_path / "digits").write_text("rounds: 4\n")
    assert load_config("digits").rounds == 4
    with pytest.raises(ConfigError, match="not the name of a packaged config"):
        load_config("elsewhere/spiral.yaml")  # a path with a folder never falls back


def test_top_level_configs_is_the_packaged_folder_not_a_copy():
    top = REPO / "configs"
    if top.exists():
        assert top.resolve() == PACKAGED_CONFIGS.resolve()


def test_documented_config_paths_exist():
    """Every `configs/<name>.yaml` the docs, benchmarks, sources and tests mention exists."""
    names = set(packaged_configs())
    files = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("benchmarks/**/*.md"),
             *REPO.glob("benchmarks/**/*.py"), *REPO.glob("src/**/*.py"), *REPO.glob("tests/*.py"), *PACKAGED_CONFIGS.glob("*.yaml")]
    missing = {(f.relative_to(REPO).as_posix(), m)
               for f in files for m in re.findall(r"configs/([A-Za-z0-9_]+)\.yaml", f.read_text())
               if m not in names}
    assert not missing, sorted(missing)


def test_config_defaults_prints_the_resolved_defaults(capsys):
    assert main(["config", "defaults"]) == 0
    out = capsys.readouterr().out
    assert out == defaults_yaml()
    assert yaml.safe_load(out) == load_config().to_dict(complete=True)
    d = yaml.safe_load(out)
    assert (d["training"]["momentum"], d["eval"]["personal_every"], d["eval"]["batch_size"]) == (0.0, 10, 256)
    # the keys left out of a run's config.yaml at their defaults are in the reference
    assert {"augment", "train_size", "download", "mirrors", "verify", "root"} <= set(d["data"])
    assert d["data"]["augment"] == {} and d["features"]["name"] == "none" and d["privacy"]["mode"] == "none"
    assert load_config(overrides=[]).to_dict(complete=True) == from_dict(d).to_dict(complete=True)  # it loads


def test_readme_configuration_block_is_the_defaults():
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- protofl config defaults -->\s*```yaml\n(.*?)```", text, re.S)
    assert m, "README.md: the block after <!-- protofl config defaults --> is missing"
    assert yaml.safe_load(m[1]) == yaml.safe_load(defaults_yaml()), (
        "README.md's configuration block differs from the defaults; paste the output of "
        "`protofl config defaults`:\n" + defaults_yaml())


def test_version_in_one_place(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"protofl {protofl.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", protofl.__version__)
    assert f"## {protofl.__version__}" in (REPO / "CHANGELOG.md").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        meta = tomllib.loads((REPO / "pyproject.toml").read_text())
        assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
        assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "protofl.version.__version__"}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_all_extra_holds_every_extra_and_the_readme_names_each():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (all_req,) = extras["all"]
    listed = set(re.fullmatch(r"protofl\[(.+)\]", all_req)[1].split(","))
    # extras left out of `all` on purpose (pyproject.toml says why next to each); the
    # README's table must say they are not in `all`
    outside = {"torchvision"}
    assert listed == set(extras) - {"all"} - outside, "add the new extra to `all` in pyproject.toml"
    readme = (REPO / "README.md").read_text()
    for name in extras:
        assert f"| `{name}` |" in readme, f"README.md's extras table has no row for `{name}`"
    for name in outside:
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
        assert "not in `all`" in row, f"README.md: the `{name}` row must say it is not in `all`"


def test_configs_and_version_do_not_import_torch():
    code = ("import sys; from protofl.cli import main; main(['configs']); main(['configs', 'show', 'digits']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
