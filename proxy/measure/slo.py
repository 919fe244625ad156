"""Service-level objectives from live traffic: each generation request's verdict, and the phase to blame.

The objectives come from one YAML file (`serve --slo PATH`, reloaded on SIGHUP):

    objectives:
      - name: interactive        # the `slo` label
        models: ["llama-*"]      # exact names or globs; the first objective that matches wins
        tenants: ["search-*"]    # optional: only these tenants' requests (names or globs; --tenants); models then default to all
        page_per_tenant: true    # optional: `rules --slo` pages per tenant (each tenant's burn its own alert)
        ttft: 0.5                # seconds, optional
        tpot: 0.05               # seconds per output token after the first, optional
        e2e: 30                  # seconds, optional (at least one of the three)
        target: 0.99             # share of requests that must meet every objective
        window: 30d              # optional: the window the error budget is spent over (default 30d)

Verdicts (`judge`), as DistServe and vLLM's `--goodput` define a good request, but for every request:
- good = every stated objective that can be measured on the request was met. TTFT and TPOT are
  measured on streams only: TPOT = (e2e - TTFT) / (visible output tokens per choice - 1), hidden
  reasoning excluded (it is generated before the first token, so it is in TTFT). A non-streaming
  request is judged on `e2e` only; one with nothing measurable is not judged (`slo_good` null).
- a failed request (5xx or 429 from the upstream, a stream broken mid-way, a timeout, the proxy's own
  503 or 500) is bad: objective `error`, blamed on its outcome. A 4xx other than 429 is the client's
  own mistake (a bad parameter, a wrong key) and is not judged.
- a client that leaves (or stops reading) is judged only on what it had already waited for: past the
  TTFT objective without a first token (or with a late one) it is a TTFT miss, past `e2e` an e2e miss
  (users give up on slow answers); one that leaves sooner is not counted.

Blame: a TTFT miss names the phase before the first token (client, proxy, failover, wait, network, tokenize,
queue, load, reasoning, prefill) that exceeds its *usual* value for that model the most; an e2e miss the
same over every phase; a TPOT miss `decode`. Usual = the phase's median over that model's last
`USUAL_WINDOW` requests that met their objectives (so a lasting incident does not become the norm
it is measured against); with no such request yet, 0 (the largest phase is blamed). When no phase
exceeds its usual (the objective is missed as a rule, not by an excursion), the largest is blamed.
"""
from __future__ import annotations

import collections
import fnmatch
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..config import checked_entry, parse_yaml, read_text
from .timing import Breakdown, RequestTiming

log = logging.getLogger("llmproxy.slo")

GENERATION = frozenset({"chat", "completions", "responses", "messages", "generate_content", "ollama_chat", "ollama_generate"})
OBJECTIVES = ("ttft", "tpot", "e2e")  # what a request can miss, besides `error`
BEFORE_FIRST_TOKEN = ("client", "proxy", "lag", "failover", "wait", "network", "tokenize", "queue", "load", "reasoning", "prefill")
FAILED = ("upstream_error", "timeout", "proxy_error", "overloaded")  # outcomes that are the service's failure
LEFT = ("client_disconnect", "client_slow")  # the client went away, or stopped reading
USUAL_WINDOW = 256  # good requests per model the usual phase values are the median of
USUAL_MODELS = 200  # models whose usual values are kept (later ones share one)
KEYS = ("name", "models", "tenants", "page_per_tenant", "ttft", "tpot", "e2e", "target", "window")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_WINDOW_S = 30 * 86400.0


@dataclass(frozen=True)
class Objective:
    """One named SLO: latency thresholds (seconds) for the models it matches, and its target."""

    name: str
    models: tuple[str, ...]
    target: float
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    window_s: float = DEFAULT_WINDOW_S
    tenants: tuple[str, ...] = ()  # empty: every tenant
    page_per_tenant: bool = False

    @property
    def thresholds(self) -> dict[str, float]:
        """The stated objectives: {"ttft": 0.5, ...}."""
        return {name: value for name in OBJECTIVES if (value := getattr(self, name)) is not None}

    @property
    def budget(self) -> float:
        """The share of requests allowed to be bad (1 - target)."""
        return 1.0 - self.target

    def matches(self, model: str, tenant: str = "unknown") -> bool:
        return any(model == pattern or fnmatch.fnmatchcase(model, pattern) for pattern in self.models) and (
            not self.tenants or any(tenant == pattern or fnmatch.fnmatchcase(tenant, pattern) for pattern in self.tenants))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request judged against its objective. `good` None: nothing stated could be measured."""

    slo: str
    good: bool | None
    missed: tuple[str, ...] = ()
    blame: dict[str, str] = field(default_factory=dict)
    stated: tuple[str, ...] = ()  # the objectives the SLO states (its metrics' series start at 0 for each)

    def as_record(self) -> dict[str, Any]:
        return {"slo": self.slo, "slo_good": self.good, "slo_missed": list(self.missed), "slo_blame": dict(self.blame)}


def parse_window(value: Any, where: str) -> float:
    """`30d`, `6h`, `90m`, `3600s`, or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", str(value).strip())
    if not match:
        raise ValueError(f"{where}: window must be a duration such as 30d or 6h, not {value!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def _seconds(spec: dict[str, Any], key: str, where: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive number of seconds, not {value!r}")
    return float(value)


def parse(text: str, path: str = "<slo>") -> tuple[Objective, ...]:
    """The objectives of a file's text; a broken one raises ValueError naming the file and line."""
    data = parse_yaml(text, f"slo file {path}")
    if not isinstance(data, dict) or not isinstance(data.get("objectives"), list):
        raise ValueError(f"slo file {path}, line 1: expected `objectives:` (a list)")
    out: list[Objective] = []
    for spec in data["objectives"]:
        where = checked_entry(spec, f"slo file {path}", KEYS, "objective")
        name, models, target = spec.get("name"), spec.get("models", ["*"] if "tenants" in spec else None), spec.get("target")
        tenants = spec.get("tenants", [])
        if not (isinstance(tenants, list) and all(isinstance(t, str) and t for t in tenants)) or ("tenants" in spec and not tenants):
            raise ValueError(f"{where}: tenants must be a non-empty list of tenant names or globs, not {tenants!r}")
        if not isinstance(spec.get("page_per_tenant", False), bool):
            raise ValueError(f"{where}: page_per_tenant must be true or false, not {spec['page_per_tenant']!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"{where}: name must be a word of letters, digits, _ . or -, not {name!r}")
        if name in {o.name for o in out}:
            raise ValueError(f"{where}: objective {name!r} is defined twice")
        if not (isinstance(models, list) and models and all(isinstance(m, str) and m for m in models)):
            raise ValueError(f"{where}: objective {name!r} needs `models` (or `tenants`), a non-empty list of names or globs")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
            raise ValueError(f"{where}: objective {name!r} needs a `target` between 0 and 1 (such as 0.99), not {target!r}")
        ttft, tpot, e2e = (_seconds(spec, key, where) for key in OBJECTIVES)
        if ttft is None and tpot is None and e2e is None:
            raise ValueError(f"{where}: objective {name!r} states none of ttft, tpot, e2e")
        window = parse_window(spec["window"], where) if "window" in spec else DEFAULT_WINDOW_S
        out.append(Objective(name, tuple(models), float(target), ttft, tpot, e2e, window, tuple(tenants), spec.get("page_per_tenant", False)))
    return tuple(out)


def load(path: str) -> tuple[Objective, ...]:
    return parse(read_text(path, f"slo file {path}"), path)


Key = tuple[str, str]  # (model, "ttft" | "e2e"): the proxy phase before the first token is not the whole one


class Usual:
    """Per model, each phase's median over its last USUAL_WINDOW good requests. Adding is an append
    per phase; the medians are computed when a miss asks for them, at most once per sixteenth of a
    full window of new values."""

    def __init__(self) -> None:
        self._values: dict[Key, dict[str, collections.deque[float]]] = {}
        self._medians: dict[Key, dict[str, float]] = {}
        self._fresh: dict[Key, int] = {}

    def _key(self, key: Key) -> Key:
        return key if key in self._values or len(self._values) < 2 * USUAL_MODELS else ("\0other", key[1])

    def add(self, key: Key, phases: dict[str, float]) -> None:
        key = self._key(key)
        values = self._values.setdefault(key, {})
        for phase, seconds in phases.items():
            ring = values.get(phase)
            if ring is None:
                ring = values[phase] = collections.deque(maxlen=USUAL_WINDOW)
            ring.append(seconds)
        self._fresh[key] = self._fresh.get(key, 0) + 1

    def of(self, key: Key) -> dict[str, float]:
        key = self._key(key)
        medians, fresh = self._medians.get(key), self._fresh.get(key, 0)
        # Recomputed when anything is new while the window fills, then after every sixteenth of it.
        filling = fresh and min(map(len, self._values.get(key, {}).values()), default=0) < USUAL_WINDOW
        if medians is None or filling or fresh >= USUAL_WINDOW // 16:
            rings = self._values.get(key, {})
            medians = self._medians[key] = {phase: _median(ring) for phase, ring in rings.items() if ring}
            self._fresh[key] = 0
        return medians


def _median(values: collections.deque[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def blame(phases: dict[str, float], usual: dict[str, float]) -> str:
    """The phase furthest above its usual value; the largest phase when none is above it."""
    if not phases:
        return "unknown"
    excess = {phase: seconds - usual.get(phase, 0.0) for phase, seconds in phases.items()}
    worst = max(excess, key=excess.__getitem__)
    return worst if excess[worst] > 0 else max(phases, key=phases.__getitem__)


def before_first_token(b: Breakdown) -> dict[str, float]:
    """The phases a client waits through before its first token (a stream that never got one: the
    upstream's whole wait, `server`, is its queue and prefill)."""
    phases = {p: b.phases[p] for p in BEFORE_FIRST_TOKEN if p in b.phases and p != "proxy"}
    phases["proxy"] = b.proxy_before_s + b.proxy_first_s
    if b.ttft_s is None and "server" in b.phases:
        phases["prefill"] = phases.get("prefill", 0.0) + b.phases["server"]
    return phases


def tpot_s(t: RequestTiming, b: Breakdown) -> float | None:
    """(e2e - TTFT) / (visible output tokens per choice - 1); None when it cannot be measured."""
    visible = t.visible_tokens
    if b.ttft_s is None or visible is None:
        return None
    per_choice = visible / max(1, b.choices)
    return (b.e2e_s - b.ttft_s) / (per_choice - 1) if per_choice > 1 else None


class SLOs:
    """The objectives in force, and what each model's phases usually are. Built from `--slo`;
    `reload` (SIGHUP) parses the whole file first, so a broken one changes nothing."""

    def __init__(self, path: str = "", objectives: tuple[Objective, ...] | None = None) -> None:
        self.path = path
        self.objectives: tuple[Objective, ...] = objectives if objectives is not None else (load(path) if path else ())
        self.usual = Usual()

    def reload(self) -> None:
        if self.path:
            self.objectives = load(self.path)
            log.warning("objectives reloaded from %s: %s", self.path, ", ".join(o.name for o in self.objectives))

    def pick(self, model: str, tenant: str = "unknown") -> Objective | None:
        return next((o for o in self.objectives if o.matches(model, tenant)), None)

    def judge(self, t: RequestTiming, b: Breakdown) -> Verdict | None:
        """This request's verdict, or None (not a generation request, or no objective names its model)."""
        if not self.objectives or t.endpoint not in GENERATION:
            return None
        objective = self.pick(t.model, t.tenant)
        if objective is None:
            return None
        limits = objective.thresholds
        stated = tuple(limits)
        if t.outcome in FAILED:
            if 400 <= t.status_code < 500 and t.status_code != 429:
                return Verdict(objective.name, None, stated=stated)  # the client's own mistake
            return Verdict(objective.name, False, ("error",), {"error": t.outcome}, stated)
        measured: dict[str, float] = {}
        if t.outcome in LEFT:  # only what it had already waited through counts
            waited = b.ttft_s if b.ttft_s is not None else b.e2e_s
            if "ttft" in limits and t.stream and waited > limits["ttft"]:
                measured["ttft"] = waited
            if "e2e" in limits and b.e2e_s > limits["e2e"]:
                measured["e2e"] = b.e2e_s
            if not measured:
                return Verdict(objective.name, None, stated=stated)
        else:
            paced = t.unmeasured == "client_backpressure"  # a slow reader set the pace after the first token: not the service's
            if "ttft" in limits and t.stream and b.ttft_s is not None:
                measured["ttft"] = b.ttft_s
            if "tpot" in limits and t.stream and not paced and (tpot := tpot_s(t, b)) is not None:
                measured["tpot"] = tpot
            if "e2e" in limits and not paced:
                measured["e2e"] = b.e2e_s
        if not measured:
            return Verdict(objective.name, None, stated=stated)
        missed = tuple(name for name in OBJECTIVES if name in measured and measured[name] > limits[name])
        first = before_first_token(b) if t.stream else None
        if not missed:
            if t.outcome == "ok":  # what this model's phases are when it meets its objectives
                self.usual.add((t.model, "e2e"), b.phases)
                if first is not None:
                    self.usual.add((t.model, "ttft"), first)
            return Verdict(objective.name, True, stated=stated)
        blamed: dict[str, str] = {}
        for name in missed:
            if name == "ttft" and first is not None:
                blamed[name] = blame(first, self.usual.of((t.model, "ttft")))
            elif name == "tpot":
                blamed[name] = "decode"
            else:
                blamed[name] = blame(b.phases, self.usual.of((t.model, "e2e")))
        return Verdict(objective.name, False, missed, blamed, stated)
