"""A fleet's records, made by the proxy's own code: realistic traffic for the store's tests and for
bench/store/store_volume.py, written as JSON lines (what `records export` writes, `records import` reads).

Each record is a `RequestTiming` filled as the relay would fill it for an engine with a known law
(per model: a prefill rate and fixed cost, decode speed at batch 1 slowing with the streams in flight,
engine-reported queueing on some upstreams), then `split`, judged against an objective and turned
into the stored record by `record_dict`: the same fields, phases and verdicts a proxy writes. The mix:
many models and replicas, three APIs, streams and not, failed and abandoned requests, short prompts
and agent-sized ones (20-120k tokens, often cached), short and long answers, a few stalls.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator

import orjson

from proxy.wire.engine import EngineTimings
from proxy.measure.slo import SLOs, Objective
from proxy.measure.telemetry import RequestContext, record_dict
from proxy.measure.timing import RequestTiming, split

MS = 1_000_000
APIS = (("openai", "chat"), ("openai", "chat"), ("openai", "responses"), ("anthropic", "messages"))
OBJECTIVES = (Objective("interactive", ("chat-*",), 0.95, ttft=1.0, tpot=0.03, e2e=30.0),
              Objective("batch", ("batch-*",), 0.9, e2e=60.0))


@dataclass(frozen=True)
class Engine:
    """One model's law on its upstream."""

    prefill_tps: float
    fixed_s: float
    itl_1_s: float  # seconds per token at one stream
    itl_per_stream_s: float  # added per stream decoding beside it
    reports_queue: bool  # vLLM-style per-request metrics: the engine's queue time is its own phase


def engines(models: int, seed: int) -> dict[str, Engine]:
    rng = random.Random(seed)
    out = {}
    for i in range(models):
        name = f"{'chat' if i % 4 else 'batch'}-{i:02d}"
        out[name] = Engine(rng.uniform(3000, 20000), rng.uniform(0.01, 0.04), 1 / rng.uniform(50, 150), rng.uniform(0.0002, 0.0008),
                           i % 3 == 0)
    return out


def timing(rng: random.Random, model: str, engine: Engine, received_ns: int) -> RequestTiming:
    """One request as the relay measures it, on the monotonic clock (received at `received_ns`)."""
    api, endpoint = rng.choice(APIS)
    stream = rng.random() < 0.9
    t = RequestTiming(received_ns=received_ns, api=api, endpoint=endpoint, model=model, stream=stream)  # type: ignore[arg-type]
    long_prompt = rng.random() < 0.1
    prompt = int(rng.uniform(20_000, 120_000) if long_prompt else math.exp(rng.uniform(math.log(50), math.log(6000))))
    cached = int(prompt * rng.uniform(0.5, 0.95)) if (long_prompt and rng.random() < 0.6) or rng.random() < 0.1 else 0
    output = int(math.exp(rng.uniform(math.log(5), math.log(200))))
    streams = rng.randint(1, 32)
    stall = 4.0 if rng.random() < 0.03 else 1.0
    t.body_end_ns = received_ns + int(rng.uniform(0.05, 2.0) * MS)
    t.issued_ns = t.body_end_ns + int(rng.uniform(0.05, 0.3) * MS)
    t.first_event_ns = t.issued_ns + int(rng.uniform(0.0, 0.2) * MS)
    if rng.random() < 0.02:  # a new connection
        t.tcp_start_ns, t.tcp_end_ns = t.first_event_ns, t.first_event_ns + int(rng.uniform(0.2, 3) * MS)
        t.send_start_ns = t.tcp_end_ns
    else:
        t.send_start_ns = t.first_event_ns
    t.sent_ns = t.send_start_ns + int(rng.uniform(0.02, 0.5) * MS * (1 + prompt / 20_000))
    t.rtt_s = rng.uniform(0.0002, 0.004)
    t.prompt_tokens, t.cached_prompt_tokens = prompt, (cached or None)
    t.tokenize_prompt_s = (prompt - 0.9 * cached) * rng.uniform(0.3e-6, 0.8e-6)
    queue_s = rng.expovariate(1 / 0.05) if rng.random() < 0.3 else 0.0
    prefill_s = (engine.fixed_s + (prompt - cached) / engine.prefill_tps) * rng.uniform(0.95, 1.05) * stall
    ttft_ns = t.sent_ns - received_ns + int((queue_s + prefill_s + (t.rtt_s or 0)) * 1e9)
    t.headers_ns = t.sent_ns + int(rng.uniform(1, 20) * MS)
    itl = (engine.itl_1_s + engine.itl_per_stream_s * (streams - 1)) * rng.uniform(0.95, 1.05) * stall
    roll = rng.random()
    outcome = "ok" if roll < 0.93 else "upstream_error" if roll < 0.96 else "client_disconnect" if roll < 0.985 else "timeout"
    t.outcome = outcome  # type: ignore[assignment]
    t.status_code = 200 if outcome != "upstream_error" else rng.choice((500, 503, 429))
    if outcome == "upstream_error":
        t.upstream_end_ns = t.response_end_ns = t.headers_ns + int(rng.uniform(1, 50) * MS)
        t.error = "upstream returned an error"
        t.completion_tokens = None
        return t
    first = received_ns + max(ttft_ns, t.headers_ns - received_ns + MS)
    if outcome != "ok":
        output = max(2, output // rng.randint(2, 6))
    per_chunk = rng.choice((1, 1, 2, 3, 4))
    if stream:
        t.content_ns = [first + int(k * per_chunk * itl * 1e9) for k in range(max(1, output // per_chunk))]
        t.content_choice = [0] * len(t.content_ns)
        t.first_sent_ns = first + int(rng.uniform(0.01, 0.08) * MS)
        t.in_flight_at_decode = streams
        t.upstream_end_ns = t.content_ns[-1] + int(rng.uniform(0.1, 1) * MS)
    else:
        t.upstream_end_ns = first + int(output * itl * 1e9)
    t.response_end_ns = t.upstream_end_ns + int(rng.uniform(0.02, 0.3) * MS)
    t.completion_tokens = output
    if engine.reports_queue and stream:
        t.engine = EngineTimings(source="vllm", queue_s=queue_s, prompt_s=prefill_s)
    return t


def records(n: int, start_unix_ns: int, span_s: float, models: int = 20, instances: int = 4, seed: int = 0) -> Iterator[dict[str, Any]]:
    """`n` records, the requests' ends spread evenly over `span_s` from `start_unix_ns` (wall clock),
    each with a stable `id`, as `records export` writes them."""
    rng = random.Random(seed)
    laws = engines(models, seed)
    names = sorted(laws)
    slos = SLOs(objectives=OBJECTIVES)
    step_ns = int(span_s * 1e9 / max(1, n))
    for i in range(n):
        model = names[rng.randrange(len(names))] if rng.random() < 0.5 else names[min(len(names) - 1, int(rng.expovariate(0.25)))]
        instance = f"pod-{rng.randrange(instances)}"
        t = timing(rng, model, laws[model], 10**12)
        b = split(t)
        ctx = RequestContext(t, 0)
        end_unix_ns = start_unix_ns + i * step_ns
        ctx.wall_offset_ns = end_unix_ns - int(b.e2e_s * 1e9) - t.received_ns
        ctx.verdict = slos.judge(t, b)
        record = record_dict(ctx, b)
        record["upstream"] = f"vllm-{model}"
        record["instance"] = instance
        record["id"] = f"{instance}/fleet-{seed}/{i}"
        yield record


def lines(n: int, start_unix_ns: int, span_s: float, pool: int = 100_000, **kwargs: Any) -> Iterator[bytes]:
    """`n` records as JSON lines, their ends spread evenly over `span_s`: for a store of millions, the
    first `pool` made as `records` makes them (100 µs each), then made again with a new id and end time
    (the same mix and laws: 3 µs each)."""
    made = list(records(min(n, pool), start_unix_ns, span_s * min(n, pool) / max(1, n), **kwargs))
    step_ns = int(span_s * 1e9 / max(1, n))
    for i in range(n):
        record = made[i % len(made)]
        if i >= len(made):
            record = {**record, "id": f"{record['instance']}/fleet-{kwargs.get('seed', 0)}/{i}"}
            record["received_unix_ns"] = start_unix_ns + i * step_ns - int(record["duration_s"] * 1e9)
        yield orjson.dumps(record) + b"\n"


def fingerprint(records_: list[dict[str, Any]]) -> str:
    """What a set of records is, to compare two stores' contents."""
    return hashlib.sha256(b"".join(orjson.dumps(r, option=orjson.OPT_SORT_KEYS) for r in sorted(records_, key=lambda r: r["id"]))).hexdigest()
