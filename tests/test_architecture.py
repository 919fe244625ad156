"""The structure as drawn from the imports (scripts/architecture.py): proxy/'s folders and top-level modules as
nodes, no circle between them, every arrow pointing down the layers docs/architecture.md lists, the folders small,
every module small enough to read in one sitting, and the map in docs/architecture.md the code's."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import architecture as A  # noqa: E402


def test_the_finder_sees_a_circle_and_an_arrow_up():
    assert A.cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert A.cycle({"a": {"b"}, "b": set()}) is None
    assert A.upward({"proxy.wire": {"proxy.serve"}, "proxy.serve": {"proxy.wire"}}) == [("proxy.wire", "proxy.serve")]
    assert A.upward({"proxy.newfolder": {"proxy.wire"}}) == [("proxy.newfolder", "proxy.wire")]  # (a node the layers do not name)


def test_every_import_is_read_even_inside_a_function():
    modules = A.imports()
    assert "proxy.serve.relay" in modules["proxy.serve.app"] and "proxy.upstream.pump" in modules["proxy.serve.reply"]
    assert "proxy.config" in modules["proxy.cli"]  # (cli imports most of what it runs inside its commands)
    assert "proxy.measure.context" in modules["proxy.fleet.placement"]  # (a TYPE_CHECKING import)


def test_the_folders_draw_no_circle_and_every_arrow_points_down():
    edges = A.graph()
    assert "proxy.fleet" in edges["proxy.serve"] and "proxy.upstream" in edges["proxy.fleet"]  # (the graph is really drawn)
    assert set(edges) <= set(A.LAYERS), set(edges) - set(A.LAYERS)
    assert A.cycle(edges) is None, A.cycle(edges)
    assert A.upward(edges) == []
    # The cycles the issue found, gone for good: measurement knows neither the fleet nor the records, the pool not the fleet.
    for low, high in (("proxy.measure", "proxy.fleet"), ("proxy.measure", "proxy.records"), ("proxy.upstream", "proxy.fleet"),
                      ("proxy.measure", "proxy.answers"), ("proxy.fleet", "proxy.serve")):
        assert high not in edges[low], (low, high)


def test_few_modules_beside_the_folders_and_no_folder_too_big():
    assert len(A.top_modules()) <= A.MAX_TOP_MODULES, A.top_modules()
    sizes = {folder: len(names) for folder, names in A.folders().items()}
    assert len(sizes) >= 6 and max(sizes.values()) <= A.MAX_FOLDER_MODULES, sizes


def test_every_module_reads_in_one_sitting():
    long = {str(path.relative_to(ROOT)): n for path in A.PROXY.rglob("*.py") if (n := len(path.read_text().splitlines())) >= 400}
    assert not long, long


def test_the_map_in_the_docs_is_the_codes():
    text = A.DOC.read_text()
    assert A.rewrite(text) == text, "run: .venv/bin/python scripts/architecture.py"
    assert A.problems() == []
