"""The per-request timing record and the phase split computed from it.

Instants are monotonic integer nanoseconds (`*_ns`, from `time.monotonic_ns`); durations are float
seconds (`*_s`). The relay only stores instants and counts; `split()` turns them into durations
exactly once, when the request ends, whatever the ending. Definitions (docs/definitions.md quotes them):

- ttft = first content chunk of any choice - request received by the proxy.
- Each choice (`choices[].index`) is its own sequence. Per choice: decode tokens = the tokens in
  its content chunks after its first one; decode tok/s = those tokens / (its last content chunk -
  its first); inter-token latency = gap between its consecutive content chunks / tokens in the
  later chunk. The request's decode tok/s is the mean over its choices. Hidden reasoning tokens
  (reported in usage, never streamed) are not in any chunk, so never in decode.
- phases, which sum to the end-to-end duration:
  client    = request received -> request body fully read (the client's upload), plus, for a slow
              reader, the time after the upstream's end the relay waited on it (its write buffer full)
  proxy     = (body read -> upstream request issued) + (first content chunk read -> handed to
              the server's send) + (upstream stream ended -> last byte handed to the server's send,
              less the client's part of it)
  lag       = the proxy's own delay in getting to bytes that had arrived (its event loop late: a CPU
              quota, a burst, a GC pause): the request body's end, the upstream's connect and its first
              content chunk, each from its arrival in the kernel (measure/arrival.py) to the loop's read
  wait      = the proxy's own waits: for a slot under --max-in-flight (--admission-queue-s: its
              tenant over its share) and for a free upstream connection (its pool full:
              --max-connections, --pool-timeout); queues inside the proxy, never network, never
              the engine's `queue`
  failover  = the time lost on attempts abandoned for another replica (a connect error, a 5xx or 429,
              no first token by the route's deadline): from the first attempt's issue to the last's
  network   = DNS + TCP + (CONNECT through an egress proxy) + TLS + request upload + one RTT
  tokenize  = the proxy's tokenizer CPU time for this prompt, standing for the server's own
  reasoning = hidden reasoning tokens / the request's own decode rate (an estimate)
  prefill   = ttft - all of the above (the server's queue + prefill)
  decode    = upstream stream ended - first content chunk handed on (decode plus the closing chunks)
  Non-streaming responses have no first chunk: their server time is the phase `server`.
  wait, lag, network, tokenize and reasoning are capped so that prefill is never negative and the sum
  stays exact. Instants are when the bytes reached the socket: the request's first byte and its
  body's last in the server protocol (server.py), each upstream piece in the upstream protocol
  (connection.py), by the kernel's stamp when the loop read them late (within a tick: arrival.py),
  never when a task wakes. Bytes that waited in a socket while the loop was away arrive as one read,
  stamped with its last segment: a run of equal content stamps counts as one (its tokens together),
  and a first token read with later ones is put before them at the rate the later reads measured
  (`inferred_s`: how far), never before the response's head. When the engine reports its own timings, `prefill` becomes the engine's prompt
  processing time, `load` its model load (Ollama) and the rest of it `queue`; `server` splits into
  queue, load, prefill and decode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import Outcome
from ..wire.engine import EngineTimings, refine
from .reads import first_arrival, sequences, window

now_ns = time.monotonic_ns
# What the server's protocol (server.py) stamps where the bytes are read, for the relay, in the ASGI
# scope: scope["extensions"][STAMPS] = {"first_byte_ns", "body_end_ns" (0 until read), "blocked":
# [(paused_ns, resumed_ns), ...] and "paused_ns" (0 unless now) when the client's connection stopped
# taking bytes (its write buffer over the high-water mark: a slow reader) and took them again,
# "writer": the body writer of the relay's fast way (pump.py), "lost": the callbacks the protocol calls
# when the client's connection closes (the relay's, while its request runs)}; monotonic instants. Here, below both.
STAMPS = "llmproxy.stamps"

NS = 1_000_000_000
Endpoint = Literal["chat", "completions", "embeddings", "responses", "responses_other", "messages", "messages_other", "generate_content",
                   "gemini_other", "ollama_chat", "ollama_generate", "ollama_embed", "ollama_other", "other"]
Unmeasured = Literal["", "event_too_large", "undecodable", "client_backpressure"]
Phase = Literal["client", "proxy", "lag", "failover", "wait", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server"]
TokenSource = Literal["usage", "engine", "tokenizer"]
PHASES: tuple[Phase, ...] = ("client", "proxy", "lag", "failover", "wait", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server")


def _s(start_ns: int | None, end_ns: int | None) -> float | None:
    if start_ns is None or end_ns is None:
        return None
    return max(0, end_ns - start_ns) / NS


@dataclass(slots=True)
class RequestTiming:
    """Everything measured about one request. Filled by the relay, read once by split()."""

    received_ns: int
    api: str = "other"  # the wire API (proxy/apis/): openai, azure, anthropic, other
    endpoint: Endpoint = "other"
    model: str = "unknown"
    stream: bool = False
    tenant: str = "unknown"  # who sent it (tenants.py): the application or team
    user: str = ""  # its end user ("": none named); records and spans only, never a metric label
    body_end_ns: int | None = None  # the client's request body fully there (its last bytes' arrival: measure/arrival.py)
    body_seen_ns: int | None = None  # ... and read by the loop (later than the arrival: the proxy's lag)
    queued_ns: int | None = None  # it began waiting for a slot under --max-in-flight (admission.py; None: admitted at once)
    admitted_ns: int | None = None  # ... and was admitted, or gave up (--admission-queue-s)
    # upstream exchange (stamped by upstream/pool.py at each step; those of the last attempt)
    issued_ns: int | None = None
    first_issued_ns: int | None = None  # the first attempt's issue, when it was abandoned for another replica
    attempts: list[Any] = field(default_factory=list)  # the abandoned attempts (retry.Attempt), in order
    pool_full: bool = False  # the pool had no free slot when the request was issued (it waited, or was refused)
    first_event_ns: int | None = None
    dns_start_ns: int | None = None
    dns_end_ns: int | None = None
    tcp_start_ns: int | None = None
    tcp_end_ns: int | None = None  # the SYN-ACK's arrival, by the kernel's RTT sample (pool.py)
    tcp_seen_ns: int | None = None  # ... and when the loop saw the connection made (later: the proxy's lag)
    tls_start_ns: int | None = None
    tls_end_ns: int | None = None
    proxy_start_ns: int | None = None  # the CONNECT exchange with an egress proxy (egress.py)
    proxy_end_ns: int | None = None
    send_start_ns: int | None = None  # request headers start going out
    sent_ns: int | None = None  # request body sent (the upload is network time)
    headers_ns: int | None = None
    first_sent_ns: int | None = None  # the first content chunk handed to the server's send
    first_seen_ns: int | None = None  # ... read by the loop (content_ns: when the bytes arrived)
    rtt_s: float | None = None  # kernel smoothed RTT of the connection used (TCP_INFO)
    # body: one entry per (content chunk, choice with text in it)
    content_ns: list[int] = field(default_factory=list)
    content_choice: list[int] = field(default_factory=list)
    chunk_text: list[str] = field(default_factory=list)  # kept in memory only, for token counts
    reasoning_streamed: bool = False  # visible reasoning deltas were streamed
    hidden_reasoning_blocks: int = 0  # blocks of reasoning generated but never streamed (Anthropic redacted_thinking)
    upstream_end_ns: int | None = None
    response_end_ns: int | None = None
    # tokens
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    prefix_predicted_tokens: int | None = None  # of those, what the replica's prefix index predicted (prefix.py; None: not checked)
    prefix_stray: bool = False  # a conversation this proxy had not seen there, and the replica had none of it (prefix.py)
    reasoning_tokens: int | None = None  # as usage reports them (part of completion_tokens)
    prompt_uncounted_parts: int = 0  # prompt parts the tokenizer cannot count (images, audio, files)
    token_source: TokenSource = "usage"
    tokenize_prompt_s: float | None = None
    tokenize_looked_up_tokens: int = 0  # of the prompt's tokens, those the proxy's cache knew (their time: at the measured rate)
    tokenize_completion_s: float | None = None
    chunk_tokens: list[float] | None = None  # tokens per content entry, filled at finish (None: 1 each)
    # result
    status_code: int = 0
    outcome: Outcome = "ok"
    error: str = ""
    response_model: str = ""
    response_id: str = ""  # the answer's id a later request may name (a Responses API response: fleet/routes.py's holders)
    malformed_chunks: int = 0
    unmeasured: Unmeasured = ""  # why the response was relayed but not (wholly) read: an event past the limit, undecodable bytes
    engine: EngineTimings | None = None  # the upstream engine's own timings, when it reports them
    captured_input: str = ""  # prompt text, only with --capture-content (spans only)
    captured_output: str = ""  # completion text, only with --capture-content (spans only)
    in_flight: bool = False  # counted in llmproxy_requests_in_flight (refused requests never are)
    in_flight_at_decode: int | None = None  # requests in flight in this worker when its first content chunk came
    # A slow client: when its connection stopped taking bytes and took them again (the server's
    # protocol stamps them); and how long the upstream's reading was paused for it (read-ahead full).
    client_blocked: list[tuple[int, int]] = field(default_factory=list)
    held_s: float = 0.0

    stale: bool = False  # the pooled connection was closed under the request: it went again on a new one (pool.py)

    @property
    def reused(self) -> bool | None:
        """True when the request went out on a pooled connection (no connect event fired)."""
        if self.first_event_ns is None:
            return None
        return self.tcp_start_ns is None

    def reset_upstream(self) -> None:
        """Forget an upstream attempt (the proxy retries without stream_options, or on another replica)."""
        self.issued_ns = self.first_event_ns = self.headers_ns = self.send_start_ns = self.sent_ns = None
        self.dns_start_ns = self.dns_end_ns = self.tcp_start_ns = self.tcp_end_ns = self.tcp_seen_ns = self.tls_start_ns = self.tls_end_ns = None
        self.first_seen_ns = None
        self.stale = False
        self.proxy_start_ns = self.proxy_end_ns = None
        self.rtt_s = None

    @property
    def hidden_reasoning_tokens(self) -> int:
        """Reasoning tokens usage reports that the stream never showed (o-series, gpt-5)."""
        return 0 if self.reasoning_streamed or not self.reasoning_tokens else self.reasoning_tokens

    @property
    def visible_tokens(self) -> int | None:
        """Completion tokens that were streamed (usage's count minus hidden reasoning)."""
        if self.completion_tokens is None:
            return None
        return max(0, self.completion_tokens - self.hidden_reasoning_tokens)


@dataclass(slots=True)
class Breakdown:
    """Durations in seconds derived from one RequestTiming."""

    e2e_s: float
    ttft_s: float | None
    decode_s: float | None
    decode_tokens_per_second: float | None
    prefill_tokens_per_second: float | None
    phases: dict[str, float]
    connect: dict[str, float]  # dns/tcp/proxy/tls, new connections only
    pool_wait_s: float | None
    inter_chunk_s: list[float]
    inter_token_s: list[float]
    choice_decode_tps: list[float] = field(default_factory=list)  # per choice with a decode window
    choices: int = 0  # choices that streamed content
    proxy_before_s: float = 0.0  # the proxy phase, split: before the upstream request was issued,
    proxy_first_s: float = 0.0  # relaying the first content chunk (on the client's TTFT),
    proxy_after_s: float = 0.0  # and after the upstream stream ended
    client_blocked_s: float = 0.0  # the relay waited on a slow client with bytes to give it
    client_after_s: float = 0.0  # of which after the upstream's end: in the `client` phase, not `proxy`
    inferred_s: float = 0.0  # the first token put this long before its read's stamp (several tokens in one read)

    @property
    def dominant(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "none"


def _carve(phases: dict[str, float], budget: float, parts: tuple[tuple[str, float], ...]) -> float:
    """The phases before the server's, each capped at what `budget` (the upstream's share of the wait)
    has left, in this order, so that the server's part is never negative; what is left for it.
    (`failover` and `lag` only when there was some; a part adds to a phase already there.)"""
    for name, seconds in parts:
        if not seconds and name in ("failover", "lag"):
            continue
        seconds = min(seconds, budget)
        phases[name] = phases.get(name, 0.0) + seconds
        budget -= seconds
    return budget


def split(t: RequestTiming) -> Breakdown:
    """Durations and the phase split; pure arithmetic on the record (unit-tested exactly)."""
    end_ns = t.response_end_ns if t.response_end_ns is not None else now_ns()
    e2e = max(0, end_ns - t.received_ns) / NS

    connect: dict[str, float] = {}
    dns = _s(t.dns_start_ns, t.dns_end_ns)
    tcp_from = t.dns_end_ns if t.dns_end_ns is not None else t.tcp_start_ns
    tcp = _s(tcp_from, t.tcp_end_ns)
    tls = _s(t.tls_start_ns, t.tls_end_ns)
    tunnel = _s(t.proxy_start_ns, t.proxy_end_ns)
    for name, value in (("dns", dns), ("tcp", tcp), ("proxy", tunnel), ("tls", tls)):
        if value is not None:
            connect[name] = value
    pool_wait = _s(t.issued_ns, t.first_event_ns)
    rtt = t.rtt_s if t.rtt_s is not None else (tcp or 0.0)
    upload = _s(t.send_start_ns, t.sent_ns) or 0.0
    wait = pool_wait or 0.0
    network = sum(connect.values()) + upload + (rtt if t.headers_ns is not None else 0.0)
    if t.stale:  # the request first went out on a pooled connection the upstream had closed: that try was the network's
        network += _s(t.first_event_ns, t.dns_start_ns if t.dns_start_ns is not None else t.tcp_start_ns) or 0.0
    lag_connect = _s(t.tcp_end_ns, t.tcp_seen_ns) or 0.0  # the connection was made; the loop saw it later

    gaps: list[float] = []
    itl: list[float] = []
    rates: list[float] = []
    runs: dict[int, list[int]] = {}
    seqs = sequences(t, runs) if t.content_ns else {}
    for choice, (instants, counts) in seqs.items():
        merged = runs.get(choice)
        seq_gaps = [(b - a) / NS for a, b in zip(instants, instants[1:])]
        gaps += seq_gaps
        if merged is None:
            itl += [gap / n if n > 0 else gap for gap, n in zip(seq_gaps, counts[1:])]
        else:
            for gap, n, m in zip(seq_gaps, counts[1:], merged[1:]):  # (each chunk of a read: the read's mean gap per token)
                itl += [gap / n if n > 0 else gap] * m
        window_ns, after = window(t, instants, counts)
        if window_ns > 0 and after > 0:
            rates.append(after * NS / window_ns)
    first = first_arrival(t, seqs) if t.content_ns else None
    last = max(t.content_ns) if t.content_ns else None
    ttft = _s(t.received_ns, first)
    decode = _s(first, last)
    decode_tps = sum(rates) / len(rates) if rates else None

    body_end = t.body_end_ns if t.body_end_ns is not None else t.received_ns
    # The body was there; the loop read it later (not while the request waited for admission: then the server
    # stops reading a large body, and that time is the wait's).
    lag_in = _s(max(body_end, t.admitted_ns or 0), t.body_seen_ns) or 0.0
    first_issued = t.first_issued_ns if t.first_issued_ns is not None else t.issued_ns
    # The admission wait is the proxy's, all of it: a big body's end is read only once admitted (the server stops
    # reading it past 64 KB), so the part of the wait before it is not the client's upload.
    admission = _s(t.queued_ns, t.admitted_ns) or 0.0
    during_upload = 0.0
    if admission and t.queued_ns is not None and t.admitted_ns is not None:
        during_upload = max(0, min(t.admitted_ns, body_end) - max(t.queued_ns, t.received_ns)) / NS
    client = max(0.0, (_s(t.received_ns, body_end) or 0.0) - during_upload)
    proxy_before = _s(body_end, first_issued) or 0.0
    if first_issued is not None:
        lag_in = min(lag_in, proxy_before)
        proxy_before -= lag_in
        admission = min(admission, proxy_before + during_upload)
        proxy_before -= admission - during_upload
    else:  # (refused or failed before anything went upstream)
        lag_in = min(lag_in, max(0.0, e2e - client))
    wait += admission
    failover = _s(first_issued, t.issued_ns) or 0.0 if t.first_issued_ns is not None else 0.0
    upstream_end = t.upstream_end_ns if t.upstream_end_ns is not None else end_ns
    tail_from = max(upstream_end, body_end)
    proxy_after = max(0, end_ns - tail_from) / NS
    # A slow reader: after the upstream's end the relay was still handing it what it had read
    # ahead; the time it waited on the client then is the client's own, not the proxy's.
    blocked = sum(max(0, min(b, end_ns) - max(a, t.received_ns)) for a, b in t.client_blocked) / NS
    client_after = min(proxy_after, sum(max(0, min(b, end_ns) - max(a, tail_from)) for a, b in t.client_blocked) / NS)
    proxy_after -= client_after
    client += client_after
    phases = {"client": client, "proxy": proxy_before + proxy_after}
    if lag_in:
        phases["lag"] = lag_in
    proxy_first = 0.0
    tokenize = t.tokenize_prompt_s or 0.0
    before = (("failover", failover), ("wait", wait), ("lag", lag_connect), ("network", network), ("tokenize", tokenize))
    if t.issued_ns is None:  # refused or failed before anything went upstream: the proxy's own time
        phases["proxy"] = max(0.0, e2e - client - lag_in)
        if admission:  # (of it, the wait for a slot)
            phases["wait"] = min(admission, phases["proxy"])
            phases["proxy"] -= phases["wait"]
    elif ttft is not None and first is not None:
        rest = _carve(phases, max(0.0, ttft - client - proxy_before - lag_in), before)
        hidden = t.hidden_reasoning_tokens
        if hidden and decode_tps:
            phases["reasoning"] = min(rest, hidden / decode_tps)
            rest -= phases["reasoning"]
        phases["prefill"] = rest
        # After its arrival: the first token waited for the loop (lag), then was relayed (proxy), the end read with it.
        decode_window = max(0, upstream_end - first) / NS
        seen = min(max(t.first_seen_ns or first, first), t.first_sent_ns) if t.first_sent_ns else first
        lag_first = min(decode_window, (seen - first) / NS)
        proxy_first = min(decode_window - lag_first, _s(seen, t.first_sent_ns) or 0.0)
        if lag_first:
            phases["lag"] = phases.get("lag", 0.0) + lag_first
        phases["proxy"] += proxy_first
        phases["decode"] = decode_window - lag_first - proxy_first
    else:
        phases["server"] = _carve(phases, max(0.0, e2e - client - phases["proxy"] - lag_in), before)
    if t.issued_ns is not None:
        phases.setdefault("lag", 0.0)  # (present, 0 too, wherever bytes came from upstream: a prompt proxy says so)
    phases = refine(phases, t.engine)
    prefill_s = phases.get("prefill")
    uncached = t.prompt_tokens - (t.cached_prompt_tokens or 0) if t.prompt_tokens else None
    prefill_tps = uncached / prefill_s if uncached and uncached > 0 and prefill_s else None
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
        choice_decode_tps=rates,
        choices=len(seqs),
        proxy_before_s=proxy_before,
        proxy_first_s=proxy_first,
        proxy_after_s=proxy_after,
        client_blocked_s=blocked,
        client_after_s=client_after,
        inferred_s=(t.content_ns[0] - first) / NS if first is not None else 0.0,
    )


def failover_shares(t: RequestTiming, b: Breakdown | None) -> list[tuple[Any, float]]:
    """The phase failover shared among the abandoned attempts (retry.Attempt) by how long each ran: each
    abandoned replica owns its part, never the replica that then served (its own TTFT excludes it)."""
    seconds = b.phases.get("failover", 0.0) if b is not None else 0.0
    total = sum(a.end_ns - a.start_ns for a in t.attempts)
    return [(a, seconds * (a.end_ns - a.start_ns) / total if total else seconds / len(t.attempts)) for a in t.attempts]


def note_slow_client(t: RequestTiming, stamps: dict[str, Any], response: Any) -> None:
    """When the client did not take bytes as fast as they came (the server protocol's stamps), and
    whether the upstream's reading was held back for it (`response`: the upstream connection, or
    None): its later stamps may be the client's pace, so the request is marked and kept out of the
    decode figures."""
    t.client_blocked = list(stamps.get("blocked", ()))
    if stamps.get("paused_ns"):  # still paused at the end (the client left, or was cut)
        t.client_blocked.append((stamps["paused_ns"], t.response_end_ns or now_ns()))
    if response is not None and response.held_back:
        t.held_s = response.held_s
        t.unmeasured = t.unmeasured or "client_backpressure"
