"""The forward proxy a company network routes outbound traffic through, for the upstream connections.

Which one, as curl reads its variables: `https_proxy` / `HTTPS_PROXY` for an https upstream,
`http_proxy` for an http one (lower case only: `HTTP_PROXY` can be set by a CGI request's `Proxy:`
header, curl's "httpoxy" rule), else `all_proxy` / `ALL_PROXY`; lower case first. `no_proxy` /
`NO_PROXY` bypasses them: `*`, host names (each also matches its subdomains, with or without a
leading dot), IP addresses and CIDR ranges, optionally with `:port`. `--upstream-proxy URL` (or a
route's `proxy:`) names one explicitly (then `no_proxy` does not apply), `--upstream-proxy none`
goes direct whatever the environment says.

How: an https upstream goes through a `CONNECT host:port` tunnel, TLS end to end inside it with the
certificate checked against the upstream's host name (the proxy sees only ciphertext); an http
upstream gets absolute-form requests (`GET http://host:port/path`). Credentials in the proxy URL
(`http://user:password@proxy:3128`) are sent as `Proxy-Authorization: Basic …`; they are in no log
line, error, record or span (`EgressProxy.where` has none). The CONNECT exchange is timed as its own
step of the network phase (`proxy`, beside dns, tcp and tls). Proxies are http:// (the usual egress
proxy; a TLS connection to the proxy itself is not supported, and refused at start).
"""
from __future__ import annotations

import ipaddress
import os
from typing import Mapping

from ..config import DIRECT, EgressProxy, parse_egress


def _env(environ: Mapping[str, str], *names: str) -> str:
    return next((value.strip() for name in names if (value := environ.get(name, "")).strip()), "")


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether `no_proxy` (curl's form) names this host."""
    host = host.lower().strip("[]").rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        name, _, wanted_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if wanted_port and wanted_port.isdigit() and int(wanted_port) != port:
            continue
        name = (name or entry).strip("[]").rstrip(".")
        if address is not None:
            try:
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = name.lstrip(".")
        if host == name or host.endswith("." + name):
            return True
    return False


def choose(scheme: str, host: str, port: int, explicit: str = "", environ: Mapping[str, str] | None = None) -> EgressProxy | None:
    """The proxy a connection to scheme://host:port goes through, or None (direct)."""
    if explicit.strip().lower() in DIRECT:
        return None
    if explicit:
        return parse_egress(explicit)
    env = os.environ if environ is None else environ
    if bypassed(host, port, _env(env, "no_proxy", "NO_PROXY")):
        return None
    url = _env(env, "https_proxy", "HTTPS_PROXY") if scheme == "https" else _env(env, "http_proxy")
    url = url or _env(env, "all_proxy", "ALL_PROXY")
    return parse_egress(url) if url else None
