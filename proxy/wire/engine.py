"""Engine-reported per-request timings, joined to the proxy's own measurement.

- llama.cpp's server puts `timings` in the last stream chunk and in non-streaming bodies:
  `prompt_n`, `prompt_ms` (prompt processing = the engine's prefill), `predicted_n`,
  `predicted_ms`, `predicted_per_token_ms`, `cache_n` (prompt tokens served from its cache).
- vLLM with `--enable-per-request-metrics` (0.32.0 has it; see tests/data/vllm-0.32.0) puts a
  `metrics` object on the usage chunk (stream) or at the top level: `queue_time_ms`,
  `time_to_first_token_ms` (counted from scheduling, so: its prefill), `generation_time_ms`,
  `mean_itl_ms`. Without the flag, vLLM's timings come as spans through the propagated trace.
- TGI answers with headers `x-queue-time`, `x-inference-time`, `x-time-per-token` (ms),
  `x-prompt-tokens`, `x-generated-tokens`; it does not split inference into prefill and decode.

- Ollama puts `load_duration`, `prompt_eval_duration`, `eval_duration` (ns) and the counts on its
  last object (`done: true`) and on bodies.

With them the proxy splits its `prefill` phase into the engine's own `prefill`, its model `load`
(Ollama) and the rest, `queue` (waiting for a slot, the server's HTTP handling and tokenization),
and a non-streaming `server` phase into queue, load, prefill and decode (or queue and the rest, for TGI).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Mapping

COUNT_MAX = (1 << 63) - 1  # what a store's integer column holds: a count from outside past it is no count
EngineSource = Literal["llama.cpp", "vllm", "tgi", "ollama"]


@dataclass(slots=True)
class EngineTimings:
    source: EngineSource
    prompt_s: float | None = None  # the engine's prefill
    decode_s: float | None = None
    per_token_s: float | None = None
    queue_s: float | None = None  # the engine's own queue wait, when it reports one
    load_s: float | None = None  # loading the model before the request could run (Ollama's load_duration)
    prompt_tokens: int | None = None
    predicted_tokens: int | None = None
    cached_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(obj: Mapping[str, Any], key: str, scale: float = 1.0) -> float | None:
    """A duration the engine reported, scaled to seconds: finite and not negative, else None (a `nan` header or an
    overflowing number is no time, and would poison every sum it entered: a phase, a histogram's)."""
    value = obj.get(key)
    if isinstance(value, (bytes, str)):
        try:
            value = float(value)
        except (ValueError, OverflowError):
            return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        seconds = float(value) * scale
    except OverflowError:  # (an integer past a float's range)
        return None
    return seconds if 0.0 <= seconds < math.inf else None


def _int(obj: Mapping[str, Any], key: str) -> int | None:
    """A count the engine reported: a non-negative integer a store can hold, else None."""
    value = obj.get(key)
    if isinstance(value, (bytes, str)) and value.isdigit() and len(value) < 20:
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= COUNT_MAX else None


def from_llamacpp(timings: Any) -> EngineTimings | None:
    """llama.cpp's `timings` object, milliseconds converted to seconds."""
    if not isinstance(timings, dict):
        return None
    prompt_s, decode_s = _num(timings, "prompt_ms", 1e-3), _num(timings, "predicted_ms", 1e-3)
    if prompt_s is None and decode_s is None:
        return None
    return EngineTimings("llama.cpp", prompt_s=prompt_s, decode_s=decode_s, per_token_s=_num(timings, "predicted_per_token_ms", 1e-3),
                         prompt_tokens=_int(timings, "prompt_n"), predicted_tokens=_int(timings, "predicted_n"),
                         cached_tokens=_int(timings, "cache_n"))


def from_vllm(metrics: Any) -> EngineTimings | None:
    """vLLM's per-request `metrics` object (--enable-per-request-metrics)."""
    if not isinstance(metrics, dict):
        return None
    prompt_s = _num(metrics, "time_to_first_token_ms", 1e-3)
    if prompt_s is None:
        return None
    return EngineTimings("vllm", prompt_s=prompt_s, decode_s=_num(metrics, "generation_time_ms", 1e-3),
                         per_token_s=_num(metrics, "mean_itl_ms", 1e-3), queue_s=_num(metrics, "queue_time_ms", 1e-3))


def from_ollama(obj: Any) -> EngineTimings | None:
    """Ollama's last object (`done: true`) or body: durations in ns, tokens counted."""
    if not isinstance(obj, dict):
        return None
    prompt_s, decode_s = _num(obj, "prompt_eval_duration", 1e-9), _num(obj, "eval_duration", 1e-9)
    if prompt_s is None and decode_s is None:
        return None
    predicted = _int(obj, "eval_count")
    return EngineTimings("ollama", prompt_s=prompt_s, decode_s=decode_s, per_token_s=decode_s / predicted if decode_s is not None and predicted else None,
                         load_s=_num(obj, "load_duration", 1e-9), prompt_tokens=_int(obj, "prompt_eval_count"), predicted_tokens=predicted)


def from_tgi(headers: list[tuple[bytes, bytes]]) -> EngineTimings | None:
    """TGI's timing headers on a response, if it sent them."""
    found = {k.lower().decode("latin-1"): v for k, v in headers if k[:2].lower() == b"x-"}
    queue_s = _num(found, "x-queue-time", 1e-3)
    inference_s = _num(found, "x-inference-time", 1e-3)
    if queue_s is None and inference_s is None:
        return None
    return EngineTimings("tgi", queue_s=queue_s, per_token_s=_num(found, "x-time-per-token", 1e-3),
                         prompt_tokens=_int(found, "x-prompt-tokens"), predicted_tokens=_int(found, "x-generated-tokens"))


def refine(phases: dict[str, float], engine: EngineTimings | None) -> dict[str, float]:
    """Split the proxy's server-side phase with the engine's own numbers; the sum is unchanged."""
    if engine is None:
        return phases
    out = dict(phases)
    if "prefill" in out:
        if engine.prompt_s is not None:
            prefill = min(engine.prompt_s, out["prefill"])
        elif engine.queue_s is not None:
            prefill = out["prefill"] - min(engine.queue_s, out["prefill"])
        else:
            return phases
        rest = out["prefill"] - prefill
        load = min(engine.load_s or 0.0, rest)
        out["queue"], out["prefill"] = rest - load, prefill
        if load:
            out["load"] = load
    elif "server" in out:
        server = out["server"]
        if engine.prompt_s is not None and engine.decode_s is not None:
            prefill = min(engine.prompt_s, server)
            decode = min(engine.decode_s, server - prefill)
            load = min(engine.load_s or 0.0, server - prefill - decode)
            del out["server"]
            out.update(queue=server - prefill - decode - load, prefill=prefill, decode=decode)
            if load:
                out["load"] = load
        elif engine.queue_s is not None:  # TGI: queue, and inference as one
            queue = min(engine.queue_s, server)
            out.update(queue=queue, server=server - queue)
    return out
