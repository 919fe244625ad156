"""The standing hostile-input suite, property-based (hypothesis): what any client may send and any upstream may stream,
through the request parser and everything that reads a request, every dialect's stream reader behind SSE framing at
any split, and the records' columns and codec. Nothing raises but the errors each defines, and everything kept is
bounded and storable. (A corpus of hostile bodies runs through a real proxy in tests/test_hostile.py.)"""
from __future__ import annotations

import json
import math

import orjson
from hypothesis import HealthCheck, given, settings, strategies as st

from proxy import apis
from proxy.wire import prompt
from proxy.wire.chunk import read_usage
from proxy.wire.engine import COUNT_MAX, from_llamacpp, from_ollama, from_vllm
from proxy.records import Rejected, Writer, codec
from proxy.records import columns as C
from proxy.wire.sse import SSEDecoder
from proxy.serve.tenants import USER_CHARS, api_user, clean
from proxy.wire.text import MODEL_CHARS, storable

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Every character, lone surrogates and controls included (hypothesis leaves surrogates out of text by default).
TEXT = st.text(st.characters(blacklist_categories=()), max_size=24)
KEYS = st.sampled_from(["model", "messages", "input", "contents", "prompt", "system", "instructions", "tools", "user", "metadata",
                        "stream", "stream_options", "n", "images", "content", "parts", "role", "type", "image_url", "url", "source",
                        "data", "inlineData", "text", "name", "user_id", "safety_identifier", "include_usage", "cache_control"]) | TEXT
SCALAR = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True, allow_infinity=True) | TEXT
          | st.sampled_from(["user", "assistant", "system", "model", "image_url", "image", "input_image", "tool_result", "text"]))
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=40)
BODY = st.dictionaries(KEYS, VALUE, max_size=8)
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings", "/api/chat", "/api/generate",
         "/v1beta/models/m:streamGenerateContent", "/openai/deployments/d/chat/completions"]


def engine_json(value: object) -> bytes:
    """What a client writing its own JSON sends (Python's json: lone surrogates escaped, NaN, Infinity, huge integers)."""
    return json.dumps(value).encode()


@FAST
@given(st.sampled_from(PATHS), BODY)
def test_whatever_a_body_holds_every_reader_of_a_request_answers_in_bounds(path, body):
    """The lenient parse takes what an engine takes; the model, the stream flag, the end user, the prompt's parts, its
    chain and its media estimate are read without raising, and what is kept of them is bounded."""
    route = apis.resolve(path)
    raw = engine_json(body)
    parsed = apis.parse_request(route, raw)
    assert parsed is not None  # (Python's json took it, as an engine would)
    model, stream = route.dialect.model_and_stream(route.endpoint, parsed)
    assert isinstance(model, str) and isinstance(stream, bool)
    assert len(storable(model, MODEL_CHARS)) <= MODEL_CHARS
    user = clean(api_user(parsed), USER_CHARS)
    assert len(user) <= USER_CHARS and user.isascii()
    parts = route.dialect.prompt_parts(route.endpoint, parsed)
    assert parts is None or (len(parts.texts) <= 1024 and all(isinstance(t, str) for t in parts.texts) and parts.fixed >= 0)
    inline = prompt.media(prompt.sequence(parsed))
    estimate = prompt.tokens(len(raw), inline)
    assert estimate >= 0 and inline[0] >= 0 and inline[1] >= 0
    made = prompt.chain(parsed, estimate)
    if made is not None:
        assert len(made.hashes) == len(made.tokens) <= prompt.ITEMS_LINKED + 2 and min(made.tokens) >= 1 and made.total >= 0
    injected = route.dialect.inject(route.endpoint, parsed, raw)
    assert injected is None or apis.parse_request(route, injected) is not None


@FAST
@given(st.sampled_from(PATHS), st.binary(max_size=300))
def test_any_bytes_are_parsed_or_left_alone(path, body):
    parsed = apis.parse_request(apis.resolve(path), body)
    assert parsed is None or isinstance(parsed, dict)


EVENT_KEYS = st.sampled_from(["choices", "delta", "content", "index", "usage", "prompt_tokens", "completion_tokens", "type", "error",
                              "code", "response", "message", "text", "candidates", "parts", "usageMetadata", "done", "eval_count",
                              "timings", "metrics", "content_block", "reasoning_content", "tool_calls", "function", "arguments",
                              "time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "prompt_ms", "predicted_ms", "prompt_n",
                              "eval_duration", "prompt_eval_duration", "load_duration", "prompt_tokens_details", "cached_tokens"]) | TEXT
EVENT = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(EVENT_KEYS, inner, max_size=5), max_leaves=30)


# What the engines' own figures ride on, with any values: vLLM's metrics, llama.cpp's timings, usage, Ollama's last object.
FIGURES = st.fixed_dictionaries({}, optional={
    "metrics": st.dictionaries(st.sampled_from(["time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms"]), SCALAR),
    "timings": st.dictionaries(st.sampled_from(["prompt_ms", "predicted_ms", "predicted_per_token_ms", "prompt_n", "predicted_n", "cache_n"]), SCALAR),
    "usage": st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"]), SCALAR),
    "done": st.just(True), "eval_duration": SCALAR, "prompt_eval_duration": SCALAR, "load_duration": SCALAR, "eval_count": SCALAR,
    "choices": st.just([])})


@FAST
@given(st.sampled_from(["openai", "anthropic", "gemini", "ollama", "azure"]),
       st.lists(st.dictionaries(EVENT_KEYS, EVENT, max_size=6) | FIGURES, max_size=6),
       st.integers(1, 64), st.sampled_from([b"\n", b"\r\n"]))
def test_every_dialects_stream_reader_takes_any_event_at_any_split(api, events, size, newline):
    """An upstream's stream of any JSON (and its framing cut anywhere): the same events whatever the split, each read
    without raising, its texts per choice, its usage's counts integers a store holds, its engine times finite."""
    dialect = apis.BY_NAME[api]
    stream = b"".join(b"data: " + engine_json(e) + newline + newline for e in events) + b"data: [DONE]" + newline + newline
    whole = [(e.raw, e.data) for e in SSEDecoder().feed(stream)]
    decoder = SSEDecoder()
    pieces = [(e.raw, e.data) for i in range(0, len(stream), size) for e in decoder.feed(stream[i:i + size])]
    assert pieces + [(e.raw, e.data) for e in decoder.flush()] == whole
    for _, data in whole:
        chunk = dialect.event(data or b"")
        assert all(isinstance(i, int) and isinstance(t, str) for i, t in chunk.texts)
        counts = read_usage(chunk.usage if isinstance(chunk.usage, dict) else None)
        assert all(c is None or 0 <= c <= COUNT_MAX for c in counts)
        for engine in (from_llamacpp(chunk.timings), from_vllm(chunk.metrics), chunk.engine):
            if engine is not None:
                for value in (engine.prompt_s, engine.decode_s, engine.per_token_s, engine.queue_s, engine.load_s):
                    assert value is None or (math.isfinite(value) and value >= 0)
    for obj in events:
        engine = from_ollama(obj)
        assert engine is None or all(v is None or (math.isfinite(v) and v >= 0) for v in (engine.prompt_s, engine.decode_s, engine.load_s))


RECORD = st.fixed_dictionaries(
    {"model": TEXT, "outcome": st.sampled_from(["ok", "upstream_error", "client_disconnect"]), "received_unix_ns": SCALAR | st.integers(0, 2**63),
     "duration_s": SCALAR | st.floats(0, 100)},
    optional={"ttft_s": SCALAR, "decode_tokens_per_second": SCALAR, "prompt_tokens": SCALAR, "completion_tokens": SCALAR,
              "cached_prompt_tokens": SCALAR, "hidden_reasoning_tokens": SCALAR, "in_flight_at_decode": SCALAR,
              "phases_s": st.dictionaries(st.sampled_from(list(C.PHASES)), SCALAR, max_size=4) | SCALAR, "user": TEXT, "tenant": TEXT,
              "instance": TEXT, "upstream": TEXT, "api": TEXT, "endpoint": TEXT, "slo": TEXT, "slo_good": st.booleans() | st.none(),
              "status_code": st.integers(0, 599), "id": TEXT})


@FAST
@given(RECORD)
def test_a_records_columns_are_what_a_store_holds_or_it_is_no_record(record):
    """Any record an import or another writer may hand over: its row made (every text storable, every real finite,
    every integer in a bigint, its JSON storable and read back) or it is refused as no record; nothing else."""
    line = engine_json(record)
    try:
        row = Writer.row(line)
    except Rejected:
        return
    columns = C.Columns(max_models=3)
    made = columns.row(row.rid, row.parsed(), row.data)
    assert len(made) == len(C.COLUMNS) + 1
    for name, value in zip(C.COLUMNS, made):
        if isinstance(value, str):
            assert value == storable(value, len(value)), name
        elif isinstance(value, float):
            assert math.isfinite(value), name
        elif isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63, name
    stored = orjson.loads(codec.unpack(made[-1]))  # (orjson: no NaN, no lone surrogate, no integer past 64 bits)
    assert stored["duration_s"] == record["duration_s"]


@FAST
@given(st.binary(max_size=400))
def test_any_line_of_an_import_is_a_row_or_refused(line):
    try:
        Writer.row(line)
    except Rejected:
        pass


@FAST
@given(st.binary(max_size=2000))
def test_the_codec_gives_back_what_it_was_given(data):
    assert codec.unpack(codec.pack(data)) == data


@FAST
@given(st.lists(st.tuples(TEXT, st.sampled_from([200, 404, 500, 429, 400])), max_size=60))
def test_the_models_the_configuration_knows_are_never_folded(requests):
    """(The records' aggregates keep names by the same ModelLabels: columns.Columns.)"""
    from proxy.measure.labels import served

    kept = C.Columns(5, ("configured",)).models
    for model, status in requests:
        kept(model, served(status))
    assert kept("configured", False) == "configured"
    assert len({model for model, _ in requests if kept(model, False) != "other"} - {"configured"}) <= 5
