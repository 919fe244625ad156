"""Routing to many engines: model names (exact or glob) to one or more upstreams (`--routes PATH`).

The routing file (YAML):

    upstreams:
      - name: vllm-a                      # the `upstream` label
        url: http://vllm-a:8000/v1
        api_key_env: ""                   # env var whose value is sent as the key (optional)
        connect_timeout: 10               # optional, like the flags: connect_timeout,
        max_connections: 256              #   first_token_timeout, read_timeout, write_timeout,
                                          #   pool_timeout, max_connections, keepalive_expiry,
        upstream_proxy: http://proxy:3128 #   upstream_proxy (none: direct; default: the environment's)
    routes:
      - models: ["meta-llama/*", "qwen3-8b"]
        upstreams: [vllm-a, vllm-b]       # several: `pick` chooses
        first_token_deadline: 2.0         # optional: seconds to the first content token; then another replica
        retries: 1                        # further replicas tried at most per request (default: 1 with a deadline, else 0)
        pick: predicted_ttft              # or fewest_in_flight (the default)
        retry_budget: {ratio: 0.2, min_concurrency: 3}   # optional (these defaults, Envoy's): retry.py
    default: vllm-a                       # optional: else an unknown model is a 404 model_not_found
    ejection: {consecutive_failures: 5, base_time: 30}   # optional (health.py has every key), or `off`
    health_check: {path: /health, interval: 1, timeout: 1}   # optional (checks.py has every key), or `off`

Every key of the file is checked: an unknown one (a typo in `first_token_deadline` would leave an
operator believing they have failover) is refused with its line. A route with `retries` tries
another of its replicas when an attempt fails before anything reached the client: a connect error, a
5xx or 429, or (with `first_token_deadline`) no content token by the deadline, within its retry
budget (retry.py); `pick: predicted_ttft` sends each request to the replica with the lowest
predicted time to first token (forecast.py). Every replica's health is judged from every attempt
sent to it (health.py) and, for a route of several, from active checks (checks.py): one failing is
set aside, by default, whatever the route's `pick` (picker.py filters, scores and picks).

A route's `url` maps request paths exactly as `--upstream` does (`Pool.target`, upstream/pool.py): the client's
path goes below the URL's path less a final `/v1`, so one upstream serves OpenAI's `/v1/…`,
Anthropic's `/v1/messages`, Azure's `/openai/deployments/…` (give Azure's resource URL, an origin)
and any other path alike. The model is what the request's API names (the body's `model`, else an
Azure deployment in the path); a request that names none (`GET /api/tags`) goes to `default`.

Exact names win over globs; globs are tried in file order. Without `--routes`, the one
`--upstream` serves every model, as before. `reload` (SIGHUP) parses the whole file first: a
broken file is refused with a clear message and the old routes keep serving. An upstream whose
definition did not change keeps its pool; streams in flight keep the upstream they started on.
"""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import Settings, checked_entry, parse_yaml, read_text
from ..upstream.connection import Budget
from ..upstream.pool import Pool
from ..wire.prompt import Chain
from .checks import CheckSpec, targets
from .health import EjectionSpec, Health
from .picker import Picker
from .replica import Replica
from .retry import BudgetSpec, RetryBudget

log = logging.getLogger("llmproxy.routes")
GLOBBED_MAX = 4096  # models whose glob route is remembered (names are client-chosen: bounded)
HOLDERS_MAX = 100_000  # stored responses whose replica is remembered (a Responses API id: about 10 MB)
PICKS = ("fewest_in_flight", "predicted_ttft")
ROUTE_KEYS = ("models", "upstreams", "first_token_deadline", "retries", "pick", "retry_budget")


@dataclass
class Rule:
    """One route: its models, its replicas, and how a request is placed and failed over among them."""

    models: tuple[str, ...]
    upstreams: tuple[str, ...]
    first_token_deadline: float | None = None
    retries: int = 0
    pick: str = "fewest_in_flight"
    budget: RetryBudget = field(default_factory=RetryBudget)



OVERRIDES = ("connect_timeout", "first_token_timeout", "read_timeout", "write_timeout", "pool_timeout", "max_connections",
             "keepalive_expiry", "upstream_proxy")


def _upstream_settings(base: Settings, spec: dict[str, Any], where: str) -> Settings:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("url"), str):
        raise ValueError(f"{where}: each upstream needs a `name` and a `url`")
    where = f"{where}, line {spec.pop('__line__', '?')}"
    unknown = set(spec) - {"name", "url", "api_key_env", *OVERRIDES}
    if unknown:
        raise ValueError(f"{where}: upstream {spec['name']!r} has unknown keys {sorted(unknown)}")
    key_env = spec.get("api_key_env") or ""
    key = os.environ.get(key_env, "") if key_env else ""
    if key_env and not key:
        raise ValueError(f"{where}: upstream {spec['name']!r} names api_key_env {key_env!r}, which is empty or unset")
    try:
        values = {name: type(getattr(base, name))(spec[name]) for name in OVERRIDES if name in spec}
    except (TypeError, ValueError):
        raise ValueError(f"{where}: upstream {spec['name']!r} has a value of the wrong type") from None
    return dataclasses.replace(base, upstream=spec["url"], upstream_name=spec["name"], upstream_api_key_env=key_env,
                               upstream_api_key=key, **values)


class Router:
    """Which upstream serves a model. Built from the settings; `reload` re-reads the routing file."""

    def __init__(self, settings: Settings, on_eject: Callable[[str, str, float], None] | None = None) -> None:
        self.settings = settings
        self.budget = Budget(settings.stream_buffer_bytes, settings.stream_buffer_total_bytes)  # one for every upstream
        self.on_eject = on_eject  # (upstream, reason, seconds): each replica set aside (the counter, a log line)
        self.upstreams: dict[str, Replica] = {}
        self.routes: list[Rule] = []
        self.exact: dict[str, Rule] = {}
        self.globbed: dict[str, Rule | None] = {}  # a model's glob route, once matched (bounded)
        self.default: str | None = None
        self.ejection = EjectionSpec()
        self.checks = CheckSpec(enabled=False)  # a routes file's `health_check` (on by default there)
        self.picker = Picker()
        self.holders: collections.OrderedDict[str, str] = collections.OrderedDict()  # a stored response's id -> its replica
        if settings.routes:
            self._install(*self._parse(settings.routes))
        else:
            upstream = self._judged(Replica(Pool(settings, self.budget)))
            self.upstreams = {upstream.label: upstream}
            self.routes, self.default = [Rule(("*",), (upstream.label,))], upstream.label
        self.fallback = Rule(("*",), (self.default,)) if self.default is not None else None

    def _judged(self, upstream: Replica) -> Replica:
        """The upstream's health under the file's `ejection` policy, reporting each ejection."""
        report = self.on_eject
        upstream.health = Health(self.ejection, None if report is None else lambda reason, seconds: report(upstream.label, reason, seconds))
        return upstream

    def _parse(self, path: str) -> tuple[dict[str, Settings], list[Rule], str | None, EjectionSpec, CheckSpec]:
        data = parse_yaml(read_text(path, f"routes file {path}"), f"routes file {path}")
        if not isinstance(data, dict) or not isinstance(data.get("upstreams"), list) or not isinstance(data.get("routes", []), list):
            raise ValueError(f"routes file {path}, line 1: expected `upstreams:` (a list) and `routes:` (a list)")
        unknown = sorted(set(data) - {"upstreams", "routes", "default", "ejection", "health_check", "__line__"})
        if unknown:
            raise ValueError(f"routes file {path}, line {data['__line__']}: unknown keys {unknown} "
                             f"(known: upstreams, routes, default, ejection, health_check)")
        specs: dict[str, Settings] = {}
        for spec in data["upstreams"]:
            settings = _upstream_settings(self.settings, spec, f"routes file {path}")
            if spec["name"] in specs:
                raise ValueError(f"routes file {path}: upstream {spec['name']!r} is defined twice")
            specs[spec["name"]] = settings
        routes = [_rule(route, specs, f"routes file {path}") for route in data.get("routes", [])]
        default = data.get("default")
        if default is not None and default not in specs:
            raise ValueError(f"routes file {path}: default {default!r} is not an upstream")
        ejection, checks = data.get("ejection"), data.get("health_check")
        line = ejection.get("__line__", "?") if isinstance(ejection, dict) else data["__line__"]
        checks_line = checks.get("__line__", "?") if isinstance(checks, dict) else data["__line__"]
        return (specs, routes, default, EjectionSpec.parse(ejection, f"routes file {path}, line {line}"),
                CheckSpec.parse(checks, f"routes file {path}, line {checks_line}"))

    def _install(self, specs: dict[str, Settings], routes: list[Rule], default: str | None, ejection: EjectionSpec,
                 checks: CheckSpec) -> None:
        """The parsed file in force. An upstream whose definition did not change keeps its pool and its
        health (a replica set aside stays aside: a reload is no cure), under the new `ejection` policy."""
        upstreams = {}
        changed, self.ejection = ejection != self.ejection, ejection
        for name, settings in specs.items():
            current = self.upstreams.get(name)
            if current is not None and current.pool.settings == settings:
                upstreams[name] = current
                if changed:
                    current.health.configure(ejection)
            else:
                upstreams[name] = self._judged(Replica(Pool(settings, self.budget)))
        for name, old in self.upstreams.items():
            if upstreams.get(name) is not old:
                old.pool.close()  # idle connections only: its streams in flight finish on it
        self.upstreams, self.routes, self.default = upstreams, routes, default
        self.fallback = Rule(("*",), (default,)) if default is not None else None
        self.exact, self.globbed = {}, {}
        self.checks = checks
        checked = {u.label for u, _ in self.check_targets()}
        for name, upstream in upstreams.items():
            upstream.health.checked = name in checked  # (its checks, not user requests, bring it back: health.py)
        for rule in routes:
            for model in rule.models:
                if not any(c in model for c in "*?["):
                    self.exact.setdefault(model, rule)

    def reload(self) -> None:
        """Re-read the routing file; a broken one raises ValueError and changes nothing."""
        if self.settings.routes:
            self._install(*self._parse(self.settings.routes))
            log.warning("routes reloaded from %s: %d upstreams, %d routes", self.settings.routes, len(self.upstreams), len(self.routes))

    def route(self, model: str) -> Rule | None:
        """The route serving a model (exact names first, then globs in file order, then `default`)."""
        rule = self.exact.get(model)
        if rule is None:
            if model in self.globbed:
                rule = self.globbed[model]
            else:  # (matched once per model: fnmatch per request cost more than the rest of picking)
                rule = next((r for r in self.routes if any(fnmatch.fnmatchcase(model, m) for m in r.models)), None)
                if len(self.globbed) < GLOBBED_MAX:
                    self.globbed[model] = rule
        return rule if rule is not None else self.fallback

    def check_targets(self) -> list[tuple[Replica, str]]:
        """The replicas the active checks look at now (checks.py), with a model each; none with checks off."""
        return targets(self.routes, self.upstreams) if self.checks.enabled else []

    def replicas(self, rule: Rule) -> list[Replica]:
        return [self.upstreams[n] for n in rule.upstreams]

    def choose(self, rule: Rule, prompt_tokens: int = 0, tried: tuple[str, ...] = (), now: float | None = None,
               chain: Chain | None = None, pin: str = "") -> Replica | None:
        """One of the route's replicas not tried yet for this request (None: none left), by its `pick` (picker.py); `pin`:
        the replica that holds what the request names (a stored response), while it may take requests."""
        now = time.monotonic() if now is None else now
        if len(rule.upstreams) == 1:
            return None if tried else self.upstreams[rule.upstreams[0]]
        if pin and pin in rule.upstreams and pin not in tried and self.upstreams[pin].health.available(now):
            return self.upstreams[pin]
        return self.picker.choose(rule.pick, self.replicas(rule), prompt_tokens, tried, now, chain)

    def held(self, response_id: str, upstream: str) -> None:
        """A stored response (a Responses API id) lives on this replica: the requests that name it go there."""
        holders = self.holders
        holders[response_id] = upstream
        holders.move_to_end(response_id)
        if len(holders) > HOLDERS_MAX:
            holders.popitem(last=False)

    def holder(self, response_id: Any) -> str:
        """The replica holding a stored response ("": none known, or no longer an upstream)."""
        label = self.holders.get(response_id, "") if isinstance(response_id, str) else ""
        return label if label in self.upstreams else ""

    def named(self, endpoint: str, parsed: dict[str, Any] | None, path: str) -> str:
        """The replica holding the stored response a request names (`previous_response_id`, or the path's
        /v1/responses/{id}): only it can answer ("": none named, or none known)."""
        if endpoint == "responses" and parsed is not None:
            return self.holder(parsed.get("previous_response_id"))
        if endpoint == "responses_other" and "/responses/" in path:
            return self.holder(path.split("/responses/", 1)[1].split("/", 1)[0])
        return ""

    def pinned(self, label: str) -> Rule:
        """A route of the one replica holding what a request names, for a request no route serves (GET /v1/responses/{id})."""
        return Rule(("*",), (label,))

    @staticmethod
    def indexes(rule: Rule) -> bool:
        """Whether the route's placement reads its replicas' prefix indexes (prefix.py): its prompts are chained."""
        return rule.pick == "predicted_ttft" and len(rule.upstreams) > 1

    def could_retry(self, rule: Rule, tried: tuple[str, ...]) -> bool:
        """Another replica of the route could take this request now (none chosen, nothing counted)."""
        return len(rule.upstreams) > 1 and self.picker.could_serve(self.replicas(rule), tried)

    def models(self) -> list[str]:
        """The exact model names the routes name (for GET /v1/models)."""
        return sorted(self.exact)

    def close(self) -> None:
        for upstream in self.upstreams.values():
            upstream.pool.close()


def _rule(route: Any, specs: dict[str, Settings], where: str) -> Rule:
    """One route of the file, every key checked."""
    where = checked_entry(route, where, ROUTE_KEYS, "route")
    models, names = route.get("models"), route.get("upstreams")
    if not (isinstance(models, list) and models and isinstance(names, list) and names):
        raise ValueError(f"{where}: each route needs `models` and `upstreams` (non-empty lists)")
    missing = [n for n in names if n not in specs]
    if missing:
        raise ValueError(f"{where}: route {models} names unknown upstreams {missing}")
    deadline = route.get("first_token_deadline")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0):
        raise ValueError(f"{where}: first_token_deadline must be a positive number of seconds, not {deadline!r}")
    retries = route.get("retries", 1 if deadline is not None else 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"{where}: retries must be a whole number of further replicas, not {retries!r}")
    pick = route.get("pick", "fewest_in_flight")
    if pick not in PICKS:
        raise ValueError(f"{where}: pick must be one of {', '.join(PICKS)}, not {pick!r}")
    budget = RetryBudget(BudgetSpec.parse(route.get("retry_budget"), where))
    return Rule(tuple(str(m) for m in models), tuple(names), float(deadline) if deadline is not None else None, retries, pick, budget)
