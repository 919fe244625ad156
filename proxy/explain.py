"""`llm-latency-proxy explain`: the latency budget of real traffic, from the records databases.

The background reading does this by hand: Total ≈ Prefill(L_in) + Decode(L_out); the crossover
prompt length where prefill equals decode; single-stream decode tok/s ≈ memory bandwidth ÷ bytes
read per token; per-request speed is not aggregate throughput. Here each figure is fitted from the
requests that really happened, per model and upstream, with the count and goodness of fit behind
it:

- prefill seconds (the phase, queue and hidden reasoning excluded) against *uncached* prompt
  tokens: intercept = fixed cost, 1 / slope = prefill tok/s;
- decode seconds per token against the requests in flight when the request started decoding:
  ITL ≈ α + β·concurrency, so "100 tok/s per request" holds only near batch 1.

Fits are Theil–Sen (the median of pairwise slopes): a few stalled requests do not bend them.
"""
from __future__ import annotations

import collections
import json
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from . import budget
from .slo import Objective

PHASES = ("client", "network", "tokenize", "queue", "load", "prefill", "reasoning", "decode", "server", "proxy")
MAX_PAIRS_POINTS = 300  # points sampled for the pairwise slopes (45,000 pairs)


@dataclass
class Fit:
    intercept: float
    slope: float
    r2: float
    n: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def theil_sen(xs: list[float], ys: list[float], seed: int = 0) -> Fit | None:
    """Median of pairwise slopes, median intercept; None without two distinct x values."""
    points = list(zip(xs, ys))
    if len({x for x, _ in points}) < 2:
        return None
    sample = random.Random(seed).sample(points, MAX_PAIRS_POINTS) if len(points) > MAX_PAIRS_POINTS else points
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(sample) for x2, y2 in sample[i + 1:] if x2 != x1]
    slope = statistics.median(slopes)
    intercept = statistics.median(y - slope * x for x, y in points)
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in points)
    return Fit(intercept, slope, 1.0 - residual / total if total > 0 else 1.0, len(points))


def roofline(params: float, bytes_per_param: float, bandwidth: float, kv_bytes_per_token: float = 0.0, context: float = 0.0) -> float:
    """Bandwidth-bound single-stream decode ceiling, tok/s: every token reads the weights and the
    KV cache of its context once."""
    return bandwidth / (params * bytes_per_param + kv_bytes_per_token * context)


def load(paths: Iterable[str], since_s: float = 0.0, model: str = "") -> list[dict[str, Any]]:
    """Records from one or more stores (records.load: SQLite files, or a fleet's PostgreSQL)."""
    from .records import load as load_records

    return load_records(list(paths), since_s, model)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyse_group(records: list[dict[str, Any]], hardware: dict[str, float] | None = None,
                  objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    """Every figure for one model on one upstream, from its successful requests."""
    ok = [r for r in records if r["outcome"] == "ok"]
    streams = [r for r in ok if r.get("ttft_s") is not None]
    report: dict[str, Any] = {"requests": len(records), "ok": len(ok), "streams": len(streams)}
    # Which APIs carried this model's traffic: one engine behind them, so one fit; the split shows who calls it.
    report["apis"] = dict(collections.Counter(f"{r.get('api', 'openai')} {r.get('endpoint', 'chat')}" for r in records).most_common())
    xs, ys = [], []
    for r in streams:
        if r.get("prompt_tokens") is not None and "prefill" in r["phases_s"]:
            xs.append(float(r["prompt_tokens"] - (r.get("cached_prompt_tokens") or 0)))
            ys.append(r["phases_s"]["prefill"])
    prefill = theil_sen(xs, ys)
    if prefill is not None:
        report["prefill"] = {**asdict(prefill), "tokens_per_second": 1.0 / prefill.slope if prefill.slope > 0 else None,
                             "fixed_cost_s": prefill.intercept}
    cx, cy = [], []
    for r in streams:  # (a slow client's held-back stream is the client's pace, not the engine's: left out)
        if r.get("decode_tokens_per_second") and r.get("in_flight_at_decode") and r.get("unmeasured") != "client_backpressure":
            cx.append(float(r["in_flight_at_decode"]))
            cy.append(1.0 / r["decode_tokens_per_second"])
    decode = theil_sen(cx, cy)
    if decode is not None:
        report["decode"] = {**asdict(decode), "itl_at_1_s": decode.at(1), "tokens_per_second_at_1": 1.0 / decode.at(1)}
    elif cy:
        report["decode"] = {"itl_at_1_s": statistics.median(cy), "tokens_per_second_at_1": 1.0 / statistics.median(cy), "n": len(cy),
                            "note": "one concurrency level only: no slope"}
    queues = [r["phases_s"]["queue"] for r in streams if "queue" in r["phases_s"]]
    if queues:
        report["queue_s_median"] = statistics.median(queues)
    loads = [r["phases_s"]["load"] for r in ok if r["phases_s"].get("load")]
    if loads:  # a cold model load (Ollama's load_duration): the first thing to see on a laptop
        report["load"] = {"requests": len(loads), "median_s": statistics.median(loads), "max_s": max(loads)}
    phases = {p: statistics.median(r["phases_s"].get(p, 0.0) for r in ok) for p in PHASES if any(p in r["phases_s"] for r in ok)}
    total = sum(phases.values())
    if total > 0:
        report["budget"] = {p: {"seconds": s, "share": s / total} for p, s in phases.items()}
        report["dominant"] = max(phases, key=phases.__getitem__)
    outputs = [r["completion_tokens"] - (r.get("hidden_reasoning_tokens") or 0) for r in ok if r.get("completion_tokens")]
    median_output = _median([float(o) for o in outputs])
    if prefill is not None and prefill.slope > 0 and "decode" in report and median_output:
        decode_time = median_output * report["decode"]["itl_at_1_s"]
        report["crossover_prompt_tokens"] = max(0.0, (decode_time - prefill.intercept) / prefill.slope)
        report["median_output_tokens"] = median_output
    if median_output:
        report["what_if"] = {"2ms_less_per_output_token_saves_s": 0.002 * median_output}
    network = phases.get("network")
    if network is not None:
        report.setdefault("what_if", {})["halving_network_saves_ms"] = network / 2 * 1000
    speeds = [r["decode_tokens_per_second"] for r in streams if r.get("decode_tokens_per_second")]
    if speeds and len(ok) > 1:
        start = min(r["received_unix_ns"] for r in ok)
        end = max(r["received_unix_ns"] + r["duration_s"] * 1e9 for r in ok)
        aggregate = sum(r.get("completion_tokens") or 0 for r in ok) / max(1e-9, (end - start) / 1e9)
        per_request = statistics.median(speeds)
        report["throughput"] = {"per_request_decode_tps_median": per_request, "aggregate_output_tps": aggregate,
                                "aggregate_over_per_request": aggregate / per_request}
    if hardware and "decode" in report:
        prompts = [float(r.get("prompt_tokens") or 0) for r in ok]
        context = (_median(prompts) or 0.0) + (median_output or 0.0) / 2
        ceiling = roofline(hardware["params"], hardware["bytes_per_param"], hardware["bandwidth"], hardware.get("kv_bytes_per_token", 0.0), context)
        report["roofline"] = {"ceiling_tps": ceiling, "measured_tps_at_1": report["decode"]["tokens_per_second_at_1"],
                              "mbu": report["decode"]["tokens_per_second_at_1"] / ceiling, "context_tokens": context}
    names = collections.Counter(r["slo"] for r in records if r.get("slo"))
    if names:  # the SLO its requests were judged against (the file's today: the one that matches the model)
        name = names.most_common(1)[0][0]
        objective = next((o for o in objectives if o.name == name), None)
        report["slo"] = {"name": name, **budget.attainment(records, name, objective)}
        cap = budget.capacity(streams, report.get("decode"), objective)
        if cap is not None:
            report["capacity"] = cap
    report["diagnosis"] = diagnosis(report)
    return report


def diagnosis(report: dict[str, Any]) -> list[str]:
    """Two or three lines a person can paste into an incident channel."""
    lines = []
    budget = report.get("budget")
    if budget:
        dominant = report["dominant"]
        share = lambda p: budget.get(p, {}).get("share", 0.0)  # noqa: E731
        lines.append(f"{dominant}-dominant: {share(dominant):.0%} of wall clock; network {share('network'):.1%}, "
                     f"tokenizer {share('tokenize'):.2%}, proxy {share('proxy'):.2%}")
    decode = report.get("decode")
    if decode and "slope" in decode and decode["intercept"] > 0:
        lines.append(f"decode {decode['tokens_per_second_at_1']:.0f} tok/s per request near batch 1; each extra concurrent request "
                     f"adds {decode['slope'] * 1000:.2f} ms per token ({decode['slope'] / decode['intercept']:.1%})")
    throughput = report.get("throughput")
    if throughput:
        ratio = throughput["aggregate_over_per_request"]
        why = ("a server's advertised tok/s is not what one user sees" if ratio > 1.5 else
               "requests mostly ran one at a time, so no batching raised the aggregate")
        lines.append(f"per-request decode {throughput['per_request_decode_tps_median']:.0f} tok/s vs aggregate output "
                     f"{throughput['aggregate_output_tps']:.0f} tok/s ({ratio:.1f}x): {why}")
    return lines


def explain(records: list[dict[str, Any]], hardware: dict[str, float] | None = None,
            objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], r.get("upstream", "")), []).append(r)
    return {f"{model} @ {upstream}": analyse_group(rs, hardware, objectives) for (model, upstream), rs in sorted(groups.items())}


def render(report: dict[str, Any]) -> str:
    """The text report: one block per model and upstream."""
    ms = lambda s: f"{s * 1000:.2f} ms" if s < 1 else f"{s:.3f} s"  # noqa: E731
    out = []
    for name, g in report.items():
        out.append(f"== {name}: {g['requests']} requests, {g['ok']} ok, {g['streams']} streamed")
        if g.get("apis"):
            out.append("apis: " + ", ".join(f"{api} {n}" for api, n in g["apis"].items()))
        if "prefill" in g:
            p = g["prefill"]
            tps = f"{p['tokens_per_second']:,.0f} tok/s" if p["tokens_per_second"] else "n/a"
            out.append(f"prefill: {tps} over uncached prompt tokens, fixed cost {ms(p['fixed_cost_s'])} (R² {p['r2']:.3f}, n={p['n']})")
        if "decode" in g:
            d = g["decode"]
            slope = f", +{d['slope'] * 1000:.3f} ms per token per concurrent request (R² {d['r2']:.3f}, n={d['n']})" if "slope" in d else f" (n={d['n']}, {d.get('note', '')})"
            out.append(f"decode: {d['tokens_per_second_at_1']:.1f} tok/s at batch 1 (ITL {ms(d['itl_at_1_s'])}){slope}")
        if "queue_s_median" in g:
            out.append(f"queue (engine-reported): median {ms(g['queue_s_median'])}")
        if "load" in g:
            load = g["load"]
            out.append(f"model load (engine-reported): {load['requests']} of {g['ok']} requests waited for it, median {ms(load['median_s'])}, "
                       f"max {ms(load['max_s'])}")
        if "budget" in g:
            parts = ", ".join(f"{p} {ms(v['seconds'])} ({v['share']:.1%})" for p, v in g["budget"].items())
            out.append(f"median request: {parts}; {g['dominant']} dominates")
        if "crossover_prompt_tokens" in g:
            out.append(f"crossover: prefill equals decode at {g['crossover_prompt_tokens']:,.0f} uncached prompt tokens "
                       f"(median output {g['median_output_tokens']:.0f} tokens)")
        for key, value in g.get("what_if", {}).items():
            out.append(f"what if: {'2 ms less per output token saves' if key.startswith('2ms') else 'halving the network saves'} "
                       f"{ms(value) if key.startswith('2ms') else f'{value:.2f} ms'} on the median request")
        if "throughput" in g:
            t = g["throughput"]
            out.append(f"throughput: per-request decode {t['per_request_decode_tps_median']:.1f} tok/s, aggregate output "
                       f"{t['aggregate_output_tps']:.1f} tok/s ({t['aggregate_over_per_request']:.1f}x apart)")
        if "slo" in g:
            out.extend(budget.render(g["slo"]["name"], g["slo"]))
        if "capacity" in g:
            out.append(budget.render_capacity(g["capacity"]))
        if "roofline" in g:
            r = g["roofline"]
            out.append(f"roofline: ceiling {r['ceiling_tps']:.1f} tok/s at {r['context_tokens']:.0f} tokens of context; measured "
                       f"{r['measured_tps_at_1']:.1f} tok/s: MBU {r['mbu']:.0%}")
        out.extend(f"> {line}" for line in g["diagnosis"])
        out.append("")
    return "\n".join(out)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)


def plot(records: list[dict[str, Any]], report: dict[str, Any], path: str) -> None:
    """Per model and upstream: prefill seconds vs uncached prompt tokens with the fit, and seconds
    per output token vs requests in flight with the fit (matplotlib: `pip install '.[plot]'`)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'llm-latency-proxy[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * max(1, len(names))), squeeze=False)
    for row, name in enumerate(names):
        group = [r for r in records if f"{r['model']} @ {r.get('upstream', '')}" == name and r["outcome"] == "ok" and r.get("ttft_s") is not None]
        g, left, right = report[name], axes[row][0], axes[row][1]
        xs = [r["prompt_tokens"] - (r.get("cached_prompt_tokens") or 0) for r in group if r.get("prompt_tokens") is not None and "prefill" in r["phases_s"]]
        ys = [r["phases_s"]["prefill"] for r in group if r.get("prompt_tokens") is not None and "prefill" in r["phases_s"]]
        left.scatter(xs, ys, s=8, alpha=0.6)
        if "prefill" in g and xs:
            p = g["prefill"]
            left.plot([0, max(xs)], [p["intercept"], p["intercept"] + p["slope"] * max(xs)], color="black",
                      label=f"{p['tokens_per_second'] or 0:,.0f} tok/s + {p['fixed_cost_s'] * 1000:.1f} ms (R² {p['r2']:.2f})")
            left.legend(loc="upper left")
        left.set(title=f"{name}: prefill", xlabel="uncached prompt tokens", ylabel="prefill seconds")
        cx = [r["in_flight_at_decode"] for r in group if r.get("decode_tokens_per_second") and r.get("in_flight_at_decode")]
        cy = [1000 / r["decode_tokens_per_second"] for r in group if r.get("decode_tokens_per_second") and r.get("in_flight_at_decode")]
        right.scatter(cx, cy, s=8, alpha=0.6)
        d = g.get("decode", {})
        if "slope" in d and cx:
            right.plot([1, max(cx)], [1000 * (d["intercept"] + d["slope"]), 1000 * (d["intercept"] + d["slope"] * max(cx))], color="black",
                       label=f"ITL = {d['intercept'] * 1000:.2f} + {d['slope'] * 1000:.3f}·n ms (R² {d['r2']:.2f})")
            right.legend(loc="upper left")
        right.set(title=f"{name}: decode", xlabel="requests in flight when decoding started", ylabel="ms per output token")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
