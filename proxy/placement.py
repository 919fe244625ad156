"""Which replica a request is on, and moving it to another: the relay's side of a route's retries.

The relay makes an attempt on the replica `use` placed the request on; when the attempt fails before
anything reached the client (a connect error, a 5xx or 429, no first token by the route's deadline),
`may_retry` says whether another attempt is allowed (retries left, an untried replica, the route's
retry budget: retry.py) and picks that replica, and `fail_over` abandons the attempt: its connection
closed (mid-body: aborted, so the engine frees the slot), the attempt kept on the record (its own
trace span, its time the phase `failover`), the request placed on the next replica. Each placement
also keeps the replica's forecast (forecast.py) honest: the prompt counts in its pending prefill
work until the first token comes or the attempt ends (`settle`).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .retry import Attempt
from .timing import now_ns

if TYPE_CHECKING:
    from . import apis
    from .connection import Connection
    from .routes import Router, Rule
    from .context import RequestContext
    from .telemetry import Telemetry
    from .upstream import Upstream


class Placement:
    __slots__ = ("router", "telemetry", "ctx", "rule", "prompt", "upstream", "tried", "next", "pending")

    def __init__(self, router: Router, telemetry: Telemetry, ctx: RequestContext, rule: Rule, prompt: int) -> None:
        self.router, self.telemetry, self.ctx, self.rule, self.prompt = router, telemetry, ctx, rule, prompt
        self.upstream: Upstream | None = None
        self.tried: tuple[str, ...] = ()  # the replicas abandoned, for another
        self.next: Upstream | None = None  # the next attempt's replica, chosen with the retry
        self.pending = 0  # the prompt's tokens still counted in the replica's pending prefill work

    def use(self, upstream: Upstream) -> None:
        """The next attempt goes to `upstream`: counted in flight there, its prompt in its pending work."""
        ctx = self.ctx
        self.upstream, ctx.server = upstream, (upstream.host, upstream.port)
        if ctx.upstream and ctx.upstream != upstream.label:
            self.telemetry.moved(ctx, upstream.label)
        ctx.upstream = upstream.label
        upstream.in_flight += 1
        f = upstream.forecast
        ctx.forecast, ctx.forecast_x = f, f.pending + self.prompt
        f.pending += self.prompt
        f.last_s = time.monotonic()
        self.pending = self.prompt

    def body(self, parsed: dict[str, Any] | None, original: bytes, route: apis.Route, inject_usage: bool) -> tuple[bytes, bool]:
        """This attempt's request body, and whether usage was asked for in it (a stream, where this replica needs it)."""
        upstream, dialect = self.upstream, route.dialect
        assert upstream is not None
        if (parsed is not None and self.ctx.timing.stream and inject_usage and dialect.injects_usage and not upstream.reports_counts
                and not upstream.rejects_stream_options):
            new_body = dialect.inject(route.endpoint, parsed, original)
            if new_body is not None:
                return new_body, True
        return original, False

    def settle(self) -> None:
        """Its prompt no longer waits on the replica (the first token came, or the attempt ended)."""
        if self.pending and self.upstream is not None:
            self.upstream.forecast.pending -= self.pending
            self.pending = 0

    def may_retry(self) -> bool:
        """Retries left, an untried replica (chosen now), and the budget holds (counted when it does)."""
        rule, upstream = self.rule, self.upstream
        if upstream is None or len(self.ctx.timing.attempts) >= rule.retries:
            return False
        self.next = self.router.choose(rule, self.prompt, (*self.tried, upstream.label))
        return self.next is not None and rule.budget.allow()

    def fail_over(self, reason: str, response: Connection | None) -> None:
        """The attempt abandoned for `self.next` (which `may_retry` chose)."""
        t, ctx, upstream, nxt = self.ctx.timing, self.ctx, self.upstream, self.next
        assert upstream is not None and nxt is not None
        now = now_ns()
        span_id = 0
        if ctx.spans is not None:  # (its span id went upstream as its traceparent; the next attempt gets its own)
            span_id, ctx.spans.upstream_id = ctx.spans.upstream_id, self.telemetry.tracing.new_span_id()
        t.attempts.append(Attempt(upstream.label, reason, t.issued_ns or now, now, span_id, upstream.host, upstream.port))
        if t.first_issued_ns is None:
            t.first_issued_ns = t.issued_ns or now
        if reason == "deadline":  # (at least this long: a stuck replica's forecast learns it, so picking by speed leaves it)
            upstream.forecast.add(ctx.forecast_x, (now - (t.issued_ns or now)) / 1e9)
        if response is not None:
            upstream.release(response)  # mid-body: aborted
        upstream.in_flight -= 1
        self.settle()
        t.reset_upstream()
        t.status_code, t.outcome, t.error, t.engine, t.unmeasured, t.pool_full = 0, "ok", "", None, "", False
        self.tried, self.next = (*self.tried, upstream.label), None
        self.use(nxt)

    def finish(self) -> None:
        """The request ended: no longer in flight on its replica."""
        if self.upstream is not None:
            self.upstream.in_flight -= 1
            self.settle()
