"""Dashboard, rules and compose files: generated, consistent with the proxy's metrics, valid."""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

import yaml

from dashboards_util import (COMPOSE, DASHBOARD, PROM_CONFIG, ROOT, RULES, RULES_TEST, SLO_EXAMPLE, SLO_RULES, SLO_RULES_TEST,
                             dashboard, defined_series, metric_names, panel_targets, rules)

sys.path.insert(0, str(ROOT / "dashboards"))
import generate  # noqa: E402

from proxy.cli import parser  # noqa: E402


def test_committed_dashboard_equals_the_generated_one():
    assert DASHBOARD.read_text() == generate.render(), "run: make dashboards"


def test_metric_name_extraction():
    expr = 'sum by (phase) (rate(llmproxy_phase_seconds_sum{model=~"$m", phase="x"}[5m])) / scalar(sum(up))'
    assert metric_names(expr) == {"llmproxy_phase_seconds_sum", "up"}
    assert metric_names("llmproxy:decode_requests:rate1h offset 1d > 0.05") == {"llmproxy:decode_requests:rate1h"}


def test_every_metric_used_is_one_the_proxy_defines():
    defined = defined_series()
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    used_in_dashboard = {name for _, target in panel_targets() for name in metric_names(target["expr"])}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            used_in_dashboard |= metric_names(variable["query"].removeprefix("label_values(").split(",")[0])
    assert used_in_dashboard and used_in_dashboard <= defined, used_in_dashboard - defined
    used_in_rules = {name for rule in rules() for name in metric_names(rule["expr"])}
    assert used_in_rules <= defined | recorded | {"up"}, used_in_rules - defined - recorded
    slo_recorded = {rule["record"] for rule in rules(SLO_RULES) if "record" in rule}
    used_in_slo_rules = {name for rule in rules(SLO_RULES) for name in metric_names(rule["expr"])}
    assert used_in_slo_rules and used_in_slo_rules <= defined | slo_recorded, used_in_slo_rules - defined - slo_recorded
    for name in recorded | slo_recorded:
        assert name.startswith("llmproxy:") and name.count(":") == 2


def test_dashboard_structure():
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert set(variables) == {"datasource", "upstream", "model", "endpoint", "tenant", "slo"}
    assert variables["datasource"]["query"] == "prometheus"
    titles = [p["title"] for p in d["panels"]]
    for needed in ("Mean seconds per request, by phase", "Share of total time, by phase", "Time to first token",
                   "End-to-end duration", "Decode speed: per request vs aggregate", "Inter-token latency",
                   "Prefill tokens per second, per request", "Upstream connect time by step (new connections)",
                   "Connection reuse ratio", "Upstream RTT (kernel smoothed)", "Tokenizer seconds per request",
                   "Tokenizer microseconds per prompt token", "Requests by outcome and code", "In flight",
                   "Proxy's own overhead (phase proxy)", "Telemetry errors", "Per model", "SLO attainment vs target",
                   "Error budget left (selected range)", "Burn rate (1 h and 6 h)", "Goodput vs throughput", "SLO misses by blamed phase",
                   "Budget spent by tenant", "Requests and TTFT by tenant (selected range)"):
        assert needed in titles, needed
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
    throughput = next(p for p in d["panels"] if p["title"] == "Decode speed: per request vs aggregate")
    assert "order of magnitude" in throughput["description"]


def test_every_alert_has_annotations_and_a_runbook():
    alerts = [r for r in rules() if "alert" in r]
    names = {a["alert"] for a in alerts}
    assert {"LLMDecodeSpeedLow", "LLMDecodeSpeedDropped", "LLMTimeToFirstTokenHigh", "LLMUpstreamErrorRateHigh",
            "LLMProxyOverheadHigh", "LLMProxyDown", "LLMProxySaturated", "LLMProxyDescriptorsNearLimit"} <= names
    for alert in alerts:
        assert {"summary", "description", "runbook"} <= set(alert["annotations"]), alert["alert"]
    tested = {a["alertname"] for t in yaml.safe_load(RULES_TEST.read_text())["tests"] for a in t["alert_rule_test"]}
    assert names <= tested


def test_every_alert_says_what_to_look_at_first_and_each_pointer_exists():
    """first_look (generated with the rules): a panel the dashboard has, `explain` flags the CLI
    takes, /ui filters the page presets from its query."""
    import re
    from urllib.parse import parse_qsl

    titles = {p["title"] for p in dashboard()["panels"]}
    page = (ROOT / "proxy" / "serve" / "waterfall.js").read_text()
    filters = set(re.search(r"const FILTERS = \[([^\]]*)\]", page).group(1).replace('"', "").replace(" ", "").split(","))
    for alert in (r for r in rules() if "alert" in r):
        text = alert["annotations"]["first_look"]
        assert text == generate.first_look(alert["alert"])
        panel, explain, ui = generate.FIRST_LOOK[alert["alert"]]
        assert not panel or (f"'{panel}'" in text and panel in titles), alert["alert"]
        if explain:
            assert f"explain {explain}`" in text
            args = parser().parse_args(["explain", *explain.replace("{{ $labels.model }}", "m").split()])
            assert args.since and (args.model or "--model" not in explain)
        if ui:
            assert f"/ui?{ui}" in text
            assert {k for k, _ in parse_qsl(ui)} <= filters, alert["alert"]
        recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
        expr = alert["expr"] + " ".join(e for name, e in recorded.items() if name in alert["expr"])
        for label in re.findall(r"\$labels\.(\w+)", text):  # every label named is one the alert keeps
            assert re.search(rf"\b(by|on) \([^)]*\b{label}\b", expr) or label in ("instance", "job"), (alert["alert"], label)
    assert generate.with_first_looks(RULES.read_text()) == RULES.read_text()  # (committed as generated)


def test_the_time_scaled_rules_differ_from_the_source_only_in_durations():
    import re

    source = RULES.read_text()
    scaled = generate.scaled_rules(source)
    durations = re.compile(r"(?<=\[)\w+(?=\])|(?<=offset )\w+|(?<=for: )\w+$", re.M)
    assert durations.sub("D", scaled) == durations.sub("D", source)
    assert scaled != source and not re.search(r"\[\d+[mhd]\]|offset \d+[mhd]|for: \d+[mhd]", scaled)
    seconds = lambda d: int(d[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[d[-1]]  # noqa: E731
    windows = sorted(generate.SCALED_WINDOWS, key=seconds)
    assert [seconds(generate.SCALED_WINDOWS[w]) for w in windows] == sorted(seconds(generate.SCALED_WINDOWS[w]) for w in windows)
    for alert in (r for r in yaml.safe_load(scaled)["groups"][1]["rules"]):  # every `for` shorter than its window
        assert seconds(alert["for"]) < min(seconds(w) for w in re.findall(r"\[(\w+)\]", alert["expr"]) or ["1h"])


def promtool(*args: str) -> str:
    exe = shutil.which("promtool")
    assert exe, "promtool missing: run `make test` (it installs Debian's prometheus package)"
    result = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_promtool_check_config_and_rules():
    assert "SUCCESS" in promtool("check", "config", str(PROM_CONFIG))
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", str(RULES))


def test_promtool_rule_unit_tests():
    assert "SUCCESS" in promtool("test", "rules", str(RULES_TEST))


def test_the_slo_rules_are_generated_from_the_example_objectives_and_pass_promtool():
    assert SLO_RULES.read_text() == generate.outputs()[SLO_RULES], "run: make dashboards"
    assert f"SUCCESS: {len(rules(SLO_RULES))} rules found" in promtool("check", "rules", str(SLO_RULES))
    assert "SUCCESS" in promtool("test", "rules", str(SLO_RULES_TEST))
    alerts = [r for r in rules(SLO_RULES) if "alert" in r]
    objectives = yaml.safe_load(SLO_EXAMPLE.read_text())["objectives"]
    assert sorted((a["labels"]["slo"], a["labels"]["severity"]) for a in alerts) == sorted(
        (o["name"], severity) for o in objectives for severity in ("page", "ticket"))
    tested = {(a["exp_labels"]["slo"], a["exp_labels"]["severity"]) for t in yaml.safe_load(SLO_RULES_TEST.read_text())["tests"]
              for case in t["alert_rule_test"] for a in case["exp_alerts"]}
    assert {("interactive", "page"), ("interactive", "ticket"), ("batch", "ticket")} <= tested
    titles = {p["title"] for p in dashboard()["panels"]}
    for alert in alerts:  # every pointer in first_look exists: the row and panel, explain's flags, /ui's filters
        first_look = alert["annotations"]["first_look"]
        assert f"'{generate.ROW_SLO}'" in first_look and generate.ROW_SLO in titles and generate.PANEL_SLO_MISSES in titles
        args = parser().parse_args(first_look.split("`")[1].split()[1:])
        assert args.command == "explain" and args.slo and args.since
        page = (ROOT / "proxy" / "serve" / "waterfall.js").read_text()
        assert f"/ui?slo={alert['labels']['slo']}&verdict=miss" in first_look and '"slo", "verdict"' in page


def test_compose_services_agree_with_the_cli_and_the_scrape_config():
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    cli = parser()
    sim = cli.parse_args(compose["simulator"]["command"])
    proxy = cli.parse_args(compose["proxy"]["command"])
    assert isinstance(sim, argparse.Namespace) and sim.command == "simulate"
    assert proxy.command == "serve" and proxy.upstream == f"http://simulator:{sim.port}/v1"
    assert compose["proxy"]["ports"] == [f"{proxy.port}:{proxy.port}"]
    scrape = yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == [f"proxy:{proxy.port}"]
    assert "load --base-url http://proxy:8080/v1" in compose["traffic"]["entrypoint"][-1]
    command = compose["traffic"]["entrypoint"][-1]
    load = cli.parse_args(re.search(r"llm-latency-proxy (load [^;]+);", command).group(1).split())
    assert load.command == "load" and load.keys and load.shapes
    # Its two applications' keys are the ones the proxy's tenants file names by fingerprint (and only as fingerprints).
    from proxy.serve.tenants import Tenants

    mounted = next(v for v in compose["proxy"]["volumes"] if v.endswith(":" + proxy.tenants + ":ro"))
    text = (ROOT / "dashboards" / mounted.split(":")[0]).read_text()
    tenants = Tenants(str(ROOT / "dashboards" / mounted.split(":")[0]))
    keys = load.keys.split(",")
    assert [tenants.tenant([(b"authorization", b"Bearer " + k.encode())]) for k in keys] == ["search", "batch"]
    assert not any(k in text for k in keys) and load.shapes == "long-prompts,long-answers"
    datasource = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"].endswith(":9090")
    assert "9090:9090" in compose["prometheus"]["ports"]
