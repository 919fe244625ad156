"""What counts as a content chunk."""
import orjson

from proxy.apis.openai import parse_chunk
from proxy.wire.chunk import read_usage, strip_usage_null


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
    assert read_usage(chunk.usage)[:2] == (5, 7)


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


def test_reasoning_sent_in_both_fields_is_counted_once():
    data = chat({"reasoning_content": " think", "reasoning": " think"})
    chunk = parse_chunk(data)
    assert chunk.texts == [(0, " think")] and chunk.reasoning


def test_refusal_and_legacy_function_call_are_content():
    assert parse_chunk(chat({"refusal": "I can't"})).text == "I can't"
    assert parse_chunk(chat({"function_call": {"name": "f", "arguments": "{\"a\":"}})).text == "{\"a\":"


def test_choices_keep_their_index():
    data = orjson.dumps({"choices": [{"index": 1, "delta": {"content": "b"}}, {"index": 0, "delta": {"content": "a"}}]})
    assert parse_chunk(data).texts == [(1, "b"), (0, "a")]


def test_usage_details_and_vllm_metrics():
    usage = {"prompt_tokens": 2000, "completion_tokens": 2100, "prompt_tokens_details": {"cached_tokens": 1900},
             "completion_tokens_details": {"reasoning_tokens": 2000}}
    assert read_usage(usage) == (2000, 2100, 1900, 2000)
    chunk = parse_chunk(orjson.dumps({"choices": [], "usage": usage, "metrics": {"time_to_first_token_ms": 5.0}}))
    assert chunk.metrics == {"time_to_first_token_ms": 5.0}


def test_usage_null_is_stripped_whatever_the_spacing():
    assert strip_usage_null(b'data: {"a": 1, "usage": null}\n\n') == b'data: {"a": 1}\n\n'
    assert strip_usage_null(b'data: {"usage" : null , "a":1}\n\n') == b'data: {"a":1}\n\n'
    assert strip_usage_null(b'data: {"a":"\\"usage\\": null"}\n\n') == b'data: {"a":"\\"usage\\": null"}\n\n'
