"""Spans leave through the real OTLP/HTTP exporter, configured by the standard variables."""
from __future__ import annotations

import gzip
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest, ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from servers import SCHEDULER_SLACK_S, Process
from proxy.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Receiver:
    """An OTLP/HTTP receiver on loopback (traces at /v1/traces, metrics at /v1/metrics) that keeps
    what it is sent, decoded with the OTLP protobuf definitions."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.raw: list[bytes] = []  # exactly what was received, for leak checks
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.raw.append(body)
                if self.path == "/v1/metrics":
                    metrics = ExportMetricsServiceRequest()
                    metrics.ParseFromString(body)
                    receiver.metrics.append(metrics)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    message = ExportTraceServiceRequest()
                    message.ParseFromString(body)
                    receiver.requests.append(message)
                    reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, object, dict]]:
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    out.extend((span.name, span, resource) for span in scope_spans.spans)
        return out


def test_spans_exported_over_otlp_http(sim):
    receiver = Receiver()
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "proxy-under-test", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--token-spans", "spans"], f"http://127.0.0.1:{port}/healthz", env)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0)
        for _ in c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True):
            pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(name == "chat sim-7b" for name, _, _ in receiver.spans()):
            time.sleep(0.05)
    finally:
        proxy.stop()
        receiver.server.shutdown()
    spans = receiver.spans()
    names = [name for name, _, _ in spans]
    assert "chat sim-7b" in names and "upstream.request" in names and names.count("chunk") == 4
    server = next(span for name, span, _ in spans if name == "chat sim-7b")
    assert all(resource["service.name"] == "proxy-under-test" for _, _, resource in spans)
    upstream = next(span for name, span, _ in spans if name == "upstream.request")
    assert upstream.parent_span_id == server.span_id
    sent = sim.stats()["last_headers"]["traceparent"]
    assert sent.split("-")[:3] == ["00", upstream.trace_id.hex(), upstream.span_id.hex()]
    assert int(sent.split("-")[3], 16) & 1  # sampled


def test_every_token_is_stamped_by_default_and_read_back_from_otlp(sim):
    """No flag: the decode span carries one offset per content chunk. Read back from a real OTLP/HTTP
    export, each stamp, the first included, is where the simulator wrote that chunk (its own
    monotonic clock, the same clock as the proxy's), for chat and for the Responses API."""
    receiver = Receiver()
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port)], f"http://127.0.0.1:{port}/healthz", env)
    schedule = {"x-sim-ttft-ms": "50", "x-sim-decode-tps": "50"}
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0)
        sent = []  # (monotonic s) just before and just after the upstream handed each content chunk over: the ground truth
        for _ in c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=20, stream=True,
                                           extra_headers=schedule):
            pass
        sent.append(sim.stats()["last_send_times"])
        for _ in c.responses.create(model="sim-7b", input="x", max_output_tokens=10, stream=True, extra_headers=schedule):
            pass
        sent.append(sim.stats()["last_send_times"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sum(name == "decode" for name, _, _ in receiver.spans()) < 2:
            time.sleep(0.05)
    finally:
        proxy.stop()
        receiver.server.shutdown()
    wall_less_monotonic = statistics.median(time.time_ns() - time.monotonic_ns() for _ in range(9))  # one offset for every process
    decodes = [span for name, span, _ in receiver.spans() if name == "decode"]
    stamped = sorted(([span.start_time_unix_nano - wall_less_monotonic + v.int_value * 1000 for v in a.value.array_value.values]
                      for span in decodes for a in span.attributes if a.key == "llmproxy.chunk.offsets_us"), key=len)
    assert [len(s) for s in stamped] == [10, 20]  # the Responses API stream, then chat: one stamp per token
    for stamps, truth in zip(stamped, sorted(sent, key=len)):
        # How late each stamp is after the write began (µs). A stamp cannot precede the write (a
        # few µs of clock conversion aside); the proxy stamps each piece as the protocol reads it
        # (connection.py), so the typical one is well under a millisecond late, the first chunk
        # (TTFT's end) like the rest. The bound on every one leaves room for this 2-core machine's
        # scheduler (another process on the CPU for a few ms; bench/truth/stamps.py measures it apart).
        late = [round((ns - before * 1e9) / 1000) for ns, (before, _) in zip(stamps, truth)]
        assert all(delay >= -20 for delay in late), late
        assert statistics.median(late) <= 500 and max(late) <= SCHEDULER_SLACK_S * 1e6, late
    ttfts = [a.value.double_value for _, span, _ in receiver.spans() for a in span.attributes if a.key == "gen_ai.response.time_to_first_chunk"]
    assert len(ttfts) == 2 and all(abs(t - 0.050) < 0.010 for t in ttfts), ttfts  # and the first one where the schedule put it
    assert not [s for name, s, _ in receiver.spans() if name == "chunk"]  # no span per chunk by default


def latest_metrics(receiver: Receiver) -> dict[str, object]:
    """Each metric of the newest export that has it (cumulative: the newest holds everything), by name."""
    out: dict[str, object] = {}
    for request in receiver.metrics:
        for resource_metrics in request.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    out[metric.name] = metric
    return out


def attrs(point) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in point.attributes}


def test_metrics_over_otlp_with_the_genai_conventions_and_true_values(sim, tmp_path):
    """The standard variables switch OTLP metrics on beside /metrics; a real receiver decodes what
    arrives: the conventions' names, units, attributes and advised buckets, and values equal to the
    proxy's own records of the same requests (an injected 200 ms TTFT, 10 tokens at 100 tok/s)."""
    from proxy.measure import meters

    receiver = Receiver()
    port = free_port()
    objectives = tmp_path / "slo.yaml"
    objectives.write_text("objectives:\n  - name: chat\n    models: [sim-7b]\n    ttft: 0.1\n    target: 0.99\n")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_SERVICE_NAME": "otlp-metrics-test"}
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--slo", str(objectives), "--instance", "pod-m"],
                    f"http://127.0.0.1:{port}/healthz", env)
    base = f"http://127.0.0.1:{port}"
    schedule = {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "100"}
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        for _ in range(3):
            for _ in c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=10, stream=True,
                                               extra_headers=schedule):
                pass
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                      extra_headers={"x-sim-error-status": "500"})
        records = httpx.get(f"{base}/llmproxy/requests", params={"limit": 10}).json()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = latest_metrics(receiver)
            duration = got.get("gen_ai.client.operation.duration")
            if duration is not None and sum(p.count for p in duration.histogram.data_points) == 4:  # type: ignore[attr-defined]
                break
            time.sleep(0.1)
        prometheus = httpx.get(f"{base}/metrics").text
    finally:
        proxy.stop()
        receiver.server.shutdown()
    assert len(records) == 4 and "llmproxy_requests_total" in prometheus  # the scrape is still there, beside
    got = latest_metrics(receiver)
    assert set(got) == {d.name for d in meters.INSTRUMENTS}, set(got) ^ {d.name for d in meters.INSTRUMENTS}
    units = {d.name: d.unit for d in meters.INSTRUMENTS}
    assert all(got[name].unit == unit for name, unit in units.items())  # type: ignore[attr-defined]
    resource = {a.key: a.value.string_value for a in receiver.metrics[-1].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "otlp-metrics-test" and resource["service.instance.id"] == "pod-m"
    ok = [r for r in records if r["outcome"] == "ok"]
    ttft = got["gen_ai.server.time_to_first_token"].histogram.data_points  # type: ignore[attr-defined]
    assert len(ttft) == 1 and ttft[0].count == 3 and list(ttft[0].explicit_bounds) == list(meters.TTFT_BUCKETS)
    assert abs(ttft[0].sum - sum(r["ttft_s"] for r in ok)) < 1e-9  # the records' own figures, to the last digit
    assert all(0.2 <= r["ttft_s"] < 0.25 for r in ok)
    point = attrs(ttft[0])
    assert point["gen_ai.operation.name"] == "chat" and point["gen_ai.request.model"] == "sim-7b" and point["gen_ai.provider.name"]
    assert point["server.address"] == "127.0.0.1" and point["server.port"] == sim.port
    durations = {attrs(p).get("error.type"): p for p in got["gen_ai.client.operation.duration"].histogram.data_points}  # type: ignore[attr-defined]
    assert durations[None].count == 3 and durations["500"].count == 1
    assert list(durations[None].explicit_bounds) == list(meters.OPERATION_BUCKETS)
    assert abs(durations[None].sum - sum(r["duration_s"] for r in ok)) < 1e-9
    tokens = {attrs(p)["gen_ai.token.type"]: p for p in got["gen_ai.client.token.usage"].histogram.data_points if "error.type" not in attrs(p)}  # type: ignore[attr-defined]
    assert tokens["output"].sum == 30 and tokens["input"].sum == sum(r["prompt_tokens"] for r in ok)
    tpot = got["gen_ai.server.time_per_output_token"].histogram.data_points[0]  # type: ignore[attr-defined]
    assert tpot.count == 3 and abs(tpot.sum / 3 - 0.010) < 0.002  # 100 tok/s
    phases = {attrs(p)["llmproxy.phase"]: p for p in got["llmproxy.phase.duration"].histogram.data_points}  # type: ignore[attr-defined]
    assert abs(sum(p.sum for p in phases.values()) - sum(r["duration_s"] for r in ok)) < 1e-6  # the phases sum to the durations
    assert abs(phases["decode"].sum - sum(r["phases_s"]["decode"] for r in ok)) < 1e-9
    assert list(phases["decode"].explicit_bounds) == list(meters.PHASE_BUCKETS) and sum(phases["decode"].bucket_counts) == 3
    slo = {attrs(p)["llmproxy.slo.result"]: p.as_int for p in got["llmproxy.slo.requests"].sum.data_points}  # type: ignore[attr-defined]
    assert slo == {"bad": 4}  # a 200 ms TTFT misses 100 ms, and the 500 is an error
    misses = {(attrs(p)["llmproxy.slo.objective"], attrs(p)["llmproxy.slo.blame"]): p.as_int for p in got["llmproxy.slo.misses"].sum.data_points}  # type: ignore[attr-defined]
    assert misses == {("ttft", "prefill"): 3, ("error", "upstream_error"): 1}
