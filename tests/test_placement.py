"""A route's retries on real sockets (proxy/placement.py): a replica stuck after its headers, one that
answers 503, one that refuses connections, one that breaks after its first tokens, and every replica
slow at once (the retry budget); the official openai client on the other side."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import pytest
import yaml

from servers import RawUpstream, Simulator
from proxy.demo import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEADLINE, HEALTHY_TTFT = 0.5, 0.1


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Simulator]]:
    healthy, stuck = Simulator(), Simulator()
    stuck.configure(stall_after=0)  # its headers and role chunk, then nothing (until the proxy leaves)
    try:
        yield {"healthy": healthy, "stuck": stuck}
    finally:
        healthy.proc.stop()
        stuck.proc.stop()


def routes_file(tmp_path: Any, upstreams: dict[str, str], **route: Any) -> str:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{"name": n, "url": u} for n, u in upstreams.items()],
                                    "routes": [{"models": ["sim-7b"], "upstreams": list(upstreams), **route}]}))
    return str(path)


def stream(proxy: Any, tokens: int = 20, headers: dict[str, str] | None = None) -> tuple[float, str, int]:
    """(client TTFT, the text, content chunks) of one streamed chat completion."""
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    began = time.perf_counter()
    first, text, chunks = None, "", 0
    for chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=tokens, stream=True,
                                                extra_headers={"x-sim-ttft-ms": str(int(HEALTHY_TTFT * 1000)), **(headers or {})}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - began
            text += chunk.choices[0].delta.content
            chunks += 1
    assert first is not None
    return first, text, chunks


def failovers(proxy: Any, upstream: str, reason: str) -> float:
    return proxy.registry.get_sample_value("llmproxy_failovers_total", {"model": "sim-7b", "upstream": upstream, "reason": reason}) or 0.0


def test_a_stuck_replica_fails_over_within_the_deadline_and_is_let_go(pair, proxy_factory, tmp_path):
    healthy, stuck = pair["healthy"], pair["stuck"]
    # fewest_in_flight: with nothing in flight the two take turns, so some requests meet the stuck one first.
    path = routes_file(tmp_path, {"stuck": f"{stuck.url}/v1", "healthy": f"{healthy.url}/v1"}, first_token_deadline=DEADLINE, retries=1,
                       retry_budget={"ratio": 1.0, "min_per_second": 100})
    proxy = proxy_factory(routes=path)
    direct = "".join(c.choices[0].delta.content or "" for c in openai.OpenAI(base_url=f"{healthy.url}/v1", api_key="x").chat.completions.create(
        model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True) if c.choices)
    disconnects = stuck.stats()["disconnects"]
    results = []
    for _ in range(10):
        results.append(stream(proxy))
        results[-1] += (proxy.last_record(),)
    moved = 0
    for ttft, text, chunks, r in results:
        assert text == direct and chunks == 20  # every token exactly once: nothing of the stuck attempt reached the client
        assert r["upstream"] == "healthy" and sum(r["phases_s"].values()) == pytest.approx(r["duration_s"], abs=1e-6)
        assert r["phases_s"]["prefill"] == pytest.approx(HEALTHY_TTFT, abs=0.03)
        if not r["attempts"]:  # it met the healthy replica first
            assert ttft <= HEALTHY_TTFT + 0.05 and "failover" not in r["phases_s"]
            continue
        moved += 1
        assert DEADLINE <= ttft <= DEADLINE + HEALTHY_TTFT + 0.05, ttft  # the deadline, then the healthy replica's own TTFT
        (abandoned, served) = r["attempts"]
        assert (abandoned["upstream"], abandoned["abandoned"], served["upstream"], served["abandoned"]) == ("stuck", "deadline", "healthy", None)
        assert abandoned["duration_s"] == pytest.approx(DEADLINE, abs=0.02)
        assert r["phases_s"]["failover"] == pytest.approx(DEADLINE, abs=0.02)  # its own part of TTFT, not prefill
    assert moved >= 3 and failovers(proxy, "stuck", "deadline") == moved
    scrape = httpx.get(f"{proxy.url}/metrics").text  # each replica's predicted TTFT, once it has enough requests of its own
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
                       retry_budget={"ratio": 1.0, "min_per_second": 100})
    proxy = proxy_factory(routes=path, read_timeout=1.0)
    requests = stuck.stats()["requests"], healthy.stats()["requests"]
    client = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    got = []
    with pytest.raises(openai.APIError):  # the stream breaks, as it would directly
        for chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True,
                                                    extra_headers={"x-sim-stall-after": "3"}):
            got.append(chunk)
    record = proxy.last_record()
    assert record["attempts"] == [] and record["outcome"] == "timeout" and record["content_chunks"] == 3
    assert (stuck.stats()["requests"] - requests[0]) + (healthy.stats()["requests"] - requests[1]) == 1  # sent once, to one replica
    assert not any(failovers(proxy, u, "deadline") for u in ("stuck", "healthy"))


def test_a_503_and_a_refused_connection_go_to_the_next_replica(sim, proxy_factory, tmp_path):
    failing = RawUpstream([b'{"error": {"message": "overloaded"}}'], content_type="application/json", chunked=False, status=503)
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({
        "upstreams": [{"name": "failing", "url": failing.url}, {"name": "closed", "url": closed}, {"name": "sim", "url": f"{sim.url}/v1"}],
        "routes": [{"models": ["sim-7b"], "upstreams": ["failing", "closed", "sim"], "retries": 2}]}))  # (no deadline: nothing held)
    proxy = proxy_factory(routes=str(path))
    seen = set()
    for _ in range(6):  # (the three take turns being first)
        ttft, text, chunks = stream(proxy, tokens=5)
        record = proxy.last_record()
        assert chunks == 5 and record["outcome"] == "ok" and record["status_code"] == 200 and record["upstream"] == "sim"
        if record["attempts"]:
            assert record["attempts"][-1]["upstream"] == "sim"
        seen |= {(a["upstream"], a["abandoned"]) for a in record["attempts"][:-1]}
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
    (0.5 a second over 10 s, plus 10% of the route's requests), and every request is still answered."""
    healthy = pair["healthy"]
    other = Simulator()
    try:
        path = routes_file(tmp_path, {"one": f"{healthy.url}/v1", "two": f"{other.url}/v1"}, first_token_deadline=0.2, retries=1,
                           retry_budget={"ratio": 0.1, "min_per_second": 0.5, "window": 10})
        proxy = proxy_factory(routes=path)
        with ThreadPoolExecutor(40) as pool:
            results = list(pool.map(lambda _: stream(proxy, tokens=3, headers={"x-sim-ttft-ms": "800"}), range(40)))
        assert all(chunks == 3 for _, _, chunks in results)
        records = proxy.wait_records(40)
        retried = sum(1 for r in records if r["attempts"])
        total = sum(failovers(proxy, u, "deadline") for u in ("one", "two"))
        assert total == retried and 1 <= retried <= 0.5 * 10 + 0.1 * 40, retried  # never more than the budget
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
    assert proxy.last_record()["attempts"] == [] and stuck.stats()["requests"] + healthy.stats()["requests"] == before + 1


def test_a_held_stream_reaches_the_client_whole_whatever_its_shape(pair, proxy_factory, tmp_path):
    """On a deadline route, what comes before the first token is held, then sent with it: keep-alive comments,
    the role chunk, the Responses API's and Anthropic's typed events before their first delta, all of it."""
    import anthropic

    healthy = pair["healthy"]
    path = routes_file(tmp_path, {"healthy": f"{healthy.url}/v1"}, first_token_deadline=2.0, retries=1)
    proxy = proxy_factory(routes=path)
    slow_start = {"x-sim-ttft-ms": "300", "x-sim-keepalive-ms": "50"}
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
    assert all(r["attempts"] == [] and r["outcome"] == "ok" and r["ttft_s"] >= 0.3 for r in records[-3:])
