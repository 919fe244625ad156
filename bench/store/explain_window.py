"""`explain --since 24h` on a PostgreSQL store of N records, this tree and another build side by side, interleaved.

    git worktree add /tmp/before <commit>
    (cd /tmp/before && /work/main/.venv/bin/python -m pip install --quiet --no-deps --target /tmp/bB .)
    .venv/bin/python -m bench.store explain-window --records 1e7 --before /tmp/bB

The store is filled as store-volume fills it (tests/fleet.py's day of a fleet through `records import`, ten
live minutes more, then settled: VACUUM (ANALYZE), CHECKPOINT), then each build's `explain --since 24h` and
`--since 1h` run in turn, `--rounds` times: the median and the worst time, the peak RSS. The before build runs
from its folder (PYTHONPATH), this tree in place; both are the CLI, a process of its own.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench import harness as common  # noqa: E402
from bench.store.store_volume import PEAK, fill, live_tail, settle  # noqa: E402
from servers import Postgres  # noqa: E402


def timed(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a command, read by a parent of its own."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *command], cwd=cwd, capture_output=True, env=env, timeout=3600)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode()[-2000:])
    return took, int(done.stderr.decode().strip().splitlines()[-1]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", default="1e7")
    parser.add_argument("--before", default="", help="a build folder (pip install --target) to run side by side")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = int(float(args.records))
    print(f"command: .venv/bin/python -m bench.store explain-window --records {args.records} --before {args.before or '(none)'} "
          f"--rounds {args.rounds}\n")
    pg = Postgres()
    pg.stop()
    pg._ctl("-l", str(pg.dir / "server.log"), "-w", "-o", f"-p {pg.port} -k {pg.dir} -c listen_addresses=127.0.0.1 -c max_connections=200", "start")
    env = {**os.environ, "LLMPROXY_RECORDS_DB_PASSWORD_FILE": str(pg.password_file)}
    try:
        rate, line, what = fill(pg.dsn, size, env)
        live_tail(pg.dsn, env)
        settle(pg)
        print(f"PostgreSQL, {size:,} records; `records import` from {what}: {rate:,.0f} lines/s ({line}); settled\n")
        builds = {"this tree": (env, str(ROOT))}
        if args.before:
            elsewhere = tempfile.mkdtemp(prefix="llmproxy-before-")  # (not the checkout: its `proxy` would be imported first)
            builds["before"] = ({**env, "PYTHONPATH": args.before}, elsewhere)
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for since in ("24h", "1h"):
                for name, (build_env, cwd) in builds.items():
                    command = [sys.executable, "-m", "proxy", "explain", "--db", pg.dsn, "--since", since, "--json"]
                    runs.setdefault((since, name), []).append(timed(command, build_env, cwd))
        first = (time.time_ns() - 86400 * 10**9) // (600 * 10**9) * 600
        print(f"the 24-hour window's first block began at {time.strftime('%H:%M', time.gmtime(first))} UTC (at minutes 0-9 of an hour it is "
              "an hour's first block, and every build reads it from the hours)\n")
        rows = [[f"explain --since {since}", name, f"{statistics.median(t for t, _ in r):.2f} s", f"{max(t for t, _ in r):.2f} s",
                 f"{max(m for _, m in r):.0f} MB"] for (since, name), r in runs.items()]
        print(common.table(["what", "build", "median", "worst", "peak RSS"], rows))
    finally:
        pg.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
