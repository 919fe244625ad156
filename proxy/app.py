"""create_app: the ASGI application, wiring settings to the relay and its telemetry.

`/v1/*` goes straight to the relay (a plain ASGI path, no framework routing on the hot path); the
proxy's own endpoints (`/metrics`, `/healthz`, `/llmproxy/requests`) are a small FastAPI app.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from .config import Settings
from .metrics import ProxyMetrics, multiprocess_enabled
from .relay import Exchange, filter_headers
from .telemetry import Telemetry
from .timing import RequestTiming, now_ns
from .tokens import Tokenizer
from .tracing import Tracing, build_tracer_provider
from .upstream import Upstream

log = logging.getLogger("llmproxy")
SETTINGS_ENV = "LLMPROXY_SETTINGS_JSON"


class ProxyApp:
    """The ASGI callable. Holds every long-lived object; nothing is global."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry | None = None,
        tracer_provider: Any = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.settings = settings
        multiprocess = multiprocess_enabled()
        self.metrics = ProxyMetrics(registry or CollectorRegistry(), settings.max_models, multiprocess)
        if tracer_provider is None:
            tracer_provider = build_tracer_provider(settings, self.metrics.telemetry_error)
        self.tracer_provider = tracer_provider
        if tokenizer is None and settings.tokenize:
            tokenizer = Tokenizer(settings.default_encoding)
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmproxy-tokenize")
        self.telemetry = Telemetry(settings, self.metrics, Tracing(tracer_provider, settings), tokenizer, self.executor)
        self.upstream = Upstream(settings)
        self._auth = f"Bearer {settings.upstream_api_key}".encode() if settings.upstream_api_key else None
        self.admin = self._admin_app()

    def upstream_headers(self, headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
        """Client headers minus hop-by-hop ones, with the upstream's Host and, if set, its key."""
        out = [(k, v) for k, v in filter_headers(headers) if not (self._auth and k == b"authorization")]
        if self.telemetry.tracing.enabled:
            out = [(k, v) for k, v in out if k not in (b"traceparent", b"tracestate")]
        out.append((b"host", self.upstream.host_header.encode()))
        out.append((b"content-length", str(length).encode()))
        if self._auth:
            out.append((b"authorization", self._auth))
        return out

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await Exchange(self, scope, receive, send, RequestTiming(received_ns=now_ns())).run()
            return
        await self.admin(scope, receive, send)

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        tokenizer = self.telemetry.tokenizer
        if tokenizer is not None:  # load the BPE tables before the first request needs them
            tokenizer.preload()
        await self.upstream.warm()
        try:
            yield
        finally:
            await self.upstream.aclose()
            if self.tracer_provider is not None:
                self.tracer_provider.shutdown()
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.metrics.multiprocess:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(os.getpid())

    def _admin_app(self) -> FastAPI:
        app = FastAPI(title="llm-latency-proxy", lifespan=self.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        metrics, telemetry = self.metrics, self.telemetry

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok", "upstream": self.settings.upstream_label}

        @app.get("/metrics")
        async def scrape(request: Request) -> Response:
            body, content_type = metrics.render(request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

        @app.get("/llmproxy/requests")
        async def requests(limit: int = 100) -> list[dict[str, Any]]:
            """The most recent per-request records, newest last (this worker's only)."""
            records = list(telemetry.records)
            return records[-limit:] if limit > 0 else []

        return app


def create_app(settings: Settings, **kwargs: Any) -> ProxyApp:
    return ProxyApp(settings, **kwargs)


def app_from_env() -> ProxyApp:
    """uvicorn factory for worker processes: the parent serialised its settings."""
    settings = Settings.from_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper())
    return ProxyApp(settings)
