"""What counts as a content chunk."""
import orjson

from proxy.chunk import parse_chunk, read_usage, strip_usage_null


def chat(delta, **extra):
    return orjson.dumps({"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **extra})


def test_role_only_and_empty_content_are_not_content():
    assert parse_chunk(chat({"role": "assistant", "content": ""})).text == ""
    assert parse_chunk(chat({})).text == ""


def test_content_reasoning_and_tool_arguments_are_content():
    assert parse_chunk(chat({"content": "hi"})).text == "hi"
    assert parse_chunk(chat({"reasoning_content": "think"})).text == "think"
    tool = {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert parse_chunk(chat(tool)).text == '{"a"'


def test_completions_text_is_content():
    data = orjson.dumps({"choices": [{"index": 0, "text": " word", "finish_reason": None}]})
    assert parse_chunk(data).text == " word"


def test_usage_only_chunk():
    data = orjson.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}, "model": "m"})
    chunk = parse_chunk(data)
    assert chunk.usage_only and chunk.text == "" and chunk.model == "m"
    assert read_usage(chunk.usage) == (5, 7)


def test_invalid_json_is_marked_not_raised():
    assert parse_chunk(b"{not json").valid is False
    assert parse_chunk(b"[1,2]").valid is False


def test_engine_timings_are_kept():
    data = orjson.dumps({"choices": [], "timings": {"prompt_ms": 12.5}})
    assert parse_chunk(data).timings == {"prompt_ms": 12.5}


def test_strip_usage_null_restores_the_plain_chunk():
    plain = b'data: {"id":"x","choices":[]}\n\n'
    assert strip_usage_null(b'data: {"id":"x","choices":[],"usage":null}\n\n') == plain
    assert strip_usage_null(b'data: {"usage":null,"id":"x","choices":[]}\n\n') == plain
    assert strip_usage_null(plain) == plain
