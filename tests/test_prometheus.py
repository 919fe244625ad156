"""A real Prometheus scrapes a real proxy: every panel query, rule and alert expression runs."""
from __future__ import annotations

import asyncio
import math
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from servers import Process, Prometheus, Simulator
import yaml

from dashboards_util import RULES, SLO_EXAMPLE, SLO_RULES, dashboard, panel_targets, rules, substitute
from proxy.processes import free_port
from proxy.simulator.load import Mix, run_load
from proxy.serve.tenants import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dashboards"))
import generate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def has_data(data: dict[str, Any]) -> bool:
    """At least one finite value (a NaN from 0/0 is not data)."""
    values = [r["value"][1] for r in data["result"]] if data["resultType"] == "vector" else []
    if data["resultType"] == "scalar":
        values = [data["result"][1]]
    return any(math.isfinite(float(v)) for v in values)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("prom")
    test_rules = workdir / "rules.yml"  # the proxy's rules and the burn-rate rules of the example objectives, in one file
    groups = yaml.safe_load(generate.scaled_rules(RULES.read_text()))["groups"] + yaml.safe_load(SLO_RULES.read_text())["groups"]
    test_rules.write_text(yaml.safe_dump({"groups": groups}))  # (the alert chains' own tests: test_alerts.py)
    sim = Simulator("--jitter", "0.05", "--prefix-cache-tokens", "200000")  # (cached tokens reported: the Prefix cache row)
    tenants = workdir / "tenants.yaml"  # two applications by their keys (drive() sends with both)
    tenants.write_text("tenants:\n" + "".join(f"  - name: {name}\n    keys: ['{fingerprint(key)}']\n" for name, key in KEYS.items()))
    # Two proxy replicas, both scraped, as a fleet runs them: every panel must sum over instances.
    # `localhost` (not an IP) so the DNS step is measured too.
    # --max-in-flight well above the test load: the saturation panel has a cap to divide by.
    ports = [free_port(), free_port()]
    # The second replica routes to the simulator and to a replica that is down (nothing listens on its port): its
    # requests that meet it fail over, it is set aside (the Replicas row has data); by predicted_ttft, whose prefix
    # index is checked against the simulator's cache (the Prefix cache row). (No active checks: they would set the
    # down replica aside before any request met it, and the Failovers panel would have nothing to show.)
    routes = workdir / "routes.yaml"
    routes.write_text(yaml.safe_dump({"upstreams": [{"name": "down", "url": f"http://127.0.0.1:{free_port()}/v1"},
                                                    {"name": f"localhost:{sim.port}", "url": f"http://localhost:{sim.port}/v1"}],
                                      "routes": [{"models": ["*"], "upstreams": ["down", f"localhost:{sim.port}"], "retries": 1,
                                                  "pick": "predicted_ttft"}],
                                      "default": f"localhost:{sim.port}", "health_check": "off"}))
    # The example objectives (dashboards/prometheus/slo.yml) judge the load: the SLO row has data.
    proxies = [Process(["serve", *(["--routes", str(routes)] if i else ["--upstream", f"http://localhost:{sim.port}/v1"]), "--port", str(port),
                        "--max-in-flight", "64", "--slo", str(SLO_EXAMPLE), "--tenants", str(tenants)], f"http://127.0.0.1:{port}/healthz")
               for i, port in enumerate(ports)]
    prom = Prometheus(workdir, [f"127.0.0.1:{port}" for port in ports], test_rules)
    try:
        yield {"sim": sim, "proxy": f"http://127.0.0.1:{ports[0]}", "proxies": [f"http://127.0.0.1:{p}" for p in ports], "prom": prom}
    finally:
        prom.stop()
        for each in proxies:
            each.stop()
        sim.proc.stop()


KEYS = {"search-eu": "sk-load-search-eu-0001", "batch": "sk-load-batch-0002"}  # search-eu: judged by the example's search-apps objective


def drive(base: str, seconds: float, concurrency: int = 4, mix: Mix | None = None) -> Any:
    return asyncio.run(run_load(f"{base}/v1", concurrency=concurrency, duration_s=seconds, mix=mix, keys=list(KEYS.values()), users=50))


def test_every_panel_query_and_rule_returns_data(stack):
    prom = stack["prom"]
    mix = Mix(max_tokens=(5, 10, 20), prompt_tokens=(50, 500, 2000), error_share=0.05)
    # Two steps of concurrency: the second opens new upstream connections after Prometheus has
    # seen the first, so the connect-time counters increase inside the query window.
    first = drive(stack["proxy"], 3.0, concurrency=2, mix=mix)
    with ThreadPoolExecutor(1) as pool:  # the second replica's traffic beside the second step
        replica = pool.submit(drive, stack["proxies"][1], 3.0, concurrency=4, mix=mix)
        second = drive(stack["proxy"], 6.0, concurrency=8, mix=mix)
        other = replica.result()
    assert first.sent + second.sent > 20 and other.sent > 5 and first.failures == second.failures == other.failures == 0
    assert float(prom.query('sum(llmproxy_upstream_ejections_total{upstream="down"})')["result"][0]["value"][1]) >= 1
    for i in range(3):  # conversations resumed on the second replica, past their first turn, that no engine has: strays
        history = [{"role": "user", "content": f"resumed {i}: " + "earlier work " * 300}, {"role": "assistant", "content": "done"},
                   {"role": "user", "content": "and next?"}]
        httpx.post(f"{stack['proxies'][1]}/v1/chat/completions", json={"model": "sim-7b", "messages": history, "max_tokens": 3},
                   headers={"Authorization": f"Bearer {KEYS['batch']}"}, timeout=30).raise_for_status()
    assert "llmproxy_prefix_strays_total{upstream=" in httpx.get(f"{stack['proxies'][1]}/metrics").text
    time.sleep(3)  # two more scrapes, and the recording rules evaluated on them
    empty = []
    queries = list(panel_targets())
    for panel, target in queries:
        data = prom.query(substitute(target["expr"]))
        if not has_data(data):
            empty.append(f"{panel['title']} / {target['refId']}")
    assert not empty, f"panel queries without data: {empty}"
    # Across replicas: a panel's series aggregate over instances (sum by, not one line per pod),
    # except the panels that are per instance on purpose (they say `by (instance)`).
    per_instance = [f"{panel['title']} / {target['refId']}" for panel, target in queries if "by (instance)" not in target["expr"]
                    and any("instance" in r["metric"] for r in prom.query(substitute(target["expr"]))["result"])]
    assert not per_instance, f"panel queries split by instance: {per_instance}"
    direct = sum(float(v) for url in stack["proxies"]
                 for v in re.findall(r"^llmproxy_requests_total\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M))
    assert float(prom.query("sum(llmproxy_requests_total)")["result"][0]["value"][1]) == direct  # the sum over both replicas
    # The endpoint variable set to the Responses API alone: every panel that filters by endpoint
    # has data for that traffic too (the load mix sends 15% of its requests there).
    filtered = [(panel, target) for panel, target in queries if "$endpoint" in target["expr"]]
    for endpoint in ("responses", "messages", "generate_content", "ollama_chat"):  # each API's traffic alone (Responses, Anthropic, Gemini, Ollama)
        without = [f"{panel['title']} / {target['refId']}" for panel, target in filtered
                   if not has_data(prom.query(substitute(target["expr"], endpoint=endpoint)))]
        assert filtered and not without, f"panel queries without data for endpoint={endpoint}: {without}"
    # The tenant variable set to one tenant: every panel that filters by tenant has that tenant's data.
    by_tenant = [(panel, target) for panel, target in queries if "$tenant" in target["expr"]]
    for tenant in KEYS:
        without = [f"{panel['title']} / {target['refId']}" for panel, target in by_tenant
                   if not has_data(prom.query(substitute(target["expr"], tenant=tenant)))]
        assert by_tenant and not without, f"panel queries without data for tenant={tenant}: {without}"
    spent = prom.query(substitute(next(t["expr"] for p, t in queries if p["title"] == generate.PANEL_TENANT_BUDGET)))["result"]
    assert {(r["metric"]["slo"], r["metric"]["tenant"]) for r in spent} >= {("search-apps", "search-eu"), ("interactive", "batch")}, spent
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
            values = httpx.get(f"{prom.url}/api/v1/label/{match.group(2)}/values",
                               params={"match[]": substitute(match.group(1))}).json()["data"]
            assert values, variable["name"]
            if variable["name"] == "endpoint":
                assert {"chat", "completions", "responses", "messages", "generate_content", "ollama_chat"} <= set(values), values
            if variable["name"] == "tenant":
                assert set(values) == set(KEYS), values
    everything = rules() + rules(SLO_RULES)
    recorded, alerts = [r for r in everything if "record" in r], [r for r in everything if "alert" in r]
    # Production windows, evaluated directly: every recorded series has data (the burn-rate ratios are
    # recorded per objective, in its own group: the load here is judged by the first objective only).
    for name in {rule["record"] for rule in recorded}:
        assert any(has_data(prom.query(rule["expr"])) for rule in recorded if rule["record"] == name), name
    for rule in alerts:  # valid against real series; firing is the live test's job
        prom.query(rule["expr"])
    print(f"\nexecuted {len(queries)} panel queries (all with data), {len(recorded)} recording rules (all with data), "
          f"{len(alerts)} alert expressions (all valid)")
