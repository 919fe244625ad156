"""A fleet's common faults on real sockets (proxy/fleet/health.py, checks.py, placement.py, picker.py; the relay's
in-band failover): a full fleet answering 429 (load is not sickness), a wedged replica that accepts and never
answers (found by the active checks, its requests moved), a stream that fails in-band under its 200, a replica
that fails long prompts (a conversation sent there at most once), identical long prompts on replicas that confirm
no cache (each prefilled once). The official openai client on the other side."""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import openai
import pytest

from servers import Simulator, scraped, simulators
from test_placement import HEALTHY, agent_turn, ejections, failovers, routes_file, stream
from proxy.demo import prompt_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def four() -> Iterator[list[Simulator]]:
    with simulators(4) as sims:
        yield sims


@pytest.fixture
def replicas(four: list[Simulator]) -> Iterator[list[Simulator]]:
    healthy = {**HEALTHY, "max_streams": 0, "stream_error_after": -1, "error_over_tokens": 0, "wedged": False}
    for each in four:
        each.configure(**healthy)
    yield four
    for each in four:
        each.configure(**healthy)


def goodput(proxy: Any, seconds: float, clients: int, sims: list[Simulator]) -> tuple[int, int]:
    """Streams served whole in `seconds` by `clients` looping, and the fewest requests any replica received meanwhile."""
    stop, served = threading.Event(), [0]
    before = [s.stats()["requests"] for s in sims]

    def client() -> None:
        while not stop.is_set():
            try:
                _, _, chunks = stream(proxy, tokens=10, headers={"x-sim-ttft-ms": "50"})
                served[0] += chunks == 10
            except openai.APIError:
                time.sleep(0.05)

    with ThreadPoolExecutor(clients) as pool:
        running = [pool.submit(client) for _ in range(clients)]
        time.sleep(seconds)
        stop.set()
        for each in running:
            each.result()
    return served[0], min(s.stats()["requests"] - b for s, b in zip(sims, before))


@pytest.mark.parametrize("retry_after", ["1", ""])
def test_a_full_fleet_is_not_a_sick_one(replicas, proxy_factory, tmp_path, retry_after):
    """Four replicas of four streams each, 24 clients: every replica answers 429 past its fourth stream. No replica is
    set aside, every one keeps getting requests, and the 429s fail over. (The goodput against ejection off, side by
    side: `python -m bench.fleet full-fleet`, bench/RESULTS.md.)"""
    for each in replicas:
        each.configure(max_streams=4, retry_after=retry_after)
    named = {f"r{i}": f"{s.url}/v1" for i, s in enumerate(replicas)}
    proxy = proxy_factory(routes=routes_file(tmp_path, named, retries=1, first_token_deadline=2.0))
    served, least = goodput(proxy, 2.0, 24, replicas)
    print(f"\nRetry-After {retry_after or 'none'}: {served} streams in 2 s; the fewest requests a replica got: {least}")
    assert served >= 20 and least >= 10, (served, least)  # (it served, and no replica went without requests)
    assert sum(ejections(proxy, u, reason) for u in named for reason in ("consecutive_failures", "failure_share", "retry_after")) == 0
    assert all(scraped(proxy.url, "llmproxy_upstream_state", upstream=u, state="serving") == 1 for u in named)
    assert sum(failovers(proxy, u, "status_429") for u in named) > 0  # (it was full: 429s failed over)


def test_a_wedged_replica_is_found_by_its_checks_and_its_requests_answered_elsewhere(replicas, proxy_factory, tmp_path):
    """One of three accepts every request (its /health too) and never answers. 30 non-streaming requests, 3 at a time:
    each answered within 10 s, those that reached it by another replica; its checks set it aside within seconds."""
    wedged = replicas[2]
    wedged.configure(wedged=True)
    named = {f"r{i}": f"{s.url}/v1" for i, s in enumerate(replicas[:3])}
    proxy = proxy_factory(routes=routes_file(tmp_path, named, retries=1, first_token_deadline=1.0))
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0, timeout=30)

    def one(_: int) -> float:
        began = time.monotonic()
        answer = client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                extra_headers={"x-sim-ttft-ms": "50"})
        assert answer.usage.completion_tokens == 3
        return time.monotonic() - began

    with ThreadPoolExecutor(3) as pool:
        took = list(pool.map(one, range(30)))
    records = proxy.wait_records(30)
    moved = [r for r in records if len(r["attempts"]) > 1]
    assert sum(t <= 10.0 for t in took) >= 29, sorted(took)[-3:]
    assert all(r["outcome"] == "ok" and r["upstream"] != "r2" for r in records)
    assert moved and all(r["attempts"][0] == {**r["attempts"][0], "upstream": "r2", "abandoned": "silent"} for r in moved)
    assert all(r["duration_s"] < 4.0 for r in moved), [r["duration_s"] for r in moved]  # its deadline, then a check's interval and timeout
    found = time.monotonic() + 5.0  # (set aside by its failed checks: two in a row, a second's timeout each)
    while not ejections(proxy, "r2", "health_check") and time.monotonic() < found:
        time.sleep(0.1)
    assert ejections(proxy, "r2", "health_check") == 1
    assert sum(ejections(proxy, u, r) for u in ("r0", "r1") for r in ("health_check", "consecutive_failures", "failure_share")) == 0


def test_an_error_in_the_stream_is_a_failure_and_before_content_goes_elsewhere(replicas, proxy_factory, tmp_path):
    """vLLM's way to fail a started stream: `data: {"error": ...}` then [DONE], under its 200. Before any content, with a
    healthy replica beside it, every client gets the healthy replica's whole answer; after content, the record and the
    counter say upstream_error."""
    failing, healthy = replicas[0], replicas[1]
    failing.configure(stream_error_after=0)
    proxy = proxy_factory(routes=routes_file(tmp_path, {"failing": f"{failing.url}/v1", "healthy": f"{healthy.url}/v1"}, retries=1))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: stream(proxy, tokens=5), range(40)))
    records = proxy.wait_records(40)
    assert sum(chunks == 5 for _, _, chunks in results) >= 38
    assert all(r["outcome"] == "ok" and r["upstream"] == "healthy" for r in records)
    abandoned = [r["attempts"][0] for r in records if len(r["attempts"]) > 1]
    assert abandoned and all(a["upstream"] == "failing" and a["abandoned"] == "stream_error" for a in abandoned)
    assert failovers(proxy, "failing", "stream_error") == len(abandoned)

    failing.configure(stream_error_after=2)  # after content: too late to move; the request failed, and says so
    (tmp_path / "one").mkdir()
    alone = proxy_factory(routes=routes_file(tmp_path / "one", {"failing": f"{failing.url}/v1"}))
    client = openai.OpenAI(base_url=alone.v1, api_key="sk-test", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.APIError):  # (the SDK raises on the error event)
            for _ in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True):
                pass
    failed = alone.wait_records(3)
    assert all(r["outcome"] == "upstream_error" and r["error"].startswith("stream_error:") for r in failed), failed
    assert alone.sample("llmproxy_requests_total", {"model": "sim-7b", "upstream": "failing", "endpoint": "chat", "stream": "true",
                                                    "outcome": "upstream_error", "code": "200"}) == 3


def test_a_conversation_goes_back_at_most_once_to_the_replica_that_failed_it(replicas, proxy_factory, tmp_path):
    """A replica that answers 500 to prompts over 2,000 tokens; six agent conversations of six growing turns: each
    conversation's long turns reach it at most once (a prompt is indexed where it was answered, and a conversation
    that failed on a replica is remembered away from it)."""
    picky, other = replicas[0], replicas[1]
    for each in (picky, other):
        each.configure(prefix_cache_tokens=400_000)
    picky.configure(error_over_tokens=2000)
    proxy = proxy_factory(routes=routes_file(tmp_path, {"picky": f"{picky.url}/v1", "other": f"{other.url}/v1"}, retries=1,
                                             pick="predicted_ttft"))
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    conversations: list[list[Any]] = [[] for _ in range(6)]
    for _ in range(6):
        for session, messages in enumerate(conversations):
            agent_turn(client, messages, session, words=300)
    records = proxy.wait_records(36)
    long_on_picky = collections.Counter(r["user"] for r in records for a in r["attempts"]
                                        if a["upstream"] == "picky" and r["prompt_tokens"] > 2000)
    assert all(r["outcome"] == "ok" for r in records)
    assert max(long_on_picky.values(), default=0) <= 1, long_on_picky


def test_identical_long_prompts_are_prefilled_once_where_no_engine_confirmed_a_cache(replicas, proxy_factory, tmp_path):
    """Six identical 8,000-token prompts (1.6 s of prefill) on two replicas that report no cached tokens, a 1 s deadline:
    a cache nobody confirmed never shortens a deadline, so each is sent once and none waits past its own prefill."""
    two = replicas[:2]
    before = sum(s.stats()["requests"] for s in two)
    proxy = proxy_factory(routes=routes_file(tmp_path, {f"r{i}": f"{s.url}/v1" for i, s in enumerate(two)}, retries=1,
                                             first_token_deadline=1.0, pick="predicted_ttft"))
    long = prompt_of(8000)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: stream(proxy, tokens=3, headers={"x-sim-ttft-ms": ""}, prompt=long), range(6)))
    assert sum(s.stats()["requests"] for s in two) - before == 6
    assert all(chunks == 3 for _, _, chunks in results) and max(ttft for ttft, _, _ in results) <= 1.9, [r[0] for r in results]


def test_a_response_is_continued_on_the_replica_that_stored_it(replicas, proxy_factory, tmp_path):
    """A Responses API request naming `previous_response_id` (or GET /v1/responses/{id}) goes to the replica whose
    answer it names: only that one holds it."""
    named = {f"r{i}": f"{s.url}/v1" for i, s in enumerate(replicas[:3])}
    proxy = proxy_factory(routes=routes_file(tmp_path, named))
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    for turn in range(6):
        first = client.responses.create(model="sim-7b", input=f"conversation {turn}", max_output_tokens=2,
                                        stream=turn % 2 == 1) if turn % 2 == 0 else None
        if first is None:  # (streamed: its id from response.created)
            events = list(client.responses.create(model="sim-7b", input=f"conversation {turn}", max_output_tokens=2, stream=True))
            ident = events[0].response.id
        else:
            ident = first.id
        where = proxy.wait_records(1 + 3 * turn)[-1]["upstream"]
        client.responses.create(model="sim-7b", input="and then?", previous_response_id=ident, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):  # (the simulator stores nothing: what matters is where it asked)
            client.responses.retrieve(ident)
        records = proxy.wait_records(3 + 3 * turn)[-2:]
        assert [r["upstream"] for r in records] == [where, where], (where, records)


def test_every_proxy_sees_the_engines_own_queue(replicas, proxy_factory, tmp_path):
    """Two proxies that share nothing: one holds four long streams on r0; the other, reading each replica's queue gauges
    (`health_check: {metrics: /metrics}`, vLLM's num_requests_running and _waiting), sends its requests to r1."""
    from proxy.fleet.checks import queue_of

    assert queue_of(b'# HELP x\nvllm:num_requests_running{model_name="a"} 3.0\nvllm:num_requests_waiting{model_name="a"} 2.0\n'
                    b'vllm:num_requests_waiting{model_name="b"} 1.0\nvllm:num_requests_running_total 9\n') == (3.0, 3.0)
    assert queue_of(b"sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n") == (4.0, 1.0) and queue_of(b"up 1\n") is None
    r0, r1 = replicas[0], replicas[1]
    (tmp_path / "other").mkdir()
    other = proxy_factory(routes=routes_file(tmp_path / "other", {"r0": f"{r0.url}/v1"}))
    path = tmp_path / "routes.yaml"
    routes_file(tmp_path, {"r0": f"{r0.url}/v1", "r1": f"{r1.url}/v1"})
    import yaml
    data = yaml.safe_load(path.read_text())
    data["health_check"] = {"metrics": "/metrics"}
    path.write_text(yaml.safe_dump(data))
    proxy = proxy_factory(routes=str(path))
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(stream, other, 3, {"x-sim-ttft-ms": "3000"}) for _ in range(4)]
        time.sleep(1.5)  # (a check or two has read r0's queue)
        for _ in range(6):
            stream(proxy, tokens=2)
        assert all(f.result()[2] == 3 for f in held)
    assert [r["upstream"] for r in proxy.wait_records(6)] == ["r1"] * 6
