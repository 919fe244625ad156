"""deploy/: Kubernetes manifests validated offline against the Kubernetes schemas, the Prometheus
Operator resources checked field by field (and generated from the one rules file and dashboard),
the collector configuration checked structurally."""
from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from servers import ROOT

sys.path.insert(0, str(ROOT / "dashboards"))
import generate  # noqa: E402

from proxy.cli import parser  # noqa: E402

K8S = ROOT / "deploy" / "kubernetes"
CORE = ("deployment", "service", "hpa", "pdb", "routes-configmap", "slo-configmap", "grafana-dashboard-configmap")


def load(name: str) -> dict:
    return yaml.safe_load((K8S / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", CORE)
def test_core_manifests_validate_strictly_against_the_kubernetes_schemas(name):
    kubernetes_validate.validate(load(name), "1.37.0", strict=True)


def test_the_validation_can_fail():
    broken = copy.deepcopy(load("deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


def test_the_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_deployment_runs_safely_and_drains_streams():
    deployment = load("deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    args = parser().parse_args(container["args"])  # every flag is one the proxy has
    grace = args.shutdown_grace
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    from proxy.serve.app import RECORDS_FLUSH_S

    # A rollout drops no stream, and the records flush fits, with slack (SIGKILL would lose the buffer).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + RECORDS_FLUSH_S + 5
    assert args.admin_port and {p["name"]: p["containerPort"] for p in container["ports"]}["admin"] == args.admin_port
    assert container["resources"]["requests"]["cpu"] and "cpu" not in container["resources"]["limits"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    routes_dir = str(Path(args.routes).parent)
    assert routes_dir in mounts and any(e["name"] == "XDG_DATA_HOME" and e["value"] in mounts for e in container["env"])
    assert args.slo == generate.SLO_IN_POD and str(Path(args.slo).parent) in mounts  # the objectives beside the routes
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    names = {source["configMap"]["name"] for source in config["projected"]["sources"]}
    assert names == {load("routes-configmap")["metadata"]["name"], load("slo-configmap")["metadata"]["name"]}
    assert Path(args.slo).name in load("slo-configmap")["data"] and Path(args.routes).name in load("routes-configmap")["data"]


def json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 `add` (what the component uses), as kustomize applies it."""
    out = copy.deepcopy(document)
    for operation in operations:
        assert operation["op"] == "add", operation
        *parents, last = operation["path"].strip("/").split("/")
        target = out
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if last == "-":
            target.append(operation["value"])
        elif isinstance(target, list):
            target.insert(int(last), operation["value"])
        else:
            target[last] = operation["value"]
    return out


def test_the_postgresql_component_points_every_replica_at_one_store_from_a_secret():
    component = yaml.safe_load((K8S / "components" / "postgresql" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    (patch,) = component["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": load("deployment")["metadata"]["name"]}
    deployment = json_patch(load("deployment"), yaml.safe_load(patch["patch"]))
    kubernetes_validate.validate(deployment, "1.37.0", strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    secret = env["LLMPROXY_RECORDS_DB"]["valueFrom"]["secretKeyRef"]
    password_file = Path(env["LLMPROXY_RECORDS_DB_PASSWORD_FILE"]["value"])
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret["name"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert Path(mount["mountPath"]) == password_file.parent and mount["readOnly"]
    assert volume["secret"]["items"] == [{"key": "password", "path": password_file.name}]  # the password alone, never in the URL key
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # records tagged with the pod
    from proxy.config import build_settings

    settings = build_settings(parser().parse_args(container["args"]),
                              {"LLMPROXY_RECORDS_DB": "postgresql://llmproxy@postgres:5432/llmproxy",
                               "LLMPROXY_RECORDS_DB_PASSWORD_FILE": str(password_file), "POD_NAME": "llm-latency-proxy-abc12"})
    assert settings.records_path.startswith("postgresql://") and settings.records_db_password_file == str(password_file)
    assert settings.instance_name == "llm-latency-proxy-abc12"


def test_service_monitor_scrapes_the_admin_port_with_the_admin_key():
    monitor, service, deployment = load("servicemonitor"), load("service"), load("deployment")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    labels = {}
    for entry in yaml.safe_load((K8S / "kustomization.yaml").read_text())["labels"]:
        labels.update(entry["pairs"])  # what kustomize puts on every resource, the Service included
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "authorization", "scheme", "scrapeTimeout", "relabelings"}
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLMPROXY_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": credentials["name"], "key": credentials["key"]}


def test_prometheus_rule_is_generated_from_the_rules_file_and_passes_promtool(tmp_path):
    text = (K8S / "prometheusrule.yaml").read_text()
    assert text == generate.prometheus_rule(), "run: make dashboards"
    rule = yaml.safe_load(text)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule" and set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "dashboards/prometheus/rules.yml").read_text())["groups"]
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for r in group["rules"]:
            assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations"}
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run `make test`"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    print("\n" + shlex.join(["promtool", "check", "rules", "(PrometheusRule spec.groups)"]) + ": " + out.stdout.strip().splitlines()[-1])


def test_the_slo_resources_are_generated_from_the_example_objectives(tmp_path):
    outputs = generate.outputs()
    for name in ("slo-prometheusrule.yaml", "slo-configmap.yaml"):
        assert (K8S / name).read_text() == outputs[K8S / name], "run: make dashboards"
    rule = load("slo-prometheusrule")
    assert rule["kind"] == "PrometheusRule" and set(rule["spec"]) == {"groups"}
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]  # (each group: its objective's ratios, then its alerts)
    assert alerts != [] and all(r["labels"]["slo"] for r in alerts)
    assert generate.SLO_IN_POD in alerts[0]["annotations"]["first_look"]  # the pod's path, for explain
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([shutil.which("promtool") or "promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert load("slo-configmap")["data"]["slo.yaml"] == (ROOT / "dashboards/prometheus/slo.yml").read_text()


def test_the_dashboard_configmap_is_the_generated_dashboard():
    text = (K8S / "grafana-dashboard-configmap.yaml").read_text()
    assert text == generate.dashboard_configmap(generate.render()), "run: make dashboards"
    configmap = yaml.safe_load(text)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"]["llm-latency-breakdown.json"] == (ROOT / "dashboards/grafana/llm-latency-breakdown.json").read_text()


def test_the_collector_tail_samples_the_slow_and_the_failed():
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert set(config["receivers"]["otlp"]["protocols"]) >= {"http"}
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    assert "tail_sampling" not in pipelines["metrics"]["processors"]  # every request counts: metrics are never sampled
    for name in pipelines["metrics"]["processors"] + pipelines["metrics"]["exporters"]:
        assert name in config["processors"] or name in config["exporters"]
    traces = pipelines["traces"]
    assert traces["receivers"] == ["otlp"] and "tail_sampling" in traces["processors"]
    assert traces["processors"][0] == "memory_limiter" and traces["processors"][-1] == "batch"
    for name in traces["processors"] + traces["exporters"]:
        assert name in config["processors"] or name in config["exporters"]
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    ttft = policies["numeric_attribute"]["numeric_attribute"]
    tracing_source = (ROOT / "proxy" / "measure" / "tracing.py").read_text()
    assert f'"{ttft["key"]}"' in tracing_source  # an attribute the proxy really sets
    assert policies["latency"]["latency"]["threshold_ms"] > 0 and 0 < policies["probabilistic"]["probabilistic"]["sampling_percentage"] < 100


def test_the_package_list_names_every_subpackage():
    """`pip install .` (the Dockerfile's) ships only the packages pyproject.toml lists: each one must be there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "proxy").rglob("__init__.py")}
    assert listed == found, found ^ listed
