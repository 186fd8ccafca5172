"""The docs site builds with warnings as errors, and the tutorial notebook runs."""
import os
import subprocess
import sys

import pytest

from conftest import REPO


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # the reference is generated from the docstrings
    assert "continues the run folder of this config" in api and "RunResult" in api


def test_tutorial_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("pandas")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "docs" / "tutorial.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "docs")}}).execute()
    outputs = {c.id: c.outputs for c in nb.cells if c.cell_type == "code"}
    table = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs["compare"])
    assert "| fedavg |" in table and "| fednh |" in table and "±" in table
    text = "".join(o.get("text", "") for o in outputs["workers"])
    assert "same results: True" in text
    errors = [o for outs in outputs.values() for o in outs if o.output_type == "error"]
    assert not errors


def test_adding_a_method_guide_runs(digits_cfg, tmp_path, monkeypatch):
    """docs/adding_a_method.md: its module and its test, as printed, pass the shared suite."""
    import re
    import types

    from protofl.algorithms import ALGORITHMS

    import test_algorithms_common as common

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "adding_a_method.md").read_text(), re.S)
    module_src, test_src = blocks
    module = types.ModuleType("protofl_guide_feddecorr")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))  # @register adds to a copy
    exec(compile(module_src, "feddecorr.py", "exec"), module.__dict__)
    assert ALGORITHMS.get("feddecorr") is module.FedDecorr
    monkeypatch.setitem(sys.modules, "protofl.algorithms.feddecorr", module)  # the test imports it there
    tests: dict = {}
    exec(compile(test_src, "test_feddecorr.py", "exec"), tests)
    tests["test_decorrelation_of_perfectly_correlated_and_of_independent_dimensions"]()
    common.test_every_method_two_rounds_on_digits("feddecorr", digits_cfg, tmp_path / "suite")
    common.test_every_method_batched_equals_sequential("feddecorr", digits_cfg, tmp_path / "both")
