"""Per-request work on the event loop at finish: the split, metrics, spans and the SLO verdict, in-process.

    .venv/bin/python -m bench.relay finish                 # this checkout
    .venv/bin/python -m bench.relay finish --src /tmp/old  # another checkout (git worktree)

5,000 finished streaming records of 100 content chunks each (the test suite's record shape),
each observed once; the span processor is a batch processor with an exporter that drops. The SLO
verdict (when the checkout has one: proxy/measure/slo.py) is timed for a good request (its phases appended to
the model's usual values) and for a TTFT miss (the blame: each phase against its usual median),
and its metrics (`observe_slo`) once per request. Attribution (when the checkout has it:
proxy/serve/tenants.py), as the relay does it per request: the tenant from the request's headers with no
--tenants file, from its key's fingerprint among 20 tenants' keys, from a header entry (the 21st
source), and the end user from the body's `user`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]))
parser.add_argument("--requests", type=int, default=5000)
args = parser.parse_args()
sys.path.insert(0, str(Path(args.src) / "tests"))
sys.path.insert(0, args.src)

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from test_timing import streaming_record  # noqa: E402

from proxy.config import Settings  # noqa: E402
from proxy.measure.metrics import ProxyMetrics  # noqa: E402
from proxy.measure.timing import split  # noqa: E402
from proxy.measure.tracing import Tracing  # noqa: E402


class Drop(SpanExporter):
    def export(self, spans):  # type: ignore[no-untyped-def]
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=1_000_000))
tracing = Tracing(provider, Settings(upstream="http://10.0.0.5:8000/v1"))
metrics = ProxyMetrics(CollectorRegistry())
records = []
for _ in range(args.requests):
    t = streaming_record()
    t.status_code = 200
    t.content_ns = [210_000_000 + k * 10_000_000 for k in range(100)]
    t.content_choice = [0] * 100
    t.upstream_end_ns = t.content_ns[-1] + 1
    t.response_end_ns = t.upstream_end_ns + 1
    records.append(t)
b = split(records[0])
work_items = [("the split", lambda t: split(t)),
              ("metrics (ProxyMetrics.observe)", lambda t: metrics.observe(t, b, "u", None)),
              ("spans (start + finish)", lambda t: tracing.finish(tracing.start({}, t, 0), t, b, 0))]
try:
    from proxy.measure.slo import SLOs, parse
except ImportError:  # an older checkout: no objectives
    pass
else:
    good = SLOs(objectives=parse("objectives:\n  - name: s\n    models: ['*']\n    ttft: 0.5\n    tpot: 0.05\n    e2e: 30\n    target: 0.99\n"))
    missing = SLOs(objectives=parse("objectives:\n  - name: s\n    models: ['*']\n    ttft: 0.1\n    tpot: 0.05\n    e2e: 30\n    target: 0.99\n"))
    for _ in range(300):  # a usual to blame against: a full window of good requests
        missing.usual.add(("m", "ttft"), {"prefill": 0.05, "network": 0.001, "client": 0.0, "proxy": 0.0005, "tokenize": 0.001})
    verdict = good.judge(records[0], b)
    work_items += [("SLO verdict, a good request (SLOs.judge)", lambda t: good.judge(t, b)),
                   ("SLO verdict, a TTFT miss with its blame", lambda t: missing.judge(t, b)),
                   ("SLO metrics (ProxyMetrics.observe_slo)", lambda t: metrics.observe_slo(verdict, "m", "u"))]
try:
    from proxy.measure.meters import Meters
except ImportError:  # an older checkout: no OTLP metrics
    pass
else:
    meters = Meters(Settings(upstream="http://10.0.0.5:8000/v1"), metrics.models)  # (no exporter: the recording alone)
    work_items.append(("OTLP metrics (Meters.export, when an OTLP endpoint is set)", lambda t: meters.export(t, b, "u", None, None)))
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    sdk = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    instruments = [sdk.create_histogram(f"h{i}") for i in range(12)]
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m",
                  "server.address": "10.0.0.5", "server.port": 8000, "llmproxy.phase": "decode"}
    work_items.append(("the same 12 points through the OTel SDK's Histogram.record (not used)",
                       lambda t: [h.record(0.1, attributes) for h in instruments]))
try:
    from proxy.serve.tenants import Tenants, fingerprint, parse as parse_tenants
except ImportError:  # an older checkout: no tenants
    pass
else:
    keys = [f"sk-proj-{i:02d}-" + "x" * 40 for i in range(20)]
    tenants = Tenants(config=parse_tenants("tenants:\n" + "".join(f"  - name: t{i}\n    keys: ['{fingerprint(k)}']\n" for i, k in enumerate(keys))
                                           + "  - name: gw\n    header: {name: x-team, values: [gw]}\nusers:\n  header: x-end-user\n"))
    none = Tenants()
    common = [(b"host", b"proxy:8080"), (b"content-type", b"application/json"), (b"user-agent", b"OpenAI/Python 1.99.1"),
              (b"accept", b"application/json"), (b"x-stainless-lang", b"python")]
    by_key = common + [(b"authorization", b"Bearer " + keys[13].encode())]
    by_header = common + [(b"authorization", b"Bearer sk-not-listed"), (b"x-team", b"gw")]
    body = {"model": "m", "messages": [], "user": "user-1234"}
    work_items += [("attribution: no --tenants (Tenants.tenant, `unknown`)", lambda t: none.tenant(by_key)),
                   ("attribution: the tenant from its key's fingerprint, 20 tenants' keys", lambda t: tenants.tenant(by_key)),
                   ("attribution: the tenant from a header (after a key no fingerprint matches)", lambda t: tenants.tenant(by_header)),
                   ("attribution: the end user from the body's `user` (Tenants.user)", lambda t: tenants.user(by_key, body))]
for label, work in work_items:
    began = time.perf_counter()
    for t in records:
        work(t)
    print(f"{label}: {(time.perf_counter() - began) / len(records) * 1e6:.1f} µs per request")
