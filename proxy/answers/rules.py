"""`llm-latency-proxy rules --slo PATH`: Prometheus burn-rate alerts generated from the objectives file.

The method is the SRE Workbook's multiwindow, multi-burn-rate alert ("Alerting on SLOs"): the
burn rate is the bad share of requests divided by the budget (1 - target); an alert needs the burn
over a long window *and* over a short one (1/12 of it) above the same factor, so it fires fast and
resets fast. Page: 14.4 over 1 h and 5 m (2% of a 30-day budget spent), or 6 over 6 h and 30 m (5%);
ticket: 3 over 1 d and 2 h (10%), or 1 over 3 d and 6 h (10%). The recording rules (in each objective's group, before its alerts) hold the error
ratio of every SLO over each window, from exact counts (`llmproxy_slo_requests_total`), so the alerts
stay cheap; each alert's annotations ask Prometheus which objective and phase are spending the budget
(`llmproxy_slo_misses_total`) and say where to look first.
"""
from __future__ import annotations

from typing import Any

import yaml

from ..measure.slo import Objective

# (severity, long window, short window, burn factor, share of a 30-day budget spent when it fires)
BURNS = (("page", "1h", "5m", 14.4, 0.02), ("page", "6h", "30m", 6.0, 0.05),
         ("ticket", "1d", "2h", 3.0, 0.10), ("ticket", "3d", "6h", 1.0, 0.10))
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
RATIO = "llmproxy:slo_errors:ratio_rate{window}"
# What to do first about the phase that spends the budget (the alert's runbook).
WHAT_TO_DO = ("queue: the engine is saturated (more replicas, a smaller batch, admission control); prefill: long prompts "
              "(prompt caching, chunked prefill, a shorter system prompt); reasoning: hidden reasoning (a lower reasoning effort); "
              "load: cold model loads (keep the model loaded); client: slow uploads from the clients themselves; network: the "
              "link to the upstream; tokenize: the server's tokenizer; proxy: the proxy's own time (its CPU, --workers); wait: the proxy's own upstream pool is full (--max-connections); failover: a replica failed or "
              "missed the route's first-token deadline and the request went to another (llmproxy_failovers_total: which replica, why); decode: "
              "too many streams per engine (see `explain`'s capacity); error: the upstream's failures, by outcome.")


def _by(o: Objective) -> str:
    """What an objective's ratios and alerts are kept apart by: the objective, and with
    `page_per_tenant` each tenant (its burn pages on its own)."""
    return "slo, tenant" if o.page_per_tenant else "slo"


def recording_rules(o: Objective) -> list[dict[str, Any]]:
    """One SLO's error ratio over each window its alerts read (per tenant with `page_per_tenant`). In
    the alerts' own group, before them: a group's rules run in order, so the alerts read this
    evaluation's ratios (groups run concurrently, so from a group of its own they read this one's or
    the last one's, by chance). Its `slo` label (the value the sum already has) makes each
    objective's rules distinct to the linter."""
    by = _by(o)
    return [{"record": RATIO.format(window=w),
             "expr": f'sum by ({by}) (rate(llmproxy_slo_requests_total{{slo="{o.name}", result="bad"}}[{w}]))\n'
                     f'  / sum by ({by}) (rate(llmproxy_slo_requests_total{{slo="{o.name}"}}[{w}]))\n', "labels": {"slo": o.name}}
            for w in WINDOWS]


def describe(o: Objective) -> str:
    """`TTFT ≤ 0.5 s, TPOT ≤ 50 ms, e2e ≤ 30 s for 99% of requests to llama-*`."""
    def seconds(value: float) -> str:
        return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"

    stated = [f"{name.upper() if name != 'e2e' else name} ≤ {seconds(v)}" for name, v in o.thresholds.items()]
    tenants = f" from tenants {', '.join(o.tenants)}" if o.tenants else ""
    return f"{', '.join(stated)} for {o.target * 100:g}% of requests to {', '.join(o.models)}{tenants}"


def blame_annotation(o: Objective, window: str) -> str:
    """A template Prometheus fills when the alert fires: each objective and blamed phase's share of the bad requests."""
    which = f'slo="{o.name}"' + (', tenant="%s"' if o.page_per_tenant else "")  # (the firing tenant's, by printf)
    misses = f'sum by (objective, blame) (increase(llmproxy_slo_misses_total{{{which}}}[{window}]))'
    bad = f'scalar(sum(increase(llmproxy_slo_requests_total{{{which}, result="bad"}}[{window}])))'
    query = '"' + f"sort_desc({misses} / {bad} > 0)".replace('"', '\\"') + '"'
    if o.page_per_tenant:
        query = f"(printf {query} $labels.tenant $labels.tenant)"
    return (f'Spending the budget over the last {window} (share of the bad requests): {{{{ range $i, $m := query {query} }}}}'
            "{{ if $i }}, {{ end }}{{ $m.Labels.objective }} misses blamed on {{ $m.Labels.blame }} {{ $m.Value | humanizePercentage }}"
            "{{ else }}none counted{{ end }}.")


def alert(o: Objective, severity: str, slo_path: str) -> dict[str, Any]:
    pairs = [b for b in BURNS if b[0] == severity]
    budget = round(o.budget, 12)
    expr = "\n  or\n".join(f'(\n  {RATIO.format(window=long)}{{slo="{o.name}"}} / {budget:g} > {factor:g}\n'
                           f'  and {RATIO.format(window=short)}{{slo="{o.name}"}} / {budget:g} > {factor:g}\n)'
                           for _, long, short, factor, _ in pairs)
    windows = " or ".join(f"{factor:g}x over {long} and {short}" for _, long, short, factor, _ in pairs)
    spent = " / ".join(f"{share:.0%}" for *_, share in pairs)
    explain = f"llm-latency-proxy explain --slo {slo_path} --since {pairs[0][1]}" + (" --by tenant" if o.page_per_tenant else "")
    ui = f"/ui?slo={o.name}&verdict=miss" + ("&tenant={{ $labels.tenant }}" if o.page_per_tenant else "")
    return {
        "alert": "LLMSLOBudgetBurn",
        "expr": expr + "\n",
        "labels": {"severity": severity, "slo": o.name, "objective": f"{o.target * 100:g}%"},
        "annotations": {
            "summary": f"SLO {o.name} is spending its error budget too fast ({severity})" + (
                " for tenant {{ $labels.tenant }}" if o.page_per_tenant else ""),
            "description": (f"The error budget of {o.name} ({describe(o)}) burns at {{{{ $value | printf \"%.1f\" }}}}x the "
                            f"sustainable rate ({windows}: {spent} of a 30-day budget spent when this fires)."),
            "blame": blame_annotation(o, pairs[0][1]),
            "runbook": f"Act on the phase named in `blame`. {WHAT_TO_DO}",
            "first_look": (f"First look: the dashboard row 'Service-level objectives' (panel 'SLO misses by blamed phase'); then "
                           f"`{explain}` (attainment, misses by phase, capacity); then the misses themselves: "
                           f"{ui} on any replica."),
        },
    }


def groups(objectives: tuple[Objective, ...], slo_path: str) -> list[dict[str, Any]]:
    return [{"name": f"llmproxy-slo-{o.name}", "rules": [*recording_rules(o), alert(o, "page", slo_path), alert(o, "ticket", slo_path)]}
            for o in objectives]


HEADER = ("# Generated by `llm-latency-proxy rules --slo {path}` from that objectives file: edit it, then generate again.\n"
          "# Multiwindow, multi-burn-rate alerts (the SRE Workbook's): see proxy/answers/rules.py.\n")


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as a person writes them."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def render(objectives: tuple[Objective, ...], slo_path: str, kubernetes: bool = False) -> str:
    """The rules file, or (kubernetes) a PrometheusRule for the Prometheus Operator with the same groups."""
    body: dict[str, Any] = {"groups": groups(objectives, slo_path)}
    if kubernetes:
        body = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": "llm-latency-proxy-slo", "labels": {"prometheus": "k8s", "role": "alert-rules"}},
                "spec": body}
    return HEADER.format(path=slo_path) + yaml.dump(body, Dumper=_Dumper, sort_keys=False, width=140, allow_unicode=True)
