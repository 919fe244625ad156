"""The finish boundary: the gauge drops at once, the rest is queued and always completed."""
import asyncio
import time

from prometheus_client import CollectorRegistry

from proxy.serve.app import ProxyApp
from proxy.config import Settings
from proxy.measure.telemetry import RequestContext
from proxy.measure.timing import RequestTiming, now_ns


def finished_context(telemetry) -> RequestContext:
    received = now_ns()
    t = RequestTiming(received_ns=received, endpoint="chat", model="m", stream=True)
    ctx = RequestContext(t, time.time_ns() - received)
    telemetry.start(ctx, [])
    t.issued_ns = t.first_event_ns = t.headers_ns = received + 1_000
    t.content_ns = [received + 2_000_000 + k * 1_000_000 for k in range(5)]
    t.content_choice = [0] * 5
    t.upstream_end_ns = t.response_end_ns = received + 8_000_000
    t.outcome, t.status_code = "ok", 200
    ctx.usage = {"prompt_tokens": 3, "completion_tokens": 5}
    return ctx


def test_finish_drops_the_gauge_at_once_and_a_burst_of_finishes_is_drained_whole():
    app = ProxyApp(Settings(upstream="http://127.0.0.1:9/v1", tokenize=False), registry=CollectorRegistry())
    telemetry = app.telemetry

    async def burst() -> tuple[float, int, int]:
        contexts = [finished_context(telemetry) for _ in range(500)]
        in_flight = app.metrics.registry.get_sample_value("llmproxy_requests_in_flight", {"upstream": "127.0.0.1:9"})
        for ctx in contexts:
            telemetry.finish(ctx)
            telemetry.finish(ctx)  # a second call is a no-op: one finish per request
        queued = len(telemetry.records)
        await telemetry.drain()
        return in_flight, queued, len(telemetry.records)

    try:
        in_flight, queued, done = asyncio.run(burst())
    finally:
        app.offload.shutdown()
    assert in_flight == 500 and app.metrics.registry.get_sample_value("llmproxy_requests_in_flight", {"upstream": "127.0.0.1:9"}) == 0
    assert queued == 0  # nothing was exported inside finish() itself
    assert done == 500  # (records default to 1,000 kept)
    labels = {"model": "m", "upstream": "127.0.0.1:9", "endpoint": "chat", "stream": "true", "api": "other", "outcome": "ok", "code": "200",
              "tenant": "unknown"}
    assert app.metrics.registry.get_sample_value("llmproxy_requests_total", labels) == 500
