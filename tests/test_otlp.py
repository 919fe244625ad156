"""Spans leave through the real OTLP/HTTP exporter, configured by the standard variables."""
from __future__ import annotations

import gzip
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from servers import SCHEDULER_SLACK_S, Process
from proxy.demo import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Receiver:
    """An OTLP/HTTP trace receiver on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.raw: list[bytes] = []  # exactly what was received, for leak checks
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.raw.append(body)
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
        # scheduler (another process on the CPU for a few ms; bench/stamps.py measures it apart).
        late = [round((ns - before * 1e9) / 1000) for ns, (before, _) in zip(stamps, truth)]
        assert all(delay >= -20 for delay in late), late
        assert statistics.median(late) <= 500 and max(late) <= SCHEDULER_SLACK_S * 1e6, late
    ttfts = [a.value.double_value for _, span, _ in receiver.spans() for a in span.attributes if a.key == "gen_ai.response.time_to_first_chunk"]
    assert len(ttfts) == 2 and all(abs(t - 0.050) < 0.010 for t in ttfts), ttfts  # and the first one where the schedule put it
    assert not [s for name, s, _ in receiver.spans() if name == "chunk"]  # no span per chunk by default
