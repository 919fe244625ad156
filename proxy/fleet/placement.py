"""Which replica a request is on, and moving it to another: the relay's side of a route's retries.

The relay makes an attempt on the replica `use` placed the request on; when the attempt fails before
anything reached the client (a connect error, a 5xx or 429, an error the stream reported before its
first content, no first token or no answer by its deadline), `may_retry` says whether another
attempt is allowed (retries left, an untried replica the picker may use, the route's retry budget:
retry.py) and picks that replica, and `fail_over` abandons the attempt: its connection closed
(mid-body: aborted, so the engine frees the slot), the attempt kept on the record (its own trace
span, its time the phase `failover`), the request placed on the next replica. Each attempt also
tells its replica's judges: its forecast (forecast.py), whose pending prefill work holds the prompt
until the first token comes or the attempt ends (`settle`); its health (health.py), which hears one
verdict per attempt: a success at the first content token (or an answer that is not a failure), a
sick failure (the Retry-After a 503 asked for), a busy one (a 429, a missed deadline), or nothing (a
4xx, a client that left); and its prefix index (prefix.py), which holds the prompt once the replica
answered it, never on the strength of a send alone, and remembers a conversation away from a replica
that failed it. When the request finishes, its `Lesson` fits the forecast and checks the prefix index
against what the engine reported cached.

A deadline is based on the whole prompt unless the replica has confirmed that it caches (it reported
cached tokens): a cache no engine confirmed never shortens one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..measure.timing import now_ns
from ..wire.prompt import Chain
from .forecast import Forecast
from .picker import Picker
from .prefix import Use
from .retry import BUSY, Attempt

if TYPE_CHECKING:
    from .. import apis
    from ..measure.context import RequestContext
    from ..measure.telemetry import Telemetry
    from ..measure.timing import Breakdown, RequestTiming
    from ..upstream.connection import Connection
    from .replica import Replica
    from .routes import Router, Rule


def failed(t: RequestTiming) -> str:
    """How the request's last attempt ended for its replica: "sick" (a timeout, the proxy unable to reach or read
    it, a 5xx it answered, its stream broken or failed in-band), "busy" (a 429), "" (not its failure)."""
    if t.outcome == "timeout":
        return "sick"
    if t.outcome != "upstream_error":
        return ""
    if t.status_code == 429:
        return "busy"
    return "sick" if t.error or t.status_code >= 500 else ""


@dataclass(slots=True)
class Lesson:
    """What an attempt's replica learns when its request finishes (measure/telemetry.py tells it, measure/context.py's
    `Lesson`): its prefix index checked against what the engine reported cached, and its forecast fitted."""

    forecast: Forecast  # the replica's TTFT forecast (forecast.py)
    x: int  # that replica's pending prompt tokens and this prompt's uncached ones, when it was sent
    own: int  # of those, this prompt's (its uncached part as predicted: prefix.py)
    estimate: int  # this prompt's estimated tokens, cached or not (wire/prompt.py)
    use: Use | None  # its prompt on the replica's prefix index, for the check (prefix.py)
    deadline_x: int = 0  # x as a deadline reads it: the whole prompt, unless the replica confirmed its cache
    replica: Replica | None = None

    def finished(self, t: RequestTiming, b: Breakdown | None) -> None:
        self._checked(t)
        # The replica's server time to first token: a stream's, or the engine's own for a non-streaming answer
        # (its prefill reported: vLLM's metrics, llama.cpp's timings, Ollama's); a non-streaming answer's
        # time alone says nothing of its first token (its decode is in it), so it is no sample.
        if b is not None and t.outcome == "ok" and "prefill" in b.phases:
            self.forecast.add(self.x, sum(b.phases.get(p, 0.0) for p in ("queue", "load", "reasoning", "prefill")))

    def _checked(self, t: RequestTiming) -> None:
        """What the engine reported cached: the replica's prefix index checked against it (prefix.py; its prediction
        counted beside it on the record, in the engine's tokens), and the forecast's point made of the prompt it really
        prefilled."""
        use, cached, prompt = self.use, t.cached_prompt_tokens, t.prompt_tokens
        if cached is None or not prompt or t.outcome != "ok":
            return  # (unchecked: the index is trusted, and the fit's point is its prediction)
        if cached and self.replica is not None:
            self.replica.caches = True  # (from now on its predicted hits may shorten a deadline)
        share = min(1.0, cached / prompt)
        self.x += round(self.estimate * (1 - share)) - self.own
        if use is not None and use.prompt.total:
            t.prefix_predicted_tokens = min(prompt, round(use.predicted * prompt / use.prompt.total))
            t.prefix_stray = use.reported(round(share * use.prompt.total))


class Placement:
    __slots__ = ("router", "telemetry", "ctx", "rule", "prompt", "chain", "upstream", "tried", "next", "pending", "probe", "judged",
                 "retry_after", "lesson", "forced", "sent_s", "retried")

    def __init__(self, router: Router, telemetry: Telemetry, ctx: RequestContext, rule: Rule, prompt: int,
                 chain: Chain | None = None) -> None:
        self.router, self.telemetry, self.ctx, self.rule, self.prompt = router, telemetry, ctx, rule, prompt
        self.chain = chain  # the prompt as its replicas' prefix indexes see it (prefix.py; None: not indexed)
        self.upstream: Replica | None = None
        self.tried: tuple[str, ...] = ()  # the replicas abandoned, for another
        self.next: Replica | None = None  # the next attempt's replica, chosen with the retry
        self.pending = 0  # the prompt's tokens still counted in the replica's pending prefill work
        self.probe = False  # this attempt is its replica's probe (health.py)
        self.judged = False  # its replica's health heard this attempt's verdict
        self.retry_after: float | None = None  # what the replica's 429 or 503 asked for (s)
        self.lesson: Lesson | None = None  # what the attempt's replica learns at finish
        self.forced = False  # placed on a replica set aside (the route served it by force)
        self.sent_s = 0.0  # when this attempt was placed (monotonic s)
        self.retried = False  # a retry of this request is counted in flight on its route's budget

    def use(self, upstream: Replica) -> None:
        """The next attempt goes to `upstream`: counted in flight there, its prompt's uncached part (what the replica's
        prefix index holds of it, answered there before) in its pending work."""
        ctx = self.ctx
        self.upstream, ctx.server = upstream, (upstream.pool.host, upstream.pool.port)
        if ctx.upstream and ctx.upstream != upstream.label:
            self.telemetry.moved(ctx, upstream.label)
        if not self.tried:
            self.rule.budget.started()
        ctx.upstream = upstream.label
        upstream.in_flight += 1
        f, now, own, use = upstream.forecast, time.monotonic(), self.prompt, None
        if self.chain is not None:
            index, chain = upstream.prefixes, self.chain
            predicted = index.match(chain)
            unseen = chain.opening and predicted <= chain.shared  # (a conversation past its first turn, not seen there)
            use = Use(index, chain, predicted, Picker.rivals(self.router.replicas(self.rule), upstream, chain) if unseen else ())
            own = max(0, own - predicted)
        ctx.lesson = self.lesson = Lesson(f, f.pending + own, own, self.prompt, use, f.pending + (own if upstream.caches else self.prompt), upstream)
        f.pending += own
        f.last_s, f.sent = now, f.sent + 1
        self.pending, self.sent_s = own, now
        self.forced = not upstream.health.available(now)  # (set aside: the route served it by force)
        self.probe, self.judged, self.retry_after = upstream.health.sent(now), False, None

    def body(self, parsed: dict[str, Any] | None, original: bytes, route: apis.Route, inject_usage: bool) -> tuple[bytes, bool]:
        """This attempt's request body, and whether usage was asked for in it (a stream, where this replica needs it)."""
        upstream, dialect = self.upstream, route.dialect
        assert upstream is not None
        if (parsed is not None and self.ctx.timing.stream and inject_usage and dialect.injects_usage and not upstream.pool.reports_counts
                and not upstream.pool.rejects_stream_options):
            new_body = dialect.inject(route.endpoint, parsed, original)
            if new_body is not None:
                return new_body, True
        return original, False

    def deadline_s(self) -> float | None:
        """This attempt's first-token deadline: the route's, or a margin over what its replica is expected to take
        for this prompt with the work ahead of it (forecast.py), whichever is later; None: the route has none."""
        deadline, lesson = self.rule.first_token_deadline, self.lesson
        if deadline is None or lesson is None:  # (no route deadline, or not placed yet: `use` sets both)
            return None
        return lesson.forecast.deadline_s(deadline, lesson.deadline_x)

    def watch_s(self) -> float | None:
        """How long this attempt's replica may go without a sign of working before the attempt leaves it: the active
        checks' interval and timeout (checks.py); None: no checks on it, nothing to go by."""
        upstream = self.upstream
        return self.router.checks.window_s if upstream is not None and upstream.health.checked else None

    def silent(self, now: float, interval_s: float) -> bool:
        """This attempt's replica has shown no sign of working since it was sent (no check passed, no first token, no
        answer), and had the time to (`interval_s`: a check's interval and timeout), or a check failed since: a
        request that came whole (not a stream) and has no answer yet is on a replica that may be wedged."""
        upstream = self.upstream
        if upstream is None:
            return False
        health = upstream.health
        return health.alive_s < self.sent_s and (health.check_failed_s >= self.sent_s or now - self.sent_s >= interval_s)

    def settle(self) -> None:
        """Its prompt no longer waits on the replica (the first token came, or the attempt ended)."""
        if self.pending and self.upstream is not None:
            self.upstream.forecast.pending -= self.pending
            self.pending = 0

    def first_token(self) -> None:
        """The attempt's first content token: its prompt prefilled, and the replica serves (the pump tells)."""
        self.settle()
        self._judge("")

    def could_retry(self, budgeted: bool = True) -> bool:
        """Another attempt could follow this one now: retries left, a replica left to try, budget to spend if `budgeted`
        (nothing counted)."""
        rule, upstream = self.rule, self.upstream
        return (upstream is not None and len(self.ctx.timing.attempts) < rule.retries
                and self.router.could_retry(rule, (*self.tried, upstream.label)) and (not budgeted or self.retried or rule.budget.could_allow()))

    def may_retry(self, budgeted: bool = True) -> bool:
        """Retries left, an untried replica (chosen now), and, for a retry the budget bounds, the budget holds (counted
        when it does). The budget bounds the retries that add load: an attempt abandoned for being slow (a deadline, a
        silent replica) or refused for load (a 429, a full pool); a replica that failed at once (a refused connection, a
        5xx, an error in-band before content) did no work, and its outlier detection sets it aside."""
        rule, upstream = self.rule, self.upstream
        if upstream is None or len(self.ctx.timing.attempts) >= rule.retries:
            return False
        self.next = self.router.choose(rule, self.prompt, (*self.tried, upstream.label), chain=self.chain)
        if self.next is None or (budgeted and not (self.retried or rule.budget.allow())):
            return False
        self.retried = self.retried or budgeted
        return True

    def fail_over(self, reason: str, response: Connection | None) -> None:
        """The attempt abandoned for `self.next` (which `may_retry` chose)."""
        t, ctx, upstream, nxt = self.ctx.timing, self.ctx, self.upstream, self.next
        assert upstream is not None and nxt is not None
        now = now_ns()
        span_id = 0
        if ctx.spans is not None:  # (its span id went upstream as its traceparent; the next attempt gets its own)
            span_id, ctx.spans.upstream_id = ctx.spans.upstream_id, self.telemetry.tracing.new_span_id()
        t.attempts.append(Attempt(upstream.label, reason, t.issued_ns or now, now, span_id, upstream.pool.host, upstream.pool.port))
        if t.first_issued_ns is None:
            t.first_issued_ns = t.issued_ns or now
        self._judge("busy" if reason in BUSY else "sick")
        lesson = self.lesson
        if reason == "deadline" and lesson is not None and lesson.use is not None and lesson.use.predicted:
            lesson.use.index.forget(lesson.use.prompt)  # (a predicted hit that missed its deadline: evicted, likely)
        if response is not None:
            upstream.pool.release(response)  # mid-body: aborted
        upstream.in_flight -= 1
        self.settle()
        t.reset_upstream()
        t.status_code, t.outcome, t.error, t.engine, t.unmeasured, t.pool_full = 0, "ok", "", None, "", False
        self.tried, self.next = (*self.tried, upstream.label), None
        self.use(nxt)

    def finish(self) -> None:
        """The request ended: no longer in flight on its replica, which hears the last attempt's verdict."""
        self.rule.budget.ended(self.retried)
        if self.upstream is not None:
            self.upstream.in_flight -= 1
            self.settle()
            t = self.ctx.timing
            failure = failed(t)
            if failure:
                self.judged = self.judged and failure == "busy"  # (a stream that broke after its first token: a failure after all)
                self._judge(failure)
            elif t.outcome == "ok" and t.status_code < 400:
                self._judge("")
                if t.response_id:  # (a stored response: the requests that name it go where it lives)
                    self.router.held(t.response_id, self.upstream.label)
            elif not self.judged and self.upstream is not None:
                self.judged = True
                self.upstream.health.ended(self.probe)

    def _judge(self, failure: str) -> None:
        """The attempt's verdict, once, to its replica's health ("": it served; "sick"; "busy") and its prefix index: a
        prompt answered there is held there, a conversation failed there is remembered away from it."""
        upstream = self.upstream
        if self.judged or upstream is None:
            return
        self.judged = True
        now, health, chain = time.monotonic(), upstream.health, self.chain
        if failure == "busy":
            health.busy(now, self.probe, self.retry_after if upstream.pool.key is not None else None)
        elif failure:
            health.failed(now, self.probe, self.retry_after)
            if chain is not None and chain.session:
                upstream.prefixes.lost(chain)
        else:
            health.succeeded(now, self.probe, self.forced)
            if chain is not None:
                upstream.prefixes.sent(chain)
