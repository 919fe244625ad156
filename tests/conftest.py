"""Fixtures: one simulator process per session, proxies in this process on real sockets."""
from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Records databases (on by default, in the user data directory) go to a directory of this session,
# for every proxy the tests start, in this process or as a child.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="llmproxy-test-data-")

from servers import Postgres, ProxyServer, Simulator  # noqa: E402

from proxy import build  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    """A hot module edited after its in-place compiled build would not be what runs: refuse."""
    stale = build.stale()
    if stale:
        raise pytest.UsageError(f"{', '.join(stale)} changed after the compiled build beside it: run `make install` "
                                "(or delete the proxy/*.so files to run interpreted)")


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    """A PostgreSQL cluster of its own per test module (a temporary folder, run as the `postgres` user)."""
    server = Postgres()
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def sim() -> Iterator[Simulator]:
    simulator = Simulator()
    yield simulator
    simulator.proc.stop()


@pytest.fixture
def proxy_factory(sim: Simulator) -> Iterator[Any]:
    servers: list[ProxyServer] = []

    def make(upstream: str | None = None, **settings: Any) -> ProxyServer:
        server = ProxyServer(upstream or f"{sim.url}/v1", **settings)
        servers.append(server)
        return server

    yield make
    try:
        for server in servers:
            server.assert_all_finished()  # after every test: no request left unfinished, no span open
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def proxy(proxy_factory: Any) -> ProxyServer:
    return proxy_factory()


@pytest.fixture(autouse=True)
def _frozen_heap() -> None:
    """Before each test, what the earlier tests left alive (the SDKs' thousands of modules and
    models, session fixtures) is collected once and frozen: the proxies under test run in this
    process, and a full collection over that heap stalls their event loop for 250-330 ms here,
    which a timing test would read as the proxy's own time (a proxy process freezes its start-up
    heap the same way: server.py). Each collection then walks only what the running test made."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _records_of_this_test(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The default records database is one file per listening port in the user's data directory: a proxy of
    this test on a port an earlier test used would serve that test's records too (a CI run read 10 where 4
    were made). A data directory per test; a proxy restarted within one test still finds its own."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data")))
