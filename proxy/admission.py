"""What the proxy lets in: a cap on requests in flight, and the open-files limit it runs under.

Beyond what the machine can relay, every stream slows down together; `--max-in-flight` answers the
excess at once with `503 proxy_overloaded` and Retry-After instead (Envoy's `max_requests`, nginx's
`limit_conn`), so admitted streams keep their latency and clients retry elsewhere or later.

Each request needs a descriptor for its client and one for its upstream connection. Many shells and
systemd services start processes with a soft limit of 1,024 open files, far below what
`--max-connections` allows, so at start-up each worker raises its soft limit to the hard one, logs
the result, and warns when even that is below what the settings need.
"""
from __future__ import annotations

import logging
import resource

from .config import Settings
from .errors import ProxyOverloaded

log = logging.getLogger("llmproxy")

RESERVE = 64  # descriptors for everything but sockets: listeners, pipes to the offload workers, logs


class Admission:
    """Counts requests in flight in this worker; refuses the one over the cap (0: no cap)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.in_flight = 0

    def enter(self) -> None:
        if self.cap and self.in_flight >= self.cap:
            raise ProxyOverloaded("max_in_flight", f"{self.in_flight} requests in flight, the limit set by --max-in-flight")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


def descriptors_needed(settings: Settings) -> int:
    """A client and an upstream socket per request the settings allow at once, plus the reserve."""
    clients = settings.max_in_flight or settings.max_connections
    return clients + settings.max_connections + RESERVE


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_files_limit(settings: Settings) -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (this process); log it; warn when too low.
    Returns (soft before, soft now, hard)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    soft = before
    if target > before:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", before, target, exc)
    needed = descriptors_needed(settings)
    log.info("open files limit: %d (soft limit was %d, hard limit %s)", soft, before, "unlimited" if hard == resource.RLIM_INFINITY else hard)
    if soft < needed:
        log.warning(
            "open files limit %d is below the %d that --max-connections %d and as many client connections need "
            "(with --max-in-flight, that many): beyond it, requests get 503 proxy_overloaded. Raise the hard limit "
            "(systemd LimitNOFILE=, docker --ulimit nofile=N:N, Kubernetes: the container runtime's default) "
            "or lower --max-connections.", soft, needed, settings.max_connections)
    return before, soft, hard
