"""The records store against what a fleet does to it, in both stores (SQLite, and a real PostgreSQL):
hostile fields beside good records, a writer that meets the unexpected, and (below) upgrades,
clocks, crashes and imports in any order."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import pytest

from proxy.records import Filters, Rejected, Unavailable, Writer, open_backend
from proxy.records import codec
from proxy.records.aggregate import Fold
from proxy.records.sql import Window
from servers import Postgres

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: Any, tmp_path: Any) -> Iterator[tuple[str, str]]:
    """A fresh store of each kind: (its --records-db, its password file)."""
    if request.param == "sqlite":
        yield str(tmp_path / "records.sqlite"), ""
        return
    server: Postgres = request.getfixturevalue("pg")
    database = f"t{time.monotonic_ns()}"
    server.query(f"CREATE DATABASE {database}")
    yield server.dsn.rsplit("/", 1)[0] + f"/{database}", str(server.password_file)


def record(i: int, **fields: Any) -> dict[str, Any]:
    return {"endpoint": "chat", "stream": True, "outcome": "ok", "model": f"m-{i % 4}", "upstream": "u", "api": "openai",
            "received_unix_ns": time.time_ns(), "duration_s": 0.1, "ttft_s": 0.02, "prompt_tokens": 100, "completion_tokens": 10,
            "phases_s": {"prefill": 0.02, "decode": 0.08}, **fields}


class Counted:
    """What a writer counted: errors and drops by reason."""

    def __init__(self) -> None:
        self.errors = 0
        self.drops: dict[str, int] = {}

    def error(self) -> None:
        self.errors += 1

    def drop(self, reason: str, count: int) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count


def stored(target: tuple[str, str]) -> list[dict[str, Any]]:
    backend = open_backend(target[0], password_file=target[1])
    return [json.loads(data) for data in backend.recent(100_000, Filters())]


HOSTILE = {
    "nul": {"model": "evil\x00model"},
    "surrogate": {"model": "evil\ud800model"},  # valid JSON (`\ud800`), no UTF-8, no PostgreSQL text
    "both in the user": {"user": "u\x00\ud800x"},
    "20,000 characters": {"model": "m" * 20_000},
    "controls in the tenant": {"tenant": "t\x01\x1b[31m\x7f"},
    "a count past any integer column": {"prompt_tokens": 2**70},  # (an upstream's usage: refused by the store itself)
}


def test_hostile_fields_cost_no_other_record_its_place(target):
    """350 good records and the hostile ones among them, in the same batches: every good record is stored;
    each hostile one is stored made storable, or (the count no column holds) dropped alone and counted."""
    counted = Counted()
    writer = Writer(open_backend(target[0], password_file=target[1]), "host", 10_000, 10**8, counted.error, counted.drop)
    good = [record(i) for i in range(350)]
    for i, r in enumerate(good):
        writer.add(r)
        if i % 60 == 30:
            for name, fields in HOSTILE.items():
                writer.add(record(i, hostile=name, **fields))
    writer.flush(timeout=30)
    writer.close()
    got = stored(target)
    assert {r["id"] for r in good} <= {r["id"] for r in got}  # no good record lost
    hostile = [r for r in got if "hostile" in r]
    rounds = sum(1 for i in range(350) if i % 60 == 30)
    assert len(hostile) == rounds * (len(HOSTILE) - 1) and counted.drops == {"rejected": rounds}
    for r in hostile:
        assert "\x00" not in json.dumps(r) and "\\ud800" not in json.dumps(r)
    assert max(len(r["model"]) for r in hostile) == 20_000  # (the record keeps what it was given, made storable...)
    backend = open_backend(target[0], password_file=target[1])
    folded = Fold(("model",))
    backend.aggregate(folded, Window())
    models = {key[0] for key in folded.groups}
    assert max(map(len, models)) <= 256  # (...its columns and aggregates at most 256 characters)


class Flaky:
    """A backend that raises the unexpected once on write and once on retention, then behaves."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.writes, self.retains = inner, 0, 0
        self.where, self.retain_every_s = inner.where, 0.05

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, rows: list[Any]) -> int:
        self.writes += 1
        if self.writes == 1:
            raise RuntimeError("injected: a bug in the write path")
        return self.inner.write(rows)

    def maintain(self) -> tuple[int, int]:
        self.retains += 1
        if self.retains == 1:
            raise KeyError("injected: a malformed row while moving records in")
        return self.inner.maintain()

    @property
    def tally(self) -> Any:
        return self.inner.tally

    @tally.setter
    def tally(self, value: Any) -> None:
        self.inner.tally = value


def test_the_writer_survives_an_injected_exception(target):
    counted = Counted()
    flaky = Flaky(open_backend(target[0], password_file=target[1]))
    writer = Writer(flaky, "host", 10_000, 10**8, counted.error, counted.drop)
    first = [record(i) for i in range(40)]
    for r in first:
        writer.add(r)
    writer.flush(timeout=30)
    deadline = time.monotonic() + 10
    while flaky.retains < 2 and time.monotonic() < deadline:  # (retention passes run, the first one failing)
        time.sleep(0.05)
    later = [record(i) for i in range(40)]
    for r in later:
        writer.add(r)
    writer.flush(timeout=30)
    assert writer._thread.is_alive() and flaky.retains >= 2
    writer.close()
    ids = {r["id"] for r in stored(target)}
    # The batch the injected failure hit was split and written again: only a record that fails alone is dropped.
    assert {r["id"] for r in first + later} == ids and counted.drops == {} and counted.errors >= 2


def test_hostile_requests_through_the_proxy_are_stored_made_storable(target, proxy_factory, sim):
    """The official client sends what a hostile or buggy caller would, among 350 good streams: a model with a NUL,
    one of 20,000 characters, one with terminal escapes, one with a lone surrogate (orjson refuses it; read as the
    engines read it, Python's json: its model kept, made storable), an end user with a NUL. Every request has its record."""
    import httpx
    import openai
    from concurrent.futures import ThreadPoolExecutor

    proxy = proxy_factory(records_db=target[0], records_db_password_file=target[1])
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    hostile = [{"model": "evil\x00model"}, {"model": "m" * 20_000}, {"model": "m\x1b[31mred\x07"}, {"model": "evil\ud800model"},
               {"model": "sim-7b", "user": "u\x00x"}]

    def one(i: int) -> None:
        fields = hostile[i // 70] if i % 70 == 35 and i // 70 < len(hostile) else {"model": "sim-7b"}
        if "\ud800" in fields["model"]:  # (the official client cannot even encode it: a caller writing its own JSON)
            body = json.dumps({"model": fields["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
            httpx.post(f"{proxy.v1}/chat/completions", content=body.encode(), headers={"content-type": "application/json"}, timeout=30)
            return
        try:
            list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
                                                extra_headers={"x-sim-ttft-ms": "1"}, **fields))
        except openai.APIError:
            pass  # (the simulator refuses the JSON it cannot read, as an engine would: the request still has its record)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(355)))
    proxy.app.telemetry.records_sink.store.flush(timeout=30)
    got = stored(target)
    assert len(got) == 355, len(got)
    models = sorted({r["model"] for r in got})
    assert models == sorted({"sim-7b", "evil\ufffdmodel", "m" * 256, "m\ufffd[31mred\ufffd"}), models
    assert sum(1 for r in got if r["model"] == "evil\ufffdmodel") == 2  # (the NUL's and the lone surrogate's)
    assert sum(1 for r in got if r.get("user") == "u_x") == 1  # (the end user: printable ASCII, tenants.py)
    scrape = httpx.get(f"{proxy.url}/metrics").text
    assert "\x00" not in scrape and 'reason="rejected"} 0.0' in scrape and 'reason="buffer_full"} 0.0' in scrape


PRELUDE = """
import asyncio, json, sys, threading, time
sys.path.insert(0, {root!r})
def record(i):
    return {{"endpoint": "chat", "outcome": "ok", "model": "m", "upstream": "u", "api": "openai", "received_unix_ns": time.time_ns(),
             "duration_s": 0.1}}
def written(store):  # 30 records added and written
    for i in range(30):
        store.add(record(i))
    store.flush(timeout=30)
"""  # (what the scripts below, run by another interpreter, begin with)

CRASHING = PRELUDE + """
from proxy.records import Writer, open_backend

class Stuck:  # writes hang after the first batch (the store's write in flight when the process is killed)
    def __init__(self, inner):
        self.inner, self.writes = inner, 0
        self.where, self.retain_every_s = inner.where, 0.2
    def __getattr__(self, name):
        return getattr(self.inner, name)
    @property
    def tally(self):
        return self.inner.tally
    @tally.setter
    def tally(self, value):
        self.inner.tally = value
    def write(self, rows):
        self.writes += 1
        if self.writes > 1:
            threading.Event().wait()
        return self.inner.write(rows)

writer = Writer(Stuck(open_backend({target!r}, password_file={password!r})), "crashing", 10_000, 10**8, lambda: None, lambda *a: None)
written(writer)
for i in range(17):  # numbered, never written
    writer.add(record(i))
time.sleep(1.0)  # (its maintenance pass writes how far it has numbered)
print("ready", flush=True)
threading.Event().wait()
"""


def test_a_writer_killed_with_its_records_buffered_is_counted_by_the_next(target, tmp_path):
    """kill -9 with 17 records numbered and not written (its write hangs): the next writer's maintenance finds its
    boot gone and counts exactly those 17, once; the store keeps the 30 it wrote."""
    import os
    import signal
    import subprocess
    import sys

    from servers import ROOT

    code = CRASHING.format(root=str(ROOT), target=target[0], password=target[1])
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    lost: list[int] = []
    counted = Counted()
    writer = Writer(open_backend(target[0], password_file=target[1]), "next", 1000, 10**7, counted.error, counted.drop, on_lost=lost.append)
    writer.add(record(0))
    writer.flush(timeout=30)
    deadline = time.monotonic() + 15
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    writer.close()
    assert lost == [17]
    assert sum(1 for r in stored(target) if r["id"].startswith("crashing/")) == 30
    later = open_backend(target[0], password_file=target[1])
    later.open()
    assert later.maintain() == (0, 0)  # counted once: the next pass of anyone finds nothing more
    later.close()


HOLDING = PRELUDE + """
from proxy.records import outbox
outbox.HOLD_S = 3600.0  # (what is added next stays held until the kill)
box = outbox.Outbox({target!r}, {{"password_file": {password!r}}}, "holding", 10_000, 10**8, lambda: None, lambda *a: None)
written(box)
async def hold():
    for i in range(5):  # on the loop, as the finisher adds them: numbered, held, never handed over
        box.add(record(i))
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(hold())
"""


def test_records_held_in_the_serving_process_at_a_kill_9_are_counted_by_the_next(target, tmp_path):
    """The serving process holds records before it hands them to its writer process (outbox.py); kill -9 with 5
    held: its writer process, left alone, ends with the boot's figures (the 5 numbered, in shared memory), and the
    next writer counts exactly those 5 lost, once; the store keeps the 30 handed over before."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from servers import ROOT

    code = HOLDING.format(root=str(ROOT), target=target[0], password=target[1])
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    os.kill(process.pid, signal.SIGKILL)  # (the serving process only: its writer process sees the pipe end)
    process.wait()
    lost: list[int] = []
    counted = Counted()
    writer = Writer(open_backend(target[0], password_file=target[1]), "next", 1000, 10**7, counted.error, counted.drop, on_lost=lost.append)
    try:
        deadline = time.monotonic() + 20
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        writer.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # (its writer process, if still there)
    assert lost == [5]
    assert sum(1 for r in stored(target) if r["id"].startswith("holding/")) == 30


def counts(backend: Any, start_ns: int) -> tuple[int, int]:
    """(records the rollup counts in the window, records its histograms count: the prompt figure, every ok one's)."""
    from proxy.records import columns as C

    folded = Fold(("model",))
    backend.aggregate(folded, Window(start_ns))
    return sum(a.requests for a in folded.groups.values()), sum(a.count(C.PROMPT) for a in folded.groups.values())


def execute(target: tuple[str, str], statement: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """A statement on the store, as another program would run it."""
    if target[0].startswith("postgresql://"):
        from proxy.records.deadline import connect

        with connect(target[0], target[1]) as conn:
            cursor = conn.execute(statement.replace("?", "%s"), args)
            return cursor.fetchall() if cursor.description else []
    import sqlite3

    with sqlite3.connect(target[0]) as db:
        return db.execute(statement, args).fetchall()


def test_a_replica_whose_clock_is_behind_loses_no_record_from_the_percentiles(target, monkeypatch):
    """Its records reach a block the store compacted already: the block is marked dirty by what is compacted, not by
    anyone's clock, compacted again, and its histograms count them."""
    backend = open_backend(target[0], password_file=target[1])
    backend.open()
    forty = time.time_ns() - 40 * 60 * 10**9
    block = forty - forty % (600 * 10**9)
    write = lambda n, at: backend.write([Writer.row(json.dumps(record(i, received_unix_ns=at + i * 10**6, id=f"r{at}-{i}")).encode())  # noqa: E731
                                         for i in range(n)])
    assert write(10, block + 60 * 10**9) == 10
    assert backend.compact() >= 1
    assert counts(backend, block) == (10, 10)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 45 * 60 * 10**9)  # this replica's clock: 45 minutes behind
    assert write(3, block + 120 * 10**9) == 3  # (to it, the block ended a moment ago)
    monkeypatch.setattr(time, "time_ns", real)
    backend.compact()
    assert counts(backend, block) == (13, 13)
    backend.close()


def test_a_window_older_than_the_blocks_histograms_reads_no_dropped_block(target):
    """Three days back, past the ten-minute histograms' two days: a window starting mid-hour reads that hour's first
    part from its records, never from blocks whose histograms retention dropped (they would count as zeros), and
    retention takes away what said they were compacted."""
    backend = open_backend(target[0], password_file=target[1])
    backend.open()
    hour = time.time_ns() - 3 * 86400 * 10**9
    hour -= hour % (3600 * 10**9)
    rows = [Writer.row(json.dumps(record(i, received_unix_ns=hour + i * 60 * 10**9, id=f"old-{i}")).encode()) for i in range(60)]
    assert backend.write(rows) == 60
    assert backend.compact() >= 1  # (its hour)
    for block in range(6):  # its blocks, compacted back then, their histograms since dropped by retention
        execute(target, "INSERT INTO llmproxy_compacted (span, start, at_ns) VALUES (?, ?, ?)", (600 * 10**9, hour + block * 600 * 10**9, hour))
    assert counts(backend, hour) == (60, 60)
    assert counts(backend, hour + 25 * 60 * 10**9) == (35, 35)  # (from minute 25: the hour's rest from its records)
    backend.maintain()
    assert execute(target, "SELECT count(*) FROM llmproxy_compacted WHERE span = ?", (600 * 10**9,)) == [(0,)]
    backend.close()


def test_a_kill_9_under_load_is_counted_on_restart(pg, sim, tmp_path):
    """A proxy on the fleet's PostgreSQL, its writes held up (an operator's LOCK on the records) so that its writer
    process holds what it numbers; 120 requests answered; then kill -9 of the proxy and its writer process (the
    whole container, as an OOM kill does). The next proxy finds the dead boot and counts exactly what it lost:
    every answered request whose record the store does not have."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    import psycopg

    from proxy.processes import free_port, wait_healthy
    from proxy.records.deadline import connect
    from servers import ROOT, scraped

    database = f"t{time.monotonic_ns()}"
    pg.query(f"CREATE DATABASE {database}")
    dsn = pg.dsn.rsplit("/", 1)[0] + f"/{database}"

    def start(name: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--upstream", f"{sim.url}/v1", "--port", str(port),
                                    "--records-db", dsn, "--records-db-password-file", str(pg.password_file), "--instance", name],
                                   cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/healthz", process)
        return process, url

    first, url = start("first")
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(30):  # (written: the store has them)
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-sim-ttft-ms": "1"}, timeout=30).status_code == 200
    deadline = time.monotonic() + 15
    while int(pg.query("SELECT 1") and execute((dsn, str(pg.password_file)), "SELECT count(*) FROM llmproxy_records")[0][0]) < 30:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with connect(dsn, str(pg.password_file)) as holder:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE llmproxy_records IN SHARE MODE")  # (writes wait; the writer's heartbeat still goes through)
        for _ in range(90):
            assert httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-sim-ttft-ms": "1"}, timeout=30).status_code == 200
        deadline = time.monotonic() + 15  # (its maintenance pass, every 5 s, writes how far it has numbered: all 120)
        while execute((dsn, str(pg.password_file)), "SELECT coalesce(max(assigned), 0) FROM llmproxy_boots WHERE instance = 'first'")[0][0] < 120:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # the serving process and its writer process
        first.wait()
        holder.execute("ROLLBACK")
    stored = execute((dsn, str(pg.password_file)), "SELECT count(*) FROM llmproxy_records WHERE instance = 'first'")[0][0]
    assert 30 <= stored < 120
    second, url2 = start("second")
    try:
        deadline = time.monotonic() + 20
        while scraped(url2, "llmproxy_records_lost_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert scraped(url2, "llmproxy_records_lost_total") == 120 - stored
        # (two rows: the serving process's, what it still held; its records process's, what that one held unwritten)
        assert execute((dsn, str(pg.password_file)), "SELECT array_agg(DISTINCT state), sum(lost) FROM llmproxy_boots "
                       "WHERE instance = 'first'") == [(["lost"], 120 - stored)]
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(30)
