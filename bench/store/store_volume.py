"""A day of a fleet's records in one store: fill it, then time what an operator asks of it.

    .venv/bin/python -m bench.store store-volume [--postgres 1e6,1e7] [--sqlite 1e6] [--ingest-seconds 60]

For each size: a store of its own (PostgreSQL: a cluster in a temporary folder with the server's
default durability, fsync on; SQLite: a file), filled with N records of a fleet (tests/fleet.py: 20
models, 4 replicas, every outcome, short and agent-sized prompts, SLO verdicts; ends spread evenly
over the last 24 h) by `records import` from a pipe (its rate: lines/s end to end, the hours'
compaction included; up to 2 million lines read from a file, more from the generator through a pipe),
then ten minutes more ending now (a live fleet's last block, not compacted yet). Then, each three
times (the median, and the worst), with the peak RSS of the command:
- `explain --since 24h` and `--since 1h` (the CLI, a process of its own); on PostgreSQL right after
  the fill and again once the server settled (VACUUM (ANALYZE), CHECKPOINT, autovacuum idle: what a
  day written over a day has had done as it went);
- a proxy serving `/ui` on the store: the newest 200 records, and each single filter (a model, a rare
  outcome, SLO misses, an instance, TTFT at least its p99), and the page's summary of the last hour.
And for PostgreSQL, the ingest of a live fleet: 8 writer processes, each a replica's buffer and
writer thread adding 250 records a second as the proxy does, for --ingest-seconds: the rate stored,
the most any buffer held, and the p50/p99 of a proxy's own `proxy` phase on requests it relays to
the simulator meanwhile, against the same requests with the writers idle.

Every process shares this 2-core machine with the database: the figures are a floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench import harness as common  # noqa: E402
from servers import Postgres  # noqa: E402

from proxy.processes import free_port  # noqa: E402

DAY_S = 86400.0
GENERATE = ("import sys, time; sys.path.insert(0, 'tests'); import fleet; out = sys.stdout.buffer\n"
            "for line in fleet.lines(int(sys.argv[1]), time.time_ns() - int(86400e9), 86400.0, pool=100_000): out.write(line)\n")


PEAK = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(done.returncode)")


def peak_of(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a command (its own, read by a parent of its own)."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *command], cwd=ROOT, capture_output=True, env=env, timeout=3600)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{command}: {done.stderr.decode()[-2000:]}")
    return took, int(done.stderr.decode().strip().splitlines()[-1]) / 1024


FILES: dict[int, str] = {}  # n -> a file of n generated lines (made once per run)


def fill(target: str, n: int, env: dict[str, str]) -> tuple[float, str, str]:
    """`records import` of n generated records; (lines/s, its summary line, from what). Up to 2 million
    lines are written to a file first, so that the rate is the import's alone; more come from the
    generator through a pipe (which takes CPU from the import: a floor)."""
    if n <= 2_000_000:
        if n not in FILES:
            FILES[n] = os.path.join(tempfile.mkdtemp(prefix="llmproxy-volume-"), "records.jsonl")
            with open(FILES[n], "wb") as out:
                subprocess.run([sys.executable, "-c", GENERATE, str(n)], cwd=ROOT, stdout=out, check=True, timeout=3600)
        source, what = open(FILES[n], "rb"), "a file"
    else:
        generator = subprocess.Popen([sys.executable, "-c", GENERATE, str(n)], cwd=ROOT, stdout=subprocess.PIPE)
        source, what = generator.stdout, "the generator, through a pipe"  # type: ignore[assignment]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "proxy", "records", "import", "--db", target], cwd=ROOT, stdin=source,
                          capture_output=True, env=env, timeout=7200)
    took = time.perf_counter() - began
    source.close()
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode()[-2000:])
    return n / took, done.stderr.decode().strip().splitlines()[-1], what


def live_tail(target: str, env: dict[str, str]) -> None:
    """Ten minutes of records ending now (the last block not compacted yet, as in a live fleet)."""
    tail = ("import sys, time; sys.path.insert(0, 'tests'); import fleet; out = sys.stdout.buffer\n"
            "for line in fleet.lines(70_000, time.time_ns() - int(600e9), 600.0, pool=20_000, seed=77): out.write(line)\n")
    generator = subprocess.Popen([sys.executable, "-c", tail], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run([sys.executable, "-m", "proxy", "records", "import", "--db", target], cwd=ROOT, stdin=generator.stdout, env=env,
                   capture_output=True, check=True, timeout=600)
    generator.wait()


def explain_times(target: str, env: dict[str, str], repeats: int = 3) -> list[list[Any]]:
    rows = []
    for since in ("24h", "1h"):
        runs = [peak_of([sys.executable, "-m", "proxy", "explain", "--db", target, "--since", since, "--json"], env) for _ in range(repeats)]
        rows.append([f"explain --since {since}", f"{statistics.median(t for t, _ in runs):.2f} s", f"{max(t for t, _ in runs):.2f} s",
                     f"{max(m for _, m in runs):.0f} MB"])
    return rows


def settle(pg: Postgres) -> None:
    """What a store written over a day has had done as it went: vacuumed and analysed, its dirty pages
    checkpointed, no autovacuum worker still on the days just written."""
    pg.query("VACUUM (ANALYZE)")
    pg.query("CHECKPOINT")
    deadline = time.monotonic() + 600
    while pg.query("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'")[0][0] and time.monotonic() < deadline:
        time.sleep(1.0)


def ui_times(target: str, env: dict[str, str], repeats: int = 3) -> list[list[Any]]:
    """A proxy on the store (its upstream never called): the list, each filter, and the summary."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", str(port), "--records-db", target]
    rows = []
    with common.process(command, f"http://127.0.0.1:{port}/healthz", env=env):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client:
            newest = client.get("/llmproxy/requests", params={"limit": 200}).json()
            ttfts = sorted(r["ttft_s"] for r in newest if r.get("ttft_s") is not None)
            cases = {"newest 200": {}, "model (the least used)": {"model": "chat-19"}, "outcome (timeout, 1.5%)": {"outcome": "timeout"},
                     "SLO misses": {"verdict": "miss"}, "instance": {"instance": "pod-2"},
                     "TTFT at least p99 of the newest": {"min_ttft": ttfts[int(0.99 * (len(ttfts) - 1))]}}
            for name, params in cases.items():
                times, found = [], 0
                for _ in range(repeats):
                    began = time.perf_counter()
                    found = len(client.get("/llmproxy/requests", params={"limit": 200, **params}).json())
                    times.append(time.perf_counter() - began)
                rows.append([f"/llmproxy/requests {name}", f"{statistics.median(times) * 1000:.0f} ms", f"{max(times) * 1000:.0f} ms", f"{found} rows"])
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                summary = client.get("/llmproxy/summary", params={"since": 3600}).json()
                times.append(time.perf_counter() - began)
            rows.append(["/llmproxy/summary (the last hour)", f"{statistics.median(times) * 1000:.0f} ms", f"{max(times) * 1000:.0f} ms",
                         f"{summary['requests']:,} requests"])
    return rows


INGEST = """
import json, sys, time
sys.path.insert(0, 'tests')
import fleet
from proxy.records import Writer, open_backend
url, password_file, name, rate, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
records = list(fleet.records(int(rate * 10), time.time_ns(), 10.0, seed=hash(name) % 1000))
peak = [0]
writer = Writer(open_backend(url, password_file=password_file), name, 50_000, 64 << 20, lambda: None, lambda *a: None,
                on_batch=lambda stored, waiting: peak.__setitem__(0, max(peak[0], waiting)))
began, added = time.monotonic(), 0
while (now := time.monotonic()) - began < seconds:
    due = int((now - began) * rate)
    while added < due:
        r = dict(records[added % len(records)])
        r["received_unix_ns"] = time.time_ns() - int(r["duration_s"] * 1e9)
        writer.add(r)
        added += 1
    time.sleep(0.01)
writer.flush(30)
writer.close()
print(json.dumps({"added": added, "written": writer.written, "peak_buffered": peak[0]}))
"""


def ingest(pg: Postgres, replicas: int, rate: float, seconds: float) -> dict[str, Any]:
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-c", INGEST, pg.dsn, str(pg.password_file), f"pod-{i}", str(rate), str(seconds)], cwd=ROOT,
                              stdout=subprocess.PIPE, env=env) for i in range(replicas)]
    results = [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in procs]
    return {"added": sum(r["added"] for r in results), "written": sum(r["written"] for r in results),
            "peak_buffered": max(r["peak_buffered"] for r in results), "rate": sum(r["written"] for r in results) / seconds}


def proxy_phase(pg: Postgres, seconds: float, writers: Any) -> list[float]:
    """A proxy on the store relaying streams to the simulator for `seconds` while `writers()` runs (or
    not): its own `proxy` phase per request, from its records."""
    import httpx

    sim_port, port = free_port(), free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port), "--records-db",
               pg.dsn, "--records-db-password-file", str(pg.password_file), "--instance", "measured"]
    with common.simulator(sim_port), common.process(command, f"http://127.0.0.1:{port}/healthz"):
        import threading

        thread = threading.Thread(target=writers)
        thread.start()
        phases: list[float] = []
        body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
        with httpx.Client(timeout=30) as client:
            began = time.monotonic()
            while time.monotonic() - began < seconds:
                client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers={"x-sim-ttft-ms": "5"})
            records = client.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": 100_000, "instance": "measured"}).json()
        phases = [r["phases_s"]["proxy"] for r in records if r["outcome"] == "ok"]
        thread.join()
    return phases


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", default="1e6,1e7", help="sizes of the PostgreSQL stores, comma-separated ('' for none)")
    parser.add_argument("--sqlite", default="1e6", help="sizes of the SQLite stores")
    parser.add_argument("--ingest-seconds", type=float, default=60.0)
    args = parser.parse_args()
    print(f"command: .venv/bin/python -m bench.store store-volume --postgres {args.postgres!r} --sqlite {args.sqlite!r} "
          f"--ingest-seconds {args.ingest_seconds:g}\n")
    for size in [int(float(s)) for s in args.sqlite.split(",") if s]:
        path = os.path.join(tempfile.mkdtemp(prefix="llmproxy-volume-"), "records.sqlite")
        rate, line, what = fill(path, size, dict(os.environ))
        live_tail(path, dict(os.environ))
        print(f"### SQLite, {size:,} records\n\n`records import` from {what}: {rate:,.0f} lines/s ({line})\n")
        print(common.table(["what", "median", "worst", "peak RSS / found"], explain_times(path, dict(os.environ)) + ui_times(path, dict(os.environ))))
        print(f"\nfile: {os.path.getsize(path) / 1e9:.2f} GB\n")
    for size in [int(float(s)) for s in args.postgres.split(",") if s]:
        pg = Postgres()
        pg.stop()
        pg._ctl("-l", str(pg.dir / "server.log"), "-w", "-o", f"-p {pg.port} -k {pg.dir} -c listen_addresses=127.0.0.1 -c max_connections=200",
                "start")  # the server's defaults: fsync on
        env = {**os.environ, "LLMPROXY_RECORDS_DB_PASSWORD_FILE": str(pg.password_file)}
        try:
            rate, line, what = fill(pg.dsn, size, env)
            live_tail(pg.dsn, env)
            print(f"### PostgreSQL 15, {size:,} records\n\n`records import` from {what}: {rate:,.0f} lines/s ({line})\n")
            right_after = explain_times(pg.dsn, env)
            began = time.perf_counter()
            settle(pg)
            print(f"Right after the fill (autovacuum and the checkpoint busy with what it wrote), then settled ({time.perf_counter() - began:.0f} s "
                  "of VACUUM (ANALYZE), CHECKPOINT and autovacuum's last workers): a fleet that wrote its day over a day has been vacuumed "
                  "as it went.\n")
            print(common.table(["what", "median", "worst", "peak RSS / found"],
                               [[f"{row[0]}, right after the fill", *row[1:]] for row in right_after]
                               + [[f"{row[0]}, settled", *row[1:]] for row in explain_times(pg.dsn, env)] + ui_times(pg.dsn, env)))
            print(f"\ndatabase: {pg.query('SELECT pg_database_size(current_database())')[0][0] / 1e9:.1f} GB; "
                  f"aggregates: {pg.query('SELECT count(*) FROM llmproxy_rollup')[0][0]:,} rollup rows, "
                  f"{pg.query('SELECT count(*) FROM llmproxy_hist')[0][0]:,} hourly and "
                  f"{pg.query('SELECT count(*) FROM llmproxy_hist_block')[0][0]:,} ten-minute histogram rows\n")
            if size == max(int(float(s)) for s in args.postgres.split(",") if s):
                result: dict[str, Any] = {}
                idle = proxy_phase(pg, args.ingest_seconds / 2, lambda: None)
                busy = proxy_phase(pg, args.ingest_seconds, lambda: result.update(ingest(pg, 8, 250.0, args.ingest_seconds)))
                print(f"Ingest, 8 replicas adding 250 records/s each for {args.ingest_seconds:g} s: {result['rate']:,.0f} records/s stored "
                      f"({result['written']:,} of {result['added']:,} added), at most {result['peak_buffered']:,} waiting in a buffer. "
                      f"The proxy's own phase on its requests meanwhile: p50 {statistics.median(busy) * 1000:.3f} ms, p99 "
                      f"{common.pct(busy, 0.99) * 1000:.3f} ms ({len(busy)} requests); with the writers idle: p50 "
                      f"{statistics.median(idle) * 1000:.3f} ms, p99 {common.pct(idle, 0.99) * 1000:.3f} ms ({len(idle)} requests)\n")
        finally:
            pg.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
