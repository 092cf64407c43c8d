#!/usr/bin/env python3
"""Writes base/prometheusrule.yaml from packaging/prometheus/alerts.yml: the same groups and
rules, wrapped as a prometheus-operator PrometheusRule. One source of truth for the alerts;
tests/unit/test_kubernetes.py fails when the two disagree. Run after editing alerts.yml:

    python3 packaging/kubernetes/gen_prometheusrule.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
OUTPUT = HERE / "base" / "prometheusrule.yaml"

HEADER = """\
# Generated from packaging/prometheus/alerts.yml by packaging/kubernetes/gen_prometheusrule.py;
# do not edit by hand (tests/unit/test_kubernetes.py checks that the two agree).
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line PromQL and descriptions stay readable as literal blocks.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(alerts: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "llm-supervisor", "namespace": "llm-supervisor"},
        "spec": {"groups": alerts["groups"]},
    }


def render(alerts_text: str) -> str:
    rule = prometheus_rule(yaml.safe_load(alerts_text))
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)


def main() -> None:
    OUTPUT.write_text(render(ALERTS.read_text()))


if __name__ == "__main__":
    main()
