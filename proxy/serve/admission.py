"""What the proxy lets in: a cap on requests in flight, shared fairly among tenants.

Beyond what the machine can relay, every stream slows down together; `--max-in-flight` answers the
excess with `503 proxy_overloaded` and Retry-After instead (Envoy's `max_requests`, nginx's
`limit_conn`), so admitted streams keep their latency and clients retry elsewhere or later.

The cap is shared by tenant (tenants.py: the tenants the file names, `unknown` and `other`; a client
cannot mint shares by inventing header values). Each tenant with requests in flight or waiting has a
share of the cap, `weight / sum of their weights` (weights from the tenants file, 1 by default),
at least one request. Max-min fairness, work-conserving:
- below the cap anyone is admitted (a tenant alone may use all of it: nothing is reserved idle but
  one slot for the next request of each tenant in flight under its share, so that a tenant between
  two requests does not find its slot borrowed);
- at the cap, a tenant under its share is still admitted (its guarantee), even past the cap: the
  slots others borrowed while it was idle come back as their requests end, and nobody borrows again
  until in flight is under the cap (in flight stays under the cap plus the shares: 2x at the very worst);
- at the cap, a tenant at or over its share is refused at once (503, reason `max_in_flight`), or
  with `--admission-queue-s S` waits up to S seconds (then the same 503, reason `queue_timeout`).
  A freed slot goes to the waiting tenant with the fewest in flight for its weight (ties in turn):
  slots, not dispatches, are what a tenant's share is of, so a tenant of long streams and one of
  short ones each get their share of concurrency (deficit round robin over dispatches would give the
  short one's turns to the long one's backlog). The wait is the phase `wait`, the proxy's own.
The cap is the proxy's, `--max-in-flight` split over `--workers` (each worker enforces its part and
the shares of it), so a tenant hitting every worker gets its share of the whole, not N times it.
The cap's part in each worker, and the descriptors the process holds, are upstream/limits.py's.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable

from ..errors import ProxyOverloaded

log = logging.getLogger("llmproxy")

class Admission:
    """Requests in flight in this worker, by tenant; fair shares of the cap (0: no cap, only counted)."""

    def __init__(self, cap: int, queue_s: float = 0.0, weight: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self.cap = cap
        self.queue_s = queue_s
        self.weight = weight  # a tenant's weight (the tenants file's, read at each use: a reload applies at once)
        self.in_flight = 0
        self.on_busy: Callable[[], None] | None = None  # told when a request enters an idle proxy (the loop's probe: cpu.py)
        self.held: dict[str, int] = {}  # tenant -> admitted, in flight (only with a cap)
        self.queues: dict[str, deque[asyncio.Future[None]]] = {}  # tenant -> its waiters, oldest first
        self._turn = 0  # round robin among equals

    def share(self, tenant: str) -> float:
        """The tenant's share of the cap now: its weight over the weights of every tenant with
        requests in flight or waiting, itself included."""
        return self._share(tenant, self._active_weight(tenant))

    def _active_weight(self, tenant: str) -> float:
        active = set(self.held) | set(self.queues)
        return sum(self.weight(t) for t in active) + (0.0 if tenant in active else self.weight(tenant))

    def _share(self, tenant: str, total: float) -> float:
        return max(1.0, self.cap * self.weight(tenant) / total) if total > 0 else float(self.cap)

    def _admit(self, tenant: str) -> None:
        self.in_flight += 1
        self.held[tenant] = self.held.get(tenant, 0) + 1
        if self.in_flight == 1 and self.on_busy is not None:
            self.on_busy()

    def _may_enter(self, tenant: str) -> bool:
        """Under its share; or borrowing, while the cap has room beyond one slot kept for the next
        request of each other tenant in flight under its share (so that a tenant between two of its
        requests does not find its slot borrowed and then come back past the cap)."""
        total = self._active_weight(tenant)
        held = self.held
        if held.get(tenant, 0) < int(self._share(tenant, total)):
            return True
        kept = sum(1 for other, n in held.items() if other != tenant and n < int(self._share(other, total)))
        return self.in_flight + kept < self.cap

    def try_enter(self, tenant: str) -> bool:
        """Admit at once if the rules allow (the fast path: room for every tenant in flight to come
        back for one more, and nobody waiting)."""
        if not self.cap:
            self.in_flight += 1
            if self.in_flight == 1 and self.on_busy is not None:
                self.on_busy()
            return True
        if self.queues:  # others wait: only a tenant under its share goes ahead of them
            admitted = self.held.get(tenant, 0) < int(self.share(tenant))
        else:
            admitted = self.in_flight + len(self.held) < self.cap or self._may_enter(tenant)
        if admitted:
            self._admit(tenant)
        return admitted

    async def wait(self, tenant: str) -> None:
        """After `try_enter` said no: wait for a slot if the queue is on. Raises ProxyOverloaded when
        the request may not wait, or waited --admission-queue-s."""
        if self.queue_s <= 0:
            raise ProxyOverloaded("max_in_flight", f"{self.in_flight} requests in flight, the limit set by --max-in-flight, "
                                                   f"and this tenant holds {self.held.get(tenant, 0)}, its share or more")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queues.setdefault(tenant, deque()).append(waiter)
        try:
            async with asyncio.timeout(self.queue_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # granted in the same instant: it is in
                return
            self._forget(tenant, waiter)
            raise ProxyOverloaded("queue_timeout", f"waited {self.queue_s:g} s for a slot (--admission-queue-s); "
                                                   f"{self.in_flight} requests in flight") from None
        except BaseException:  # the client went, or the server is stopping
            if waiter.done() and not waiter.cancelled():
                self.leave(tenant)  # (granted as it was cancelled: the slot goes on)
            else:
                self._forget(tenant, waiter)
            raise

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self.queues.get(tenant)
        if queue is not None:
            try:
                queue.remove(waiter)
            except ValueError:
                pass
            if not queue:
                del self.queues[tenant]

    def leave(self, tenant: str) -> None:
        self.in_flight -= 1
        if not self.cap:
            return
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        if self.queues:
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots (and shares now owed) to the waiting tenants, the fewest in flight for
        their weight first, ties in turn."""
        while self.queues:
            waiting = list(self.queues)
            self._turn += 1
            start = self._turn % len(waiting)
            order = waiting[start:] + waiting[:start]
            tenant = min(order, key=lambda t: self.held.get(t, 0) / self.weight(t))
            if not self._may_enter(tenant):
                return
            queue = self.queues[tenant]
            waiter = queue.popleft()
            if not queue:
                del self.queues[tenant]
            if waiter.done():  # cancelled, its task not yet run to take itself out
                continue
            self._admit(tenant)
            waiter.set_result(None)

    def queued(self) -> dict[str, int]:
        """(Read from the scrape's thread: the items are taken in one step.)"""
        return {tenant: len(queue) for tenant, queue in list(self.queues.items())}
