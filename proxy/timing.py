"""The per-request timing record and the phase split computed from it.

Instants are monotonic integer nanoseconds (`*_ns`, from `time.monotonic_ns`); durations are float
seconds (`*_s`). The relay only stores instants and counts; `finalize()` turns them into durations
exactly once, when the request ends, whatever the ending. Definitions (the README quotes them):

- ttft = first content chunk - request received by the proxy.
- decode = last content chunk - first content chunk;
  decode_tokens_per_second = (completion_tokens - 1) / decode, only when completion_tokens >= 2
  and decode > 0.
- inter_token_latency = gap between consecutive content chunks / tokens in the later chunk.
- phases, which sum to the end-to-end duration:
  proxy    = (upstream request issued - received) + (response finished - upstream stream ended)
  network  = pool wait + DNS + TCP + TLS + one RTT
  tokenize = the measured prompt tokenization (the server pays it too, before prefill)
  prefill  = ttft - proxy(before upstream) - network - tokenize  (the server's queue + prefill)
  decode   = upstream stream ended - first content chunk (decode plus the closing chunks)
  Non-streaming responses have no first chunk: their server time is the phase `server`.
  network and tokenize are capped so that prefill is never negative and the sum stays exact.
  When the engine reports its own timings (llama.cpp), `prefill` becomes the engine's prompt
  processing time and the rest of it `queue`; `server` splits into queue, prefill and decode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .engine import EngineTimings, refine

now_ns = time.monotonic_ns

NS = 1_000_000_000
OUTCOMES = ("ok", "upstream_error", "client_disconnect", "timeout", "proxy_error")
PHASES = ("proxy", "network", "tokenize", "queue", "prefill", "decode", "server")


def _s(start_ns: int | None, end_ns: int | None) -> float | None:
    if start_ns is None or end_ns is None:
        return None
    return max(0, end_ns - start_ns) / NS


@dataclass(slots=True)
class RequestTiming:
    """Everything measured about one request. Filled by the relay, read once by finalize()."""

    received_ns: int
    endpoint: str = "other"
    model: str = "unknown"
    stream: bool = False
    # upstream exchange (httpcore trace events and our DNS step)
    issued_ns: int | None = None
    first_event_ns: int | None = None
    dns_start_ns: int | None = None
    dns_end_ns: int | None = None
    tcp_start_ns: int | None = None
    tcp_end_ns: int | None = None
    tls_start_ns: int | None = None
    tls_end_ns: int | None = None
    headers_ns: int | None = None
    rtt_s: float | None = None  # kernel smoothed RTT of the connection used (TCP_INFO)
    # body
    content_ns: list[int] = field(default_factory=list)  # one instant per content chunk
    chunk_text: list[str] = field(default_factory=list)  # kept in memory only, for token counts
    upstream_end_ns: int | None = None
    response_end_ns: int | None = None
    # tokens
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_source: str = "usage"
    tokenize_prompt_s: float | None = None
    tokenize_completion_s: float | None = None
    chunk_tokens: list[int] | None = None  # tokens per content chunk, filled at finalize
    # result
    status_code: int = 0
    outcome: str = "ok"
    error: str = ""
    response_model: str = ""
    malformed_chunks: int = 0
    engine: EngineTimings | None = None  # the upstream engine's own timings, when it reports them
    captured_input: str = ""  # prompt text, only with --capture-content (spans only)
    captured_output: str = ""  # completion text, only with --capture-content (spans only)
    finalized: bool = False
    in_flight: bool = False  # counted in llmproxy_requests_in_flight (refused requests never are)

    @property
    def reused(self) -> bool | None:
        """True when the request went out on a pooled connection (no connect event fired)."""
        if self.first_event_ns is None:
            return None
        return self.tcp_start_ns is None


@dataclass(slots=True)
class Breakdown:
    """Durations in seconds derived from one RequestTiming."""

    e2e_s: float
    ttft_s: float | None
    decode_s: float | None
    decode_tokens_per_second: float | None
    prefill_tokens_per_second: float | None
    phases: dict[str, float]
    connect: dict[str, float]  # dns/tcp/tls, new connections only
    pool_wait_s: float | None
    inter_chunk_s: list[float]
    inter_token_s: list[float]
    proxy_before_s: float = 0.0  # the proxy phase, split: before the upstream request was issued
    proxy_after_s: float = 0.0  # and after the upstream stream ended

    @property
    def dominant(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "none"


def split(t: RequestTiming) -> Breakdown:
    """Durations and the phase split; pure arithmetic on the record (unit-tested exactly)."""
    end_ns = t.response_end_ns if t.response_end_ns is not None else now_ns()
    e2e = max(0, end_ns - t.received_ns) / NS

    connect: dict[str, float] = {}
    dns = _s(t.dns_start_ns, t.dns_end_ns)
    tcp_from = t.dns_end_ns if t.dns_end_ns is not None else t.tcp_start_ns
    tcp = _s(tcp_from, t.tcp_end_ns)
    tls = _s(t.tls_start_ns, t.tls_end_ns)
    for name, value in (("dns", dns), ("tcp", tcp), ("tls", tls)):
        if value is not None:
            connect[name] = value
    pool_wait = _s(t.issued_ns, t.first_event_ns)
    rtt = t.rtt_s if t.rtt_s is not None else (tcp or 0.0)
    network = (pool_wait or 0.0) + sum(connect.values()) + (rtt if t.headers_ns is not None else 0.0)

    first = t.content_ns[0] if t.content_ns else None
    last = t.content_ns[-1] if t.content_ns else None
    ttft = _s(t.received_ns, first)
    decode = _s(first, last)

    tokens = t.completion_tokens
    decode_tps = (tokens - 1) / decode if tokens is not None and tokens >= 2 and decode else None

    gaps = [(b - a) / NS for a, b in zip(t.content_ns, t.content_ns[1:])]
    per_chunk = t.chunk_tokens or [1] * len(t.content_ns)
    itl = [gap / max(1, n) for gap, n in zip(gaps, per_chunk[1:])]

    proxy_before = _s(t.received_ns, t.issued_ns) or 0.0
    upstream_end = t.upstream_end_ns if t.upstream_end_ns is not None else end_ns
    proxy_after = max(0, end_ns - upstream_end) / NS
    phases = {"proxy": proxy_before + proxy_after}
    tokenize = t.tokenize_prompt_s or 0.0
    if ttft is not None and first is not None:
        budget = max(0.0, ttft - proxy_before)
        network = min(network, budget)
        tokenize = min(tokenize, budget - network)
        phases.update(network=network, tokenize=tokenize, prefill=budget - network - tokenize)
        phases["decode"] = max(0, upstream_end - first) / NS
    else:
        budget = max(0.0, e2e - phases["proxy"])
        network = min(network, budget)
        tokenize = min(tokenize, budget - network)
        phases.update(network=network, tokenize=tokenize, server=budget - network - tokenize)
    phases = refine(phases, t.engine)
    prefill_s = phases.get("prefill")
    prefill_tps = t.prompt_tokens / prefill_s if t.prompt_tokens and prefill_s else None
    return Breakdown(
        e2e_s=e2e,
        ttft_s=ttft,
        decode_s=decode,
        decode_tokens_per_second=decode_tps,
        prefill_tokens_per_second=prefill_tps,
        phases=phases,
        connect=connect,
        pool_wait_s=pool_wait,
        inter_chunk_s=gaps,
        inter_token_s=itl,
        proxy_before_s=proxy_before,
        proxy_after_s=proxy_after,
    )
