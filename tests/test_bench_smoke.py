"""A few-second version of `make bench`: sanity bounds only (the real figures live in bench/), and every benchmark
tool's subcommands resolve (their imports: the harness and each other)."""
import asyncio
import statistics
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port  # noqa: E402
from servers import Process  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_smoke(sim):
    port = free_port()
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port)], f"http://127.0.0.1:{port}/healthz")
    compare.SIM_URL = sim.url
    try:
        compare.schedule(compare.SEQ_SCHEDULE)
        seq = asyncio.run(compare.sequential((sim.port, "/v1"), (port, "/v1"), 10))
        compare.schedule(compare.SWEEP_SCHEDULE)
        sweep = asyncio.run(compare.concurrent((port, "/v1"), 8, 2.0))
        bursts = asyncio.run(compare.burst((port, "/v1"), 8, 2))
        cpu = compare.cpu_seconds(proxy.process.pid)
    finally:
        httpx.post(f"{sim.url}/sim/config", json={"ttft_ms": -1.0, "decode_tps": 100.0})
        proxy.stop()
    assert len(seq["added_ttft"]) == 10  # every pair complete: all 20 tokens relayed each time
    assert statistics.median(seq["added_ttft"]) < 0.050
    assert sweep["chunks"] >= 8 * 100 and sweep["chunks"] % 100 == 0  # whole streams only, no chunk lost
    assert len(bursts["ttft"]) == 16 and all(0.015 < ttft < 1.0 for ttft in bursts["ttft"])
    assert cpu > 0.1  # the proxy's threads' CPU, read from schedstat: it relayed ~1,000 chunks


def test_streams_scale_smoke(sim):
    """bench/scale/streams_scale.py's level at 32 streams of 6 tokens (a token a second after 1 s): none
    fails, every record is written with the schedule's TTFT and decode rate, nothing waits in the
    proxy's pool, the scrape counts every request."""
    from bench.scale import streams_scale

    r = streams_scale.level(32, 1, 6, sim.port)
    assert r["failed"] == 0 and r["records"] == r["records_ok"] == 32 and r["scraped_requests"] == 32
    assert r["ttft_error_max_ms"] < 50 and r["decode_tps_error_max"] < 0.05 and r["with_decode_rate"] == 32
    assert r["wait_p99_ms"] < 5 and r["chunks_in_window"] > 0 and r["rss_per_stream_kb"] < 1024


def test_pick_smoke():
    """bench/fleet/pick.py, a few seconds of it: both modes run over the same arrivals and say where the long prompts went."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bench.fleet", "pick", "--seconds", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=180, check=True, cwd=ROOT).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == ["fewest_in_flight", "predicted_ttft"], out
    assert all(int(row.split(" | ")[2]) > 5 for row in rows) and "lower" in out


def test_prefix_affinity_smoke():
    """bench/fleet/prefix_affinity.py, two short sessions of it: the table, its index checked against the engine."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bench.fleet", "prefix-affinity", "--replicas", "2",
                          "--sessions", "2", "--turns", "3", "--seeds", "1", "--proxies", "1", "--picks", "predicted_ttft", "reference"],
                         capture_output=True, text=True, timeout=180, check=True, cwd=ROOT).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2 | 1 |")]
    assert [row[2] for row in rows] == ["predicted_ttft", "reference"], out
    assert rows[0][7] == "1.00" and float(rows[0][4]) > 0.3, out  # (predicted / reported; the cache share)


def test_sick_fleet_smoke():
    """bench/fleet/sick_fleet.py, one case of it: three equal replicas share non-streaming requests under predicted_ttft."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bench.fleet", "sick-fleet", "--only", "non_streaming"],
                         capture_output=True, text=True, timeout=180, check=True, cwd=ROOT).stdout
    row = next(line for line in out.splitlines() if line.startswith("| three equal replicas"))
    shares = [int(share.rstrip("%")) for share in row.split("shares ")[1].rstrip(" |").split(" / ")]
    assert len(shares) == 3 and all(15 <= share <= 55 for share in shares), out


def test_every_subcommand_of_every_tool_resolves():
    """Each tool lists its subcommands (one per module of its folder), and every import of a benchmark from the
    harness or another benchmark names a module and a name that exist (read, not run: a benchmark runs for minutes)."""
    import ast
    import subprocess

    tools = sorted(p.parent.name for p in (ROOT / "bench").glob("*/__main__.py"))
    assert tools == ["fleet", "relay", "scale", "store", "truth"]
    for tool in tools:
        listed = subprocess.run([sys.executable, "-m", f"bench.{tool}", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True).stdout
        modules = sorted(p.stem for p in (ROOT / "bench" / tool).glob("*.py") if not p.stem.startswith("__"))
        assert modules and all(f"  {m.replace('_', '-')} " in listed for m in modules), listed
    refused = subprocess.run([sys.executable, "-m", "bench.relay", "no-such"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert refused.returncode == 2 and "unknown subcommand" in refused.stderr
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                target = ROOT / (node.module.replace(".", "/") + ".py")
                package = ROOT / node.module.replace(".", "/") / "__init__.py"
                assert target.exists() or package.exists(), (path, node.module)
                if target.exists():
                    defined = {n.name for n in ast.walk(ast.parse(target.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
                    defined |= {t.id for n in ast.walk(ast.parse(target.read_text())) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
                    missing = [a.name for a in node.names if a.name not in defined]
                    assert not missing, (path, node.module, missing)
                else:
                    assert all((ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists() or a.name == "harness" for a in node.names), (path, node.module)
