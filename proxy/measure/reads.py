"""A request's content stamps read back as the reads they were (timing.split() uses them).

A stamp is when a read's bytes reached the socket: the kernel's, for the last segment of the read
(arrival.py). When the event loop was late (a CPU quota, a burst), bytes of several chunks waited in
the socket and arrive as one read, all stamped with its last segment's arrival: the earlier chunks'
own instants are unknown, only bounded. So a run of equal stamps is one read, its tokens counted
together; a decode window runs between reads whose stamps are exact; and a first token read with
later ones is placed before them at the rate the later reads measured.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .timing import RequestTiming


def sequences(t: RequestTiming, runs: dict[int, list[int]]) -> dict[int, tuple[list[int], list[float]]]:
    """Content instants and token counts per choice, a run of equal instants merged into one: the bytes of one
    read, which the kernel stamps with their last segment's arrival (arrival.py), the earlier ones' unknown.
    `runs` gets how many chunks each merged (nothing where none did)."""
    tokens = t.chunk_tokens if t.chunk_tokens is not None and len(t.chunk_tokens) == len(t.content_ns) else [1.0] * len(t.content_ns)
    choices = t.content_choice if len(t.content_choice) == len(t.content_ns) else [0] * len(t.content_ns)
    stamps = t.content_ns
    if (not choices or min(choices) == max(choices)) and all(a != b for a, b in zip(stamps, stamps[1:])):
        return {choices[0] if choices else 0: (stamps, tokens)}  # (one choice, each chunk its own read: `runs` stays empty)
    seqs: dict[int, tuple[list[int], list[float]]] = {}
    for instant, choice, count in zip(t.content_ns, choices, tokens):
        instants, counts = seqs.setdefault(choice, ([], []))
        merged = runs.setdefault(choice, [])
        if instants and instants[-1] == instant:
            counts[-1] += count
            merged[-1] += 1
        else:
            instants.append(instant)
            counts.append(count)
            merged.append(1)
    return seqs


def window(t: RequestTiming, instants: list[int], counts: list[float]) -> tuple[int, float]:
    """A choice's decode window (ns) and the tokens in it after its first read, between reads whose stamps are
    exact: a read's stamp is its last segment's, so the last content read with the stream's end after it (the
    loop late to both) is left out, its stamp being the end's."""
    end = len(instants) - 1
    if end >= 2 and instants[end] == t.upstream_end_ns:
        end -= 1
    return instants[end] - instants[0], sum(counts[1:end + 1])


def first_arrival(t: RequestTiming, seqs: dict[int, tuple[list[int], list[float]]]) -> int:
    """When the first content token arrived. Read alone, its stamp. Read with the tokens after it (the loop was
    late: bytes waited in the socket, and the kernel stamps a read with its last segment), it came that many
    tokens earlier at the rate the later reads measured (each read's stamp exact), and never before the
    response's head."""
    first = t.content_ns[0]
    choice = t.content_choice[0] if len(t.content_choice) == len(t.content_ns) else 0
    instants, counts = seqs[choice]
    own = t.chunk_tokens[0] if t.chunk_tokens is not None and len(t.chunk_tokens) == len(t.content_ns) else 1.0
    later = counts[0] - own if instants[0] == first else 0.0
    span, after = window(t, instants, counts)
    if later <= 0 or span <= 0 or after <= 0:
        return first
    rate = after / span  # tokens per ns
    floor = max(t.headers_ns or 0, t.sent_ns or 0)
    return max(first - int(later / rate), floor) if floor < first else first
