"""Metrics from one finished request, read back from a fresh registry."""
import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.measure import cpu
from proxy.measure.labels import ModelLabels, served
from proxy.measure.metrics import METRICS, ProxyMetrics
from proxy.measure.timing import split

from test_timing import streaming_record

UP = "127.0.0.1:8000"


def cgroup_v1(folder: Path, quota_us: int) -> cpu.Cgroup:
    """A cgroup v1 cpu controller's files, as the kernel writes them."""
    (folder / "cpu.stat").write_text("nr_periods 120\nnr_throttled 30\nthrottled_time 2500000000\n")
    (folder / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    return cpu.Cgroup(folder / "cpu.stat", v2=False)


def observed():
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    t = streaming_record()
    t.status_code = 200
    metrics.observe(t, split(t), UP, trace_id="0af7651916cd43dd8448eb211c80319c")
    return registry, metrics


def test_request_counter_and_histograms():
    registry, _ = observed()
    base = {"model": "m", "upstream": UP, "endpoint": "chat", "stream": "true"}
    tenanted = {**base, "tenant": "unknown"}
    assert registry.get_sample_value("llmproxy_requests_total", {**tenanted, "api": "other", "outcome": "ok", "code": "200"}) == 1
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_sum", tenanted) == pytest.approx(0.210)
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_bucket", {**tenanted, "le": "0.2"}) == 0
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_bucket", {**tenanted, "le": "0.5"}) == 1
    assert registry.get_sample_value("llmproxy_decode_tokens_per_second_sum", tenanted) == pytest.approx(100.0)
    assert registry.get_sample_value("llmproxy_inter_token_latency_seconds_count", base) == 2
    assert registry.get_sample_value("llmproxy_phase_seconds_total", {**base, "phase": "prefill"}) == pytest.approx(0.2)
    assert registry.get_sample_value("llmproxy_proxy_overhead_seconds_count", {"upstream": UP, "endpoint": "chat", "stream": "true"}) == 1
    assert registry.get_sample_value("llmproxy_upstream_connect_seconds_count", {"upstream": UP, "step": "tls"}) == 1
    assert registry.get_sample_value("llmproxy_upstream_connections_total", {"upstream": UP, "reused": "false"}) == 1
    assert registry.get_sample_value("llmproxy_tokens_total", {"model": "m", "upstream": UP, "kind": "prompt", "source": "usage"}) == 1000
    assert registry.get_sample_value("llmproxy_tokenize_seconds_count", {"model": "m", "kind": "prompt"}) == 1


def test_alert_thresholds_are_bucket_bounds():
    """Each alert compares a quantile with a threshold: a bound there makes the comparison exact."""
    buckets = {d.name: d.buckets for d in METRICS}
    assert 20.0 in buckets["llmproxy_decode_tokens_per_second"]  # LLMDecodeSpeedLow: p50 < 20 tok/s
    assert 5.0 in buckets["llmproxy_time_to_first_token_seconds"]  # LLMTimeToFirstTokenHigh: p95 > 5 s
    assert 0.01 in buckets["llmproxy_proxy_overhead_seconds"]  # LLMProxyOverheadHigh: p99 > 10 ms
    assert buckets["llmproxy_proxy_overhead_seconds"][0] <= 0.0001 and buckets["llmproxy_request_duration_seconds"][-1] >= 300


def test_model_labels_are_capped():
    cap = ModelLabels(2)
    assert [cap(m) for m in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]
    sets = ModelLabels(100, max_sets=3)
    chosen = [sets.label_set(m, "u", e, "true", "t")[0] for m, e in (("a", "chat"), ("a", "messages"), ("b", "chat"), ("b", "messages"), ("a", "chat"))]
    assert chosen == ["a", "a", "b", "other", "a"]  # the fourth set is over the budget; known sets keep their model


def test_no_client_crowds_the_configured_models_out():
    """A client sending 100 junk names first: the names the configuration knows (its routes', its objectives') are
    kept whatever came before; a name the upstream refused (its 404, the proxy's own for a model it does not route)
    takes no place; a served one does."""
    cap = ModelLabels(100)
    cap.know(("llama-3-8b", "qwen3-8b"))
    refused = [cap(f"junk-{i}", served(404)) for i in range(100)]
    assert set(refused) == {"other"}
    assert [cap("llama-3-8b", served(500)), cap("qwen3-8b", served(200)), cap("new-model", served(200)), cap("busy", served(429))] == [
        "llama-3-8b", "qwen3-8b", "new-model", "busy"]  # (a 429 is overload: the model exists)
    for i in range(98):
        cap(f"served-{i}", True)
    assert cap("one-too-many", True) == "other" and cap("llama-3-8b", True) == "llama-3-8b"  # past the cap, the known ones still


def test_past_the_budget_the_model_folds_first_then_the_tenant():
    sets = ModelLabels(100, max_sets=32)  # (a reserve of 2 sets of model `other` that keep their tenant)
    for i in range(32):
        assert sets.label_set(f"m{i}", "u", "chat", "true", "t0") == (f"m{i}", "u", "chat", "true", "t0")
    assert sets.label_set("late", "u", "chat", "true", "t1") == ("other", "u", "chat", "true", "t1")
    assert sets.label_set("late", "u", "chat", "true", "t2") == ("other", "u", "chat", "true", "t2")
    assert sets.label_set("late", "u", "chat", "true", "t3") == ("other", "u", "chat", "true", "other")  # the reserve is spent
    assert sets.label_set("later", "u", "chat", "true", "t1") == ("other", "u", "chat", "true", "t1")  # a reserved set stays
    sets.forget({"t0"})  # t0's series expired: its sets count no more
    assert sets.label_set("new", "u", "chat", "true", "t3") == ("new", "u", "chat", "true", "t3")


def test_a_tenant_that_stopped_sending_has_its_series_removed():
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry, tenant_expiry_s=3600)
    for tenant in ("gone", "stays"):
        t = streaming_record()
        t.status_code, t.tenant = 200, tenant
        metrics.observe(t, split(t), UP)
    labels = {"model": "m", "upstream": UP, "endpoint": "chat", "stream": "true", "api": "other", "outcome": "ok", "code": "200"}
    ttft = {k: labels[k] for k in ("model", "upstream", "endpoint", "stream")}
    assert metrics.expire_tenants() == []  # both sent within the hour
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_count", {**ttft, "tenant": "gone"}) == 1
    metrics._tenant_seen["gone"] -= 3601  # (its last request, an hour and a second ago)
    assert metrics.expire_tenants() == ["gone"]
    assert registry.get_sample_value("llmproxy_requests_total", {**labels, "tenant": "gone"}) is None
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_count", {**ttft, "tenant": "gone"}) is None
    assert registry.get_sample_value("llmproxy_requests_total", {**labels, "tenant": "stays"}) == 1
    assert registry.get_sample_value("llmproxy_phase_seconds_total", {**ttft, "phase": "prefill"}) is not None  # (no tenant label: untouched)
    t = streaming_record()  # it comes back: its series are new ones, on the scrape again, from 0
    t.status_code, t.tenant = 200, "gone"
    metrics.observe(t, split(t), UP)
    assert registry.get_sample_value("llmproxy_requests_total", {**labels, "tenant": "gone"}) == 1
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_count", {**ttft, "tenant": "gone"}) == 1
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_count", {**ttft, "tenant": "stays"}) == 1


def test_openmetrics_exposition_carries_the_trace_id_exemplar():
    _, metrics = observed()
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert re.search(rb'llmproxy_time_to_first_token_seconds_bucket\{.*\} 1.0 # \{trace_id="0af7651916cd43dd8448eb211c80319c"\}', body)


def test_every_defined_metric_is_exposed_with_its_name(tmp_path):
    registry, metrics = observed()
    metrics.cpu.cgroup = cgroup_v1(tmp_path, quota_us=50_000)  # (the kernel's figures: a cgroup with a quota has them all)
    metrics.telemetry_error("tracing")
    metrics.in_flight(UP).inc()
    body, _ = metrics.render("text/plain")
    for d in METRICS:
        assert f"# TYPE {d.exposed} {d.kind}\n".encode() in body, d.name


@pytest.mark.e2e
def test_series_at_the_model_cap(proxy_factory, tmp_path):
    """100 models through every API the proxy measures (chat, completions, Responses, Anthropic
    Messages, Gemini, Ollama chat, streaming and not; embeddings; Azure's chat path) on the real proxy: one scrape stays
    under 20,000 series and 3 MB (the label-set budget folds what exceeds it into model="other"),
    with no _created series and engine-only children only where an engine reported (Ollama). Every
    model is judged against an SLO stating all three objectives (its series at their most: 2 results
    and every blame of ttft, tpot, e2e and error, per set, for SLO_SETS sets and `other`). And the
    requests come from 50 tenants, 20 of them named in the --tenants file, each from its own end
    user: the tenant label holds the 20 and `other`, no end user is a label, the bounds hold."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.scale import scrape

    from proxy.measure.metrics import BLAMES, SLO_SETS

    objectives = tmp_path / "slo.yaml"
    objectives.write_text("objectives:\n  - name: all\n    models: ['*']\n    ttft: 0.5\n    tpot: 0.05\n    e2e: 30\n    target: 0.99\n")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(scrape.tenants_file(20))
    proxy = proxy_factory(slo=str(objectives), tenants=str(tenants))

    assert scrape.fill_to_the_cap(proxy.url, tenants=50) == 1500
    body = httpx.get(f"{proxy.url}/metrics").content
    series = scrape.series(body)
    assert 15_000 < series <= 20_000, series  # the lower bound: the 400 label sets really are there
    assert len(body) <= 3_000_000
    assert b"_created" not in body
    engine = [line for line in body.splitlines() if line.startswith(b"llmproxy_engine_")]
    assert engine and all(b'endpoint="ollama_chat"' in line for line in engine)  # only where an engine reported its timings (Ollama)
    requests = [line for line in body.splitlines() if line.startswith(b"llmproxy_requests_total{")]
    assert all(b'outcome="ok"' in line for line in requests)
    named = {re.search(rb'model="([^"]+)"', line).group(1) for line in requests} - {b"other"}
    assert 25 <= len(named) < 100 and any(b'model="other"' in line for line in requests)
    endpoints = {re.search(rb'endpoint="([^"]+)"', line).group(1) for line in requests}
    assert endpoints == {b"chat", b"completions", b"embeddings", b"responses", b"messages", b"generate_content", b"ollama_chat"}
    slo = [line for line in body.splitlines() if line.startswith((b"llmproxy_slo_requests_total{", b"llmproxy_slo_misses_total{"))]
    sets = SLO_SETS + SLO_SETS // 16 + 1  # the budget, the reserve for model `other` by tenant, then `other` for both
    assert len(slo) == sets * (2 + sum(map(len, BLAMES.values()))), len(slo)  # every set at its most
    assert sum(float(line.rsplit(b" ", 1)[1]) for line in requests) == 1500  # every request counted, named or not
    labels = set(re.findall(rb'tenant="([^"]*)"', body))
    assert labels == {b"tenant-%02d" % i for i in range(20)} | {b"other", b"unknown"}, labels  # (unknown: its refusal series, from 0)
    assert b"user-" not in body and b"user=" not in body

def test_a_requests_series_are_as_bounded_as_its_label_sets():
    """series.py keeps one holder of children per label set: 100 models from 3 tenants past a budget of 32 sets
    make no more holders than sets (the folded ones: model `other`, then tenant `other` too)."""
    metrics = ProxyMetrics(CollectorRegistry(), max_models=100, max_label_sets=32)
    for i in range(100):
        for tenant in ("a", "b", "c"):
            t = streaming_record()
            t.status_code, t.tenant, t.model = 200, tenant, f"m{i}"
            metrics.observe(t, split(t), UP)
    assert len(metrics._series) <= 32 + 32 // 16 + 1


@pytest.mark.e2e
def test_an_idle_proxy_is_scraped_with_nothing_in_flight_not_absent(proxy):
    """Before its first request the proxy exposes its in-flight gauge at 0: `LLMProxyMetricsAbsent`
    (absent(llmproxy_requests_in_flight)) is for a proxy nobody scrapes, never one nobody has called yet."""
    text = httpx.get(f"{proxy.url}/metrics").text
    assert f'llmproxy_requests_in_flight{{upstream="{proxy.settings.upstream_label}"}} 0.0' in text, text[:2000]
