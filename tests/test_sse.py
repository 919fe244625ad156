"""SSE framing: split reads, multi-event reads, [DONE], comments, line endings; bytes unaltered."""
from hypothesis import given, strategies as st

from proxy.wire.sse import EventTooLarge, SSEDecoder

STREAM = (
    b'data: {"a":1}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"b":2}\r\n\r\n'
    b"event: x\ndata: line1\ndata: line2\n\n"
    b"data: [DONE]\n\n"
)


def decode(parts: list[bytes]):
    decoder = SSEDecoder()
    events = []
    for part in parts:
        events.extend(decoder.feed(part))
    events.extend(decoder.flush())
    return events


def test_whole_stream_in_one_read():
    events = decode([STREAM])
    assert [e.data for e in events] == [b'{"a":1}', None, b'{"b":2}', b"line1\nline2", b"[DONE]"]


def test_every_split_point_gives_the_same_events():
    expected = [(e.raw, e.data) for e in decode([STREAM])]
    for cut in range(1, len(STREAM)):
        assert [(e.raw, e.data) for e in decode([STREAM[:cut], STREAM[cut:]])] == expected, cut


def test_byte_at_a_time():
    events = decode([STREAM[i : i + 1] for i in range(len(STREAM))])
    assert b"".join(e.raw for e in events) == STREAM
    assert len(events) == 5


def test_cr_only_line_endings_and_split_crlf():
    events = decode([b"data: x\r", b"\n\r", b"\ndata: y\r\r"])
    assert [e.data for e in events] == [b"x", b"y"]


def test_unterminated_last_event_is_flushed():
    events = decode([b'data: {"x":1}\n\ndata: {"y":2}'])
    assert [e.data for e in events] == [b'{"x":1}', b'{"y":2}']


def test_data_without_space_after_colon():
    assert decode([b"data:abc\n\n"])[0].data == b"abc"


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_never_crashes_and_never_alters_bytes(parts):
    events = decode(parts)
    assert b"".join(e.raw for e in events) == b"".join(parts)


@given(st.lists(st.sampled_from([b"data: a", b"data: b", b": c", b"", b"x: y"]), max_size=30),
       st.sampled_from([b"\n", b"\r\n", b"\r"]), st.integers(min_value=1, max_value=7))
def test_any_chunking_gives_the_same_events(lines, newline, size):
    stream = b"".join(line + newline for line in lines)
    whole = [(e.raw, e.data) for e in decode([stream])]
    pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
    assert [(e.raw, e.data) for e in decode(pieces)] == whole


def test_an_event_past_the_limit_stops_framing_with_its_bytes_kept():
    decoder = SSEDecoder(limit=1000)
    assert [e.data for e in decoder.feed(b"data: small\n\ndata: ")] == [b"small"]
    held = b"data: "
    for _ in range(3):
        piece = b"A" * 300
        held += piece
        decoder.feed(piece)
    try:
        decoder.feed(b"A" * 300)
    except EventTooLarge as exc:
        assert exc.pending == held + b"A" * 300 and exc.events == []  # nothing lost: the caller relays these and the rest as it comes
    else:
        raise AssertionError("an event past the limit must stop framing")
    assert decoder.feed(b"data: again\n\n")[0].data == b"again"  # (a reset decoder frames afresh)
    try:
        SSEDecoder(limit=100).feed(b"data: one\n\ndata: " + b"B" * 200)
    except EventTooLarge as exc:  # the events the same read completed first are kept
        assert [e.data for e in exc.events] == [b"one"] and exc.pending == b"data: " + b"B" * 200


def test_framing_searches_each_byte_once_however_many_reads_an_event_spans(monkeypatch):
    """An event that grows by 1 KB a read for 2,000 reads: the line-end search covers each byte about
    once (linear), not the whole unfinished event again on every read (quadratic: ~2 GB here)."""
    import proxy.wire.sse as sse

    real, scanned = sse._LINE_END, [0]

    class Counting:
        def search(self, buffer, pos):  # noqa: ANN001
            scanned[0] += len(buffer) - pos
            return real.search(buffer, pos)

    monkeypatch.setattr(sse, "_LINE_END", Counting())
    decoder = SSEDecoder(limit=10 * 1024 * 1024)
    decoder.feed(b"data: ")
    for _ in range(2000):
        decoder.feed(b"x" * 1024)
    events = decoder.feed(b"\n\n")
    assert len(events) == 1 and len(events[0].data) == 2000 * 1024
    assert scanned[0] <= 2 * (2000 * 1024 + 8)
