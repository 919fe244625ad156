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
        upstreams: [vllm-a, vllm-b]       # several: the one with fewest requests in flight
    default: vllm-a                       # optional: else an unknown model is a 404 model_not_found

A route's `url` maps request paths exactly as `--upstream` does (`Upstream.target`): the client's
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

import dataclasses
import fnmatch
import logging
import os
from typing import Any

import yaml

from .config import Settings
from .connection import Budget
from .upstream import Upstream

log = logging.getLogger("llmproxy.routes")
GLOBBED_MAX = 4096  # models whose glob route is remembered (names are client-chosen: bounded)
OVERRIDES = ("connect_timeout", "first_token_timeout", "read_timeout", "write_timeout", "pool_timeout", "max_connections",
             "keepalive_expiry", "upstream_proxy")


def _upstream_settings(base: Settings, spec: dict[str, Any], where: str) -> Settings:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("url"), str):
        raise ValueError(f"{where}: each upstream needs a `name` and a `url`")
    unknown = set(spec) - {"name", "url", "api_key_env", *OVERRIDES}
    if unknown:
        raise ValueError(f"{where}: upstream {spec['name']!r} has unknown keys {sorted(unknown)}")
    key_env = spec.get("api_key_env") or ""
    key = os.environ.get(key_env, "") if key_env else ""
    if key_env and not key:
        raise ValueError(f"{where}: upstream {spec['name']!r} names api_key_env {key_env!r}, which is empty or unset")
    values = {name: type(getattr(base, name))(spec[name]) for name in OVERRIDES if name in spec}
    return dataclasses.replace(base, upstream=spec["url"], upstream_name=spec["name"], upstream_api_key_env=key_env,
                               upstream_api_key=key, **values)


class Router:
    """Which upstream serves a model. Built from the settings; `reload` re-reads the routing file."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.budget = Budget(settings.stream_buffer_bytes, settings.stream_buffer_total_bytes)  # one for every upstream
        self.upstreams: dict[str, Upstream] = {}
        self.routes: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self.exact: dict[str, tuple[str, ...]] = {}
        self.globbed: dict[str, tuple[str, ...] | None] = {}  # a model's glob route, once matched (bounded)
        self.default: str | None = None
        if settings.routes:
            self._install(*self._parse(settings.routes))
        else:
            upstream = Upstream(settings, self.budget)
            self.upstreams = {upstream.label: upstream}
            self.routes, self.default = [(("*",), (upstream.label,))], upstream.label

    def _parse(self, path: str) -> tuple[dict[str, Settings], list[tuple[tuple[str, ...], tuple[str, ...]]], str | None]:
        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"routes file {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("upstreams"), list) or not isinstance(data.get("routes", []), list):
            raise ValueError(f"routes file {path}: expected `upstreams:` (a list) and `routes:` (a list)")
        specs: dict[str, Settings] = {}
        for spec in data["upstreams"]:
            settings = _upstream_settings(self.settings, spec, f"routes file {path}")
            if spec["name"] in specs:
                raise ValueError(f"routes file {path}: upstream {spec['name']!r} is defined twice")
            specs[spec["name"]] = settings
        routes = []
        for route in data.get("routes", []):
            models, names = (route or {}).get("models"), (route or {}).get("upstreams")
            if not (isinstance(models, list) and models and isinstance(names, list) and names):
                raise ValueError(f"routes file {path}: each route needs `models` and `upstreams` (non-empty lists)")
            missing = [n for n in names if n not in specs]
            if missing:
                raise ValueError(f"routes file {path}: route {models} names unknown upstreams {missing}")
            routes.append((tuple(str(m) for m in models), tuple(names)))
        default = data.get("default")
        if default is not None and default not in specs:
            raise ValueError(f"routes file {path}: default {default!r} is not an upstream")
        return specs, routes, default

    def _install(self, specs: dict[str, Settings], routes: list[tuple[tuple[str, ...], tuple[str, ...]]], default: str | None) -> None:
        upstreams = {}
        for name, settings in specs.items():
            current = self.upstreams.get(name)
            upstreams[name] = current if current is not None and current.settings == settings else Upstream(settings, self.budget)
        for name, old in self.upstreams.items():
            if upstreams.get(name) is not old:
                old.close()  # idle connections only: its streams in flight finish on it
        self.upstreams, self.routes, self.default = upstreams, routes, default
        self.exact, self.globbed = {}, {}
        for models, names in routes:
            for model in models:
                if not any(c in model for c in "*?["):
                    self.exact.setdefault(model, names)

    def reload(self) -> None:
        """Re-read the routing file; a broken one raises ValueError and changes nothing."""
        if self.settings.routes:
            self._install(*self._parse(self.settings.routes))
            log.warning("routes reloaded from %s: %d upstreams, %d routes", self.settings.routes, len(self.upstreams), len(self.routes))

    def pick(self, model: str) -> Upstream | None:
        names = self.exact.get(model)
        if names is None:
            if model in self.globbed:
                names = self.globbed[model]
            else:  # (matched once per model: fnmatch per request cost more than the rest of picking)
                names = next((n for models, n in self.routes if any(fnmatch.fnmatchcase(model, m) for m in models)), None)
                if len(self.globbed) < GLOBBED_MAX:
                    self.globbed[model] = names
        if names is None:
            names = (self.default,) if self.default is not None else None
        if names is None:
            return None
        if len(names) == 1:
            return self.upstreams[names[0]]
        return min((self.upstreams[n] for n in names), key=lambda u: u.in_flight)

    def models(self) -> list[str]:
        """The exact model names the routes name (for GET /v1/models)."""
        return sorted(self.exact)

    def close(self) -> None:
        for upstream in self.upstreams.values():
            upstream.close()
