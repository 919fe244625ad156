"""Side by side, in one run: directly to the upstream, through this proxy (each telemetry mode),
and through LiteLLM's proxy, on the same fixed simulator schedule, all on loopback.

    make bench        # = .venv/bin/python -m bench.relay compare --out bench/results.json --plot bench/compare.png

Scenarios: (A) sequential single stream, direct and system requests interleaved in pairs;
(B) concurrency sweep of 1, 16, 64, 128, 256 streams (closed loop); (D) bursts of 64 streams started
at once; (C) non-streaming requests per second. Figures: added TTFT, inter-token-latency
distortion (system gap - direct gap), proxy CPU per relayed chunk at 1 and 64 streams (per-request
work included; from /proc/PID/task/*/schedstat, nanoseconds, every thread), peak RSS, and the
saturation point (added TTFT p50 above 5 ms). CPU per chunk at 1/16/64 streams and the bursts run
in both client styles: keep-alive (the openai client's default) and one connection per stream
(`fresh`: the TCP handshake and accept are in its TTFT). Envoy (a C++ relay that measures nothing)
is the floor: the last table printed gives every system's figures as ratios to Envoy's in the same
run, with the targets, and checks the proxy's self-measured overhead (its `proxy` phase on the
TTFT path, from its own records) against the client-observed added TTFT less Envoy's.
`--before DIR` adds this proxy run from another checkout (a git worktree) with the default flags,
for a before/after in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import Connection, Sink, cpu_seconds, envoy_command, memory_mb, pct, process, simulator  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LITELLM_PYTHON = os.environ.get("LITELLM_PYTHON", str(ROOT / ".venv-litellm" / "bin" / "python"))
KEY = "sk-bench-master"
# Schedules are set on the simulator itself (POST /sim/config), not by request headers: LiteLLM
# does not forward a client's headers upstream, and every system must see the same schedule.
SEQ_SCHEDULE = {"ttft_ms": 20.0, "decode_tps": 500.0}  # 2 ms inter-token gaps
SWEEP_SCHEDULE = {"ttft_ms": 20.0, "decode_tps": 100.0}
SIM_URL = ""


def schedule(values: dict[str, float]) -> None:
    import httpx

    httpx.post(f"{SIM_URL}/sim/config", json=values).raise_for_status()
SEQ_TOKENS, SWEEP_TOKENS = 20, 100


def body(tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "sim-7b", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": tokens, "stream": stream}


async def sequential(direct: tuple[int, str], system: tuple[int, str], pairs: int) -> dict[str, list[float]]:
    """Interleaved pairs, direct then system (order alternating): added TTFT and ITL distortion."""
    a = Connection("127.0.0.1", direct[0], direct[1], {"authorization": f"Bearer {KEY}"})
    b = Connection("127.0.0.1", system[0], system[1], {"authorization": f"Bearer {KEY}"})
    added_ttft: list[float] = []
    distortion: list[float] = []
    for _ in range(5):  # warm both paths
        await a.stream(body(SEQ_TOKENS))
        await b.stream(body(SEQ_TOKENS))
    for i in range(pairs):
        runs = {}
        for name, conn in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
            runs[name] = await conn.stream(body(SEQ_TOKENS))
        (sa, xa, _), (sb, xb, _) = runs["a"], runs["b"]
        if len(xa) == len(xb) == SEQ_TOKENS:
            added_ttft.append((xb[0] - sb) - (xa[0] - sa))
            gaps_a = [y - x for x, y in zip(xa, xa[1:])]
            gaps_b = [y - x for x, y in zip(xb, xb[1:])]
            distortion.extend(gb - ga for ga, gb in zip(gaps_a, gaps_b))
    a.close()
    b.close()
    return {"added_ttft": added_ttft, "itl_distortion": distortion}


async def concurrent(target: tuple[int, str], streams: int, seconds: float, fresh: bool = False) -> dict[str, Any]:
    """`streams` closed-loop workers; `fresh`: each stream on a new connection (else kept alive)."""
    ttfts: list[float] = []
    gaps: list[float] = []
    chunks = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal chunks
        conn = Connection("127.0.0.1", target[0], target[1], {"authorization": f"Bearer {KEY}"})
        while time.perf_counter() < deadline:
            start, arrivals, status = await conn.stream(body(SWEEP_TOKENS))
            if fresh:
                conn.close()
            if status == 200 and arrivals:
                ttfts.append(arrivals[0] - start)
                gaps.extend(y - x for x, y in zip(arrivals, arrivals[1:]))
                chunks += len(arrivals)
        conn.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    elapsed = time.perf_counter() - began
    return {"ttft": ttfts, "gaps": gaps, "chunks": chunks, "seconds": elapsed}


async def burst(target: tuple[int, str], streams: int, rounds: int, fresh: bool = False, tokens: int = SWEEP_TOKENS) -> dict[str, Any]:
    """`streams` requests started at once, `rounds` times: on connections kept between rounds
    (keep-alive clients, the openai client's default), or `fresh`: each on a new connection, whose
    TCP handshake is then part of its TTFT (the start is taken before the connect)."""
    conns = [Connection("127.0.0.1", target[0], target[1], {"authorization": f"Bearer {KEY}"}) for _ in range(streams)]
    ttfts: list[float] = []
    for _ in range(rounds):
        results = await asyncio.gather(*(conn.stream(body(tokens)) for conn in conns))
        ttfts.extend(arrivals[0] - start for start, arrivals, status in results if status == 200 and arrivals)
        if fresh:
            for conn in conns:
                conn.close()
        await asyncio.sleep(0.2)
    for conn in conns:
        conn.close()
    return {"ttft": ttfts}


async def non_streaming(target: tuple[int, str], seconds: float, concurrency: int = 16) -> dict[str, Any]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        conn = Connection("127.0.0.1", target[0], target[1], {"authorization": f"Bearer {KEY}"})
        while time.perf_counter() < deadline:
            start, end, status = await conn.complete(body(1, stream=False))
            if status == 200:
                latencies.append(end - start)
        conn.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"rps": len(latencies) / (time.perf_counter() - began), "latency": latencies}


def summarise(name: str, seq: dict[str, list[float]], sweep: dict[int, dict[str, Any]], direct_sweep: dict[int, dict[str, Any]],
              rps: dict[str, Any], direct_rps: dict[str, Any], cpu: dict[int, float], rss: float | None,
              bursts: dict[str, Any], direct_bursts: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"system": name}
    ms = lambda v: round(v * 1000, 3)  # noqa: E731
    row["seq_added_ttft_p50_ms"] = ms(pct(seq["added_ttft"], 0.5))
    row["seq_added_ttft_p99_ms"] = ms(pct(seq["added_ttft"], 0.99))
    row["seq_itl_distortion_p50_ms"] = ms(pct(seq["itl_distortion"], 0.5))
    row["seq_itl_distortion_p99_ms"] = ms(pct(seq["itl_distortion"], 0.99))
    saturation = None
    for streams, result in sweep.items():
        base = direct_sweep[streams]
        added = pct(result["ttft"], 0.5) - pct(base["ttft"], 0.5)
        row[f"c{streams}_added_ttft_p50_ms"] = ms(added)
        row[f"c{streams}_added_ttft_p99_ms"] = ms(pct(result["ttft"], 0.99) - pct(base["ttft"], 0.99))
        row[f"c{streams}_itl_p50_ms"] = ms(pct(result["gaps"], 0.5))
        row[f"c{streams}_itl_p99_ms"] = ms(pct(result["gaps"], 0.99))
        row[f"c{streams}_chunks_per_s"] = round(result["chunks"] / result["seconds"])
        if saturation is None and added > 0.005:
            saturation = streams
    row["saturation_streams"] = saturation or f">{max(sweep)}"
    row["rps_non_streaming"] = round(rps["rps"], 1)
    row["rps_direct"] = round(direct_rps["rps"], 1)
    row["non_streaming_added_p50_ms"] = ms(pct(rps["latency"], 0.5) - pct(direct_rps["latency"], 0.5))
    for streams, seconds_per_chunk in cpu.items():
        row[f"cpu_us_per_chunk_c{streams}"] = round(seconds_per_chunk * 1e6, 2)
    row["burst_added_ttft_p50_ms"] = ms(pct(bursts["ttft"], 0.5) - pct(direct_bursts["ttft"], 0.5))
    row["burst_added_ttft_p99_ms"] = ms(pct(bursts["ttft"], 0.99) - pct(direct_bursts["ttft"], 0.99))
    row["peak_rss_mb"] = round(rss, 1) if rss is not None else None
    return row


def run_system(target: tuple[int, str], pid: int | None, direct: tuple[int, str], args: argparse.Namespace,
               direct_sweep: dict[int, dict[str, Any]], direct_rps: dict[str, Any], direct_bursts: tuple[dict[str, Any], dict[str, Any]], name: str) -> dict[str, Any]:
    print(f"[{name}] sequential pairs", flush=True)
    schedule(SEQ_SCHEDULE)
    seq = asyncio.run(sequential(direct, target, args.pairs))
    own = own_ttft_overhead(target[0], args.pairs) if name.startswith(("llm-latency-proxy", "before")) else []
    schedule(SWEEP_SCHEDULE)
    sweep = {}
    cpu: dict[int, float] = {}
    for streams in args.sweep:
        print(f"[{name}] {streams} streams", flush=True)
        before = cpu_seconds(pid) if pid else 0.0
        sweep[streams] = asyncio.run(concurrent(target, streams, args.seconds))
        if pid and streams in (1, 16, 64):
            cpu[streams] = (cpu_seconds(pid) - before) / max(1, sweep[streams]["chunks"])
    fresh_cpu: dict[int, float] = {}
    for streams in (1, 16, 64):
        if pid and streams in args.sweep:
            print(f"[{name}] {streams} streams, one connection each", flush=True)
            before = cpu_seconds(pid)
            result = asyncio.run(concurrent(target, streams, args.seconds, fresh=True))
            fresh_cpu[streams] = (cpu_seconds(pid) - before) / max(1, result["chunks"])
    print(f"[{name}] bursts of {args.burst}", flush=True)
    bursts = asyncio.run(burst(target, args.burst, args.burst_rounds))
    fresh_bursts = asyncio.run(burst(target, args.burst, args.burst_rounds, fresh=True))
    print(f"[{name}] non-streaming", flush=True)
    schedule({"ttft_ms": 0.0})
    rps = asyncio.run(non_streaming(target, args.seconds))
    schedule(SWEEP_SCHEDULE)
    row = summarise(name, seq, sweep, direct_sweep, rps, direct_rps, cpu, memory_mb(pid, "VmHWM") if pid else None, bursts, direct_bursts[0])
    ms = lambda v: round(v * 1000, 3)  # noqa: E731
    for streams, seconds_per_chunk in fresh_cpu.items():
        row[f"fresh_cpu_us_per_chunk_c{streams}"] = round(seconds_per_chunk * 1e6, 2)
    row["fresh_burst_added_ttft_p50_ms"] = ms(pct(fresh_bursts["ttft"], 0.5) - pct(direct_bursts[1]["ttft"], 0.5))
    row["fresh_burst_added_ttft_p99_ms"] = ms(pct(fresh_bursts["ttft"], 0.99) - pct(direct_bursts[1]["ttft"], 0.99))
    if own:
        row["own_ttft_overhead_p50_ms"] = ms(pct(own, 0.5))
    return row


def own_ttft_overhead(port: int, pairs: int) -> list[float]:
    """The proxy's own time on each sequential request's TTFT path, from its records: the `proxy`
    phase before the upstream request was issued plus relaying the first content chunk."""
    import httpx

    records = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": pairs}).json()
    return [r["proxy_parts_s"]["before"] + r["proxy_parts_s"]["first_token"] for r in records if "proxy_parts_s" in r]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=6.0, help="per concurrency level and for the RPS run")
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--burst", type=int, default=64, help="streams started at once")
    parser.add_argument("--burst-rounds", type=int, default=8)
    parser.add_argument("--systems", nargs="+", default=["envoy", "metrics-only", "offsets", "before", "litellm"],
                        help="envoy (the floor: a C++ relay measuring nothing), metrics-only, offsets (the defaults: tracing on, "
                             "per-token offsets on the decode span), off, events, spans, before, litellm")
    parser.add_argument("--before", default="", help="checkout to run as the system 'before' (default flags, tracing on)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    py = sys.executable
    sim_port = free_port()
    direct = (sim_port, "/v1")
    rows: list[dict[str, Any]] = []
    sink = Sink()
    try:
        return run_all(args, py, sim_port, direct, rows, sink)
    finally:
        sink.close()


def run_all(args: argparse.Namespace, py: str, sim_port: int, direct: tuple[int, str], rows: list[dict[str, Any]], sink: Sink) -> int:
    global SIM_URL
    SIM_URL = f"http://127.0.0.1:{sim_port}"
    with simulator(sim_port):
        print("[direct] sweep and non-streaming", flush=True)
        schedule(SWEEP_SCHEDULE)
        direct_sweep = {s: asyncio.run(concurrent(direct, s, args.seconds)) for s in args.sweep}
        schedule({"ttft_ms": 0.0})
        direct_rps = asyncio.run(non_streaming(direct, args.seconds))
        schedule(SWEEP_SCHEDULE)
        direct_bursts = (asyncio.run(burst(direct, args.burst, args.burst_rounds)),
                         asyncio.run(burst(direct, args.burst, args.burst_rounds, fresh=True)))
        ideal_ttft = SWEEP_SCHEDULE["ttft_ms"] / 1000
        rows.append({"system": "direct", **{f"c{s}_ttft_p50_ms": round(pct(r["ttft"], 0.5) * 1000, 3) for s, r in direct_sweep.items()},
                     **{f"c{s}_itl_p50_ms": round(pct(r["gaps"], 0.5) * 1000, 3) for s, r in direct_sweep.items()},
                     **{f"c{s}_chunks_per_s": round(r["chunks"] / r["seconds"]) for s, r in direct_sweep.items()},
                     "ideal_ttft_ms": ideal_ttft * 1000, "ideal_itl_ms": 1000 / SWEEP_SCHEDULE["decode_tps"],
                     "rps_non_streaming": round(direct_rps["rps"], 1)})
        for name in args.systems:
            port = free_port()
            if name == "litellm":
                rows.append(run_litellm(port, sim_port, direct, args, direct_sweep, direct_rps, direct_bursts))
                continue
            if name == "envoy":
                rows.append(run_envoy(port, sim_port, direct, args, direct_sweep, direct_rps, direct_bursts))
                continue
            if name == "before" and not args.before:
                continue
            flags = ["--token-spans", name] if name not in ("metrics-only", "before") else []
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url} if name != "metrics-only" else {}
            src = args.before if name == "before" else str(ROOT)
            cmd = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port), *flags)
            label = f"before ({args.before}), tracing on" if name == "before" else f"llm-latency-proxy {LABELS.get(name, name)}"
            with process(cmd, f"http://127.0.0.1:{port}/healthz", env) as proc:
                rows.append(run_system((port, "/v1"), proc.pid, direct, args, direct_sweep, direct_rps, direct_bursts, label))
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}", "args": vars(args) | {"out": str(args.out), "plot": str(args.plot)},
              "rows": rows}
    print(json.dumps(report, indent=1))
    print(floor_table(rows))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, args.sweep, args.plot)
    return 0


def run_litellm(port: int, sim_port: int, direct: tuple[int, str], args: argparse.Namespace,
                direct_sweep: dict[int, dict[str, Any]], direct_rps: dict[str, Any], direct_bursts: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    config = Path(tempfile.mkdtemp()) / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: sim-7b\n    litellm_params:\n      model: openai/sim-7b\n"
        f"      api_base: http://127.0.0.1:{sim_port}/v1\n      api_key: none\n"
        f"general_settings:\n  master_key: {KEY}\nlitellm_settings:\n  drop_params: true\n")
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true"}
    cmd = [LITELLM_PYTHON, "-m", "litellm.proxy.proxy_cli", "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    with process(cmd, f"http://127.0.0.1:{port}/health/liveliness", env, {"authorization": f"Bearer {KEY}"}) as proc:
        return run_system((port, "/v1"), proc.pid, direct, args, direct_sweep, direct_rps, direct_bursts, "litellm 1.108.7")




def run_envoy(port: int, sim_port: int, direct: tuple[int, str], args: argparse.Namespace,
              direct_sweep: dict[int, dict[str, Any]], direct_rps: dict[str, Any], direct_bursts: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """Envoy, the floor a relay can reach: a C++ proxy with a plain route to the same upstream,
    one worker thread (--concurrency 1, as the proxy runs one worker), measuring nothing."""
    with process(envoy_command(port, sim_port), f"http://127.0.0.1:{port}/health") as proc:
        return run_system((port, "/v1"), proc.pid, direct, args, direct_sweep, direct_rps, direct_bursts, "envoy 1.40.0 (--concurrency 1)")


LABELS = {"metrics-only": "defaults (records, metrics; no OTLP endpoint)", "offsets": "defaults + tracing (OTLP)"}

# (figure, row key, target as a ratio to Envoy's, or as ms above Envoy's) for the floor table
FLOOR_FIGURES = [
    ("CPU µs per chunk, 1 stream, keep-alive", "cpu_us_per_chunk_c1", 1.2, None),
    ("CPU µs per chunk, 16 streams, keep-alive", "cpu_us_per_chunk_c16", 1.2, None),
    ("CPU µs per chunk, 64 streams, keep-alive", "cpu_us_per_chunk_c64", 1.2, None),
    ("CPU µs per chunk, 1 stream, one connection each", "fresh_cpu_us_per_chunk_c1", 1.2, None),
    ("CPU µs per chunk, 16 streams, one connection each", "fresh_cpu_us_per_chunk_c16", 1.2, None),
    ("CPU µs per chunk, 64 streams, one connection each", "fresh_cpu_us_per_chunk_c64", 1.2, None),
    ("burst of 64, added TTFT p50 (ms), keep-alive", "burst_added_ttft_p50_ms", 1.5, None),
    ("burst of 64, added TTFT p99 (ms), keep-alive", "burst_added_ttft_p99_ms", 2.0, None),
    ("burst of 64, added TTFT p50 (ms), one connection each", "fresh_burst_added_ttft_p50_ms", 1.5, None),
    ("burst of 64, added TTFT p99 (ms), one connection each", "fresh_burst_added_ttft_p99_ms", 2.0, None),
    ("1 stream, added TTFT p50 (ms)", "seq_added_ttft_p50_ms", None, 0.2),
]


def floor_table(rows: list[dict[str, Any]]) -> str:
    """Every system against Envoy, the floor, from this run: figure (ratio), and whether the target holds."""
    envoy = next((r for r in rows if r["system"].startswith("envoy")), None)
    systems = [r for r in rows if r["system"] != "direct"]
    if envoy is None:
        return "(no envoy row: run with --systems envoy ...)"
    lines = ["| figure | target | " + " | ".join(r["system"] for r in systems) + " |",
             "|---|---|" + "---|" * len(systems)]
    for title, key, ratio, above in FLOOR_FIGURES:
        floor = envoy.get(key)
        cells = []
        for r in systems:
            value = r.get(key)
            if value is None or floor is None:
                cells.append("")
                continue
            if r is envoy:
                cells.append(f"{value:,.2f}")
            elif ratio is not None:
                met = "✓" if value <= ratio * floor else "✗"
                cells.append(f"{value:,.2f} ({value / floor:.2f}×) {met}" if floor > 0 else f"{value:,.2f}")
            else:
                met = "✓" if value - floor <= (above or 0) else "✗"
                cells.append(f"{value:,.3f} ({value - floor:+.3f}) {met}")
        target = f"≤ {ratio}× Envoy" if ratio is not None else f"≤ Envoy + {above} ms"
        lines.append(f"| {title} | {target} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in systems:
        if "own_ttft_overhead_p50_ms" in r:
            observed = r["seq_added_ttft_p50_ms"] - envoy["seq_added_ttft_p50_ms"]
            own = r["own_ttft_overhead_p50_ms"]
            met = "✓" if abs(observed - own) <= 0.2 else "✗"
            lines.append(f"{r['system']}: client-observed added TTFT p50 less Envoy's = {observed:.3f} ms; its own "
                         f"`proxy` phase on the TTFT path (records) p50 = {own:.3f} ms; within 0.2 ms: {met}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], sweep: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows[1:]:
        left.plot(sweep, [row[f"c{s}_added_ttft_p50_ms"] for s in sweep], marker="o", label=row["system"])
        right.plot(sweep, [row[f"c{s}_itl_p99_ms"] for s in sweep], marker="o", label=row["system"])
    right.plot(sweep, [rows[0][f"c{s}_itl_p50_ms"] for s in sweep], "k--", label="direct ITL p50")
    for axis, title in ((left, "added TTFT p50 vs direct (ms)"), (right, "client inter-token gap p99 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    left.axhline(5, color="red", linewidth=0.8, linestyle=":")
    left.set_yscale("symlog", linthresh=1)
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(results: Path, path: Path) -> None:
    """Redraw the plot from a saved run (python -m bench.relay compare --replot bench/results.json bench/compare.png)."""
    report = json.loads(results.read_text())
    plot(report["rows"], report["args"]["sweep"], path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replot"]:
        replot(Path(sys.argv[2]), Path(sys.argv[3]))
        raise SystemExit(0)
    raise SystemExit(main())
