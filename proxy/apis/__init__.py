"""The wire APIs the proxy measures, one module each (a "dialect"), behind one small interface.

The relay never knows which API it carries: it resolves the request path to a `Route` (which
dialect, which `endpoint`, timed or not) and asks that dialect what the request says (model,
stream flag, prompt texts), what each streamed event means (a `Chunk`: content, visible
reasoning, usage, engine timings, an error, the end) and what a whole JSON body says. We never
translate between APIs, so a dialect only reads. Adding an API: its module and one row in
`DIALECTS`.

| api | paths | endpoints |
|---|---|---|
| `openai` | `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses[/…]` | chat, completions, embeddings, responses, responses_other |
| `azure` | `/openai/deployments/{d}/…`, `/openai/v1/…`, `/openai/responses` | the same as openai (Azure OpenAI is chat) |
| `anthropic` | `/v1/messages`, `/v1/messages/…` (count_tokens, batches) | messages, messages_other |
| `gemini` | `/v1beta/models/{m}:generateContent`, `:streamGenerateContent` (also `/v1/`, Vertex AI's path) | generate_content, gemini_other |
| `ollama` | `/api/chat`, `/api/generate`, `/api/embed`, `/api/…` | ollama_chat, ollama_generate, ollama_embed, ollama_other |

Any other path is relayed untouched and untimed: api `other`, endpoint `other`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire.chunk import BodyInfo, Chunk, json_object, string
from ..wire.compression import DecodeError, decompress
from ..wire.tokens import PromptParts


@dataclass(frozen=True, slots=True)
class Route:
    """What a request path means."""

    dialect: "Dialect"
    endpoint: str  # the `endpoint` label
    timed: bool = True  # False: relayed untouched, never timed as a generation (stored-object operations)
    model: str = ""  # a model the path names (an Azure deployment, a Gemini model), used when the body names none
    stream: bool | None = None  # the path says whether it streams (Gemini); None: the body does
    framing: str = "sse"  # how a stream is framed when it is not text/event-stream: "ndjson" (Ollama), "array" (Gemini)


class Dialect:
    """One wire API. The defaults are what an API that measures nothing would say."""

    name = "other"  # the `api` label of records and requests_total, and openai.api / gen_ai.provider on spans
    provider = ""  # gen_ai.provider.name for this API ("": from the upstream's host, as for OpenAI-compatible servers)
    key_headers: tuple[bytes, ...] = (b"authorization",)  # where clients put their key; an upstream key goes in the first
    key_prefix = b"Bearer "  # what precedes the key in that header
    injects_usage = False  # can ask the upstream for usage the client did not request (and strip it again)

    def route(self, path: str, query: bytes) -> Route | None:
        """This API's route for `path` (and query string), or None if the path is not this API's."""
        return None

    def upstream_query(self, query: bytes, drop_key: bool) -> bytes:
        """The query string to send upstream; `drop_key`: a key in it is the proxy's, or replaced by the upstream's."""
        return query

    def model_and_stream(self, endpoint: str, parsed: dict[str, Any]) -> tuple[str, bool]:
        return string(parsed.get("model")), parsed.get("stream") is True

    def prompt_parts(self, endpoint: str, parsed: dict[str, Any]) -> PromptParts | None:
        return None

    def event(self, data: bytes) -> Chunk:
        """What one event's data means: a JSON object read by `read`, else a malformed chunk."""
        chunk = Chunk()
        obj = json_object(data)
        if obj is None:
            chunk.valid = False
        else:
            self.read(obj, chunk)
        return chunk

    def read(self, obj: dict[str, Any], chunk: Chunk) -> None:
        """Fill `chunk` from one event's JSON object."""

    def body(self, obj: dict[str, Any]) -> BodyInfo:
        """What a whole (non-streaming) JSON response body says."""
        return BodyInfo()

    def inject(self, endpoint: str, parsed: dict[str, Any], raw: bytes) -> bytes | None:
        """The request body asking for usage the client did not, or None (nothing to inject)."""
        return None

    def forwarded(self, chunk: Chunk, raw: bytes) -> bytes:
        """With usage injected: the bytes of one event the client should get (b"": none)."""
        return raw


class Passthrough(Dialect):
    """Paths no API owns: relayed as they are."""


from .anthropic import Anthropic  # noqa: E402  (the dialects subclass Dialect, defined above)
from .azure import Azure  # noqa: E402
from .gemini import Gemini  # noqa: E402
from .ollama import Ollama  # noqa: E402
from .openai import OpenAI  # noqa: E402

PASSTHROUGH = Passthrough()
# The one table: the first dialect that claims a path serves it.
DIALECTS: tuple[Dialect, ...] = (OpenAI(), Anthropic(), Azure(), Gemini(), Ollama())
BY_NAME: dict[str, Dialect] = {d.name: d for d in (*DIALECTS, PASSTHROUGH)}
API_NAMES = tuple(BY_NAME)
OTHER = Route(PASSTHROUGH, "other", timed=False)


def resolve(path: str, query: bytes = b"") -> Route:
    for dialect in DIALECTS:
        route = dialect.route(path, query)
        if route is not None:
            return route
    return OTHER


def parse_request(route: Route, body: bytes) -> dict[str, Any] | None:
    """The parsed JSON object of a timed request, or None (not timed, empty, not JSON, not an object).
    A body we cannot parse is still forwarded as it came: only measurement degrades."""
    return json_object(body) if route.timed and body else None


def read_json_body(api: str, raw: bytes, encoding: bytes = b"identity") -> BodyInfo:
    """What a non-streaming JSON response says, decoded first (gzip, deflate, br, zstd). Pure and
    picklable in and out, so a large body can be read in another process."""
    if not raw:
        return BodyInfo()
    try:
        raw = decompress(raw, encoding)
    except DecodeError:
        return BodyInfo(undecodable=True)
    obj = json_object(raw)
    return BY_NAME[api].body(obj) if obj is not None else BodyInfo()
