"""The method contract is what methods use, and nothing more: every member a method module
(or the shared math in nn/) reads from its context ``ctx`` is declared in the
``ClientContext`` or ``ServerContext`` protocol of algorithms/base.py, and the engine's
contexts implement every member their protocol declares."""
import ast
import typing

from protofl.algorithms.base import ClientContext, ServerContext

from conftest import REPO


def declared(proto) -> set[str]:
    names: set[str] = set()
    for k in proto.__mro__:
        if k not in (typing.Protocol, typing.Generic, object):
            names |= set(vars(k)) | set(getattr(k, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def test_every_context_member_a_method_uses_is_in_the_protocol():
    allowed = declared(ClientContext) | declared(ServerContext)
    used: dict[str, set[str]] = {}
    files = sorted((REPO / "src" / "protofl" / "algorithms").glob("*.py")) + \
        sorted((REPO / "src" / "protofl" / "nn").glob("*.py"))
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ctx":
                used.setdefault(node.attr, set()).add(f.name)
    assert {"fit", "shared_model", "rng", "log"} <= set(used)  # the scan sees the methods' calls
    missing = {k: sorted(v) for k, v in used.items() if k not in allowed}
    assert not missing, f"context members used but not in algorithms/base.py's protocols: {missing}"


def test_the_engine_contexts_implement_their_protocols():
    from protofl.engine.client import ClientContext as EngineClient
    from protofl.engine.server import ServerContext as EngineServer

    for proto, impl in ((ClientContext, EngineClient), (ServerContext, EngineServer)):
        # a member is a class attribute (method, property) or set in __init__ (an annotation or assignment)
        src = ast.parse((REPO / "src" / "protofl" / "engine" / ("client.py" if impl is EngineClient
                                                                  else "server.py")).read_text())
        cls = next(n for n in ast.walk(src) if isinstance(n, ast.ClassDef) and n.name == impl.__name__)
        assigned = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
        have = set(dir(impl)) | assigned | set(getattr(impl, "__annotations__", {}))
        assert declared(proto) <= have, (impl.__name__, sorted(declared(proto) - have))
