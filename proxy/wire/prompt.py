"""A prompt's shape, read once from its parsed request: its size before it is tokenized, and its links.

`tokens` estimates a prompt's tokens from its body's bytes (/ 4) and its inline media (each image, audio or file
`MEDIA_TOKENS`), the same way when a replica's forecast is fitted and when it predicts (fleet/forecast.py).

`chain` reads it as an engine's prefix cache sees it: in the order its template renders it (the system prompt and the
tools first, then the messages in order), as a chain of hashes, one per message (each the hash of the one before and
the message's own text, so a hash stands for the whole prompt up to it, as an engine's block hashes are chained; small
messages share a link, so that every link holds at least `LINK_BYTES`), with each link's size in estimated tokens. A
message is never split: a turn never changes the messages before it, so a chain breaks where a prompt differs, at most
a link's bytes before (engines cache by blocks of 16 tokens: at most a block of difference per prompt). What a request
costs is bounded whatever it holds: a prompt of 450,000 token ids or 60,000 empty messages is a few links for its
first `ITEMS_LINKED` items, and only counted past them (`Chain.rest`). Keys an engine does not render (Anthropic's
`cache_control`, which moves to the newest message every turn) are left out of a link's text. Each replica's prefix
index holds the chains sent to it (fleet/prefix.py).

`Chain.session`: the hash of the chain up to the conversation's first non-system message, the same for every turn of
one conversation and different across conversations; `opening`: the tokens of its first turn's prompt (before its
first answer), which every later turn begins with; `shared`: what comes before the session (the system prompt and
the tools), every session's of one agent.

Here, below the dialects and the fleet: the worker process computes both for a large body (measure/offload.py), the
relay for a small one, and the fleet reads them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .text import dumps

BYTES_PER_TOKEN = 4
MEDIA_TOKENS = 1000  # an image's tokens, about (OpenAI's 1024 x 1024 at high detail: 765; Claude's: ~1,400; LLaVA's: 576)
MEDIA_MIN = 256  # characters: a shorter string in a media part is its type or name, not its data
MEDIA_ITEMS = 1024  # messages looked at for media (prefix.ITEMS_LINKED: what is linked one by one)
MEDIA_TYPES = frozenset(("image_url", "image", "input_image", "input_audio", "input_file", "document", "file"))
HEAD_KEYS = ("system", "instructions", "systemInstruction", "system_instruction", "tools", "functions")  # rendered first
SEQUENCE_KEYS = ("messages", "input", "contents", "prompt")  # then these, in order
SYSTEM_ROLES = ("system", "developer")
ANSWER_ROLES = ("assistant", "model")  # (Gemini's)
ANSWER_TYPES = ("function_call", "reasoning", "custom_tool_call")  # (the Responses API's output items, resent as input)
LONG_TEXT = 2048  # characters: a text this long is hashed as it is, not as JSON (`_text`)
ITEMS_LINKED = 1024  # a sequence's items hashed into links; past them, only counted (`chain`)
LINK_BYTES = 256  # a link closes at a message's end once it holds this much (64 estimated tokens; TOLERANCE is 256)


def tokens(size: int, media: tuple[int, int] = (0, 0)) -> int:
    """A prompt's size before it is tokenized: its request body's bytes / 4, but for its images, audio and files sent
    inline (`media`: their characters, how many), each `MEDIA_TOKENS`: an engine counts an image by its pixels, never
    by its bytes, and a screenshot's megabyte at bytes / 4 would swamp the fit's slope and a prefix index's capacity."""
    return max(0, size - media[0]) // BYTES_PER_TOKEN + media[1] * MEDIA_TOKENS


def media(items: list[Any]) -> tuple[int, int]:
    """(characters, pieces) of the media inline in a request's messages (`items`, its first MEDIA_ITEMS): each part of
    a message's `content` or `parts` list that is an image, audio or a file (OpenAI's `image_url`, `input_audio`,
    `input_image`, `input_file`; Anthropic's `image` and `document`, also inside a `tool_result`; Gemini's
    `inlineData`), and each of Ollama's `images`. Read from the parsed structure, where the types say what a part is:
    a search of the body's bytes for base64 cost 0.4 ms an agent's turn on this project's machine, this 20 µs. A
    message whose content is text costs one lookup."""
    size = count = 0
    for item in items[:MEDIA_ITEMS]:
        if type(item) is dict:
            get = item.get
            content, parts, images = get("content"), get("parts"), get("images")
            if type(content) is list or type(parts) is list or type(images) is list:  # (a message of text only: three lookups)
                found = media_of(item)
                size, count = size + found[0], count + found[1]
    return size, count


def media_of(item: dict[str, Any]) -> tuple[int, int]:
    """(characters, pieces) of the media inline in one message (`media`)."""
    size = count = 0
    for key in ("content", "parts"):
        parts = item.get(key)
        if type(parts) is list:
            for part in parts:
                if type(part) is dict:
                    found = _part(part)
                    size, count = size + found[0], count + found[1]
    images = item.get("images")
    if type(images) is list:
        for image in images:
            if type(image) is str:
                size, count = size + len(image), count + 1
    return size, count


def _part(part: dict[str, Any]) -> tuple[int, int]:
    if part.get("type") in MEDIA_TYPES or "inlineData" in part or "inline_data" in part:
        return _strings(part, 3), 1
    inner = part.get("content")  # (a tool's result, holding images of its own: Anthropic's tool_result)
    if type(inner) is list:
        found = [_part(p) for p in inner if type(p) is dict]
        return sum(f[0] for f in found), sum(f[1] for f in found)
    return 0, 0


def _strings(value: Any, depth: int) -> int:
    """The characters of the long strings in a media part (its data or URL), a few levels down."""
    if type(value) is str:
        return len(value) if len(value) >= MEDIA_MIN else 0
    if depth and type(value) is dict:
        return sum(_strings(v, depth - 1) for v in value.values())
    return 0


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
    """The request's prompt as links (None: nothing to chain). `estimated`: the whole body's tokens (`tokens`),
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
    sizes: list[int] = []
    session = shared = start = opening = total = 0
    digest = hashlib.sha256()  # (SHA-NI: twice blake2b's speed here, 133 against 261 µs for an agent's 208 KB)
    held = media = count = 0  # what the open link holds: bytes, and of those inline media's characters and pieces

    def close() -> None:
        """The prompt hashed so far as a link, of the bytes since the last one (at least one token)."""
        nonlocal held, media, count, total
        hashes.append(int.from_bytes(digest.copy().digest()[:8], "big"))
        sizes.append(max(1, tokens(held, (media, count))))
        total += sizes[-1]
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
            opening = total + tokens(held)
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
    return Chain(tuple(hashes), tuple(sizes), session, shared, start, opening, rest)
