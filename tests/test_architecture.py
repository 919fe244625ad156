"""The structure as drawn from the imports: no circle between the proxy's modules (a subpackage, a
family behind one interface, is one node: its modules import their interface from it), and every
module small enough to read in one sitting."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"


def node(module: str) -> str:
    """proxy.apis.openai -> proxy.apis (a subpackage is one node); proxy.relay -> proxy.relay."""
    parts = module.split(".")
    return ".".join(parts[:2])


def modules() -> dict[str, Path]:
    out = {}
    for path in PROXY.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def graph() -> dict[str, set[str]]:
    """Every import, at any level of a module (functions and TYPE_CHECKING blocks too)."""
    known = modules()
    edges: dict[str, set[str]] = {node(m): set() for m in known}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for item in ast.walk(ast.parse(path.read_text())):
            if isinstance(item, ast.ImportFrom):
                base = item.module or ""
                if item.level:
                    anchor = package.split(".")[: len(package.split(".")) - (item.level - 1)]
                    base = ".".join(anchor + ([item.module] if item.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in item.names]
            elif isinstance(item, ast.Import):
                targets = [a.name for a in item.names]
            else:
                continue
            for target in targets:
                if target.startswith("proxy") and node(target) != node(module):
                    edges[node(module)].add(node(target))
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle, if there is any (depth-first search)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_finder_sees_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_imports_draw_no_circle():
    edges = graph()
    assert "proxy.relay" in edges["proxy.app"] and "proxy.pump" in edges["proxy.reply"]  # (the graph is really drawn)
    assert cycle(edges) is None, cycle(edges)


def test_every_module_reads_in_one_sitting():
    long = {str(path.relative_to(ROOT)): n for path in PROXY.rglob("*.py") if (n := len(path.read_text().splitlines())) >= 400}
    assert not long, long
