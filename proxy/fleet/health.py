"""A replica's health: set aside while it fails, back after one probe (Envoy's outlier detection).

Picking by measured speed rewards a replica that fails fast (a crashed engine behind a healthy port
answers 503 at once: it is never busy and never slow), so failures are judged apart, per replica,
from every attempt sent to it, whichever request it served and whether or not it was retried:

- a failure is a connect error, a connection broken, a 5xx, a 429, no first token by the deadline, a
  first-token or inter-chunk timeout; a success is a first content token (a stream), or an answer
  that is not a failure (anything else); a 4xx or a client that left says nothing about the replica;
- `consecutive_failures` in a row, or a `failure_share` of at least `min_requests` attempts over the
  last `window` seconds, eject it for `base_time` × the times it was ejected in a row (one fewer for
  each `base_time` it then served well), at most `max_time`; a 429 or 503 with Retry-After sets it
  aside for that long (at most `retry_after_max`), as every HTTP client honours it;
- when its time is up, the next request of a route it serves is its probe, and only the probe's
  verdict brings it back (or sets it aside again, for longer); no other request goes to it meanwhile;
- `max_share` of a route's replicas at most are set aside at once, and at least one serves (the
  placement applies it per route, picker.py): a fleet that fails everywhere is still tried.

Updated on the event loop only. `on_eject(reason)` is told at each ejection (the counter and a log line).
"""
from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from typing import Any, Callable

from .window import Window

SERVING, EJECTED, PROBING = "serving", "ejected", "probing"
STATES = (SERVING, EJECTED, PROBING)
EJECT_REASONS = ("consecutive_failures", "failure_share", "retry_after", "probe_failed")
KEYS = {"consecutive_failures": "consecutive", "failure_share": "share", "min_requests": "min_requests", "window": "window_s",
        "base_time": "base_s", "max_time": "max_s", "max_share": "max_share", "retry_after_max": "retry_after_max_s"}


@dataclass(frozen=True)
class EjectionSpec:
    """The routes file's `ejection:` (every key optional; `ejection: off` turns it off)."""

    consecutive: int = 5
    share: float = 0.5
    min_requests: int = 10
    window_s: float = 10.0
    base_s: float = 30.0
    max_s: float = 300.0
    max_share: float = 0.5
    retry_after_max_s: float = 60.0
    enabled: bool = True

    @classmethod
    def parse(cls, spec: Any, where: str) -> "EjectionSpec":
        if spec is None or spec is True:
            return cls()
        if spec is False or spec == "off":
            return cls(enabled=False)
        if not isinstance(spec, dict) or set(spec) - {*KEYS, "__line__"}:
            raise ValueError(f"{where}: ejection must be `off` or a map of {', '.join(KEYS)} (each optional)")
        values: dict[str, Any] = {}
        for key, name in KEYS.items():
            if key not in spec:
                continue
            value = spec[key]
            whole = name in ("consecutive", "min_requests")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or value <= 0 \
                    or (name in ("share", "max_share") and value > 1):
                kind = "a whole number above 0" if whole else "a share in (0, 1]" if name in ("share", "max_share") else "a number of seconds above 0"
                raise ValueError(f"{where}: ejection's {key} must be {kind}, not {value!r}")
            values[name] = value if whole else float(value)
        return cls(**values)


def retry_after_s(headers: list[tuple[bytes, bytes]], now_wall: float | None = None) -> float | None:
    """What a 429 or 503 asks for: `retry-after-ms` (OpenAI, Azure), else `retry-after` in seconds or
    as an HTTP date; None when it asks nothing (or nothing readable)."""
    found = {k.lower(): v for k, v in headers if k.lower() in (b"retry-after", b"retry-after-ms")}
    try:
        if b"retry-after-ms" in found:
            return max(0.0, float(found[b"retry-after-ms"]) / 1000)
        if b"retry-after" in found:
            value = found[b"retry-after"].decode("latin-1").strip()
            if value.replace(".", "", 1).isdigit():
                return float(value)
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - (time.time() if now_wall is None else now_wall))
    except (ValueError, TypeError, OverflowError):
        return None
    return None


class Health:
    __slots__ = ("spec", "on_eject", "state", "until", "reason", "consecutive", "multiplier", "returned_s", "window", "probe_out")

    def __init__(self, spec: EjectionSpec = EjectionSpec(), on_eject: Callable[[str, float], None] | None = None) -> None:
        self.spec, self.on_eject = spec, on_eject
        self.state = SERVING
        self.until = 0.0  # set aside until then (monotonic s)
        self.reason = ""  # why it was last set aside
        self.consecutive = 0  # failures in a row
        self.multiplier = 0  # times ejected in a row (the next ejection lasts base × one more)
        self.returned_s = 0.0  # when its last probe brought it back
        self.window = Window(spec.window_s)  # [attempts, failures] per second
        self.probe_out = False

    def configure(self, spec: EjectionSpec) -> None:
        """A reloaded policy: from now on (what it counted within the window is kept if the window is the same)."""
        if spec.window_s != self.spec.window_s:
            self.window = Window(spec.window_s)
        self.spec = spec

    def available(self, now: float) -> bool:
        """May take a request now: serving, or its time up and no probe out yet (this request is the probe)."""
        return self.state == SERVING or (now >= self.until and not self.probe_out)

    def due(self, now: float) -> bool:
        """Set aside, its time up, no probe out: the next request of its route goes to it, as the probe."""
        return self.state != SERVING and now >= self.until and not self.probe_out

    def sent(self, now: float) -> bool:
        """An attempt went to it; True: that attempt is its probe."""
        self.window.cell(now)[0] += 1
        if self.due(now):
            self.state, self.probe_out = PROBING, True
            return True
        return False

    def succeeded(self, now: float, probe: bool = False) -> None:
        self.consecutive = 0
        if probe and self.state == PROBING:
            self.probe_out = False
            if now < self.until:  # (set aside again meanwhile: a Retry-After from a request sent before)
                self.state = EJECTED
                return
            self.state, self.returned_s = SERVING, now
            self.window.clear()

    def ended(self, probe: bool) -> None:
        """An attempt that said nothing about the replica (a 4xx, a client that left): a probe's turn passes on."""
        if probe and self.state == PROBING:
            self.state, self.probe_out = EJECTED, False

    def failed(self, now: float, probe: bool = False, retry_after: float | None = None) -> str:
        """An attempt failed; why it was set aside now ("": it was not)."""
        spec = self.spec
        self.window.cell(now)[1] += 1
        self.consecutive += 1
        if probe:
            self.probe_out = False
        if not spec.enabled:
            return ""
        if retry_after is not None and retry_after > 0:
            return self._eject(now, "retry_after", min(retry_after, spec.retry_after_max_s))
        if probe and self.state == PROBING:
            return self._eject(now, "probe_failed")
        if self.state != SERVING:
            return ""
        if self.consecutive >= spec.consecutive:
            return self._eject(now, "consecutive_failures")
        attempts, failures = self.window.totals(now)
        if attempts >= spec.min_requests and failures >= spec.share * attempts:
            return self._eject(now, "failure_share")
        return ""

    def _eject(self, now: float, reason: str, seconds: float | None = None) -> str:
        if seconds is None:  # base time x times ejected in a row, one fewer per base time it served well since
            if self.returned_s:
                self.multiplier = max(0, self.multiplier - int((now - self.returned_s) / self.spec.base_s))
            self.multiplier += 1
            seconds = min(self.spec.max_s, self.spec.base_s * self.multiplier)
        until = now + seconds
        if self.state != SERVING and self.until > until:  # (a Retry-After never shortens an ejection)
            until = self.until
        self.state, self.until, self.reason = (PROBING if self.probe_out else EJECTED), until, reason
        if self.on_eject is not None:
            self.on_eject(reason, until - now)
        return reason

    def share(self, now: float) -> float:
        """Its failures over its attempts in the window (one success assumed, so a single failure is no verdict)."""
        attempts, failures = self.window.totals(now)
        return failures / (attempts + 1)
