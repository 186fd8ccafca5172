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


def test_adding_a_method_guide_prints_the_real_feddecorr_and_its_test_passes():
    """docs/adding_a_method.md prints src/protofl/algorithms/feddecorr.py (the registered
    method) verbatim, and a test of tests/test_feddecorr.py; that test passes. The shared
    suite (tests/test_algorithms_common.py) runs the registered method itself."""
    import re

    from protofl.algorithms import ALGORITHMS
    from protofl.algorithms.feddecorr import FedDecorr

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "adding_a_method.md").read_text(), re.S)
    module_src, test_src = blocks
    assert module_src == (REPO / "src" / "protofl" / "algorithms" / "feddecorr.py").read_text()
    assert test_src in (REPO / "tests" / "test_feddecorr.py").read_text()
    assert ALGORITHMS.get("feddecorr") is FedDecorr
    tests: dict = {}
    exec(compile(test_src, "test_feddecorr.py", "exec"), tests)
    names = [k for k in tests if k.startswith("test_")]
    assert names
    for name in names:
        tests[name]()
