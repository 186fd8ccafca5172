"""docs/adding_a_method.md walked through from scratch: its module, as the page prints it,
becomes a new method in a package of its own (a temporary folder, registered through an
entry point as the page's last step says), with no other file of protofl edited; it runs,
runs on the batched executor, resumes to more rounds, and the page's own test passes."""
import os
import re
import subprocess
import sys

from protofl.run_folder import read_rows

from conftest import DIGITS, REPO, strip_timing

from test_plugins import _install_metadata

PAGE = REPO / "docs" / "adding_a_method.md"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_page_walked_through_gives_a_method_that_runs_batches_and_resumes(tmp_path):
    module, test = code_blocks(PAGE.read_text(encoding="utf-8"))[:2]
    assert 'name = "feddecorr"' in module and "@register\n" in module
    # the new method: the page's module under another name, in a package of its own
    pkg = tmp_path / "src" / "walkdecorr"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    new = module.replace('name = "feddecorr"', 'name = "walkdecorr"').replace("@register\n", "")
    (pkg / "method.py").write_text(new)
    (pkg / "test_method.py").write_text(test.replace("protofl.algorithms.feddecorr", "walkdecorr.method"))
    site = tmp_path / "site"
    _install_metadata(site, "walkdecorr", {"protofl.algorithms": {"walkdecorr": "walkdecorr.method:FedDecorr"}})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(tmp_path / "src"), str(site)]))

    def run(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path)

    base = [str(DIGITS), "algorithm.name=walkdecorr", "algorithm.beta=0.05", "execution.workers=0",
            "partition.num_clients=4", "--quiet"]
    seq = run("-m", "protofl", "run", *base, "rounds=2", f"output.dir={tmp_path / 'seq'}")
    assert seq.returncode == 0 and "walkdecorr: 2 rounds" in seq.stdout, seq.stderr
    batched = run("-m", "protofl", "run", *base, "rounds=2", "execution.executor=batched",
                  f"output.dir={tmp_path / 'bat'}")
    assert batched.returncode == 0 and "walkdecorr: 2 rounds" in batched.stdout, batched.stderr
    (folder,) = (tmp_path / "seq").iterdir()
    before = strip_timing(read_rows(folder / "metrics.jsonl"))
    more = run("-m", "protofl", "run", *base, "rounds=3", "--resume", f"output.dir={tmp_path / 'seq'}")
    assert more.returncode == 0 and "walkdecorr: 3 rounds" in more.stdout, more.stderr
    after = strip_timing(read_rows(folder / "metrics.jsonl"))
    assert len(after) == 3 and after[:2] == before  # resumed: its two rounds kept, one added
    # the page's test, on the new module
    t = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(pkg / "test_method.py"))
    assert t.returncode == 0 and "1 passed" in t.stdout, t.stdout + t.stderr
