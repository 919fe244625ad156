"""The relay: one request in, an upstream exchange (on a route with retries, one per replica tried
until one answers: placement.py), bytes out as they arrive. The hot path.

API-agnostic: the request path resolves to a route of one dialect (`proxy/apis/`), which reads
the request and says what each event means. Each attempt's response goes out through a `Reply`
(reply.py), whose pump (pump.py) timestamps each upstream read, forwards it untouched, then hands
a copy to the response's `Reader` (reader.py: decode, frame, note content chunks). It builds no
metric, span or log: `Telemetry.finish` does that once, from the request's context, in `run`'s one
`finally`. Only when the proxy injected usage (or strips engine fields) does it forward per SSE
event, to drop what the client did not ask for; it then asks the upstream for identity encoding,
and if the upstream compresses anyway, the client gets the decoded stream. A stream or body that
cannot be decoded or framed (an event past `--max-event-bytes`) is relayed as it comes and counted
as unmeasured.

Attempts: a stream is held (nothing reaches the client before its first content token) only while
another attempt could follow it: a replica left to try and retry budget to spend. On a route with a
first-token deadline (the route's, or more for a prompt its replica is expected to take longer over:
forecast.py), when it passes, the attempt is abandoned if a retry is allowed then; if not, what was
held goes out at once and the rest as it comes. A held stream that reports an error before its first
content is abandoned the same way. A request with no first byte yet (an answer that comes whole: its
headers; a stream: its first token) on a replica that has shown no sign of working since it was
sent, by the active checks' verdicts (fleet/checks.py), is abandoned for another: a wedged replica
holds no request longer than a check's interval and timeout past the deadline. The first-token limit
(`first_token_timeout`) bounds the request across its attempts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from starlette.types import Receive, Scope, Send

from .. import apis
from ..config import Settings
from ..errors import ModelNotRouted, ProxyError, ProxyOverloaded, TransportError, UpstreamTimeout, map_transport_error
from ..fleet.health import retry_after_s
from ..fleet.placement import Placement
from ..fleet.retry import FailOver
from ..measure.context import RequestContext
from ..measure.timing import STAMPS, RequestTiming, note_slow_client, now_ns
from ..wire import prompt as shape
from ..wire.engine import from_llamacpp, from_vllm
from ..wire.text import MODEL_CHARS, storable
from .reply import Reply, options_rejected, without_options
from .request import ClientGone, check_request, read_body

if TYPE_CHECKING:
    from ..fleet.replica import Replica
    from ..fleet.routes import Router
    from ..measure.offload import Offload
    from ..measure.telemetry import Telemetry
    from ..upstream.connection import Connection
    from .admission import Admission
    from .tenants import Tenants

log = logging.getLogger("llmproxy.relay")


class AppView(Protocol):
    """What an Exchange needs from the application."""

    settings: Settings
    telemetry: Telemetry
    router: Router
    offload: Offload
    client_keys: tuple[str, ...]
    admission: Admission
    tenants: Tenants

    def upstream_headers(self, headers: list[tuple[bytes, bytes]], length: int, upstream: Replica, dialect: apis.Dialect,
                         identity: bool) -> list[tuple[bytes, bytes]]: ...


class Exchange:
    """One proxied request. Created per request; `run` is the whole ASGI response."""

    def __init__(self, app: AppView, scope: Scope, receive: Receive, send: Send) -> None:
        self.app, self.scope, self.receive, self.send = app, scope, receive, send
        # When the protocol read the request's first byte (server.py); another ASGI server: now.
        self.stamps: dict[str, Any] = scope.get("extensions", {}).get(STAMPS) or {"first_byte_ns": now_ns(), "body_end_ns": 0}
        received = self.stamps["first_byte_ns"]
        self.t = RequestTiming(received_ns=received)
        self.ctx = RequestContext(self.t, time.time_ns() - now_ns())  # the wall clock less the monotonic one
        self.relaying = False
        self.client_gone = False
        self.started = False  # http.response.start went to the client
        self.reply: Reply | None = None  # the attempt's response on its way to the client (reply.py)
        self.response: Connection | None = None
        self.place: Placement | None = None  # which replica of its route it is on (made once the body is parsed)
        self.task: asyncio.Task[Any] | None = None
        self.failing_over = ""  # why the attempt is abandoned ("": it is not)
        self.watch: asyncio.TimerHandle | None = None  # looks at the replica while no first byte came (`_on_watch`)
        self.holding = False  # this attempt's stream is held for its first token (another attempt may follow)
        self.first_token_by: float | None = None  # the first-token limit of the request, across its attempts (loop time)
        self.route = apis.OTHER  # what the path means: its API (dialect) and endpoint
        self.injected = False  # we asked for include_usage: drop the usage chunk, strip usage:null

    async def run(self) -> None:
        t, app = self.t, self.app
        task = self.task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        lost: set[Callable[[], None]] | None = self.stamps.get("lost")
        admitted, admission = False, app.admission
        try:
            # Who sent it, before anything can refuse it: a refused request is its tenant's too.
            t.tenant = app.tenants.tenant(self.scope["headers"], self.scope.get("query_string", b""))
            share = app.tenants.label(t.tenant)  # (whose share of --max-in-flight: admission.py)
            if not admission.try_enter(share):  # over its share at the cap: a 503 before the body is read, or a wait
                t.queued_ns = now_ns() if admission.queue_s else None
                try:
                    await admission.wait(share)
                finally:
                    t.admitted_ns = now_ns()
            admitted = True
            check_request(self.scope, app.client_keys)
            body = await read_body(self.scope, self.receive, app.settings, complete=bool(self.stamps["body_end_ns"]))
            t.body_end_ns = self.stamps["body_end_ns"] or now_ns()  # its last byte reached the socket
            t.body_seen_ns = self.stamps.get("body_seen_ns") or t.body_end_ns  # ... and the loop read it
            if lost is not None:  # the server's protocol calls these when the client's connection closes (server.py)
                lost.add(self._client_lost)
            else:  # (another ASGI server: a task waits on `receive` for http.disconnect)
                watcher = asyncio.create_task(self._watch())
            await self._relay(body)
        except ClientGone:
            t.outcome, t.status_code = "client_disconnect", t.status_code or 499
        except asyncio.CancelledError:
            if not self.client_gone:
                t.outcome, t.error = "proxy_error", t.error or "cancelled"  # the server is shutting down
                raise
            task.uncancel()
            t.outcome, t.status_code = "client_disconnect", t.status_code or 499
        except ProxyError as error:
            await self._fail(error)
        except MemoryError:
            await self._fail(ProxyOverloaded("memory", "out of memory"))
        except Exception:  # a bug of ours: the client gets a clean 500, the request is still finished
            log.exception("unexpected error while relaying")
            await self._fail(ProxyError("internal proxy error"))
        finally:
            if admitted:
                admission.leave(share)
            self.relaying = False
            if watcher is not None:
                watcher.cancel()
            elif lost is not None:
                lost.discard(self._client_lost)
            if t.response_end_ns is None:
                t.response_end_ns = now_ns()
            note_slow_client(t, self.stamps, self.response)
            if self.reply is not None and self.reply.pump is not None:
                self.reply.pump.discard()  # (a response still held when the request ended: its bytes leave the read-ahead)
            if self.place is not None and self.place.upstream is not None:
                self.place.finish()
                if self.response is not None:
                    self.place.upstream.pool.release(self.response)  # mid-body: aborts the connection (so vLLM stops) and frees its read-ahead
            app.telemetry.finish(self.ctx)
            self._let_go()

    def _let_go(self) -> None:
        """The request is over. What it built refers back to itself (the reply's callbacks, the pump's, the body
        writer held by the server's cycle): cut here, reference counting frees it all at once; left to the garbage
        collector, 40-odd objects a request were what its young collections walked (their CPU, their pauses)."""
        self._drop_reply()
        self.stamps.pop("writer", None)

    def _drop_reply(self) -> None:
        """The attempt's reply and response let go of (its pump and the reply refer to each other)."""
        if self.reply is not None:
            self.reply.pump = None
        self.response = self.reply = None

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self._client_lost()
                return

    def _client_lost(self) -> None:
        """The client's connection closed: the request is cancelled, unless it was done already. (The openai
        client may close the connection once it read [DONE], before the upstream's end of stream is relayed:
        that request finished normally.)"""
        if self.relaying and not (self.reply is not None and self.reply.reader is not None and self.reply.reader.done):
            self.client_gone = True
            if self.task is not None:
                self.task.cancel()

    async def _relay(self, body: bytes) -> None:
        t, app, ctx = self.t, self.app, self.ctx
        route = self.route = apis.resolve(self.scope["path"], self.scope.get("query_string", b""))
        dialect = route.dialect
        t.api, t.endpoint = dialect.name, route.endpoint  # type: ignore[assignment]
        parsed, ctx.prompt_parts = await app.offload.request(route, self.scope["path"], body)
        original = body
        if parsed is not None:
            model, t.stream = dialect.model_and_stream(route.endpoint, parsed)
            t.model = storable(model or route.model or "unknown", MODEL_CHARS)  # (sent on unchanged; measured storable)
        elif route.model:
            t.model = storable(route.model, MODEL_CHARS)
        if route.stream is not None:  # the path says (Gemini)
            t.stream = route.stream
        t.user = app.tenants.user(self.scope["headers"], parsed)
        partial = parsed is not None and parsed.get("_partial")  # (a big body's summary, made in the worker: offload.py)
        inline = (parsed["_media"] if partial else shape.media(shape.sequence(parsed))) if parsed is not None else (0, 0)
        rule, prompt = app.router.route(t.model), shape.tokens(len(body), inline)
        pin = app.router.named(route.endpoint, parsed, self.scope["path"])  # (a stored response lives on one replica)
        if pin and (rule is None or pin not in rule.upstreams):
            rule = app.router.pinned(pin)
        chain = None
        if rule is not None and parsed is not None and app.router.indexes(rule):
            chain = parsed.get("_chain") if partial else shape.chain(parsed, prompt)
        upstream = app.router.choose(rule, prompt, chain=chain, pin=pin) if rule is not None else None
        if rule is None or upstream is None:
            raise ModelNotRouted(f"the model `{t.model}` is not routed by this proxy (see its routing file)")
        self.place = Placement(app.router, app.telemetry, ctx, rule, prompt, chain)
        self.place.use(upstream)
        if parsed is not None:
            ctx.request, ctx.request_size = (None if partial else parsed), len(body)
        app.telemetry.start(ctx, self.scope["headers"])
        self.relaying = True
        await self._exchange(parsed, original)
        self.relaying = False  # the response is complete: a client closing now is not a disconnect
        reply = self.reply
        if reply is not None and reply.json_body:
            ctx.body = info = await app.offload.response(dialect.name, reply.json_body, reply.body_encoding)
            reply.json_body = None
            if info.undecodable:
                t.unmeasured = "undecodable"
            engine = info.engine or from_llamacpp(info.timings) or from_vllm(info.metrics)
            t.engine, t.response_id = engine or t.engine, info.ident or t.response_id
        if t.stream and t.engine is not None and t.engine.predicted_tokens is not None and t.engine.source == "llama.cpp":
            upstream.pool.reports_counts = True

    @property
    def upstream(self) -> Replica | None:
        """The replica the request is on now."""
        return self.place.upstream if self.place is not None else None

    async def _exchange(self, parsed: dict[str, Any] | None, original: bytes) -> None:
        """Attempts, each on another replica of the route, until one is not abandoned (retry.py)."""
        while True:
            assert self.place is not None
            body, self.injected = self.place.body(parsed, original, self.route, self.app.settings.inject_usage)
            # Where the proxy may rewrite a stream, it asks for one it can rewrite.
            headers = self.app.upstream_headers(self.scope["headers"], len(body), self.place.upstream, self.route.dialect,  # type: ignore[arg-type]
                                                self.injected or self.app.settings.strip_engine_fields)
            if self.ctx.spans is not None:
                headers.append((b"traceparent", self.ctx.spans.traceparent()))
            try:
                await self._attempt(body, original, headers)
                return
            except FailOver as why:
                if self.reply is not None and self.reply.pump is not None:
                    self.reply.pump.discard()
                self.place.fail_over(why.reason, self.response)
                self._drop_reply()
                self.failing_over = ""

    def _may_retry(self, budgeted: bool = True) -> bool:
        """Another attempt: nothing reached the client, which is still there, and the route gives one (placement.py)."""
        return not self.started and not self.client_gone and self.place is not None and self.place.may_retry(budgeted)

    def _on_deadline(self) -> None:
        """This attempt's first-token deadline, no content yet: abandon it if another attempt is allowed now;
        if not, nothing is held any longer (what was goes out now, the rest as it comes)."""
        if self.t.content_ns or self.task is None or self.failing_over:
            return
        if self._may_retry():
            self.failing_over = "deadline"
            self.task.cancel()
        else:
            self.holding = False
            if self.reply is not None and self.reply.pump is not None:
                self.reply.pump.unhold()

    def _on_watch(self, window_s: float) -> None:
        """No first byte yet (see `_first_byte`): if the replica has shown no sign of working since this attempt was
        sent, it is left for another (if one is allowed); else looked at again a check's interval later."""
        place, task = self.place, self.task
        if self._first_byte() or task is None or place is None or self.failing_over:
            return
        if place.silent(time.monotonic(), window_s):
            if self._may_retry():
                self.failing_over = "silent"
                task.cancel()
            return
        self.watch = asyncio.get_running_loop().call_later(window_s / 2, self._on_watch, window_s)

    def _first_byte(self) -> bool:
        """What a client waits for first has come: a stream's first content token, or an answer's head."""
        return bool(self.t.content_ns) if self.t.stream else self.response is not None

    def _in_band_failed(self) -> bool:
        """A held stream reported an error before its first content: True, another attempt follows."""
        if self.failing_over or not self._may_retry(budgeted=False):
            return False
        self.failing_over = "stream_error"
        return True

    async def _attempt(self, body: bytes, original: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        t, upstream, place = self.t, self.upstream, self.place
        assert upstream is not None and place is not None
        loop = asyncio.get_running_loop()
        if self.first_token_by is None:
            self.first_token_by = loop.time() + upstream.pool.first_token_timeout
        limit = upstream.pool.first_token_timeout
        query = self.route.dialect.upstream_query(self.scope.get("query_string", b""), upstream.pool.key is not None or bool(self.app.client_keys))
        url = upstream.pool.target(self.scope["path"], query)
        retry = not self.started and place.could_retry(budgeted=False)
        first_s = place.deadline_s()
        self.holding = t.stream and retry  # held only while a retry could follow
        deadline = loop.call_later(first_s, self._on_deadline) if self.holding and first_s is not None else None
        window = place.watch_s() if retry else None  # (the active checks' verdicts: a replica wedged)
        self.watch = loop.call_later(max(window, first_s or 0.0), self._on_watch, window) if window is not None else None
        try:
            async with asyncio.timeout_at(self.first_token_by) as silence:
                try:
                    response = self.response = await upstream.pool.send(self.scope["method"], url, headers, body, t)
                except TimeoutError:
                    raise UpstreamTimeout(f"no response from the upstream within {limit} s ({upstream.label})") from None
                except ProxyOverloaded as full:  # (the proxy's own pool to it full: another replica's may not be)
                    if full.reason == "pool" and self._may_retry():
                        raise FailOver("pool_full") from None
                    raise
                if self.injected and response.status == 400:  # (an upstream that rejects stream_options gets the client's own request)
                    if not await options_rejected(response, self._start, self.send, t):
                        return
                    self.response, self.injected = None, False
                    response = self.response = await without_options(upstream.pool, self.scope["method"], response, url, headers, original, t)
                if response.status >= 500 or response.status == 429:
                    place.retry_after = retry_after_s(response.headers) if response.status in (429, 503) else None
                    if self._may_retry(budgeted=response.status == 429):
                        raise FailOver("status_429" if response.status == 429 else "status_5xx")
                app = self.app
                self.reply = Reply(self.ctx, self.route, app.settings, lambda: app.admission.in_flight, self.send, self._start,
                                   self.stamps.get("writer"), place.first_token, upstream.pool.read_timeout, self.injected,
                                   self._in_band_failed)
                await self.reply.respond(response, silence, self.holding)
                if self.failing_over == "stream_error":
                    raise FailOver("stream_error")
        except asyncio.CancelledError:
            if not self.failing_over or self.client_gone or self.task is None:
                raise
            self.task.uncancel()
            raise FailOver(self.failing_over) from None
        except TimeoutError:
            if t.pool_full and t.first_event_ns is None:  # still waiting for the proxy's own pool: not the upstream's
                raise ProxyOverloaded("pool", f"all {upstream.pool.limit} connections to {upstream.label} stayed in use for the "
                                              f"first-token limit, {limit} s") from None
            if self.reply is not None and self.reply.pump is not None and self.reply.pump.sending:
                t.outcome, t.error = "client_slow", "client_slow"
                log.warning("cut a client that stopped reading for over %s s", upstream.pool.read_timeout)
                return
            await self._broken(UpstreamTimeout("the upstream sent no first token in time" if not t.content_ns else "the upstream went silent mid-stream"))
        except TransportError as exc:
            if self._may_retry(budgeted=False):
                raise FailOver("connect_error" if self.response is None else "broken") from None
            await self._broken(map_transport_error(exc, upstream.label))
        finally:
            if deadline is not None:
                deadline.cancel()
            if self.watch is not None:
                self.watch.cancel()
                self.watch = None

    async def _broken(self, error: ProxyError) -> None:
        """The upstream failed: a clean error if nothing was sent yet, else the stream breaks as it would directly."""
        self.t.upstream_end_ns = now_ns()
        if not self.started:
            raise error
        t = self.t
        t.outcome, t.error = error.outcome, f"mid_stream:{error.code}"
        log.warning("upstream stream ended early: %s", error)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def _fail(self, error: ProxyError) -> None:
        t = self.t
        t.outcome, t.status_code, t.error = error.outcome, error.status, error.code
        if isinstance(error, ProxyOverloaded):
            t.error = f"{error.code}:{error.reason}"
        else:  # (shedding load is not worth a log line per request: it is counted)
            log.warning("%s", error)
        if self.started or self.client_gone:
            return
        body = error.body()
        await self._start(error.status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                         *error.headers()])
        t.response_end_ns = now_ns()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

