"""How many streams the process can hold, and the upstream pool's size: what the settings and the open-files limit
allow at once.

Each request needs a descriptor for its client and one for its upstream connection. Many shells and
systemd services start processes with a soft limit of 1,024 open files, so when each worker is
created it raises its soft limit to the hard one and logs how many streams that holds. The upstream
pool is sized from it (or from --max-in-flight): a pool smaller than what the process can hold is a
queue nobody asked for (stream 1,001 waiting for a whole answer to end, its wait read as network).
An explicit --max-connections is a limit the operator chose: past it a request gets an immediate
503 (`proxy_overloaded`, reason `pool`), or waits at most --pool-timeout, that wait the phase `wait`.
"""
from __future__ import annotations

import logging
import resource

from ..config import Settings

log = logging.getLogger("llmproxy")

RESERVE = 64  # descriptors for everything but sockets: listeners, pipes to the offload workers, logs


def worker_cap(settings: Settings) -> int:
    """This worker's part of --max-in-flight (0: no cap): the parts add up to at most the whole."""
    if settings.max_in_flight <= 0:
        return 0
    return max(1, settings.max_in_flight // max(1, settings.workers))


def streams_held(soft: int) -> int:
    """Streams a process with `soft` open files holds at once: a client and an upstream socket each."""
    return max(1, (soft - RESERVE) // 2)


def pool_size(settings: Settings) -> int:
    """Connections an upstream's pool lends at once: --max-connections when set; else twice this
    worker's part of --max-in-flight (a request holds one at most); else the streams the process's
    open files limit holds."""
    if settings.max_connections > 0:
        return settings.max_connections
    if settings.max_in_flight > 0:
        return 2 * worker_cap(settings)  # (the most admission lets in: the cap, and the shares of tenants under theirs)
    return streams_held(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def descriptors_needed(settings: Settings) -> int:
    """A client and an upstream socket per request the settings allow at once, plus the reserve
    (0 when nothing is set: the pool is sized from the limit itself)."""
    if settings.max_connections <= 0 and settings.max_in_flight <= 0:
        return 0
    pool = pool_size(settings)
    return (2 * worker_cap(settings) or pool) + pool + RESERVE


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
    log.info("open files limit: %d (soft limit was %d, hard limit %s): %d streams at once in this process, the upstream pool %d",
             soft, before, "unlimited" if hard == resource.RLIM_INFINITY else hard, streams_held(soft), pool_size(settings))
    if soft < needed:
        log.warning(
            "open files limit %d is below the %d that --max-connections %d and as many client connections need "
            "(with --max-in-flight, that many): beyond it, requests get 503 proxy_overloaded. Raise the hard limit "
            "(systemd LimitNOFILE=, docker --ulimit nofile=N:N, Kubernetes: the container runtime's default) "
            "or lower --max-connections.", soft, needed, pool_size(settings))
    return before, soft, hard
