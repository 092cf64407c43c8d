"""The tables that map every key of an engine and of the ``supervisor:`` section to its
``Field`` (kind and one-line meaning). ``schema.py`` publishes these tables as a JSON Schema and
docs/configuration.md lists them, so neither can drift from what the validator accepts.
"""

from __future__ import annotations

from typing import Final

from llmsupervisor.config.kinds import Field, _boolean, _check_section, _number, _string
from llmsupervisor.config.launcher import LAUNCHER_CHOICES
from llmsupervisor.config.spec import CANARY_KINDS
from llmsupervisor.config.values import (
    FORBIDDEN_ARGS,
    RESERVED_ARGS,
    RESERVED_ENV,
    _args,
    _command,
    _cpus,
    _detectors,
    _env,
    _gpus,
    _ladder,
    _listen,
    _name,
    _time_window,
)
from llmsupervisor.core.restarts import MIN_FAILURE_WINDOW_S

MAX_DRAIN_GRACE_S: Final = 3600.0

LOG_LEVELS: Final = ("debug", "info", "warning", "error")

ENGINE_FIELDS: Final[dict[str, Field]] = {
    # ---- what to run
    "name": Field(_name, "the engine's name in logs, status and /engines/NAME/ready; unique"),
    "model": Field(
        _string(),
        "a local directory (starts with /, ./, ../ or ~; relative to the config file; must hold "
        "config.json or a *.gguf file) or a Hugging Face hub id such as org/name",
    ),
    "gpus": Field(
        _gpus,
        "GPU indices in PCI bus order (as nvidia-smi shows them), or GPU UUIDs (GPU-..., as "
        "nvidia-smi -L shows them; resolved through NVML at start, and the engine's "
        "CUDA_VISIBLE_DEVICES names the UUIDs), or one of either; no GPU in two engines; none: no "
        "GPU (the vLLM CPU build)",
    ),
    "cpus": Field(
        _cpus,
        "CPU placement: auto (disjoint sets: the CPUs of the GPUs' NUMA node, or an even split "
        'without GPUs), or CPU ids and ranges like [0, 1] or "0-3,8"; no CPU in two engines',
    ),
    "port": Field(
        _number(lo=1, hi=65535, integer=True), "the port vLLM listens on; unique among the engines"
    ),
    "host": Field(_string(), "the address vLLM binds to (0.0.0.0 or :: serves other hosts directly)"),
    "served_model_name": Field(
        _string(), 'the id clients send as "model"; /v1/models lists it and the canary asks for it'
    ),
    "venv": Field(
        _string(),
        "the virtualenv vLLM is installed in (relative: next to the config file): runs VENV/bin/vllm "
        "serve MODEL (see launcher)",
    ),
    "launcher": Field(
        _string(choices=LAUNCHER_CHOICES),
        "with venv: serve (VENV/bin/vllm serve), module (python -m vllm.entrypoints.openai."
        "api_server, deprecated since vLLM 0.32) or auto (serve where the venv's vllm works)",
        default="auto",  # EngineSpec.launcher is what was chosen: "command" without a venv
    ),
    "command": Field(
        _command,
        "instead of venv: the program and its first arguments (a list, or one string split like a "
        "shell); the supervisor appends --model, --host, --port, --served-model-name, then args; it "
        "runs in the config file's directory, so relative paths in it and in args are next to the file",
    ),
    "args": Field(
        _args,
        "vLLM flags without the leading --: true a bare flag, false or null left out, a list "
        "repeated values after one flag, a mapping compact JSON; merged key by key with defaults",
    ),
    "env": Field(_env, "extra environment for the engine, NAME: value; merged key by key with defaults"),
    "enabled": Field(
        _boolean,
        "false: keep the engine configured but do not start it (`start NAME` starts it for this "
        "run of the daemon)",
    ),
    # ---- starting and readiness
    "start_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "from spawn to READY: /health 200, the model in /v1/models, one canary completion",
    ),
    "canary_timeout_s": Field(_number(lo=0, lo_open=True), "deadline of the canary completion at start"),
    "canary_interval_s": Field(
        _number(lo=0, lo_open=True),
        "while READY and vLLM's counters stand still, a canary this often (never while they move)",
    ),
    "live_canary_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "the longest deadline of a canary while READY (the deadline is learned from the engine's "
        "own recent canaries: live_canary_timeout_factor x the slowest of the last 8)",
    ),
    "live_canary_min_timeout_s": Field(
        _number(lo=0, lo_open=True), "the shortest deadline of a canary while READY"
    ),
    "live_canary_timeout_factor": Field(
        _number(lo=1), "the live canary's deadline: this x the slowest of the engine's last 8 canaries"
    ),
    "canary_prompt": Field(_string(), "the prompt of the one-token canary completion"),
    "canary": Field(
        _string(choices=CANARY_KINDS),
        "which canary proves the engine serves: auto (from args: embedding for --task/--convert "
        "embed, none for other pooling models, else completion), completion, chat, embedding, none",
    ),
    "api_key_file": Field(
        _string(),
        "a file whose first line is the engine's API key (relative: next to the config file): given "
        "to vLLM as VLLM_API_KEY and sent by every probe; never logged",
    ),
    "log_probe_requests": Field(
        _boolean, "true: keep vLLM's access lines for the supervisor's own probes in the journal"
    ),
    "step_heartbeat": Field(
        _boolean,
        "false: do not give vLLM the daemon's --scheduler-cls step heartbeat (hangs are then found "
        "without it, some more slowly)",
    ),
    "health_timeout_s": Field(_number(lo=0, lo_open=True), "deadline of each /health probe"),
    "metrics_interval_s": Field(
        _number(lo=0),
        "vLLM's full /metrics body is read this often (0: every tick); /health, the process sweep "
        "and the canary every tick",
    ),
    # 64 KiB to 1 GiB: below, a real vLLM body would not fit; above, parsing it takes minutes.
    "metrics_max_body_bytes": Field(
        _number(lo=64 * 1024, hi=1024**3, integer=True),
        "a /metrics body larger than this is a probe failure (read as a stream, abandoned at the cap)",
    ),
    "agent_port": Field(
        _number(lo=1, hi=65535, integer=True),
        "serve HAProxy's agent-check protocol for this engine on this port (docs/fleet.md)",
    ),
    # ---- draining and stopping
    # At most an hour: the slowest balancer's check (an AWS target group: 300 s x 10) takes 50
    # minutes to notice; more only kept a restart DRAINING (and a READY engine counted out of
    # rotation) for ever (issue 28: 1e12).
    "drain_grace_s": Field(
        _number(lo=0, hi=MAX_DRAIN_GRACE_S),
        "after leaving rotation, wait this long for load balancers to notice before stopping; "
        "also how long an engine READY again still counts as out of rotation",
    ),
    "drain_timeout_s": Field(
        _number(lo=0), "then wait at most this long for vLLM to report no running or waiting request"
    ),
    "stop_timeout_s": Field(
        _number(lo=0),
        "stop ladder 1: SIGTERM to the API server, wait this long for the process group (keep it "
        "about 15 s above args.shutdown-timeout)",
    ),
    "group_term_timeout_s": Field(_number(lo=0), "stop ladder 2: SIGTERM to the whole process group, wait"),
    "kill_timeout_s": Field(
        _number(lo=0, lo_open=True), "stop ladder 3: SIGKILL to the process group, wait for it to be gone"
    ),
    "gpu_release_timeout_s": Field(
        _number(lo=0), "after a stop, wait up to this long for NVML to show the GPU memory released"
    ),
    # ---- crashes
    "backoff_initial_s": Field(
        _number(lo=0), "failure n >= 2 within failure_window_s waits backoff_initial_s x 2^(n-2)"
    ),
    "backoff_max_s": Field(_number(lo=0), "... capped at this"),
    "backoff_jitter_ratio": Field(_number(lo=0, hi=1), "... times a random 1 +- this"),
    "max_failures": Field(
        _number(lo=1, integer=True), "this many failures within failure_window_s: FATAL, left stopped"
    ),
    "failure_window_s": Field(
        _number(lo=MIN_FAILURE_WINDOW_S),
        "the window failures are counted in (at least a minute: a shorter one would count every "
        "crash of a quick crash loop as the first)",
    ),
    "stable_after_s": Field(_number(lo=0), "READY this long clears the failure count"),
    # ---- actions
    "automatic_actions": Field(_boolean, "false: report findings (log, status, metrics), never act on them"),
    "max_actions_per_hour": Field(
        _number(lo=1, integer=True),
        "automatic actions per engine per hour (shedding and crash restarts aside)",
    ),
    "action_cooldown_s": Field(_number(lo=0), "at least this long between two automatic actions"),
    "repair_verify_s": Field(
        _number(lo=0), "after a repair short of a restart, wait this long before judging it failed"
    ),
    "ladder": Field(
        _ladder,
        "batch-size steps below the engine's own args, each setting some of max-num-batched-tokens, "
        "max-num-seqs, max-num-active-seqs (vLLM 0.32+), gpu-memory-utilization; values never rise "
        "going down; max-num-batched-tokens and max-num-seqs are in vLLM's compile cache key (a cold "
        "compile at the step's first start), the other two are not",
    ),
    "ladder_calm_s": Field(
        _number(lo=0), "this long without throttling or a preemption storm: one ladder step back up"
    ),
    "restart_every_h": Field(_number(lo=0, lo_open=True), "scheduled restart after this many hours READY"),
    "restart_jitter_s": Field(_number(lo=0), "... plus a random 0 to this many seconds"),
    "restart_window": Field(
        _time_window, 'scheduled restarts only inside this local time window, "02:00-05:00" (may wrap)'
    ),
    "detectors": Field(
        _detectors, "detector thresholds (DetectorConfig fields); merged key by key with defaults"
    ),
}
REQUIRED_ENGINE_FIELDS: Final = ("name", "model", "port")
# Fields that make no sense shared by every engine.
PER_ENGINE_ONLY: Final = frozenset({"name", "model", "gpus", "port", "served_model_name", "agent_port"})

SUPERVISOR_FIELDS: Final[dict[str, Field]] = {
    "state_dir": Field(
        _string(),
        "status.json, the control socket outside systemd, the lock, and per engine its vLLM "
        "compile cache and ladder step; a relative path is next to the config file",
    ),
    "log_level": Field(_string(choices=LOG_LEVELS), "debug, info, warning or error"),
    "tick_interval_s": Field(_number(lo=0.05, hi=60), "how often the daemon looks at every engine"),
    "http_listen": Field(
        _listen,
        "HOST:PORT of the daemon's HTTP listener (readiness, /metrics); not an engine's port or "
        "agent_port on an overlapping address",
    ),
    "shutdown_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "on SIGTERM, how long every engine's stop may take (cover stop + group_term + kill timeouts)",
    ),
    "max_unavailable": Field(
        _number(lo=1, integer=True),
        "planned actions never take more engines out of rotation at once (engines already out count)",
    ),
    "min_in_rotation": Field(
        _number(lo=0, integer=True), "load shedding keeps at least this many engines in rotation"
    ),
    "readyz_requires": Field(
        _string(choices=("all", "any")),
        "/readyz is 200 when all engines meant to serve (and not held by an operator) are in "
        "rotation, or any one (docs/fleet.md)",
    ),
    "nvml_wait_s": Field(
        _number(lo=0, hi=86400),
        "NVML not open at start (a driver that loads late): engines named by GPU index wait this long"
        " for it, then start anyway with an error logged; 0: no wait. By-UUID engines start at once"
        " (docs/gpu.md)",
    ),
    "nvml_hang_misses": Field(
        _number(lo=2, hi=1000, integer=True),
        "a GPU whose NVML calls miss this many deadlines in a row (one per tick), while other GPUs"
        " answer, is lost: its engines stop and the node condition is set (docs/gpu.md)",
    ),
}


__all__ = [
    "ENGINE_FIELDS",
    "FORBIDDEN_ARGS",
    "LOG_LEVELS",
    "PER_ENGINE_ONLY",
    "REQUIRED_ENGINE_FIELDS",
    "RESERVED_ARGS",
    "RESERVED_ENV",
    "SUPERVISOR_FIELDS",
    "_check_section",
]
