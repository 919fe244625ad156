"""One records store for a fleet: a real PostgreSQL (Debian's, a cluster in a temporary folder,
password authentication), several proxies writing at once, the server stopped and restarted
mid-load, a cold start without it, a SIGTERM flush, and the password in nothing the proxy writes."""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.processes import free_port
from proxy.records import Filters, Writer
from proxy.records import codec
from proxy.records import columns as C
from proxy.records.migration import WRITERS_FROM, prepare
from proxy.records.deadline import connect, redact
from proxy.records.postgres import STORE_VERSION, TABLE, PostgresBackend

import fleet
from servers import ROOT, Postgres, Process, SilentRelay, scraped

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


TABLES = (TABLE, "llmproxy_rollup", "llmproxy_hist", "llmproxy_hist_block", "llmproxy_compacted", "llmproxy_dirty", "llmproxy_boots")


@pytest.fixture
def clean(pg: Postgres) -> Postgres:
    if pg.query(f"SELECT to_regclass('{TABLE}')")[0][0] is not None:
        pg.query(f"TRUNCATE {', '.join(TABLES)}")
    pg.query("DROP TABLE IF EXISTS llmproxy_requests")  # (schema 1's, which a test may have made)
    return pg


def replica(sim: Any, pg: Postgres, name: str, tmp_path: Path, *flags: str) -> Process:
    port = free_port()
    process = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db", pg.dsn, "--records-db-password-file",
                       str(pg.password_file), "--instance", name, "--log-level", "info", *flags], f"http://127.0.0.1:{port}/healthz",
                      log=tmp_path / f"{name}.log")
    process.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return process


BODY = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}


def send(url: str, model: str = "sim-7b", client: httpx.Client | None = None) -> float:
    """One streamed request (3 tokens, 5 ms to the first); its duration as the client saw it."""
    began = time.perf_counter()
    response = (client or httpx).post(f"{url}/v1/chat/completions", json={**BODY, "model": model}, headers={"x-sim-ttft-ms": "5"},
                                      timeout=30)
    assert response.status_code == 200, response.text
    return time.perf_counter() - began


def rows(pg: Postgres) -> int:
    """The records stored (0 before the first writer made the table)."""
    if pg.query(f"SELECT to_regclass('{TABLE}')")[0][0] is None:
        return 0
    return pg.query(f"SELECT count(*) FROM {TABLE}")[0][0]


def wait_rows(pg: Postgres, count: int, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := rows(pg)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_three_replicas_give_one_explain_and_one_ui_of_all_their_traffic(sim, clean, tmp_path):
    pg = clean
    replicas = [replica(sim, pg, f"pod-{i}", tmp_path) for i in range(3)]
    try:
        with ThreadPoolExecutor(6) as pool:  # all three at once, each its own model
            list(pool.map(lambda i: send(replicas[i % 3].url, f"model-{i % 3}"), range(60)))
        assert wait_rows(pg, 60) == 60
        fleet = httpx.get(f"{replicas[0].url}/llmproxy/requests", params={"limit": 1000}).json()  # any replica: the fleet's
        assert len(fleet) == 60 and {r["instance"] for r in fleet} == {"pod-0", "pod-1", "pod-2"}
        one = httpx.get(f"{replicas[2].url}/llmproxy/requests", params={"limit": 1000, "instance": "pod-1"}).json()
        assert len(one) == 20 and {(r["instance"], r["model"]) for r in one} == {("pod-1", "model-1")}
        metrics = "".join(httpx.get(f"{r.url}/metrics").text for r in replicas)
        assert scraped(replicas[0].url, "llmproxy_records_written_total") == 20
        ui_rows = waterfall(replicas[1].url)  # /ui on any replica: the fleet's requests, one replica at a time by `instance`
        assert ui_rows == {"": 60, "pod-0": 20, "pod-1": 20, "pod-2": 20}
    finally:
        for each in replicas:
            each.stop()
    done = subprocess.run([sys.executable, "-m", "proxy", "explain", "--db", pg.dsn, "--db-password-file", str(pg.password_file), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = {name: group for name, group in json.loads(done.stdout).items() if name.startswith("model-")}  # (the browser's favicon: `unknown`)
    assert sorted(name.split(" @ ")[0] for name in report) == ["model-0", "model-1", "model-2"]
    assert all(group["requests"] == 20 for group in report.values())
    stored = pg.query(f"SELECT instance, count(*), count(DISTINCT rid) FROM {TABLE} WHERE model LIKE 'model-%' GROUP BY instance ORDER BY instance")
    assert stored == [("pod-0", 20, 20), ("pod-1", 20, 20), ("pod-2", 20, 20)]
    logs = "".join((tmp_path / f"pod-{i}.log").read_text() for i in range(3))
    everything = logs + metrics + done.stdout + json.dumps(fleet) + str([codec.unpack(d) for (d,) in pg.query(f"SELECT data FROM {TABLE}")])
    assert pg.password not in everything and "do-not-log" not in everything


def waterfall(url: str) -> dict[str, int]:
    """The rows of the test's chat traffic /ui draws, unfiltered and for each instance its filter offers
    (Debian's Chromium; its own GET /favicon.ico is relayed and recorded too, as api `other`)."""
    import shutil

    from playwright.sync_api import sync_playwright

    from test_waterfall import CHROMIUM_ARGS, wait_for

    counts = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{url}/ui")
            chats = "[...document.querySelectorAll('.row .label')].filter(l => l.innerText.includes(' openai chat ')).length"
            wait_for(page, f"{chats} > 0")
            counts[""] = page.evaluate(chats)
            for name in [o for o in page.eval_on_selector_all("#instance option", "os => os.map(o => o.value)") if o]:
                page.select_option("#instance", name)
                wait_for(page, f"[...document.querySelectorAll('.row')].every(r => r.title === '{name}')")
                counts[name] = page.evaluate(chats)
        finally:
            browser.close()
    return counts


def test_a_restart_mid_load_loses_no_record_and_adds_no_latency(sim, clean, tmp_path):
    pg = clean
    proxy = replica(sim, pg, "pod-r", tmp_path)
    stop = threading.Event()
    timeline: list[tuple[float, float]] = []  # (when, duration)
    lock = threading.Lock()

    def load() -> None:
        with httpx.Client() as client:  # one kept connection each: the duration is the request's, not a new client's set-up
            while not stop.is_set():
                took = send(proxy.url, client=client)
                with lock:
                    timeline.append((time.monotonic(), took))

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        down = time.monotonic()
        pg.stop("fast")  # mid-load: connections cut, the writer's batch fails
        time.sleep(3.0)
        assert scraped(proxy.url, "llmproxy_records_buffered") > 0  # waiting, not lost
        pg.start()
        up = time.monotonic()
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join()
        sent = len(timeline)
        assert wait_rows(pg, sent, timeout=20) == sent  # every record, none twice
        assert pg.query(f"SELECT count(DISTINCT rid) FROM {TABLE}")[0][0] == sent
        assert scraped(proxy.url, "llmproxy_records_dropped_total") == 0
        assert scraped(proxy.url, "llmproxy_telemetry_errors_total", component="records") >= 1  # the outage was counted
    finally:
        stop.set()
        proxy.stop()
    before = [took for at, took in timeline if at < down]
    during = [took for at, took in timeline if down + 0.2 < at < up]
    print(f"\n{len(timeline)} requests; client-side duration median before the outage {statistics.median(before) * 1000:.1f} ms, "
          f"during it {statistics.median(during) * 1000:.1f} ms ({len(during)} requests)")
    assert len(during) > 50 and statistics.median(during) < statistics.median(before) + 0.005  # no added latency (5 ms of slack)
    log = (tmp_path / "pod-r.log").read_text()
    assert "cannot be written to" in log and "reachable again" in log and pg.password not in log


def test_a_replica_that_starts_while_postgresql_is_down_serves_and_writes_later(sim, clean, tmp_path):
    pg = clean
    pg.stop("fast")
    try:
        proxy = replica(sim, pg, "pod-cold", tmp_path)
        for _ in range(10):
            send(proxy.url)
        served = httpx.get(f"{proxy.url}/llmproxy/requests", params={"limit": 100}).json()  # from memory meanwhile
        assert len(served) == 10
    finally:
        pg.start()
    try:
        assert wait_rows(pg, 10, timeout=20) == 10
        assert len(httpx.get(f"{proxy.url}/llmproxy/requests", params={"limit": 100}).json()) == 10  # now from the store
    finally:
        proxy.stop()


def test_sigterm_flushes_what_is_buffered(sim, clean, tmp_path):
    pg = clean
    proxy = replica(sim, pg, "pod-term", tmp_path)
    for _ in range(30):
        send(proxy.url)
    proxy.process.send_signal(signal.SIGTERM)  # at once: the last records are still in their batch's 250 ms
    proxy.process.wait(timeout=30)
    assert rows(pg) == 30


def test_concurrent_starts_migrate_once_and_a_newer_schema_is_refused(clean):
    pg = clean
    pg.query(f"DROP TABLE IF EXISTS {', '.join(TABLES)}, llmproxy_meta")

    def open_one(_: int) -> None:
        with connect(pg.dsn, str(pg.password_file)) as conn:
            prepare(conn)

    with ThreadPoolExecutor(8) as pool:  # replicas starting together: the advisory lock serialises them
        list(pool.map(open_one, range(8)))
    assert sorted(pg.query("SELECT key, value FROM llmproxy_meta WHERE key LIKE 'store_%%'")) == \
        [("store_level", str(STORE_VERSION)), ("store_version", str(WRITERS_FROM))]
    pg.query("UPDATE llmproxy_meta SET value = '99' WHERE key = 'store_version'")  # (a store that takes writers of version 99 only)
    backend = PostgresBackend(pg.dsn, 0, 0.0, str(pg.password_file))
    from proxy.records import Unavailable

    with pytest.raises(Unavailable, match=f"takes writers of version 99 or newer and this proxy writes version {STORE_VERSION}: upgrade this replica"):
        backend.open()
    pg.query("UPDATE llmproxy_meta SET value = %s WHERE key = 'store_version'", str(WRITERS_FROM))


def fleet_record() -> dict[str, Any]:
    return next(fleet.records(1, time.time_ns(), 1.0))


def partitions(pg: Postgres, parent: str = TABLE) -> list[str]:
    return sorted(name for (name,) in pg.query("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                                               "WHERE i.inhparent = %s::regclass", parent))


def test_retention_drops_whole_days_past_the_age_and_the_row_cap(clean):
    """Records of five days ago to today: past the age limit their days' partitions go whole (no DELETE),
    the aggregates' with them; a row cap drops the oldest days while the newer ones hold it."""
    pg = clean
    today = time.time_ns() // 86400_000_000_000
    store = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    store.open()
    for back in range(5, -1, -1):  # 20 records a day, ending at noon
        noon = (today - back) * 86400_000_000_000 + 43_200_000_000_000
        store.write([Writer.row(json.dumps({**fleet_record(), "id": f"d{back}-{i}", "received_unix_ns": noon + i, "duration_s": 0.1}).encode())
                     for i in range(20)])
    days = partitions(pg)
    assert len(days) >= 6 + 2 and rows(pg) == 120  # six days of records, and partitions made ahead
    store.max_age_s = (time.time_ns() - (today - 3) * 86400_000_000_000) / 1e9 - 60  # the cutoff a minute into day -3: days -5, -4 wholly past
    from proxy.records.partitions import DROPPING

    pg.query(f"COMMENT ON TABLE {days[0]} IS '{DROPPING}'")  # a drop interrupted after its detach: marked, no partition now
    pg.query(f"ALTER TABLE {TABLE} DETACH PARTITION {days[0]}")
    pg.query(f"ALTER TABLE {TABLE} DETACH PARTITION {days[1]}")  # an archive an operator detached by hand (expired too): no mark
    store.maintain()
    assert pg.query("SELECT to_regclass(%s)", days[0]) == [(None,)]  # dropped all the same
    assert pg.query("SELECT to_regclass(%s)::text", days[1]) == [(days[1],)]  # kept: not ours to drop
    assert rows(pg) == 80 and len(partitions(pg)) == len(days) - 2
    assert [name for name in days if name not in partitions(pg)] == days[:2]
    assert len(partitions(pg, "llmproxy_hist")) == len(partitions(pg)) == len(partitions(pg, "llmproxy_rollup"))
    assert pg.query("SELECT min(start) FROM llmproxy_rollup")[0][0] >= (today - 3) * 86400_000_000_000
    store.max_rows = 30  # the oldest days go while the newer ones hold 30 records (the planner's count): today and yesterday stay
    store.maintain()
    assert rows(pg) == 40 and pg.query(f"SELECT min(ended_ns) FROM {TABLE}")[0][0] >= (today - 1) * 86400_000_000_000
    store.close()


def test_a_wrong_password_costs_requests_nothing_and_is_not_logged(sim, clean, tmp_path):
    pg = clean
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password-1b2c")
    port = free_port()
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db",
                     pg.dsn.replace("@", ":inline-PASSWORD-9e8d@"), "--records-db-password-file", str(wrong), "--log-level", "debug"],
                    f"http://127.0.0.1:{port}/healthz", log=tmp_path / "wrong.log")
    try:
        for _ in range(3):
            send(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 10  # (the records reach the writer process within a second, which then fails to connect)
        while scraped(f"http://127.0.0.1:{port}", "llmproxy_telemetry_errors_total", component="records") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proxy.stop()
    log = (tmp_path / "wrong.log").read_text()
    assert "password authentication failed" in log and redact(pg.dsn.replace("@", ":x@")) in log
    assert "inline-PASSWORD" not in log + metrics and "not-the-password" not in log + metrics


def test_the_fleet_store_answers_as_every_record_did_compacted_or_not(clean):
    """The fixed set (test_aggregate.py) through PostgreSQL: the same answers as today's explain over its
    records, read from the records, then from the compacted hours."""
    import explain_reference
    from test_aggregate import differences, fixed_set

    from proxy.answers.explain import explain, gather

    pg = clean
    records = fixed_set()
    store = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    store.open()
    try:
        rows_ = [Writer.row(json.dumps(r).encode()) for r in records]
        assert sum(store.write(rows_[i:i + 500]) for i in range(0, len(rows_), 500)) == len(records)
        assert store.write(rows_[:500]) == 0  # a batch sent again: stored, and counted, once
        truth = explain_reference.explain(records, objectives=fleet.OBJECTIVES)
        assert differences(explain(gather([store]), objectives=fleet.OBJECTIVES), truth) == []
        assert store.compact() >= 6
        assert differences(explain(gather([store]), objectives=fleet.OBJECTIVES), truth) == []
    finally:
        store.close()


def test_schema_1_moves_in_place_while_old_replicas_keep_writing(clean):
    """A rolling upgrade: a store of schema 1 with records; a replica of this version starts (and moves
    them in, as they were: ids, end times, aggregates) while one of the old version keeps writing to its
    table (it checks schema_version, which stays 1), whose records follow."""
    import explain_reference
    import schema1
    from test_aggregate import differences

    from proxy.answers.explain import explain, gather

    pg = clean
    pg.query(f"DROP TABLE IF EXISTS {', '.join(TABLES)}, llmproxy_meta")
    records = list(fleet.records(350, time.time_ns() - 3 * 3600 * 10**9, 3 * 3600, models=6, instances=3, seed=7))
    with connect(pg.dsn, str(pg.password_file)) as old:
        schema1.postgres_create(old)
        schema1.postgres_write(old, records[:300])
        new = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
        new.open()
        assert new.pending() == 300 and pg.query("SELECT value FROM llmproxy_meta WHERE key = 'schema_version'") == [("1",)]
        schema1.postgres_write(old, records[300:320])  # the old replica, after the new one's migration
        while new.pending():
            new.maintain()
        schema1.postgres_write(old, records[320:])
        schema1.postgres_write(old, records[320:])  # (a batch it sent twice)
    new.maintain()
    new.close()
    assert new.pending() == 0 and rows(pg) == 350
    stored = {r["id"] for r in (json.loads(codec.unpack(d)) for (d,) in pg.query(f"SELECT data FROM {TABLE}"))}
    assert stored == {r["id"] for r in records}  # each under its own id
    got = explain(gather([new]), objectives=fleet.OBJECTIVES)
    assert differences(got, explain_reference.explain(records, objectives=fleet.OBJECTIVES)) == []


def test_version_2_migrates_while_an_old_replica_keeps_writing(clean):
    """Store version 3 (tenants) over a fleet store of version 2: the columns added in place under the
    migration lock; a replica of version 2 still running keeps writing; explain answers as every
    record did, and `--by tenant` counts every record (the old replica's as `unknown`)."""
    import explain_reference
    import schema2
    from test_aggregate import differences

    from proxy.answers import ledger
    from proxy.answers.explain import explain, gather

    pg = clean
    records = list(fleet.records(400, time.time_ns() - 3 * 3600 * 10**9, 3 * 3600, models=4, instances=2, seed=11))
    for record in records[340:]:
        record.update(tenant="search", user="u-1")
    store = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    with connect(pg.dsn, str(pg.password_file)) as old:
        store.open()
        store.close()
        schema2.downgrade(old, postgres=True)
        schema2.write(old, records[:300], postgres=True)
        store.open()
        schema2.write(old, records[300:340], postgres=True)  # the old replica, still running
        store.maintain()  # (its indexes built online, then its level raised)
        assert sorted(pg.query("SELECT key, value FROM llmproxy_meta WHERE key LIKE 'store_%%'")) == \
            [("store_level", str(STORE_VERSION)), ("store_version", str(WRITERS_FROM))]
        store.write([Writer.row(json.dumps(r).encode()) for r in records[340:]])
    store.close()
    got = explain(gather([store]), objectives=fleet.OBJECTIVES)
    assert differences(got, explain_reference.explain(records, objectives=fleet.OBJECTIVES)) == []
    assert {t: agg.requests for t, agg in ledger.gather([store]).items()} == {"unknown": 340, "search": 60}
    assert len(store.recent(100, Filters(tenant="search", user="u-1"))) == 60


def test_records_move_from_sqlite_to_postgresql_and_an_import_again_skips_them(clean, tmp_path):
    """`records export` from the embedded store, `records import` into the fleet's: every record, under its
    id, with the same explain; the same lines again store nothing."""
    from proxy.answers.explain import explain, gather, of_records
    from test_aggregate import differences

    pg = clean
    records = list(fleet.records(2000, time.time_ns() - 5 * 3600 * 10**9, 5 * 3600, models=8, instances=2, seed=9))
    sqlite_store = of_records(records)
    lines = subprocess.run([sys.executable, "-m", "proxy", "records", "export", "--db", sqlite_store.where], capture_output=True, timeout=120,
                           cwd=ROOT, check=True).stdout
    assert lines.count(b"\n") == 2000
    command = [sys.executable, "-m", "proxy", "records", "import", "--db", pg.dsn, "--db-password-file", str(pg.password_file)]
    first = subprocess.run(command, input=lines, capture_output=True, timeout=300, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert b"2,000 lines read, 2,000 records stored, 0 skipped" in first.stderr
    again = subprocess.run(command, input=lines, capture_output=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0 and b"2,000 lines read, 0 records stored, 2,000 skipped" in again.stderr, again.stderr
    assert rows(pg) == 2000
    store = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    assert differences(explain(gather([store]), objectives=fleet.OBJECTIVES), explain(gather([sqlite_store]), objectives=fleet.OBJECTIVES)) == []
    before = time.time_ns()
    exported = subprocess.run([sys.executable, "-m", "proxy", "records", "export", "--db", pg.dsn, "--db-password-file", str(pg.password_file),
                               "--since", "2h"], capture_output=True, timeout=120, cwd=ROOT, check=True).stdout
    ids = {json.loads(line)["id"] for line in exported.splitlines()}
    since = lambda at: {r["id"] for r in records if C.ended_ns(r) >= at - 7200 * 10**9}  # noqa: E731
    assert since(time.time_ns()) <= ids <= since(before) and len(ids) > 500  # (the boundary moved while the command started)


def test_a_silent_failover_costs_seconds_and_no_record(sim, clean, tmp_path):
    """The store's address goes silent on the connections the proxy holds (no reset: a primary gone behind a failover
    manager's address, a pooler that keeps acknowledging) while new connections reach the live server. Every record
    reaches the store (the writer's client-side deadline cuts the silent connection and it connects again),
    /metrics and /llmproxy/requests answer within 5 s throughout, and SIGTERM ends the proxy within its grace."""
    relay = SilentRelay(clean.port)
    port = free_port()
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db",
                    f"postgresql://{clean.USER}@127.0.0.1:{relay.port}/{clean.DATABASE}", "--records-db-password-file",
                    str(clean.password_file), "--instance", "silent"], f"http://127.0.0.1:{port}/healthz", log=tmp_path / "silent.log")
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(10):
            send(url)
        assert wait_rows(clean, 10) == 10
        assert httpx.get(f"{url}/llmproxy/requests", params={"limit": 5}, timeout=5).status_code == 200  # (a reader connection held)
        relay.freeze()
        slowest = 0.0
        for i in range(30):
            send(url)
            if i % 3 == 0:
                for path in ("/metrics", "/llmproxy/requests"):
                    began = time.monotonic()
                    assert httpx.get(f"{url}{path}", timeout=5).status_code == 200
                    slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.1)
        assert wait_rows(clean, 40, timeout=60) == 40  # (the writer's deadline, 10 s, then a new connection)
        began = time.monotonic()
        proc.stop()
        stopped = time.monotonic() - began
        print(f"\nslowest answer while silent {slowest:.2f} s; SIGTERM to exit {stopped:.2f} s")
        assert slowest < 5.0 and stopped < 10.0 and proc.process.returncode is not None
    finally:
        proc.stop()
        relay.close()


def test_a_signal_to_the_whole_group_loses_no_record(sim, clean, tmp_path):
    """SIGTERM to the proxy's whole process group (Ctrl-C, systemd's KillMode=control-group, `tini -g`) while its
    records wait on a store that is held up: the records process ignores it, the serving process shuts down and has it
    write what it holds once the store answers again, within the flush deadline."""
    import os

    from proxy.processes import wait_healthy
    from proxy.records.deadline import connect

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db",
                                clean.dsn, "--records-db-password-file", str(clean.password_file), "--instance", "group"],
                               cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/healthz", process)
        send(url)
        assert wait_rows(clean, 1) == 1
        with connect(clean.dsn, str(clean.password_file)) as holder:
            holder.execute("BEGIN")
            holder.execute(f"LOCK TABLE {TABLE} IN SHARE MODE")  # (writes wait)
            for _ in range(40):
                send(url)
            time.sleep(1.5)  # (handed to the records process: a batch waits on the lock)
            os.killpg(process.pid, signal.SIGTERM)
            time.sleep(1.0)
            holder.execute("ROLLBACK")  # the store answers again, within the shutdown's flush deadline (5 s)
        process.wait(timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_rows(clean, 41, timeout=5) == 41


def test_a_reconnect_below_the_level_takes_no_lock_for_columns_already_there(clean):
    """A writer that connects again while its store is still a level below (its indexes building) reads the catalog
    first: no ALTER TABLE (ACCESS EXCLUSIVE, even when it adds nothing) behind a long reader's transaction."""
    from proxy.records import migration
    from proxy.records.deadline import connect

    with connect(clean.dsn, str(clean.password_file)) as conn:
        migration.prepare(conn)  # (the store at this level)
        conn.execute("UPDATE llmproxy_meta SET value = %s WHERE key = 'store_level'", (str(migration.LEVEL - 1),))
        with connect(clean.dsn, str(clean.password_file)) as reader:
            reader.execute("BEGIN")
            reader.execute(f"SELECT count(*) FROM {TABLE}")  # (a reader's transaction: ACCESS SHARE, held)
            began = time.monotonic()
            assert migration.prepare(conn) is False  # (its level's indexes still to build: maintenance's)
            assert time.monotonic() - began < 1.0
            reader.execute("ROLLBACK")
        conn.execute("UPDATE llmproxy_meta SET value = %s WHERE key = 'store_level'", (str(migration.LEVEL),))


def _writer_of(pid: int) -> int:
    """The records process of a proxy process (its OS name, set by generation.serve)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name == "llmproxy-writer" and int(rest[1]) == pid and rest[0] not in ("Z", "X"):  # (a killed one not reaped yet)
            return int(stat.parent.name)
    raise AssertionError(f"no records process under {pid}")


def test_a_records_process_killed_alone_loses_what_it_held_counted_once_by_whoever_counts(sim, clean, tmp_path):
    """The records process alone killed (an OOM kill, a segfault) while the store is held up, 140 records handed to it:
    another is started at once, and the dead one's row is settled with what the serving process handed it. Whoever
    counts it first (this proxy's new records process, or another proxy on the store from its last figures), every
    request's record is stored or counted lost, once: the store's figure, both proxies' counters, and the same two
    maintenance passes later (the dead process's pid is its own row's, never flipped back to running)."""
    import os

    from proxy.records.deadline import connect

    def start(instance: str) -> tuple[Process, str]:
        port = free_port()
        proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db", clean.dsn,
                        "--records-db-password-file", str(clean.password_file), "--instance", instance], f"http://127.0.0.1:{port}/healthz")
        return proc, f"http://127.0.0.1:{port}"

    first, url = start("alone")
    other, url2 = start("other")
    try:
        for _ in range(10):
            send(url)
        assert wait_rows(clean, 10) == 10
        writer = _writer_of(first.process.pid)
        with connect(clean.dsn, str(clean.password_file)) as holder:
            holder.execute("BEGIN")
            holder.execute(f"LOCK TABLE {TABLE} IN SHARE MODE")  # (writes wait)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda _: send(url), range(140)))
            time.sleep(2.0)  # (handed over: at most HOLD_S in the serving process)
            os.kill(writer, signal.SIGKILL)
            time.sleep(0.5)
            holder.execute("ROLLBACK")

        def lost() -> float:
            return scraped(url, "llmproxy_records_lost_total") + scraped(url2, "llmproxy_records_lost_total")

        def stored() -> int:
            return clean.query(f"SELECT count(*) FROM {TABLE} WHERE instance = 'alone'")[0][0]

        deadline = time.monotonic() + 30
        while stored() + lost() < 150 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _writer_of(first.process.pid) != writer  # (another, started when the pipe ended)
        assert stored() + lost() == 150, (stored(), lost())
        assert clean.query("SELECT sum(lost) FROM llmproxy_boots WHERE instance = 'alone'")[0][0] == lost() > 0
        counted = lost()
        print(f"\nstored {stored()}, lost {counted:.0f} (counted by this proxy {scraped(url, 'llmproxy_records_lost_total'):.0f}, "
              f"by the other {scraped(url2, 'llmproxy_records_lost_total'):.0f})")
        time.sleep(2 * 5.0 + 1.0)  # (two maintenance passes of each proxy: RETAIN_EVERY_S)
        assert lost() == counted and stored() + counted == 150
        assert clean.query("SELECT sum(lost) FROM llmproxy_boots WHERE instance = 'alone'")[0][0] == counted
        assert clean.query("SELECT count(*) FROM llmproxy_boots WHERE instance = 'alone' AND state = 'running'")[0][0] == 2  # (it, its writer)
    finally:
        first.stop()
        other.stop()


def test_a_detach_waiting_on_a_long_reader_waits_outside_the_retention_lock_bounded(clean, monkeypatch):
    """A day past retention while a reader's transaction can still see it: DETACH … CONCURRENTLY waits for that
    transaction. It waits outside the retention lock (another replica's pass compacts meanwhile), for at most
    DETACH_WAIT_S; past it the pass fails at its retention step, and once the reader is gone a pass finishes the drop."""
    from proxy.records import Unavailable, partitions as P
    from proxy.records.sql import BLOCK_NS

    monkeypatch.setattr(P, "DETACH_WAIT_S", 2.0)
    pg = clean
    now = time.time_ns()
    today = now // 86400_000_000_000
    dropping = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    other = PostgresBackend(pg.dsn, -1, 7 * 86400.0, str(pg.password_file))
    dropping.open()
    other.open()

    def rows_at(ended_ns: int, tag: str) -> list[Any]:
        return [Writer.row(json.dumps({**fleet_record(), "id": f"{tag}-{i}", "received_unix_ns": ended_ns + i, "duration_s": 0.1}).encode())
                for i in range(10)]

    old_day = (today - 3) * 86400_000_000_000 + 43_200_000_000_000
    dropping.write(rows_at(old_day, "old"))
    expired = sorted(name for name in partitions(pg) if name.endswith(time.strftime("%Y%m%d", time.gmtime(old_day / 1e9))))
    assert expired
    dropping.max_age_s = 2 * 86400.0  # (day -3 wholly past)
    outcome: list[Any] = []
    with connect(pg.dsn, str(pg.password_file)) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute(f"SELECT count(*) FROM {TABLE}")  # (a snapshot that sees the old day: its detach waits for it)

        def run() -> None:
            began = time.monotonic()
            try:
                dropping.maintain()
                outcome.append(("done", time.monotonic() - began))
            except Unavailable as exc:
                outcome.append((str(exc), time.monotonic() - began))

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.0)  # (the pass is waiting on the detach now)
        assert thread.is_alive()
        block = (now - 3600_000_000_000) // BLOCK_NS * BLOCK_NS
        other.write(rows_at(block + 1_000_000_000, "fresh"))
        other.maintain()  # another replica's pass: the retention lock is free, its compaction runs
        assert pg.query("SELECT count(*) FROM llmproxy_compacted WHERE span = %s AND start = %s", BLOCK_NS, block)[0][0] == 1
        thread.join(15)
        assert not thread.is_alive() and outcome and outcome[0][0] != "done" and 1.5 < outcome[0][1] < 10, outcome
        assert dropping.step == "retention"
        reader.execute("ROLLBACK")
    dropping.maintain()  # (the detach finished, the day dropped)
    assert all(pg.query("SELECT to_regclass(%s)", name) == [(None,)] for name in expired)
    dropping.close()
    other.close()


def test_explain_reads_for_as_long_as_a_person_waits_while_the_pages_give_up_in_seconds(clean):
    """A read of the serving process is cut after READ_S (3 s: its pages answer in seconds while the store is silent),
    but `explain` is a command a person waits on, and a week of a big fleet reads for longer than that: its reads
    have COMMAND_READ_S. A read held 4.5 s behind a lock: the page's store gives up, `explain` answers."""
    from proxy.records import Unavailable, open_backend
    from proxy.records.aggregate import Fold
    from proxy.records.postgres import READ_S
    from proxy.records.sql import Window

    pg = clean
    lines = b"".join(fleet.lines(200, time.time_ns() - 3600 * 10**9, 3000.0, seed=3))
    command = [sys.executable, "-m", "proxy", "records", "import", "--db", pg.dsn, "--db-password-file", str(pg.password_file)]
    assert subprocess.run(command, input=lines, capture_output=True, timeout=120, cwd=ROOT).returncode == 0
    page = open_backend(pg.dsn, password_file=str(pg.password_file))
    assert READ_S < 4.5
    with connect(pg.dsn, str(pg.password_file)) as holder:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE llmproxy_rollup IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        explain = subprocess.Popen([sys.executable, "-m", "proxy", "explain", "--db", pg.dsn, "--db-password-file", str(pg.password_file),
                                    "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        with pytest.raises(Unavailable):  # (its statement_timeout or its deadline, the same 3 s)
            page.aggregate(Fold(()), Window(), cells=False)
        cut = time.monotonic() - began
        time.sleep(max(0.0, 4.5 - (time.monotonic() - began)))
        holder.execute("COMMIT")
    out, err = explain.communicate(timeout=60)
    assert explain.returncode == 0, err
    assert READ_S - 0.5 < cut < READ_S + 1.5  # (the page's read cut at its deadline)
    assert sum(group["requests"] for group in json.loads(out).values()) == 200
    pg.stop()
    try:
        gone = subprocess.run([sys.executable, "-m", "proxy", "explain", "--db", pg.dsn, "--db-password-file", str(pg.password_file)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        pg.start()
    assert gone.returncode == 1 and "Traceback" not in gone.stderr, gone.stderr
    assert gone.stderr.startswith("llm-latency-proxy: the records store did not answer: ") and pg.password not in gone.stderr
