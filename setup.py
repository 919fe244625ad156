"""The hot path compiled with mypyc (everything else is pyproject.toml).

Why: CPU per relayed chunk is the proxy's cost against a C++ relay, and these modules are what runs
per chunk (the upstream connection, the pump, the reader, SSE framing, the OpenAI dialect): compiled,
the same code costs 6-16% less CPU per chunk at every level measured (bench/RESULTS.md, "mypyc"). The
code is mypy-strict already, so mypyc compiles it as it is.

The extensions are optional: where no C compiler is found the build warns and the package installs
as plain Python, which behaves the same, only slower. LLMPROXY_PURE_PYTHON=1 asks for that on
purpose. An editable install (`make install`) builds them in place, beside their sources: the suite
refuses to run when a source is newer than its compiled module (proxy/build.py, tests/conftest.py),
so a test never exercises a stale build; `make install` rebuilds.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy.build import sources  # noqa: E402  (the one list of hot modules; standard library only)


def extensions() -> list[Any]:
    if os.environ.get("LLMPROXY_PURE_PYTHON") == "1":
        return []
    from mypyc.build import mypycify

    # In pip's isolated build the runtime dependencies are absent: their types are Any there, and the
    # `type: ignore`s that their stubs need are unused.
    modules = mypycify([*sources(), "--ignore-missing-imports", "--no-warn-unused-ignores"], opt_level="3", group_name="llmproxy_hot")
    for module in modules:
        module.optional = True  # no compiler: a warning, and the pure-Python package
    return modules


setup(ext_modules=extensions())
