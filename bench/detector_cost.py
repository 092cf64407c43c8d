"""CPU time of ``detect_all`` per engine per tick on a full observation window.

bench/overhead measures the daemon for a minute, when the window is young: the degradation
baseline is pinned only after 10 minutes of traffic and the window fills in ~31. This replays a
busy engine at the default 2 s tick (the captured vLLM 0.32 body, counters advancing, one
process) until both are full, then times 200 more ticks of append + ``detect_all``, as the
engine's loop runs them.

    python bench/detector_cost.py                      # this checkout
    python bench/detector_cost.py --against /tmp/old   # and another checkout's detectors, alternating
    python bench/detector_cost.py --memory             # a full window's memory, whole vs thinned

With ``--against`` both run five times, alternating, and the findings of both are compared on
every replayed tick (they must be identical).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not whichever the venv has installed
from llmsupervisor import detectors  # noqa: E402
from llmsupervisor.core.observe import Observation, ObservationWindow  # noqa: E402
from llmsupervisor.probes.host import ProcInfo, ProcSample  # noqa: E402
from llmsupervisor.probes.vllm_metrics import EngineMetrics, Histogram, parse_metrics  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32.0-cpu.txt"
TICK_S = 2.0
FILL_TICKS = 1232  # 41 minutes: the ring is full and the baseline pinned
TIMED_TICKS = 200


def busy_engine(base: EngineMetrics) -> Iterator[Observation]:
    """A busy engine: 4 running, 5 requests and 80 tokens finished per tick, TTFTs spread over
    the captured body's buckets, RSS growing slowly."""
    assert base.ttft_seconds is not None
    les = base.ttft_seconds.les
    for i in range(1, FILL_TICKS + TIMED_TICKS + 1):
        finished = 5 * i
        # Cumulative: a fifth of the requests under each of the 4th..7th bounds, all by the 8th.
        ttft = [min(finished, finished * max(0, k - 2) // 5) for k in range(len(les))]
        metrics = replace(
            base,
            requests_running=4,
            requests_waiting=0,
            iterations_total=10 * i,
            generation_tokens_total=80 * i,
            prompt_tokens_total=1000 * i,
            prefix_cache_queries_total=1000 * i,
            prefix_cache_hits_total=500 * i,
            request_success_total_by_reason=MappingProxyType({"length": finished}),
            ttft_seconds=Histogram(buckets=zip(les, ttft, strict=True), sum=0.1 * finished, count=finished),
        )
        rss_bytes = 2_000_000_000 + 1000 * i
        proc = ProcSample(
            pgid=7,
            processes=(
                ProcInfo(
                    pid=7,
                    title="vllm serve",
                    rss_bytes=rss_bytes,
                    cpu_seconds=1.0,
                    status="sleeping",
                    zombie=False,
                ),
            ),
            rss_bytes_total=rss_bytes,
            cpu_seconds_total=1.0,
            process_count=1,
            zombie_count=0,
        )
        yield Observation(
            engine="gpu0", at_s=i * TICK_S, metrics=metrics, proc=proc, engine_pids=frozenset({7})
        )


def load_detectors(checkout: Path) -> ModuleType:
    """Another checkout's detectors, a module (detectors.py) or a package (detectors/), on this
    checkout's core and probes.

    A package's modules import each other as ``llmsupervisor.detectors.*``: the other checkout's
    is put under that name while it loads, then this checkout's is put back.
    """
    name = "llmsupervisor.detectors"
    package = checkout / "llmsupervisor" / "detectors"

    def ours(module: str) -> bool:
        return module == name or module.startswith(name + ".")

    saved = {k: m for k, m in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    try:
        if package.is_dir():
            spec = importlib.util.spec_from_file_location(
                name, package / "__init__.py", submodule_search_locations=[str(package)]
            )
        else:
            spec = importlib.util.spec_from_file_location(name, package.with_suffix(".py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up, and submodules their package
        spec.loader.exec_module(module)
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


def ms_per_tick(module: ModuleType, observations: list[Observation]) -> float:
    cfg = module.DetectorConfig()
    window = module.new_window(cfg)
    for obs in observations[:FILL_TICKS]:
        window.append(obs)
    assert window.baseline_span is not None, "no baseline pinned"
    started = time.process_time()
    for obs in observations[FILL_TICKS:]:
        window.append(obs)
        module.detect_all(window, obs.at_s, cfg)
    return (time.process_time() - started) / TIMED_TICKS * 1000


def findings(module: ModuleType, observations: list[Observation]) -> list[list[tuple[object, ...]]]:
    cfg = module.DetectorConfig()
    window = module.new_window(cfg)
    out = []
    for obs in observations:
        window.append(obs)
        found = module.detect_all(window, obs.at_s, cfg)
        out.append([(f.kind.value, f.severity.value, dict(f.evidence), f.since_s) for f in found])
    return out


VLLM_TITLES = (
    "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model /models/llama-3-8b-instruct "
    "--host 127.0.0.1 --port 8001 --served-model-name llama --max-num-seqs 64",
    "VLLM::EngineCore",
    "VLLM::Worker_TP0",
    "/opt/vllm/bin/python -c from multiprocessing.resource_tracker import main;main(11)",
)


COUNTERS = (
    "requests_running",
    "requests_waiting",
    "iterations_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "request_success_total_by_reason",
    "ttft_seconds",
)


def as_vllm(obs: Observation, *, metrics: bool, body: str) -> Observation:
    """``obs`` as the daemon keeps it for a real vLLM engine: four processes, each with its
    command line, and ``/metrics`` only on the rounds that read it, parsed from the body as
    each scrape is (its own objects, not ones shared with the other observations)."""
    assert isinstance(obs.proc, ProcSample) and isinstance(obs.metrics, EngineMetrics)
    fresh = parse_metrics(body) if metrics else None
    if fresh is not None:
        assert isinstance(fresh, EngineMetrics)
        fresh = replace(fresh, **{name: getattr(obs.metrics, name) for name in COUNTERS})
    rss = obs.proc.rss_bytes_total
    procs = tuple(
        ProcInfo(
            pid=7 + k, title=title, rss_bytes=rss // 4, cpu_seconds=obs.at_s, status="sleeping", zombie=False
        )
        for k, title in enumerate(VLLM_TITLES)
    )
    proc = replace(obs.proc, processes=procs, process_count=4, at_s=obs.at_s)
    return replace(obs, proc=proc, metrics=fresh)


def window_bytes(observations: list[Observation], *, thinned: bool, metrics_every: int) -> int:
    """Python memory one engine's full window holds (tracemalloc), the observations built inside
    the trace so that what the window keeps is what is counted."""
    cfg = detectors.DetectorConfig()
    body = FIXTURE.read_text()
    parse_metrics(body)  # the series keys are parsed once per daemon, outside the window
    tracemalloc.start()
    if thinned:
        window = detectors.new_window(cfg)
    else:  # as before issue 16: every observation whole, the baseline's 301 kept
        window = ObservationWindow(
            max_count=4096,
            max_age_s=cfg.lookback_s + 2 * cfg.stale_after_s,
            baseline_s=cfg.degradation_baseline_s,
            baseline_accept=lambda obs: detectors.baseline_has_traffic(obs, cfg),
        )
    before = tracemalloc.get_traced_memory()[0]
    for i, obs in enumerate(observations):
        window.append(as_vllm(obs, metrics=i % metrics_every == 0, body=body))
    assert window.baseline_span is not None
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, help="another checkout whose detectors to compare")
    p.add_argument("--memory", action="store_true", help="a full window's memory, before and after thinning")
    args = p.parse_args()
    base = parse_metrics(FIXTURE.read_text())
    assert isinstance(base, EngineMetrics)
    if args.memory:
        observations = list(busy_engine(base))[:FILL_TICKS]
        whole = window_bytes(observations, thinned=False, metrics_every=1)
        thin = window_bytes(observations, thinned=True, metrics_every=2)
        print("full window, one engine (41 min at a 2 s tick, a 4-process vLLM group):")
        print(f"  whole observations, baseline kept, /metrics every round: {whole / 1e6:.2f} MB")
        print(f"  thinned, baseline as statistics, /metrics every other round: {thin / 1e6:.2f} MB")
        print(f"  at 8 engines: {8 * whole / 1e6:.1f} MB -> {8 * thin / 1e6:.1f} MB")
        return
    observations = list(busy_engine(base))
    modules = {"this": detectors}
    if args.against is not None:
        modules["against"] = load_detectors(args.against)
    runs: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(5 if args.against else 3):
        for name, module in modules.items():
            runs[name].append(ms_per_tick(module, observations))
    for name, values in runs.items():
        print(
            f"{name}: detect_all {statistics.median(values):.3f} ms per tick (median; runs "
            + " ".join(f"{v:.3f}" for v in values)
            + ")"
        )
    if args.against is not None:
        same = findings(modules["this"], observations) == findings(modules["against"], observations)
        print("findings identical on every tick" if same else "FINDINGS DIFFER")


if __name__ == "__main__":
    main()
