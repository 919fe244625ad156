"""Fair admission per tenant (admission.py): the rules on the class itself, then on real sockets
with the official client: a tenant within its share is never refused while another bursts, weights
split a saturated cap, the queue waits at most --admission-queue-s and serves tenants fairly."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.serve.admission import Admission
from proxy.upstream.limits import worker_cap
from proxy.config import Settings
from proxy.errors import ProxyOverloaded
from proxy.serve.tenants import fingerprint, parse
from proxy.measure.timing import NS, RequestTiming, split
from servers import scraped


def admission(cap: int, queue_s: float = 0.0, **weights: float) -> Admission:
    return Admission(cap, queue_s, lambda tenant: weights.get(tenant, 1.0))


def test_a_tenant_alone_may_use_the_whole_cap_and_one_under_its_share_is_admitted_past_it():
    a = admission(4)
    assert all(a.try_enter("bulk") for _ in range(4))  # work-conserving: nothing reserved for an idle tenant
    assert not a.try_enter("bulk")  # at the cap, over its share (4 of 4 while alone)
    assert a.try_enter("chat") and a.try_enter("chat")  # chat's share is 2 of 4: admitted past the cap
    assert not a.try_enter("chat")  # its share held: now it is chat that is refused
    assert not a.try_enter("bulk") and a.in_flight == 6
    for _ in range(3):
        a.leave("bulk")
    assert a.try_enter("bulk")  # 3 in flight: under the cap, anyone
    assert not a.try_enter("bulk") and a.held == {"bulk": 2, "chat": 2}  # at the cap again, bulk at its share


def test_below_the_cap_anyone_is_admitted():
    a = admission(4)
    assert a.try_enter("bulk") and a.try_enter("bulk") and a.try_enter("bulk")
    assert a.try_enter("bulk")  # 3 < 4: borrowing what nobody uses
    a.leave("bulk")
    assert a.try_enter("chat") and a.held == {"bulk": 3, "chat": 1}


def test_shares_follow_the_weights_and_the_active_tenants():
    a = admission(8, a=3.0, b=1.0)
    assert a.share("a") == 8 and a.share("b") == 8  # each alone
    a.try_enter("b")
    assert a.share("a") == 6 and a.share("b") == 8  # a's if it came now; b alone so far
    a.try_enter("a")
    assert a.share("a") == 6 and a.share("b") == 2
    assert admission(32).share("x") == 32 and admission(2).share("x") == 2
    many = admission(4)
    for tenant in "abcdefgh":
        many.try_enter(tenant)
    assert many.share("z") == 1  # at least one request each


def test_worker_caps_add_up_to_the_proxy_s():
    assert worker_cap(Settings(max_in_flight=32, workers=1)) == 32
    assert worker_cap(Settings(max_in_flight=32, workers=3)) == 10  # 30 in all: never more than was set
    assert worker_cap(Settings(max_in_flight=2, workers=4)) == 1
    assert worker_cap(Settings(max_in_flight=0, workers=4)) == 0


def test_no_queue_refuses_at_once_and_the_queue_times_out_with_its_own_reason():
    async def scenario() -> None:
        a = admission(1)
        assert a.try_enter("x")
        with pytest.raises(ProxyOverloaded) as refused:
            await a.wait("x")
        assert refused.value.reason == "max_in_flight"
        q = admission(1, queue_s=0.2)
        assert q.try_enter("x") and not q.try_enter("x")
        start = time.monotonic()
        with pytest.raises(ProxyOverloaded) as timed_out:
            await q.wait("x")
        assert timed_out.value.reason == "queue_timeout" and 0.19 < time.monotonic() - start < 0.5
        assert q.queues == {} and q.in_flight == 1  # the waiter left its queue

    asyncio.run(scenario())


def test_freed_slots_go_to_the_tenant_with_the_fewest_in_flight_not_first_come():
    async def scenario() -> list[str]:
        a = admission(2, queue_s=5.0)
        assert a.try_enter("a") and a.try_enter("b")  # each at its share (1 of 2)
        granted: list[str] = []

        async def one(tenant: str) -> None:
            assert not a.try_enter(tenant)  # at the cap, at its share: it waits
            await a.wait(tenant)
            granted.append(tenant)

        tasks = [asyncio.create_task(one("a")) for _ in range(4)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("b")) for _ in range(4)]  # b's come after all of a's
        await asyncio.sleep(0)
        assert a.queued() == {"a": 4, "b": 4}
        holders = ["a", "b"]  # each request ends in the order it was admitted
        for _ in range(8):
            a.leave(holders.pop(0))
            await asyncio.sleep(0)
            holders.append(granted[-1])
        await asyncio.gather(*tasks)
        return granted

    granted = asyncio.run(scenario())
    assert granted == ["a", "b"] * 4  # first come would be a a a a b b b b


def test_a_waiter_cancelled_as_it_was_granted_gives_its_slot_back():
    async def scenario() -> None:
        a = admission(1, queue_s=5.0)
        assert a.try_enter("a")
        waiting = asyncio.create_task(a.wait("a"))
        await asyncio.sleep(0)
        a.leave("a")  # granted: the slot is the waiter's
        waiting.cancel()  # ... and its client went before it ran
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert a.in_flight == 0 and a.held == {} and a.queues == {}

    asyncio.run(scenario())


def test_weights_split_a_saturated_cap_with_the_queue():
    """Two tenants each with far more demand than the cap, weights 3:1: the slots held split 3:1."""
    async def scenario() -> float:
        a = admission(8, queue_s=30.0, a=3.0, b=1.0)
        rng = random.Random(7)
        held: list[str] = []
        samples: list[float] = []

        async def client(tenant: str) -> None:
            while True:
                if not a.try_enter(tenant):
                    await a.wait(tenant)
                held.append(tenant)
                await asyncio.sleep(rng.uniform(0.001, 0.004))
                held.remove(tenant)
                a.leave(tenant)

        tasks = [asyncio.create_task(client(t)) for t in ["a"] * 20 + ["b"] * 20]
        for _ in range(200):
            await asyncio.sleep(0.002)
            if a.held:
                samples.append(a.held.get("a", 0) / sum(a.held.values()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return sum(samples) / len(samples)

    share = asyncio.run(scenario())
    assert 0.675 <= share <= 0.825, share  # 3:1 is 0.75; within 10%


def test_the_tenants_file_takes_weights_and_refuses_bad_ones():
    config = parse("tenants:\n  - name: chat\n    keys: ['sha256:0123456789abcdef']\n    weight: 3\n"
                   "  - header: {name: x-team, values: [a, b]}\n    weight: 0.5\nweights: {unknown: 2}\n")
    assert config.weights == {"chat": 3.0, "a": 0.5, "b": 0.5, "unknown": 2.0}
    for bad, said in (("  - name: chat\n    keys: ['sha256:0123456789abcdef']\n    weight: 0\n", "line 2"),
                      ("  - name: chat\n    keys: ['sha256:0123456789abcdef']\n    weight: yes\n", "a weight is a number"),
                      ("  - header: {name: x-t, values: any}\n    weight: 2\n", "weights: {other: W}")):
        with pytest.raises(ValueError, match=said):
            parse("tenants:\n" + bad)
    with pytest.raises(ValueError, match="weights must be"):
        parse("tenants: []\nweights: {chat: 2}\n")


def test_the_admission_wait_is_the_phase_wait_never_the_proxy_s_or_the_server_s():
    t = RequestTiming(received_ns=0, body_end_ns=1_000_000, queued_ns=500_000, admitted_ns=301_000_000)
    t.issued_ns = t.first_event_ns = 302_000_000
    t.headers_ns, t.content_ns, t.content_choice = 400_000_000, [500_000_000, 600_000_000], [0, 0]
    t.upstream_end_ns = t.response_end_ns = 600_000_000
    t.first_sent_ns = 500_000_000
    b = split(t)
    assert b.phases["wait"] == pytest.approx(0.3005)  # all of it: the body's last 0.5 ms came in the wait (the proxy's)
    assert b.phases["client"] == pytest.approx(0.0005) and b.phases["proxy"] == pytest.approx(0.001)
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s)
    refused = RequestTiming(received_ns=0, body_end_ns=1_000_000, queued_ns=1_000_000, admitted_ns=201_000_000, response_end_ns=202 * NS // 1000)
    r = split(refused)
    assert r.phases["wait"] == pytest.approx(0.2) and r.phases["proxy"] == pytest.approx(0.001)
    # A large body: the server reads 64 KB of it, then none until it is admitted, so its end comes after the wait.
    # The whole wait is `wait`; the client's upload is what is left (2 ms before it, 10 ms after).
    big = RequestTiming(received_ns=0, queued_ns=2_000_000, admitted_ns=302_000_000, body_end_ns=312_000_000)
    big.body_seen_ns = 312_000_000
    big.issued_ns = big.first_event_ns = 313_000_000
    big.headers_ns, big.content_ns, big.content_choice = 400_000_000, [500_000_000, 600_000_000], [0, 0]
    big.upstream_end_ns = big.response_end_ns = big.first_sent_ns = 600_000_000
    big.first_sent_ns = 500_000_000
    g = split(big)
    assert g.phases["wait"] == pytest.approx(0.300) and g.phases["client"] == pytest.approx(0.012)
    assert g.phases["proxy"] == pytest.approx(0.001) and sum(g.phases.values()) == pytest.approx(g.e2e_s)


# --- on real sockets, with the official client -----------------------------------------------

KEYS = {"chat": "sk-chat-0001", "bulk": "sk-bulk-0002"}


def tenants_file(tmp_path: Path, weights: dict[str, float] | None = None) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - name: {name}\n    keys: ['{fingerprint(key)}']\n"
                                         + (f"    weight: {weights[name]}\n" if weights and name in weights else "")
                                         for name, key in KEYS.items()))
    return str(path)


def stream(client: openai.OpenAI, tokens: int, tps: int) -> float:
    """One streamed answer to its end; its TTFT at the client."""
    start = time.monotonic()
    first = None
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                                max_tokens=tokens, extra_headers={"x-sim-decode-tps": str(tps)}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
    assert first is not None
    return first


@pytest.mark.e2e
def test_a_burst_from_one_tenant_never_refuses_another_within_its_share(proxy_factory, tmp_path):
    proxy = proxy_factory(max_in_flight=8, tenants=tenants_file(tmp_path))
    chat = openai.OpenAI(base_url=proxy.v1, api_key=KEYS["chat"], max_retries=0)
    bulk = openai.OpenAI(base_url=proxy.v1, api_key=KEYS["bulk"], max_retries=0)
    stop = threading.Event()
    chat_results: list[Any] = []

    def chat_user() -> None:  # an interactive app: 2 streams in flight, one after another
        while not stop.is_set():
            try:
                chat_results.append(stream(chat, 10, 100))
            except openai.APIStatusError as exc:
                chat_results.append(exc)

    users = [threading.Thread(target=chat_user) for _ in range(2)]
    for user in users:
        user.start()
    time.sleep(0.5)
    bulk_results: list[Any] = []

    def bulk_one() -> None:
        try:
            bulk_results.append(stream(bulk, 40, 40))  # 1 s each
        except openai.APIStatusError as exc:
            bulk_results.append(exc)

    burst = [threading.Thread(target=bulk_one) for _ in range(30)]
    for each in burst:
        each.start()
    for each in burst:
        each.join()
    stop.set()
    for user in users:
        user.join()
    refused = [r for r in bulk_results if isinstance(r, openai.APIStatusError)]
    answered = len(bulk_results) - len(refused)
    assert not [r for r in chat_results if isinstance(r, Exception)] and len(chat_results) > 10  # chat: none refused
    assert 5 <= answered <= 8, answered  # bulk: every slot chat left (8 - the 0-2 it had in flight), but one kept for its next request
    assert all(r.status_code == 503 and r.body["code"] == "proxy_overloaded" and r.response.headers["retry-after"] == "1" for r in refused)
    assert scraped(proxy.url, "llmproxy_requests_rejected_total", tenant="bulk", reason="max_in_flight") == len(refused)
    assert scraped(proxy.url, "llmproxy_requests_rejected_total", tenant="chat") == 0
    assert proxy.app.admission.in_flight == 0 and proxy.app.admission.held == {}


@pytest.mark.e2e
def test_the_queue_waits_at_most_its_seconds_and_the_wait_is_in_the_record(proxy_factory, tmp_path):
    proxy = proxy_factory(max_in_flight=1, admission_queue_s=0.3, tenants=tenants_file(tmp_path))
    bulk = openai.OpenAI(base_url=proxy.v1, api_key=KEYS["bulk"], max_retries=0)
    chat = openai.OpenAI(base_url=proxy.v1, api_key=KEYS["chat"], max_retries=0)
    holder = threading.Thread(target=stream, args=(bulk, 60, 40))  # 1.5 s, holding the one slot
    holder.start()
    time.sleep(0.3)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as timed_out:
        bulk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    waited = time.monotonic() - start
    assert timed_out.value.status_code == 503 and "--admission-queue-s" in timed_out.value.body["message"]
    assert timed_out.value.response.headers["retry-after"] == "1" and 0.29 < waited < 0.6
    assert stream(chat, 5, 100) < 0.5  # chat, under its share, is not queued behind bulk's stream
    holder.join()
    # A wait that ends in a slot: bulk's second stream waits for its first (0.5 s) to end.
    first = threading.Thread(target=stream, args=(bulk, 20, 40))
    proxy.app.admission.queue_s = 3.0
    first.start()
    time.sleep(0.1)
    ttft = stream(bulk, 5, 100)
    first.join()
    assert 0.3 < ttft < 0.9
    records = proxy.wait_records(5)
    refused = [r for r in records if r["outcome"] == "overloaded"]
    assert len(refused) == 1 and refused[0]["error"] == "proxy_overloaded:queue_timeout"
    assert refused[0]["phases_s"]["wait"] == pytest.approx(0.3, abs=0.05)
    waited_ok = max((r for r in records if r["outcome"] == "ok"), key=lambda r: r["phases_s"].get("wait", 0.0))
    assert waited_ok["phases_s"]["wait"] == pytest.approx(ttft, abs=0.1) and waited_ok["phases_s"]["wait"] > 0.25
    assert scraped(proxy.url, "llmproxy_requests_rejected_total", tenant="bulk", reason="queue_timeout") == 1
    assert scraped(proxy.url, "llmproxy_admission_wait_seconds_count", tenant="bulk") == 2
    # `explain --by tenant`: each tenant's refusals and waits, from the rollup.
    deadline = time.monotonic() + 10
    while not proxy.app.telemetry.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    proxy.app.telemetry.records_sink.store.flush()
    command = [sys.executable, "-m", "proxy", "explain", "--db", proxy.settings.records_db, "--by", "tenant"]
    report = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, check=True).stdout)
    assert report["bulk"]["admission"]["refused"] == 1 and report["chat"]["admission"]["refused"] == 0
    assert report["bulk"]["admission"]["wait_s_mean"] == pytest.approx(waited_ok["phases_s"]["wait"] / 3, abs=0.02)  # one of its three ok waited
    assert "admission: 1 refused by the proxy" in subprocess.run(command, capture_output=True, text=True, check=True).stdout
    # An agent-sized body (600 KB: the server stops reading it past 64 KB) that waits for its slot: its wait is `wait`,
    # not the client's upload, although its end was read only once admitted.
    first = threading.Thread(target=stream, args=(bulk, 20, 40))
    first.start()
    time.sleep(0.1)
    big = [{"role": "user", "content": "word " * 120_000}]
    bulk.chat.completions.create(model="m", messages=big, max_tokens=2, extra_headers={"x-sim-ttft-ms": "50"})  # (not 120,000 tokens' prefill)
    first.join()
    record = max(proxy.wait_records(7), key=lambda r: r["prompt_tokens"] or 0)
    assert record["prompt_tokens"] > 100_000 and record["phases_s"]["wait"] > 0.25 and record["phases_s"]["client"] < 0.1, record["phases_s"]
