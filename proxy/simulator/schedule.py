"""The simulator's nouns: its settings (`SimConfig`, changed at run time by `POST /sim/config`), what it saw
(`SimStats`), and one request's schedule (`Plan`: when each chunk is ready, what its usage says)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SimConfig:
    prefill_tps: float = 5000.0
    ttft_ms: float = -1.0  # >= 0: a fixed TTFT instead of prompt tokens / prefill_tps
    decode_tps: float = 100.0
    jitter: float = 0.0  # each inter-token gap scaled by uniform(1 - jitter, 1 + jitter)
    chunk_tokens: int = 1  # tokens per content chunk
    default_max_tokens: int = 100
    role_chunk: bool = True
    usage_null_chunks: bool = True  # with include_usage, every chunk carries "usage": null (OpenAI)
    deterministic: bool = False  # fixed `created`, for byte comparisons
    seed: int = 0
    # Continuous batching (chat and completions streams): with either set, each next token takes
    # alpha + beta x (streams decoding now) per token, decided as the one before it goes out, instead
    # of 1 / decode_tps: time per token grows with the batch, as an engine's does.
    batch_alpha_ms: float = 0.0
    batch_beta_ms: float = 0.0
    # One prefill at a time, first come first served (an engine's prefill unit is shared): a request's
    # queue is the prefill work sent before it. Off: each request prefills on its own.
    prefill_queue: bool = False
    stall_after: int = -1  # >= 0: every stream goes silent after this many content chunks (a stuck replica: 0, after its headers)
    # A sick replica: every generation request answered at once with this status (a crashed engine behind a
    # healthy port: 503; overloaded: 429), with `retry_after` (seconds) as its Retry-After header when set.
    error_status: int = 0
    retry_after: str = ""
    prefix_cache_tokens: int = 0  # > 0: a prefix cache of this many tokens (cache.py) serves prompts it has seen
    # The fleet's common faults: a full engine (a generation request arriving while `max_streams` are in flight is a 429,
    # with `retry_after`), a chat stream that fails in-band after `stream_error_after` content chunks (vLLM's `data:
    # {"error": ...}` then [DONE], under its 200), prompts over `error_over_tokens` refused with a 500, and a wedged
    # engine (`wedged`: every request, /health too, accepted and never answered).
    max_streams: int = 0
    stream_error_after: int = -1
    error_over_tokens: int = 0
    wedged: bool = False

    @property
    def batching(self) -> bool:
        return self.batch_alpha_ms > 0 or self.batch_beta_ms > 0

    def batch_gap_s(self, decoding: int) -> float:
        """Seconds per token with `decoding` streams in the batch (this one included)."""
        return (self.batch_alpha_ms + self.batch_beta_ms * decoding) / 1000


class SimStats:
    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.disconnects = 0
        self.tokens_sent = 0
        self.last_headers: dict[str, str] = {}
        self.last_body: dict[str, Any] = {}
        # For each content chunk of the last stream: monotonic instants just before and just after it
        # was handed to the server (it went out in between).
        self.last_send_times: list[tuple[float, float]] = []
        self.last_received = 0.0  # when the last generation request reached the app (its schedule's zero)
        self.prompt_tokens = 0  # of every generation request
        self.cached_tokens = 0  # of those, served from the prefix cache

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "completed": self.completed, "disconnects": self.disconnects, "tokens_sent": self.tokens_sent,
                "last_headers": self.last_headers, "last_body": self.last_body, "last_send_times": self.last_send_times,
                "last_received": self.last_received, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


@dataclass
class Plan:
    chunks: list[tuple[float, int, str, list[str]]]
    usage: dict[str, Any]
    queue: float  # seconds waiting before prefill
    first: float  # prefill done (before hidden reasoning)
    gap: float
    choices: int
    hidden: int = 0  # reasoning tokens generated before the first visible one, never streamed
    thinking_tokens: int = 0  # all reasoning tokens, hidden and visible
    load: float = 0.0  # seconds loading the model (part of queue), before prefill

    @property
    def cached(self) -> int:
        """Prompt tokens served from the cache (x-sim-cached-tokens)."""
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    @property
    def end(self) -> float:
        return self.chunks[-1][0] if self.chunks else self.first

    def vllm_metrics(self) -> dict[str, Any]:
        """vLLM's --enable-per-request-metrics object, from this schedule."""
        ttft = (self.chunks[0][0] if self.chunks else self.first) - self.queue
        generation = self.end - (self.chunks[0][0] if self.chunks else self.first)
        tokens = self.usage["completion_tokens"]
        return {"time_to_first_token_ms": ttft * 1000, "generation_time_ms": generation * 1000, "queue_time_ms": self.queue * 1000,
                "mean_itl_ms": self.gap * 1000, "tokens_per_second": tokens / max(1e-9, self.end - self.queue), "speculative_decoding": None}
