"""Who sent a request: its tenant (the application or team: few, known, a metric label) and its end
user (many: in records and spans only, never a metric label). `--tenants PATH` (env
`LLMPROXY_TENANTS`), reloaded on SIGHUP like `--routes` and `--slo`:

    tenants:
      - name: search                    # the `tenant` value
        keys: ["sha256:3f2a9c0d41e7b6a5"] # what `llm-latency-proxy tenants fingerprint` prints for a key
      - name: batch
        header: {name: x-team, values: [batch, batch-eu]}   # or values: any
      - header: {name: x-tenant, values: any}   # no name: the header's value is the tenant
    users:
      header: x-end-user                # optional; the API's own user fields are always read
    weights: {unknown: 1, other: 1}     # optional: the admission weights of those two (1 each)

Any named entry (or a nameless one with listed values) may say `weight: W` (a number > 0, 1 by
default): the tenant's weight in fair admission at --max-in-flight (admission.py).

Sources, the first that gives a value winning: the API key the request carries (any API's key
header, or Gemini's `key` query parameter: the proxy's own `--api-key` keys and a provider's alike),
matched by its SHA-256 fingerprint, then each `header` entry in file order; none: `unknown`. The file
holds fingerprints, never keys, and a key that matches none leaves no trace: it is hashed, looked
up, dropped. The end user: the `users.header`, then the API's own field (OpenAI `safety_identifier`,
`user`, `metadata.user_id`; Anthropic `metadata.user_id`), else none.

Values are sanitised (printable ASCII, `_` for the rest) and capped (`TENANT_CHARS`, `USER_CHARS`).
A nameless `values: any` entry makes tenants of whatever its header holds: at most `DYNAMIC_MAX`
distinct ones per process, later ones are `other`. In metrics only the tenants the file names
(`name`, or the listed values of a nameless entry) are label values; the others are `other`, and
`unknown` stays `unknown`; records and spans hold the value itself.
"""
from __future__ import annotations

import hashlib
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ..config import checked_entry, parse_yaml, read_text
from .request import client_key, query_key

log = logging.getLogger("llmproxy.tenants")

UNKNOWN, OTHER = "unknown", "other"
TENANT_CHARS, USER_CHARS = 64, 128
DYNAMIC_MAX = 1000  # distinct tenants from `values: any` headers per process (client-chosen: bounded)
FINGERPRINT_HEX = 16  # what `tenants fingerprint` prints: 64 bits of SHA-256
MIN_FINGERPRINT_HEX = 12
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_UNSAFE = re.compile(r"[^\x21-\x7e]")


def fingerprint(key: str) -> str:
    """`sha256:` and the first 16 hex digits of the key's SHA-256: what the file lists."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX]


def clean(value: str, limit: int) -> str:
    """Printable ASCII only (others `_`), at most `limit` characters, no surrounding space."""
    return _UNSAFE.sub("_", value.strip()[:limit])


@dataclass(frozen=True)
class HeaderSource:
    header: bytes  # lower case, as ASGI gives header names
    values: frozenset[str] | None  # None: any
    name: str  # "": the value itself is the tenant


@dataclass(frozen=True)
class Config:
    keys: dict[str, str]  # fingerprint hex prefix -> tenant
    lengths: tuple[int, ...]  # the distinct prefix lengths in `keys`
    headers: tuple[HeaderSource, ...]
    user_header: bytes
    named: frozenset[str]  # the tenants metrics label by name
    weights: dict[str, float] = field(default_factory=dict)  # admission weights other than 1, by label

    @property
    def empty(self) -> bool:
        return not self.keys and not self.headers


NONE = Config({}, (), (), b"", frozenset())


def _name(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value) or value in (UNKNOWN, OTHER):
        raise ValueError(f"{where}: {what} must be a word of letters, digits, _ . : or - (at most 64, not `unknown` or `other`), "
                         f"not {value!r}")
    return value


def parse(text: str, path: str = "<tenants>") -> Config:
    """The attribution a file's text configures; a broken file raises ValueError naming its line."""
    data = parse_yaml(text, f"tenants file {path}")
    if not isinstance(data, dict) or not isinstance(data.get("tenants", []), list):
        raise ValueError(f"tenants file {path}, line 1: expected `tenants:` (a list) and optionally `users:`")
    where = f"tenants file {path}, line {data.pop('__line__', 1)}"
    if set(data) - {"tenants", "users", "weights"}:
        raise ValueError(f"{where}: unknown keys {sorted(set(data) - {'tenants', 'users', 'weights'})} (known: tenants, users, weights)")
    weights: dict[str, float] = {}
    fixed = data.get("weights") or {}
    if not isinstance(fixed, dict) or set(fixed) - {UNKNOWN, OTHER, "__line__"}:
        raise ValueError(f"{where}: weights must be {{unknown: W, other: W}} (the named tenants' are their entries' `weight`)")
    for label in (UNKNOWN, OTHER):
        if label in fixed:
            weights[label] = _weight(fixed[label], where)
    keys: dict[str, str] = {}
    headers: list[HeaderSource] = []
    named: set[str] = set()
    for spec in data.get("tenants") or []:
        where = checked_entry(spec, f"tenants file {path}", ("name", "keys", "header", "weight"), "tenant")
        if "keys" not in spec and "header" not in spec:
            raise ValueError(f"{where}: a tenant needs `keys`, `header` or both")
        name = _name(spec["name"], where, "name") if "name" in spec else ""
        if name:
            named.add(name)
        if "keys" in spec:
            if not name:
                raise ValueError(f"{where}: a tenant with `keys` needs a `name`")
            if not isinstance(spec["keys"], list) or not spec["keys"]:
                raise ValueError(f"{where}: keys must be a non-empty list of fingerprints (`llm-latency-proxy tenants fingerprint`)")
            for number, item in enumerate(spec["keys"], start=1):
                hexed = str(item).lower().removeprefix("sha256:")
                if not re.fullmatch(rf"[0-9a-f]{{{MIN_FINGERPRINT_HEX},64}}", hexed):  # (not echoed: it may be a key pasted by mistake)
                    raise ValueError(f"{where}: keys entry {number} is not a fingerprint (`sha256:` and {MIN_FINGERPRINT_HEX} to 64 hex "
                                     "digits, as `llm-latency-proxy tenants fingerprint` prints; never the key itself)")
                clash = next((t for k, t in keys.items() if t != name and (k.startswith(hexed) or hexed.startswith(k))), None)
                if clash is not None:
                    raise ValueError(f"{where}: fingerprint {item!r} also matches tenant {clash!r}'s")
                keys[hexed] = name
        if "header" in spec:
            header = spec["header"]
            if not isinstance(header, dict) or not isinstance(header.get("name"), str) or "values" not in header \
                    or set(header) - {"name", "values", "__line__"}:
                raise ValueError(f"{where}: header must be {{name: HEADER, values: [VALUE, ...] or any}}")
            values = header["values"]
            if values == "any":
                allowed = None
            elif isinstance(values, list) and values and all(isinstance(v, str) and v for v in values):
                allowed = frozenset(values)
                if not name:
                    named.update(_name(v, where, "each listed value of a nameless header") for v in values)
            else:
                raise ValueError(f"{where}: header values must be a non-empty list of strings or `any`, not {values!r}")
            headers.append(HeaderSource(header["name"].strip().lower().encode("latin-1"), allowed, name))
        if "weight" in spec:
            labels = [name] if name else sorted(allowed or ())
            if not labels:
                raise ValueError(f"{where}: a nameless `values: any` entry's tenants are `other` in admission: "
                                 "set its weight with `weights: {other: W}`")
            weight = _weight(spec["weight"], where)
            for label in labels:
                if weights.get(label, weight) != weight:
                    raise ValueError(f"{where}: tenant {label!r} is given two weights")
                weights[label] = weight
    users = data.get("users") or {}
    if not isinstance(users, dict) or set(users) - {"header", "__line__"} or not isinstance(users.get("header", ""), str):
        raise ValueError(f"tenants file {path}, line {users.get('__line__', 1) if isinstance(users, dict) else 1}: "
                         "users must be {header: HEADER}")
    lengths = tuple(sorted({len(k) for k in keys}))
    return Config(keys, lengths, tuple(headers), users.get("header", "").strip().lower().encode("latin-1"), frozenset(named),
                  {label: w for label, w in weights.items() if w != 1.0})


def _weight(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e6:
        raise ValueError(f"{where}: a weight is a number above 0 (at most 1e6), not {value!r}")
    return float(value)


def load(path: str) -> Config:
    return parse(read_text(path, f"tenants file {path}"), path)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


def api_user(parsed: dict[str, Any] | None) -> str:
    """The end user the request body names in the API's own fields (OpenAI chat and Responses:
    `safety_identifier`, `user`, `metadata.user_id`; Anthropic: `metadata.user_id`), else ""."""
    if not parsed:
        return ""
    for key in ("safety_identifier", "user"):
        value = parsed.get(key)
        if isinstance(value, str) and value.strip():
            return value
    metadata = parsed.get("metadata")
    if isinstance(metadata, dict):
        for key in ("user_id", "user"):
            value = metadata.get(key)
            if isinstance(value, str) and value.strip():
                return value
    return ""


class Tenants:
    """The attribution in force. Built from `--tenants`; `reload` (SIGHUP) parses the whole file
    first, so a broken one changes nothing."""

    def __init__(self, path: str = "", config: Config | None = None) -> None:
        self.path = path
        self.config = config if config is not None else (load(path) if path else NONE)
        self._dynamic: set[str] = set()

    def reload(self) -> None:
        if self.path:
            self.config = load(self.path)
            log.warning("tenants reloaded from %s: %d named", self.path, len(self.config.named))

    def tenant(self, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> str:
        """The request's tenant from its key or headers; `unknown` when no source gives one."""
        config = self.config
        if config.keys:
            key = client_key(headers) or query_key(query)
            if key:
                digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
                del key
                for length in config.lengths:
                    found = config.keys.get(digest[:length])
                    if found is not None:
                        return found
        for source in config.headers:
            value = _header(headers, source.header)
            if not value:
                continue
            if source.values is not None and value not in source.values:
                continue
            if source.name:
                return source.name
            value = clean(value, TENANT_CHARS)
            if value in config.named or value in self._dynamic:
                return value
            if value in (UNKNOWN, OTHER) or len(self._dynamic) >= DYNAMIC_MAX:
                return OTHER
            self._dynamic.add(value)
            return value
        return UNKNOWN

    def user(self, headers: list[tuple[bytes, bytes]], parsed: dict[str, Any] | None) -> str:
        """The end user: the configured header, then the API's own fields; "" when none."""
        value = _header(headers, self.config.user_header) if self.config.user_header else ""
        return clean(value or api_user(parsed), USER_CHARS)

    def labels(self) -> list[str]:
        """Every tenant label there can be: the named ones, `unknown` and `other`."""
        return [*sorted(self.config.named), UNKNOWN, OTHER]

    def weight(self, label: str) -> float:
        """A tenant label's admission weight (1 unless the file says otherwise)."""
        return self.config.weights.get(label, 1.0)

    def label(self, tenant: str) -> str:
        """The `tenant` metric label: a tenant the file names, `unknown`, or `other`."""
        return tenant if tenant == UNKNOWN or tenant in self.config.named else OTHER


def main(argv: list[str]) -> int:
    """`llm-latency-proxy tenants fingerprint`: each key read from stdin (one per line) as its
    fingerprint, for the tenants file; the key is never echoed."""
    if argv != ["fingerprint"]:
        print("usage: llm-latency-proxy tenants fingerprint < keys.txt   (one key per line; prints one fingerprint per line)",
              file=sys.stderr)
        return 2
    found = 0
    for line in sys.stdin:
        key = line.strip()
        if key.lower().startswith("bearer "):
            key = key[7:].strip()
        if key:
            print(fingerprint(key))
            found += 1
    if not found:
        print("no key on stdin", file=sys.stderr)
        return 1
    return 0
