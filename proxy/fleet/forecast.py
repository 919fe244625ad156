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
proxy itself. A prompt's size is estimated from the request body before it is sent (wire/prompt.py's `tokens`: its
bytes / 4), the same way when fitting and when predicting. Only answers are samples: a failed
attempt says nothing about how fast the replica prefills (its health says it fails, health.py, and
the placement weighs the two: picker.py), so a stuck replica's abandoned attempts never stretch the
deadline the next request gets on it (`deadline_s`). With no fit yet, a prompt is expected to take
its tokens at `PRIOR_TOKENS_PER_S`, a slow engine's prefill rate: a long prompt is never abandoned
for being long on a replica the proxy has not measured.
"""
from __future__ import annotations

from typing import Iterable

HALF_LIFE = 50.0
DECAY = 0.5 ** (1 / HALF_LIFE)
MIN_SAMPLES = 5
REFERENCE_TOKENS = 1000  # the prompt length of the predicted-TTFT gauge
PRIOR_TOKENS_PER_S = 2000.0  # a prompt's expected prefill rate on a replica with no fit (a large model on one GPU; a 7B one does ~5,000)
DEADLINE_MARGIN = 1.5  # a first-token deadline is at least this much over the expected server TTFT


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
