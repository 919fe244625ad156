"""The fleet store against what a fleet does to it, at volume (PostgreSQL 15, fsync on, this 2-core machine).

    .venv/bin/python -m bench.store store-faults --import 1e6                     # an import in time order and the same in random order
    .venv/bin/python -m bench.store store-faults --upgrade 1e7 --old /tmp/v2      # an online upgrade while an old replica writes
    (git worktree add /tmp/v2 af1bb5c: the last commit of store version 2)

- Import: N records of a fleet (tests/fleet.py, ends over the last 24 h) by `records import` from a file, into
  an empty database, once in time order and once shuffled: lines/s each. Duplicates are found by their key in the
  unique index, never by reading a batch's time range, so the order should not matter.
- Upgrade: a store of version 2 holding N records (1 M imported, then copied nine times under new keys, server-side),
  settled; a replica of version 2 (its own code, from `--old`) adding `--rate` records a second for the whole run;
  after 10 s a replica of this version starts on the store and adds as many. Reported: how long until the store is
  at this version (its new columns at once, its indexes built CONCURRENTLY partition by partition), each replica's
  write latency (every `backend.write`: one batch, one transaction) before, during and after, and whether each kept
  every record it added.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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

GENERATE = ("import sys, time; sys.path.insert(0, 'tests'); import fleet; out = sys.stdout.buffer\n"
            "for line in fleet.lines(int(sys.argv[1]), time.time_ns() - int(86400e9), 86400.0, pool=100_000): out.write(line)\n")

# A replica's writer at a steady rate, every write timed (wall clock), from the code at sys.argv[1].
REPLICA = """
import json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2] + '/tests')
import fleet
from proxy.records import Writer, open_backend
import os
url, password_file, name, rate, stop = sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]), sys.argv[7]
backend = open_backend(url, password_file=password_file)
writes = []
real = backend.write
def timed(rows):
    began = time.time()
    try:
        return real(rows)
    finally:
        writes.append((began, time.time() - began))
backend.write = timed
records = list(fleet.records(int(rate * 10), time.time_ns(), 10.0, seed=hash(name) % 1000))
writer = Writer(backend, name, 50_000, 64 << 20, lambda: None, lambda *a: None)
began, added = time.monotonic(), 0
while not os.path.exists(stop):
    now = time.monotonic()
    while added < int((now - began) * rate):
        r = dict(records[added % len(records)])
        r["received_unix_ns"] = time.time_ns() - int(r["duration_s"] * 1e9)
        writer.add(r)
        added += 1
    time.sleep(0.01)
writer.flush(60)
writer.close(60)
print(json.dumps({"added": added, "written": writer.written, "writes": writes}))
"""


def cluster() -> Postgres:
    pg = Postgres()
    pg.stop()
    pg._ctl("-l", str(pg.dir / "server.log"), "-w", "-o", f"-p {pg.port} -k {pg.dir} -c listen_addresses=127.0.0.1 -c max_connections=200",
            "start")  # the server's defaults: fsync on
    return pg


def database(pg: Postgres, name: str) -> str:
    pg.query(f"CREATE DATABASE {name}")
    return pg.dsn.rsplit("/", 1)[0] + f"/{name}"


def query(pg: Postgres, target: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(target, password=pg.password, autocommit=True) as conn:
        cursor = conn.execute(sql, args or None)
        return cursor.fetchall() if cursor.description else []


def lines_file(n: int) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="llmproxy-faults-"), "records.jsonl")
    with open(path, "wb") as out:
        subprocess.run([sys.executable, "-c", GENERATE, str(n)], cwd=ROOT, stdout=out, check=True, timeout=3600)
    return path


def run_import(target: str, path: str, env: dict[str, str]) -> tuple[float, str]:
    n = sum(1 for _ in open(path, "rb"))
    began = time.perf_counter()
    with open(path, "rb") as source:
        done = subprocess.run([sys.executable, "-m", "proxy", "records", "import", "--db", target], cwd=ROOT, stdin=source,
                              capture_output=True, env=env, timeout=7200)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode()[-2000:])
    return n / took, done.stderr.decode().strip().splitlines()[-1]


def imports(n: int) -> None:
    pg = cluster()
    env = {**os.environ, "LLMPROXY_RECORDS_DB_PASSWORD_FILE": str(pg.password_file)}
    try:
        ordered = lines_file(n)
        shuffled = ordered + ".shuffled"
        lines = open(ordered, "rb").readlines()
        random.Random(3).shuffle(lines)
        with open(shuffled, "wb") as out:
            out.writelines(lines)
        del lines
        rows = []
        for name, path in (("in time order", ordered), ("in random order", shuffled)):
            rate, line = run_import(database(pg, f"import_{name.split()[1]}"), path, env)
            rows.append([name, f"{rate:,.0f} lines/s", line])
        print(f"command: .venv/bin/python -m bench.store store-faults --import {n:g}\n")
        print(common.table(["records import of " + f"{n:,}", "rate", "its summary"], rows))
    finally:
        pg.destroy()


def latency(writes: list[list[float]], start: float, end: float) -> str:
    durations = sorted(d for at, d in writes if start <= at < end)
    if not durations:
        return "none"
    return f"{len(durations)} writes, p50 {statistics.median(durations) * 1000:.0f} ms, p99 {common.pct(durations, 0.99) * 1000:.0f} ms, " \
           f"max {durations[-1] * 1000:.0f} ms"


def upgrade(n: int, old: str, rate: float) -> None:
    import schema2

    from proxy.records.deadline import connect

    pg = cluster()
    env = {**os.environ, "LLMPROXY_RECORDS_DB_PASSWORD_FILE": str(pg.password_file)}
    try:
        target = database(pg, "upgrade")
        base = min(n, 1_000_000)
        run_import(target, lines_file(base), env)
        with connect(target, str(pg.password_file)) as conn:
            schema2.downgrade(conn, postgres=True)  # (version 2's tables: the columns, indexes and table version 3 and 4 added, gone)
        columns = ", ".join(c for c in schema2.COLUMNS if c not in ("rid", "key", "ended_ns"))
        began = time.perf_counter()
        for copy in range(1, -(-n // base)):  # copies under new keys and ids, a millisecond later each, server-side
            query(pg, target, f"INSERT INTO llmproxy_records (rid, key, ended_ns, {columns}, data) SELECT rid || '/{copy}', key + {copy * 7919}, "
                     f"ended_ns + {copy * 1_000_000}, {columns}, data FROM llmproxy_records WHERE rid NOT LIKE '%/%/%/%' "
                     f"LIMIT {min(base, n - copy * base)}")
        filled = time.perf_counter() - began
        query(pg, target, "VACUUM (ANALYZE)")
        query(pg, target, "CHECKPOINT")
        total = query(pg, target, "SELECT count(*) FROM llmproxy_records")[0][0]
        stop = os.path.join(tempfile.mkdtemp(prefix="llmproxy-faults-"), "stop")
        replica = lambda code, name: subprocess.Popen(  # noqa: E731
            [sys.executable, "-c", REPLICA, code, str(ROOT), target, str(pg.password_file), name, str(rate), stop],
            cwd=ROOT, stdout=subprocess.PIPE, env=env)
        old_replica = replica(old, "old")
        time.sleep(10.0)
        started = time.time()
        new_replica = replica(str(ROOT), "new")
        done = None
        while done is None and time.time() - started < 600.0:
            level = query(pg, target, "SELECT value FROM llmproxy_meta WHERE key = 'store_level'")
            if level and int(level[0][0]) == 4:
                done = time.time()
            time.sleep(0.2)
        time.sleep(20.0)
        Path(stop).touch()
        results = {name: json.loads(p.communicate(timeout=600)[0]) for name, p in (("old", old_replica), ("new", new_replica))}
        kept = {name: query(pg, target, "SELECT count(*) FROM llmproxy_records WHERE rid LIKE %s", f"{name}/%")[0][0] for name in results}
        end = done or time.time()
        print(f"command: .venv/bin/python -m bench.store store-faults --upgrade {n:g} --old {old} --rate {rate:g}\n")
        print(f"A store of version 2 with {total:,} records ({base:,} imported, copied server-side in {filled:.0f} s, settled); "
              f"a replica of version 2 and, 10 s later, one of this version, each adding {rate:g} records a second.\n")
        rows = [["store at this version", f"{end - started:.1f} s after the new replica started" if done else "not within the run"]]
        for name in ("old", "new"):
            writes = results[name]["writes"]
            rows += [[f"{name} replica's writes before the new one started", latency(writes, 0, started)],
                     [f"{name} replica's writes during the upgrade", latency(writes, started, end)],
                     [f"{name} replica's writes after it", latency(writes, end, 1e18)],
                     [f"{name} replica's records", f"{results[name]['added']:,} added, {results[name]['written']:,} written, "
                                                   f"{kept[name]:,} in the store"]]
        print(common.table(["what", "measured"], rows))
    finally:
        pg.destroy()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--import", dest="import_n", type=float, default=0)
    parser.add_argument("--upgrade", type=float, default=0)
    parser.add_argument("--old", default="/tmp/v2", help="a checkout of store version 2 (af1bb5c)")
    parser.add_argument("--rate", type=float, default=200.0, help="records a second each replica adds")
    args = parser.parse_args()
    if args.import_n:
        imports(int(args.import_n))
    if args.upgrade:
        upgrade(int(args.upgrade), args.old, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
