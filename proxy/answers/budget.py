"""What the records say about each service-level objective, for `explain`: attainment, the error
budget left, goodput, misses by objective and blamed phase; and capacity, the concurrency at which
the decode fit's time per token reaches the `tpot` objective.

Capacity from passive traffic: the decode fit is ITL ≈ α + β·c, with c the requests in flight when
a request began decoding; at the objective T the engine holds c* = (T - α) / β streams. A straight
line through one or two concurrency levels says little about a third, so the answer needs
`MIN_LEVELS` distinct levels with at least `MIN_PER_LEVEL` decoding requests each and a positive
slope; otherwise `streams` is None and `note` says why. c is what this proxy saw: several proxy
replicas in front of one engine each see their share of its streams (read them together, `--db`).
"""
from __future__ import annotations

import collections
from typing import Any, Iterable

from ..measure.slo import Objective
from ..records.aggregate import Aggregate, Judged

MIN_LEVELS = 3
MIN_PER_LEVEL = 3


def attainment(judged: Judged | None, objective: Objective | None) -> dict[str, Any]:
    """One SLO over a window's verdicts: judged, good, attainment, budget left, goodput, misses by blame."""
    judged = judged or Judged()
    misses: dict[str, collections.Counter[str]] = {}
    for (missed, blamed), n in judged.misses.items():
        misses.setdefault(missed, collections.Counter())[blamed] += n
    out: dict[str, Any] = {"judged": judged.judged, "good": judged.good, "bad": judged.judged - judged.good,
                           "attainment": judged.good / judged.judged if judged.judged else None,
                           "misses": {missed: dict(counts.most_common()) for missed, counts in sorted(misses.items())}}
    if judged.judged:
        seconds = judged.span.seconds
        out.update(goodput_rps=judged.good / seconds, throughput_rps=judged.judged / seconds, window_s=seconds)
    if objective is not None:
        out["target"] = objective.target
        out["objectives"] = objective.thresholds
        if judged.judged:  # 1: untouched, 0: spent, below 0: overspent, over the records' window (--since)
            out["budget_left"] = 1.0 - (out["bad"] / judged.judged) / objective.budget
    return out


def capacity(levels: dict[int, int], decode: dict[str, Any] | None, objective: Objective | None) -> dict[str, Any] | None:
    """{"tpot_s", "streams", "peak_streams"} for a model group with a tpot objective (None without one);
    `levels`: decoding requests per concurrency level they began decoding at."""
    if objective is None or objective.tpot is None:
        return None
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


def summary(groups: Iterable[Aggregate], objectives: tuple[Objective, ...]) -> dict[str, dict[str, Any]]:
    """Per SLO over every model it covers (the objectives file's, and any the records name), from a
    window's aggregates (by any dimensions: each objective's verdicts are summed over them)."""
    merged: dict[str, Judged] = {}
    for agg in groups:
        for name, judged in agg.slos.items():
            into = merged.setdefault(name, Judged())
            into.judged += judged.judged
            into.good += judged.good
            into.span.add(judged.span.start, judged.span.end)
            into.misses.update(judged.misses)
    names = [o.name for o in objectives] + sorted(set(merged) - {o.name for o in objectives})
    by_name = {o.name: o for o in objectives}
    return {name: attainment(merged.get(name), by_name.get(name)) for name in names}


def render(name: str, s: dict[str, Any]) -> list[str]:
    """Lines of the text report for one SLO."""
    if not s["judged"]:
        return [f"SLO {name}: no judged requests in this window"]
    target = f" (target {s['target']:.2%})" if "target" in s else ""
    budget = f", error budget left {s['budget_left']:.0%}" if "budget_left" in s else ""
    lines = [f"SLO {name}: {s['good']} of {s['judged']} good, attainment {s['attainment']:.2%}{target}{budget}; "
             f"goodput {s['goodput_rps']:.2f} req/s of {s['throughput_rps']:.2f} req/s"]
    for missed, blamed in s["misses"].items():
        total = sum(blamed.values())
        parts = ", ".join(f"{phase} {n / total:.0%}" for phase, n in blamed.items())
        lines.append(f"  {missed} misses: {total} ({parts})")
    return lines


def render_capacity(c: dict[str, Any]) -> str:
    head = f"capacity at tpot {c['tpot_s'] * 1000:g} ms: "
    if c["streams"] is None or "note" in c:
        value = f"{c['streams']:.1f} streams; " if c["streams"] is not None else ""
        return head + value + c.get("note", "")
    return head + (f"{c['streams']:.1f} concurrent streams (peak seen {c['peak_streams']}, headroom {c['headroom']:.1f}x; "
                   f"from {c['levels']} concurrency levels)")
