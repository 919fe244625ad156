"""Active health checks: each replica of a route of several, checked off the user path, on an interval.

A replica that accepts and never answers (an engine wedged behind a live API server, a node gone
without a reset) fails no request quickly: its requests wait. Outlier detection (health.py) hears of
it only when a request gives up, separately in every process, and its probe back is a user's request.
So, as Envoy's active health checking does, every serving process checks every replica of its routes
of several every `interval` seconds: `GET path` (the engine's health endpoint: vLLM's, SGLang's and
llama.cpp's `/health`, which fail when the engine is dead), and with `generate: true` a one-token
chat completion of the route's first model (what a wedged engine cannot answer). A check that takes
longer than `timeout`, cannot connect or answers a 5xx fails; anything else passes (a 429 is a busy
replica, alive; a 404 a server without that path, alive). `unhealthy` failed in a row set the replica
aside until one passes (and its prefix index is cleared: a replica back from failing its checks is
an engine restarted, its cache empty); a replica set aside for failing requests comes back when its
time is up and its next check passes, never on a user's request. The relay also reads the checks' verdicts while a
request waits for its first byte (placement.py's `silent`): a replica that has shown no sign of
working since the request was sent is left for another.

The routes file's `health_check:` (each key optional; `off` turns them off):
`{path: /health, interval: 1, timeout: 1, unhealthy: 2, generate: false}`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import orjson

from ..errors import ProxyError, TransportError
from ..measure.timing import RequestTiming, now_ns
from .health import policy

if TYPE_CHECKING:
    from .replica import Replica

log = logging.getLogger("llmproxy.checks")

KEYS = ("path", "interval", "timeout", "unhealthy", "generate", "metrics")
QUEUE_GAUGES = {b"vllm:num_requests_running": 0, b"vllm:num_requests_waiting": 1,  # (0: running, 1: waiting)
                b"sglang:num_running_reqs": 0, b"sglang:num_queue_reqs": 1}
BODY_LIMIT = 64 * 1024  # a check's answer read at most (then the connection is let go)
METRICS_LIMIT = 4 * 1024 * 1024  # an engine's metrics page read at most


@dataclass(frozen=True)
class CheckSpec:
    path: str = "/health"
    interval_s: float = 1.0
    timeout_s: float = 1.0
    unhealthy: int = 2
    generate: bool = False
    metrics: str = ""  # a path of the engine's Prometheus metrics: its queue read at each check (vLLM's, SGLang's /metrics)
    enabled: bool = True

    @property
    def window_s(self) -> float:
        """How long a replica may go without a check's verdict: an interval and a timeout."""
        return self.interval_s + self.timeout_s

    @classmethod
    def parse(cls, spec: Any, where: str) -> "CheckSpec":
        spec = policy(spec, where, "health_check", KEYS)
        if not isinstance(spec, dict):
            return cls(enabled=spec)
        path = spec.get("path", cls.path)
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{where}: health_check's path must start with /, not {path!r}")
        values: dict[str, Any] = {"path": path}
        for key, name in (("interval", "interval_s"), ("timeout", "timeout_s")):
            value = spec.get(key, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}: health_check's {key} must be a number of seconds above 0, not {value!r}")
            values[name] = float(value)
        unhealthy, generate = spec.get("unhealthy", cls.unhealthy), spec.get("generate", cls.generate)
        if isinstance(unhealthy, bool) or not isinstance(unhealthy, int) or unhealthy < 1:
            raise ValueError(f"{where}: health_check's unhealthy must be a whole number above 0, not {unhealthy!r}")
        if not isinstance(generate, bool):
            raise ValueError(f"{where}: health_check's generate must be true or false, not {generate!r}")
        metrics = spec.get("metrics", "")
        if not isinstance(metrics, str) or (metrics and not metrics.startswith("/")):
            raise ValueError(f"{where}: health_check's metrics must be a path starting with /, not {metrics!r}")
        return cls(**values, unhealthy=unhealthy, generate=generate, metrics=metrics)


class Checker:
    """Checks the replicas the router names (`check_targets()`: replica, a model to generate with), each at most once
    at a time, under the router's `checks` policy as it is at each round (a reload changes both)."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.running: dict[str, asyncio.Task[None]] = {}
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self.task, *self.running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            spec = self.router.checks
            for replica, model in self.router.check_targets():
                running = self.running.get(replica.label)
                if running is None or running.done():
                    self.running[replica.label] = asyncio.create_task(self.check(replica, model, spec))
            await asyncio.sleep(spec.interval_s if spec.enabled else 5.0)

    @staticmethod
    async def queue(replica: Replica, spec: CheckSpec) -> None:
        """The engine's own queue (`metrics`): what every proxy in front of it sent, not only this one's."""
        try:
            answer = await fetch(replica, "GET", spec.metrics, b"", spec.timeout_s, METRICS_LIMIT)
        except ProxyError:
            return
        queue = queue_of(answer[1]) if answer is not None and answer[0] < 400 else None
        if queue is not None:
            replica.engine_load, replica.engine_load_s = queue[0] + queue[1], time.monotonic()

    async def check(self, replica: Replica, model: str, spec: CheckSpec) -> None:
        """One check of one replica, its verdict told to its health."""
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}) \
            if spec.generate and model else b""
        try:
            answer = await fetch(replica, "POST" if body else "GET", "/v1/chat/completions" if body else spec.path, body, spec.timeout_s)
        except ProxyError:  # (the proxy's own pool to it full: no verdict on the replica)
            return
        passed = answer is not None and answer[0] < 500
        if passed and spec.metrics:
            await self.queue(replica, spec)
        health = replica.health
        down = health.check_failures >= spec.unhealthy
        health.check(time.monotonic(), passed, spec.unhealthy)
        if passed and down:  # (back from failing its checks: an engine restarted, its prefix cache empty)
            replica.prefixes.clear()
            replica.caches = False
            log.warning("upstream %s passes its health checks again: its prefix index cleared", replica.label)


async def fetch(replica: Replica, method: str, path: str, body: bytes, timeout_s: float, limit: int = BODY_LIMIT) -> tuple[int, bytes] | None:
    """One request to one of the replica's paths, off the user path: (status, body up to `limit`); None: no answer in
    time, or none at all (ProxyError: the proxy's own pool is full, no verdict)."""
    pool = replica.pool
    headers = [(b"host", pool.host_header.encode()), (b"content-length", str(len(body)).encode()), (b"user-agent", b"llm-latency-proxy-check")]
    if body:
        headers.append((b"content-type", b"application/json"))
    if pool.key:
        headers.append((b"authorization", b"Bearer " + pool.key))
    connection = None
    try:
        async with asyncio.timeout(timeout_s):
            connection = await pool.send(method, pool.target(path, b""), headers, body, RequestTiming(received_ns=now_ns()))
            parts, size = [], 0
            while size < limit and (part := await connection.read()):
                parts.append(part)
                size += len(part)
            return connection.status, b"".join(parts)
    except (TimeoutError, TransportError, OSError):
        return None
    finally:
        if connection is not None:
            pool.release(connection)


def queue_of(text: bytes) -> tuple[float, float] | None:
    """(running, waiting) requests an engine's Prometheus text reports (vLLM's or SGLang's gauges, summed over their
    series); None: neither is there."""
    found = [0.0, 0.0]
    seen = False
    for line in text.splitlines():
        if not (line.startswith(b"vllm:") or line.startswith(b"sglang:")):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        slot = QUEUE_GAUGES.get(name)
        if slot is None:
            continue
        try:
            found[slot] += float((line.rsplit(b"}", 1)[1] if b"}" in line else line.split(b" ", 1)[1]).split()[0])
            seen = True
        except (ValueError, IndexError):
            continue
    return (found[0], found[1]) if seen else None


def targets(routes: Iterable[Any], upstreams: dict[str, Replica]) -> list[tuple[Replica, str]]:
    """The replicas of routes of several (a route of one has nowhere else to send), each once, with the first exact
    model name of a route it serves (for a generation check)."""
    out: dict[str, tuple[Replica, str]] = {}
    for rule in routes:
        if len(rule.upstreams) < 2:
            continue
        model = next((m for m in rule.models if not any(c in m for c in "*?[")), "")
        for name in rule.upstreams:
            if name not in out or (model and not out[name][1]):
                out[name] = (upstreams[name], model)
    return list(out.values())
