"""The real daemon with engines the canary could not serve before (issue 13), against the fake
vLLM: an engine that demands an API key, an embedding model; and what the daemon writes about
them (the key in no log line, status.json, /metrics, doctor output or process listing; no access
lines for its own probes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.lib.daemon import fake_engine, free_port

pytestmark = pytest.mark.system

KEY = "sk-fake-engine-key-5f0c1d2e3a4b"
ARGS_KEY = "sk-in-the-args-9a8b7c6d5e"


def _post(port: int, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers, timeout=5)


def _key_file(tmp_path: Path) -> Path:
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    return key_file


def test_an_engine_with_an_api_key_becomes_ready_and_the_key_shows_nowhere(daemon_factory, tmp_path: Path):
    keyed, legacy, plain = free_port(), free_port(), free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine(
                    "keyed", keyed, api_key_file=str(_key_file(tmp_path)), env={"HF_TOKEN": "hf_x1y2"}
                ),
                # The old way: the key on vLLM's command line. It works too, and is masked.
                fake_engine("legacy", legacy, args={"api-key": ARGS_KEY}),
                # No key: a VLLM_API_KEY in the daemon's own environment must not reach it (the
                # probes would not know that key and the engine would never turn READY).
                fake_engine("plain", plain),
            ]
        }
    )
    d.start(extra_env={"VLLM_API_KEY": "daemon-env-key"})
    ready = d.wait_state("keyed", "ready")
    d.wait_state("legacy", "ready")
    plain_engine = d.wait_state("plain", "ready")
    assert "VLLM_API_KEY" not in psutil.Process(plain_engine["pid"]).environ()
    # READY took /v1/models and a canary completion, both behind the key.

    # vLLM guards /v1/*: the supervisor's probes got through only with the key.
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    assert _post(keyed, "/v1/completions", completion).status_code == 401
    assert _post(keyed, "/v1/completions", completion, KEY).status_code == 200
    assert _post(legacy, "/v1/completions", completion, ARGS_KEY).status_code == 200

    # Passed in the environment, so it is in no command line (`ps` shows those to every user).
    engine = psutil.Process(ready["pid"])
    assert engine.environ()["VLLM_API_KEY"] == KEY
    assert KEY not in " ".join(engine.cmdline())

    # Nowhere the daemon writes: its log (the spawn line, forwarded vLLM lines), the status file,
    # its /metrics, the CLI's status, doctor.
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    status_file = (d.state_dir / "status.json").read_text()
    cli = [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path)]
    status_cli = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60, check=False)
    doctor = subprocess.run([*cli, "doctor"], capture_output=True, text=True, timeout=120, check=False)
    assert "api key (engine keyed)" in doctor.stdout + doctor.stderr
    log = d.log()
    for where, text in {
        "log": log,
        "status.json": status_file,
        "/metrics": metrics,
        "status": status_cli.stdout + status_cli.stderr,
        "doctor": doctor.stdout + doctor.stderr,
    }.items():
        for secret in (KEY, ARGS_KEY, "hf_x1y2"):
            assert secret not in text, f"{secret} in {where}"
    assert "--api-key ***" in log  # the legacy engine's spawn line, masked

    # The probes' access lines stay out of the journal; a client's request line does not.
    assert '"GET /health' not in log and '"GET /metrics' not in log and '"GET /v1/models' not in log
    assert '"POST /v1/completions HTTP/1.1" 401' in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert d.stop() == 0


def test_an_embedding_engine_becomes_ready_with_canary_auto(daemon_factory):
    port = free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine("embed", port, args={"task": "embed"}, canary_interval_s=0.3),
            ]
        }
    )
    d.start()
    d.wait_state("embed", "ready")
    # The readiness canary embedded (a completion would fail on this engine); its own access
    # line is not in the journal (issue 26: the daemon's probes are not the operator's noise).
    assert d.engine("embed")["canary_requests"] >= 1
    assert '"POST /v1/embeddings HTTP/1.1" 200' not in d.log()
    # A completion canary could never have passed: the model serves no completions.
    assert _post(port, "/v1/completions", {"model": "tiny", "prompt": "hi"}).status_code == 400
    embedded = _post(port, "/v1/embeddings", {"model": "tiny", "input": "hi"})
    assert embedded.status_code == 200 and embedded.json()["data"]
    # Live canaries embed too, and are counted as the supervisor's own requests, not traffic.
    d.wait_state("embed", "ready", timeout_s=30)
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    canaries = [
        line
        for line in metrics.splitlines()
        if line.startswith('llmsupervisor_engine_canary_requests_total{engine="embed"}')
    ]
    assert canaries and float(canaries[0].split()[-1]) >= 1
    assert d.stop() == 0
