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

Nothing here reads a record: the store counts the window (records/aggregate.py) and sends its
aggregates and a bounded sample of each fit's points, so a day of a fleet's traffic is read in
seconds. Percentiles come from log histograms (within 1%); a fit's slope and intercept from a
uniform sample (every point, up to `SAMPLE`), its R² and n from sums over every point.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from ..measure.slo import Objective
from ..records import Backend, open_backend
from ..records import columns as C
from ..records.aggregate import Aggregate, read
from ..records.sql import PAIRS, SAMPLE, Window
from . import budget

PHASES = ("client", "failover", "wait", "network", "tokenize", "queue", "load", "prefill", "reasoning", "decode", "server", "proxy", "lag")
BY = ("model", "upstream")
METHOD = {"percentiles": f"from log buckets of ratio {C.GAMMA}: each within {C.GAMMA ** 0.5 - 1:.2%} of the value",
          "fits": f"Theil-Sen: the slope from {PAIRS} points, the intercept from {SAMPLE}, of a uniform sample (every point below that); "
                  "R² and n over every point",
          "window": "--since from the start of the ten-minute block it falls in (records are counted in blocks by their end)"}


@dataclass
class Fit:
    intercept: float
    slope: float
    r2: float
    n: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def theil_sen(points: list[tuple[float, float]], sums: list[float] | None = None) -> Fit | None:
    """The median of the pairwise slopes of the first `PAIRS` points (callers pass a uniform sample,
    in its order), the median intercept over all of them; R² and n from the sums over every point
    (n, Σx, Σy, Σx², Σxy, Σy²) when given, else from the points. None without two distinct x values."""
    if len({x for x, _ in points}) < 2:
        return None
    head = points[:PAIRS]
    slope = statistics.median([(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(head) for x2, y2 in head[i + 1:] if x2 != x1])
    intercept = statistics.median(y - slope * x for x, y in points)
    if sums is None:
        sums = [float(len(points)), sum(x for x, _ in points), sum(y for _, y in points), sum(x * x for x, _ in points),
                sum(x * y for x, y in points), sum(y * y for _, y in points)]
    n, sx, sy, sxx, sxy, syy = sums
    total = syy - sy * sy / n
    residual = max(0.0, syy - 2 * intercept * sy - 2 * slope * sxy + n * intercept ** 2 + 2 * intercept * slope * sx + slope ** 2 * sxx)
    return Fit(intercept, slope, 1.0 - residual / total if total > 0 else 1.0, int(n))


def roofline(params: float, bytes_per_param: float, bandwidth: float, kv_bytes_per_token: float = 0.0, context: float = 0.0) -> float:
    """Bandwidth-bound single-stream decode ceiling, tok/s: every token reads the weights and the
    KV cache of its context once."""
    return bandwidth / (params * bytes_per_param + kv_bytes_per_token * context)


def gather(stores: Iterable[Backend], window: Window = Window()) -> dict[str, Aggregate]:
    """Per model and upstream, the aggregates of one or more stores (one per replica, or a fleet's
    PostgreSQL), with the fits' samples."""
    groups = read(list(stores), BY, window, samples=True)
    return {f"{model} @ {upstream}": agg for (model, upstream), agg in sorted(groups.items())}


def analyse_group(agg: Aggregate, hardware: dict[str, float] | None = None, objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    """Every figure for one model on one upstream, from its successful requests."""
    report: dict[str, Any] = {"requests": agg.requests, "ok": agg.ok, "streams": agg.streams}
    # Which APIs carried this model's traffic: one engine behind them, so one fit; the split shows who calls it.
    report["apis"] = dict(sorted(agg.apis.items(), key=lambda item: (-item[1], item[0])))
    prefill = theil_sen(agg.samples["prefill"], agg.fits["prefill"])
    if prefill is not None:
        report["prefill"] = {**asdict(prefill), "tokens_per_second": 1.0 / prefill.slope if prefill.slope > 0 else None,
                             "fixed_cost_s": prefill.intercept}
    cached = agg.total(C.CACHED)
    if prefill is not None and prefill.slope > 0 and cached > 0:  # what the prefix cache saved, at the fitted prefill rate
        points, uncached = agg.fits["prefill"][0], agg.fits["prefill"][1]
        report["prefix_cache"] = {"cached_tokens": cached, "share": cached / (cached + uncached),
                                  "prefill_saved_s": cached * prefill.slope, "saved_per_request_s": cached * prefill.slope / points}
    decode = theil_sen(agg.samples["decode"], agg.fits["decode"])
    if decode is not None:
        report["decode"] = {**asdict(decode), "itl_at_1_s": decode.at(1), "tokens_per_second_at_1": 1.0 / decode.at(1)}
    elif agg.count(C.DECODE_ITL):
        itl = agg.quantile(C.DECODE_ITL) or 0.0
        report["decode"] = {"itl_at_1_s": itl, "tokens_per_second_at_1": 1.0 / itl, "n": agg.count(C.DECODE_ITL),
                            "note": "one concurrency level only: no slope"}
    if agg.count(C.QUEUE):
        report["queue_s_median"] = agg.quantile(C.QUEUE)
    if agg.count(C.LOAD):  # a cold model load (Ollama's load_duration): the first thing to see on a laptop
        report["load"] = {"requests": agg.count(C.LOAD), "median_s": min(agg.quantile(C.LOAD) or 0.0, agg.load_max), "max_s": agg.load_max}
    phases = {p: agg.quantile(C.PHASE_CODES[p], zeros=agg.ok - agg.count(C.PHASE_CODES[p])) or 0.0
              for p in PHASES if agg.count(C.PHASE_CODES[p])}
    total = sum(phases.values())
    if total > 0:
        report["budget"] = {p: {"seconds": s, "share": s / total} for p, s in phases.items()}
        report["dominant"] = max(phases, key=phases.__getitem__)
    median_output = agg.quantile(C.OUTPUT)
    if prefill is not None and prefill.slope > 0 and "decode" in report and median_output:
        decode_time = median_output * report["decode"]["itl_at_1_s"]
        report["crossover_prompt_tokens"] = max(0.0, (decode_time - prefill.intercept) / prefill.slope)
        report["median_output_tokens"] = median_output
    if median_output:
        report["what_if"] = {"2ms_less_per_output_token_saves_s": 0.002 * median_output}
    network = phases.get("network")
    if network is not None:
        report.setdefault("what_if", {})["halving_network_saves_ms"] = network / 2 * 1000
    if agg.count(C.DECODE_TPS) and agg.ok > 1:
        aggregate = agg.completion / agg.ok_span.seconds
        per_request = agg.quantile(C.DECODE_TPS) or 0.0
        report["throughput"] = {"per_request_decode_tps_median": per_request, "aggregate_output_tps": aggregate,
                                "aggregate_over_per_request": aggregate / per_request}
    if hardware and "decode" in report:
        context = (agg.quantile(C.PROMPT) or 0.0) + (median_output or 0.0) / 2
        ceiling = roofline(hardware["params"], hardware["bytes_per_param"], hardware["bandwidth"], hardware.get("kv_bytes_per_token", 0.0), context)
        report["roofline"] = {"ceiling_tps": ceiling, "measured_tps_at_1": report["decode"]["tokens_per_second_at_1"],
                              "mbu": report["decode"]["tokens_per_second_at_1"] / ceiling, "context_tokens": context}
    if agg.slo_requests:  # the SLO its requests were judged against (the file's today: the one that matches the model)
        name = agg.slo_requests.most_common(1)[0][0]
        objective = next((o for o in objectives if o.name == name), None)
        report["slo"] = {"name": name, **budget.attainment(agg.slos.get(name), objective)}
        cap = budget.capacity(agg.levels(), report.get("decode"), objective)
        if cap is not None:
            report["capacity"] = cap
    report["diagnosis"] = diagnosis(report)
    report["method"] = METHOD
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


def explain(groups: dict[str, Aggregate], hardware: dict[str, float] | None = None,
            objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    return {name: analyse_group(agg, hardware, objectives) for name, agg in groups.items()}


def of_records(records: list[dict[str, Any]]) -> Backend:
    """A store holding these records (a temporary SQLite file, written by the stores' own write path),
    for a report on records in hand: the demo's sections, a test's fixed set."""
    from ..records import Writer

    path = os.path.join(tempfile.mkdtemp(prefix="llmproxy-explain-"), "records.sqlite")
    store = open_backend(path, max_rows=0, max_age_s=0)
    store.open()
    try:
        for start in range(0, len(records), 1000):
            store.write([Writer.row(json.dumps(record).encode()) for record in records[start:start + 1000]])
    finally:
        store.close()
    return store


def render(report: dict[str, Any]) -> str:
    """The text report: one block per model and upstream."""
    ms = lambda s: f"{s * 1000:.2f} ms" if s < 1 else f"{s:.3f} s"  # noqa: E731
    out = [f"(percentiles {METHOD['percentiles']}; fits {METHOD['fits']}; window {METHOD['window']})", ""] if report else []
    for name, g in report.items():
        out.append(f"== {name}: {g['requests']} requests, {g['ok']} ok, {g['streams']} streamed")
        if g.get("apis"):
            out.append("apis: " + ", ".join(f"{api} {n}" for api, n in g["apis"].items()))
        if "prefill" in g:
            p = g["prefill"]
            tps = f"{p['tokens_per_second']:,.0f} tok/s" if p["tokens_per_second"] else "n/a"
            out.append(f"prefill: {tps} over uncached prompt tokens, fixed cost {ms(p['fixed_cost_s'])} (R² {p['r2']:.3f}, n={p['n']})")
        if "prefix_cache" in g:
            c = g["prefix_cache"]
            out.append(f"prefix cache: {c['share']:.0%} of prompt tokens served from cache ({c['cached_tokens']:,.0f}); prefill not spent "
                       f"{ms(c['prefill_saved_s'])} at the fitted rate, {ms(c['saved_per_request_s'])} per request")
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


def plot(groups: dict[str, Aggregate], report: dict[str, Any], path: str) -> None:
    """Per model and upstream: prefill seconds vs uncached prompt tokens with the fit, and seconds
    per output token vs requests in flight with the fit, over the fits' samples (matplotlib:
    `pip install '.[plot]'`)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'llm-latency-proxy[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * max(1, len(names))), squeeze=False)
    for row, name in enumerate(names):
        g, left, right = report[name], axes[row][0], axes[row][1]
        xs, ys = [x for x, _ in groups[name].samples["prefill"]], [y for _, y in groups[name].samples["prefill"]]
        left.scatter(xs, ys, s=8, alpha=0.6)
        if "prefill" in g and xs:
            p = g["prefill"]
            left.plot([0, max(xs)], [p["intercept"], p["intercept"] + p["slope"] * max(xs)], color="black",
                      label=f"{p['tokens_per_second'] or 0:,.0f} tok/s + {p['fixed_cost_s'] * 1000:.1f} ms (R² {p['r2']:.2f})")
            left.legend(loc="upper left")
        left.set(title=f"{name}: prefill", xlabel="uncached prompt tokens", ylabel="prefill seconds")
        cx, cy = [x for x, _ in groups[name].samples["decode"]], [1000 * y for _, y in groups[name].samples["decode"]]
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
