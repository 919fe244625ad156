"""NDJSON and JSON-array framing: any split of the bytes gives the same events, elements never wait
for the end of the array, cut-off elements are no event, and growth past the limit stops framing."""
from hypothesis import given, strategies as st

from proxy.wire.framing import ArrayDecoder, LineDecoder
from proxy.wire.sse import EventTooLarge

ELEMENTS = [b'{"a": [1, {"b": "x}"}], "s": "q\\"uote ]"}', b'{"candidates": [{"content": {"parts": [{"text": "{[\\\\"}]}}]}', b"{}"]
ARRAY = b"[" + b",\r\n".join(ELEMENTS) + b"]"
NDJSON = b'{"a":1}\n\n{"b":"line\\nbreak"}\r\n{"done":true}\n'


def feed(decoder, parts):
    events = []
    for part in parts:
        events.extend(decoder.feed(part))
    return events + decoder.flush()


def test_each_element_as_soon_as_it_closes():
    decoder = ArrayDecoder()
    first = decoder.feed(ARRAY[: ARRAY.index(b",\r\n")])
    assert [e.data for e in first] == [ELEMENTS[0]]  # before the rest of the array arrived
    assert [e.data for e in feed(decoder, [ARRAY[ARRAY.index(b",\r\n"):]])] == ELEMENTS[1:]


@given(st.lists(st.integers(1, len(ARRAY) - 1), max_size=8))
def test_any_split_gives_the_same_elements(cuts):
    points = sorted(set(cuts))
    parts = [ARRAY[a:b] for a, b in zip([0, *points], [*points, len(ARRAY)])]
    assert [e.data for e in feed(ArrayDecoder(), parts)] == ELEMENTS


@given(st.lists(st.integers(1, len(NDJSON) - 1), max_size=8))
def test_ndjson_any_split(cuts):
    points = sorted(set(cuts))
    parts = [NDJSON[a:b] for a, b in zip([0, *points], [*points, len(NDJSON)])]
    assert [e.data for e in feed(LineDecoder(), parts)] == [b'{"a":1}', b'{"b":"line\\nbreak"}', b'{"done":true}']


def test_cut_mid_element_and_truncated_line():
    assert [e.data for e in feed(ArrayDecoder(), [ARRAY[:-2]])] == ELEMENTS[:2]  # the third never closed: no event
    assert [e.data for e in feed(LineDecoder(), [b'{"a":1}\n{"trunc'])] == [b'{"a":1}', b'{"trunc']  # flushed: the dialect finds it malformed


def test_growth_past_the_limit_stops_framing():
    for decoder, opening in ((ArrayDecoder(limit=1000), b'[{"a":1},{"text": "'), (LineDecoder(limit=1000), b'{"a":1}\n{"text": "')):
        events = decoder.feed(opening)
        assert [e.data for e in events] == [b'{"a":1}']
        try:
            for _ in range(10):
                decoder.feed(b"x" * 300)
        except EventTooLarge as exc:
            assert len(exc.pending) > 1000
        else:
            raise AssertionError("an element past the limit must stop framing")
