"""A replica's health: set aside while it is sick, never for being busy (Envoy's outlier detection, and its
active health checking).

Picking by measured speed rewards a replica that fails fast (a crashed engine behind a healthy port
answers 503 at once: it is never busy and never slow), so failures are judged apart, per replica,
from every attempt sent to it, whichever request it served and whether or not it was retried:

- **sick**: a connect error, a connection broken, a 5xx, an error the stream reported in-band, a
  first-token or inter-chunk timeout, an active check failed. **Busy**: a 429, no first token by
  the route's deadline, or the proxy's own pool to it full. A busy answer fails the attempt over and weighs on the replica's score (its
  `share`), never on its ejection: a full fleet is not a sick one, and a client's own key's quota
  says nothing about the replica for everyone else. A 429 with Retry-After on the proxy's own key backs
  the replica off for that long (`backoff_until`: it takes requests only when no other replica of its
  route can), but does not set it aside. A success is a first content token (a stream), or an answer
  that is not a failure; a 4xx or a client that left says nothing about the replica;
- `consecutive_failures` sick ones in a row, or a `failure_share` of at least `min_requests` attempts over
  the last `window` seconds, eject it for `base_time` x the times it was ejected in a row (one fewer
  for each `base_time` it then served well), at most `max_time`; a 503 with Retry-After sets it
  aside for that long (at most `retry_after_max`); `unhealthy` active checks failed in a row set it
  aside until one passes;
- with active checks (checks.py), a replica whose time aside is up comes back when its next check
  passes: a probe is never a user's request. Without them, the next request of a route it serves is
  its probe, and only the probe's verdict brings it back;
- `max_share` of a route's replicas at most are set aside at once (at least one may be), and below
  `panic_threshold` of them serving the route serves them all (Envoy's panic mode; picker.py): a fleet
  failing everywhere is still tried, and a replica serving by force comes back at its first success.

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
EJECT_REASONS = ("consecutive_failures", "failure_share", "retry_after", "probe_failed", "health_check")
KEYS = {"consecutive_failures": "consecutive", "failure_share": "share", "min_requests": "min_requests", "window": "window_s",
        "base_time": "base_s", "max_time": "max_s", "max_share": "max_share", "panic_threshold": "panic",
        "retry_after_max": "retry_after_max_s"}
SHARES = ("share", "max_share", "panic")


@dataclass(frozen=True)
class EjectionSpec:
    """The routes file's `ejection:` (every key optional; `ejection: off` turns it off)."""

    consecutive: int = 5
    share: float = 0.5
    min_requests: int = 10
    window_s: float = 10.0
    base_s: float = 30.0
    max_s: float = 300.0
    max_share: float = 0.1  # Envoy's max_ejection_percent (at least one replica may be set aside)
    panic: float = 0.5  # Envoy's healthy_panic_threshold: below this share serving, the route serves all
    retry_after_max_s: float = 60.0
    enabled: bool = True

    @classmethod
    def parse(cls, spec: Any, where: str) -> "EjectionSpec":
        spec = policy(spec, where, "ejection", KEYS)
        if not isinstance(spec, dict):
            return cls(enabled=spec)
        values: dict[str, Any] = {}
        for key, name in KEYS.items():
            if key not in spec:
                continue
            value = spec[key]
            whole = name in ("consecutive", "min_requests")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or value <= 0 \
                    or (name in SHARES and value > 1):
                kind = "a whole number above 0" if whole else "a share in (0, 1]" if name in SHARES else "a number of seconds above 0"
                raise ValueError(f"{where}: ejection's {key} must be {kind}, not {value!r}")
            values[name] = value if whole else float(value)
        return cls(**values)


def policy(spec: Any, where: str, name: str, keys: Any) -> dict[str, Any] | bool:
    """A routes file's policy key (`ejection:`, `health_check:`): True (absent, or `true`: the defaults), False (`off`),
    or its map, every key known."""
    if spec is None or spec is True:
        return True
    if spec is False or spec == "off":
        return False
    if not isinstance(spec, dict) or set(spec) - {*keys, "__line__"}:
        raise ValueError(f"{where}: {name} must be `off` or a map of {', '.join(keys)} (each optional)")
    return spec


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
    __slots__ = ("spec", "on_eject", "state", "until", "reason", "consecutive", "multiplier", "returned_s", "window", "probe_out",
                 "checked", "check_failures", "alive_s", "check_failed_s", "backoff_until")

    def __init__(self, spec: EjectionSpec = EjectionSpec(), on_eject: Callable[[str, float], None] | None = None) -> None:
        self.spec, self.on_eject = spec, on_eject
        self.state = SERVING
        self.until = 0.0  # set aside until then (monotonic s)
        self.reason = ""  # why it was last set aside
        self.consecutive = 0  # sick failures in a row
        self.multiplier = 0  # times ejected in a row (the next ejection lasts base × one more)
        self.returned_s = 0.0  # when its last probe brought it back
        self.window = Window(spec.window_s)  # [attempts, sick failures, busy answers] per second
        self.probe_out = False
        self.checked = False  # active checks run on it (checks.py): they, not user requests, bring it back
        self.check_failures = 0  # active checks failed in a row
        self.alive_s = 0.0  # when it last showed it works: a check passed, a first token, an answer (monotonic s)
        self.check_failed_s = 0.0  # when an active check last failed
        self.backoff_until = 0.0  # a 429 on the proxy's own key asked for quiet until then: last choice meanwhile

    def configure(self, spec: EjectionSpec) -> None:
        """A reloaded policy: from now on (what it counted within the window is kept if the window is the same)."""
        if spec.window_s != self.spec.window_s:
            self.window = Window(spec.window_s)
        self.spec = spec

    def available(self, now: float) -> bool:
        """May take a request now: serving, or its time up and no probe out yet (this request is the probe; never
        with active checks, whose next pass brings it back)."""
        return self.state == SERVING or (not self.checked and now >= self.until and not self.probe_out)

    def due(self, now: float) -> bool:
        """Set aside, its time up, no probe out, no active checks: the next request of its route goes to it, as the probe."""
        return self.state != SERVING and not self.checked and now >= self.until and not self.probe_out

    def sent(self, now: float) -> bool:
        """An attempt went to it; True: that attempt is its probe."""
        self.window.cell(now)[0] += 1
        if self.due(now):
            self.state, self.probe_out = PROBING, True
            return True
        return False

    def succeeded(self, now: float, probe: bool = False, forced: bool = False) -> None:
        """It served: a probe's pass brings it back, as does any success of a request it took while set aside (the
        route served it by force: panic mode, or too many set aside)."""
        self.consecutive, self.alive_s = 0, now
        if probe and self.state == PROBING:
            self.probe_out = False
            if now < self.until:  # (set aside again meanwhile: a Retry-After from a request sent before)
                self.state = EJECTED
                return
            self._back(now)
        elif forced and self.state == EJECTED and (self.reason != "retry_after" or now >= self.until):
            self._back(now)

    def _back(self, now: float) -> None:
        self.state, self.returned_s = SERVING, now
        self.window.clear()

    def ended(self, probe: bool) -> None:
        """An attempt that said nothing about the replica (a 4xx, a client that left): a probe's turn passes on."""
        if probe and self.state == PROBING:
            self.state, self.probe_out = EJECTED, False

    def busy(self, now: float, probe: bool = False, backoff: float | None = None) -> None:
        """A 429, or no first token by the deadline: weighs on its score, never ejects it (`backoff`: the quiet a 429 on
        the proxy's own key asked for). A probe that found it busy found it alive: it comes back."""
        self.window.cell(now)[2] += 1
        if backoff is not None and backoff > 0:
            self.backoff_until = max(self.backoff_until, now + min(backoff, self.spec.retry_after_max_s))
        if probe:
            self.probe_out = False
            if self.state == PROBING:
                self._back(now)

    def failed(self, now: float, probe: bool = False, retry_after: float | None = None) -> str:
        """An attempt failed sick; why it was set aside now ("": it was not)."""
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
        attempts, failures, _ = self.window.totals(now)
        if attempts >= spec.min_requests and failures >= spec.share * attempts:
            return self._eject(now, "failure_share")
        return ""

    def check(self, now: float, passed: bool, unhealthy: int) -> str:
        """An active check's verdict (checks.py): `unhealthy` failed in a row set it aside until one passes; a pass
        brings back a replica whose time aside is up. Why it was set aside now ("": it was not)."""
        if passed:
            self.check_failures, self.alive_s = 0, now
            if self.state != SERVING and now >= self.until:
                self.probe_out = False
                self._back(now)
            return ""
        self.check_failures += 1
        self.check_failed_s = now
        if not self.spec.enabled or self.check_failures < unhealthy:
            return ""
        if self.state != SERVING:
            self.until = max(self.until, now)  # (its time aside runs on while it fails its checks)
            return ""
        return self._eject(now, "health_check", 0.0)

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
        """Its failures, sick or busy, over its attempts in the window (one success assumed, so a single failure is no
        verdict): what its score weighs."""
        attempts, failures, busy = self.window.totals(now)
        return (failures + busy) / (attempts + 1)

    def backing_off(self, now: float) -> bool:
        return now < self.backoff_until
