"""Engines the canary could not serve before issue 13, and what the daemon writes about them:

- ``redact``: secrets out of log lines, the spawn line, errors, ``doctor`` lines, status reasons;
- ``api_key_file``: read at load (clear problems when it cannot be), VLLM_API_KEY to vLLM, a
  Bearer token on every probe, the key in no process listing the daemon prints;
- the canary's kind (``canary: auto|completion|chat|embedding|none``) and its requests;
- the canary's own requests and tokens taken out of the degradation spans and the served load;
- probe access lines kept out of the journal (vLLM's flag where it has it, else the filter);
- the down clock behind the LlmSupervisorEngineDown alert.

System tests with real processes are in tests/system/test_system_fake.py (fake vLLM) and
tests/vllm/test_vllm_cpu.py (real vLLM).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmsupervisor import logs
from llmsupervisor.config import EngineSpec, load_config
from llmsupervisor.config.spec import canary_kind_from_args
from llmsupervisor.core.observe import Observation, ObservationWindow, canary_load
from llmsupervisor.detectors.degradation import span_stats
from llmsupervisor.detectors.load import served_load
from llmsupervisor.doctor import DoctorCheck, Identity, Level, check_api_key_file
from llmsupervisor.engine import access_log
from llmsupervisor.engine.http import VllmHttp
from llmsupervisor.engine.launch import launch
from llmsupervisor.engine.output import is_probe_access_line
from llmsupervisor.errors import ConfigError, PortHeld
from llmsupervisor.probes import health
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.probe_http import ProbeHttp
from llmsupervisor.probes.vllm_metrics import EngineMetrics
from llmsupervisor.redact import MASK, RedactFilter, redact, redact_env, register_secret, secret_env_name
from tests.lib.canned_http import canned_server, reply

KEY = "sk-test-0123456789abcdef"

# ---- redact ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("python -m vllm --api-key s3cr3t --port 8001", "python -m vllm --api-key *** --port 8001"),
        ("python -m vllm --api-key=s3cr3t --port 8001", "python -m vllm --api-key=*** --port 8001"),
        ("vllm --hf-token 'hf_abc' --x", "vllm --hf-token '*** --x"),
        ("HF_TOKEN=hf_abc PATH=/bin", "HF_TOKEN=*** PATH=/bin"),
        ('{"OPENAI_API_KEY": "sk-1", "HOME": "/root"}', '{"OPENAI_API_KEY": "***", "HOME": "/root"}'),
        ("DB_PASSWORD: hunter2", "DB_PASSWORD: ***"),
        ("AWS_SECRET_ACCESS_KEY='abc'", "AWS_SECRET_ACCESS_KEY='***"),
        ("Authorization: Bearer abc.def", "Authorization: Bearer ***"),
        # Evidence and ordinary words are not secrets.
        ("generation_tokens_total=120 max_tokens: 1", "generation_tokens_total=120 max_tokens: 1"),
        ("KV cache 97% full; port 8001", "KV cache 97% full; port 8001"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text).replace("'***'", "'***") == expected.replace("'***'", "'***")
    assert "s3cr3t" not in redact(text) and "hunter2" not in redact(text)


def test_a_registered_secret_is_masked_anywhere() -> None:
    register_secret(KEY)
    assert redact(f"HTTP 401 for key {KEY}!") == f"HTTP 401 for key {MASK}!"
    assert redact(f"x{KEY}y") == f"x{MASK}y"
    register_secret("ab")  # too short to be a key: masking it would garble ordinary text
    assert redact("about") == "about"


def test_redact_a_command_line_and_env() -> None:
    # The spawn line logs the argv joined; the handlers' filter masks it (no argv-level copy).
    argv = ["python", "-m", "vllm", "--api-key", "k1", "--api-key=k2", "--port", "1", "HF_TOKEN=xyz"]
    assert redact(" ".join(argv)).split() == [
        "python",
        "-m",
        "vllm",
        "--api-key",
        MASK,
        f"--api-key={MASK}",
        "--port",
        "1",
        f"HF_TOKEN={MASK}",
    ]
    env = {"VLLM_API_KEY": "k", "HF_TOKEN": "t", "MY_SECRET_X": "s", "DB_PASSWORD": "p", "PATH": "/bin"}
    assert redact_env(env) == {**{k: MASK for k in env if k != "PATH"}, "PATH": "/bin"}
    assert secret_env_name("vllm_api_key") and not secret_env_name("KEYBOARD")


def test_the_log_filter_redacts_every_record_and_its_traceback() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    httpx_log, httpcore_log = logging.getLogger("httpx"), logging.getLogger("httpcore")
    saved = root.handlers[:], root.level, httpx_log.level, httpcore_log.level
    logs.setup("info", stream=stream)
    try:
        log = logging.getLogger("llmsupervisor.test")
        log.info("spawned pid %d: %s", 12, "vllm --api-key topsecret1 --port 1")
        logging.getLogger("llmsupervisor.engine.output").info("%s", "env HF_TOKEN=hf_leak")
        try:
            raise RuntimeError("failed with --api-key=topsecret2")
        except RuntimeError:
            log.exception("boom")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        httpx_log.setLevel(saved[2])
        httpcore_log.setLevel(saved[3])
    text = stream.getvalue()
    assert "topsecret" not in text and "hf_leak" not in text, text
    assert "--api-key *** --port 1" in text and "HF_TOKEN=***" in text


def test_errors_doctor_lines_and_port_holders_are_redacted() -> None:
    held = PortHeld(8001, 77, "python -m vllm --api-key leaked1 --port 8001")
    assert "leaked1" not in str(held)
    check = DoctorCheck("engine a", Level.FAIL, "python failed: --api-key leaked2")
    assert "leaked2" not in str(check) and "leaked2" not in check.detail


# ---- api_key_file ---------------------------------------------------------------------------


def _config(tmp_path: Path, extra: str, *, key_text: str | None = KEY + "\n") -> Path:
    if key_text is not None:
        key_file = tmp_path / "engine.key"
        key_file.write_text(key_text)
        key_file.chmod(0o600)
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            engines:
              - name: a
                model: org/model
                port: 8001
                command: [{sys.executable}, -m, vllm.entrypoints.openai.api_server]
            """
        ).lstrip()
        + textwrap.indent(textwrap.dedent(extra).strip(), "    ")
        + "\n"
    )
    return path


def _problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return [str(p) for p in info.value.problems]


def test_api_key_file_is_read_relative_to_the_config_and_never_shown(tmp_path: Path) -> None:
    spec = load_config(_config(tmp_path, "api_key_file: engine.key")).engines[0]
    assert spec.api_key_file == str(tmp_path / "engine.key")
    assert spec.api_key == spec.bearer_key == KEY
    assert KEY not in repr(spec) and KEY not in " ".join(spec.argv())
    assert redact(f"key {KEY}") == f"key {MASK}"  # registered when the config was loaded


@pytest.mark.parametrize(
    ("key_text", "message"),
    [
        (None, "cannot read api_key_file"),
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("two words\n", "holds whitespace"),
        ("x" * 5000, "over 4096 bytes"),
    ],
)
def test_a_bad_api_key_file_is_a_config_problem(tmp_path: Path, key_text: str | None, message: str) -> None:
    (problem,) = _problems(_config(tmp_path, "api_key_file: engine.key", key_text=key_text))
    assert ":6: engines[0].api_key_file: " in problem and message in problem, problem


def test_an_unreadable_api_key_file_is_a_config_problem(tmp_path: Path) -> None:
    path = _config(tmp_path, "api_key_file: engine.key")
    if os.geteuid() == 0:
        (tmp_path / "engine.key").unlink()
        (tmp_path / "engine.key").mkdir()  # root reads any file: a directory fails for root too
    else:
        (tmp_path / "engine.key").chmod(0)
    (problem,) = _problems(path)
    assert "cannot read api_key_file" in problem and KEY not in problem


def test_check_config_reports_the_key_file_and_exits_78(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmsupervisor.cli import main as cli

    path = _config(tmp_path, "api_key_file: missing.key", key_text=None)
    assert cli.main(["check-config", str(path)]) == 78
    assert "api_key_file" in capsys.readouterr().err


def test_two_keys_are_a_config_problem(tmp_path: Path) -> None:
    problems = _problems(
        _config(
            tmp_path,
            """
            api_key_file: engine.key
            args: {api-key: other}
            env: {VLLM_API_KEY: third}
            """,
        )
    )
    assert any("args.api-key: set either 'api_key_file'" in p for p in problems), problems
    assert any("env.VLLM_API_KEY: set either 'api_key_file'" in p for p in problems), problems
    assert all("other" not in p and "third" not in p for p in problems)


def _spec(**changes: Any) -> EngineSpec:
    return EngineSpec(name="a", model="m", gpus=(), port=8001, command=("vllm",), **changes)


def test_bearer_key_comes_from_the_file_else_env_else_args() -> None:
    assert _spec().bearer_key is None
    assert _spec(api_key="from-file", env={"VLLM_API_KEY": "e"}).bearer_key == "from-file"
    assert _spec(env={"VLLM_API_KEY": "from-env"}).bearer_key == "from-env"
    assert _spec(args={"api-key": ["one", "two"]}).bearer_key == "one"
    assert _spec(args={"api-key": "solo"}).bearer_key == "solo"


class _Procs:
    """Just enough of ``Processes`` for ``launch``: records the spawn."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.spawned: list[tuple[list[str], dict[str, str]]] = []

    async def port_holders(self, port: int, host: str) -> list[int | None]:
        return []

    def spawn(self, argv: list[str], env: dict[str, str], cpus: Sequence[int] = ()) -> Any:
        self.spawned.append((argv, dict(env)))

        class Proc:
            pid = pgid = 4242

        return Proc()

    async def record_group(self, engine: str, pid: int) -> None:
        pass


def test_launch_passes_the_key_in_the_environment_never_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "inherited-by-the-daemon")
    procs = _Procs(tmp_path)
    spec = _spec(api_key=KEY)
    with caplog.at_level(logging.INFO, logger="llmsupervisor.engine"):
        launched = asyncio.run(launch(spec, 0, procs))  # type: ignore[arg-type]
    assert launched.failure == ""
    argv, env = procs.spawned[0]
    assert env["VLLM_API_KEY"] == KEY and KEY not in " ".join(argv)
    assert KEY not in caplog.text
    # Without a key of its own, an engine does not inherit the daemon's: the probes would not
    # know it and the engine would never turn READY.
    asyncio.run(launch(_spec(), 0, procs))  # type: ignore[arg-type]
    assert "VLLM_API_KEY" not in procs.spawned[1][1]


def test_the_spawn_line_masks_an_api_key_in_args(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    procs = _Procs(tmp_path)
    with caplog.at_level(logging.INFO, logger="llmsupervisor.engine"):
        asyncio.run(launch(_spec(args={"api-key": "in-args-key"}), 0, procs))  # type: ignore[arg-type]
    argv, env = procs.spawned[0]
    assert "in-args-key" in argv and "VLLM_API_KEY" not in env  # vLLM takes --api-key first
    # Masked where it leaves: by the filter every handler carries (redact.py), not at the source.
    record = next(r for r in caplog.records if "spawned pid" in r.getMessage())
    assert RedactFilter().filter(record)
    spawn_line = record.getMessage()
    assert "in-args-key" not in spawn_line and "--api-key ***" in spawn_line


def test_a_port_check_and_a_group_record_that_get_no_answer_neither_block_nor_lose_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both are blocking reads and writes of the host, so they run in threads under deadlines:
    a port check the host does not answer in time is skipped (a held port still fails vLLM's
    bind), and a group record the disk does not take fails the start (a successor daemon could
    not find the group)."""

    class Slow(_Procs):
        async def port_holders(self, port: int, host: str) -> list[int | None]:
            raise TimeoutError

        async def record_group(self, engine: str, pid: int) -> None:
            raise TimeoutError

    procs = Slow(tmp_path)
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.engine"):
        launched = asyncio.run(launch(_spec(), 0, procs))  # type: ignore[arg-type]
    assert "port 8001; not checked" in caplog.text
    assert len(procs.spawned) == 1 and launched.proc is not None
    assert launched.failure == "cannot record the process group in the state dir: the disk did not answer"


def test_doctor_checks_the_key_file_for_the_daemons_user(tmp_path: Path) -> None:
    key = tmp_path / "engine.key"
    key.write_text(KEY)
    key.chmod(0o600)
    spec = _spec(api_key_file=str(key))
    owner = Identity(name="owner", uid=os.geteuid(), gids=frozenset({os.getegid()}))
    stranger = Identity(name="nobody", uid=65534, gids=frozenset({65534}))
    assert check_api_key_file(spec, owner).level is Level.OK
    assert check_api_key_file(spec, stranger).level is Level.FAIL
    key.chmod(0o644)
    assert check_api_key_file(spec, owner).level is Level.WARN  # every user may read it
    assert check_api_key_file(_spec(api_key_file=str(tmp_path / "nope")), owner).level is Level.FAIL
    assert all(KEY not in str(check_api_key_file(spec, who)) for who in (owner, stranger))


# ---- the canary's kind and requests ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kind"),
    [
        ({}, "completion"),
        ({"task": "embed"}, "embedding"),
        ({"task": "embedding"}, "embedding"),
        ({"runner": "pooling", "convert": "embed"}, "embedding"),
        ({"convert": "embed"}, "embedding"),
        ({"runner": "pooling"}, "none"),
        ({"task": "classify"}, "none"),
        ({"task": "score"}, "none"),
        ({"runner": "generate"}, "completion"),
        ({"max-num-seqs": 8}, "completion"),
    ],
)
def test_canary_auto_reads_the_engines_flags(args: dict[str, Any], kind: str) -> None:
    assert canary_kind_from_args(args) == kind
    assert _spec(args=args).canary_kind == kind
    assert _spec(args=args, canary="chat").canary_kind == "chat"  # an explicit kind wins


def test_canary_field_is_checked(tmp_path: Path) -> None:
    (problem,) = _problems(_config(tmp_path, "canary: rerank", key_text=None))
    assert "engines[0].canary: must be one of auto, completion, chat, embedding, none" in problem
    spec = load_config(_config(tmp_path, "canary: Embedding", key_text=None)).engines[0]
    assert spec.canary_kind == "embedding"


def serve_endpoints(requests: list[httpx.Request], *, status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        path = request.url.path
        if status != 200:
            return httpx.Response(status, json={"error": "Unauthorized"})
        if path == "/v1/embeddings":
            return httpx.Response(
                200, json={"data": [{"embedding": [0.1, 0.2]}], "usage": {"prompt_tokens": 2}}
            )
        if path in ("/v1/completions", "/v1/chat/completions"):
            usage = {"prompt_tokens": 3, "completion_tokens": 1}
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, text="")

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    ("kind", "path", "tokens"),
    [
        ("completion", "/v1/completions", (3, 1)),
        ("chat", "/v1/chat/completions", (3, 1)),
        ("embedding", "/v1/embeddings", (2, 0)),
    ],
)
def test_each_canary_kind_sends_its_request_with_the_key(
    kind: str, path: str, tokens: tuple[int, int]
) -> None:
    requests: list[httpx.Request] = []

    async def go() -> tuple[HttpCheck, HttpCheck, HttpCheck, list[tuple[str, dict[str, str]]]]:
        # /health goes through the probes' own client, to a real local server.
        async with serve_endpoints(requests) as client, canned_server(lambda p, h: reply(200)) as server:
            probe = ProbeHttp(server.url)
            http = VllmHttp(client, _spec(canary=kind, api_key=KEY), probe)
            try:
                return (
                    await http.canary(timeout_s=5),
                    await http.models(timeout_s=5),
                    await http.health(timeout_s=5),
                    server.requests,
                )
            finally:
                probe.close()

    canary, models, health_check, probed = asyncio.run(go())
    assert canary.ok and models.ok and health_check.ok
    assert (canary.prompt_tokens, canary.generation_tokens) == tokens
    assert [r.url.path for r in requests] == [path, "/v1/models"]
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in requests)
    assert [(p, h["authorization"]) for p, h in probed] == [("/health", f"Bearer {KEY}")]
    body = json.loads(requests[0].content)
    assert ("messages" in body) == (kind == "chat") and ("input" in body) == (kind == "embedding")


def test_no_key_no_authorization_header_and_a_401_is_a_failed_check() -> None:
    requests: list[httpx.Request] = []

    async def go() -> HttpCheck:
        async with serve_endpoints(requests, status=401) as client:
            return await VllmHttp(client, _spec(), ProbeHttp(_spec().base_url)).models(timeout_s=5)

    models = asyncio.run(go())
    assert not models.ok and models.detail == "HTTP 401"
    assert "authorization" not in requests[0].headers


def test_canary_none_sends_nothing() -> None:
    requests: list[httpx.Request] = []

    async def go() -> HttpCheck:
        async with serve_endpoints(requests) as client:
            return await health.canary(client, "http://x", "m", prompt="Hi", timeout_s=1, kind="none")

    assert asyncio.run(go()).ok and requests == []


# ---- canaries are not traffic ---------------------------------------------------------------


def _metrics(finished: int, prompt: int, generated: int, running: int = 0) -> EngineMetrics:
    return EngineMetrics(
        requests_running=running,
        requests_waiting=0,
        requests_swapped=0,
        kv_usage_ratio=0.1,
        preemptions_total=0,
        prompt_tokens_total=prompt,
        generation_tokens_total=generated,
        iterations_total=generated,
        prefix_cache_queries_total=None,
        prefix_cache_hits_total=None,
        request_success_total_by_reason={"length": finished},
        ttft_seconds=None,
        e2e_latency_seconds=None,
        itl_seconds=None,
        sleep_state=None,
        present=frozenset(),
    )


CANARY = HttpCheck(
    ok=True, detail="completed", latency_s=0.02, status_code=200, prompt_tokens=3, generation_tokens=1
)


def _idle_engine_with_canaries(seconds: int = 60, step_s: int = 2) -> list[Observation]:
    """An engine nobody uses but the supervisor: a canary every other tick, and its counters
    moving by exactly what the canaries asked."""
    out: list[Observation] = []
    canaries = 0
    for i, t in enumerate(range(0, seconds + 1, step_s)):
        canary = CANARY if i % 2 == 1 else None
        canaries += canary is not None
        metrics = _metrics(canaries, 3 * canaries, canaries)
        out.append(Observation(engine="a", at_s=1000.0 + t, metrics=metrics, canary=canary))
    return out


def test_canary_load_counts_the_answered_canaries_between_two_readings() -> None:
    observations = _idle_engine_with_canaries()
    load = canary_load(observations, observations[0].at_s, observations[-1].at_s)
    assert (load.requests, load.prompt_tokens, load.generation_tokens) == (15, 45, 15)
    failed = replace(observations[1], canary=replace(CANARY, ok=False, failure="timeout"))
    assert canary_load([failed], 0, 2000).requests == 0  # an aborted canary is not finished


def test_an_engine_that_only_answers_canaries_served_nothing() -> None:
    observations = _idle_engine_with_canaries()
    stats = span_stats(observations)
    assert stats is not None and stats.requests == 0
    window = ObservationWindow()
    for o in observations:
        window.append(o)
    served = served_load(window, observations[-1].at_s)
    assert served is not None and served.canary_requests == 15
    assert served.requests_per_s == served.prompt_tokens_per_s == served.generation_tokens_per_s == 0.0


def test_real_traffic_is_counted_without_the_canaries() -> None:
    observations = []
    for i, t in enumerate(range(0, 61, 2)):
        canaries = (i + 1) // 2
        real = 10 * i  # 5 requests/s, 20 prompt and 8 generated tokens each
        metrics = _metrics(real + canaries, 20 * real + 3 * canaries, 8 * real + canaries, running=8)
        canary = CANARY if i % 2 == 1 else None
        observations.append(Observation(engine="a", at_s=1000.0 + t, metrics=metrics, canary=canary))
    window = ObservationWindow()
    for o in observations:
        window.append(o)
    served = served_load(window, observations[-1].at_s)
    assert served is not None
    assert served.requests_per_s == pytest.approx(5.0)
    assert served.prompt_tokens_per_s == pytest.approx(100.0)
    assert served.generation_tokens_per_s == pytest.approx(40.0)
    stats = span_stats(observations)
    assert stats is not None and stats.requests == 300
    assert stats.tokens_per_s_per_running == pytest.approx(40.0 / 8)


def test_a_counter_reset_gives_no_rate() -> None:
    window = ObservationWindow()
    window.append(Observation(engine="a", at_s=0.0, metrics=_metrics(100, 100, 100)))
    window.append(Observation(engine="a", at_s=2.0, metrics=_metrics(1, 1, 1)))
    served = served_load(window, 2.0)
    assert served is not None and served.requests_per_s is None
    assert served_load(ObservationWindow(), 0.0) is None


# ---- probe access lines ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "probe"),
    [
        ('INFO:     127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK', True),
        ('INFO:     127.0.0.1:40312 - "GET /metrics HTTP/1.1" 200 OK', True),
        ('INFO:     127.0.0.1:40312 - "GET /v1/models HTTP/1.1" 200 OK', True),
        ('(APIServer pid=7) INFO 11-23 10:00:00 [h.py:1] 127.0.0.1:5 - "GET /metrics HTTP/1.1" 200', True),
        ('INFO:     127.0.0.1:40312 - "GET /health?x=1 HTTP/1.1" 200 OK', True),
        ('INFO:     10.0.0.9:40312 - "POST /v1/completions HTTP/1.1" 200 OK', False),
        ('INFO:     10.0.0.9:40312 - "POST /v1/chat/completions HTTP/1.1" 200 OK', False),
        ('INFO:     10.0.0.9:40312 - "GET /v1/models/m HTTP/1.1" 200 OK', False),
        ('INFO:     10.0.0.9:40312 - "GET /healthz HTTP/1.1" 404 Not Found', False),
        ("INFO 11-23 Starting vLLM server on http://127.0.0.1:8001 (/health ready soon)", False),
    ],
)
def test_probe_access_lines(line: str, probe: bool) -> None:
    assert is_probe_access_line(line) is probe


def _fake_install(prefix: Path, *, with_flag: bool) -> Path:
    cli_args = prefix / "lib" / "python3.11" / "site-packages" / "vllm" / "entrypoints" / "launchers"
    cli_args.mkdir(parents=True)
    text = "disable_access_log_for_endpoints: str | None = None\n" if with_flag else "x = 1\n"
    (cli_args / "cli_args.py").write_text(text)
    (prefix / "bin").mkdir()
    python = prefix / "bin" / "python"
    python.symlink_to(sys.executable)
    return python


def test_the_flag_is_added_only_where_vllm_has_it(tmp_path: Path) -> None:
    new = _fake_install(tmp_path / "new", with_flag=True)
    old = _fake_install(tmp_path / "old", with_flag=False)
    command = [str(new), "-m", "vllm.entrypoints.openai.api_server"]
    flags = access_log.probe_access_flags(command, {}, log_probe_requests=False)
    assert flags == ["--disable-access-log-for-endpoints", "/health,/metrics,/v1/models"]
    assert access_log.probe_access_flags([str(old)], {}, log_probe_requests=False) == []
    assert access_log.probe_access_flags(command, {}, log_probe_requests=True) == []
    operator = {"disable-access-log-for-endpoints": "/ping"}
    assert access_log.probe_access_flags(command, operator, log_probe_requests=False) == []
    assert access_log.probe_access_flags(["no-such-program-here"], {}, log_probe_requests=False) == []
