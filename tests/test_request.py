"""Request parsing and the include_usage rewrite: never crash, never alter what is not ours to alter."""
import json

import orjson
from hypothesis import given, strategies as st

from proxy import apis
from proxy.apis.openai import USAGE_OPTION, usage_injected_body
from proxy.serve.request import filter_headers

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
                    max_leaves=20)


@given(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/x", "/v1/messages",
                         "/openai/deployments/d/chat/completions"]), st.binary(max_size=200))
def test_parse_request_never_crashes_on_bytes(path, body):
    route = apis.resolve(path)
    parsed = apis.parse_request(route, body)
    assert route.endpoint in ("chat", "completions", "embeddings", "messages", "other")  # (/v1/models: OpenAI's list, relayed)
    assert parsed is None or isinstance(parsed, dict)


@given(st.dictionaries(st.text(max_size=10).filter(lambda k: k != "stream_options"), JSON, max_size=6), st.sampled_from([None, 2]))
def test_usage_injection_keeps_every_other_byte(body, indent):
    raw = json.dumps(body, indent=indent).encode()  # any client formatting, big integers included
    rewritten = usage_injected_body(orjson.loads(raw), raw)
    assert rewritten is not None
    assert rewritten.replace(USAGE_OPTION + (b"," if body else b""), b"", 1) == raw  # only the option was added
    assert orjson.loads(rewritten) == {"stream_options": {"include_usage": True}, **orjson.loads(raw)}


def test_usage_injection_leaves_clients_that_asked_or_sent_nonsense_alone():
    asked = b'{"stream_options": {"include_usage": true}}'
    assert usage_injected_body(orjson.loads(asked), asked) is None
    weird = b'{"stream_options": "weird"}'
    assert usage_injected_body(orjson.loads(weird), weird) is None
    other = b'{"stream_options": {"x": 1}}'
    assert orjson.loads(usage_injected_body(orjson.loads(other), other))["stream_options"] == {"x": 1, "include_usage": True}
    big = b'{"seed": 123456789012345678901234567890, "stream_options": {"x": 1}}'
    assert usage_injected_body(orjson.loads(big), big) is None  # would lose digits: leave it alone


def test_hop_by_hop_and_connection_named_headers_are_dropped():
    headers = [(b"connection", b"keep-alive, x-private"), (b"x-private", b"1"), (b"transfer-encoding", b"chunked"),
               (b"authorization", b"Bearer k"), (b"x-keep", b"2")]
    assert filter_headers(headers) == [(b"authorization", b"Bearer k"), (b"x-keep", b"2")]
