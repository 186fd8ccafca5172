"""The package as a user installs it: sdist + wheel, a fresh virtual environment, no checkout.

Builds the sdist and, from it, the wheel (as `python -m build` does), checks both with
`twine check --strict`, installs the wheel (not editable) into a new virtual environment
and runs the README's first commands from an empty folder outside the checkout. A file
left out of the distributions (a packaged config, the version) fails here.

Nothing is downloaded, torch least of all: the new environment links this environment's
installed copies of the wheel's declared dependencies (and theirs, recursively: torch's
CUDA libraries on a CUDA machine); pip installs the wheel alone (``--no-index
--no-deps``, so it never replaces a linked package) and ``pip check`` then verifies that
the linked packages satisfy the wheel's requirements. An import of a package the wheel
does not declare fails here too. Building needs
no network either (``--no-isolation``: the ``release`` extra provides build, twine and
setuptools).
"""
import os
import re
import subprocess
import sys
import sysconfig
import venv
from importlib import metadata
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.wheel

CONFIGS = REPO / "src" / "protofl" / "configs"


def sh(*cmd, cwd=None, env=None, timeout=600) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{out[-4000:]}"
    return out


def requirements(wheel: Path) -> list[str]:
    """The names in the wheel's unconditional ``Requires-Dist`` (extras left out)."""
    import zipfile
    from email.parser import HeaderParser

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = HeaderParser().parsestr(z.read(name).decode())
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions of ``names`` and, recursively, of their requirements."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        key = canonicalize_name(todo.pop())
        if key in seen:
            continue
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue  # an optional platform package that is not installed: pip check says so
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def link_distributions(dists, site: Path) -> None:
    """Make ``dists`` installed in ``site`` by linking their top-level files and folders."""
    for dist in dists:
        root = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            if (root / top).exists() and not (site / top).exists():
                (site / top).symlink_to(root / top)


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}

    # build: sdist, then the wheel from the sdist; no warning, twine clean
    log = sh(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO, env=env)
    warnings = [ln for ln in log.splitlines() if re.search(r"warning|deprecat", ln, re.I)]
    assert not warnings, "the build warns:\n" + "\n".join(warnings)
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    sh(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, env=env)

    # a fresh environment (no system site-packages) with the installed dependencies linked in
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    bindir = tmp_path / "venv" / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    assert site != Path(sysconfig.get_path("purelib"))
    deps = requirements(wheel)
    assert "torch" in deps
    link_distributions(installed_closure(deps), site)
    pip = [sys.executable, "-m", "pip", "--python", py]
    # --no-deps: pip must never upgrade (uninstall) a linked distribution; pip check then
    # verifies that the linked ones satisfy every requirement of the wheel
    sh(*pip, "install", "--no-index", "--no-deps", wheel, env=env)
    sh(*pip, "check", env=env)

    # the README's first commands, from an empty folder outside the checkout
    work = tmp_path / "work"
    work.mkdir()
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"

    def protofl(*args) -> str:
        return sh(bindir / "protofl", *args, cwd=work, env=env)

    where = sh(py, "-c", "import protofl; print(protofl.__file__)", cwd=work, env=env)
    assert Path(where.strip()).is_relative_to(site), where
    version = re.search(r'__version__ = "(.+?)"', (REPO / "src/protofl/version.py").read_text())[1]
    assert protofl("--version").strip() == f"protofl {version}"
    assert "fedavg" in protofl("list")
    listed = [ln.split()[0] for ln in protofl("configs").splitlines()]
    assert listed == sorted(p.stem for p in CONFIGS.glob("*.yaml")), "packaged configs missing from the wheel"
    assert protofl("configs", "show", "digits") == (CONFIGS / "digits.yaml").read_text()
    tables = protofl("reproduce", "list")
    for f in (REPO / "src" / "protofl" / "reproduce" / "tables").glob("*.yaml"):
        name = re.search(r"^name: (\S+)", f.read_text(), re.M)[1]
        assert f"| {name} |" in tables, f"reproduce table {name} missing from the wheel"
    out = protofl("run", "digits", "rounds=2", "--quiet")
    assert "fedavg: 2 rounds" in out and "gm=" in out, out
    assert (work / "runs").is_dir() and list((work / "runs").glob("*/summary.json"))
