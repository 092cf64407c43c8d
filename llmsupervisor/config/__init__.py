"""Configuration: YAML in, frozen dataclasses out, every problem named by file, line and field.

The file has three top-level sections::

    supervisor:   # the daemon's own settings (state dir, log level, tick, HTTP listener)
    defaults:     # any engine key but name, model, gpus, port and served_model_name; applied
                  # to every engine (``env``, ``args`` and ``detectors`` merged key by key)
    engines:      # a list of engines; a minimal one is four lines (name, model, gpus, port)

``load_config`` never raises on bad *content*: it collects every problem it can find into a
``ConfigError`` whose ``problems`` render as ``PATH:LINE: field: what is wrong``, the shape
compilers use, so editors and CI annotate them. Only after the whole file validates does a
``SupervisorConfig`` exist, which is what lets a reload keep the old config on any problem.

The modules, each importing only the ones above it:

- ``spec``: the frozen result (``EngineSpec``, ``SupervisorSettings``, ``SupervisorConfig``)
  and ``render_args``.
- ``problems``: YAML nodes to data with the line of every node; the problem collector.
- ``kinds``: ``Kind`` and ``Field``, the generic kinds (numbers, strings, booleans) and the
  section check.
- ``values``: the domain kinds (GPUs, CPUs, commands, args, env, ladder, detectors, ...).
- ``fields``: the key -> field tables of an engine and of ``supervisor:``.
- ``checks``: one engine's entry to an ``EngineSpec``, and the checks between engines.
- ``listeners``: every address the config listens on, against the others.
- ``load``: ``load_config`` and the top-level sections; relative paths next to the file.
- ``schema``: the JSON Schema and the field reference, generated from the ``fields`` tables.
- ``reload_plan``: a reload as a pure diff of two validated configs (used by daemon/reload.py).
"""

from llmsupervisor.config.fields import (
    ENGINE_FIELDS,
    FORBIDDEN_ARGS,
    LOG_LEVELS,
    PER_ENGINE_ONLY,
    REQUIRED_ENGINE_FIELDS,
    RESERVED_ARGS,
    RESERVED_ENV,
    SUPERVISOR_FIELDS,
)
from llmsupervisor.config.launcher import VLLM_API_SERVER_MODULE
from llmsupervisor.config.load import DEFAULT_CONFIG_PATH, TOP_LEVEL, load_config, state_dir_named_in
from llmsupervisor.config.spec import (
    LADDER_FLAGS,
    EngineSpec,
    SupervisorConfig,
    SupervisorSettings,
    render_args,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENGINE_FIELDS",
    "FORBIDDEN_ARGS",
    "LADDER_FLAGS",
    "LOG_LEVELS",
    "PER_ENGINE_ONLY",
    "REQUIRED_ENGINE_FIELDS",
    "RESERVED_ARGS",
    "RESERVED_ENV",
    "SUPERVISOR_FIELDS",
    "TOP_LEVEL",
    "VLLM_API_SERVER_MODULE",
    "EngineSpec",
    "SupervisorConfig",
    "SupervisorSettings",
    "load_config",
    "render_args",
    "state_dir_named_in",
]
