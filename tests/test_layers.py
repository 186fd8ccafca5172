"""The layers docs/architecture.md draws hold: every protofl import (at module level or
inside a function) points down the layer list, and no module-level imports form a circle.
Read from the source with ``ast``: nothing is imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

SRC = REPO / "src" / "protofl"
ARCH = REPO / "docs" / "architecture.md"


def documented_layers() -> list[list[str]]:
    """The layer list of docs/architecture.md (its "## Layers" code block), top first."""
    text = ARCH.read_text()
    block = re.search(r"## Layers\n.*?```\n(.*?)```", text, re.S)[1]
    # one layer a line: its names, then (after two spaces or more) what it is
    return [[n.strip() for n in re.split(r"\s{2,}", line)[0].split(",")] for line in block.splitlines() if line]


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported protofl module, at module level?) for every import in ``path``."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top_level = set()
    for node in tree.body:  # module level, TYPE_CHECKING blocks excluded
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top_level.add(id(node))
        elif isinstance(node, ast.Try):
            top_level |= {id(n) for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x` / `from protofl import x`: x may be a module of that package
            names = [f"{target}.{a.name}" if (SRC.parent / f"{target}.{a.name}".replace(".", "/")).exists()
                     or (SRC.parent / (f"{target}.{a.name}".replace(".", "/") + ".py")).exists() else target
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [(n, id(node) in top_level) for n in names if n == "protofl" or n.startswith("protofl.")]
    return out


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "protofl"


def test_every_import_points_down_the_documented_layers():
    layers = documented_layers()
    rank = {name: i for i, names in enumerate(layers) for name in names}
    modules = sorted(SRC.rglob("*.py"))
    parts = {part_of(module_name(p)) for p in modules} - {"protofl", "__main__"}
    assert parts <= set(rank), f"not in docs/architecture.md's layer list: {sorted(parts - set(rank))}"
    up = []
    for path in modules:
        src = part_of(module_name(path))
        if src in ("protofl", "__main__"):  # the package's lazy facade and `python -m protofl`
            continue
        for target, _ in imports(path):
            dst = part_of(target)
            if dst == "protofl":
                up.append(f"{module_name(path)} imports the package root (import what it needs from its module)")
            elif dst != src and rank[dst] < rank[src]:
                up.append(f"{module_name(path)} -> {target} ({src} is below {dst})")
    assert not up, "imports pointing up the layer list:\n" + "\n".join(up)


def test_no_module_level_import_circle():
    graph: dict[str, set[str]] = {}
    known = {module_name(p) for p in SRC.rglob("*.py")}
    for path in SRC.rglob("*.py"):
        graph[module_name(path)] = {t for t, top in imports(path) if top and t in known and t != module_name(path)}
    assert "protofl.engine.validate" in graph["protofl.engine.simulation"]  # the graph is read, not empty

    # a package's __init__ runs before its modules: a module importing its own package's
    # names is the package importing it back only if the __init__ imports that module
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "module-level import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_layer_reading_is_the_docs():
    layers = documented_layers()
    assert layers[0] == ["cli", "flower"] and "engine" in layers[3] and "errors" in layers[-1]
