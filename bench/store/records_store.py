"""The fleet's records store (PostgreSQL) measured: which driver and write form, how many records one
replica's writer stores per second, what retention deletes cost, and CPU per relayed chunk with
PostgreSQL against SQLite (the same proxy, side by side, interleaved rounds).

    .venv/bin/python -m bench.store records-store            # needs Debian's postgresql (make test installs it)

A PostgreSQL cluster of its own, in a temporary folder, with the server's default durability (fsync
on), on this same 2-core machine: the server's CPU competes with the writer's, so the rates are a
floor. Records are the test suite's streaming record with 100 content chunks (1.7 KB of JSON).
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402
from servers import Postgres  # noqa: E402
from test_timing import streaming_record  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402
from proxy.records import Writer  # noqa: E402
from proxy.records.postgres import TABLE, PostgresBackend  # noqa: E402
from proxy.measure.telemetry import RequestContext, record_dict  # noqa: E402
from proxy.measure.timing import split  # noqa: E402


def record() -> dict[str, Any]:
    t = streaming_record()
    t.content_ns = [210_000_000 + k * 10_000_000 for k in range(100)]
    t.content_choice = [0] * 100
    t.upstream_end_ns = t.content_ns[-1] + 1
    t.response_end_ns = t.upstream_end_ns + 1
    out = record_dict(RequestContext(t, 0), split(t))
    out["upstream"] = "u"
    return out


def fresh() -> dict[str, Any]:
    """The record, ending now (the writer names each record it adds: a new id)."""
    out = record()
    out["received_unix_ns"] = time.time_ns() - int(out["duration_s"] * 1e9)
    return out


def cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drivers(pg: Postgres, n: int = 20_000, batch: int = 500) -> list[tuple[str, float, float]]:
    """(form, records/s, client CPU µs per record): psycopg 3 and asyncpg, json and jsonb, COPY alone
    and COPY into a staging table + INSERT … ON CONFLICT (what a retried batch needs)."""
    import orjson
    import psycopg

    data = orjson.dumps(record()).decode()
    columns = ("rid", "ended_ns", "instance", "pid", "model", "upstream", "endpoint", "stream", "outcome", "data")
    names = ", ".join(columns)
    schema = ("DROP TABLE IF EXISTS bench_r; CREATE TABLE bench_r (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, rid text NOT NULL "
              "UNIQUE, ended_ns bigint NOT NULL, instance text NOT NULL, pid int NOT NULL, model text NOT NULL, upstream text NOT NULL, "
              "endpoint text NOT NULL, stream boolean NOT NULL, outcome text NOT NULL, data {kind} NOT NULL); "
              "CREATE INDEX ON bench_r (ended_ns); CREATE INDEX ON bench_r (model, upstream, ended_ns)")
    staging = f"CREATE TEMP TABLE IF NOT EXISTS bench_s ON COMMIT DELETE ROWS AS SELECT {names} FROM bench_r WITH NO DATA"
    merge = f"INSERT INTO bench_r ({names}) SELECT {names} FROM bench_s ON CONFLICT (rid) DO NOTHING"

    def rows(tag: str) -> list[tuple[Any, ...]]:
        return [(f"{tag}:{i}", time.time_ns(), "pod", 1, "m", "u", "chat", True, "ok", data) for i in range(n)]

    def with_psycopg(kind: str, staged: bool) -> tuple[float, float]:
        with psycopg.connect(pg.dsn, password=pg.password, autocommit=True) as conn:
            conn.execute(schema.format(kind=kind))
            todo, began, used = rows(f"p{kind}{staged}"), time.perf_counter(), cpu()
            for i in range(0, n, batch):
                with conn.transaction():
                    if staged:
                        conn.execute(staging)
                    with conn.cursor().copy(f"COPY {'bench_s' if staged else 'bench_r'} ({names}) FROM STDIN") as copy:
                        for row in todo[i:i + batch]:
                            copy.write_row(row)
                    if staged:
                        conn.execute(merge)
            return n / (time.perf_counter() - began), (cpu() - used) / n * 1e6

    async def with_asyncpg(kind: str, staged: bool) -> tuple[float, float]:
        import asyncpg

        conn = await asyncpg.connect(pg.dsn, password=pg.password)
        await conn.execute(schema.format(kind=kind))
        todo, began, used = rows(f"a{kind}{staged}"), time.perf_counter(), cpu()
        for i in range(0, n, batch):
            async with conn.transaction():
                if staged:
                    await conn.execute(staging)
                await conn.copy_records_to_table("bench_s" if staged else "bench_r", records=todo[i:i + batch], columns=columns)
                if staged:
                    await conn.execute(merge)
        await conn.close()
        return n / (time.perf_counter() - began), (cpu() - used) / n * 1e6

    out = []
    for kind in ("json", "jsonb"):
        for staged in (False, True):
            form = "COPY, staged + ON CONFLICT" if staged else "COPY"
            out.append((f"psycopg 3, {kind}, {form}", *with_psycopg(kind, staged)))
            out.append((f"asyncpg, {kind}, {form}", *asyncio.run(with_asyncpg(kind, staged))))
    return out


def writer_rate(pg: Postgres, n: int = 50_000) -> tuple[float, float]:
    """One replica's writer (the proxy's own code: buffer, batches, COPY and the rollup): records/s from
    the first add to the last stored, and the writer process's CPU per record."""
    pg.query(f"DROP TABLE IF EXISTS {TABLE}, llmproxy_rollup, llmproxy_hist, llmproxy_hist_block, llmproxy_compacted, llmproxy_dirty, "
             "llmproxy_meta")
    backend = PostgresBackend(pg.dsn, 0, 0.0, str(pg.password_file))
    writer = Writer(backend, "bench", n + 1, 10**10, lambda: None, lambda *_: None)
    writer.add(fresh())
    writer.flush(30)  # connected and migrated before the clock starts
    began, used = time.perf_counter(), cpu()
    for _ in range(n):
        writer.add(fresh())
    writer.flush(120)
    elapsed, spent = time.perf_counter() - began, cpu() - used
    writer.close()
    stored = pg.query(f"SELECT count(*) FROM {TABLE}")[0][0]
    assert stored == n + 1, stored
    return n / elapsed, spent / n * 1e6


def chunk_cpu(pg: Postgres, rounds: int = 4, seconds: float = 6.0, streams: int = 16) -> dict[str, list[float]]:
    """CPU per relayed chunk of the same proxy with records in SQLite and in PostgreSQL, interleaved."""
    import tempfile

    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    arms = {"SQLite": ["--records-db", str(Path(tempfile.mkdtemp(prefix="llmproxy-bench-")) / "r.sqlite")],
            "PostgreSQL": ["--records-db", pg.dsn, "--records-db-password-file", str(pg.password_file)]}
    ports = {name: free_port() for name in arms}
    figures: dict[str, list[float]] = {name: [] for name in arms}
    with common.simulator(sim_port):
        commands = {name: serve_command(str(ROOT), "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(ports[name]), *flags)
                    for name, flags in arms.items()}
        with common.process(commands["SQLite"], f"http://127.0.0.1:{ports['SQLite']}/healthz") as lite, \
                common.process(commands["PostgreSQL"], f"http://127.0.0.1:{ports['PostgreSQL']}/healthz") as postgres:
            pids = {"SQLite": lite.pid, "PostgreSQL": postgres.pid}
            for name in arms:
                asyncio.run(compare.concurrent((ports[name], "/v1"), streams, 1.0))
            for round_ in range(rounds):
                for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                    before = common.cpu_seconds(pids[name])
                    result = asyncio.run(compare.concurrent((ports[name], "/v1"), streams, seconds))
                    figures[name].append((common.cpu_seconds(pids[name]) - before) / max(1, result["chunks"]) * 1e6)
    return figures


def main() -> int:
    pg = Postgres()
    pg.stop()
    pg._ctl("-l", str(pg.dir / "server.log"), "-w", "-o", f"-p {pg.port} -k {pg.dir} -c listen_addresses=127.0.0.1", "start")  # fsync on
    try:
        print("command: .venv/bin/python -m bench.store records-store (PostgreSQL 15, fsync on, same machine)\n")
        print("| driver, column, write | records/s | client CPU µs per record |\n|---|---|---|")
        for form, rate, us in drivers(pg):
            print(f"| {form} | {rate:,.0f} | {us:.1f} |")
        rate, us = writer_rate(pg)
        print(f"\none replica's writer (Writer + PostgresBackend, 50,000 records): {rate:,.0f} records/s, {us:.1f} µs of CPU per record")
        figures = chunk_cpu(pg)
        print("\n| records in | proxy CPU µs per relayed chunk (16 streams; median of rounds) | rounds |\n|---|---|---|")
        for name, values in figures.items():
            print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    finally:
        pg.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
