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
bytes / 4), the same way when fitting and when predicting. A request goes to the lowest prediction.
Exploration: a replica with fewer than `MIN_SAMPLES` requests, or one not sent any for
`STALE_S` seconds, gets the next short request (at most `REFERENCE_TOKENS`: cheap to probe with), so
a new or recovered replica is noticed; and `EPSILON` of the short requests go to another replica.
"""
from __future__ import annotations

import math
import random
import time
from typing import Iterable, Sequence

HALF_LIFE = 50.0
DECAY = 0.5 ** (1 / HALF_LIFE)
MIN_SAMPLES = 5
STALE_S = 30.0
EPSILON = 0.05
REFERENCE_TOKENS = 1000  # the prompt length of the predicted-TTFT gauge, and a "short" request's bound
BYTES_PER_TOKEN = 4


def tokens(body_bytes: int) -> int:
    """A prompt's size before it is tokenized: its request body's bytes / 4."""
    return body_bytes // BYTES_PER_TOKEN


class Forecast:
    """One replica's fit and its pending prompt tokens. Updated on the event loop only."""

    __slots__ = ("w", "sx", "sy", "sxx", "sxy", "n", "pending", "last_s")

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0
        self.pending = 0  # estimated prompt tokens sent to it and waiting for their first token
        self.last_s = 0.0  # when it was last sent a request (monotonic s)

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

    def predict(self, prompt: int) -> float | None:
        """Seconds of server time to this prompt's first token if sent now; None when unknown."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b = fit
        return max(0.0, a + b * (self.pending + prompt))


def choose(candidates: Sequence[tuple[str, Forecast]], prompt: int, rng: random.Random, now: float | None = None) -> int | None:
    """The index of the candidate to send a request of `prompt` tokens to; None when none has a
    prediction yet and the request is too long to probe with (the caller's fallback decides)."""
    now = time.monotonic() if now is None else now
    short = prompt <= REFERENCE_TOKENS
    if short:
        for i, (_, f) in enumerate(candidates):  # a new replica, or one not tried for a while: probe it with a short request
            if f.n < MIN_SAMPLES or now - f.last_s > STALE_S:
                return i
        if len(candidates) > 1 and rng.random() < EPSILON:
            return rng.randrange(len(candidates))
    best, best_s = None, math.inf
    for i, (_, f) in enumerate(candidates):
        predicted = f.predict(prompt)
        if predicted is not None and predicted < best_s:
            best, best_s = i, predicted
    return best


def predictions(forecasts: Iterable[tuple[str, Forecast]]) -> dict[str, float]:
    """Each replica's predicted server TTFT for a REFERENCE_TOKENS prompt sent now (the gauge)."""
    return {label: p for label, f in forecasts if (p := f.predict(REFERENCE_TOKENS)) is not None}
