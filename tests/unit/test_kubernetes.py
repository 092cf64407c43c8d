"""The Kubernetes manifests (packaging/kubernetes): valid against the bundled Kubernetes schemas
(kubernetes-validate, offline), CRDs checked structurally, the probe and grace numbers in step
with the example config, and the PrometheusRule in step with packaging/prometheus/alerts.yml.

ServiceMonitor, PrometheusRule and ScaledObject are CRDs (prometheus-operator, KEDA), whose
schemas kubernetes-validate does not bundle: for those the test checks the fields those
operators require, by hand.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsupervisor.config import load_config
from llmsupervisor.daemon.supervisor import LEFTOVER_KILL_TIMEOUT_S, SHUTDOWN_CANCEL_TIMEOUT_S
from tests.lib.paths import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = REPO / "packaging" / "kubernetes"
BASE = K8S / "base"
AUTOSCALING = K8S / "autoscaling"
KUBERNETES_VERSION = "1.32.0"  # a version the bundled schemas cover; our manifests use nothing newer
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization_resources(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization lists (recursing into bases), plus its generated ConfigMaps,
    without kustomize's transformations (names and labels are checked on the real render below)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        out += _kustomization_resources(path) if path.is_dir() else _documents(path)
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        out.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}
        )
    return out


def _all_resources() -> list[dict[str, Any]]:
    return [*_kustomization_resources(AUTOSCALING), *_documents(AUTOSCALING / "keda-scaledobject.yaml")]


def _validate(resource: dict[str, Any]) -> None:
    kind = resource["kind"]
    if kind in CRD_KINDS:
        _check_crd(resource)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def _check_crd(resource: dict[str, Any]) -> None:
    kind, spec = resource["kind"], resource["spec"]
    assert resource["metadata"]["name"]
    if kind == "ServiceMonitor":
        assert resource["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"]
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")
    elif kind == "PrometheusRule":
        assert resource["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["groups"]
        for group in spec["groups"]:
            assert set(group) <= {"name", "interval", "rules"} and group["name"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
                assert ("alert" in rule) != ("record" in rule) and rule["expr"]
    elif kind == "ScaledObject":
        assert resource["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"]["name"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus"
            assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
            assert isinstance(trigger["metadata"]["threshold"], str)  # KEDA wants a string


@pytest.mark.parametrize("resource", _all_resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_every_manifest_is_valid(resource: dict[str, Any]) -> None:
    _validate(resource)


def test_kustomize_renders_valid_manifests() -> None:
    kubectl = shutil.which("kubectl") or shutil.which("kustomize")
    if kubectl is None:
        pytest.skip("neither kubectl nor kustomize installed")
    for directory in (BASE, AUTOSCALING):
        argv = (
            [kubectl, "kustomize", str(directory)]
            if kubectl.endswith("kubectl")
            else [kubectl, "build", str(directory)]
        )
        rendered = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        resources = [d for d in yaml.safe_load_all(rendered) if d]
        for resource in resources:
            _validate(resource)
        kinds = {r["kind"] for r in resources}
        assert {"StatefulSet", "Service", "ConfigMap", "ServiceMonitor", "PrometheusRule"} <= kinds
        # The generated ConfigMap's hashed name is what the StatefulSet mounts.
        config_map = next(r for r in resources if r["kind"] == "ConfigMap")
        pod = next(r for r in resources if r["kind"] == "StatefulSet")["spec"]["template"]["spec"]
        assert {"name": "config", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]


def _statefulset() -> dict[str, Any]:
    return next(d for d in _documents(BASE / "statefulset.yaml") if d["kind"] == "StatefulSet")


def test_probe_and_grace_numbers_agree_with_the_config() -> None:
    config = load_config(BASE / "config.yaml", check_paths=False)
    pod = _statefulset()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (engine,) = config.engines
    assert ports["http"] == engine.port and engine.host == "0.0.0.0"
    assert config.supervisor.http_listen == f"0.0.0.0:{ports['metrics']}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == len(engine.gpus)

    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    # The kubelet gives a model load at least the daemon's own start deadline.
    assert startup["failureThreshold"] * startup["periodSeconds"] >= max(
        e.start_timeout_s for e in config.engines
    )
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # /livez fails after max(10, 5 ticks) without a loop turn; a probe must not time out first.
    assert container["livenessProbe"]["timeoutSeconds"] <= max(10.0, 5 * config.supervisor.tick_interval_s)

    # The daemon's shutdown covers a whole drain and stop ladder of every engine...
    for e in config.engines:
        stop_s = (
            e.drain_grace_s + e.drain_timeout_s + e.stop_timeout_s + e.group_term_timeout_s + e.kill_timeout_s
        )
        assert config.supervisor.shutdown_timeout_s >= stop_s, e.name
        # ... vLLM's own drain ends before the ladder's first rung does (etc/llm-supervisor/config.yaml).
        assert e.stop_timeout_s >= float(e.args.get("shutdown-timeout", 0)) + 15
    # ... and the kubelet waits for all of it, after the preStop hook, before SIGKILL.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    worst_shutdown_s = (
        float(pre_stop[1])
        + config.supervisor.shutdown_timeout_s
        + SHUTDOWN_CANCEL_TIMEOUT_S
        + LEFTOVER_KILL_TIMEOUT_S
    )
    assert pod["terminationGracePeriodSeconds"] >= math.ceil(worst_shutdown_s)
    # The daemon runs in JSON-lines mode, reading the mounted ConfigMap.
    assert container["command"][-2:] == ["--log-format", "json"]
    assert "/etc/llm-supervisor/config.yaml" in container["command"]


def test_prometheus_rule_is_generated_from_alerts_yml() -> None:
    spec = importlib.util.spec_from_file_location("gen_prometheusrule", K8S / "gen_prometheusrule.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    alerts_text = (REPO / "packaging" / "prometheus" / "alerts.yml").read_text()
    committed = (BASE / "prometheusrule.yaml").read_text()
    assert committed == gen.render(alerts_text), "run packaging/kubernetes/gen_prometheusrule.py"
    rule = yaml.safe_load(committed)
    assert rule["spec"]["groups"] == yaml.safe_load(alerts_text)["groups"]


def test_scrape_job_name_matches_the_alerts() -> None:
    """ServiceMonitor targets get job=<Service name>; the scrape-down alert matches job="llm-supervisor"."""
    alerts_text = (REPO / "packaging" / "prometheus" / "alerts.yml").read_text()
    assert 'job="llm-supervisor"' in alerts_text
    monitor = _documents(BASE / "servicemonitor.yaml")[0]
    services = _documents(BASE / "services.yaml")
    selected = [
        s
        for s in services
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["llm-supervisor"]


def test_autoscaling_reads_gauges_the_daemon_exports() -> None:
    from llmsupervisor.exporter import AUTOSCALING_GAUGES

    hpa = _documents(AUTOSCALING / "hpa.yaml")[0]
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names <= set(AUTOSCALING_GAUGES)
    adapter = yaml.safe_load((AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())
    assert names <= {r["name"]["as"] for r in adapter["rules"]}
    keda = (AUTOSCALING / "keda-scaledobject.yaml").read_text()
    assert all(name in keda or name.endswith("_seconds") for name in names)
