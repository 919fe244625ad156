"""What each replica has cached of the prompts sent to it: a prefix index per replica (estimation mode,
as the Gateway API Inference Extension's prefix-cache scorer), checked against what the engine reports.

An engine with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's
slot cache) prefills only what it has not seen, and it sees a prompt in the order its template
renders it: the system prompt and the tools first, then the messages in order. A coding agent resends
its whole, growing conversation every turn, so each turn is the last one's prompt plus what the turn
added. The proxy keeps, per replica, the prompts it sent there as a chain of hashes, one per message
(`chain`: each the hash of the one before and the message's own text, so a hash stands for the whole
prompt up to it, as an engine's block hashes are chained; small messages share a link, so that every
link holds at least `LINK_BYTES`), with each link's size in tokens (its bytes / 4, its inline images at
their own estimate, as the forecast estimates a prompt). A request's cached part on a replica is its
longest chain of links the replica's index holds (`match`). The index is an LRU bounded in tokens and
in links (`Index`: its memory, whatever the prompts' shapes); it is
updated when a request is sent there (`sent`), and corrected by what the response reports
(`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`, llama.cpp's `cache_n`, Gemini's
`cachedContentTokenCount`): a replica that reports fewer cached tokens than predicted has evicted what
the index still holds, so the index holds that much less from then on, its oldest links forgotten
(`reported`); its capacity grows back while its predictions hold.

A message is never split: a turn never changes the messages before it, so a chain breaks where a prompt
differs, at most a link's bytes before (engines cache by blocks of 16 tokens: at most a block of
difference per prompt). What a request costs is bounded whatever it holds: a prompt of 450,000 token
ids or 60,000 empty messages is a few links for its first `ITEMS_LINKED` items, and only counted past
them (`Chain.rest`). Keys
an engine does not render (Anthropic's `cache_control`, which moves to the newest message every turn)
are left out of a link's text.

`session`: the hash of the chain up to the conversation's first non-system message, the same for every
turn of one conversation and different across conversations: proxies that share nothing agree on a
session's replica by rendezvous hashing on it (picker.py). `opening`: the tokens of its first turn's
prompt (before its first answer), which every later turn begins with, so any replica that served the
conversation holds it: a replica reporting none of it for a conversation this index did not know there
never had it (`Use.reported`: a stray, and that replica remembered away for the conversation). What comes before
it (`shared`: the system prompt and the tools) is every session's of one agent: once any replica holds
it the placement takes every replica to (each serves some session), so that a proxy that happened to send
it to one replica first does not pull every conversation there.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Any

from .forecast import media_of, tokens as estimate
from .text import dumps

CAPACITY_TOKENS = 1_000_000  # what an index holds per replica at most (an engine with a large KV cache; the reports correct it)
MIN_CAPACITY = 10_000
TOLERANCE = 256  # tokens: an engine caches whole blocks, the estimate is bytes / 4
HEAD_KEYS = ("system", "instructions", "systemInstruction", "system_instruction", "tools", "functions")  # rendered first
SEQUENCE_KEYS = ("messages", "input", "contents", "prompt")  # then these, in order
SYSTEM_ROLES = ("system", "developer")
ANSWER_ROLES = ("assistant", "model")  # (Gemini's)
ANSWER_TYPES = ("function_call", "reasoning", "custom_tool_call")  # (the Responses API's output items, resent as input)
LONG_TEXT = 2048  # characters: a text this long is hashed as it is, not as JSON (`_text`)
AWAY_MAX = 10_000  # conversations remembered as not on a replica, per replica
ITEMS_LINKED = 1024  # a sequence's items hashed into links; past them, only counted (`chain`)
LINK_BYTES = 256  # a link closes at a message's end once it holds this much (64 estimated tokens; TOLERANCE is 256)
LINKS_MAX = 32_768  # links an index holds at most, whatever their tokens (about 5 MB a replica: docs/deployment.md)


@dataclass(frozen=True, slots=True)
class Chain:
    """A prompt as links: each link's hash (of the prompt up to it) and its size in estimated tokens."""

    hashes: tuple[int, ...]
    tokens: tuple[int, ...]
    session: int  # the conversation's key (0: none)
    shared: int = 0  # tokens before the conversation's first non-system message: the agent's, every session's
    start: int = 0  # the link of that message: the conversation's own links from it on
    opening: int = 0  # tokens before the conversation's first answer: its first turn's prompt, which every later one begins with (0: none yet)
    rest: int = 0  # tokens past the linked items of a longer sequence (never matched: `chain`)

    @property
    def total(self) -> int:
        return sum(self.tokens) + self.rest


def _text(value: Any) -> bytes:
    """A link's bytes: its JSON; or, holding a long text (a plain message {role, content}, or the head with the
    instructions or system prompt), its pieces length-prefixed behind a tag no JSON begins with, the texts as they
    are: JSON's escaping of an agent's 170 KB system prompt took 113 µs, encoding it takes 10 (anything short is
    dumped: 0.3 µs a message, against 1.5 this way)."""
    if type(value) is dict:
        content = value.get("content")
        if type(content) is str and len(content) > LONG_TEXT and all(type(v) is str for v in value.values()):
            return _framed(b"\x00", [(b"s", text.encode("utf-8", "surrogatepass")) for pair in value.items() if pair[0] != "cache_control"
                                     for text in pair])
    elif type(value) is list and any(type(v) is str and len(v) > LONG_TEXT for v in value):
        return _framed(b"\x01", [(b"s", v.encode("utf-8", "surrogatepass")) if type(v) is str else (b"j", dumps(v)) for v in value])
    data = dumps(value)
    if b"cache_control" in data and isinstance(value, dict):  # (not rendered by an engine: it moves every turn)
        data = dumps(_without_cache_control(value))
    return data


def _framed(tag: bytes, pieces: list[tuple[bytes, bytes]]) -> bytes:
    """Each piece as its kind (s: a text, j: JSON), its length, its bytes: no two lists of pieces give the same bytes."""
    out = [tag]
    for kind, piece in pieces:
        out += (kind, len(piece).to_bytes(4, "big"), piece)
    return b"".join(out)


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def sequence(parsed: dict[str, Any]) -> list[Any]:
    """The request's messages (or input, contents, prompt), in order: what follows the head."""
    found: Any = next((parsed[key] for key in SEQUENCE_KEYS if parsed.get(key)), None)
    return found if isinstance(found, list) else [found] if found is not None else []


def chain(parsed: dict[str, Any] | None, estimated: int = 0) -> Chain | None:
    """The request's prompt as links (None: nothing to chain). `estimated`: the whole body's tokens (forecast.tokens),
    what a sequence longer than ITEMS_LINKED is beyond its linked part (`Chain.rest`).

    Bounded work and memory whatever the body holds: a link closes at a message's end once it holds LINK_BYTES (small
    messages share one: a body of thousands of tiny ones, or a prompt of token ids, makes few links, and every link
    has a size), and always around the conversation's first non-system message (the session's link); only the first
    ITEMS_LINKED items are linked (an agent's conversation, whole), the rest of a longer sequence only counted."""
    if not parsed:
        return None
    head = [parsed[key] for key in HEAD_KEYS if parsed.get(key)]
    items = sequence(parsed)
    if not items:
        return None
    hashes: list[int] = []
    tokens: list[int] = []
    session = shared = start = opening = total = 0
    digest = hashlib.sha256()  # (SHA-NI: twice blake2b's speed here, 133 against 261 µs for an agent's 208 KB)
    held = media = count = 0  # what the open link holds: bytes, and of those inline media's characters and pieces

    def close() -> None:
        """The prompt hashed so far as a link, of the bytes since the last one (at least one token)."""
        nonlocal held, media, count, total
        hashes.append(int.from_bytes(digest.copy().digest()[:8], "big"))
        tokens.append(max(1, estimate(held, (media, count))))
        total += tokens[-1]
        held = media = count = 0

    if head:
        data = _text(head)
        digest.update(data)
        held = len(data)
        close()
    linked = items[:ITEMS_LINKED]
    for position, item in enumerate(linked):
        role = item.get("role") if isinstance(item, dict) else None
        first = not session and role not in SYSTEM_ROLES  # the conversation's first message: a link of its own
        if first and held:
            close()
        if session and not opening and (role in ANSWER_ROLES or (isinstance(item, dict) and item.get("type") in ANSWER_TYPES)):
            opening = total + estimate(held)
        data = _text(item)
        digest.update(b"\x1e")
        digest.update(data)
        held += len(data) + 1
        if type(item) is dict:
            inline = media_of(item)
            media, count = media + inline[0], count + inline[1]
        if first:
            shared = total
            close()
            session, start = hashes[-1], len(hashes) - 1
        elif held >= LINK_BYTES or position == len(linked) - 1:
            close()
    rest = max(0, estimated - total) if len(items) > ITEMS_LINKED else 0
    return Chain(tuple(hashes), tuple(tokens), session, shared, start, opening, rest)


class Index:
    """One replica's links, least recently sent first, bounded in tokens and in links (`LINKS_MAX`: its memory, whatever
    the prompts' shapes). On the event loop only."""

    __slots__ = ("capacity", "ceiling", "floor", "links", "held", "away")

    def __init__(self, capacity: int = CAPACITY_TOKENS, floor: int = MIN_CAPACITY) -> None:
        self.capacity = self.ceiling = capacity
        self.floor = floor  # (what a report shrinks it to at least)
        self.links: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> its tokens
        self.held = 0
        self.away: collections.OrderedDict[int, None] = collections.OrderedDict()  # conversations found not here (`Use.reported`)

    def match(self, prompt: Chain) -> int:
        """Tokens of the longest prefix of the prompt this replica holds."""
        matched, links = 0, self.links
        for link, size in zip(prompt.hashes, prompt.tokens):
            if link not in links:
                break
            matched += size
        return matched

    def sent(self, prompt: Chain) -> None:
        """The prompt went to this replica: it holds all of it now. Past capacity the least recently sent goes, a
        prompt's end before its beginning (its links renewed from the last to the first): as an engine evicts, so
        that what is forgotten shortens a chain and never cuts its head off."""
        links = self.links
        for link, size in zip(reversed(prompt.hashes), reversed(prompt.tokens)):
            if link in links:
                links.move_to_end(link)
            else:
                links[link] = size
                self.held += size
        self.away.pop(prompt.session, None)
        self._trim()

    def lost(self, prompt: Chain) -> None:
        """The prompt's conversation was not here before this prompt came: its links forgotten (this copy is not where
        the conversation lives), and the conversation remembered as away from this replica."""
        links = self.links
        for link in prompt.hashes[prompt.start:]:
            size = links.pop(link, None)
            if size is not None:
                self.held -= size
        self.away[prompt.session] = None
        self.away.move_to_end(prompt.session)
        if len(self.away) > AWAY_MAX:
            self.away.popitem(last=False)

    def reported(self, predicted: int, cached: int) -> None:
        """The engine reported `cached` tokens of a prompt this index predicted `predicted` of (both estimated). Fewer:
        it evicted links this index still holds, the least recently sent ones if it is an LRU as this is, so this
        index holds about that much less from now on (its oldest links forgotten). As predicted: it may hold a
        little more again (an eviction storm passes)."""
        if cached + TOLERANCE < predicted:
            self.capacity = max(self.floor, self.held - (predicted - cached))
            self._trim()
        elif self.capacity < self.ceiling:
            self.capacity = min(self.ceiling, int(self.capacity * 1.02) + TOLERANCE)

    def _trim(self) -> None:
        links = self.links
        while (self.held > self.capacity or len(links) > LINKS_MAX) and links:
            self.held -= links.popitem(last=False)[1]


@dataclass(slots=True)
class Use:
    """A request's prompt on the replica it was sent to: what the index predicted cached, for the check at its end."""

    index: Index
    prompt: Chain
    predicted: int  # estimated tokens predicted cached there
    rivals: tuple[Index, ...] = ()  # a conversation this index did not know there: where else it may live (picker.py)

    def reported(self, cached: int) -> bool:
        """The engine reported `cached` (estimated) tokens of the prompt cached: the index corrected by it, and a
        conversation past its first turn that this index did not know there checked. Holding its first turn's prompt
        (half of its own part at least): it lives there (another proxy sent it, or this one before a restart), and the
        index holds it since the send. Less: a stray (True), prefilled whole. While a rival replica may hold it, it
        lives there, and this copy is not where the next turn should follow (`Index.lost`); with every rival looked
        at, it lived nowhere a proxy places it (a conversation resumed, its cache evicted): it lives here now."""
        p = self.prompt
        self.index.reported(self.predicted, cached)
        own = p.opening - p.shared
        if own < TOLERANCE or self.predicted > p.shared or cached >= p.shared + own // 2:
            return False
        if any(p.session not in r.away for r in self.rivals):
            self.index.lost(p)
        return True
