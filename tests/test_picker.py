"""Which replica takes a request (proxy/fleet/picker.py): filter, probe, explore, score, pick; over replicas
whose health and forecast are set by hand, on an injected clock."""
from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field

from proxy.fleet.forecast import MIN_SAMPLES, Forecast
from proxy.fleet.health import EjectionSpec, Health
from proxy.fleet.picker import STALE_S, Picker, serving
from proxy.fleet.prefix import Index, Use
from proxy.wire.prompt import Chain, chain

NOW = 1000.0


@dataclass
class Replica:
    label: str
    health: Health = field(default_factory=Health)
    forecast: Forecast = field(default_factory=Forecast)
    in_flight: int = 0
    prefixes: Index = field(default_factory=Index)

    def load(self, now: float) -> float:
        return self.in_flight


def fitted(label: str, seconds_per_token: float, fixed: float = 0.01) -> Replica:
    r = Replica(label)
    for x in (100, 400, 1600, 6400, 200, 800, 3200):
        r.forecast.add(x, fixed + seconds_per_token * x)
    r.forecast.sent, r.forecast.last_s = 20, NOW
    return r


def eject(r: Replica, now: float = NOW, seconds: float = 30) -> None:
    r.health.sent(now)
    r.health.failed(now, retry_after=seconds)


def counts(picker: Picker, pick: str, replicas: list[Replica], prompt: int, n: int = 300) -> collections.Counter[str]:
    return collections.Counter(picker.choose(pick, replicas, prompt, now=NOW).label for _ in range(n))  # type: ignore[union-attr]


def test_a_replica_set_aside_gets_nothing_until_its_probe():
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    eject(a)
    picker = Picker(random.Random(0))
    assert "a" not in counts(picker, "fewest_in_flight", [a, b, c], 100)
    assert picker.choose("fewest_in_flight", [a, b, c], 100, now=NOW + 30).label == "a"  # its time is up: the probe
    a.health.sent(NOW + 30)
    assert "a" not in {picker.choose("fewest_in_flight", [a, b, c], 100, now=NOW + 30).label for _ in range(20)}  # the probe is out


def test_at_most_a_tenth_aside_and_below_half_serving_every_replica_serves():
    """Envoy's max_ejection_percent (10%, at least one) and healthy_panic_threshold (50%)."""
    ten = [Replica(x) for x in "abcdefghij"]
    for r, seconds in zip(ten, (10, 20, 30)):
        eject(r, seconds=seconds)
    assert [r.label for r in serving(ten, NOW)] == [*"defghij", "a", "b"]  # one of ten aside: those back soonest serve anyway
    spec = EjectionSpec(max_share=0.5)
    four = [Replica(x, Health(spec)) for x in "abcd"]
    for r, seconds in zip(four, (10, 20)):
        eject(r, seconds=seconds)
    assert [r.label for r in serving(four, NOW)] == ["c", "d"]  # half serving: not below the threshold
    eject(four[2])
    assert [r.label for r in serving(four, NOW)] == list("abcd")  # a quarter serving: panic, every one serves
    lone = [Replica("x")]
    eject(lone[0])
    assert [r.label for r in serving(lone, NOW)] == ["x"]
    pair = [Replica("p"), Replica("q")]
    eject(pair[0])
    assert [r.label for r in serving(pair, NOW)] == ["q"]
    eject(pair[1], seconds=60)
    assert [r.label for r in serving(pair, NOW)] == ["p", "q"]


def test_a_replica_backing_off_takes_requests_only_when_none_other_can():
    a, b = Replica("a"), Replica("b")
    a.health.busy(NOW, backoff=2.0)  # a 429 on the proxy's own key asked for 2 s
    assert [r.label for r in serving([a, b], NOW + 1)] == ["b"] and a.health.state == "serving"
    b.health.busy(NOW, backoff=2.0)
    assert [r.label for r in serving([a, b], NOW + 1)] == ["a", "b"]  # both asked: both serve
    assert [r.label for r in serving([a, b], NOW + 2.5)] == ["a", "b"]


def test_a_replica_that_fails_fast_never_looks_fast():
    """It is never busy and never slow: scored over its success share, it loses to healthy ones."""
    failing, b, c = fitted("failing", 1 / 20000), fitted("b", 1 / 5000), fitted("c", 1 / 5000)
    for _ in range(4):  # four failures in its window (not enough to eject it)
        failing.health.sent(NOW)
        failing.health.failed(NOW)
    picker = Picker(random.Random(0))
    assert counts(picker, "predicted_ttft", [failing, b, c], 2000)["failing"] <= 0.05 * 300 / 3 + 5  # (exploration only)
    assert counts(picker, "predicted_ttft", [failing, b, c], 2000, n=30).keys() != {"failing"}


def test_equal_replicas_share_the_requests_whatever_they_know():
    picker = Picker(random.Random(0))
    unknown = [Replica(x) for x in "abc"]
    for r in unknown:
        r.forecast.sent, r.forecast.last_s = 50, NOW  # explored, but no answer measured (non-streaming, no engine timings)
    assert all(90 <= n <= 110 for n in counts(picker, "predicted_ttft", unknown, 100).values())
    equal = [fitted(x, 1 / 5000, fixed=0.05 + i * 0.002) for i, x in enumerate("abc")]  # within the forecasts' noise of each other
    assert all(90 <= n <= 110 for n in counts(picker, "predicted_ttft", equal, 100).values())
    assert all(90 <= n <= 110 for n in counts(picker, "predicted_ttft", equal, 20000).values())


def test_predicted_ttft_prefers_the_faster_and_the_less_loaded():
    fast, slow = fitted("fast", 1 / 20000), fitted("slow", 1 / 4000)
    picker = Picker(random.Random(0))
    assert counts(picker, "predicted_ttft", [slow, fast], 8000)["fast"] >= 270  # (EPSILON of them explore)
    fast.forecast.pending = 200_000  # ten seconds of prompts already waiting on the fast one
    assert counts(picker, "predicted_ttft", [slow, fast], 8000)["slow"] >= 270


def test_new_and_forgotten_replicas_are_explored_at_every_prompt_size():
    known, new = fitted("known", 1 / 20000), Replica("new")
    picker = Picker(random.Random(0))
    assert picker.choose("predicted_ttft", [known, new], 50_000, now=NOW).label == "new"  # a long prompt too
    new.forecast.sent, new.forecast.last_s = MIN_SAMPLES, NOW - STALE_S - 1
    assert picker.choose("predicted_ttft", [known, new], 50_000, now=NOW).label == "new"  # not sent any for STALE_S
    two_new = [Replica("x"), Replica("y")]
    assert set(counts(picker, "predicted_ttft", two_new, 100, n=10)) == {"x", "y"}  # explored in turn, not the first one always


def test_a_retry_goes_to_an_untried_replica_or_none():
    a, b = Replica("a"), Replica("b")
    picker = Picker(random.Random(0))
    assert picker.choose("fewest_in_flight", [a, b], 100, tried=("a",), now=NOW).label == "b"
    assert picker.choose("fewest_in_flight", [a, b], 100, tried=("a", "b"), now=NOW) is None
    eject(b)
    assert not picker.could_serve([a, b], ("a",), now=NOW) and picker.could_serve([a, b], (), now=NOW)


def test_a_conversation_goes_where_its_prefix_is_until_that_replica_is_loaded():
    """predicted_ttft over the uncached part: the replica holding the prefix wins; past its bounded share of the
    requests in flight it takes no more, and exploring never throws the prefix away."""
    from proxy.fleet.prefix import Index
    from proxy.wire.prompt import chain

    a, b = fitted("a", 0.0002), fitted("b", 0.0002)
    a.prefixes, b.prefixes = Index(), Index()  # type: ignore[attr-defined]
    messages = [{"role": "system", "content": "s " * 6000}, {"role": "user", "content": "task " * 3000}]
    first = chain({"messages": messages})
    assert first is not None
    b.prefixes.sent(first)  # type: ignore[attr-defined]
    turn = chain({"messages": [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more " * 500}]})
    picker = Picker(random.Random(0))
    assert {picker.choose("predicted_ttft", [a, b], turn.total, now=NOW, chain=turn).label for _ in range(200)} == {"b"}  # type: ignore[union-attr]
    b.in_flight = 3  # 3 of 3 in flight: its pending work is in the score, the cache still wins
    assert picker.choose("predicted_ttft", [a, b], turn.total, now=NOW, chain=turn).label == "b"  # type: ignore[union-attr]
    b.in_flight = 8  # 8 of 8: past 1.25 x its share of 9, plus 2
    assert picker.choose("predicted_ttft", [a, b], turn.total, now=NOW, chain=turn).label == "a"  # type: ignore[union-attr]


def test_proxies_that_share_nothing_agree_on_a_conversations_replica():
    """Rendezvous on the session key breaks ties: two pickers (two proxies) send each conversation to the same
    replica, and different conversations spread."""
    from proxy.fleet.prefix import Index
    from proxy.wire.prompt import chain

    places: list[list[str]] = []
    for seed in (1, 2):
        replicas = [fitted(x, 0.0002) for x in "abcd"]
        for r in replicas:
            r.prefixes = Index()  # type: ignore[attr-defined]
        picker = Picker(random.Random(seed))
        picker.turn = seed  # (a different turn counter in each)
        out = []
        for s in range(40):
            prompt = chain({"messages": [{"role": "system", "content": "same " * 1000}, {"role": "user", "content": f"task {s}"}]})
            out.append(picker.choose("predicted_ttft", replicas, 100, now=NOW, chain=prompt).label)  # type: ignore[union-attr]
        places.append(out)
    assert places[0] == places[1] and len(set(places[0])) == 4


def agent_turns(session: int, turns: int) -> list[Chain]:
    """One agent session's prompts as chains: a system prompt every session shares, each turn the last one's messages,
    its answer and a new 600-token user message."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "agent " * 4000}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"session {session} turn {turn} " + "data " * 600})
        prompt = chain({"messages": list(messages)})
        assert prompt is not None
        out.append(prompt)
        messages.append({"role": "assistant", "content": f"answer {session}.{turn}"})
    return out


def test_a_known_conversation_stays_where_it_lives_whatever_the_queue_there():
    """Past its first turn, a conversation this proxy knows goes to the replica holding it though that replica's pending
    work is far longer than a full prefill elsewhere: another proxy's view of the load would differ, and a move costs
    the whole prompt. (Only the load bound, or its health, moves it.)"""
    a, b = fitted("a", 0.0002), fitted("b", 0.0002)
    first, second = agent_turns(0, 2)
    b.prefixes.sent(first)
    b.forecast.pending = 50_000  # (10 s of work ahead there, against about 1 s for the whole prompt on a)
    picker = Picker(random.Random(0))
    assert {picker.choose("predicted_ttft", [a, b], second.total, now=NOW, chain=second).label for _ in range(50)} == {"b"}  # type: ignore[union-attr]
    b.in_flight = 8  # past the load bound: a takes it
    assert picker.choose("predicted_ttft", [a, b], second.total, now=NOW, chain=second).label == "a"  # type: ignore[union-attr]


def test_a_first_turn_goes_to_one_of_its_two_ranked_replicas_unless_both_are_slower():
    """A conversation's first turn: the better of the two replicas its key ranks first (by their load), so that a
    proxy new to the conversation has two places to look; but not when another replica alone is 1.5x faster."""
    replicas = [fitted(x, 0.0002) for x in "abcd"]
    picker, rng, seen = Picker(random.Random(0)), random.Random(1), collections.Counter()
    for s in range(60):
        prompt = agent_turns(s, 1)[0]
        for r in replicas:
            r.forecast.pending = rng.randrange(0, 20_000)
        ranked = [r.label for r in Picker._ranked(replicas, prompt.session)]
        place = picker.choose("predicted_ttft", replicas, prompt.total, now=NOW, chain=prompt)
        assert place is not None and place.label in ranked[:2]
        seen[ranked.index(place.label)] += 1
    assert seen[0] > 10 and seen[1] > 10  # (by load: either of the two)
    for r in replicas:
        r.forecast.pending = 0
    fast = next(r for r in replicas if r.label == ranked[3])
    fast.forecast = fitted(fast.label, 0.00005).forecast  # four times the others' prefill rate
    assert picker.choose("predicted_ttft", replicas, prompt.total, now=NOW, chain=prompt) is fast


def test_proxies_that_share_nothing_find_a_conversation_within_one_stray_turn():
    """Two proxies (two pickers, each with its own indexes and its own view of the load), 40 agent sessions of 8 turns
    on 4 replicas, each turn through one proxy at random; what each engine has cached is the truth its reports come
    from. A first turn goes where its proxy's view of the load puts it; a proxy new to the conversation sends it astray
    at most once (to a replica that never had it: remembered away), and every other turn goes where it lives."""
    rng = random.Random(7)
    views = [[fitted(x, 0.0002) for x in "abcd"] for _ in range(2)]
    pickers = [Picker(random.Random(i)) for i in range(2)]
    engines = {x: Index() for x in "abcd"}  # (each replica's cache: the truth)
    astray: collections.Counter[int] = collections.Counter()
    homes: dict[int, str] = {}
    for s in range(40):
        for turn, prompt in enumerate(agent_turns(s, 8)):
            p = rng.randrange(2)
            for r in views[p]:
                r.forecast.pending = rng.randrange(0, 20_000)  # (its view of the load: the other proxy's differs)
            u = pickers[p].choose("predicted_ttft", views[p], prompt.total, now=NOW, chain=prompt)
            assert u is not None
            predicted = u.prefixes.match(prompt)  # (as placement.py makes its Use)
            rivals = Picker.rivals(views[p], u, prompt) if prompt.opening and predicted <= prompt.shared else ()  # type: ignore[arg-type]
            use = Use(u.prefixes, prompt, predicted, rivals)
            u.prefixes.sent(prompt)  # type: ignore[attr-defined]
            cached = engines[u.label].match(prompt)
            engines[u.label].sent(prompt)
            use.reported(cached)
            homes.setdefault(s, u.label)
            astray[s] += u.label != homes[s]
    assert max(astray.values()) <= 1 and 5 <= sum(astray.values()) < 40, astray
    assert len(set(homes.values())) == 4
