"""create_app: the ASGI application, wiring settings to the relay and its telemetry.

Every path goes straight to the relay (a plain ASGI path, no framework routing on the hot path)
but the proxy's own endpoints (`/metrics`, `/healthz`, `/ui`, `/llmproxy/*`), a small FastAPI app.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from .. import apis, records
from ..config import Settings
from ..fleet import forecast
from ..fleet.checks import Checker
from ..fleet.health import EJECT_REASONS, STATES
from ..fleet.replica import Replica
from ..fleet.routes import Router
from ..measure import cpu
from ..measure.arrival import TickPhase
from ..measure.meters import Meters, build_meters
from ..measure.metrics import ProxyMetrics, multiprocess_enabled
from ..measure.offload import Offload
from ..measure.slo import SLOs
from ..measure.telemetry import Telemetry
from ..measure.tracing import Tracing, build_tracer_provider
from ..records.aggregate import summary as summarise
from ..records.outbox import Outbox
from ..upstream.limits import raise_open_files_limit, worker_cap
from ..wire.tokens import Tokenizer
from .acceptor import ProxyLoop
from .admission import Admission
from .page import HEADERS, NO_SNIFF, Gate, files
from .relay import Exchange
from .request import KEY_HEADERS, filter_headers
from .tenants import Tenants

log = logging.getLogger("llmproxy")
SETTINGS_ENV = "LLMPROXY_SETTINGS_JSON"
RECORDS_FLUSH_S = 5.0  # at shutdown, after the drain: what the records buffer may take to reach the store
READ_FLUSH_S = 0.5  # /llmproxy/requests waits this long at most for what was just finished to be written
ADMIN_PATHS = ("/metrics", "/healthz", "/ui")  # and /llmproxy/*: never relayed


class ProxyApp:
    """The ASGI callable. Holds every long-lived object; nothing is global."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry | None = None,
        tracer_provider: Any = None,
        tokenizer: Tokenizer | None = None,
        meters: Meters | None = None,
    ) -> None:
        self.settings = settings
        multiprocess = multiprocess_enabled()
        self.metrics = ProxyMetrics(registry or CollectorRegistry(), settings.max_models, multiprocess, settings.max_label_sets,
                                    settings.tenant_expiry)
        self.offload = Offload()
        self.outbox: Outbox | None = None  # the records process's queue (records/outbox.py), opened at start-up
        if tracer_provider is None:
            tracer_provider = build_tracer_provider(settings, self.metrics.telemetry_error, self.offload)
        self.tracer_provider = tracer_provider
        if tokenizer is None and settings.tokenize:
            tokenizer = Tokenizer(settings.default_encoding)
        self.slos = SLOs(settings.slo)  # --slo: a broken file is refused here, at start, with its line
        self.tenants = Tenants(settings.tenants)  # --tenants: likewise
        self.metrics.slo_targets({o.name: o.target for o in self.slos.objectives})
        self.metrics.tenant_label = self.tenants.label
        # OTLP metrics, beside /metrics, when an OTLP endpoint is configured (a test passes its own).
        self.meters = meters if meters is not None else build_meters(settings, self.metrics.models, self.metrics.telemetry_error)
        if self.meters is not None:
            self.meters.tenant_label = self.tenants.label
        self.telemetry = Telemetry(settings, self.metrics, Tracing(tracer_provider, settings), tokenizer, self.offload, self.slos, self.meters)
        # In each worker, before its listener and its upstream pools exist (their size comes from it).
        self.open_files = raise_open_files_limit(settings)[1]
        self.router = Router(settings, self.telemetry.ejected)  # --routes, or the one --upstream for every model
        self.metrics.models.know(self.known_models())  # (kept by name whatever clients send: labels.py)
        # --max-in-flight is the proxy's: each worker enforces its part, shared by tenant (admission.py).
        self.admission = Admission(worker_cap(settings), settings.admission_queue_s, lambda label: self.tenants.weight(label))
        self.metrics.child("llmproxy_max_in_flight", settings.upstream_label).set(self.admission.cap)
        self.metrics.in_flight(settings.upstream_label)  # (at 0 from the start: an idle proxy is scraped, never absent)
        self.metrics.tenants_known(settings.upstream_label, self.tenants.labels(), self.admission.cap > 0)
        self.client_keys = settings.client_keys()
        self.admin = self._admin_app()  # the proxy's own endpoints, on this port or --admin-port

    @property
    def upstream(self) -> Replica:
        """The default upstream (the only one without --routes)."""
        router = self.router
        return router.upstreams[router.default] if router.default is not None else next(iter(router.upstreams.values()))

    def upstream_headers(self, headers: list[tuple[bytes, bytes]], length: int, upstream: Replica, dialect: apis.Dialect,
                         identity: bool = False) -> list[tuple[bytes, bytes]]:
        """Client headers minus hop-by-hop ones, with the upstream's Host and, if set, its key,
        written where the request's API carries keys (`Authorization: Bearer`, Azure `api-key`,
        Anthropic `x-api-key`). With proxy authentication on, the client's key headers hold the
        proxy's key: never sent on. `identity`: the proxy may rewrite this response, so it asks
        for it uncompressed."""
        drop_keys = upstream.pool.key is not None or bool(self.client_keys)
        drop = (KEY_HEADERS if drop_keys else ()) + ((b"traceparent", b"tracestate") if self.telemetry.tracing.enabled else ()) \
            + ((b"accept-encoding",) if identity else ())
        out = [(k, v) for k, v in filter_headers(headers) if k.lower() not in drop] if drop else filter_headers(headers)
        out.append((b"host", upstream.pool.host_header.encode()))
        out.append((b"content-length", str(length).encode()))
        if identity:
            out.append((b"accept-encoding", b"identity"))
        if upstream.pool.key:
            out.append((dialect.key_headers[0], dialect.key_prefix + upstream.pool.key))
        return out

    def known_models(self) -> tuple[str, ...]:
        """The model names the configuration knows: its routes' and its objectives' exact names (never folded into
        `other`, whatever names clients send: labels.py, records/columns.py)."""
        named = {m for o in self.slos.objectives for m in o.models if not any(c in m for c in "*?[")}
        return tuple(sorted({*self.router.models(), *named}))

    def reload(self) -> None:
        """SIGHUP: re-read --routes, --slo and --tenants; a broken file is refused and the old one keeps serving."""
        try:
            self.router.reload()
        except ValueError as exc:
            log.error("routes not reloaded, the old ones keep serving: %s", exc)
        try:
            self.slos.reload()
            self.metrics.slo_targets({o.name: o.target for o in self.slos.objectives})
        except ValueError as exc:
            log.error("objectives not reloaded, the old ones keep serving: %s", exc)
        try:
            self.tenants.reload()
            self.metrics.tenants_known(self.settings.upstream_label, self.tenants.labels(), self.admission.cap > 0)
        except ValueError as exc:
            log.error("tenants not reloaded, the old ones keep serving: %s", exc)
        self.metrics.models.know(self.known_models())  # (the records process keeps the names it started with)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path.startswith("/v1/") or not self._admin_path(path):  # every path is relayed but the proxy's own
                if path == "/v1/models" and self.settings.routes and scope["method"] == "GET":
                    await self._models(send)
                    return
                await Exchange(self, scope, receive, send).run()
                return
        await self.admin(scope, receive, send)

    def _admin_path(self, path: str) -> bool:
        """The proxy's own endpoints; with --admin-port they live there and only /healthz stays here."""
        if self.settings.admin_port:
            return path == "/healthz"
        return path in ADMIN_PATHS or path.startswith("/llmproxy/")

    async def _models(self, send: Send) -> None:
        """GET /v1/models with --routes: the models the routes name (OpenAI's list shape)."""
        body = orjson.dumps({"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": ",".join(rule.upstreams)}
                                                        for m, rule in sorted(self.router.exact.items())]})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.metrics.child("llmproxy_max_fds").set(self.open_files)
        watcher = asyncio.create_task(self._sample_every_second()) if self.metrics.multiprocess else None
        lag = cpu.LoopLag(self.metrics.child("llmproxy_event_loop_lag_seconds").observe, lambda: self.admission.in_flight > 0)
        lag.start()
        self.admission.on_busy = lag.wake
        phase = TickPhase()  # where the kernel's tick begins, for the arrival stamps (arrival.py), in its own thread
        phase.start()
        if self.settings.routes or self.settings.slo or self.settings.tenants:
            try:  # (only the main thread of a process may; a test serving the app in a thread cannot)
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
            except (RuntimeError, ValueError):
                log.warning("SIGHUP cannot reload routes, objectives or tenants here (not the main thread)")
        count_pause = self.metrics.accept_paused(self.settings.upstream_label)
        loop = asyncio.get_running_loop()
        if isinstance(loop, ProxyLoop):  # (a test may serve the app on another loop)
            loop.on_pause = count_pause
        self.outbox = self.telemetry.records_sink.store = self._records_writer()  # its thread, in each worker
        tokenizer = self.telemetry.tokenizer
        if tokenizer is not None:  # load the BPE tables before the first request needs them
            tokenizer.preload()
        self.offload.start_worker()
        checker = Checker(self.router)  # the active health checks (fleet/checks.py), off the user path
        if self.settings.routes:
            checker.start()
        # What start-up made (some 60,000 objects: the libraries' modules, the app) lives as long as the
        # process: frozen, it is never walked again, and a full collection, which stalls every stream
        # on this loop, walks only what serving made (50-60 ms less per full collection here).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            lag.stop()
            phase.stop()
            await checker.stop()
            await self.telemetry.drain()  # every finished request exported before the exporters stop
            store = self.outbox
            if store is not None:  # what is buffered, written within the deadline (the rest: counted, `shutdown`)
                await asyncio.to_thread(store.close, RECORDS_FLUSH_S)
            self.router.close()
            if self.tracer_provider is not None:
                self.tracer_provider.shutdown()
            if self.meters is not None:
                await asyncio.to_thread(self.meters.shutdown)  # its last export: what the finisher recorded since the previous one
            self.offload.shutdown()
            if self.metrics.multiprocess:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(os.getpid())

    def _records_writer(self) -> Outbox | None:
        """The records store --records-db names (SQLite: every worker on one file, WAL mode; PostgreSQL:
        every replica on one table), written by a process of this worker's own behind its bounded buffer
        (records/outbox.py); None when records are off."""
        s, target = self.settings, self.settings.records_path
        if not target:
            return None
        options = {"max_rows": s.records_max_rows, "max_age_s": s.records_max_age, "password_file": s.records_db_password_file,
                   "max_models": s.max_models, "known_models": self.known_models()}
        buffered, written = self.metrics.child("llmproxy_records_buffered"), self.metrics.child("llmproxy_records_written")

        def on_batch(stored: int, waiting: int) -> None:
            written.inc(stored)
            buffered.set(waiting)

        lost = self.metrics.child("llmproxy_records_lost")
        return Outbox(target, options, s.instance_name, s.records_buffer, s.records_buffer_bytes, lambda: self.telemetry.count_error("records"),
                      self.metrics.records_dropped, on_batch, on_lost=lost.inc,
                      on_nulled=lambda field, n: self.metrics.child("llmproxy_records_nulled", field).inc(n),
                      on_maintenance=lambda step: self.metrics.child("llmproxy_records_maintenance_errors", step).inc())

    def _sample(self) -> None:
        """The gauges read off the process (open descriptors, bytes read ahead of slow clients, the
        upstream pools), when they are asked for: at each scrape, in its thread (listing thousands of
        descriptors takes ms). Nothing wakes an idle proxy to keep them fresh."""
        self.metrics.child("llmproxy_read_ahead_bytes").set(self.router.budget.used)
        upstreams = list(self.router.upstreams.values())
        self.metrics.pools({u.label: (u.pool.in_use, u.pool.idle, u.pool.limit) for u in upstreams})
        self.metrics.predictions(forecast.predictions((u.label, u.forecast) for u in upstreams))
        self.metrics.health({u.label: u.health.state for u in upstreams}, STATES, EJECT_REASONS)
        if self.admission.cap:
            self.metrics.admission(dict(self.admission.held), self.admission.queued())
        try:
            self.metrics.child("llmproxy_open_fds").set(_open_fds())
        except OSError:  # no /proc (not Linux), or out of descriptors for the listing itself
            pass

    async def _sample_every_second(self) -> None:
        """With workers, a scrape is answered by one of them and reads every worker's file, so each
        worker samples its own gauges once a second."""
        while True:
            await asyncio.to_thread(self._sample)
            await asyncio.sleep(1.0)

    def _admin_app(self) -> FastAPI:
        app = FastAPI(title="llm-latency-proxy", lifespan=self.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        metrics, telemetry, admin_key = self.metrics, self.telemetry, self.settings.admin_key

        def scrape_now(accept: str) -> tuple[bytes, str]:
            self._sample()
            return metrics.render(accept)

        page, gate = files(), Gate(admin_key)
        scraper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmproxy-scrape")

        @app.middleware("http")
        async def protect(request: Request, call_next: Any) -> Response:
            # /ui and its files hold no data: the data endpoints ask for the key (page.py).
            refused = gate.refused(request)
            if refused is not None:
                return refused
            response: Response = await call_next(request)
            response.headers.update(HEADERS if request.url.path in page else NO_SNIFF)
            return response

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok", "upstream": self.settings.upstream_label}

        @app.get("/metrics")
        async def scrape(request: Request) -> Response:
            metrics.expire_tenants()  # (here, on the loop that observes: never beside an observation)
            # In a thread: rendering thousands of series must not hold the event loop (and the
            # streams on it) for the whole render; the GIL still switches every 5 ms.
            # Its own thread: the default executor's may all wait on a store gone silent (the reads' deadlines bound
            # them, but a scrape never waits on the store at all).
            body, content_type = await asyncio.get_running_loop().run_in_executor(scraper, scrape_now, request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

        @app.get("/ui")
        @app.get("/llmproxy/ui/waterfall.js")
        @app.get("/llmproxy/ui/waterfall.css")
        async def ui(request: Request) -> Response:
            """The live waterfall page (proxy/serve/waterfall.html, its script and its style): every recent request split by phase."""
            body, kind = page[request.url.path]
            return Response(body, media_type=kind)

        @app.post("/llmproxy/login")
        async def login(request: Request) -> Response:
            """The page's login form (--admin-key): page.py."""
            return await gate.login(request)

        @app.get("/llmproxy/requests")
        async def requests(limit: int = 100, model: str = "", upstream: str = "", outcome: str = "", api: str = "", slo: str = "",
                           verdict: str = "", instance: str = "", min_ttft: float = 0.0, tenant: str = "", user: str = "") -> Any:
            """The most recent per-request records, newest last: every worker's (with PostgreSQL, every
            replica's), from the records store (this worker's in memory when records are off or the
            store unreadable). `verdict`: good or miss (its SLO verdict); `instance`: one replica;
            `min_ttft`: seconds; `tenant` and `user`: who sent it (--tenants)."""
            filters = records.Filters(model, upstream, outcome, api, slo, verdict, instance, min_ttft, tenant, user)
            store = self.outbox
            if store is not None:
                await asyncio.to_thread(store.flush, READ_FLUSH_S)
                try:
                    found = await asyncio.to_thread(store.recent, limit, filters)
                    return Response(b"[" + b",".join(found) + b"]", media_type="application/json")  # (as stored: never parsed here)
                except Exception:  # noqa: BLE001 - unreadable (a corrupt file, the server down): counted, served from memory
                    telemetry.count_error("records")
            rows = [r for r in telemetry.records if filters.match(r)]
            return rows[-limit:] if limit > 0 else []

        @app.get("/llmproxy/upstreams")
        async def upstreams() -> Any:
            """Each replica's health and forecast now, as this worker sees them (health.py, forecast.py): /ui's replicas line."""
            now = time.monotonic()
            return [{"upstream": u.label, "state": u.health.state, "reason": u.health.reason or None,
                     "back_in_s": round(max(0.0, u.health.until - now), 1) if u.health.state != "serving" else None,
                     "in_flight": u.in_flight, "failure_share": round(u.health.share(now), 3),
                     "predicted_ttft_s": u.forecast.predict(forecast.REFERENCE_TOKENS)} for u in list(self.router.upstreams.values())]

        @app.get("/llmproxy/summary")
        async def summary(since: float = 3600.0, model: str = "", upstream: str = "", outcome: str = "", api: str = "", slo: str = "",
                          verdict: str = "", instance: str = "", tenant: str = "") -> Any:
            """What the records store counted over the last `since` seconds for these filters (/ui's
            summary line): requests by outcome, TTFT and end-to-end percentiles, SLO attainment; from
            the aggregates, never from the records (null when records are off)."""
            store = self.outbox
            if store is None:
                return {"requests": None}
            filters = records.Filters(model, upstream, outcome, api, slo, verdict, instance, tenant=tenant)
            try:
                return await asyncio.to_thread(summarise, store.backend, since, filters)
            except Exception:  # noqa: BLE001 - unreadable: counted
                telemetry.count_error("records")
                return {"requests": None}

        return app


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # (minus the listing's own)


def create_app(settings: Settings, **kwargs: Any) -> ProxyApp:
    return ProxyApp(settings, **kwargs)


def app_from_env() -> ProxyApp:
    """uvicorn factory for worker processes: the parent serialised its settings."""
    settings = Settings.from_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper())
    return ProxyApp(settings)
