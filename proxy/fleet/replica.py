"""One replica as the fleet knows it: the connection pool to it (upstream/pool.py), the requests on it now, and
what the fleet learned of it: whether it is set aside for failing (health.py), its predicted time to first token
(forecast.py), and what its prefix cache may hold (prefix.py). The picker chooses among replicas, a placement
sends to the one chosen through its pool, and the finished request teaches it (placement.py's `Lesson`).
"""
from __future__ import annotations

from ..upstream.pool import Pool
from .forecast import Forecast
from .health import Health
from .prefix import Index


class Replica:
    __slots__ = ("pool", "label", "in_flight", "forecast", "prefixes", "health", "caches", "engine_load", "engine_load_s")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.label = pool.label  # (the `upstream` label of its metrics, records and spans)
        self.in_flight = 0  # requests on it now (the picker weighs the least busy)
        self.forecast = Forecast()
        self.prefixes = Index()  # the prompts sent to it, as its prefix cache may hold them
        self.health = Health()  # (the router gives it the routes file's policy)
        self.caches = False  # it reported cached prompt tokens: its predicted hits may shorten a deadline (placement.py)
        self.engine_load = 0.0  # requests running and waiting as the engine reports them (checks.py's `metrics`)
        self.engine_load_s = 0.0  # when (monotonic s; 0: never)

    def load(self, now: float, fresh_s: float = 3.0) -> float:
        """Its requests in flight, or the engine's own count when it reported one lately and it is more (other proxies'
        requests on it too): what the picker weighs."""
        if self.engine_load_s and now - self.engine_load_s <= fresh_s and self.engine_load > self.in_flight:
            return self.engine_load
        return self.in_flight
