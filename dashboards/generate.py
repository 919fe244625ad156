"""Generates dashboards/grafana/llm-latency-breakdown.json with grafana-foundation-sdk.

    .venv/bin/python dashboards/generate.py          # rewrite the committed JSON
    .venv/bin/python dashboards/generate.py --check  # exit 1 if the committed JSON differs

Every query uses only metric names from proxy/measure/metrics.py (a test checks it), and every panel
query runs against a real Prometheus in the test suite.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, DataTransformerConfig, GridPos, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).resolve().parent / "grafana" / "llm-latency-breakdown.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'upstream=~"$upstream", model=~"$model", endpoint=~"$endpoint"'
SEL_T = SEL + ', tenant=~"$tenant"'  # the families with a tenant label (requests, TTFT, decode tok/s, e2e, SLO counters)
SEL_MODEL = 'upstream=~"$upstream", model=~"$model"'
UP = 'upstream=~"$upstream"'
SLO = 'slo=~"$slo", upstream=~"$upstream", model=~"$model", tenant=~"$tenant"'
RI = "$__rate_interval"

LATENCY_VS_THROUGHPUT = (
    "Per-request decode speed (what one user feels) next to aggregate output tokens per second "
    "(what the server produces for everyone). Decode is memory-bandwidth bound: each step reads the "
    "weights and KV cache once, so batching many requests multiplies aggregate throughput while each "
    "stream stays at roughly 50-150 tok/s. The two differ by about the batch size: an order of "
    "magnitude under load. Slow responses are a per-request problem; look at the left series."
)


# What to look at first, per alert: the dashboard panel (a title build() makes), `explain` and the
# /ui filter (page filters: api, model, upstream, outcome). Written into rules.yml as each alert's
# `first_look` annotation; a test checks every title, flag and filter exists.
PANEL_PHASES = "Mean seconds per request, by phase"
PANEL_DECODE = "Decode speed: per request vs aggregate"
PANEL_OUTCOMES = "Requests by outcome and code"
PANEL_OVERHEAD = "Proxy's own overhead (phase proxy)"
PANEL_SHED = "Shed load: 503 proxy_overloaded, by reason"
PANEL_FDS = "Open descriptors vs the limit"
PANEL_TELEMETRY = "Telemetry errors"
PANEL_POOL = "The proxy's own upstream pool"
PANEL_CPU = "The proxy's own CPU: throttling and event-loop lag"
ROW_SLO = "Service-level objectives"
PANEL_SLO_MISSES = "SLO misses by blamed phase"
PANEL_TENANT_BUDGET = "Budget spent by tenant"
PANEL_ADMISSION = "Admission by tenant: in flight and waiting"
PANEL_REPLICAS = "Replicas set aside"
MODEL = "{{ $labels.model }}"
UPSTREAM = "{{ $labels.upstream }}"
INSTANCE = "{{ $labels.instance }}"
FIRST_LOOK: dict[str, tuple[str, str, str]] = {  # alert: (panel, explain arguments, /ui query) ("" = none)
    "LLMDecodeSpeedLow": (PANEL_DECODE, f"--model {MODEL} --since 1h", f"model={MODEL}&upstream={UPSTREAM}"),
    "LLMDecodeSpeedDropped": (PANEL_DECODE, f"--model {MODEL} --since 1d", f"model={MODEL}&upstream={UPSTREAM}"),
    "LLMTimeToFirstTokenHigh": (PANEL_PHASES, f"--model {MODEL} --since 1h", f"model={MODEL}&upstream={UPSTREAM}"),
    "LLMUpstreamErrorRateHigh": (PANEL_OUTCOMES, "--since 1h", f"upstream={UPSTREAM}&outcome=upstream_error"),
    "LLMProxyOverheadHigh": (PANEL_OVERHEAD, "--since 1h", f"upstream={UPSTREAM}"),
    "LLMProxySaturated": (PANEL_SHED, "", "outcome=overloaded"),
    "LLMProxyDescriptorsNearLimit": (PANEL_FDS, "", "outcome=overloaded"),
    "LLMProxyUpstreamPoolFull": (PANEL_POOL, "", f"upstream={UPSTREAM}"),
    "LLMProxyRecordsMaintenanceFailing": (PANEL_TELEMETRY, "", ""),
    "LLMProxyDown": (PANEL_OUTCOMES, "", ""),
    "LLMProxyMetricsAbsent": ("", "", ""),
}


def q(expr: str, legend: str, ref: str, instant: bool = False, fmt: str | None = None) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    if instant:
        target = target.instant().format(PromQueryFormat(fmt or "table"))
    elif fmt:
        target = target.format(PromQueryFormat(fmt))
    return target


def quantiles(metric: str, sel: str, by: str = "le") -> list[prometheus.Dataquery]:
    return [q(f"histogram_quantile({p}, sum by ({by}) (rate({metric}_bucket{{{sel}}}[{RI}])))", f"p{int(p * 100)}", chr(65 + i))
            for i, p in enumerate((0.5, 0.95, 0.99))]


def ts(title: str, unit: str, targets: list[prometheus.Dataquery], x: int, y: int, w: int = 12, h: int = 8,
       description: str = "", stack: StackingMode | None = None) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DS).grid_pos(GridPos(h=h, w=w, x=x, y=y))
    panel = panel.legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM).show_legend(True))
    if description:
        panel = panel.description(description)
    if stack is not None:
        panel = panel.stacking(StackingConfig().mode(stack)).fill_opacity(60)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def build() -> dict:
    d = (
        Dashboard("LLM latency breakdown")
        .uid("llm-latency-breakdown")
        .description("Where each successful LLM request's time goes, measured by llm-latency-proxy: client upload, proxy, the proxy's own wait, network, tokenize, queue, hidden reasoning, prefill, decode.")
        .tags(["llm", "latency", "llm-latency-proxy"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for name, source in (("upstream", "llmproxy_requests_total, upstream"),
                         ("model", 'llmproxy_requests_total{upstream=~"$upstream"}, model'),
                         ("endpoint", 'llmproxy_requests_total{upstream=~"$upstream"}, endpoint'),
                         ("tenant", 'llmproxy_requests_total{upstream=~"$upstream"}, tenant'),
                         ("slo", "llmproxy_slo_target, slo")):
        d = d.with_variable(QueryVariable(name).label(name.capitalize()).datasource(DS).query(f"label_values({source})")
                            .multi(True).include_all(True).all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))

    per_request = f"scalar(sum(rate(llmproxy_request_duration_seconds_count{{{SEL}}}[{RI}])))"
    d = d.with_row(Row("Where the time goes"))
    d = d.with_panel(ts(PANEL_PHASES, "s", [
        q(f"sum by (phase) (rate(llmproxy_phase_seconds_total{{{SEL}}}[{RI}])) / {per_request}", "{{phase}}", "A")], 0, 1,
        description=("Stacked, successful requests: the phases sum to the mean end-to-end duration. decode dominates short prompts; "
                     "prefill dominates very long ones. client is the client's own upload; reasoning is a reasoning model's hidden "
                     "reasoning (an estimate: hidden tokens / the request's decode rate). Failed requests are on 'Requests by outcome and code'."),
        stack=StackingMode.NORMAL))
    d = d.with_panel(ts("Share of total time, by phase", "percentunit", [
        q(f"sum by (phase) (rate(llmproxy_phase_seconds_total{{{SEL}}}[{RI}])) / scalar(sum(rate(llmproxy_request_duration_seconds_sum{{{SEL}}}[{RI}])))", "{{phase}}", "A")],
        12, 1, stack=StackingMode.NORMAL))

    d = d.with_row(Row("Latency"))
    d = d.with_panel(ts("Time to first token", "s", quantiles("llmproxy_time_to_first_token_seconds", SEL_T), 0, 10))
    d = d.with_panel(ts("End-to-end duration", "s", quantiles("llmproxy_request_duration_seconds", SEL_T), 12, 10))

    d = d.with_row(Row("Latency vs throughput"))
    d = d.with_panel(ts(PANEL_DECODE, "short", [
        q(f"histogram_quantile(0.5, sum by (le) (rate(llmproxy_decode_tokens_per_second_bucket{{{SEL_T}}}[{RI}])))", "per request p50 (tok/s)", "A"),
        q(f"histogram_quantile(0.1, sum by (le) (rate(llmproxy_decode_tokens_per_second_bucket{{{SEL_T}}}[{RI}])))", "per request p10 (tok/s)", "B"),
        q(f'sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="completion"}}[{RI}]))', "aggregate output (tok/s)", "C"),
    ], 0, 19, w=24, description=LATENCY_VS_THROUGHPUT))
    itl = (heatmap.Panel().title("Inter-token latency").datasource(DS).grid_pos(GridPos(h=8, w=8, x=0, y=27)).unit("s")
           .with_target(q(f"sum by (le) (increase(llmproxy_inter_token_latency_seconds_bucket{{{SEL}}}[{RI}]))", "{{le}}", "A", fmt="heatmap"))
           .description("Gap between consecutive content chunks divided by the tokens in the later chunk."))
    d = d.with_panel(itl)
    d = d.with_panel(ts("Inter-chunk gap vs inter-token latency", "s", [
        q(f"sum(rate(llmproxy_inter_chunk_latency_seconds_sum{{{SEL}}}[{RI}])) / sum(rate(llmproxy_inter_chunk_latency_seconds_count{{{SEL}}}[{RI}]))", "chunk gap mean", "A"),
        q(f"sum(rate(llmproxy_inter_token_latency_seconds_sum{{{SEL}}}[{RI}])) / sum(rate(llmproxy_inter_token_latency_seconds_count{{{SEL}}}[{RI}]))", "per token mean", "B"),
        q(f"histogram_quantile(0.99, sum by (le) (rate(llmproxy_inter_token_latency_seconds_bucket{{{SEL}}}[{RI}])))", "per token p99", "C"),
    ], 8, 27, w=8, description="Means are equal when the engine streams one token per chunk; a chunk gap larger than the token latency means several tokens per chunk. The p99 shows stalls."))
    d = d.with_panel(ts("Prefill tokens per second, per request", "short", [
        q(f"histogram_quantile(0.5, sum by (le) (rate(llmproxy_prefill_tokens_per_second_bucket{{{SEL}}}[{RI}])))", "p50", "A"),
        q(f"histogram_quantile(0.1, sum by (le) (rate(llmproxy_prefill_tokens_per_second_bucket{{{SEL}}}[{RI}])))", "p10", "B"),
    ], 16, 27, w=8))

    d = d.with_row(Row("Network"))
    d = d.with_panel(ts("Upstream connect time by step (new connections)", "s", [
        q(f"sum by (step) (rate(llmproxy_upstream_connect_seconds_sum{{{UP}}}[{RI}])) / sum by (step) (rate(llmproxy_upstream_connect_seconds_count{{{UP}}}[{RI}]))", "{{step}} mean", "A")],
        0, 36, w=8))
    d = d.with_panel(ts("Connection reuse ratio", "percentunit", [
        q(f'sum(rate(llmproxy_upstream_connections_total{{{UP}, reused="true"}}[{RI}])) / sum(rate(llmproxy_upstream_connections_total{{{UP}}}[{RI}]))', "reused", "A")],
        8, 36, w=8))
    d = d.with_panel(ts("Upstream RTT (kernel smoothed)", "s", quantiles("llmproxy_upstream_rtt_seconds", UP)[:3:2], 16, 36, w=8))

    d = d.with_row(Row("Tokenizer"))
    d = d.with_panel(ts("Tokenizer seconds per request", "s", [
        q(f'sum by (kind) (rate(llmproxy_tokenize_seconds_sum{{model=~"$model"}}[{RI}])) / sum by (kind) (rate(llmproxy_tokenize_seconds_count{{model=~"$model"}}[{RI}]))', "{{kind}}", "A")],
        0, 45, w=8))
    d = d.with_panel(ts("Tokenizer microseconds per prompt token", "µs", [
        q(f'1e6 * sum(rate(llmproxy_tokenize_seconds_sum{{model=~"$model", kind="prompt"}}[{RI}])) / sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="prompt"}}[{RI}]))', "µs per token", "A")],
        8, 45, w=8))
    d = d.with_panel(ts("Prompt cache and hidden reasoning", "percentunit", [
        q(f'sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="cached_prompt"}}[{RI}])) / sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="prompt"}}[{RI}]))', "prompt tokens from cache", "A"),
        q(f'sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="reasoning"}}[{RI}])) / sum(rate(llmproxy_tokens_total{{{SEL_MODEL}, kind="completion"}}[{RI}]))', "completion tokens hidden (reasoning)", "B")],
        16, 45, w=8, description="Prefill works on uncached prompt tokens only; hidden reasoning tokens are generated before the first visible token and never streamed."))

    d = d.with_row(Row("Requests and the proxy itself"))
    d = d.with_panel(ts(PANEL_OUTCOMES, "reqps", [
        q(f"sum by (outcome, code) (rate(llmproxy_requests_total{{{SEL_T}}}[{RI}]))", "{{outcome}} {{code}}", "A")], 0, 54, w=8))
    d = d.with_panel(stat.Panel().title("In flight").datasource(DS).grid_pos(GridPos(h=8, w=4, x=8, y=54))
                     .with_target(q(f"sum(llmproxy_requests_in_flight{{{UP}}})", "in flight", "A")))
    d = d.with_panel(ts(PANEL_OVERHEAD, "s", quantiles("llmproxy_proxy_overhead_seconds", 'upstream=~"$upstream", endpoint=~"$endpoint"')[::2], 12, 54, w=6,
                        description="Not by model: the proxy's own time does not depend on it."))
    d = d.with_panel(ts(PANEL_TELEMETRY, "short", [
        q(f"sum by (component) (rate(llmproxy_telemetry_errors_total[{RI}]))", "{{component}}", "A"),
        q(f"sum by (step) (rate(llmproxy_records_maintenance_errors_total[{RI}]))", "records maintenance: {{step}}", "B")], 18, 54, w=6,
        description="Failures inside metrics, tracing, tokenizer or records, and failed passes of the records store's maintenance by step. "
                    "Requests were unaffected, but numbers may be missing."))

    d = d.with_panel(ts(PANEL_SHED, "reqps", [
        q(f"sum by (reason) (rate(llmproxy_requests_rejected_total{{{UP}}}[{RI}]))", "rejected: {{reason}}", "A"),
        q(f"sum by (reason) (rate(llmproxy_accept_pauses_total[{RI}]))", "accept paused: {{reason}}", "B"),
        q("sum(llmproxy_requests_in_flight) / sum(llmproxy_max_in_flight > 0)", "in flight / --max-in-flight (all replicas)", "C")], 0, 62, w=6,
        description="Requests the proxy refused itself (never the upstream's fault): max_in_flight is admission control "
                    "(--max-in-flight), descriptors/ports/memory are exhaustion while accepting or connecting. Accept pauses: "
                    "the listener waited 50 ms for a free descriptor while clients queued in the listen backlog."))
    d = d.with_panel(ts(PANEL_FDS, "short", [
        q("sum by (instance) (llmproxy_open_fds)", "open {{instance}}", "A"),
        q("sum by (instance) (llmproxy_max_fds)", "limit {{instance}}", "B")], 6, 62, w=6,
        description="Each request holds a client and an upstream socket. The proxy raises its soft RLIMIT_NOFILE to the hard one at start; "
                    "near the limit, new requests get 503 proxy_overloaded (reason descriptors)."))
    d = d.with_panel(ts("Requests by API", "reqps", [
        q(f"sum by (api, endpoint) (rate(llmproxy_requests_total{{{SEL_T}}}[{RI}]))", "{{api}} {{endpoint}}", "A")], 12, 62, w=6,
        description="Which wire API the applications call: openai (chat, completions, embeddings, responses), azure (the same "
                    "operations on Azure OpenAI's paths), anthropic (messages), other (any other path, relayed untimed). Every "
                    "latency panel above measures them with the same definitions; filter by endpoint (messages is Anthropic's)."))
    d = d.with_panel(ts("Relayed but not measured, by reason", "reqps", [
        q(f"sum by (reason) (rate(llmproxy_unmeasured_requests_total{{{UP}}}[{RI}]))", "{{reason}}", "A")], 18, 62, w=6,
        description="Requests whose response went to the client whole but could not be read: event_too_large (a streamed event "
                    "past --max-event-bytes: the rest of that stream was relayed unframed), undecodable (a content-encoding the "
                    "proxy could not decode). Their latency split is missing, never wrong."))
    d = d.with_panel(ts(PANEL_POOL, "short", [
        q(f"sum by (upstream, state) (llmproxy_upstream_pool_connections{{{UP}}})", "{{upstream}} {{state}}", "A"),
        q(f"sum by (upstream) (llmproxy_upstream_pool_limit{{{UP}}})", "{{upstream}} limit", "B"),
        q(f"sum by (upstream, result) (rate(llmproxy_upstream_pool_waits_total{{{UP}}}[{RI}]))", "{{upstream}} found it full: {{result}} /s", "C")],
        0, 70, w=12,
        description="The proxy's own connections to each upstream: lent to requests (in_use), kept for reuse (idle), and the pool's "
                    "size (--max-connections, else --max-in-flight, else what the open files limit holds). Requests that found it "
                    "full waited (the phase wait, the proxy's own, never network) or got 503 proxy_overloaded (reason pool)."))
    d = d.with_panel(ts(PANEL_CPU, "s", [
        q(f"sum by (instance) (rate(llmproxy_process_cpu_throttled_seconds_total[{RI}]))", "throttled s/s {{instance}}", "A"),
        q(f"histogram_quantile(0.99, sum by (le) (rate(llmproxy_event_loop_lag_seconds_bucket[{RI}])))", "event loop lag p99", "B"),
        q(f'sum(rate(llmproxy_phase_seconds_total{{{SEL}, phase="lag"}}[{RI}])) / sum(rate(llmproxy_request_duration_seconds_count{{{SEL}}}[{RI}]))',
          "mean lag per request (phase lag)", "C")], 12, 70, w=12,
        description="Whether the proxy itself is short of CPU. Throttled: seconds per second its cgroup (the pod) was stopped "
                    "for its CPU limit (every process: serving, records, tokenizer). Event loop lag: how late its loop ran a "
                    "timer (every stream waited that long). Phase lag: a request's bytes that had arrived, waiting for the "
                    "loop; the engine's phases stay true (the kernel's arrival stamps). Any of them high: LLMProxySaturated."))

    d = d.with_row(Row("Per model"))
    per_model = (
        table.Panel().title("Per model").datasource(DS).grid_pos(GridPos(h=8, w=24, x=0, y=79))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True}}))
        .with_target(q(f"sum by (model) (increase(llmproxy_requests_total{{{SEL_T}}}[$__range]))", "requests", "A", instant=True))
        .with_target(q(f"histogram_quantile(0.95, sum by (model, le) (rate(llmproxy_time_to_first_token_seconds_bucket{{{SEL_T}}}[$__range])))", "ttft p95", "B", instant=True))
        .with_target(q(f"histogram_quantile(0.5, sum by (model, le) (rate(llmproxy_decode_tokens_per_second_bucket{{{SEL_T}}}[$__range])))", "decode p50", "C", instant=True))
        .with_target(q(f'sum by (model) (increase(llmproxy_tokens_total{{{SEL_MODEL}, kind="prompt"}}[$__range]))', "tokens in", "D", instant=True))
        .with_target(q(f'sum by (model) (increase(llmproxy_tokens_total{{{SEL_MODEL}, kind="completion"}}[$__range]))', "tokens out", "E", instant=True))
    )
    d = d.with_panel(per_model)

    # Service-level objectives (--slo): exact good/bad counts, so ratios are exact, not bucket estimates.
    good, judged = f'llmproxy_slo_requests_total{{{SLO}, result="good"}}', f"llmproxy_slo_requests_total{{{SLO}}}"
    bad = f'llmproxy_slo_requests_total{{{SLO}, result="bad"}}'
    budget = '1 - max by (slo) (llmproxy_slo_target{slo=~"$slo"})'
    ratio = lambda metric, window: f"sum by (slo) (rate({metric}[{window}])) / sum by (slo) (rate({judged}[{window}]))"  # noqa: E731
    d = d.with_row(Row(ROW_SLO))
    d = d.with_panel(ts("SLO attainment vs target", "percentunit", [
        q(ratio(good, "1h"), "{{slo}} attainment (1h)", "A"),
        q('max by (slo) (llmproxy_slo_target{slo=~"$slo"})', "{{slo}} target", "B")], 0, 88, w=8,
        description="The share of judged generation requests that met every stated objective of their SLO (TTFT, TPOT, e2e), "
                    "over the last hour, against the SLO's target."))
    d = d.with_panel(stat.Panel().title("Error budget left (selected range)").datasource(DS).grid_pos(GridPos(h=8, w=4, x=8, y=88))
                     .unit("percentunit").description("1 - the bad share over the dashboard's time range / the budget (1 - target). "
                                                      "Set the range to the SLO window (30 days by default); below 0: overspent.")
                     .with_target(q(f"1 - (sum by (slo) (increase({bad}[$__range])) / sum by (slo) (increase({judged}[$__range]))) / ({budget})",
                                    "{{slo}}", "A", instant=True, fmt="time_series")))
    d = d.with_panel(ts("Burn rate (1 h and 6 h)", "short", [
        q(f"({ratio(bad, '1h')}) / ({budget})", "{{slo}} 1h", "A"),
        q(f"({ratio(bad, '6h')}) / ({budget})", "{{slo}} 6h", "B")], 12, 88, w=6,
        description="The bad share divided by the budget: 1 spends the budget exactly over the SLO window. The page alert "
                    "(LLMSLOBudgetBurn) needs 14.4 over 1 h (and 5 m) or 6 over 6 h (and 30 m)."))
    d = d.with_panel(ts("Goodput vs throughput", "reqps", [
        q(f"sum by (slo) (rate({good}[{RI}]))", "{{slo}} goodput", "A"),
        q(f"sum by (slo) (rate({judged}[{RI}]))", "{{slo}} judged requests", "B")], 18, 88, w=6,
        description="Goodput (DistServe, vLLM's --goodput): requests per second that met every objective; beside it, every "
                    "judged request per second."))
    d = d.with_panel(ts(PANEL_SLO_MISSES, "reqps", [
        q(f"sum by (slo, objective, blame) (rate(llmproxy_slo_misses_total{{{SLO}}}[{RI}]))", "{{slo}} {{objective}}: {{blame}}", "A")],
        0, 96, w=24, stack=StackingMode.NORMAL,
        description="Which phase broke each miss: for ttft (and e2e) the phase furthest above its usual value for the model "
                    "(its median over recent good requests), for tpot decode, for error the outcome. Queue: the engine is "
                    "saturated; prefill: long prompts; reasoning: hidden reasoning; client: slow uploads."))
    # Whose traffic spends each budget: a tenant's bad requests over all of its objective's judged requests (every
    # tenant's) and the budget, so the tenants' lines stack up to the objective's own burn rate.
    everyone = 'llmproxy_slo_requests_total{slo=~"$slo", upstream=~"$upstream", model=~"$model"}'
    share = lambda window: (f"sum by (slo, tenant) (rate({bad}[{window}])) / on (slo) group_left () "  # noqa: E731
                            f"(sum by (slo) (rate({everyone}[{window}])) * ({budget}))")
    d = d.with_panel(ts(PANEL_TENANT_BUDGET, "short", [q(share("1h"), "{{slo}}: {{tenant}}", "A")], 0, 104, w=16, stack=StackingMode.NORMAL,
        description="Each tenant's part of its objective's burn rate over the last hour (--tenants: the tenants the file names, "
                    "unknown, and other for the rest): its bad requests / all of the objective's judged requests / the budget "
                    "(1 - target). Stacked, the tenants add up to the objective's burn rate (1: the budget spent exactly over its "
                    "window). `llm-latency-proxy explain --by tenant` says what each one's misses were blamed on."))
    d = d.with_panel(table.Panel().title("Requests and TTFT by tenant (selected range)").datasource(DS).grid_pos(GridPos(h=8, w=8, x=16, y=104))
                     .with_transformation(DataTransformerConfig(id_val="merge", options={}))
                     .with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True}}))
                     .with_target(q(f"sum by (tenant) (increase(llmproxy_requests_total{{{SEL_T}}}[$__range]))", "requests", "A", instant=True))
                     .with_target(q(f"histogram_quantile(0.95, sum by (tenant, le) (rate(llmproxy_time_to_first_token_seconds_bucket{{{SEL_T}}}[$__range])))",
                                    "ttft p95", "B", instant=True)))
    # Admission by tenant (admission.py): each tenant's use of --max-in-flight, what it waited for a slot, what was refused.
    TEN = 'tenant=~"$tenant"'
    d = d.with_panel(ts(PANEL_ADMISSION, "short", [
        q(f"sum by (tenant) (llmproxy_admission_in_flight{{{TEN}}})", "{{tenant}} in flight", "A"),
        q(f"sum by (tenant) (llmproxy_admission_queued{{{TEN}}})", "{{tenant}} waiting", "B"),
        q(f"sum(llmproxy_max_in_flight{{{UP}}})", "--max-in-flight", "C")], 0, 112, w=8,
        description="Requests admitted and in flight, and waiting for a slot (--admission-queue-s), per tenant, against the cap "
                    "(over every instance). At the cap each tenant in flight or waiting has a share, its weight over theirs: one "
                    "under its share is still admitted, one over it waits or is refused. Below the cap anyone may use it all."))
    d = d.with_panel(ts("Refused by the proxy, by tenant", "reqps", [
        q(f"sum by (tenant, reason) (rate(llmproxy_requests_rejected_total{{{UP}, {TEN}}}[{RI}]))", "{{tenant}}: {{reason}}", "A")],
        8, 112, w=8,
        description="503 proxy_overloaded, by tenant and reason: max_in_flight (at the cap, the tenant at or over its share), "
                    "queue_timeout (it waited --admission-queue-s), pool, descriptors, ports, memory. A tenant within its share "
                    "should have none of the first two."))
    d = d.with_panel(ts("Waiting for a slot, by tenant", "short", [
        q(f"sum by (tenant) (rate(llmproxy_admission_wait_seconds_sum{{{TEN}}}[{RI}]))", "{{tenant}}", "A")], 16, 112, w=8,
        description="Seconds waited for a slot per second (the mean number of that tenant's requests waiting): the phase wait "
                    "that admission added. `llm-latency-proxy explain --by tenant` gives each tenant's refusals and mean wait."))

    # Each replica's health (routes file `ejection:`) and what failing over cost: never charged to the replica that served.
    d = d.with_row(Row("Replicas"))
    d = d.with_panel(ts(PANEL_REPLICAS, "short", [
        q(f'sum by (upstream, state) (llmproxy_upstream_state{{{UP}, state!="serving"}})', "{{upstream}} {{state}}", "A"),
        q(f"sum by (upstream, reason) (increase(llmproxy_upstream_ejections_total{{{UP}}}[{RI}]))", "{{upstream}} ejected: {{reason}}", "B")],
        0, 121, w=8,
        description="A: per replica, how many proxy instances have it set aside now (ejected: for failing, its next request after "
                    "its time is up is a probe; probing: that probe in flight). B: ejections by reason: consecutive_failures, "
                    "failure_share, retry_after (it answered 429 or 503 with Retry-After), probe_failed (set aside again, for longer)."))
    d = d.with_panel(ts("Failovers, by the replica abandoned", "reqps", [
        q(f"sum by (upstream, reason) (rate(llmproxy_failovers_total{{{UP}}}[{RI}]))", "{{upstream}}: {{reason}} /s", "A"),
        q(f'sum by (upstream) (rate(llmproxy_phase_seconds_total{{{UP}, phase="failover"}}[{RI}]))', "{{upstream}}: seconds lost /s", "B")],
        8, 121, w=8,
        description="Attempts abandoned for another replica (connect_error, broken, status_5xx, status_429, deadline) and the time "
                    "they cost their requests (the phase failover), charged to the replica abandoned; the replica that then served "
                    "is charged its own TTFT only."))
    d = d.with_panel(ts("Predicted TTFT of a 1,000-token prompt", "s", [
        q(f"max by (upstream) (llmproxy_upstream_predicted_ttft_seconds{{{UP}}})", "{{upstream}}", "A")], 16, 121, w=8,
        description="Each replica's server time to first token predicted from its own recent answers and its pending prompt work "
                    "(pick: predicted_ttft places by it; the worst proxy instance's view)."))

    # Each replica's prefix cache as the engine reports it, and the proxy's index of it (prefix.py) checked against that.
    d = d.with_row(Row("Prefix cache"))
    d = d.with_panel(ts("Prompt tokens served from the prefix cache", "percentunit", [
        q(f'sum by (upstream) (rate(llmproxy_tokens_total{{{UP}, kind="cached_prompt"}}[{RI}])) / '
          f'sum by (upstream) (rate(llmproxy_tokens_total{{{UP}, kind="prompt"}}[{RI}]))', "{{upstream}}", "A")], 0, 130, w=12,
        description="Per replica: the share of prompt tokens its engine reported cached (prompt_tokens_details.cached_tokens, "
                    "cache_read_input_tokens, llama.cpp's cache_n): prefill it did not do. With pick: predicted_ttft, each "
                    "conversation goes where its prefix is; a share falling while the traffic is the same: sessions moved, or the "
                    "cache evicts."))
    d = d.with_panel(ts("Prefix index: predicted over reported cached tokens", "short", [
        q(f"sum by (upstream) (rate(llmproxy_prefix_predicted_tokens_total{{{UP}}}[{RI}])) / "
          f"sum by (upstream) (rate(llmproxy_prefix_reported_tokens_total{{{UP}}}[{RI}]))", "{{upstream}}", "A")], 12, 130, w=12,
        description="How right each proxy's index of a replica's prefix cache is (pick: predicted_ttft), on the requests whose "
                    "engine reported its cached tokens: 1 is exact; above 1 the engine evicted what the index still holds (the "
                    "index shrinks to follow); below 1 the replica had more than this proxy sent it (other proxies' requests)."))
    d = d.with_panel(ts("Prefix strays: turns prefilled whole where their conversation was not", "reqps", [
        q(f"sum by (upstream) (rate(llmproxy_prefix_strays_total{{{UP}}}[{RI}]))", "{{upstream}}", "A")], 0, 138, w=24,
        description="Turns of a conversation this proxy had not seen on their replica (another proxy's, or from before a restart) "
                    "that the engine reported none of cached: each a whole prefill. A proxy new to a conversation looks for it on "
                    "the two replicas its key ranks first, so a few after a restart or a scale-out are expected; a steady rate "
                    "means the proxies disagree on where conversations live (docs/deployment.md: session affinity)."))
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


RULES = Path(__file__).resolve().parent / "prometheus" / "rules.yml"
SLO_EXAMPLE = Path(__file__).resolve().parent / "prometheus" / "slo.yml"  # the example objectives
SLO_RULES = Path(__file__).resolve().parent / "prometheus" / "slo-rules.yml"
SLO_IN_POD = "/etc/llm-latency-proxy/slo.yaml"  # where deploy/kubernetes mounts the objectives
KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
HEADER = "# Generated by dashboards/generate.py from {source}: edit that file, then run make dashboards.\n"


def prometheus_rule() -> str:
    """The Prometheus Operator's PrometheusRule, from the one rules file (its groups, unchanged)."""
    import yaml

    groups = yaml.safe_load(with_first_looks(RULES.read_text()))["groups"]
    resource = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": "llm-latency-proxy", "labels": {"prometheus": "k8s", "role": "alert-rules"}},
                "spec": {"groups": groups}}
    return HEADER.format(source="dashboards/prometheus/rules.yml") + yaml.safe_dump(resource, sort_keys=False, width=200)


def dashboard_configmap(dashboard: str) -> str:
    """The dashboard as a ConfigMap that Grafana's sidecar loads (label grafana_dashboard: "1")."""
    import yaml

    resource = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "llm-latency-proxy-dashboard", "labels": {"grafana_dashboard": "1"}},
                "data": {"llm-latency-breakdown.json": dashboard}}
    return HEADER.format(source="dashboards/generate.py") + yaml.safe_dump(resource, sort_keys=False, width=200)


def first_look(alert: str) -> str:
    panel, explain, ui = FIRST_LOOK[alert]
    steps = []
    if panel:
        steps.append(f"the dashboard panel '{panel}'")
    if explain:
        steps.append(f"`llm-latency-proxy explain {explain}` (the fitted split on the proxy's records)")
    if ui:
        if alert in ("LLMProxySaturated", "LLMProxyDescriptorsNearLimit", "LLMProxyUpstreamPoolFull"):
            steps.append(f"the requests themselves: http://{INSTANCE}/ui?{ui}")
        else:
            steps.append(f"the requests themselves: /ui?{ui} on any replica")
    if alert == "LLMProxyDown":
        steps.append(f"http://{INSTANCE}/healthz and the process's logs")
    if alert == "LLMProxyMetricsAbsent":
        steps.append("Prometheus' /targets page for job llm-latency-proxy")
    return "First look: " + "; then ".join(steps) + "."


def with_first_looks(text: str) -> str:
    """rules.yml with each alert's `first_look` annotation (re)written after its runbook line; the
    file stays hand-edited YAML with its comments, only those lines are the generator's."""
    out: list[str] = []
    alert = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("- alert: "):
            alert = stripped.split(": ", 1)[1]
        if stripped.startswith("first_look: "):
            continue
        out.append(line)
        if alert and stripped.startswith("runbook: "):
            indent = line[:len(line) - len(line.lstrip())]
            out.append(f"{indent}first_look: {json.dumps(first_look(alert), ensure_ascii=False)}")
    return "\n".join(out) + "\n"


# The test copy of the rules (tests/test_alerts.py): the one source with its durations shortened so
# the whole alert chain runs in about a minute. Windows keep their order (5m < 1h < the 1d offset)
# and every `for` stays shorter than the window it watches; a test checks nothing else differs.
SCALED_WINDOWS = {"5m": "8s", "1h": "12s", "1d": "28s"}
SCALED_FOR = {"2m": "2s", "5m": "3s", "10m": "4s", "15m": "4s"}
# The burn-rate rules' windows (proxy/answers/rules.py), scaled for their own chain test: each short window
# stays shorter than its long one, and the shortest still holds three 1 s scrapes.
SLO_SCALED_WINDOWS = {"5m": "3s", "30m": "4s", "1h": "6s", "2h": "8s", "6h": "10s", "1d": "12s", "3d": "16s"}


def scaled_rules(text: str, windows: dict[str, str] = SCALED_WINDOWS) -> str:
    import re

    text = re.sub(r"\[(\w+)\]", lambda m: f"[{windows[m.group(1)]}]", text)
    text = re.sub(r"\boffset (\w+)", lambda m: f"offset {windows[m.group(1)]}", text)
    return re.sub(r"^(\s*for: )(\w+)$", lambda m: m.group(1) + SCALED_FOR[m.group(2)], text, flags=re.M)


def slo_configmap() -> str:
    """The example objectives as the ConfigMap deploy/kubernetes mounts at SLO_IN_POD."""
    import yaml

    resource = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llm-latency-proxy-slo"},
                "data": {"slo.yaml": SLO_EXAMPLE.read_text()}}
    return HEADER.format(source="dashboards/prometheus/slo.yml") + yaml.safe_dump(resource, sort_keys=False, width=200)


def outputs() -> dict[Path, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from proxy.answers import rules
    from proxy.measure import slo

    objectives = slo.load(str(SLO_EXAMPLE))
    text = render()
    return {OUTPUT: text, RULES: with_first_looks(RULES.read_text()), KUBERNETES / "prometheusrule.yaml": prometheus_rule(),
            KUBERNETES / "grafana-dashboard-configmap.yaml": dashboard_configmap(text),
            SLO_RULES: rules.render(objectives, "dashboards/prometheus/slo.yml"),
            KUBERNETES / "slo-prometheusrule.yaml": rules.render(objectives, SLO_IN_POD, kubernetes=True),
            KUBERNETES / "slo-configmap.yaml": slo_configmap()}


def main() -> int:
    files = outputs()
    if "--check" in sys.argv:
        stale = [str(path) for path, text in files.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}: run dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
