"""Which replica of a route takes a request: filter, score, pick (the Gateway API Inference
Extension's scheduler shape), over what the proxy keeps per replica: its health (health.py), its
forecast (forecast.py), its prefix index (prefix.py) and its requests in flight.

- **Filter.** The replicas not tried yet for this request and not set aside by their health; but a
  route never has more than `max_share` of its replicas set aside at once (at least one may be), nor
  all of them: past that, those due back soonest serve anyway; and below `panic_threshold` of them
  serving, it serves them all (Envoy's panic mode: a fleet failing everywhere is still tried, and
  spread over, not piled onto the few left). A replica backing off (a 429 on the proxy's own key
  asked for quiet) takes a request only when no other can. `predicted_ttft` also bounds the load
  (consistent hashing with bounded loads): a replica with LOAD_BOUND times its share of the requests
  in flight (this one counted), plus LOAD_SLACK, takes no more while another has fewer, and is
  expected within SPILL times its speed: a replica far slower to its first token takes no overflow
  (its queue is cheaper than its prefill). (The slack: at a few requests in flight the score, which
  counts each replica's pending work, knows better; moving a long conversation off its cache to
  spare a short queue costs more than the queue.)
- **Probe.** A replica whose time aside is up gets the request: its verdict brings it back.
- **Where a conversation lives** (`predicted_ttft`, a prompt of AFFINITY_TOKENS or more; prefix.py's
  session key, first turn and index). Proxies that share nothing must agree, so each rule is one every
  proxy can follow from what it sees alone. A conversation's first turn goes to the better scored of
  the CHOICES replicas its key ranks first by rendezvous hashing (power of two choices: balanced by
  load, yet in a place any proxy can look), unless another replica alone is CHOICE_SLACK times
  faster. Past its first turn, a conversation this proxy knows (an index holds it) stays where it
  lives, whatever the queue there: another proxy's view of the load differs, and a move costs the
  whole prompt; only the load bound and its health move it. A conversation this proxy has not seen
  (another proxy's turns, or from before a restart) goes to the replica its key ranks first among
  those not known to lack it; the engine's report then says whether it lived there (prefix.Use:
  else that replica is remembered away for it, and the next turn looks on the other), so a proxy
  new to a conversation sends at most one turn astray (`llmproxy_prefix_strays_total`).
- **Explore** (`predicted_ttft`). A replica with fewer than MIN_SAMPLES attempts, or none for
  STALE_S seconds, is tried first whatever the prompt's size, and EPSILON of the requests go to
  another replica at random (EPSILON of the conversations, by their key, to their rendezvous replica: every
  proxy explores the same way): a replica starved of some prompts is measured again. Exploring never
  throws a cached prefix away: only the replicas holding the longest indexed prefix of the prompt
  are explored. A conversation (AFFINITY_TOKENS or more) skips the first rule, whose choice would
  differ from proxy to proxy: a replica not fitted yet is scored at the prior rate instead.
- **Score.** `predicted_ttft`: the replica's predicted server TTFT for this prompt's uncached part
  there (the prompt less the longest prefix its index holds), with the work pending on it, over the
  share of its recent attempts that did not fail (failing half of them, it scores double): a
  replica that fails fast never looks fast, one holding the conversation's prefix prefills only its
  new turn, and a replica with no fit yet (too few answers measured) is expected at the prior rate
  (forecast.py), a slow engine's. With no fit anywhere (only non-streaming answers), fewest in
  flight. `fewest_in_flight`: its requests in flight, this one counted, over the same share (a replica failing fast
  looks idle: it scores up to ten times its load, and its health sets it aside, as Envoy's outlier detection does for
  its balancer; one that misses its deadlines or refuses for load is sent less, never set aside for it).
- **Pick.** The lowest score; scores within the forecasts' noise of it (TIE_S, or TIE_SHARE of it)
  are a tie, which the replicas holding the longest prefix of the prompt win. A conversation's tie
  goes by rendezvous hashing on its session key (every proxy the same way). Any other tie goes
  to the fewest in flight, then in turn: equal replicas share the requests.
"""
from __future__ import annotations

import hashlib
import math
import random
import time
from typing import TYPE_CHECKING, Sequence

from ..wire.prompt import Chain
from .forecast import MIN_SAMPLES
from .prefix import Index

if TYPE_CHECKING:
    from .replica import Replica

STALE_S = 30.0
EPSILON = 0.05
TIE_S, TIE_SHARE = 0.010, 0.15
FLOOR = 0.1  # a score is divided by at least this (a replica failing everything scores ten times its own)
AFFINITY_TOKENS = 1000  # a shorter prompt costs too little to prefill to be kept anywhere: spread like any other
CHOICES, CHOICE_SLACK = 2, 1.5  # a conversation's first turn: the better of the two replicas its key ranks first (unless 1.5x slower alone)
LOAD_BOUND, LOAD_SLACK = 1.25, 2  # no replica takes more than 1.25x its share of the requests in flight plus 2 (while another has less)
SPILL = 2.0  # ... that is expected within twice its time to first token for this prompt


def serving(replicas: Sequence[Replica], now: float) -> list[Replica]:
    """The route's replicas that may take a request now: its cap on those set aside and its panic threshold applied."""
    out = [u for u in replicas if u.health.available(now)]
    n = len(replicas)
    if len(out) < n:
        spec = replicas[0].health.spec
        if len(out) < spec.panic * n:  # (panic: every replica serves)
            return list(replicas)
        aside = sorted((u for u in replicas if not u.health.available(now)), key=lambda u: u.health.until)
        cap = min(n - 1, max(1, int(spec.max_share * n)))
        if len(aside) > cap:
            out += aside[: len(aside) - cap]
    quiet = [u for u in out if not u.health.backing_off(now)]
    return quiet if quiet and len(quiet) < len(out) else out


class Picker:
    __slots__ = ("rng", "turn")

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        self.turn = 0

    def choose(self, pick: str, replicas: Sequence[Replica], prompt: int, tried: tuple[str, ...] = (),
               now: float | None = None, chain: Chain | None = None) -> Replica | None:
        """One of these replicas (a route's, in its order) for a request of `prompt` tokens (`chain`: as the prefix
        indexes see it); None: none left."""
        now = time.monotonic() if now is None else now
        candidates = serving(replicas, now)
        if tried:
            candidates = [u for u in candidates if u.label not in tried]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        for u in candidates:
            if u.health.due(now):
                return u  # its probe
        if pick == "predicted_ttft":
            return self._predicted(candidates, prompt, now, chain)
        return self._fewest(candidates, now)

    def _predicted(self, candidates: list[Replica], prompt: int, now: float, chain: Chain | None) -> Replica:
        cap = math.ceil(LOAD_BOUND * (sum(u.load(now) for u in candidates) + 1) / len(candidates)) + LOAD_SLACK
        under = [u for u in candidates if u.load(now) < cap]
        if under and len(under) < len(candidates):  # (the overflow: only to a replica about as fast as the fastest)
            speed = {u.label: u.forecast.expect(prompt) for u in candidates}
            fastest = min(speed.values())
            if any(speed[u.label] <= SPILL * fastest + TIE_S for u in under):
                candidates = under
        session = chain.session if chain is not None and chain.total >= AFFINITY_TOKENS else 0
        cached = [u.prefixes.match(chain) if chain is not None else 0 for u in candidates]
        if chain is not None and chain.shared:  # (the agent's system prompt and tools: on every replica once on one)
            shared = min(chain.shared, max(cached))
            cached = [max(c, shared) for c in cached]
        most = max(cached)
        keep = [u for u, c in zip(candidates, cached) if c == most]  # (exploring never throws a cached prefix away)
        if session and chain is not None and chain.opening:  # (a conversation past its first turn)
            if most > chain.shared:  # (one this proxy knows: it stays where it lives)
                candidates, cached = keep, [most] * len(keep)
            else:  # (one it has not seen)
                ahead = [u for u in candidates if session not in u.prefixes.away]
                if ahead:
                    return self._rendezvous(ahead, session)
        fresh = [] if session else [u for u in keep if u.forecast.sent < MIN_SAMPLES or now - u.forecast.last_s > STALE_S]
        if fresh:
            return self._tie(fresh)
        if len(keep) > 1 and (session % 1000 < EPSILON * 1000 if session else self.rng.random() < EPSILON):  # (a conversation's: the same in every proxy)
            return self._rendezvous(keep, session) if session else self.rng.choice(keep)
        if not session and all(u.forecast.n < MIN_SAMPLES for u in candidates):  # (nothing measured: only non-streaming answers)
            return self._fewest(candidates, now)
        f = lambda u, c: u.forecast.expect(u.forecast.pending + max(0, prompt - c))  # noqa: E731  (a replica not fitted yet: the prior)
        scored = [(f(u, c) / max(FLOOR, 1 - u.health.share(now)), c, u) for u, c in zip(candidates, cached)]
        best = min(s for s, _, _ in scored)
        if session and chain is not None and not chain.opening and len(scored) > CHOICES:  # (a conversation's first turn)
            first = {u.label for u in self._ranked([u for _, _, u in scored], session)[:CHOICES]}
            alone = [(u.forecast.expect(max(0, prompt - c)), u.label in first) for _, c, u in scored]  # (speed, not load)
            if min(a for a, top in alone if top) <= CHOICE_SLACK * min(a for a, _ in alone) + TIE_S:
                scored = [x for x in scored if x[2].label in first]
                best = min(s for s, _, _ in scored)
        tied = [(c, u) for s, c, u in scored if s <= best + max(TIE_S, TIE_SHARE * best)]
        most = max(c for c, _ in tied)  # (within the noise, the replica holding more of the prompt: a tie never throws a prefix away)
        return self._tie([u for c, u in tied if c == most], session)

    def _fewest(self, candidates: list[Replica], now: float) -> Replica:
        """Those with the fewest in flight, this one counted, over the share of their recent attempts that did not fail
        (sick or busy: a replica refusing half of them for load looks twice as loaded), each in turn."""
        scores = [(u.load(now) + 1) / max(FLOOR, 1 - u.health.share(now)) for u in candidates]
        fewest = min(scores)
        return self._tie([u for u, score in zip(candidates, scores) if score == fewest])

    def _tie(self, group: list[Replica], session: int = 0) -> Replica:
        """A conversation's by rendezvous (every proxy agrees; the load bound above keeps it from piling up); any
        other to the fewest in flight, then each in turn."""
        if session:
            return self._rendezvous(group, session)
        self.turn += 1
        k = self.turn % len(group)
        return min(group[k:] + group[:k], key=lambda u: u.in_flight)

    @staticmethod
    def _rendezvous(group: list[Replica], session: int) -> Replica:
        """The replica a conversation's key ranks first among these: the same in every proxy, whatever it has seen."""
        return Picker._ranked(group, session)[0]

    @staticmethod
    def _ranked(group: list[Replica], session: int) -> list[Replica]:
        """These replicas as a conversation's key ranks them (rendezvous hashing): the same order in every proxy."""
        key = session.to_bytes(8, "big")
        return sorted(group, key=lambda u: hashlib.blake2b(key + u.label.encode(), digest_size=8).digest(), reverse=True)

    @staticmethod
    def rivals(replicas: Sequence[Replica], upstream: Replica, chain: Chain) -> tuple[Index, ...]:
        """The prefix indexes of the replicas a conversation's first turn goes to (the CHOICES its key ranks first), bar
        `upstream`: where a conversation this proxy has not seen there may live instead (prefix.Use)."""
        return tuple(u.prefixes for u in Picker._ranked(list(replicas), chain.session)[:CHOICES] if u is not upstream)

    def could_serve(self, replicas: Sequence[Replica], tried: tuple[str, ...], now: float | None = None) -> bool:
        """Whether any of these replicas, bar the tried ones, could take a retry now (nothing chosen or counted)."""
        now = time.monotonic() if now is None else now
        return any(u.label not in tried for u in serving(replicas, now))
