"""Each replica's time to first token, predicted from its own recent requests (`pick: predicted_ttft`).

An engine prefills prompts one batch of tokens at a time: a request waits for the prompt tokens
sent before it (the replica's pending work) and then for its own, at the replica's prefill rate.
So, per replica, the server's part of a request's TTFT (the phases queue, load, reasoning and
prefill: what the proxy measured, never the network or its own time) is fitted as

    server_ttft ≈ a + b · (pending + prompt)

by least squares with exponential forgetting (each new request weighs as much as the last
`HALF_LIFE` together, so a replica that slows or recovers is followed within tens of requests):
b is seconds per prompt token (1 / its prefill rate), a its fixed cost; `pending` is the estimated
prompt tokens of the requests on that replica still waiting for their first token, counted by the
proxy itself. A prompt's size is estimated from the request body before it is sent (`tokens`: its
bytes / 4), the same way when fitting and when predicting. Only answers are samples: a failed
attempt says nothing about how fast the replica prefills (its health says it fails, health.py, and
the placement weighs the two: picker.py), so a stuck replica's abandoned attempts never stretch the
deadline the next request gets on it (`deadline_s`). With no fit yet, a prompt is expected to take
its tokens at `PRIOR_TOKENS_PER_S`, a slow engine's prefill rate: a long prompt is never abandoned
for being long on a replica the proxy has not measured.
"""
from __future__ import annotations

from typing import Any, Iterable

HALF_LIFE = 50.0
DECAY = 0.5 ** (1 / HALF_LIFE)
MIN_SAMPLES = 5
REFERENCE_TOKENS = 1000  # the prompt length of the predicted-TTFT gauge
BYTES_PER_TOKEN = 4
PRIOR_TOKENS_PER_S = 2000.0  # a prompt's expected prefill rate on a replica with no fit (a large model on one GPU; a 7B one does ~5,000)
MEDIA_TOKENS = 1000  # an image's tokens, about (OpenAI's 1024 x 1024 at high detail: 765; Claude's: ~1,400; LLaVA's: 576)
MEDIA_MIN = 256  # characters: a shorter string in a media part is its type or name, not its data
MEDIA_ITEMS = 1024  # messages looked at for media (prefix.ITEMS_LINKED: what is linked one by one)
MEDIA_TYPES = frozenset(("image_url", "image", "input_image", "input_audio", "input_file", "document", "file"))
DEADLINE_MARGIN = 1.5  # a first-token deadline is at least this much over the expected server TTFT


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


class Forecast:
    """One replica's fit and its pending prompt tokens. Updated on the event loop only."""

    __slots__ = ("w", "sx", "sy", "sxx", "sxy", "n", "pending", "last_s", "sent")

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0
        self.pending = 0  # estimated prompt tokens sent to it and waiting for their first token
        self.last_s = 0.0  # when it was last sent a request (monotonic s)
        self.sent = 0  # attempts sent to it, answered or not (exploration counts these: picker.py)

    def add(self, x: float, y: float) -> None:
        """A finished request: x = pending + prompt tokens when it was sent, y = its server TTFT (s)."""
        d = DECAY
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y
        self.n += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before MIN_SAMPLES. Prompts of much the same size say nothing about a slope
        (a replica only sent short ones would seem as fast for a long one): then the rate they
        measured, b = mean seconds / mean tokens, a = 0. Never a negative b."""
        if self.n < MIN_SAMPLES or self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= (0.25 * mx) ** 2:
            return 0.0, my / mx if mx > 0 else 0.0
        b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return my - b * mx, b

    def at(self, x: float) -> float | None:
        """Seconds of server time to the first token with x prompt tokens ahead and its own; None when unknown."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b = fit
        return max(0.0, a + b * x)

    def predict(self, prompt: int) -> float | None:
        """Seconds of server time to this prompt's first token if sent now; None when unknown."""
        return self.at(self.pending + prompt)

    def expect(self, x: float) -> float:
        """Seconds of server time to the first token with x prompt tokens ahead and its own: the fit's, or before any
        fit the prior rate's (a slow engine's: a replica not measured yet never looks faster than a measured one)."""
        expected = self.at(x)
        return expected if expected is not None else x / PRIOR_TOKENS_PER_S

    def deadline_s(self, route_s: float, x: int) -> float:
        """A first-token deadline for an attempt sent with x prompt tokens ahead and its own (`ctx.forecast_x`):
        the route's, or DEADLINE_MARGIN over what it is expected to take, whichever is later."""
        return max(route_s, DEADLINE_MARGIN * self.expect(x))


def predictions(forecasts: Iterable[tuple[str, Forecast]]) -> dict[str, float]:
    """Each replica's predicted server TTFT for a REFERENCE_TOKENS prompt sent now (the gauge)."""
    return {label: p for label, f in forecasts if (p := f.predict(REFERENCE_TOKENS)) is not None}
