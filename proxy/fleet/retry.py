"""Retries on another replica, bounded: a route's retry budget, and what each attempt left behind.

Why a budget: a deadline that fails over is a retry, and retries multiply an outage. When every
replica slows at once (a fleet-wide incident), each request would miss its first-token deadline and
be sent again, doubling the load on replicas that are already slow. As Linkerd's and Envoy's retry
budgets do, a route's retries within the last `window_s` seconds are bounded by a share (`ratio`) of
its requests in that window, plus a floor (`min_per_s`) so that a quiet route can still fail over:
past it, a request keeps waiting on the replica it is on (its first-token limit still applies) and
is never sent twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .window import Window

RATIO, MIN_PER_S, WINDOW_S = 0.1, 3.0, 10.0  # the defaults: 10% of the route's requests, at least 3 a second, over 10 s
REASONS = ("connect_error", "broken", "status_5xx", "status_429", "deadline")  # why an attempt was abandoned


class FailOver(Exception):
    """The attempt is abandoned for another replica (the relay's control flow, never seen by a client)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BudgetSpec:
    ratio: float = RATIO
    min_per_s: float = MIN_PER_S
    window_s: float = WINDOW_S

    @classmethod
    def parse(cls, spec: Any, where: str) -> "BudgetSpec":
        """A route's `retry_budget: {ratio, min_per_second, window}` (each optional)."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict) or set(spec) - {"ratio", "min_per_second", "window", "__line__"}:
            raise ValueError(f"{where}: retry_budget must be {{ratio: 0.1, min_per_second: 3, window: 10}} (each optional)")
        values = {"ratio": spec.get("ratio", RATIO), "min_per_s": spec.get("min_per_second", MIN_PER_S), "window_s": spec.get("window", WINDOW_S)}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (name == "window_s" and value <= 0):
                raise ValueError(f"{where}: retry_budget's {name} must be a non-negative number, not {value!r}")
        return cls(float(values["ratio"]), float(values["min_per_s"]), float(values["window_s"]))


class RetryBudget:
    """Requests and retries over the last `window_s` seconds (window.py)."""

    __slots__ = ("spec", "window")

    def __init__(self, spec: BudgetSpec = BudgetSpec()) -> None:
        self.spec = spec
        self.window = Window(spec.window_s)  # [requests, retries] per second

    def request(self, now: float | None = None) -> None:
        """A request's first attempt on this route."""
        self.window.cell(time.monotonic() if now is None else now)[0] += 1

    def could_allow(self, now: float | None = None) -> bool:
        """Whether one more retry would fit now (nothing counted: the relay asks before it holds a stream)."""
        requests, retries = self.window.totals(time.monotonic() if now is None else now)
        return retries + 1 <= self.spec.min_per_s * self.spec.window_s + self.spec.ratio * requests

    def allow(self, now: float | None = None) -> bool:
        """Whether one more retry fits; if it does, it is counted."""
        now = time.monotonic() if now is None else now
        if not self.could_allow(now):
            return False
        self.window.cell(now)[1] += 1
        return True


@dataclass(frozen=True, slots=True)
class Attempt:
    """An abandoned attempt: which replica, why, and when it ran (monotonic ns); its trace span's id."""

    upstream: str
    reason: str
    start_ns: int
    end_ns: int
    span_id: int = 0
    host: str = ""
    port: int = 0
