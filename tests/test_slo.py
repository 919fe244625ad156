"""Objectives and verdicts: the file refused with its line, each verdict and blame from explicit
records, then on real sockets from traffic whose cause of each miss is built in."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from proxy.measure import slo
from proxy.measure.slo import SLOs, Usual, blame, parse
from proxy.measure.timing import split

from test_timing import MS, streaming_record

GOOD_FILE = """
objectives:
  - name: interactive
    models: ["llama-*", "m"]
    ttft: 0.5
    tpot: 0.05
    e2e: 30
    target: 0.99
  - name: batch
    models: ["*"]
    e2e: 600
    target: 0.9
    window: 7d
"""


def test_a_good_file_parses_and_the_first_match_wins():
    objectives = parse(GOOD_FILE)
    assert [o.name for o in objectives] == ["interactive", "batch"]
    interactive, batch = objectives
    assert interactive.thresholds == {"ttft": 0.5, "tpot": 0.05, "e2e": 30.0} and interactive.window_s == 30 * 86400
    assert batch.thresholds == {"e2e": 600.0} and batch.window_s == 7 * 86400 and batch.budget == pytest.approx(0.1)
    slos = SLOs(objectives=objectives)
    assert slos.pick("llama-3-8b").name == "interactive" and slos.pick("m").name == "interactive"
    assert slos.pick("qwen").name == "batch"  # the glob of the second


@pytest.mark.parametrize("text, line, words", [
    ("objectives:\n  - name: a\n    models: [m]\n    target: 0.99\n", 2, "states none of ttft, tpot, e2e"),
    ("objectives:\n  - name: a\n    models: [m]\n    ttft: 0.5\n    target: 99\n", 2, "target"),
    ("objectives:\n  - name: a\n    models: [m]\n    ttft: -1\n    target: 0.9\n", 2, "ttft must be a positive number"),
    ("objectives:\n  - name: a\n    models: [m]\n    ttft: 1\n    target: 0.9\n  - name: b\n    model: [x]\n    ttft: 1\n    target: 0.9\n",
     6, "unknown keys ['model']"),
    ("objectives:\n  - name: a\n    models: []\n    ttft: 1\n    target: 0.9\n", 2, "needs `models`"),
    ("objectives:\n  - name: a\n    models: [m]\n    ttft: 1\n    target: 0.9\n  - name: a\n    models: [n]\n    ttft: 1\n    target: 0.9\n",
     6, "defined twice"),
    ("objectives:\n  - name: a\n    models: [m\n    ttft: 1\n", 4, ""),  # broken YAML: the line the parser stopped at
    ("objectives: {}\n", 1, "expected `objectives:`"),
    ("objectives:\n  - name: a\n    models: [m]\n    e2e: 1\n    target: 0.9\n    window: soon\n", 2, "window must be a duration"),
    ("objectives:\n  - name: a\n    tenants: []\n    e2e: 1\n    target: 0.9\n", 2, "tenants must be a non-empty list"),
    ("objectives:\n  - name: a\n    tenants: [t]\n    e2e: 1\n    target: 0.9\n    page_per_tenant: yes please\n", 2,
     "page_per_tenant must be true or false"),
])
def test_a_broken_file_is_refused_with_its_line(text, line, words):
    with pytest.raises(ValueError) as error:
        parse(text, "slo.yaml")
    assert f"slo file slo.yaml, line {line}" in str(error.value) and words in str(error.value)


def test_an_objective_selects_tenants_as_well_as_models():
    objectives = parse("objectives:\n  - name: search\n    tenants: ['search-*']\n    ttft: 1\n    target: 0.99\n    page_per_tenant: true\n"
                       "  - name: llama-search\n    models: [llama]\n    tenants: [search-eu]\n    ttft: 1\n    target: 0.99\n"
                       "  - name: rest\n    models: ['*']\n    e2e: 30\n    target: 0.9\n")
    search = objectives[0]
    assert search.models == ("*",) and search.tenants == ("search-*",) and search.page_per_tenant and not objectives[2].page_per_tenant
    slos = SLOs(objectives=objectives)
    assert slos.pick("llama", "search-eu").name == "search"  # the first that matches both
    assert slos.pick("llama", "batch").name == "rest" and slos.pick("qwen").name == "rest"  # (no tenant: `unknown`)
    t = streaming_record()
    t.status_code, t.tenant = 200, "search-us"
    assert judge(t, slos).slo == "search"


def judge(t, slos=None):
    slos = slos or SLOs(objectives=parse(GOOD_FILE))
    return slos.judge(t, split(t))


def test_a_request_meeting_every_objective_is_good():
    t = streaming_record()  # TTFT 210 ms, 3 tokens 10 ms apart, e2e 232 ms
    v = judge(t)
    assert (v.slo, v.good, v.missed, v.blame) == ("interactive", True, (), {})
    assert v.stated == ("ttft", "tpot", "e2e")


def test_tpot_is_measured_after_the_first_token_per_choice():
    t = streaming_record()
    t.content_ns = [210 * MS, 300 * MS, 390 * MS]  # 90 ms per token after the first
    t.upstream_end_ns, t.response_end_ns = 391 * MS, 392 * MS
    v = judge(t)
    assert v.good is False and v.missed == ("tpot",) and v.blame == {"tpot": "decode"}
    assert slo.tpot_s(t, split(t)) == pytest.approx((0.392 - 0.210) / 2)
    t.reasoning_tokens, t.completion_tokens = 10, 13  # hidden reasoning: in TTFT, not in TPOT's tokens
    assert slo.tpot_s(t, split(t)) == pytest.approx((0.392 - 0.210) / 2)


def test_a_ttft_miss_blames_the_phase_furthest_above_its_usual_value():
    slos = SLOs(objectives=parse(GOOD_FILE))
    for _ in range(5):
        assert judge(streaming_record(), slos).good  # prefill about 195 ms: the usual
    t = streaming_record()
    t.body_end_ns = 400 * MS  # a 400 ms upload, then the same request: TTFT 610 ms
    for name in ("issued_ns", "first_event_ns", "tcp_start_ns", "dns_start_ns", "dns_end_ns", "tcp_end_ns", "tls_start_ns",
                 "tls_end_ns", "headers_ns"):
        setattr(t, name, getattr(t, name) + 400 * MS)
    t.content_ns = [x + 400 * MS for x in t.content_ns]
    t.upstream_end_ns += 400 * MS
    t.response_end_ns += 400 * MS
    v = judge(t, slos)
    assert v.missed == ("ttft",) and v.blame == {"ttft": "client"}  # prefill (195 ms) is larger, but usual
    long_prefill = streaming_record()
    long_prefill.content_ns = [800 * MS, 810 * MS, 820 * MS]
    long_prefill.upstream_end_ns, long_prefill.response_end_ns = 821 * MS, 822 * MS
    assert judge(long_prefill, slos).blame == {"ttft": "prefill"}


def test_without_history_the_largest_phase_is_blamed():
    assert blame({"client": 0.1, "prefill": 0.9}, {}) == "prefill"
    assert blame({"client": 0.1, "prefill": 0.9}, {"client": 0.5, "prefill": 1.0}) == "prefill"  # none above usual: the largest
    assert blame({"client": 0.6, "prefill": 0.9}, {"client": 0.1, "prefill": 0.8}) == "client"


def test_failures_are_bad_with_their_outcome_but_a_client_mistake_is_not_judged():
    t = streaming_record()
    t.outcome, t.status_code = "upstream_error", 500
    assert (judge(t).good, judge(t).missed, judge(t).blame) == (False, ("error",), {"error": "upstream_error"})
    t.status_code = 429
    assert judge(t).good is False
    t.status_code = 400
    assert judge(t).good is None  # the client's own mistake
    t.outcome, t.status_code = "overloaded", 503
    assert judge(t).blame == {"error": "overloaded"}
    t.outcome, t.status_code = "timeout", 504
    assert judge(t).blame == {"error": "timeout"}


def test_a_client_that_leaves_is_judged_on_what_it_waited_through():
    waited = streaming_record()
    waited.content_ns, waited.upstream_end_ns, waited.response_end_ns = [], None, 700 * MS  # left after 700 ms, no token
    waited.outcome = "client_disconnect"
    v = judge(waited)
    assert v.good is False and v.missed == ("ttft",) and v.blame == {"ttft": "prefill"}  # the upstream's wait
    early = streaming_record()
    early.content_ns, early.upstream_end_ns, early.response_end_ns = [], None, 300 * MS
    early.outcome = "client_disconnect"
    assert judge(early).good is None  # left before the objective: not counted


def test_non_streaming_requests_are_judged_on_e2e_only_and_other_endpoints_not_at_all():
    t = streaming_record()
    t.stream, t.content_ns, t.endpoint = False, [], "chat"
    assert judge(t).good is True
    batch_only = SLOs(objectives=parse("objectives:\n  - name: s\n    models: ['*']\n    ttft: 0.1\n    target: 0.9\n"))
    assert judge(t, batch_only).good is None  # nothing stated can be measured without a stream
    t.endpoint = "embeddings"
    assert judge(t) is None
    t.endpoint, t.model = "chat", "unmatched"
    assert judge(t, batch_only) is not None and judge(t, SLOs(objectives=parse(GOOD_FILE)[:1])) is None


def test_usual_is_the_median_of_recent_good_requests():
    usual = Usual()
    for seconds in (0.1, 0.2, 0.3, 10.0, 0.2):
        usual.add(("m", "ttft"), {"prefill": seconds})
    assert usual.of(("m", "ttft")) == {"prefill": 0.2}
    for _ in range(slo.USUAL_WINDOW):
        usual.add(("m", "ttft"), {"prefill": 1.0})
    assert usual.of(("m", "ttft")) == {"prefill": 1.0}  # a window: the old ones are gone
    assert usual.of(("n", "ttft")) == {}


# --- on real sockets: the cause of each miss is built into the traffic ---

SLO_YAML = """
objectives:
  - name: interactive
    models: ["slo-*"]
    ttft: 0.25
    tpot: 0.03
    e2e: 4
    target: 0.99
"""
NORMAL = {"x-sim-ttft-ms": "20", "x-sim-decode-tps": "100"}


@pytest.fixture
def judged(tmp_path: Path, proxy_factory):
    path = tmp_path / "slo.yaml"
    path.write_text(SLO_YAML)
    return proxy_factory(slo=str(path))


def chat(server, headers=None, max_tokens=5, content="hi", stream=True):
    client = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0)
    if not stream:
        return client.chat.completions.create(model="slo-7b", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                                              extra_headers=headers or NORMAL)
    return [c for c in client.chat.completions.create(model="slo-7b", messages=[{"role": "user", "content": content}],
                                                      max_tokens=max_tokens, stream=True, extra_headers=headers or NORMAL)]


@pytest.mark.e2e
def test_each_miss_names_its_objective_and_the_cause_built_into_it(judged, sim):
    for _ in range(6):
        chat(judged)  # what the model's phases usually are
    records = judged.wait_records(6)
    assert [r["slo_good"] for r in records] == [True] * 6 and {r["slo"] for r in records} == {"interactive"}
    chat(judged, {"x-sim-decode-tps": "100"}, content=" the" * 2000)  # a long prompt: 2,000 tokens at 5,000 tok/s
    chat(judged, {**NORMAL, "x-sim-hidden-reasoning": "30"})  # 300 ms of hidden reasoning before the first token
    chat(judged, {"x-sim-ttft-ms": "20", "x-sim-decode-tps": "20"})  # 50 ms per token
    chat(judged, {**NORMAL, "x-sim-queue-ms": "400", "x-sim-vllm-metrics": "1"})  # the engine says it queued
    body = orjson.dumps({"model": "slo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})

    def slowly():
        yield body[:10]
        time.sleep(0.4)
        yield body[10:]

    with httpx.stream("POST", f"{judged.v1}/chat/completions", content=slowly(), headers={**NORMAL, "content-type": "application/json"}) as r:
        assert r.status_code == 200 and r.read()
    for status in ("500", "429", "400"):
        with pytest.raises(openai.APIStatusError):
            chat(judged, {**NORMAL, "x-sim-error-status": status})
    chat(judged, {**NORMAL, "x-sim-ttft-ms": "4500"}, stream=False)  # no stream: e2e only, and 4.5 s misses it
    records = judged.wait_records(15, timeout=10)[6:]  # (6 good, then 9: the 400 is recorded too)
    got = [(r["slo_good"], r["slo_missed"], r["slo_blame"]) for r in records]
    assert got == [
        (False, ["ttft"], {"ttft": "prefill"}),
        (False, ["ttft"], {"ttft": "reasoning"}),
        (False, ["tpot"], {"tpot": "decode"}),
        (False, ["ttft"], {"ttft": "queue"}),
        (False, ["ttft"], {"ttft": "client"}),
        (False, ["error"], {"error": "upstream_error"}),
        (False, ["error"], {"error": "upstream_error"}),  # a 429 is the service refusing
        (None, [], {}),  # a 400 is the client's own mistake
        (False, ["e2e"], {"e2e": "server"}),
    ], got
    labels = {"slo": "interactive", "model": "slo-7b", "upstream": judged.settings.upstream_label}
    assert judged.sample("llmproxy_slo_requests_total", {**labels, "result": "good"}) == 6
    assert judged.sample("llmproxy_slo_requests_total", {**labels, "result": "bad"}) == 8  # the 400 is not judged
    for objective, blamed, count in (("ttft", "prefill", 1), ("ttft", "reasoning", 1), ("ttft", "queue", 1), ("ttft", "client", 1),
                                     ("tpot", "decode", 1), ("error", "upstream_error", 2), ("e2e", "server", 1),
                                     ("ttft", "network", 0), ("error", "timeout", 0), ("e2e", "decode", 0)):  # the rest start at 0
        assert judged.sample("llmproxy_slo_misses_total", {**labels, "objective": objective, "blame": blamed}) == count, (objective, blamed)
    assert judged.sample("llmproxy_slo_target", {"slo": "interactive"}) == 0.99


@pytest.mark.e2e
def test_other_apis_are_judged_alike(judged):
    """The Responses API's typed events and Anthropic's Messages, each by its own SDK: the same verdicts."""
    import anthropic

    for _ in range(4):
        chat(judged)
    client = openai.OpenAI(base_url=judged.v1, api_key="k", max_retries=0)
    for _event in client.responses.create(model="slo-7b", input="hi", max_output_tokens=5, stream=True,
                                          extra_headers={**NORMAL, "x-sim-hidden-reasoning": "30"}):
        pass
    claude = anthropic.Anthropic(base_url=judged.url, api_key="k", max_retries=0)
    with claude.messages.stream(model="slo-7b", messages=[{"role": "user", "content": " the" * 2000}], max_tokens=5,
                                extra_headers={"x-sim-decode-tps": "100"}) as stream:
        stream.until_done()
    with claude.messages.stream(model="slo-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                extra_headers={"x-sim-ttft-ms": "20", "x-sim-decode-tps": "20"}) as stream:
        stream.until_done()
    records = judged.wait_records(7)[4:]
    assert [(r["api"], r["slo_missed"], r["slo_blame"]) for r in records] == [
        ("openai", ["ttft"], {"ttft": "reasoning"}), ("anthropic", ["ttft"], {"ttft": "prefill"}), ("anthropic", ["tpot"], {"tpot": "decode"})]


@pytest.mark.e2e
def test_a_client_that_gives_up_waiting_is_a_ttft_miss_and_one_that_leaves_sooner_is_not(judged):
    def leave_after(seconds: float) -> None:
        body = {"model": "slo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        try:
            httpx.post(f"{judged.v1}/chat/completions", json=body, headers={"x-sim-ttft-ms": "2000"}, timeout=seconds)
        except httpx.TimeoutException:
            pass

    leave_after(0.6)
    first = judged.last_record()
    leave_after(0.1)
    time.sleep(0.2)
    second = judged.last_record()
    assert first["outcome"] == second["outcome"] == "client_disconnect"
    assert (first["slo_good"], first["slo_missed"], first["slo_blame"]) == (False, ["ttft"], {"ttft": "prefill"})
    assert second["slo_good"] is None and second["duration_s"] < 0.25


@pytest.mark.e2e
def test_a_reload_changes_the_objectives_and_a_broken_one_keeps_the_old(tmp_path, judged):
    path = Path(judged.settings.slo)
    chat(judged, {"x-sim-ttft-ms": "100", "x-sim-decode-tps": "100"})
    assert judged.last_record()["slo_good"] is True
    path.write_text(SLO_YAML.replace("ttft: 0.25", "ttft: 0.05"))
    judged.app.reload()
    chat(judged, {"x-sim-ttft-ms": "100", "x-sim-decode-tps": "100"})
    assert judged.last_record()["slo_missed"] == ["ttft"]
    path.write_text("objectives:\n  - name: broken\n")
    judged.app.reload()  # refused (logged): the last good objectives keep serving
    chat(judged, {"x-sim-ttft-ms": "100", "x-sim-decode-tps": "100"})
    assert judged.last_record()["slo_missed"] == ["ttft"] and judged.app.slos.objectives[0].ttft == 0.05


@pytest.mark.e2e
def test_a_broken_file_is_refused_at_start(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "slo.yaml"
    path.write_text("objectives:\n  - name: a\n    models: [m]\n    ttft: 0.5\n    target: 1.5\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--slo", str(path), "--port", "1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"slo file {path}, line 2" in done.stderr and "target" in done.stderr
