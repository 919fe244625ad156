"""One settings object, built in one place from flags and environment variables.

Every `serve` flag `--some-flag` is also read from `LLMPROXY_SOME_FLAG`; a flag given on the
command line wins over the environment, which wins over the default. The table `OPTIONS` is the
single definition the CLI, the reference (docs/configuration.md) and the tests read.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

ENV_PREFIX = "LLMPROXY_"
TOKEN_SPAN_MODES = ("offsets", "events", "spans", "off")
DIRECT = ("none", "direct")  # --upstream-proxy values that mean: no proxy, whatever the environment says


@dataclass(frozen=True)
class EgressProxy:
    host: str
    port: int
    authorization: bytes | None  # the Proxy-Authorization header's value, when the URL has credentials

    @property
    def where(self) -> str:
        """For log lines and errors: host and port, never the credentials."""
        return f"{self.host}:{self.port}"


def parse_egress(url: str) -> EgressProxy:
    """--upstream-proxy (or a route's `proxy:`) read: an http:// proxy URL (a bare host:port is http too); ValueError for
    anything else. Parsed here, with the other settings, so that a bad one is refused at start (upstream/egress.py uses it)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        safe = f"{parts.scheme}://{parts.hostname or ''}:{parts.port or ''}"
        raise ValueError(f"the upstream proxy must be an http:// URL (a CONNECT proxy), not {safe}")
    authorization = None
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        authorization = b"Basic " + base64.b64encode(credentials)
    return EgressProxy(parts.hostname, parts.port or 80, authorization)


def default_records_path(port: int) -> str:
    """--records-db auto: in the user's data directory (XDG), one file per listening port: the workers of one proxy
    share it; two proxies on one machine do not mix their records."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "llm-latency-proxy" / f"records-{port}.sqlite")


@dataclass(frozen=True)
class Option:
    name: str  # attribute name on Settings; the flag is --name-with-dashes
    type: type
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("upstream", str, "http://127.0.0.1:8000/v1", "base URL of the upstream API (ends in /v1)"),
    Option("host", str, "127.0.0.1", "address to listen on"),
    Option("port", int, 8080, "port to listen on"),
    Option("workers", int, 1, "uvicorn worker processes (metrics use multiprocess mode when > 1)"),
    Option("upstream_api_key_env", str, "", "name of an env var whose value replaces the client's Authorization"),
    Option("upstream_name", str, "", "value of the `upstream` metric label (default: host:port of --upstream)"),
    Option("provider_name", str, "", "gen_ai.provider.name on spans (default: openai for *.openai.com, else openai_compatible)"),
    Option("routes", str, "", "YAML routing file: model names (exact or glob) to upstreams, each with its own URL, key, timeouts and pool (see proxy/fleet/routes.py); reloaded on SIGHUP; empty: every model goes to --upstream"),
    Option("slo", str, "", "YAML file of service-level objectives: per model (exact or glob), TTFT, TPOT and end-to-end thresholds and a target (see proxy/measure/slo.py); every generation request gets a verdict and a blamed phase; reloaded on SIGHUP; empty: none"),
    Option("tenants", str, "", "YAML file attributing each request to a tenant (by its API key's fingerprint or a header) and an end user (a header, or the API's own `user` fields) (see proxy/serve/tenants.py); reloaded on SIGHUP; empty: every request's tenant is `unknown`"),
    Option("tenant_expiry", float, 3600.0, "seconds after a tenant's last request before its metric series are removed (0: never); with --workers > 1 they stay until the proxy restarts"),
    Option("connect_timeout", float, 10.0, "seconds to open a connection to the upstream (DNS+TCP+TLS)"),
    Option("first_token_timeout", float, 600.0, "seconds from sending a request to its first content chunk, enforced after the headers too: comments (`: keep-alive`) and role-only chunks are not tokens (for non-streaming requests, the whole response)"),
    Option("read_timeout", float, 120.0, "seconds the upstream may stay silent between chunks once the first content chunk arrived; also how long a client may stop reading before it is cut (outcome client_slow)"),
    Option("write_timeout", float, 60.0, "seconds to send the request to the upstream"),
    Option("pool_timeout", float, 0.0, "seconds a request may wait for a free upstream connection when the pool is full (0: none, an immediate 503 `proxy_overloaded`, reason pool); the wait is the phase `wait`, the proxy's own"),
    Option("max_connections", int, 0, "upstream connection pool size, per upstream and worker process (0: --max-in-flight if set, else as many streams as the open files limit holds, a client and an upstream socket each)"),
    Option("keepalive_expiry", float, 4.0, "seconds an idle upstream connection is kept for reuse, then closed by a sweep; below the 5 s after which uvicorn (vLLM, SGLang), llama.cpp and Node close idle connections, so the proxy does not send on one the server is closing for being idle (one closed as a request goes out anyway, as llama.cpp closes after every stream, with no byte of an answer on it: the request is sent again on a new connection)"),
    Option("max_in_flight", int, 0, "admission control: requests in flight in this proxy at most (split evenly over --workers), shared fairly by tenant (--tenants, weights): at the cap a tenant over its share gets a 503 `proxy_overloaded` with Retry-After, one under it is still admitted (0: off; size it from the saturation point in bench/RESULTS.md)"),
    Option("admission_queue_s", float, 0.0, "with --max-in-flight: seconds a request over its tenant's share may wait for a slot instead of an immediate 503 (0: no wait); slots go to the waiting tenant with the fewest in flight for its weight; the wait is the phase `wait`"),
    Option("max_body_bytes", int, 32 * 1024 * 1024, "largest request body accepted (larger: 413)"),
    Option("stream_buffer_bytes", int, 8 * 1024 * 1024, "bytes of one response the relay reads ahead of a slow client, so each upstream read keeps its own stamp; past it reading pauses (back-pressure) and the request is marked unmeasured (client_backpressure), out of the decode figures"),
    Option("stream_buffer_total_bytes", int, 128 * 1024 * 1024, "bytes read ahead of slow clients across every stream of a worker process at most (exceeded by one socket read per stream at most)"),
    Option("max_event_bytes", int, 16 * 1024 * 1024, "largest streamed event the proxy frames (and largest decoded read); a larger one is relayed as it comes and the request counted as unmeasured (reason event_too_large)"),
    Option("body_timeout", float, 30.0, "seconds a client may take to send its request body (slower: 408)"),
    Option("header_timeout", float, 10.0, "seconds a client may take to send its request headers (slowloris guard)"),
    Option("shutdown_grace", float, 30.0, "on SIGTERM: seconds in-flight requests may take to finish; new connections are refused"),
    Option("api_key", str, "", "comma-separated keys clients must present as Bearer tokens to the proxy (off when empty)"),
    Option("api_keys_file", str, "", "file with one client key per line (added to --api-key)"),
    Option("admin_port", int, 0, "serve /metrics and /llmproxy/* on this port instead of the main one (0: same port)"),
    Option("admin_key", str, "", "Bearer key required for /metrics and /llmproxy/* (off when empty)"),
    Option("capture_content", bool, False, "put prompt and completion text on spans (gen_ai.input/output.messages); off by default"),
    Option("ca_bundle", str, "", "CA bundle file for a TLS upstream (default: the system store)"),
    Option("upstream_proxy", str, "", "http://[USER:PASSWORD@]HOST:PORT of a forward proxy to reach the upstream through (CONNECT for https upstreams); default: https_proxy / http_proxy / all_proxy and no_proxy as curl reads them; none: direct"),
    Option("inject_usage", bool, True, "ask streaming upstreams for usage and strip the extra chunk"),
    Option("strip_engine_fields", bool, False, "remove engine-only fields (llama.cpp `timings`) from what the client receives"),
    Option("tokenize", bool, True, "count prompt tokens with the tokenizer off the critical path (the tokenize phase)"),
    Option("default_encoding", str, "o200k_base", "tiktoken encoding for models tiktoken does not know"),
    Option("max_models", int, 100, "distinct model label values before later ones become `other`"),
    Option("max_label_sets", int, 400, "distinct (model, upstream, endpoint, stream, tenant) label sets of the per-request metrics before a new one's model becomes `other` (then its tenant, past a reserve of a sixteenth): bounds one scrape (about 20,000 series, 3 MB) whatever mix of APIs, models and tenants"),
    Option("token_spans", str, "offsets", "per-chunk stamps on the decode span: offsets (arrays of µs offsets, tokens and choices per chunk: the default, near free), events (a span event per chunk), spans (a span per chunk) or off; costs in bench/RESULTS.md"),
    Option("otlp_endpoint", str, "", "OTLP/HTTP endpoint for spans (default: the OTEL_EXPORTER_OTLP_* variables)"),
    Option("service_name", str, "", "service.name of the spans (default: OTEL_SERVICE_NAME or llm-latency-proxy)"),
    Option("records", int, 1000, "recent per-request records kept in memory (for GET /llmproxy/requests when --records-db is off)"),
    Option("records_db", str, "auto", "where durable per-request records go: an SQLite file (auto: records-PORT.sqlite in the user data directory, $XDG_DATA_HOME or ~/.local/share/llm-latency-proxy), or postgresql://USER@HOST:PORT/DB, one store for every replica; empty: off"),
    Option("records_db_password_file", str, "", "file holding the PostgreSQL password (a mounted Secret; re-read at each connect); also libpq's PGPASSWORD or a password in the URL"),
    Option("records_buffer", int, 50_000, "records waiting for the store at most (it is down or slow); past it, or past --records-buffer-bytes, the oldest are dropped and counted"),
    Option("records_buffer_bytes", int, 64 * 1024 * 1024, "bytes of records (as JSON) waiting for the store at most"),
    Option("instance", str, "", "this replica's name on its records (default: $POD_NAME, else HOSTNAME:PORT)"),
    Option("records_max_rows", int, -1, "records kept in the database at most (-1: the store's default, 1,000,000 in SQLite, none in PostgreSQL, where age alone bounds it; 0: no limit). SQLite deletes the oldest records; PostgreSQL drops its oldest days whole"),
    Option("records_max_age", float, 7 * 24 * 3600.0, "seconds a record and the aggregates are kept in the database (0: no limit); PostgreSQL drops a day once all of it is older"),
    Option("log_requests", bool, False, "log one JSON line per finished request (timings only, no text)"),
    Option("log_level", str, "warning", "log level of the proxy and uvicorn"),
)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(option: Option, raw: Any) -> Any:
    if option.type is bool and isinstance(raw, str):
        return _parse_bool(raw)
    return option.type(raw)


@dataclass(frozen=True)
class Settings:
    upstream: str = "http://127.0.0.1:8000/v1"
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    upstream_api_key_env: str = ""
    upstream_name: str = ""
    provider_name: str = ""
    routes: str = ""
    slo: str = ""
    tenants: str = ""
    tenant_expiry: float = 3600.0
    connect_timeout: float = 10.0
    first_token_timeout: float = 600.0
    read_timeout: float = 120.0
    write_timeout: float = 60.0
    pool_timeout: float = 0.0
    max_connections: int = 0
    keepalive_expiry: float = 4.0
    max_in_flight: int = 0
    admission_queue_s: float = 0.0
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    shutdown_grace: float = 30.0
    api_key: str = field(default="", repr=False)
    api_keys_file: str = ""
    admin_port: int = 0
    admin_key: str = field(default="", repr=False)
    capture_content: bool = False
    ca_bundle: str = ""
    upstream_proxy: str = field(default="", repr=False)  # may hold the proxy's credentials
    inject_usage: bool = True
    strip_engine_fields: bool = False
    tokenize: bool = True
    default_encoding: str = "o200k_base"
    max_models: int = 100
    max_label_sets: int = 400
    max_event_bytes: int = 16 * 1024 * 1024
    stream_buffer_bytes: int = 8 * 1024 * 1024
    stream_buffer_total_bytes: int = 128 * 1024 * 1024
    token_spans: str = "offsets"
    otlp_endpoint: str = ""
    service_name: str = ""
    records: int = 1000
    records_db: str = field(default="auto", repr=False)  # a PostgreSQL URL may hold a password
    records_db_password_file: str = ""
    records_buffer: int = 50_000
    records_buffer_bytes: int = 64 * 1024 * 1024
    instance: str = ""
    records_max_rows: int = -1
    records_max_age: float = 7 * 24 * 3600.0
    log_requests: bool = False
    log_level: str = "warning"
    # Not a flag: the resolved upstream key, read from the env var named above at build time.
    upstream_api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.admin_port and self.workers > 1:
            raise ValueError("--admin-port needs --workers 1 (protect /metrics with --admin-key instead)")
        if min(self.keepalive_expiry, self.max_in_flight, self.max_connections, self.pool_timeout, self.admission_queue_s) < 0:
            raise ValueError("--keepalive-expiry, --max-in-flight, --max-connections, --pool-timeout and --admission-queue-s must not be negative")
        if self.token_spans not in TOKEN_SPAN_MODES:
            raise ValueError(f"--token-spans must be one of {TOKEN_SPAN_MODES}, not {self.token_spans!r}")
        parts = urlsplit(self.upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--upstream must be an http(s) URL, not {self.upstream!r}")
        if self.upstream_proxy and self.upstream_proxy.lower() not in ("none", "direct"):
            parse_egress(self.upstream_proxy)  # refused at start (the message holds no credentials)

    # Derived values: computed, never configured twice.
    @property
    def upstream_parts(self) -> tuple[str, str, int, str]:
        """(scheme, host, port, base path without trailing slash)."""
        parts = urlsplit(self.upstream)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return parts.scheme, parts.hostname or "", port, parts.path.rstrip("/")

    @property
    def upstream_label(self) -> str:
        if self.upstream_name:
            return self.upstream_name
        _, host, port, _ = self.upstream_parts
        return f"{host}:{port}"

    @property
    def provider(self) -> str:
        if self.provider_name:
            return self.provider_name
        host = self.upstream_parts[1]
        return "openai" if host == "openai.com" or host.endswith(".openai.com") else "openai_compatible"

    @property
    def records_path(self) -> str:
        """The records store (an SQLite file or a PostgreSQL URL), or "" when records are off."""
        if self.records_db != "auto":
            return self.records_db
        return default_records_path(self.port)

    @property
    def instance_name(self) -> str:
        """What this replica's records are tagged with: --instance (or the pod's name, $POD_NAME), else host:port."""
        import socket

        return self.instance or f"{socket.gethostname()}:{self.port}"

    def client_keys(self) -> tuple[str, ...]:
        """The keys clients may present (--api-key and --api-keys-file); empty: no proxy auth."""
        keys = [k.strip() for k in self.api_key.split(",") if k.strip()]
        if self.api_keys_file:
            with open(self.api_keys_file, encoding="utf-8") as handle:
                keys += [line.strip() for line in handle if line.strip() and not line.startswith("#")]
        return tuple(keys)

    def to_json(self) -> str:
        """For worker processes, which rebuild the same settings (credentials excluded)."""
        data = dataclasses.asdict(self)
        data.pop("upstream_api_key")
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, environ: Mapping[str, str] | None = None) -> "Settings":
        data = json.loads(text)
        return cls(**data, upstream_api_key=_resolve_key(data.get("upstream_api_key_env", ""), environ))


def _resolve_key(env_name: str, environ: Mapping[str, str] | None) -> str:
    if not env_name:
        return ""
    env = os.environ if environ is None else environ
    key = env.get(env_name, "")
    if not key:
        raise ValueError(f"--upstream-api-key-env names {env_name!r}, which is empty or unset")
    return key


def parse_yaml(text: str, where: str) -> Any:
    """A configuration file's YAML (--slo, --tenants), each mapping with its `__line__`, so that a
    broken entry is refused with where it is; broken YAML raises ValueError naming the line."""
    import yaml

    class LineLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            mapping = super().construct_mapping(node, deep=deep)
            mapping["__line__"] = node.start_mark.line + 1
            return mapping

    try:
        return yaml.load(text, Loader=LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ValueError(f"{where}{f', line {mark.line + 1}' if mark is not None else ''}: {getattr(exc, 'problem', None) or exc}") from None


def checked_entry(spec: Any, where: str, keys: tuple[str, ...], what: str) -> str:
    """One entry of such a file (an objective, a route, a tenant): a mapping of known keys only (a
    typo is refused, never ignored); `where` with the entry's line, for the next message."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: each {what} must be a mapping, not {spec!r}")
    where = f"{where}, line {spec.pop('__line__', '?')}"
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ValueError(f"{where}: {what} has unknown keys {unknown} (known: {', '.join(keys)})")
    return where


def read_text(path: str, where: str) -> str:
    """A configuration file's text; ValueError (`where`: what the file is) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag; defaults are None so the environment can fill the gaps."""
    for option in OPTIONS:
        kwargs: dict[str, Any] = {"default": None, "help": f"{option.help} [env {option.env}, default {option.default!r}]"}
        if option.type is bool:
            kwargs["type"] = _parse_bool
            kwargs["metavar"] = "BOOL"
        else:
            kwargs["type"] = option.type
        if option.name == "token_spans":
            kwargs["choices"] = TOKEN_SPAN_MODES
        parser.add_argument(option.flag, dest=option.name, **kwargs)


def build_settings(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags over environment over defaults, validated once."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw = getattr(args, option.name, None) if args is not None else None
        if raw is None and option.env in env:
            raw = env[option.env]
        values[option.name] = option.default if raw is None else _convert(option, raw)
    values["instance"] = values["instance"] or env.get("POD_NAME", "")  # (the Kubernetes downward API sets it)
    return Settings(**values, upstream_api_key=_resolve_key(values["upstream_api_key_env"], env))
