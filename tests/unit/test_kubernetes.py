"""The Kubernetes manifests (packaging/kubernetes): valid against the bundled Kubernetes schemas
(kubernetes-validate, offline), CRDs checked structurally, the probe and grace numbers in step
with the example config, the PrometheusRule in step with packaging/prometheus/alerts.yml, the
pod's QoS, security, disruption and placement settings (docs/fleet.md, "Shape 3"), and checkov's
policy checks passing with every skip justified in the manifest.

checkov runs from its own venv (scripts/setup-checkov), offline (--skip-download); without it the
checkov tests skip, and fail under ``LLMSUP_REQUIRE_TOOLS=1`` (CI). Overlays are rendered with
``kubectl kustomize`` (or ``kustomize build``) where installed; the base is also checked as the
plain files it is, so that most of it is checked without either.

ServiceMonitor, PrometheusRule and ScaledObject are CRDs (prometheus-operator, KEDA), whose
schemas kubernetes-validate does not bundle: for those the test checks the fields those
operators require, by hand.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsupervisor.config import load_config
from llmsupervisor.daemon.status import STATUS_FLUSH_TIMEOUT_S
from llmsupervisor.daemon.supervisor import LEFTOVER_KILL_TIMEOUT_S, SHUTDOWN_CANCEL_TIMEOUT_S
from tests.lib.paths import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = REPO / "packaging" / "kubernetes"
BASE = K8S / "base"
AUTOSCALING = K8S / "autoscaling"
EXAMPLE = K8S / "example"
NAMESPACE = "llm-supervisor"
CHECKOV_VERSION = "3.3.30"  # scripts/setup-checkov
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


def _kustomize() -> list[str] | None:
    """The command that renders a kustomization directory (appended), or None."""
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


def _render(directory: Path) -> list[dict[str, Any]]:
    argv = _kustomize()
    assert argv is not None
    rendered = subprocess.run([*argv, str(directory)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def test_kustomize_renders_valid_manifests() -> None:
    if _kustomize() is None:
        pytest.skip("neither kubectl nor kustomize installed")
    for directory in (BASE, AUTOSCALING, EXAMPLE):
        resources = _render(directory)
        for resource in resources:
            _validate(resource)
        kinds = {r["kind"] for r in resources}
        assert {
            "Namespace",
            "ServiceAccount",
            "Deployment",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "Service",
            "ConfigMap",
            "ServiceMonitor",
            "PrometheusRule",
        } <= kinds
        for resource in resources:
            if resource["kind"] != "Namespace":
                assert resource["metadata"]["namespace"] == NAMESPACE, resource["metadata"]["name"]
        # The generated ConfigMap's hashed name is what the Deployment mounts.
        config_map = next(r for r in resources if r["kind"] == "ConfigMap")
        template = next(r for r in resources if r["kind"] == "Deployment")["spec"]["template"]
        pod = template["spec"]
        assert {"name": "config", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
        # The PDB, the NetworkPolicy and the Services select the pods, after kustomize's labels.
        labels = template["metadata"]["labels"]
        for resource in resources:
            selector = {
                "PodDisruptionBudget": lambda r: r["spec"]["selector"]["matchLabels"],
                "NetworkPolicy": lambda r: r["spec"]["podSelector"]["matchLabels"],
                "Service": lambda r: r["spec"]["selector"],
            }.get(resource["kind"])
            if selector is not None:
                assert selector(resource).items() <= labels.items(), resource["metadata"]["name"]


def test_example_overlay_pins_gpu_product_and_image_digest() -> None:
    if _kustomize() is None:
        pytest.skip("neither kubectl nor kustomize installed")
    resources = _render(EXAMPLE)
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"]
    (container,) = pod["containers"]
    assert re.fullmatch(r"[^@:]+(:[^@]+)?@sha256:[0-9a-f]{64}", container["image"]), container["image"]
    # Pinned by digest, the overlay drops the base's skip of the digest check.
    assert not any("CKV_K8S_43" in v for v in deployment["metadata"].get("annotations", {}).values())
    for resource in resources:
        if resource["apiVersion"].startswith("monitoring.coreos.com/"):
            assert resource["metadata"]["labels"]["release"] == "prometheus"


def _deployment() -> dict[str, Any]:
    return next(d for d in _documents(BASE / "deployment.yaml") if d["kind"] == "Deployment")


def test_probe_and_grace_numbers_agree_with_the_config() -> None:
    config = load_config(BASE / "config.yaml", check_paths=False)
    pod = _deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (engine,) = config.engines
    assert ports["http"] == engine.port and engine.host == "0.0.0.0"
    assert config.supervisor.http_listen == f"0.0.0.0:{ports['metrics']}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == len(engine.gpus)

    # Whether the container lives is the daemon's loop, from the start: never an engine's
    # readiness, which a slow load plus a retry (> start_timeout_s) or a GPU condition holds
    # at 503 for longer than any startup budget (issue 27).
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"
    # /livez fails after max(10, 5 ticks) without a loop turn; a probe must not time out first.
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["timeoutSeconds"] <= max(10.0, 5 * config.supervisor.tick_interval_s)
    # One slow answer does not take the pod out of its Services...
    assert readiness["failureThreshold"] >= 2
    # ... and yet it is out of them, and the endpoint change has spread (the preStop sleep's
    # estimate), before the daemon starts to drain an engine that left rotation.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    for e in config.engines:
        assert e.drain_grace_s >= readiness["periodSeconds"] * readiness["failureThreshold"] + float(
            pre_stop[1]
        ), e.name

    # The daemon's shutdown covers a whole drain and stop ladder of every engine...
    for e in config.engines:
        stop_s = (
            e.drain_grace_s + e.drain_timeout_s + e.stop_timeout_s + e.group_term_timeout_s + e.kill_timeout_s
        )
        assert config.supervisor.shutdown_timeout_s >= stop_s, e.name
        # ... vLLM's own drain ends before the ladder's first rung does (etc/llm-supervisor/config.yaml).
        assert e.stop_timeout_s >= float(e.args.get("shutdown-timeout", 0)) + 15
    # ... and the kubelet waits for all of it, after the preStop hook, before SIGKILL.
    worst_shutdown_s = (
        float(pre_stop[1])
        + config.supervisor.shutdown_timeout_s
        + SHUTDOWN_CANCEL_TIMEOUT_S
        + STATUS_FLUSH_TIMEOUT_S
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
    from llmsupervisor.daemon.exporter import AUTOSCALING_GAUGES

    hpa = _documents(AUTOSCALING / "hpa.yaml")[0]
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names <= set(AUTOSCALING_GAUGES)
    adapter = yaml.safe_load((AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())
    assert names <= {r["name"]["as"] for r in adapter["rules"]}
    keda = (AUTOSCALING / "keda-scaledobject.yaml").read_text()
    assert all(name in keda or name.endswith("_seconds") for name in names)


def _base_resources() -> list[dict[str, Any]]:
    return _kustomization_resources(BASE)


def _one(kind: str) -> dict[str, Any]:
    (resource,) = [r for r in _base_resources() if r["kind"] == kind]
    return resource


def test_pod_is_guaranteed_qos_with_integer_cpus() -> None:
    """requests == limits for CPU and memory in every container, CPUs whole: the kubelet's static
    CPU manager then gives the pod exclusive CPUs (and the topology manager those of the GPU's
    NUMA node), which `cpus: auto` reads from the daemon's affinity."""
    pod = _deployment()["spec"]["template"]["spec"]
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert requests[resource] == limits[resource], (container["name"], resource)
        assert re.fullmatch(r"[1-9][0-9]*", str(limits["cpu"])), limits["cpu"]
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    (engine,) = load_config(BASE / "config.yaml", check_paths=False).engines
    assert engine.cpus == "auto"


# Volume types the restricted Pod Security Standard admits (no hostPath).
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def test_pod_meets_the_restricted_pod_security_profile() -> None:
    deployment = _deployment()
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == _one("ServiceAccount")["metadata"]["name"]
    assert _one("ServiceAccount")["automountServiceAccountToken"] is False
    pod_context = pod["securityContext"]
    assert pod_context["runAsNonRoot"] is True and pod_context["runAsUser"] > 0
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES, volume["name"]
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["readOnlyRootFilesystem"] is True
        assert context.get("privileged", False) is False
        assert context.get("runAsNonRoot", True) is True
        assert "hostPort" not in str(container["ports"])
        # With a read-only root, every path the daemon and vLLM write is a mounted volume.
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        config = load_config(BASE / "config.yaml", check_paths=False)
        for path in (str(config.supervisor.state_dir), env["HOME"], env["TMPDIR"], "/dev/shm"):
            assert path in mounts and not mounts[path].get("readOnly", False), path
        assert env["XDG_CACHE_HOME"].startswith(env["HOME"] + "/")
    # The image's user is the pod's (torch wants a passwd entry for its cache paths).
    containerfile = (K8S / "Containerfile").read_text()
    assert f"USER {pod_context['runAsUser']}:{pod_context['runAsGroup']}" in containerfile
    assert f"--uid {pod_context['runAsUser']}" in containerfile
    # The namespace enforces the profile on whatever an overlay patches in.
    labels = _one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_disruption_budget_spread_and_gpu_scheduling() -> None:
    deployment = _deployment()
    template = deployment["spec"]["template"]
    pod, labels = template["spec"], template["metadata"]["labels"]
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # A rollout takes no more than the budget, and waits for no spare GPU.
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
    assert deployment["spec"]["replicas"] >= 2
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["labelSelector"]["matchLabels"].items() <= labels.items()
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_network_policy_admits_only_the_named_ports_and_no_egress() -> None:
    policy = _one("NetworkPolicy")
    pod = _deployment()["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["spec"]["egress"] == []
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    for rule in policy["spec"]["ingress"]:
        assert rule["from"] and {p["port"] for p in rule["ports"]} <= port_names


def test_every_namespaced_manifest_names_the_namespace() -> None:
    """Explicit in the files too, not only through kustomize: the plain files checkov reads
    without kustomize pass its default-namespace check."""
    for resource in [*_all_resources(), *_documents(AUTOSCALING / "keda-scaledobject.yaml")]:
        if resource["kind"] in {"Namespace", "ConfigMap"}:  # the ConfigMap gets it from kustomize
            continue
        assert resource["metadata"].get("namespace") == NAMESPACE, resource["metadata"]["name"]
    assert yaml.safe_load((BASE / "kustomization.yaml").read_text())["namespace"] == NAMESPACE


def _checkov() -> Path:
    venv = Path(
        os.environ.get("LLMSUP_CHECKOV_VENV")
        or Path.home() / ".cache" / "llm-supervisor" / f"checkov-{CHECKOV_VERSION}"
    )
    checkov = venv / "bin" / "checkov"
    if not checkov.exists():
        if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
            pytest.fail(f"checkov is required (LLMSUP_REQUIRE_TOOLS=1): scripts/setup-checkov ({checkov})")
        pytest.skip(f"checkov not installed ({checkov}): scripts/setup-checkov")
    return checkov


def _skip_annotations(resources: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(kind.name, check id) -> reason, from checkov's `checkov.io/skipN: CKV_ID=reason`."""
    skips: dict[tuple[str, str], str] = {}
    for resource in resources:
        for key, value in resource["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                skips[(f"{resource['kind']}.{resource['metadata']['name']}", check)] = reason.strip()
    return skips


def _run_checkov(checkov: Path, directory: Path) -> dict[str, Any]:
    # --skip-download: no call to Prisma Cloud (no API key either) or anywhere else; the checks
    # are the ones bundled in the pinned release.
    done = subprocess.run(
        [str(checkov), "--skip-download", "--framework", "kubernetes", "--directory", str(directory)]
        + ["--output", "json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "BC_API_KEY": "", "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert isinstance(report, dict), report  # one framework, one report
    return report


def _assert_checkov_clean(report: dict[str, Any], resources: list[dict[str, Any]]) -> None:
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
        for c in report["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 80  # it did check the pod, not an empty directory
    # Every skip is one of ours, in the manifest, with a reason.
    skips = _skip_annotations(resources)
    for check in report["results"]["skipped_checks"]:
        kind, name = check["resource"].split(".")[:2]
        reason = skips.get((f"{kind}.{name}", check["check_id"]))
        assert reason and len(reason) > 20, check


def test_checkov_passes_the_plain_base() -> None:
    checkov = _checkov()
    report = _run_checkov(checkov, BASE)
    _assert_checkov_clean(report, _base_resources())
    assert report["summary"]["resource_count"] >= 10


@pytest.mark.parametrize("directory", [BASE, AUTOSCALING, EXAMPLE], ids=lambda d: d.name)
def test_checkov_passes_the_rendered_overlays(directory: Path, tmp_path: Path) -> None:
    checkov = _checkov()
    if _kustomize() is None:
        pytest.skip("neither kubectl nor kustomize installed")
    resources = _render(directory)
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump_all(resources))
    report = _run_checkov(checkov, tmp_path)
    _assert_checkov_clean(report, resources)
    # Every rendered object was read (checkov also counts the pod's containers).
    assert report["summary"]["resource_count"] >= len(resources)
