"""`explain` as it was before the store counted (main at d5554fc): every record of the window
loaded and read in Python. Kept, unchanged but for its imports, as the oracle the store's answers are
checked against (tests/test_aggregate.py): the same records through both must give the same report."""
from __future__ import annotations

import collections
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from proxy.answers.explain import diagnosis, roofline
from proxy.measure.slo import Objective

PHASES = ("client", "wait", "network", "tokenize", "queue", "load", "prefill", "reasoning", "decode", "server", "proxy", "lag")  # (wait: the proxy's own pool wait, a phase since records had it; lag: since store level 6)
MAX_PAIRS_POINTS = 300  # points sampled for the pairwise slopes (45,000 pairs)
MIN_LEVELS = 3
MIN_PER_LEVEL = 3


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
    cached = sum(float(r.get("cached_prompt_tokens") or 0) for r in streams if r.get("prompt_tokens") is not None and "prefill" in r["phases_s"])
    if prefill is not None and prefill.slope > 0 and cached > 0:  # (added with the prefix cache's figure: issue 47)
        report["prefix_cache"] = {"cached_tokens": cached, "share": cached / (cached + sum(xs)), "prefill_saved_s": cached * prefill.slope,
                                  "saved_per_request_s": cached * prefill.slope / len(xs)}
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
        report["slo"] = {"name": name, **attainment(records, name, objective)}
        cap = capacity(streams, report.get("decode"), objective)
        if cap is not None:
            report["capacity"] = cap
    report["diagnosis"] = diagnosis(report)
    return report


def explain(records: list[dict[str, Any]], hardware: dict[str, float] | None = None,
            objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], r.get("upstream", "")), []).append(r)
    return {f"{model} @ {upstream}": analyse_group(rs, hardware, objectives) for (model, upstream), rs in sorted(groups.items())}


def _span_s(records: list[dict[str, Any]]) -> float:
    start = min(r["received_unix_ns"] for r in records)
    end = max(r["received_unix_ns"] + r["duration_s"] * 1e9 for r in records)
    return max(1e-9, (end - start) / 1e9)


def attainment(records: list[dict[str, Any]], name: str, objective: Objective | None) -> dict[str, Any]:
    """One SLO over these records: judged, good, attainment, budget left, goodput, misses by blame."""
    judged = [r for r in records if r.get("slo") == name and r.get("slo_good") is not None]
    good = sum(1 for r in judged if r["slo_good"])
    misses: dict[str, collections.Counter[str]] = {}
    for r in judged:
        for missed, blamed in (r.get("slo_blame") or {}).items():
            misses.setdefault(missed, collections.Counter())[blamed] += 1
    out: dict[str, Any] = {"judged": len(judged), "good": good, "bad": len(judged) - good,
                           "attainment": good / len(judged) if judged else None,
                           "misses": {missed: dict(counts.most_common()) for missed, counts in sorted(misses.items())}}
    if judged:
        seconds = _span_s(judged)
        out.update(goodput_rps=good / seconds, throughput_rps=len(judged) / seconds, window_s=seconds)
    if objective is not None:
        out["target"] = objective.target
        out["objectives"] = objective.thresholds
        if judged:  # 1: untouched, 0: spent, below 0: overspent, over the records' window (--since)
            out["budget_left"] = 1.0 - (out["bad"] / len(judged)) / objective.budget
    return out


def capacity(decoding: list[dict[str, Any]], decode: dict[str, Any] | None, objective: Objective | None) -> dict[str, Any] | None:
    """{"tpot_s", "streams", "peak_streams"} for a model group with a tpot objective (None without one)."""
    if objective is None or objective.tpot is None:
        return None
    levels = collections.Counter(r["in_flight_at_decode"] for r in decoding if r.get("decode_tokens_per_second") and r.get("in_flight_at_decode"))
    used = sorted(level for level, n in levels.items() if n >= MIN_PER_LEVEL)
    out: dict[str, Any] = {"tpot_s": objective.tpot, "streams": None, "peak_streams": max(levels) if levels else None, "levels": len(used)}
    if len(used) < MIN_LEVELS:
        out["note"] = (f"needs decoding requests at {MIN_LEVELS} or more concurrency levels ({MIN_PER_LEVEL} or more each); "
                       f"seen at {len(used)}{' (' + ', '.join(map(str, used)) + ')' if used else ''}")
        return out
    if decode is None or "slope" not in decode or decode["slope"] <= 0:
        out["note"] = "time per token does not grow with concurrency here: no limit can be read off the fit"
        return out
    streams = (objective.tpot - decode["intercept"]) / decode["slope"]
    out["streams"] = max(0.0, streams)
    if streams < 1:
        out["note"] = "the objective is missed even at one stream: decode is too slow for it"
    elif out["peak_streams"]:
        out["headroom"] = streams / out["peak_streams"]
    return out


def summary(records: list[dict[str, Any]], objectives: tuple[Objective, ...]) -> dict[str, dict[str, Any]]:
    """Per SLO over every model it covers (the objectives file's, and any the records name)."""
    names = [o.name for o in objectives] + sorted({r["slo"] for r in records if r.get("slo")} - {o.name for o in objectives})
    by_name = {o.name: o for o in objectives}
    return {name: attainment(records, name, by_name.get(name)) for name in names}
