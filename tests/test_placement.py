"""A route's retries and its replicas' health on real sockets (proxy/fleet/placement.py, picker.py, health.py): a
replica stuck after its headers, one that answers 503 at once, one that refuses connections, one that
asks for quiet with a 429, one that fails and recovers, one that breaks after its first tokens, long
prompts on healthy replicas, a route of one replica, equal replicas with non-streaming requests, and
every replica slow at once (the retry budget); agent sessions on replicas with prefix caches, through two
proxies that share nothing, and resumed through a proxy new to them; the official openai client on the other side."""
from __future__ import annotations

import collections
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import openai
import pytest
import yaml

from servers import RawUpstream, Simulator, scraped, simulators
from proxy.demo import prompt_of
from proxy.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEADLINE, HEALTHY_TTFT = 0.5, 0.1
HEALTHY = {"error_status": 0, "retry_after": "", "stall_after": -1, "prefill_tps": 5000.0, "ttft_ms": -1.0, "prefix_cache_tokens": 0}


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Simulator]]:
    healthy, stuck = Simulator(), Simulator()
    stuck.configure(stall_after=0)  # its headers and role chunk, then nothing (until the proxy leaves)
    try:
        yield {"healthy": healthy, "stuck": stuck}
    finally:
        healthy.proc.stop()
        stuck.proc.stop()


@pytest.fixture(scope="module")
def trio() -> Iterator[list[Simulator]]:
    """Three replicas of one model; each test makes them sick as it needs (and healthy again after)."""
    with simulators(3) as sims:
        yield sims


@pytest.fixture
def fleet(trio: list[Simulator]) -> Iterator[list[Simulator]]:
    for each in trio:
        each.configure(**HEALTHY)
    yield trio
    for each in trio:
        each.configure(**HEALTHY)


def routes_file(tmp_path: Any, upstreams: dict[str, str], ejection: Any = None, **route: Any) -> str:
    path = tmp_path / "routes.yaml"
    data: dict[str, Any] = {"upstreams": [{"name": n, "url": u} for n, u in upstreams.items()],
                            "routes": [{"models": ["sim-7b"], "upstreams": list(upstreams), **route}]}
    if ejection is not None:
        data["ejection"] = ejection
    path.write_text(yaml.safe_dump(data))
    return str(path)


def stream(proxy: Any, tokens: int = 20, headers: dict[str, str] | None = None, prompt: str = "hi") -> tuple[float, str, int]:
    """(client TTFT, the text, content chunks) of one streamed chat completion (HEALTHY_TTFT, unless the headers
    say otherwise; an empty x-sim-ttft-ms: the prompt's own prefill time)."""
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    began = time.perf_counter()
    first, text, chunks = None, "", 0
    extra = {k: v for k, v in {"x-sim-ttft-ms": str(int(HEALTHY_TTFT * 1000)), **(headers or {})}.items() if v}
    for chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": prompt}], max_tokens=tokens, stream=True,
                                                extra_headers=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - began
            text += chunk.choices[0].delta.content
            chunks += 1
    assert first is not None
    return first, text, chunks


def failovers(proxy: Any, upstream: str, reason: str) -> float:
    return proxy.registry.get_sample_value("llmproxy_failovers_total", {"model": "sim-7b", "upstream": upstream, "reason": reason}) or 0.0


def ejections(proxy: Any, upstream: str, reason: str) -> float:
    return proxy.registry.get_sample_value("llmproxy_upstream_ejections_total", {"upstream": upstream, "reason": reason}) or 0.0


def test_a_stuck_replica_fails_over_within_the_deadline_and_is_weighed_not_set_aside(pair, proxy_factory, tmp_path):
    healthy, stuck = pair["healthy"], pair["stuck"]
    # Six at once: fewest_in_flight spreads them (nothing has failed yet), so three meet the stuck replica first.
    path = routes_file(tmp_path, {"stuck": f"{stuck.url}/v1", "healthy": f"{healthy.url}/v1"}, ejection={"consecutive_failures": 3},
                       first_token_deadline=DEADLINE, retries=1, retry_budget={"ratio": 1.0, "min_concurrency": 100})
    proxy = proxy_factory(routes=path)
    direct = "".join(c.choices[0].delta.content or "" for c in openai.OpenAI(base_url=f"{healthy.url}/v1", api_key="x").chat.completions.create(
        model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True) if c.choices)
    disconnects = stuck.stats()["disconnects"]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: stream(proxy), range(6)))
    records = proxy.wait_records(6)
    moved = 0
    for r in records:
        assert r["upstream"] == "healthy" and sum(r["phases_s"].values()) == pytest.approx(r["duration_s"], abs=1e-6)
        assert r["phases_s"]["prefill"] == pytest.approx(HEALTHY_TTFT, abs=0.03)
        if len(r["attempts"]) == 1:  # it met the healthy replica first
            assert "failover" not in r["phases_s"] and r["attempts"][0]["upstream"] == "healthy"
            continue
        moved += 1
        (abandoned, served) = r["attempts"]
        assert (abandoned["upstream"], abandoned["abandoned"], served["upstream"], served["abandoned"]) == ("stuck", "deadline", "healthy", None)
        assert abandoned["duration_s"] == pytest.approx(DEADLINE, abs=0.02)
        assert r["phases_s"]["failover"] == pytest.approx(DEADLINE, abs=0.02)  # its own part of TTFT, not prefill
    assert all(text == direct and chunks == 20 for _, text, chunks in results)  # every token exactly once: nothing of a stuck attempt reached the client
    assert moved == 3 and failovers(proxy, "stuck", "deadline") == moved
    ttfts = sorted(ttft for ttft, _, _ in results)  # as the clients saw them: three direct, three after the deadline then the healthy TTFT
    assert all(ttft <= HEALTHY_TTFT + 0.06 for ttft in ttfts[:3]) and all(DEADLINE <= ttft <= DEADLINE + HEALTHY_TTFT + 0.06 for ttft in ttfts[3:]), ttfts
    # Three deadlines missed: busy, not sick (never set aside for it: a full fleet misses deadlines too), yet weighed:
    # it looks four times as loaded, so the next requests, one at a time, never meet it.
    assert ejections(proxy, "stuck", "consecutive_failures") == 0
    scrape = httpx.get(f"{proxy.url}/metrics").text
    assert re.search(r'^llmproxy_upstream_state\{state="serving",upstream="stuck"\} 1\.0$', scrape, re.M), scrape
    for _ in range(4):
        stream(proxy, tokens=3)
        assert [a["upstream"] for a in proxy.last_record()["attempts"]] == ["healthy"]
    # Who lost the time: the stuck replica owns the failover seconds, the healthy one is charged its own TTFT only.
    assert proxy.sample("llmproxy_phase_seconds_total", {"model": "sim-7b", "upstream": "stuck", "endpoint": "chat", "stream": "true",
                                                         "phase": "failover"}) == pytest.approx(3 * DEADLINE, abs=0.06)
    assert proxy.sample("llmproxy_phase_seconds_total", {"model": "sim-7b", "upstream": "healthy", "endpoint": "chat", "stream": "true",
                                                         "phase": "failover"}) is None
    ttft_sum = proxy.sample("llmproxy_time_to_first_token_seconds_sum", {"model": "sim-7b", "upstream": "healthy", "endpoint": "chat", "stream": "true"})
    assert ttft_sum == pytest.approx(sum(r["ttft_s"] - r["phases_s"].get("failover", 0.0) for r in proxy.records()), abs=1e-6)
    assert ttft_sum < 10 * (HEALTHY_TTFT + 0.06)
    scrape = httpx.get(f"{proxy.url}/metrics").text  # each replica's predicted TTFT, once it has requests of its own
    assert re.search(r'^llmproxy_upstream_predicted_ttft_seconds\{upstream="healthy"\} [0-9.e-]+$', scrape, re.M)
    servers = [s for s in proxy.exporter.get_finished_spans() if s.kind.name == "SERVER"]
    clients = [s for s in proxy.exporter.get_finished_spans() if s.kind.name == "CLIENT"]
    assert len(servers) == 10 and len(clients) == 10 + moved  # a span per attempt
    assert sorted(s.attributes.get("llmproxy.attempt.abandoned", "") for s in clients) == [""] * 10 + ["deadline"] * moved
    deadline = time.monotonic() + 5  # the stuck attempts' connections closed: the engine saw each client leave
    while stuck.stats()["disconnects"] < disconnects + moved and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck.stats()["disconnects"] == disconnects + moved


def test_no_retry_once_a_byte_went_out(pair, proxy_factory, tmp_path):
    """A replica that stalls after its first tokens: the client has them, so the request is never sent again."""
    healthy, stuck = pair["healthy"], pair["stuck"]
    path = routes_file(tmp_path, {"stuck": f"{stuck.url}/v1", "healthy": f"{healthy.url}/v1"}, first_token_deadline=DEADLINE, retries=1,
                       retry_budget={"ratio": 1.0, "min_concurrency": 100})
    proxy = proxy_factory(routes=path, read_timeout=1.0)
    requests = stuck.stats()["requests"], healthy.stats()["requests"]
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    got = []
    with pytest.raises(openai.APIError):  # the stream breaks, as it would directly
        for chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True,
                                                    extra_headers={"x-sim-stall-after": "3"}):
            got.append(chunk)
    record = proxy.last_record()
    assert len(record["attempts"]) == 1 and record["outcome"] == "timeout" and record["content_chunks"] == 3
    assert (stuck.stats()["requests"] - requests[0]) + (healthy.stats()["requests"] - requests[1]) == 1  # sent once, to one replica
    assert not any(failovers(proxy, u, "deadline") for u in ("stuck", "healthy"))


def test_a_503_and_a_refused_connection_go_to_the_next_replica(sim, proxy_factory, tmp_path):
    failing = RawUpstream([b'{"error": {"message": "overloaded"}}'], content_type="application/json", chunked=False, status=503)
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({
        "upstreams": [{"name": "failing", "url": failing.url}, {"name": "closed", "url": closed}, {"name": "sim", "url": f"{sim.url}/v1"}],
        "routes": [{"models": ["sim-7b"], "upstreams": ["failing", "closed", "sim"], "retries": 2,
                    "retry_budget": {"ratio": 1.0}}]}))  # (no deadline; a budget for all six at once, before any replica is set aside)
    proxy = proxy_factory(routes=str(path))
    with ThreadPoolExecutor(6) as pool:  # (at once: the three are each first for some, before any has failed)
        results = list(pool.map(lambda _: stream(proxy, tokens=5), range(6)))
    seen = set()
    for record in proxy.wait_records(6):
        assert record["outcome"] == "ok" and record["status_code"] == 200 and record["upstream"] == "sim"
        assert record["attempts"][-1] == {**record["attempts"][-1], "upstream": "sim", "abandoned": None}
        seen |= {(a["upstream"], a["abandoned"]) for a in record["attempts"][:-1]}
    assert all(chunks == 5 for _, _, chunks in results)
    assert seen == {("failing", "status_5xx"), ("closed", "connect_error")}
    assert failovers(proxy, "failing", "status_5xx") >= 1 and failovers(proxy, "closed", "connect_error") >= 1
    # No other replica: its own answer goes to the client as it came.
    path.write_text(yaml.safe_dump({"upstreams": [{"name": "failing", "url": failing.url}],
                                    "routes": [{"models": ["sim-7b"], "upstreams": ["failing"], "retries": 1}]}))
    proxy.app.reload()
    with pytest.raises(openai.InternalServerError) as error:
        stream(proxy, tokens=5)
    assert error.value.status_code == 503 and "overloaded" in str(error.value.body)


def test_the_retry_budget_holds_when_every_replica_is_slow(pair, proxy_factory, tmp_path):
    """Every replica slower than the deadline (a fleet-wide slowdown): retries stay within the budget
    (10% of the route's requests in flight, plus one), and every request is still answered."""
    healthy = pair["healthy"]
    other = Simulator()
    try:
        path = routes_file(tmp_path, {"one": f"{healthy.url}/v1", "two": f"{other.url}/v1"}, first_token_deadline=0.2, retries=1,
                           retry_budget={"ratio": 0.1, "min_concurrency": 1})
        proxy = proxy_factory(routes=path)
        with ThreadPoolExecutor(40) as pool:
            results = list(pool.map(lambda _: stream(proxy, tokens=3, headers={"x-sim-ttft-ms": "800"}), range(40)))
        assert all(chunks == 3 for _, _, chunks in results)
        records = proxy.wait_records(40)
        retried = sum(1 for r in records if len(r["attempts"]) > 1)
        total = sum(failovers(proxy, u, "deadline") for u in ("one", "two"))
        assert total == retried and 1 <= retried <= 1 + 0.1 * 40, retried  # never more than the budget (40 in flight at the deadline)
        assert all(r["outcome"] == "ok" for r in records)
    finally:
        other.proc.stop()


def test_a_non_streaming_request_is_never_sent_twice_for_the_deadline(pair, proxy_factory, tmp_path):
    """Its first token is its last: a deadline on it would only send every long answer twice."""
    healthy, stuck = pair["healthy"], pair["stuck"]  # (the stuck one stalls streams only)
    path = routes_file(tmp_path, {"stuck": f"{stuck.url}/v1", "healthy": f"{healthy.url}/v1"}, first_token_deadline=0.2, retries=1)
    proxy = proxy_factory(routes=path)
    before = stuck.stats()["requests"] + healthy.stats()["requests"]
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    answer = client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            extra_headers={"x-sim-ttft-ms": "600"})
    assert answer.usage.completion_tokens == 5
    assert len(proxy.last_record()["attempts"]) == 1 and stuck.stats()["requests"] + healthy.stats()["requests"] == before + 1


def test_a_held_stream_reaches_the_client_whole_whatever_its_shape(pair, proxy_factory, tmp_path):
    """On a deadline route, what comes before the first token is held, then sent with it: keep-alive comments,
    the role chunk, the Responses API's and Anthropic's typed events before their first delta, all of it."""
    import anthropic

    healthy = pair["healthy"]
    # Two names for the one replica: another attempt could follow, so each stream is held (a route of one is never held).
    path = routes_file(tmp_path, {"healthy": f"{healthy.url}/v1", "twin": f"{healthy.url}/v1"}, first_token_deadline=2.0, retries=1)
    proxy = proxy_factory(routes=path)
    slow_start = {"x-sim-ttft-ms": "345", "x-sim-keepalive-ms": "50"}  # (six keep-alives, 50 ms apart, whatever the sleeps overshoot by up to 9 ms)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    via = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=slow_start, timeout=30).text
    direct = httpx.post(f"{healthy.url}/v1/chat/completions", json=body, headers=slow_start, timeout=30).text
    tokens = lambda text: re.findall(r'"content":"([^"]+)"', text)  # noqa: E731 - (the role chunk's content is empty)
    assert via.count(": keep-alive") == direct.count(": keep-alive") >= 4 and tokens(via) == tokens(direct) and len(tokens(via)) == 6
    events = list(openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0).responses.create(
        model="sim-7b", input="hi", max_output_tokens=6, stream=True, extra_headers=slow_start))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0).messages.stream(
            model="sim-7b", max_tokens=6, messages=[{"role": "user", "content": "hi"}], extra_headers=slow_start) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 6
    records = proxy.wait_records(3)
    # The first token, not a keep-alive (the first came at 50 ms): the simulator's timers run on a cached loop clock,
    # which a loaded machine leaves stale, so its 345 ms can be a few ms short; 300 ms still tells them apart.
    assert all(len(r["attempts"]) == 1 and r["outcome"] == "ok" and r["ttft_s"] >= 0.300 for r in records[-3:]), \
        [(len(r["attempts"]), r["outcome"], r["ttft_s"]) for r in records]


@pytest.mark.parametrize("pick", ["fewest_in_flight", "predicted_ttft"])
def test_a_replica_failing_fast_gets_few_requests_and_every_client_its_answer(fleet, proxy_factory, tmp_path, pick):
    """A crashed engine behind a healthy port answers 503 at once: never busy, never slow. It is set aside,
    not rewarded, and the retry budget is never spent on it for long."""
    a, b, sick = fleet
    sick.configure(error_status=503)
    path = routes_file(tmp_path, {"sick": f"{sick.url}/v1", "a": f"{a.url}/v1", "b": f"{b.url}/v1"}, retries=1, pick=pick)
    proxy = proxy_factory(routes=path)
    before = sick.stats()["requests"]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: stream(proxy, tokens=3), range(100)))
    assert all(chunks == 3 for _, _, chunks in results)  # every client its whole answer
    records = proxy.wait_records(100)
    assert all(r["outcome"] == "ok" and r["upstream"] in ("a", "b") for r in records)
    reached = sick.stats()["requests"] - before
    assert 1 <= reached <= 10, reached  # at most 10% of the requests
    assert failovers(proxy, "sick", "status_5xx") == reached
    if pick == "fewest_in_flight":  # (idle-looking, it had its turns until failures in a row, or its failed checks, set it aside)
        assert ejections(proxy, "sick", "consecutive_failures") + ejections(proxy, "sick", "health_check") == 1
        assert scraped(proxy.url, "llmproxy_upstream_state", upstream="sick", state="ejected") == 1


def test_a_429_is_busy_not_sick_and_its_retry_after_on_the_proxys_key_is_a_back_off(fleet, proxy_factory, tmp_path, monkeypatch):
    """A 429 fails over and weighs on the replica, never sets it aside (a full fleet is not a sick one); on the proxy's own
    key its Retry-After backs the replica off: nothing while another replica can take it, then it serves again."""
    a, busy = fleet[0], fleet[1]
    busy.configure(error_status=429, retry_after="2")
    monkeypatch.setenv("SIM_KEY", "sk-proxy")
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{"name": "busy", "url": f"{busy.url}/v1", "api_key_env": "SIM_KEY"},
                                                  {"name": "a", "url": f"{a.url}/v1", "api_key_env": "SIM_KEY"}],
                                    "routes": [{"models": ["sim-7b"], "upstreams": ["busy", "a"], "retries": 1}]}))
    proxy = proxy_factory(routes=str(path))
    before = busy.stats()["requests"]
    seen: list[tuple[float, int]] = []  # (when, the busy replica's requests so far)
    began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # (two at once: the quiet replica is the only one free, now and then)
        while time.monotonic() - began < 4.5:
            assert all(chunks == 2 for _, _, chunks in pool.map(lambda _: stream(proxy, tokens=2), range(2)))  # never a 429 seen
            seen.append((time.monotonic() - began, busy.stats()["requests"] - before))
    asked = next(at for at, n in seen if n >= 1)
    within = {n for at, n in seen if asked <= at < asked + 1.8}  # the quiet it asked for: not one more request
    assert asked < 1.0 and len(within) == 1, seen
    assert seen[-1][1] > seen[0][1] + 1 or seen[-1][1] >= 2, seen  # then it serves (and asks again)
    assert sum(ejections(proxy, "busy", reason) for reason in ("retry_after", "consecutive_failures", "failure_share")) == 0
    assert scraped(proxy.url, "llmproxy_upstream_state", upstream="busy", state="serving") == 1
    assert failovers(proxy, "busy", "status_429") == seen[-1][1]


def test_a_replica_that_fails_then_recovers_serves_its_share_again(fleet, proxy_factory, tmp_path):
    a, flaky = fleet[0], fleet[1]
    flaky.configure(error_status=503)
    path = routes_file(tmp_path, {"flaky": f"{flaky.url}/v1", "a": f"{a.url}/v1"}, ejection={"base_time": 1}, retries=1)
    proxy = proxy_factory(routes=path)
    stop = threading.Event()
    sent = [0]

    def client() -> None:
        while not stop.is_set():
            _, _, chunks = stream(proxy, tokens=2)
            assert chunks == 2
            sent[0] += 1

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(client) for _ in range(2)]
        time.sleep(3.0)
        flaky.configure(error_status=0)  # it recovers
        recovered = time.time()
        time.sleep(5.0)
        stop.set()
        for each in running:
            each.result()
    records = proxy.wait_records(sent[0])
    failing = [r for r in records if r["received_unix_ns"] < recovered * 1e9]
    first_on_flaky = sum(1 for r in failing if r["attempts"][0]["upstream"] == "flaky")
    assert len(failing) >= 20 and first_on_flaky <= 0.2 * len(failing), (first_on_flaky, len(failing))  # set aside, a probe now and then
    # Set aside for its failures or its failed checks (its /health fails while its engine does), back once a check passes.
    assert ejections(proxy, "flaky", "consecutive_failures") + ejections(proxy, "flaky", "health_check") >= 1
    late = [r["upstream"] for r in records if r["received_unix_ns"] > (recovered + 3.0) * 1e9]  # its checks pass within 1-3 s
    assert len(late) >= 10 and 0.25 <= late.count("flaky") / len(late) <= 0.75, late


def test_a_long_prompt_is_not_abandoned_for_being_long(fleet, proxy_factory, tmp_path):
    """8,000-token prompts on healthy replicas that prefill 5,000 tokens a second (1.6 s), a 1 s deadline,
    a fresh proxy: each is served by the replica it met first, its TTFT the replica's own."""
    a, b = fleet[0], fleet[1]
    path = routes_file(tmp_path, {"a": f"{a.url}/v1", "b": f"{b.url}/v1"}, first_token_deadline=1.0, retries=1)
    proxy = proxy_factory(routes=path)
    long = prompt_of(8000)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: stream(proxy, tokens=3, headers={"x-sim-ttft-ms": ""}, prompt=long), range(2)))
    for (ttft, _, chunks), r in zip(results, proxy.wait_records(2)):
        assert chunks == 3 and len(r["attempts"]) == 1 and r["prompt_tokens"] >= 7900
        assert 1.55 <= r["phases_s"]["prefill"] <= 1.7 and ttft <= 1.2 * 1.6, (ttft, r["phases_s"])
    assert not any(failovers(proxy, u, "deadline") for u in ("a", "b"))


def test_a_route_of_one_replica_sends_the_headers_at_once(fleet, proxy_factory, tmp_path):
    """Nothing to fail over to: nothing is held, so the client has the headers (and keep-alives) as the replica sends them."""
    path = routes_file(tmp_path, {"only": f"{fleet[0].url}/v1"}, first_token_deadline=0.5, retries=1)
    proxy = proxy_factory(routes=path)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    began = time.monotonic()
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers={"x-sim-ttft-ms": "1500"}, timeout=30) as response:
        headers_s = time.monotonic() - began
        text = response.read().decode()
    assert response.status_code == 200 and headers_s < 0.3, headers_s
    assert len(re.findall(r'"content":"[^"]+"', text)) == 3 and time.monotonic() - began >= 1.5


def test_a_stream_is_no_longer_held_once_no_retry_can_follow(pair, proxy_factory, tmp_path):
    """Two streams on a stuck replica, a budget of one retry: the first fails over at the deadline; for the second
    nothing more can follow, so what was held (its headers, its role chunk) goes out then, not at the first-token limit."""
    healthy, stuck = pair["healthy"], pair["stuck"]
    path = routes_file(tmp_path, {"stuck": f"{stuck.url}/v1", "healthy": f"{healthy.url}/v1"}, first_token_deadline=0.4, retries=1,
                       pick="fewest_in_flight", retry_budget={"ratio": 0.0, "min_concurrency": 1})
    proxy = proxy_factory(routes=path, first_token_timeout=2.0)
    proxy.app.router.upstreams["healthy"].in_flight += 2  # (both go to the stuck replica first)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}

    def one(_: int) -> tuple[float, int, str]:
        began = time.monotonic()
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers={"x-sim-ttft-ms": "100"}, timeout=30) as response:
            headers_s = time.monotonic() - began
            try:
                text = response.read().decode()
            except httpx.HTTPError:  # (the stuck one breaks at the first-token limit, as it would directly)
                text = ""
        return headers_s, response.status_code, text

    with ThreadPoolExecutor(2) as pool:
        results = sorted(pool.map(one, range(2)))
    proxy.app.router.upstreams["healthy"].in_flight -= 2
    (first_s, first_status, _), (second_s, second_status, second_text) = results
    assert first_status == second_status == 200
    assert 0.38 <= first_s <= 0.55 and 0.38 <= second_s <= 0.55, results  # both at the deadline (not the limit, 2 s): one moved, one let go
    records = proxy.wait_records(2)
    assert sorted(len(r["attempts"]) for r in records) == [1, 2]
    assert sorted(r["outcome"] for r in records) == ["ok", "timeout"]


def test_equal_replicas_share_non_streaming_requests(fleet, proxy_factory, tmp_path):
    """predicted_ttft with nothing to go by (a non-streaming answer says nothing of its first token): the three share."""
    path = routes_file(tmp_path, {f"r{i}": f"{s.url}/v1" for i, s in enumerate(fleet)}, pick="predicted_ttft")
    proxy = proxy_factory(routes=path)
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                               extra_headers={"x-sim-ttft-ms": "20"}), range(45)))
    counts = collections.Counter(r["upstream"] for r in proxy.wait_records(45))
    assert sum(counts.values()) == 45 and all(0.15 * 45 <= counts[f"r{i}"] <= 0.55 * 45 for i in range(3)), counts


def test_held_bytes_count_against_the_read_ahead_limits(proxy_factory, tmp_path):
    """A replica that sends 100 KB before its first token (a hostile or chatty one): held past --stream-buffer-bytes
    (64 KB) it would be memory nobody bounds, so it goes out at once, as it came, and the budget is whole after."""
    comment = b": " + b"x" * 100_000 + b"\n\n"
    content = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" the"}}]}\n\n'
    with_gap = RawUpstream([comment, content, b"data: [DONE]\n\n"], gap_s=0.4)
    try:
        path = routes_file(tmp_path, {"raw": with_gap.url, "twin": with_gap.url}, first_token_deadline=5.0, retries=1)
        proxy = proxy_factory(routes=path, stream_buffer_bytes=65536)
        body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        began = time.monotonic()
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, timeout=30) as response:
            pieces = response.iter_raw()
            first = next(pieces)
            first_s = time.monotonic() - began
            rest = b"".join(pieces)
        assert first_s < 0.7 and first.startswith(b": xxxx"), first_s  # the comment (sent after 0.4 s), long before the token (0.8 s)
        assert first + rest == comment + content + b"data: [DONE]\n\n"
        assert proxy.last_record()["content_chunks"] == 1 and proxy.app.router.budget.used == 0
    finally:
        with_gap.stop()


def agent_turn(client: openai.OpenAI, messages: list[Any], session: int, words: int = 800) -> None:
    """One turn of an agent session: its whole conversation resent, `words` tokens more than the last time."""
    if not messages:
        messages.append({"role": "system", "content": "You are a coding agent." + prompt_of(2000)})
    messages.append({"role": "user", "content": f"session {session} turn {len(messages)}:" + prompt_of(words)})
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="sim-7b", messages=messages, max_tokens=5, stream=True, user=f"session-{session}") if c.choices)
    messages.append({"role": "assistant", "content": text})


def prefix_tokens(proxy: Any, upstream: str) -> tuple[float, float]:
    """(predicted, reported) prefix tokens of one replica, as the proxy's metrics count them."""
    sample = proxy.registry.get_sample_value
    return (sample("llmproxy_prefix_predicted_tokens_total", {"upstream": upstream}) or 0.0,
            sample("llmproxy_prefix_reported_tokens_total", {"upstream": upstream}) or 0.0)


def test_agent_sessions_keep_their_replica_through_two_proxies(fleet, proxy_factory, tmp_path):
    """Replicas with prefix caches, predicted_ttft, two proxies that share nothing, each session's turns
    alternating between them: every turn of a session on one replica, most prompt tokens served from the
    cache, each proxy's index predicting what the engine then reports (less what the other proxy sent); a replica that loses its cache is
    heard (predicted above reported once) and the index is right again the turn after."""
    two = fleet[:2]
    for each in two:
        each.configure(prefix_cache_tokens=200_000)
    path = routes_file(tmp_path, {f"r{i}": f"{s.url}/v1" for i, s in enumerate(two)}, pick="predicted_ttft")
    proxies = [proxy_factory(routes=path), proxy_factory(routes=path)]
    clients = [openai.OpenAI(base_url=p.v1, api_key="sk-test", max_retries=0) for p in proxies]
    before = [s.stats() for s in two]
    conversations: list[list[Any]] = [[] for _ in range(4)]
    for session, messages in enumerate(conversations):
        for turn in range(4):  # (turn k through proxy k % 2)
            agent_turn(clients[turn % 2], messages, session)
    records = proxies[0].wait_records(8) + proxies[1].wait_records(8)
    places: dict[str, set[str]] = collections.defaultdict(set)
    for r in records:
        places[r["user"]].add(r["upstream"])
    assert len(records) == 16 and all(len(p) == 1 for p in places.values()), places
    after = [s.stats() for s in two]
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    assert cached / prompt > 0.6, (cached, prompt)
    for p in proxies:  # each proxy knows the turns it sent (every other one): it predicts less than is cached, never more
        predicted, reported = map(sum, zip(*(prefix_tokens(p, f"r{i}") for i in range(2))))
        assert reported > 5000 and 0.5 * reported < predicted <= reported, (predicted, reported)

    home = next(iter(places["session-0"]))
    two[int(home[1])].configure(prefix_cache_tokens=200_000)  # its cache lost (an engine restarted)
    was = prefix_tokens(proxies[0], home)
    agent_turn(clients[0], conversations[0], 0)
    proxies[0].wait_records(9)
    now = prefix_tokens(proxies[0], home)
    assert now[0] - was[0] > 3000 and now[1] - was[1] < 500, (was, now)  # predicted the conversation, the engine had nothing
    agent_turn(clients[0], conversations[0], 0)
    proxies[0].wait_records(10)
    last = prefix_tokens(proxies[0], home)
    assert abs((last[0] - now[0]) - (last[1] - now[1])) < 0.05 * (last[1] - now[1]), (now, last)  # right again


def test_a_proxy_new_to_a_conversation_finds_its_replica_after_one_stray(fleet, proxy_factory, tmp_path):
    """A conversation whose first turn went where its key does not rank first (through a proxy that routes to that
    replica alone), then resumed through a proxy that has never seen it: that proxy looks where the key ranks first,
    the engine reports none of the conversation cached there (one stray, counted), and from the next turn on the
    conversation goes where it lives, its first turn served from the cache there."""
    from proxy.fleet.picker import Picker
    from proxy.wire.prompt import chain

    two = fleet[:2]
    for each in two:
        each.configure(prefix_cache_tokens=200_000)
    system = {"role": "system", "content": "You are a coding agent." + prompt_of(2000)}
    for session in range(100):  # (one whose key ranks r0 first: its first turn goes to r1)
        first = chain({"messages": [system, {"role": "user", "content": f"session {session} turn 1:" + prompt_of(800)}]})
        assert first is not None
        if Picker._ranked([SimpleNamespace(label="r0"), SimpleNamespace(label="r1")], first.session)[0].label == "r0":  # type: ignore[list-item]
            break
    (tmp_path / "one").mkdir()
    alone = proxy_factory(routes=routes_file(tmp_path / "one", {"r1": f"{two[1].url}/v1"}))
    new = proxy_factory(routes=routes_file(tmp_path, {f"r{i}": f"{s.url}/v1" for i, s in enumerate(two)}, pick="predicted_ttft"))
    clients = [openai.OpenAI(base_url=p.v1, api_key="sk-test", max_retries=0) for p in (alone, new)]
    messages: list[Any] = [system]
    agent_turn(clients[0], messages, session)
    assert messages[1]["content"].startswith(f"session {session} turn 1:")  # (the turn the key was computed from)
    for through in (1, 1, 0, 1):
        agent_turn(clients[through], messages, session)
    records = sorted(new.wait_records(3), key=lambda r: r["received_unix_ns"])
    assert [r["upstream"] for r in records] == ["r0", "r1", "r1"], records
    assert records[0]["cached_prompt_tokens"] < 100 and records[1]["cached_prompt_tokens"] > 2500, records  # (the first turn's 2,800)
    sample = new.registry.get_sample_value
    assert sample("llmproxy_prefix_strays_total", {"upstream": "r0"}) == 1 and not sample("llmproxy_prefix_strays_total", {"upstream": "r1"})


def test_the_forecast_is_fitted_on_what_the_engine_prefilled(fleet, proxy_factory, tmp_path):
    """A replica serving an agent session from its prefix cache prefills only each turn's new part: its predicted
    TTFT for a 1,000-token prompt is that of 1,000 tokens at its prefill rate (5,000 tokens/s: 0.2 s), not the
    far lower figure a fit against the whole resent prompt would make."""
    fleet[0].configure(prefix_cache_tokens=200_000)
    proxy = proxy_factory(routes=routes_file(tmp_path, {"r0": f"{fleet[0].url}/v1"}))
    client, messages = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0), []
    for _ in range(8):
        agent_turn(client, messages, 0)
    proxy.wait_records(8)
    replicas = httpx.get(f"{proxy.url}/llmproxy/upstreams").json()
    predicted = next(r["predicted_ttft_s"] for r in replicas if r["upstream"] == "r0")
    assert predicted is not None and 0.12 <= predicted <= 0.35, predicted
