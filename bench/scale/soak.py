"""Soak: many concurrent streams through the proxy for a long time, with a share of faults.

Reports the request success rate, the proxy's RSS over time (growth after warm-up), its open file
descriptors and sockets, and whether `llmproxy_requests_total` equals the requests sent.

    .venv/bin/python -m bench.scale soak --duration 1800 --concurrency 200     # make soak
    .venv/bin/python -m bench.scale soak --duration 300 --concurrency 100 --burst 1000 --burst-every 60

Burst mode: on top of the steady load, `--burst N` streams start at once every `--burst-every`
seconds (bench/fleet/overload.py's raw client). For each burst: descriptors and RSS just before, the peak,
and 10 s after (back to where they were?), and how the burst's requests ended.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import simulator  # noqa: E402

from proxy.processes import free_port, started  # noqa: E402
from proxy.simulator.load import Mix, run_load  # noqa: E402

from bench.truth.burst import Peak  # noqa: E402
from bench.fleet.overload import burst as raw_burst  # noqa: E402


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    sent: int = 0
    ok: int = 0
    injected_errors: int = 0
    unexpected: int = 0
    transport_failures: int = 0
    counted_by_proxy: float = 0.0
    samples: list[dict[str, float]] = field(default_factory=list)  # t, rss_mb, fds, sockets
    bursts: list[dict[str, Any]] = field(default_factory=list)  # burst mode: one entry per burst

    @property
    def success_rate(self) -> float:
        return self.ok / max(1, self.sent - self.injected_errors)

    def rss_growth(self) -> float:
        """Relative RSS growth from the end of warm-up (first third) to the end."""
        warm = [s["rss_mb"] for s in self.samples[len(self.samples) // 3 :]]
        return (warm[-1] - warm[0]) / warm[0] if len(warm) > 1 else 0.0


def proc_stats(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed since the listing
            pass
    return {"rss_mb": rss_kb / 1024, "fds": len(fds), "sockets": sockets}


def bursts(pid: int, port: int, size: int, every: float, stop: threading.Event, report: SoakReport) -> None:
    """Every `every` seconds, `size` streams at once; descriptors and RSS before, at peak, 10 s after."""
    while not stop.wait(every):
        before = proc_stats(pid)
        with Peak(pid) as peak:
            results = asyncio.run(raw_burst(port, size))
        took = time.monotonic()
        stop.wait(10.0)
        after = proc_stats(pid)
        report.bursts.append({"streams": size, "statuses": dict(Counter(r[0] for r in results)),
                              "burst_s": round(max(r[3] for r in results), 2),
                              "fds_before_peak_after10s": [before["fds"], peak.most, after["fds"]],
                              "rss_mb_before_after10s": [round(before["rss_mb"], 1), round(after["rss_mb"], 1)],
                              "settle_wait_s": round(time.monotonic() - took, 1)})


def soak(duration_s: float, concurrency: int, fault_share: float = 0.05, sample_every: float = 5.0,
         burst: int = 0, burst_every: float = 60.0) -> SoakReport:
    report = SoakReport(duration_s, concurrency)
    sim_port, proxy_port = free_port(), free_port()
    sim, proxy = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    with simulator(sim_port, "--decode-tps", "20", "--jitter", "0.1"), \
         started(["serve", "--upstream", f"{sim}/v1", "--port", str(proxy_port), "--token-spans", "off"], f"{proxy}/healthz") as proc:
        start = time.monotonic()
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                report.samples.append({"t": round(time.monotonic() - start, 1), **proc_stats(proc.pid)})
                stop.wait(sample_every)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        burster = threading.Thread(target=bursts, args=(proc.pid, proxy_port, burst, burst_every, stop, report), daemon=True)
        if burst:
            burster.start()
        mix = Mix(max_tokens=(20, 40, 80), prompt_tokens=(50, 300, 1500), error_share=fault_share)
        result = asyncio.run(run_load(f"{proxy}/v1", concurrency=concurrency, duration_s=duration_s, mix=mix))
        stop.set()
        thread.join()
        if burst:
            burster.join()
        report.samples.append({"t": round(time.monotonic() - start, 1), **proc_stats(proc.pid)})
        text = httpx.get(f"{proxy}/metrics").text
        report.counted_by_proxy = sum(float(v) for v in re.findall(r"^llmproxy_requests_total\{[^}]*\} (\S+)$", text, re.M))
    report.sent, report.transport_failures = result.sent, result.failures
    report.ok = result.statuses.get(200, 0)
    report.injected_errors = sum(n for code, n in result.statuses.items() if code in (429, 500, 503))
    report.unexpected = result.sent - report.ok - report.injected_errors
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=1800)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--faults", type=float, default=0.05, help="share of requests with an injected upstream error")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--burst", type=int, default=0, help="burst mode: this many streams at once, every --burst-every s")
    parser.add_argument("--burst-every", type=float, default=60.0)
    args = parser.parse_args()
    report = soak(args.duration, args.concurrency, args.faults, sample_every=max(5.0, args.duration / 60),
                  burst=args.burst, burst_every=args.burst_every)
    summary = {"sent": report.sent, "ok": report.ok, "injected_errors": report.injected_errors, "unexpected": report.unexpected,
               "transport_failures": report.transport_failures, "success_rate_excluding_injected": round(report.success_rate, 6),
               "counted_by_proxy": report.counted_by_proxy, "rss_growth_after_warmup": round(report.rss_growth(), 4),
               "rss_mb_first_last": [report.samples[0]["rss_mb"], report.samples[-1]["rss_mb"]],
               "fds_min_max": [min(s["fds"] for s in report.samples), max(s["fds"] for s in report.samples)],
               "sockets_min_max": [min(s["sockets"] for s in report.samples), max(s["sockets"] for s in report.samples)]}
    if args.burst:  # (their requests are in counted_by_proxy too)
        summary["sent_in_bursts"] = sum(b["streams"] for b in report.bursts)
        summary["bursts"] = report.bursts
    burst_args = f" --burst {args.burst} --burst-every {args.burst_every:.0f}" if args.burst else ""
    print(f"command: .venv/bin/python -m bench.scale soak --duration {args.duration:.0f} --concurrency {args.concurrency} --faults {args.faults}{burst_args}")
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**summary, "samples": report.samples, **{k: v for k, v in asdict(report).items() if k != "samples"}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
