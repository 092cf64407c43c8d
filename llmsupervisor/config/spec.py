"""The typed, frozen result of a config file: one ``EngineSpec`` per engine, the daemon's own
``SupervisorSettings``, and ``SupervisorConfig`` holding both. Nothing here reads YAML or
reports problems: ``load_config`` (``load.py``, with ``fields.py`` and ``checks.py``) builds
them only from a file that validated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from llmsupervisor.core.policy import EngineRules
from llmsupervisor.core.restarts import RestartPolicy, StopLadder
from llmsupervisor.detectors import DetectorConfig
from llmsupervisor.errors import ConfigProblem

# The flags a ladder step may change: the ones that trade throughput for memory and heat.
# max-num-active-seqs (vLLM 0.32's scheduler) caps the requests admitted into RUNNING without
# resizing the model runner: the warm step down for max-num-seqs, which it may not exceed.
LADDER_FLAGS: Final = (
    "max-num-batched-tokens",
    "max-num-seqs",
    "max-num-active-seqs",
    "gpu-memory-utilization",
)
# Of those, the ones in vLLM's torch.compile cache key (vllm 0.32 config/scheduler.py
# SchedulerConfig.compute_hash): a step that changes them compiles from scratch at its first start.
# Neither max-num-active-seqs nor gpu-memory-utilization is in it.
COMPILE_KEY_FLAGS: Final = ("max-num-batched-tokens", "max-num-seqs")

# What the canary asks of an engine: a one-token completion or chat reply, one embedding, or
# nothing (readiness is then /health and /v1/models alone).
CANARY_KINDS: Final = ("auto", "completion", "chat", "embedding", "none")
# vLLM flags that make an engine a pooling model, which serves no completions: with `--task embed`
# (older releases), `--runner pooling` or `--convert embed` (0.10 and later) the canary embeds.
_EMBED_VALUES: Final = frozenset({"embed", "embedding"})
_POOLING_VALUES: Final = frozenset({"pooling", "classify", "score", "reward", "rerank"})


def canary_kind_from_args(args: Mapping[str, Any]) -> str:
    """The canary ``auto`` picks from an engine's vLLM flags: ``embedding`` for an embedding
    model, ``none`` for another pooling model (classify, score, reward: no endpoint every such
    model serves), else ``completion``."""
    values = {str(args.get(flag, "")).lower() for flag in ("task", "runner", "convert")}
    if values & _EMBED_VALUES:
        return "embedding"
    if values & _POOLING_VALUES:
        return "none"
    return "completion"


# One source for the defaults an EngineSpec shares with the runtime objects it builds.
_RESTART: Final = RestartPolicy()
_STOP: Final = StopLadder()


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One vLLM engine: what to run, where, and how patiently to treat it."""

    name: str
    model: str
    # NVML indices. An engine whose config names its GPUs by UUID has them in ``gpu_uuids``, and
    # ``gpus`` stays () until the daemon (or doctor) resolves them through NVML (``with_gpus``).
    gpus: tuple[int, ...]
    port: int
    gpu_uuids: tuple[str, ...] = ()
    # CPU placement (core/placement.py): the configured list, "auto", or () for none; and the
    # CPUs the engine is bound to (the list itself, or auto's share once the daemon placed it).
    cpus: tuple[int, ...] | str = ()
    placement: tuple[int, ...] = ()
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    command: tuple[str, ...] = ()
    # How `command` was chosen (config/launcher.py): "serve" (`vllm serve MODEL`), "module"
    # (`python -m ...api_server --model MODEL`) or "command" (the engine's own), and why.
    launcher: str = "command"
    launcher_reason: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True
    start_timeout_s: float = 900.0
    drain_grace_s: float = 5.0
    drain_timeout_s: float = 120.0
    # The stop ladder's and the restart policy's defaults are theirs (core/restarts.py).
    stop_timeout_s: float = _STOP.main_term_timeout_s
    group_term_timeout_s: float = _STOP.group_term_timeout_s
    kill_timeout_s: float = _STOP.kill_timeout_s
    canary_timeout_s: float = 30.0
    canary_interval_s: float = 2.0
    # The live canary's deadline is learned from the engine's own recent canaries, as TCP learns
    # its retransmission timeout: live_canary_timeout_factor x the slowest of the last few,
    # within [live_canary_min_timeout_s, live_canary_timeout_s] (engine/observer.py).
    live_canary_timeout_s: float = 3.0
    live_canary_min_timeout_s: float = 1.0
    live_canary_timeout_factor: float = 4.0
    canary_prompt: str = "Hello"
    canary: str = "auto"  # one of CANARY_KINDS; see canary_kind
    # The engine's API key: read from api_key_file when the config is loaded (never shown:
    # repr=False), passed to vLLM as VLLM_API_KEY, sent by every probe as a Bearer token.
    api_key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)
    # Whether vLLM's access-log lines for the supervisor's own probes (/health, /metrics,
    # /v1/models) reach the journal; off, they are 85 % of all log lines.
    log_probe_requests: bool = False
    # The step heartbeat (engine/heartbeat.py): --scheduler-cls with the daemon's plugin where the
    # engine's vLLM takes it; false leaves the engine's scheduler alone (hangs found without it).
    step_heartbeat: bool = True
    health_timeout_s: float = 5.0
    # A /metrics body larger than this is a parse failure, read no further (8 MiB; vLLM's ~60 kB).
    metrics_max_body_bytes: int = 8 * 1024 * 1024
    # The full /metrics body (50 kB, the largest share of the daemon's CPU) is read every
    # metrics_interval_s, /health, the process sweep and (when the counters stand still) the
    # canary every round: liveness from the cheap signals, load and trends from the expensive one.
    metrics_interval_s: float = 4.0
    backoff_initial_s: float = _RESTART.backoff_initial_s
    backoff_max_s: float = _RESTART.backoff_max_s
    backoff_jitter_ratio: float = _RESTART.backoff_jitter_ratio
    max_failures: int = _RESTART.max_failures
    failure_window_s: float = _RESTART.failure_window_s
    stable_after_s: float = _RESTART.stable_after_s
    # Actions (policy.py): what the supervisor may do about findings, and how often.
    automatic_actions: bool = True
    max_actions_per_hour: int = 6
    action_cooldown_s: float = 60.0
    # Batch-size ladder: steps below the engine's own args, each overriding LADDER_FLAGS.
    ladder: tuple[Mapping[str, Any], ...] = ()
    ladder_calm_s: float = 1800.0
    repair_verify_s: float = 300.0
    restart_every_h: float | None = None
    restart_jitter_s: float = 600.0
    restart_window: tuple[int, int] | None = None  # minutes of the local day, [start, end)
    gpu_release_timeout_s: float = 30.0
    # HAProxy agent-check port for this engine (llmsupervisor/daemon/agent.py); None: no agent.
    agent_port: int | None = None
    # Built from `defaults.detectors` and the engine's own `detectors` (the engine's keys win)
    # while the file is validated. Compares by value, so a reload sees a changed threshold.
    detectors: DetectorConfig = field(default_factory=DetectorConfig)

    @property
    def model_id(self) -> str:
        """The id `/v1/models` lists and the canary asks for."""
        return self.served_model_name or self.model

    @property
    def canary_kind(self) -> str:
        """The canary this engine gets: its ``canary`` field, or for ``auto`` what its flags say."""
        return self.canary if self.canary != "auto" else canary_kind_from_args(self.args)

    @property
    def bearer_key(self) -> str | None:
        """The key the probes send: the api_key_file's, else a VLLM_API_KEY in the engine's env,
        else an ``api-key`` in its args (vLLM takes a list; any one of them works)."""
        if self.api_key:
            return self.api_key
        if self.env.get("VLLM_API_KEY"):
            return self.env["VLLM_API_KEY"]
        value = self.args.get("api-key")
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        return str(value) if value not in (None, False, True, "") else None

    @property
    def gpu_count(self) -> int:
        """How many GPUs the engine is configured on, resolved or not."""
        return len(self.gpu_uuids) or len(self.gpus)

    @property
    def unresolved_gpus(self) -> bool:
        """Named by UUID and not yet resolved to NVML indices: not to be started."""
        return len(self.gpus) != self.gpu_count

    @property
    def cuda_devices(self) -> tuple[int | str, ...]:
        """CUDA_VISIBLE_DEVICES: the UUIDs where the config names them (CUDA accepts them, and
        they hold whatever order CUDA numbers the GPUs in), else the NVML indices."""
        return self.gpu_uuids or self.gpus

    def with_gpus(self, index_of: Mapping[str, int]) -> EngineSpec | list[str]:
        """This spec with its UUIDs resolved to NVML indices (``index_of``: UUID -> index, as
        NVML opened them), or the UUIDs NVML does not list."""
        if not self.gpu_uuids:
            return self
        by_lower = {uuid.lower(): index for uuid, index in index_of.items()}
        missing = [u for u in self.gpu_uuids if u.lower() not in by_lower]
        if missing:
            return missing
        return replace(self, gpus=tuple(by_lower[u.lower()] for u in self.gpu_uuids))

    @property
    def ranks(self) -> int:
        """vLLM worker processes of the engine (tensor x pipeline parallel)."""
        args = self.args
        try:
            tp = int(args.get("tensor-parallel-size", self.gpu_count or 1))
            pp = int(args.get("pipeline-parallel-size", 1))
        except (TypeError, ValueError):
            return 1
        if self.gpu_count and "tensor-parallel-size" not in args and "pipeline-parallel-size" in args:
            tp = 1
        return max(1, tp * pp)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def rotation_grace_s(self) -> float:
        """How long a load balancer takes to notice that the engine left or rejoined rotation:
        the drain waits this long before stopping it (engine/stopping.py), and the policy counts
        an engine READY again as out of rotation for as long (core/policy.py). One setting says
        it, ``drain_grace_s`` (its key since the first release)."""
        return self.drain_grace_s

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            backoff_jitter_ratio=self.backoff_jitter_ratio,
            max_failures=self.max_failures,
            failure_window_s=self.failure_window_s,
            stable_after_s=self.stable_after_s,
        )

    @property
    def stop_ladder(self) -> StopLadder:
        return StopLadder(
            main_term_timeout_s=self.stop_timeout_s,
            group_term_timeout_s=self.group_term_timeout_s,
            kill_timeout_s=self.kill_timeout_s,
        )

    @property
    def rules(self) -> EngineRules:
        """What the policy reads of this engine's settings."""
        return EngineRules(
            automatic=self.automatic_actions,
            max_actions_per_hour=self.max_actions_per_hour,
            action_cooldown_s=self.action_cooldown_s,
            ladder_calm_s=self.ladder_calm_s,
            repair_verify_s=self.repair_verify_s,
            restart_window=self.restart_window,
            rotation_grace_s=self.rotation_grace_s,
        )

    def step_args(self, step: int) -> Mapping[str, Any]:
        """The flags the ladder overrides at ``step`` (0: none; the engine's own args)."""
        merged: dict[str, Any] = {}
        for overrides in self.ladder[: max(0, step)]:
            merged.update(overrides)  # a step that leaves a flag out keeps the step above's value
        return merged

    def args_at(self, step: int) -> dict[str, Any]:
        """The engine's own args with the ladder's overrides at ``step``."""
        return {**self.args, **self.step_args(step)}

    def argv(self, step: int = 0) -> list[str]:
        """The full command line: command, then the flags the supervisor owns, then `args`
        (with the ladder step's overrides)."""
        # `vllm serve` takes the model as its positional argument (--model is deprecated there).
        model = [self.model] if self.launcher == "serve" else ["--model", self.model]
        argv = [*self.command, *model, "--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        args = self.args_at(step)
        many = self.gpu_count > 1
        if many and "tensor-parallel-size" not in args and "pipeline-parallel-size" not in args:
            # One engine over several GPUs means tensor parallelism over all of them.
            args["tensor-parallel-size"] = self.gpu_count
        return argv + render_args(args)


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorSettings:
    state_dir: Path = Path("/var/lib/llm-supervisor")
    log_level: str = "info"
    tick_interval_s: float = 2.0
    http_listen: str = "127.0.0.1:9400"
    shutdown_timeout_s: float = 100.0
    max_unavailable: int = 1  # planned actions never take more engines out of rotation
    min_in_rotation: int = 1  # load shedding keeps at least this many engines in rotation
    # /readyz: "all" engines meant to serve must be in rotation, or "any" one (docs/fleet.md).
    readyz_requires: str = "all"
    # NVML not open at start: engines named by GPU index wait this long for it, then start
    # anyway, loudly (0: no wait). Engines named by UUID start at once (docs/gpu.md).
    nvml_wait_s: float = 300.0
    # A GPU whose NVML calls miss this many deadlines in a row, while the others answer, is lost.
    nvml_hang_misses: int = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    path: Path
    supervisor: SupervisorSettings
    engines: tuple[EngineSpec, ...]
    # Valid but costly choices (check-config prints them, the daemon logs them at load).
    warnings: tuple[ConfigProblem, ...] = ()

    def engine(self, name: str) -> EngineSpec:
        for spec in self.engines:
            if spec.name == name:
                return spec
        raise KeyError(name)


def render_args(args: Mapping[str, Any]) -> list[str]:
    """Map ``{"max-num-seqs": 64, "enforce-eager": True}`` to vLLM flags.

    True renders a bare flag; False and None render nothing (write ``no-<flag>: true`` for
    vLLM's negative flags); a list renders its items after one flag; a mapping renders as JSON,
    which is how vLLM takes ``--compilation-config`` and friends.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out
