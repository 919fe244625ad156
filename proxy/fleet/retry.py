"""Retries on another replica, bounded: a route's retry budget, and what each attempt left behind.

Why a budget: a deadline that fails over is a retry, and retries multiply an outage. When every
replica slows at once (a fleet-wide incident), each request would miss its first-token deadline and
be sent again, doubling the load on replicas that are already slow. As Envoy's retry budget does, a
route's retries in flight are bounded by a share (`ratio`, Envoy's budget_percent: 20%) of its
requests in flight, plus a small floor (`min_concurrency`, Envoy's min_retry_concurrency: 3; Envoy
takes the larger of the two, this proxy their sum: a quiet route's burst fails over too): the bound grows with the load, so that a busy route can fail over as much as a quiet one
in proportion, and a fleet-wide slowdown adds at most that share. Past it, a request keeps waiting on
the replica it is on (its first-token limit still applies) and is never sent twice.

The budget is per route in each serving process: N workers (or pods) allow N times the floor, but
the share stays the share of what each process holds, so a fleet of proxies retries at most `ratio`
of its requests in flight, plus `min_concurrency` per process (docs/deployment.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RATIO, MIN_CONCURRENCY = 0.2, 3  # the defaults, Envoy's: 20% of the route's requests in flight, at least 3
REASONS = ("connect_error", "broken", "status_5xx", "status_429", "deadline", "stream_error", "silent", "pool_full")  # why an attempt was abandoned
BUSY = ("status_429", "deadline", "pool_full")  # of those, the replica's load, not its sickness (health.py's `busy`)


class FailOver(Exception):
    """The attempt is abandoned for another replica (the relay's control flow, never seen by a client)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BudgetSpec:
    ratio: float = RATIO
    min_concurrency: int = MIN_CONCURRENCY

    @classmethod
    def parse(cls, spec: Any, where: str) -> "BudgetSpec":
        """A route's `retry_budget: {ratio, min_concurrency}` (each optional)."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict) or set(spec) - {"ratio", "min_concurrency", "__line__"}:
            raise ValueError(f"{where}: retry_budget must be {{ratio: 0.2, min_concurrency: 3}} (each optional: retries in flight "
                             f"at most that share of the route's requests in flight, or that many)")
        ratio, floor = spec.get("ratio", RATIO), spec.get("min_concurrency", MIN_CONCURRENCY)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ValueError(f"{where}: retry_budget's ratio must be a share in [0, 1], not {ratio!r}")
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise ValueError(f"{where}: retry_budget's min_concurrency must be a whole number, not {floor!r}")
        return cls(float(ratio), floor)


class RetryBudget:
    """A route's requests and retries in flight in this process."""

    __slots__ = ("spec", "requests", "retries")

    def __init__(self, spec: BudgetSpec = BudgetSpec()) -> None:
        self.spec = spec
        self.requests = 0  # requests of the route in flight
        self.retries = 0  # of those, retried (each counted once, however many attempts it makes)

    def started(self) -> None:
        """A request's first attempt on this route."""
        self.requests += 1

    def ended(self, retried: bool) -> None:
        self.requests -= 1
        if retried:
            self.retries -= 1

    def could_allow(self) -> bool:
        """Whether one more retry would fit now (nothing counted: the relay asks before it holds a stream)."""
        return self.retries + 1 <= self.spec.min_concurrency + self.spec.ratio * self.requests

    def allow(self) -> bool:
        """Whether one more retry fits; if it does, it is counted until its request ends."""
        if not self.could_allow():
            return False
        self.retries += 1
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
