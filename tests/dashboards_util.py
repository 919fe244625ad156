"""Shared by the dashboard tests: where the files are, and which metric names an expression uses."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import yaml

from proxy.measure.metrics import METRICS

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "grafana" / "llm-latency-breakdown.json"
RULES = ROOT / "dashboards" / "prometheus" / "rules.yml"
PROM_CONFIG = ROOT / "dashboards" / "prometheus" / "prometheus.yml"
RULES_TEST = ROOT / "dashboards" / "prometheus" / "rules_test.yml"
SLO_EXAMPLE = ROOT / "dashboards" / "prometheus" / "slo.yml"
SLO_RULES = ROOT / "dashboards" / "prometheus" / "slo-rules.yml"
SLO_RULES_TEST = ROOT / "dashboards" / "prometheus" / "slo-rules_test.yml"
COMPOSE = ROOT / "dashboards" / "docker-compose.yml"

PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "scalar", "and", "or", "unless", "on", "ignoring",
    "offset", "absent", "le", "group_left", "group_right", "without", "max", "min", "avg", "count", "bool",
}


def defined_series() -> set[str]:
    """Every series name the proxy exposes, from its own metric definitions."""
    names: set[str] = set()
    for d in METRICS:
        if d.kind == "histogram":
            names |= {f"{d.name}_bucket", f"{d.name}_sum", f"{d.name}_count"}
        elif d.kind == "summary":
            names |= {f"{d.name}_sum", f"{d.name}_count"}
        else:
            names.add(d.exposed)
    return names


def metric_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that are series names (not labels, functions, keywords)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    expr = re.sub(r"\b(by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\boffset\s+\w+", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[match.end():].lstrip().startswith("("):
            continue  # a function call
        if match.group() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_targets() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def rules(path: Path = RULES) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def substitute(expr: str, rate_interval: str = "1m", range_: str = "5m", endpoint: str = ".*", tenant: str = ".*") -> str:
    """Grafana's variables, as the dashboard would send them with 'All' selected (or one endpoint, one tenant)."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_).replace("$__interval", "15s")
            .replace("$upstream", ".*").replace("$model", ".*").replace("$endpoint", endpoint).replace("$slo", ".*")
            .replace("$tenant", tenant))
