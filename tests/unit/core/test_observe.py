"""Observation details that matter for the daemon's memory (a window keeps ~1,200 per engine)."""

from __future__ import annotations

import pytest

from llmsupervisor.core.observe import Observation
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics


def test_observations_without_gpus_share_one_read_only_empty_view() -> None:
    a, b = Observation(engine="e", at_s=1.0), Observation(engine="e", at_s=2.0, gpus={})
    assert a.gpus is b.gpus
    assert dict(a.gpus) == {}
    with pytest.raises(TypeError):
        a.gpus[0] = None  # type: ignore[index]


def test_finish_reasons_are_interned() -> None:
    body = 'vllm:request_success_total{engine="0",finished_reason="length"} 3.0\n'
    a, b = parse_metrics(body), parse_metrics(body)
    assert isinstance(a, EngineMetrics) and isinstance(b, EngineMetrics)
    assert a.request_success_total_by_reason is not None and b.request_success_total_by_reason is not None
    (ka,), (kb,) = a.request_success_total_by_reason, b.request_success_total_by_reason
    assert ka == "length" and ka is kb
