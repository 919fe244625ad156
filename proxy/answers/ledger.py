"""`explain --by tenant`: whose requests are slow, and whose traffic spends the error budget.

Per tenant (tenants.py), from the rollup alone (exact counts and sums, never a record read one by
one): its requests and outcomes; its mean successful request split as the background reading
splits it, Total ≈ Prefill(L_in) + Decode(L_out), with the seconds of every phase (they add up to
its mean end to end) and its mean prompt and output tokens, so that whose prompts are long, whose
outputs are long and whose requests queue reads off one line; TTFT and end-to-end percentiles from
the Prometheus histograms' buckets; and per objective its verdicts, its own attainment, the share of
the objective's whole error budget its misses spent, and the phases they were blamed on. Means, not
medians: means add up (the phases to the request, the tenants to the fleet), which is what a bill
and a budget need.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..measure.slo import Objective
from ..records import Backend
from ..records import columns as C
from ..records.aggregate import Aggregate, read
from ..records.sql import Window
from . import budget

BY = ("tenant",)
SPLIT = ("client", "proxy", "lag", "failover", "wait", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server")
LONG = 2.0  # a tenant's mean this many times the others' is "long" (or "queues") in the diagnosis
NOTE = ("means over successful requests from the aggregates (exact; they add up); percentiles within the Prometheus histograms' "
        "buckets (as histogram_quantile); budget_spent: the share of the objective's whole error budget over the window "
        "(all tenants' judged requests x (1 - target)) this tenant's misses spent")


def gather(stores: Iterable[Backend], window: Window = Window()) -> dict[str, Aggregate]:
    """Per tenant, one or more stores' aggregates (from the rollup, whose tenant a replica of store
    version 2 left at its default, `unknown`)."""
    return {tenant: agg for (tenant,), agg in sorted(read(list(stores), BY, window, histograms=False).items())}


def mean(agg: Aggregate) -> dict[str, Any] | None:
    """The mean successful request: seconds per phase, TTFT, end to end, prompt and output tokens."""
    if not agg.known:
        return None
    phases = {p: agg.sums[f"{p}_sum"] / agg.known for p in SPLIT if agg.sums[f"{p}_sum"]}
    n_prefill, sum_uncached = agg.fits["prefill"][0], agg.fits["prefill"][1]
    return {"e2e_s": agg.sums["e2e_sum"] / agg.known, "ttft_s": agg.sums["ttft_sum"] / agg.streams if agg.streams else None,
            "phases_s": phases, "prompt_tokens": agg.sums["prompt"] / agg.known,
            "uncached_prompt_tokens": sum_uncached / n_prefill if n_prefill else None, "output_tokens": agg.completion / agg.ok if agg.ok else None}


def report(groups: dict[str, Aggregate], objectives: tuple[Objective, ...] = ()) -> dict[str, Any]:
    """One entry per tenant (the JSON of `explain --by tenant --json`)."""
    by_name = {o.name: o for o in objectives}
    judged_all: dict[str, int] = {}
    for agg in groups.values():
        for name, judged in agg.slos.items():
            judged_all[name] = judged_all.get(name, 0) + judged.judged
    out: dict[str, Any] = {}
    for tenant, agg in groups.items():
        entry: dict[str, Any] = {"requests": agg.requests, "ok": agg.ok, "streams": agg.streams, "outcomes": dict(agg.outcomes.most_common())}
        entry["mean"] = mean(agg)
        refused = agg.outcomes.get("overloaded", 0)  # (admission.py: over its share at --max-in-flight, or a wait that ran out)
        entry["admission"] = {"refused": refused, "refused_share": refused / agg.requests if agg.requests else None,
                              "wait_s_mean": agg.sums["wait_sum"] / agg.known if agg.known else None}
        entry["percentiles"] = {f"{name}_s": {f"p{round(q * 100)}": agg.summary_quantile(name, q) for q in (0.5, 0.99)}
                                for name in C.SUMMARY_BOUNDS}
        slos: dict[str, Any] = {}
        for name, judged in sorted(agg.slos.items()):
            objective = by_name.get(name)
            s = budget.attainment(judged, objective)
            allowed = judged_all.get(name, 0) * (objective.budget if objective is not None else 0.0)
            s["budget_spent"] = s["bad"] / allowed if allowed else None
            slos[name] = s
        entry["slo"] = slos
        blamed: dict[str, int] = {}
        for s in slos.values():
            for counts in s["misses"].values():
                for phase, n in counts.items():
                    blamed[phase] = blamed.get(phase, 0) + n
        entry["blamed"] = dict(sorted(blamed.items(), key=lambda item: -item[1]))
        out[tenant] = entry
    for tenant, entry in out.items():
        entry["diagnosis"] = diagnosis(tenant, entry, [e for t, e in out.items() if t != tenant])
    return {tenant: {**entry, "method": NOTE} for tenant, entry in out.items()}


def _others(others: list[dict[str, Any]], figure: Any) -> float | None:
    """The other tenants' mean of a figure, weighted by their ok requests."""
    pairs = [(figure(e["mean"]), e["ok"]) for e in others if e["mean"] is not None and figure(e["mean"]) is not None and e["ok"]]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else None


def diagnosis(tenant: str, entry: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """What sets this tenant apart: what its misses are blamed on, and which of its means is far above the others'."""
    lines = []
    misses = sum(entry["blamed"].values())
    if misses:
        phase, n = next(iter(entry["blamed"].items()))
        spent = [f"{s['budget_spent']:.0%} of {name}'s budget" for name, s in entry["slo"].items() if s.get("budget_spent")]
        lines.append(f"{tenant}: {misses} misses, {n / misses:.0%} blamed on {phase}" + (f"; spent {', '.join(spent)}" if spent else ""))
    m = entry["mean"]
    if m is None:
        return lines
    for label, figure, unit in (("prompts are long", lambda x: x["prompt_tokens"], "prompt tokens"),
                              ("outputs are long", lambda x: x["output_tokens"], "output tokens"),
                              ("requests queue", lambda x: x["phases_s"].get("queue", 0.0) + x["phases_s"].get("wait", 0.0), "s queued")):
        mine, theirs = figure(m), _others(others, figure)
        if mine and theirs is not None and mine > LONG * theirs and (unit != "s queued" or mine > 0.05):
            lines.append(f"{tenant}: {label}: mean {mine:,.{2 if unit == 's queued' else 0}f} {unit} vs {theirs:,.{2 if unit == 's queued' else 0}f} "
                         "for the other tenants")
    return lines


def render(tenants: dict[str, Any]) -> str:
    """The text report: one block per tenant."""
    s = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"  # noqa: E731
    out = [f"(by tenant: {NOTE})", ""] if tenants else ["no requests in this window"]
    for tenant, e in tenants.items():
        failed = ", ".join(f"{o} {n}" for o, n in e["outcomes"].items() if o != "ok")
        out.append(f"== tenant {tenant}: {e['requests']} requests, {e['ok']} ok, {e['streams']} streamed" + (f"; {failed}" if failed else ""))
        m = e["mean"]
        if m is not None:
            phases = m["phases_s"]
            total = sum(phases.values()) or 1.0
            out.append(f"mean request: {s(m['e2e_s'])} = " + " + ".join(f"{p} {s(v)} ({v / total:.0%})" for p, v in
                                                                       sorted(phases.items(), key=lambda item: -item[1]) if v / total >= 0.005))
            uncached = f" ({m['uncached_prompt_tokens']:,.0f} uncached)" if m["uncached_prompt_tokens"] is not None else ""
            output = f"{m['output_tokens']:,.0f}" if m["output_tokens"] is not None else "n/a"
            out.append(f"L_in {m['prompt_tokens']:,.0f} prompt tokens{uncached}, L_out {output} output tokens; TTFT mean {s(m['ttft_s'])}")
        a = e["admission"]
        if a["refused"] or a["wait_s_mean"]:
            out.append(f"admission: {a['refused']} refused by the proxy ({a['refused_share']:.1%}: 503 proxy_overloaded), "
                       f"mean wait for a slot or a connection {s(a['wait_s_mean'])} per ok request")
        p = e["percentiles"]
        out.append(f"TTFT p50 {s(p['ttft_s']['p50'])}, p99 {s(p['ttft_s']['p99'])}; end to end p50 {s(p['e2e_s']['p50'])}, "
                   f"p99 {s(p['e2e_s']['p99'])}")
        for name, slo in e["slo"].items():
            lines = budget.render(name, slo)
            if slo.get("budget_spent") is not None:
                lines[0] += f"; spent {slo['budget_spent']:.1%} of the objective's budget"
            out.extend(lines)
        out.extend(f"> {line}" for line in e["diagnosis"])
        out.append("")
    return "\n".join(out)
