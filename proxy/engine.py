"""Engine-reported per-request timings, joined to the proxy's own measurement.

llama.cpp's server puts `timings` in the last stream chunk and in non-streaming bodies:
`prompt_n`, `prompt_ms` (prompt processing = the engine's prefill), `predicted_n`, `predicted_ms`,
`predicted_per_token_ms`, `cache_n`. With them the proxy splits its `prefill` phase into the
engine's own `prefill` and the rest, `queue` (waiting for a slot, the server's HTTP handling and
tokenization), and a non-streaming `server` phase into queue, prefill and decode.
vLLM reports no per-request timings in its OpenAI responses; its queue/prefill/decode come as
spans through the W3C trace context the proxy propagates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class EngineTimings:
    source: str
    prompt_s: float | None = None
    decode_s: float | None = None
    per_token_s: float | None = None
    prompt_tokens: int | None = None
    predicted_tokens: int | None = None
    cached_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "prompt_s": self.prompt_s, "decode_s": self.decode_s, "per_token_s": self.per_token_s,
                "prompt_tokens": self.prompt_tokens, "predicted_tokens": self.predicted_tokens, "cached_tokens": self.cached_tokens}


def _num(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def from_llamacpp(timings: Any) -> EngineTimings | None:
    """llama.cpp's `timings` object, milliseconds converted to seconds."""
    if not isinstance(timings, dict):
        return None
    prompt_ms, predicted_ms, per_token_ms = _num(timings, "prompt_ms"), _num(timings, "predicted_ms"), _num(timings, "predicted_per_token_ms")
    if prompt_ms is None and predicted_ms is None:
        return None
    return EngineTimings(
        source="llama.cpp",
        prompt_s=prompt_ms / 1000 if prompt_ms is not None else None,
        decode_s=predicted_ms / 1000 if predicted_ms is not None else None,
        per_token_s=per_token_ms / 1000 if per_token_ms is not None else None,
        prompt_tokens=_int(timings, "prompt_n"),
        predicted_tokens=_int(timings, "predicted_n"),
        cached_tokens=_int(timings, "cache_n"),
    )


def refine(phases: dict[str, float], engine: EngineTimings | None) -> dict[str, float]:
    """Split the proxy's server-side phase with the engine's own numbers; the sum is unchanged."""
    if engine is None or engine.prompt_s is None:
        return phases
    out = dict(phases)
    if "prefill" in out:
        prefill = min(engine.prompt_s, out["prefill"])
        out["queue"], out["prefill"] = out["prefill"] - prefill, prefill
    elif "server" in out and engine.decode_s is not None:
        server = out.pop("server")
        prefill = min(engine.prompt_s, server)
        decode = min(engine.decode_s, server - prefill)
        out.update(queue=server - prefill - decode, prefill=prefill, decode=decode)
    return out
