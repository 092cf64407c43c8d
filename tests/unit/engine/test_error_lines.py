"""Issue 39, point 1: an engine that dies at start with an error line its own runtime printed
(Python's `can't open file`, `No module named`, argparse's `error:`, a shell's `not found`, a
traceback's last line whatever the exception's name) says that line in `status`: the failure's
reason ends with it, the status carries it alone (`last_error_line`), and the table's reason of
a BACKOFF or FATAL engine begins with it, so that a narrow terminal shows it too."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from llmsupervisor.cli import render
from llmsupervisor.core.state import EngineState
from llmsupervisor.engine.output import SYSTEM_NOT_READY_RE, OutputForwarder, with_error_line
from tests.lib.runner_harness import Harness, run, spec

S = EngineState
CANT_OPEN = "can't open file '/etc/llm-supervisor/serve.py': [Errno 2] No such file or directory"


def last_error_line(lines: list[str], *, stderr: bool = True) -> str | None:
    """What the forwarder keeps as the last error line after reading ``lines``."""

    async def go() -> str | None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        forwarder = OutputForwarder("a", 1, (out_r, err_r), lambda _seen: None)
        os.write(err_w if stderr else out_w, "".join(line + "\n" for line in lines).encode())
        os.close(out_w)
        os.close(err_w)
        await forwarder.close()
        return forwarder.last_error_line

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("lines", "kept"),
    [
        # Python itself, the program cut to its name (the log line keeps the whole path).
        ([f"/opt/venv/bin/python3: {CANT_OPEN}"], f"python3: {CANT_OPEN}"),
        (["/opt/venv/bin/python: No module named vllm"], "python: No module named vllm"),
        (
            [
                "/usr/bin/python3: Error while finding module specification for 'vllm.entrypoints.x' "
                "(ModuleNotFoundError: No module named 'vllm')"
            ],
            "python3: Error while finding module specification for 'vllm.entrypoints.x' "
            "(ModuleNotFoundError: No module named 'vllm')",
        ),
        # argparse (vLLM's own command line), after its usage line.
        (
            [
                "usage: vllm serve [-h] [--host HOST] ...",
                "vllm serve: error: unrecognized arguments: --bogus",
            ],
            "vllm serve: error: unrecognized arguments: --bogus",
        ),
        # A shell or env that could not find the program.
        (["sh: 1: vllm: not found"], "sh: 1: vllm: not found"),
        (["bash: vllm: command not found"], "bash: vllm: command not found"),
        (["env: 'vllm': No such file or directory"], "env: 'vllm': No such file or directory"),
        # A traceback's last line, whatever the exception is called.
        (
            ["Traceback (most recent call last):", '  File "serve.py", line 1, in <module>', "StopIteration"],
            "StopIteration",
        ),
        (
            [
                "Traceback (most recent call last):",
                '  File "serve.py", line 1, in <module>',
                "ModuleNotFoundError: No module named 'vllm'",
            ],
            "ModuleNotFoundError: No module named 'vllm'",
        ),
        # vLLM's EngineCore, its lines behind the process prefix; a chained traceback's last one.
        (
            [
                "(EngineCore_DP0 pid=12) ERROR 11-27 10:00:00 [core.py:1] EngineCore failed to start.",
                "(EngineCore_DP0 pid=12) Traceback (most recent call last):",
                '(EngineCore_DP0 pid=12)   File "core.py", line 1, in run',
                "(EngineCore_DP0 pid=12) ValueError: head_dim 16 is not supported",
            ],
            "(EngineCore_DP0 pid=12) ValueError: head_dim 16 is not supported",
        ),
        (
            [
                "Traceback (most recent call last):",
                '  File "a.py", line 1',
                "KeyError: 'x'",
                "",
                "During handling of the above exception, another exception occurred:",
                "",
                "Traceback (most recent call last):",
                '  File "b.py", line 2',
                "huggingface_hub.errors.LocalEntryNotFoundError: offline",
            ],
            "huggingface_hub.errors.LocalEntryNotFoundError: offline",
        ),
        # Nothing to quote: progress, warnings, a leak report.
        (
            [
                "INFO 11-27 10:00:00 [api_server.py:1] vLLM API server version 0.32.0",
                "WARNING 11-27 10:00:01 [config.py:9] the chat template was not found",
                "nanobind: leaked 3 instances!",
            ],
            None,
        ),
    ],
)
def test_the_line_a_failure_quotes(lines: list[str], kept: str | None) -> None:
    assert last_error_line(lines) == kept


def test_the_newest_error_line_wins_on_either_pipe() -> None:
    assert last_error_line(["ERROR 11-27 [a.py:1] first", "python3: No module named x"], stderr=False) == (
        "python3: No module named x"
    )


def test_an_engine_that_dies_at_start_says_why_in_its_status(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=2, backoff_initial_s=1.0))
        h.server.ready_after_s = 1e9  # it never listens: it dies first
        for n in (1, 2):
            await h.until(lambda s: s.state is S.STARTING and len(h.procs.spawned) == n)  # noqa: B023
            proc = h.procs.spawned[-1]
            proc.say(f"/usr/bin/python3: {CANT_OPEN}", stderr=True)
            await asyncio.sleep(0.1)
            proc.exit(code=2)
        status = await h.state(S.FATAL)
        line = f"python3: {CANT_OPEN}"
        assert status.last_error_line == line
        assert status.last_failure is not None and status.last_failure.endswith(
            f"with code 2 during start (waiting for /health): {line}"
        )
        assert line in status.state_reason and "giving up" in status.state_reason
        # The table leads with it; the JSON's reason keeps the daemon's words around it.
        engine = {"state": "fatal", "reason": status.state_reason, "last_error_line": line}
        detail = render.status_rows({"e": engine})[1][-1]
        assert detail.startswith(f"{line}; process exited with code 2"), detail
        assert detail.endswith("giving up (llm-supervisor start e retries)")
        await h.close()

    run(scenario)


def test_a_failure_without_a_line_clears_the_last_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=3, backoff_initial_s=1.0))
        h.server.ready_after_s = 1e9
        await h.until(lambda s: s.state is S.STARTING and len(h.procs.spawned) == 1)
        h.procs.spawned[-1].say("bash: vllm: command not found", stderr=True)
        await asyncio.sleep(0.1)
        h.procs.spawned[-1].exit(code=127)
        status = await h.published(lambda s: s.state is S.BACKOFF)
        assert status.last_error_line == "bash: vllm: command not found"
        await h.until(lambda s: s.state is S.STARTING and len(h.procs.spawned) == 2)
        h.procs.spawned[-1].exit(code=1)  # silent
        status = await h.published(lambda s: s.state is S.BACKOFF)
        assert status.last_error_line is None
        assert render.dying_reason({"state": "backoff", "reason": status.state_reason}) is None
        await h.close()

    run(scenario)


def test_only_a_dying_engine_leads_with_the_line() -> None:
    ready = {"state": "ready", "reason": "ready", "last_error_line": "ValueError: old"}
    assert render.dying_reason(ready) is None
    fatal = {"state": "fatal", "reason": "x: ValueError: y; giving up", "last_error_line": "ValueError: y"}
    assert render.dying_reason(fatal) == "ValueError: y; x; giving up"


TORCH_802 = (
    "(EngineCore_DP0 pid=12) RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda"
    " functions before calling NumCudaDevices() that might have already set an error? Error 802: system"
    " not yet initialized"
)


def test_cuda_error_802_at_start_is_explained_as_the_gpu_fabric(tmp_path: Path) -> None:
    """Issue 36, M6: on an HGX box whose Fabric Manager is not running CUDA fails with 802 ("system
    not yet initialized", cudaErrorSystemNotReady). vLLM's own last words come after the worker's
    (``Engine core initialization failed``): the failure's reason still says what 802 means."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=3, backoff_initial_s=1.0))
        h.server.ready_after_s = 1e9
        await h.until(lambda s: s.state is S.STARTING and len(h.procs.spawned) == 1)
        proc = h.procs.spawned[-1]
        proc.say(TORCH_802, stderr=True)
        proc.say("RuntimeError: Engine core initialization failed. See root cause above.", stderr=True)
        await asyncio.sleep(0.1)
        proc.exit(code=1)
        status = await h.published(lambda s: s.state is S.BACKOFF)
        assert (
            status.last_error_line == "RuntimeError: Engine core initialization failed. See root cause above."
        )
        assert status.last_failure is not None
        assert status.last_failure.endswith(
            "CUDA error 802 (system not yet initialized): on an NVSwitch (HGX) box the GPU fabric is not"
            " ready; is Fabric Manager running? (systemctl status nvidia-fabricmanager; docs/gpu.md)"
        )
        # The next failure, without 802, says nothing of the fabric.
        await h.until(lambda s: s.state is S.STARTING and len(h.procs.spawned) == 2)
        h.procs.spawned[-1].say("ValueError: bad model", stderr=True)
        await asyncio.sleep(0.1)
        h.procs.spawned[-1].exit(code=1)
        status = await h.published(
            lambda s: s.state is S.BACKOFF and s.last_error_line == "ValueError: bad model"
        )
        assert status.last_failure is not None and "fabric" not in status.last_failure
        await h.close()

    run(scenario)


def test_the_802_hint_is_added_once() -> None:
    once = with_error_line("exited with code 1", "RuntimeError: Error 802", system_not_ready=True)
    assert once.count("Fabric Manager") == 1
    assert with_error_line(once, None, system_not_ready=True) == once
    assert SYSTEM_NOT_READY_RE.search("CUDA_ERROR_SYSTEM_NOT_READY") and SYSTEM_NOT_READY_RE.search(
        "cudaErrorSystemNotReady"
    )
    assert not SYSTEM_NOT_READY_RE.search("Error 8020: something else")
