"""Durable per-request records in SQLite: every outcome and every worker written, nothing secret
stored, retention enforced, a locked or corrupt file never reaches a request."""
from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import openai
import pytest

from servers import Process
from proxy.processes import free_port
from proxy.records import Filters, Writer
from proxy.records.sqlite import SQLiteBackend

pytestmark = pytest.mark.e2e
KEY = "sk-live-RECORDS-SECRET-0123456789"
PROMPT = "PROMPT-MARKER-6d1f2 tell me about the weather"


def rows(path: Path) -> list[tuple]:
    """(pid, model, endpoint, outcome) of every stored record (the pid: from its id, instance/pid/boot/seq)."""
    db = sqlite3.connect(path)
    try:
        return [(rid.split("/")[-3], *rest) for rid, *rest in db.execute("SELECT rid, model, endpoint, outcome FROM llmproxy_records ORDER BY id")]
    finally:
        db.close()


def recent(path: str, limit: int) -> list[bytes]:
    return SQLiteBackend(path).recent(limit, Filters())


def until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_every_outcome_is_written_and_nothing_secret_is(proxy_factory, tmp_path):
    path = tmp_path / "records.sqlite"
    proxy = proxy_factory(records_db=str(path), first_token_timeout=0.3)
    capped = proxy_factory(records_db=str(path), max_in_flight=1)  # a second proxy on the same file
    client = openai.OpenAI(base_url=proxy.v1, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="sim-7b", messages=messages, max_tokens=12, stream=True) if c.choices)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="sim-7b", messages=messages, max_tokens=3, extra_headers={"x-sim-error-status": "500"})
    with pytest.raises(openai.APIStatusError):  # 504: no first token within 0.3 s
        client.chat.completions.create(model="sim-7b", messages=messages, max_tokens=3, extra_headers={"x-sim-ttft-ms": "2000"})
    other = openai.OpenAI(base_url=capped.v1, api_key=KEY, max_retries=0)
    slow = other.chat.completions.create(model="sim-7b", messages=messages, max_tokens=40, stream=True,
                                         extra_headers={"x-sim-decode-tps": "20"})
    next(iter(slow))
    with pytest.raises(openai.APIStatusError):  # over --max-in-flight 1
        other.chat.completions.create(model="sim-7b", messages=messages, max_tokens=3)
    slow.close()  # the client leaves mid-stream
    client.responses.create(model="sim-7b", input=PROMPT, max_output_tokens=5)
    records = proxy.wait_records(6, timeout=10)
    outcomes = sorted(r["outcome"] for r in records)
    assert outcomes == sorted(["ok", "upstream_error", "timeout", "overloaded", "client_disconnect", "ok"]), outcomes
    stored = rows(path)
    assert sorted(outcome for *_, outcome in stored) == outcomes  # /llmproxy/requests read the database
    assert {endpoint for _, _, endpoint, _ in stored} == {"chat", "responses", "other"}  # (shed before its body was read)
    first = records[0]
    assert first["content_chunks"] == 12 and len(first["content_offsets_ms"]) == 12 and first["upstream"]
    assert first["in_flight_at_decode"] == 1 and first["received_unix_ns"] > 1.7e18
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("records.sqlite"))
    raw += b"".join(SQLiteBackend(str(path)).export(0))  # (each record's JSON is stored compressed: read back whole too)
    assert KEY.encode() not in raw and b"RECORDS-SECRET" not in raw and b"PROMPT-MARKER" not in raw
    assert len(text) > 20 and text.encode() not in raw  # nor the completion


def test_every_worker_writes_and_nothing_is_lost(tmp_path, sim):
    path = tmp_path / "records.sqlite"
    port = free_port()
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--workers", "2", "--records-db", str(path)],
                    f"http://127.0.0.1:{port}/healthz")
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}

    def one(_: int) -> int:
        with httpx.Client(timeout=30) as c:  # a new connection per request: the kernel spreads them over both workers
            return c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).status_code

    sent = 0
    try:
        for _ in range(10):  # which worker accepts is the kernel's choice: batches until both served some
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(one, range(40))) == [200] * 40
            sent += 40
            if len({pid for pid, *_ in rows(path)}) == 2:
                break
        deadline = time.monotonic() + 5  # each worker writes within a quarter second of a request's end
        while len(rows(path)) < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        served = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": 10_000}).json()
    finally:
        proxy.stop()
    stored = rows(path)
    assert len(stored) == sent and len(served) == sent  # every worker's records, none lost, from either worker
    assert len({pid for pid, *_ in stored}) == 2, "both workers wrote"


def record(**fields) -> dict:
    return {"endpoint": "chat", "stream": True, "outcome": "ok", "model": "m", "upstream": "u", "api": "openai",
            "received_unix_ns": time.time_ns(), "duration_s": 0.1, **fields}


def writer(path: str, errors: list[int], drops: list[tuple[str, int]] | None = None, **limits) -> Writer:
    backend = SQLiteBackend(path, limits.pop("max_rows", 0), limits.pop("max_age_s", 0.0), limits.pop("busy_timeout_s", 5.0))
    return Writer(backend, "test", limits.pop("max_records", 1000), limits.pop("max_bytes", 10**7), lambda: errors.append(1),
                  lambda reason, n: (drops if drops is not None else []).append((reason, n)))


def test_retention_keeps_rows_and_age_bounded(tmp_path):
    path = str(tmp_path / "r.sqlite")
    errors: list[int] = []
    store = writer(path, errors, max_rows=50, max_age_s=1.0)
    for _ in range(200):
        store.add(record())
    store.flush()
    assert until(lambda: len(recent(path, 1000)) == 50)  # (retention runs every second)
    time.sleep(1.2)
    store.add(record())
    store.flush()
    assert until(lambda: len(recent(path, 1000)) == 1)  # the 50 older than max_age are gone
    store.close()
    assert not errors


def test_a_locked_file_is_counted_and_written_once_free(tmp_path):
    path = str(tmp_path / "r.sqlite")
    errors: list[int] = []
    store = writer(path, errors, busy_timeout_s=0.2)
    store.add(record())
    store.flush()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
    store.add(record())
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    assert errors, "the locked write was counted"
    holder.execute("ROLLBACK")
    holder.close()
    store.add(record())
    store.flush(timeout=10)
    store.close()
    assert len(recent(path, 10)) == 3  # the one added during the lock waited in the buffer, and went in once the file was free


def test_past_the_buffer_the_oldest_are_dropped_and_counted(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the database's folder would be: the store cannot open")
    errors: list[int] = []
    drops: list[tuple[str, int]] = []
    store = writer(str(blocker / "r.sqlite"), errors, drops, max_records=10)
    for i in range(25):
        store.add(record(model=f"m{i}"))
    assert sum(n for reason, n in drops if reason == "buffer_full") == 15 and store.buffered == 10  # the 15 oldest went
    store.close(timeout=0.5)
    assert [(reason, n) for reason, n in drops if reason == "shutdown"] == [("shutdown", 10)] and errors  # the rest, at the deadline


def test_a_corrupt_file_never_reaches_a_request(proxy_factory, tmp_path):
    path = tmp_path / "records.sqlite"
    path.write_bytes(b"this is not a database " * 100)
    proxy = proxy_factory(records_db=str(path))
    client = openai.OpenAI(base_url=proxy.v1, api_key="k", max_retries=0)
    for _ in range(3):
        assert client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=3).choices
    records = proxy.wait_records(3)  # served from memory when the database cannot be read
    assert len(records) == 3 and all(r["outcome"] == "ok" for r in records)
    assert proxy.sample("llmproxy_telemetry_errors_total", {"component": "records"}) >= 1


def test_a_schema_1_file_is_moved_in_place_while_an_old_worker_keeps_writing(tmp_path):
    """An embedded store written by the previous version: its records move into this schema (their own
    end times, their aggregates), while a worker of the old version still running on the file (a
    restart) keeps writing to its table, whose records follow them."""
    import explain_reference
    import fleet
    import schema1
    from test_aggregate import differences

    from proxy.answers.explain import explain, gather

    path = str(tmp_path / "old.sqlite")
    records = list(fleet.records(520, time.time_ns() - 3 * 3600 * 10**9, 3 * 3600, models=6, instances=1, seed=5))
    schema1.sqlite_create(path)
    schema1.sqlite_write(path, records[:500])
    store = SQLiteBackend(path)
    assert store.pending() == 500
    store.open()
    schema1.sqlite_write(path, records[500:510])  # the old worker, after the new one migrated: schema_version is still 1
    while store.pending():
        store.maintain()
    schema1.sqlite_write(path, records[510:])
    assert store.pending() == 10
    store.maintain()
    store.close()
    stored = [orjson.loads(data) for data in store.recent(1000, Filters())]
    assert store.pending() == 0 and len(stored) == 520 and all(r["id"].startswith(f"{r['instance']}/v1/") for r in stored)
    got = explain(gather([store]), objectives=fleet.OBJECTIVES)
    assert differences(got, explain_reference.explain(records, objectives=fleet.OBJECTIVES)) == []


def test_a_version_2_file_migrates_while_an_old_worker_keeps_writing(tmp_path):
    """Store version 3 (tenants) over a file of version 2: its columns added in place; a worker of
    version 2 still running keeps writing (tenant unknown, no per-tenant sums); explain answers as
    every record did, and `--by tenant` counts every record, the old ones as `unknown`."""
    import explain_reference
    import fleet
    import schema2
    from test_aggregate import differences

    from proxy.answers import ledger
    from proxy.answers.explain import explain, gather

    path = str(tmp_path / "v2.sqlite")
    records = list(fleet.records(400, time.time_ns() - 3 * 3600 * 10**9, 3 * 3600, models=4, instances=1, seed=9))
    for record in records[340:]:
        record.update(tenant="search", user="u-1")
    store = SQLiteBackend(path)
    store.open()
    store.close()
    old = sqlite3.connect(path, isolation_level=None)
    schema2.downgrade(old, postgres=False)
    schema2.write(old, records[:300], postgres=False)
    store.open()  # this version's worker starts: version 3
    assert old.execute("SELECT value FROM meta WHERE key = 'store_version'").fetchone() == ("3",)
    schema2.write(old, records[300:340], postgres=False)  # the old worker, still running
    store.write([Writer.row(orjson.dumps(r)) for r in records[340:]])
    store.close()
    got = explain(gather([store]), objectives=fleet.OBJECTIVES)
    assert differences(got, explain_reference.explain(records, objectives=fleet.OBJECTIVES)) == []
    tenants = ledger.gather([store])
    assert {t: agg.requests for t, agg in tenants.items()} == {"unknown": 340, "search": 60}
    assert ledger.mean(tenants["search"]) is not None and ledger.mean(tenants["unknown"]) is None  # (version 2 kept no sums)
    assert [orjson.loads(d)["user"] for d in store.recent(10, Filters(tenant="search", user="u-1"))] == ["u-1"] * 10


def test_a_migration_that_fails_half_way_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """SQLite's migration is one transaction: a statement failing after the columns were added takes them back
    (executescript would have committed them first), and the file stays a store its old workers write to."""
    import schema2

    from proxy.records import Unavailable
    from proxy.records import sqlite as store_module

    path = str(tmp_path / "v2.sqlite")
    store = SQLiteBackend(path)
    store.open()
    store.close()
    old = sqlite3.connect(path, isolation_level=None)
    schema2.downgrade(old, postgres=False)
    columns = [row[1] for row in old.execute("PRAGMA table_info(llmproxy_records)")]
    monkeypatch.setattr(store_module, "SCHEMA", store_module.SCHEMA + "CREATE TABLE llmproxy_records (broken INTEGER);\n")
    with pytest.raises(Unavailable, match="already exists"):
        store.open()
    assert [row[1] for row in old.execute("PRAGMA table_info(llmproxy_records)")] == columns and "tenant" not in columns
    assert old.execute("SELECT value FROM meta WHERE key = 'store_version'").fetchone() == ("2",)
    assert old.execute("SELECT 1 FROM sqlite_master WHERE name = 'llmproxy_boots'").fetchone() is None
    monkeypatch.undo()
    store.open()  # (and done right, it takes)
    assert "tenant" in [row[1] for row in old.execute("PRAGMA table_info(llmproxy_records)")]
    store.close()


def outbox_record(i: int, pad: int = 0) -> dict:
    """A minimal record for the outbox tests, `model` m{i} (and `pad` bytes of error text, to fill a pipe)."""
    return {"endpoint": "chat", "stream": True, "outcome": "ok", "model": f"m{i}", "upstream": "u", "api": "openai",
            "received_unix_ns": time.time_ns(), "duration_s": 0.1, **({"error": "x" * pad} if pad else {})}


def stored(outbox, limit: int = 1000) -> int:
    """How many records the outbox's store holds (0 until the writer process made the file)."""
    try:
        return len(outbox.recent(limit, Filters()))
    except sqlite3.Error:
        return 0


def test_the_outbox_sleeps_while_idle_and_wakes_for_a_record(tmp_path):
    """The serving process's sender thread hands records to the writer process: a record added after a long idle
    still reaches the store with no flush asked (the wake is not lost), and idle it takes no CPU (it once woke every
    10 ms: 8 ms of CPU a second, and the relay's GIL 100 times a second); nor does the records process wake it."""
    import threading

    from proxy.records.outbox import Outbox

    path = str(tmp_path / "records.sqlite")
    errors: list[int] = []
    reports: list[tuple[int, int]] = []  # (stored, waiting): what the records process reported, batch by batch
    outbox = Outbox(path, {}, "test", 1000, 1 << 20, lambda: errors.append(1), lambda reason, n: errors.append(n),
                    lambda stored, waiting: reports.append((stored, waiting)))
    try:
        outbox.add(outbox_record(1))
        assert until(lambda: stored(outbox) == 1)  # (no flush: the sender woke for it)
        sender = next(t for t in threading.enumerate() if t.name == "llmproxy-records-send")
        schedstat = Path(f"/proc/self/task/{sender.native_id}/schedstat")
        assert until(lambda: sum(n for n, _ in reports) == 1)
        before, reported = int(schedstat.read_text().split()[0]), len(reports)
        time.sleep(1.5)
        idle_cpu_s = (int(schedstat.read_text().split()[0]) - before) / 1e9
        assert idle_cpu_s < 0.003, idle_cpu_s  # (the 10 ms poll: 0.012)
        assert reports[reported:] == []  # (an idle writer's pass every second once reported an empty batch, waking this process)
        for i in range(2, 5):  # after the idle: each added alone, each written
            outbox.add(outbox_record(i))
            assert until(lambda: stored(outbox) == i), i
        assert sorted(orjson.loads(r)["model"] for r in outbox.recent(10, Filters())) == ["m1", "m2", "m3", "m4"]
        assert not errors
    finally:
        outbox.close()


def test_on_the_event_loop_records_go_to_the_writer_process_without_waking_the_sender_thread(tmp_path):
    """The finisher adds records on the event loop, which writes them to the pipe itself, on a timer: the sender
    thread is not scheduled at all (it once ran for each, 70-160 µs of CPU on this VM per wake-up). Records at an
    agent's pace are held together until the oldest waited `HOLD_S` (a message wakes the writer process), a full
    batch goes at once; each record is stored."""
    import asyncio
    import threading

    from proxy.records import outbox as outbox_module
    from proxy.records.outbox import Outbox

    path = str(tmp_path / "records.sqlite")
    errors: list[int] = []
    outbox = Outbox(path, {}, "test", 1000, 1 << 20, lambda: errors.append(1), lambda reason, n: errors.append(n))
    try:
        sender = next(t for t in threading.enumerate() if t.name == "llmproxy-records-send")
        schedstat = Path(f"/proc/self/task/{sender.native_id}/schedstat")

        def runs() -> int:
            return int(schedstat.read_text().split()[2])  # (how many times the thread was put on a CPU)

        def asleep() -> bool:  # (its start over: it waits for a record, a flush or the close, and runs no more)
            before = runs()
            time.sleep(0.2)
            return runs() == before

        assert until(asleep)
        runs_before = runs()
        held: list[int] = []

        async def agent_pace() -> None:
            for i in range(10):  # one at a time, each after the window: held together
                outbox.add(outbox_record(i))
                await asyncio.sleep(outbox_module.SEND_S * 2)
            held.append(len(outbox._queue))
            await asyncio.sleep(outbox_module.HOLD_S)  # the oldest waited HOLD_S: all ten went in one message
            held.append(len(outbox._queue))
            for i in range(10, 10 + outbox_module.HOLD_RECORDS):  # a full batch: at once
                outbox.add(outbox_record(i))
            held.append(len(outbox._queue))

        asyncio.run(agent_pace())
        assert held == [10, 0, 0]
        assert until(lambda: stored(outbox) == 10 + outbox_module.HOLD_RECORDS)
        assert runs() - runs_before == 0
        assert not errors
    finally:
        outbox.close()


@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_a_writer_process_killed_is_replaced_and_the_records_after_it_are_stored(tmp_path, on_loop):
    """kill -9 of the records process (the OOM killer): the next message finds the pipe broken, whether the loop
    or the sender thread writes it; another writer process is started, the failure counted, and the records
    from then on are stored (what the dead one held is its boot's to count: boots.py)."""
    import asyncio
    import os
    import signal

    from proxy.records import outbox as outbox_module
    from proxy.records.outbox import Outbox

    path = str(tmp_path / "records.sqlite")
    errors: list[int] = []
    outbox = Outbox(path, {}, "test", 1000, 1 << 20, lambda: errors.append(1), lambda reason, n: None)
    try:
        def models() -> set[str]:
            try:
                return {orjson.loads(r)["model"] for r in outbox.recent(100, Filters())}
            except sqlite3.Error:
                return set()

        outbox.add(outbox_record(0))
        assert until(lambda: models() == {"m0"})
        first = outbox._process
        os.kill(first.pid, signal.SIGKILL)
        first.join(5.0)

        async def on_the_loop() -> None:
            for i in range(1, 4):
                outbox.add(outbox_record(i))
                await asyncio.sleep(0.05)
            await asyncio.sleep(outbox_module.HOLD_S)  # (held until then: the loop's own send finds the pipe broken)

        if on_loop:
            asyncio.run(on_the_loop())
        else:
            for i in range(1, 4):
                outbox.add(outbox_record(i))
                time.sleep(0.05)
        assert until(lambda: models() == {"m0", "m1", "m2", "m3"}), models()
        assert outbox._process is not first and outbox._process.is_alive()
        assert errors == [1]  # (the dead writer, counted once)
    finally:
        outbox.close()


@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_a_stopped_writer_process_never_holds_up_a_request_nor_grows_the_serving_process(tmp_path, on_loop):
    """With the writer process stopped (SIGSTOP: a hung store driver, a frozen container) the pipe fills and the
    sender thread waits on it: `add`, on the request's side, never does, and what the serving process queues meanwhile
    is capped as the writer's own buffer is (the oldest dropped, counted; it once grew without bound); resumed, every
    record not dropped is stored, whole. On the event loop (where the finisher adds them) the loop writes its own
    messages without waiting: the one the full pipe cuts short is finished by the sender thread, before any other."""
    import asyncio
    import os
    import signal

    from proxy.records.outbox import Outbox

    path = str(tmp_path / "records.sqlite")
    drops: list[tuple[str, int]] = []
    outbox = Outbox(path, {}, "test", 300, 64 << 20, lambda: None, lambda reason, n: drops.append((reason, n)))
    try:
        for i in range(6):
            outbox.add(outbox_record(i))
        assert until(lambda: stored(outbox) == 6)

        os.kill(outbox._process.pid, signal.SIGSTOP)
        try:
            async def adds(pause) -> float:  # (`pause`: the loop's sleep, or the thread's)
                slowest = 0.0
                for i in range(6, 406):  # 400 records: more than the pipe holds, more than the queue's cap of 300
                    if i < 16:
                        await pause(0.012)  # (each its own message, 100 KB: the pipe fills part-way through one)
                    began = time.perf_counter()
                    outbox.add(outbox_record(i, pad=100_000 if i < 16 else 8000))
                    slowest = max(slowest, time.perf_counter() - began)
                await pause(0.05)  # (the loop's last window)
                return slowest

            async def blocking_sleep(seconds: float) -> None:
                time.sleep(seconds)

            if on_loop:
                slowest = asyncio.run(adds(asyncio.sleep))
            else:  # (driven with no loop running: the coroutine stepped by hand, every add on this thread)
                coroutine = adds(blocking_sleep)
                with pytest.raises(StopIteration) as done:
                    coroutine.send(None)
                slowest = done.value.value
            assert slowest < 0.5, slowest  # never blocked on the pipe (a blocking write would wait for the SIGCONT)
            dropped = sum(n for reason, n in drops if reason == "buffer_full")
            assert dropped > 0  # the queue held at most 300 while the pipe was full
        finally:
            os.kill(outbox._process.pid, signal.SIGCONT)
        outbox.flush(10.0)

        def accounted() -> bool:  # (the writer process's buffer has the same cap: it drops and reports too)
            return stored(outbox) + sum(n for reason, n in drops if reason == "buffer_full") == 406

        assert until(accounted, timeout=15.0), (stored(outbox), drops)
        assert all(reason == "buffer_full" for reason, _ in drops)
        models = {orjson.loads(r)["model"] for r in outbox.recent(1000, Filters())}
        assert "m405" in models  # the newest kept, whole: no message was cut short on the pipe
    finally:
        outbox.close()


def test_a_record_keeps_its_own_model_past_the_writers_cap(tmp_path):
    """The aggregates keep 3 names here (--max-models) besides the configuration's: a client's junk names, refused by
    the engine (404), take none of the places; served ones do, and past them a name is `other` in the aggregates
    only. Every record keeps its model, and the list finds it by that model."""
    path = str(tmp_path / "r.sqlite")
    store = Writer(SQLiteBackend(path, 0, 0.0, 5.0, max_models=3, known_models=("configured",)), "test", 1000, 10**7, lambda: None,
                   lambda reason, n: None)
    for i in range(100):
        store.add(record(model=f"junk-{i}", outcome="upstream_error", status_code=404))
    for name in ("a", "b", "c", "late", "configured"):
        store.add(record(model=name, status_code=200))
    store.flush()
    store.close()
    db = sqlite3.connect(path)
    try:
        stored = {m: (column, own) for m, column, own in db.execute(
            "SELECT CASE WHEN model_name IS NULL THEN model ELSE model_name END, model, model_name FROM llmproxy_records")}
        rollup = {m for (m,) in db.execute("SELECT DISTINCT model FROM llmproxy_rollup")}
    finally:
        db.close()
    assert stored["a"] == ("a", None) and stored["late"] == ("other", "late") and stored["configured"] == ("configured", None)
    assert stored["junk-7"] == ("other", "junk-7")
    assert rollup == {"a", "b", "c", "configured", "other"}
    backend = SQLiteBackend(path)
    assert [orjson.loads(r)["model"] for r in backend.recent(10, Filters(model="late"))] == ["late"]
    assert [orjson.loads(r)["model"] for r in backend.recent(10, Filters(model="a"))] == ["a"]
    folded = [orjson.loads(r)["model"] for r in backend.recent(1000, Filters(model="other"))]  # (an alert's link on model="other")
    assert len(folded) == 101 and "late" in folded and "other" not in folded  # each with its own name


def test_figures_no_column_holds_are_nulled_and_counted_and_the_record_kept(tmp_path):
    """An imported line (or another writer's record) with NaN, an infinity, a count past a bigint or below zero:
    read as leniently as a request, each such figure set to null and counted by field, the record stored."""
    path = str(tmp_path / "r.sqlite")
    nulled: list[tuple[str, int]] = []
    store = Writer(SQLiteBackend(path), "test", 1000, 10**7, lambda: None, lambda reason, n: None, on_nulled=lambda f, n: nulled.append((f, n)))
    now = time.time_ns()
    lines = [b'{"id": "a", "endpoint": "chat", "outcome": "ok", "model": "m", "received_unix_ns": %d, "duration_s": 0.5, '
             b'"ttft_s": NaN, "decode_tokens_per_second": Infinity, "prompt_tokens": 123456789012345678901234567890, '
             b'"completion_tokens": -4, "phases_s": {"prefill": -Infinity, "decode": 0.2}}' % now,
             b'{"id": "b", "endpoint": "chat", "outcome": "ok", "model": "m", "received_unix_ns": %d, "duration_s": 0.5, "ttft_s": 0.1, '
             b'"prompt_tokens": 10, "completion_tokens": 5, "phases_s": {"prefill": 0.1, "decode": 0.4}}' % now]
    for line in lines:
        store.put_row(Writer.row(line))
    store.flush()
    store.close()
    assert sorted(nulled) == [("completion_tokens", 1), ("decode_tokens_per_second", 1), ("phases_s", 1), ("prompt_tokens", 1), ("ttft_s", 1)]
    kept = {r["id"]: r for r in map(orjson.loads, SQLiteBackend(path).recent(10, Filters()))}
    assert set(kept) == {"a", "b"}
    assert kept["a"]["ttft_s"] is None and kept["a"]["prompt_tokens"] is None and kept["a"]["completion_tokens"] is None
    assert kept["a"]["phases_s"] == {"decode": 0.2} and kept["b"]["prompt_tokens"] == 10


def test_a_record_outside_the_stores_window_is_dropped_as_clock_skew(tmp_path):
    """A record that ended an hour and more ahead of the writer's clock (a wrong clock), or before the store's retention:
    never written (no partition for a far day), counted as clock_skew; its neighbours written."""
    path = str(tmp_path / "r.sqlite")
    drops: list[tuple[str, int]] = []
    store = writer(path, [], drops, max_age_s=3600.0)
    hour = 3600 * 10**9
    for at in (time.time_ns(), time.time_ns() + 2 * hour, time.time_ns() - 2 * hour, time.time_ns() + hour // 2):
        store.add(record(received_unix_ns=at))
    store.flush()
    store.close()
    assert drops == [("clock_skew", 2)] and len(recent(path, 10)) == 2
    with pytest.raises(Exception, match="outside the store's window"):
        Writer.row(orjson.dumps(record(received_unix_ns=time.time_ns() + 2 * hour)), now_ns=time.time_ns(), max_age_s=3600.0)


def test_records_import_reports_each_bad_line_by_number_and_goes_on(tmp_path):
    """A file of good records among lines that are no record (not JSON, an end time no clock has, a duration of 1e308
    that once made a worker die and the import wait for it forever) and records outside the window: every good one
    stored, each bad line named by its number, the import's exit status 1, within its time."""
    import subprocess
    import sys

    now = time.time_ns()
    good = [orjson.dumps(record(received_unix_ns=now - i * 10**9, id=f"g{i}")) for i in range(20)]
    bad = {3: b"{not json", 7: orjson.dumps(record(duration_s=1e308, id="huge")), 11: orjson.dumps(record(received_unix_ns=-5, id="neg")),
           15: orjson.dumps(record(received_unix_ns=now + 10**18, id="future")), 18: b'{"id": "nan", "duration_s": NaN}'}
    lines = []
    for number in range(1, 26):
        lines.append(bad[number] if number in bad else good.pop() if good else b"")
    source = tmp_path / "records.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "records", "import", "--db", str(tmp_path / "r.sqlite")], stdin=source.open("rb"),
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 1, done.stderr
    for number in bad:
        assert f"line {number}:" in done.stderr, done.stderr
    assert "20 records stored" in done.stderr and "1 outside the store's window (clock_skew)" in done.stderr, done.stderr
    assert len(recent(str(tmp_path / "r.sqlite"), 100)) == 20


def test_the_serving_process_queue_is_bounded_in_bytes_and_goes_in_bounded_messages(tmp_path, monkeypatch):
    """A writer process that stopped reading (SIGSTOP: a stall, a swap storm): the serving process's queue keeps at
    most --records-buffer-bytes (the oldest go, counted as buffer_full, and in its row's figures), and once the
    writer process reads again each message holds at most MESSAGE_BYTES (and one record). Every record is then
    stored or counted dropped."""
    import os
    import signal

    from proxy.records import generation
    from proxy.records import outbox as outbox_module
    from proxy.records.outbox import Outbox

    cap = 256 * 1024
    monkeypatch.setattr(outbox_module, "MESSAGE_BYTES", 64 * 1024)  # (a quarter of the cap: what is held goes in several)
    dropped: list[int] = []
    outbox = Outbox(str(tmp_path / "records.sqlite"), {}, "bytes", 100_000, cap, lambda: None,
                    lambda reason, n: dropped.append(n) if reason == "buffer_full" else None)
    try:
        outbox.add(outbox_record(0))
        assert until(lambda: stored(outbox) == 1)
        os.kill(outbox._process.pid, signal.SIGSTOP)
        held = []
        for i in range(1, 801):  # 4 KB each: 3.2 MB, the pipe's buffer and more than ten times the cap
            outbox.add(outbox_record(i, pad=4000))
            held.append(outbox._added_bytes - outbox._taken_bytes - outbox._dropped_bytes)
            time.sleep(0.001)
        assert max(held) <= cap + 5000 and sum(dropped) > 0, (max(held), sum(dropped))
        sizes = []
        real_take = outbox._take

        def take() -> list:
            rows = real_take()
            sizes.append(sum(len(row[2]) for row in rows))
            return rows

        outbox._take = take  # type: ignore[method-assign]
        os.kill(outbox._process.pid, signal.SIGCONT)
        outbox.flush(30)
        assert until(lambda: stored(outbox, 10_000) + sum(dropped) == 801, timeout=30), (stored(outbox, 10_000), sum(dropped))
        assert len(sizes) > 2 and max(sizes) <= 64 * 1024 + 5000, sizes
        counts = outbox._counts
        assert counts.get(generation.NUMBERED) == 801 == counts.get(generation.HANDED) + counts.get(generation.DROPPED)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(outbox._process.pid, signal.SIGCONT)
        outbox.close()


def test_a_drop_counted_while_a_new_writer_process_is_prepared_is_never_lost():
    """The serving process counts its drops (and what it hands over) in memory its writer process maps; a new writer
    process gets a new mapping holding the figures so far (`Counts.open`). A count made by another thread while that
    mapping is made lands in the old one or the new one, never between: 500 new mappings under a thread counting."""
    from proxy.records.generation import DROPPED, Counts

    counts = Counts()
    counts.open()
    stop, made = threading.Event(), [0]

    def count() -> None:
        while not stop.is_set():
            counts.add(DROPPED, 1)
            made[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    for _ in range(500):
        counts.open()
    stop.set()
    counter.join()
    assert made[0] > 1000 and counts.get(DROPPED) == made[0]
