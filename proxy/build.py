"""The hot path's build: which modules setup.py compiles with mypyc, and whether they run compiled.

Compiled, a relayed chunk costs 6-16% less CPU (bench/RESULTS.md, "mypyc"); interpreted, the same
code behaves the same. An in-place build (the editable install) sits beside its sources and is
imported instead of them: a source edited after the build would not run at all, so `stale` names
such sources (the suite refuses to start on any, the server logs them). Standard library only:
setup.py imports this before the package's dependencies exist.
"""
from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path

# The modules a relayed chunk runs through, and the record it is noted on (timing: RequestTiming, read
# and written per chunk, and the split at the finish; context: the stored record). apis.azure subclasses
# OpenAI (an interpreted class cannot inherit from a compiled one). The other dialects read their streams'
# events too, and with tokens they read a prompt's parts and look them up in the token cache at the finish:
# an agent's turn walks some 160 parts (140 to 70 µs a turn in process, compiled).
HOT_MODULES = ("upstream.connection", "upstream.pump", "upstream.reader", "wire.sse", "wire.framing", "wire.chunk", "measure.arrival", "measure.reads", "measure.timing",
               "measure.context", "wire.tokens", "apis.openai", "apis.azure", "apis.anthropic", "apis.gemini")
PACKAGE = Path(__file__).resolve().parent


def sources() -> list[str]:
    """The hot modules' source files, relative to the project (what setup.py hands mypyc)."""
    return [f"proxy/{name.replace('.', '/')}.py" for name in HOT_MODULES]


def compiled() -> list[str]:
    """The hot modules that this process runs compiled (imported from an extension module)."""
    names = []
    for name in HOT_MODULES:
        module = importlib.import_module(f"proxy.{name}")
        if str(getattr(module, "__file__", "")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            names.append(name)
    return names


def stale() -> list[str]:
    """Sources changed after the compiled module beside them was built (that module runs, not them).
    Only in a checkout (setup.py beside the package): an installed wheel writes both at install time."""
    if not (PACKAGE.parent / "setup.py").exists():
        return []
    # Each module's extension is a shim; the code is in the group's one library. A failed C compile (the
    # extensions are optional) rebuilds the shims and leaves the old library: both must be newer.
    group = [PACKAGE.parent / f"llmproxy_hot__mypyc{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    out = []
    for name in HOT_MODULES:
        source = PACKAGE / f"{name.replace('.', '/')}.py"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            built = source.with_name(source.stem + suffix)
            if built.exists() and source.exists() and any(source.stat().st_mtime > b.stat().st_mtime for b in [built, *group] if b.exists()):
                out.append(str(source.relative_to(PACKAGE.parent)))
    return out
