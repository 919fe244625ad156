"""What one request leaves behind for its telemetry (`RequestContext`, owned by the relay's Exchange),
and the record stored of it (`record_dict`): built once, at finish, by the records sink."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..wire.chunk import BodyInfo
from ..wire.tokens import PromptParts
from .slo import Verdict
from .timing import Breakdown, RequestTiming
from .tracing import RequestSpans


class Lesson(Protocol):
    """What the fleet learns from a finished request: told by measurement when the request's numbers are final
    (before the sinks read them, so that what it writes on the record is stored), without measurement knowing the fleet."""

    def finished(self, t: RequestTiming, b: Breakdown | None) -> None: ...


@dataclass(slots=True)
class RequestContext:
    """What one request leaves behind for its telemetry; owned by the relay's Exchange."""

    timing: RequestTiming
    wall_offset_ns: int  # epoch ns - monotonic ns, for span timestamps
    spans: RequestSpans | None = None
    request: dict[str, Any] | None = None  # the parsed request body, for the tokenizer; dropped at finish
    request_size: int = 0
    prompt_parts: PromptParts | None = None  # the prompt as texts to count (a big body, read in the worker)
    usage: dict[str, Any] | None = None  # the stream's usage object
    body: BodyInfo | None = None  # what a non-streaming JSON response said
    upstream: str = ""  # the `upstream` label of the upstream the router chose ("": none was)
    server: tuple[str, int] | None = None  # its host and port (server.address on spans)
    verdict: Verdict | None = None  # judged against its service-level objective (slo.py), at finish
    lesson: Lesson | None = None  # what its replica learns from it at finish (fleet/placement.py), told by telemetry
    finished: bool = False

    @property
    def trace_id(self) -> str | None:
        return self.spans.trace_id if self.spans is not None else None


MAX_OFFSETS = 4096  # content-chunk offsets kept per record
def record_dict(ctx: RequestContext, b: Breakdown) -> dict[str, Any]:
    """The stored per-request record: timings and counts, never text or credentials."""
    t = ctx.timing
    received = t.received_ns
    record: dict[str, Any] = {
        "api": t.api,
        "endpoint": t.endpoint,
        "model": t.model,  # (made storable where it was read: relay.py, telemetry.py)
        "tenant": t.tenant,
        "user": t.user or None,
        "response_model": t.response_model,
        "stream": t.stream,
        "status_code": t.status_code,
        "outcome": t.outcome,
        "error": t.error,
        "duration_s": b.e2e_s,
        "ttft_s": b.ttft_s,
        # The first token read with later ones (the proxy was late to them): placed this long before its read's stamp,
        # at the rate the later reads measured (reads.py); 0 when it was read alone.
        "first_token_inferred_s": b.inferred_s,
        "decode_s": b.decode_s,
        "decode_tokens_per_second": b.decode_tokens_per_second,
        "choice_decode_tokens_per_second": b.choice_decode_tps,
        "choices": b.choices,
        "prefill_tokens_per_second": b.prefill_tokens_per_second,
        "phases_s": b.phases,
        "reasoning_estimated": "reasoning" in b.phases,
        "proxy_parts_s": {"before": b.proxy_before_s, "first_token": b.proxy_first_s, "after": b.proxy_after_s},
        "client_blocked_s": b.client_blocked_s,  # the relay waited on a slow reader (its connection's write buffer full)
        "read_held_s": t.held_s,  # the upstream's reading paused for it (the read-ahead full): unmeasured client_backpressure
        "dominant_phase": b.dominant,
        "connect_s": b.connect,
        "pool_wait_s": b.pool_wait_s,
        "rtt_s": t.rtt_s,
        "reused_connection": t.reused,
        "prompt_tokens": t.prompt_tokens,
        "cached_prompt_tokens": t.cached_prompt_tokens,
        "prefix_predicted_tokens": t.prefix_predicted_tokens,  # (of those, what the replica's prefix index predicted: prefix.py)
        "prompt_uncounted_parts": t.prompt_uncounted_parts,
        "completion_tokens": t.completion_tokens,
        "reasoning_tokens": t.reasoning_tokens,
        "hidden_reasoning_tokens": t.hidden_reasoning_tokens,
        "token_source": t.token_source,
        "tokenize_prompt_s": t.tokenize_prompt_s,
        "tokenize_looked_up_tokens": t.tokenize_looked_up_tokens,
        "content_chunks": len(t.content_ns),
        "malformed_chunks": t.malformed_chunks,
        "unmeasured": t.unmeasured,
        "inter_token_p50_s": _median(b.inter_token_s),
        "engine": t.engine.as_dict() if t.engine is not None else None,
        "received_unix_ns": t.received_ns + ctx.wall_offset_ns,
        "in_flight_at_decode": t.in_flight_at_decode,
        # Each content chunk's arrival, ms after the request was received (the waterfall's ticks).
        # (Rounded to the µs in integers: round(x, 3) per offset cost 4x more, 40 µs a 100-token request.)
        "content_offsets_ms": [(ns - received + 500) // 1000 / 1000 for ns in t.content_ns[:MAX_OFFSETS]],
        "content_offsets_truncated": len(t.content_ns) > MAX_OFFSETS,
    }
    # Every attempt (none: it never went upstream), the abandoned ones first (upstream, why, when it started after
    # the request, how long it ran); the last one's `abandoned` is null (the request's outcome is its own).
    attempts: list[dict[str, Any]] = [{"upstream": a.upstream, "abandoned": a.reason, "offset_s": (a.start_ns - received) / 1e9,
                                       "duration_s": (a.end_ns - a.start_ns) / 1e9} for a in t.attempts]
    if attempts or t.issued_ns is not None:
        start = t.issued_ns if t.issued_ns is not None else t.attempts[-1].end_ns
        attempts.append({"upstream": ctx.upstream, "abandoned": None, "offset_s": (start - received) / 1e9,
                         "duration_s": ((t.response_end_ns or start) - start) / 1e9})
    record["attempts"] = attempts
    if ctx.verdict is not None:
        record.update(ctx.verdict.as_record())
    if ctx.trace_id:
        record["trace_id"] = ctx.trace_id
    return record


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
