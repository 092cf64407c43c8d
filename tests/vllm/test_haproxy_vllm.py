"""Zero failed requests through a real load balancer while engines restart.

HAProxy (the Debian package) balances two real vLLM CPU engines and health-checks each through
the supervisor's ``/engines/NAME/ready`` (one backend; ``uri-lf`` puts the server's own name in
the check's path). Under steady concurrent load:

1. a config change to both engines rolls them one at a time, each drained first (e2 runs with
   vLLM's own drain off, shutdown-timeout 0: only the supervisor's drain protects its requests);
2. a thermal throttle (fake GPU file) steps e1 one ladder step down, drained first;
   -> zero failed requests, with HAProxy's retries off so nothing masks a failure;
3. the control: the same restart with the drain switched off in the config fails requests,
   so this test can fail.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.lib.daemon import Daemon, free_port, wait_for
from tests.lib.haproxy import haproxy
from tests.lib.load import Load
from tests.lib.vllm_env import READY_TIMEOUT_S, build_model, vllm_engine, vllm_python

pytestmark = pytest.mark.vllm_cpu

HAPROXY_CFG = """\
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 180s
    timeout server 180s
    # A check answered late is not a server down: the supervisor shares 2 loaded cores with two
    # engines here (without this, a check times out after `inter`, and with `fall 1` a single
    # slow answer took both servers out at once on CI).
    timeout check 3s
    retries 0                       # no retry may hide a failed request from this test
frontend llm
    bind 127.0.0.1:{frontend_port}
    default_backend engines
backend engines
    balance leastconn
    option httpchk
    # One backend, one check path per server: the server's name is the engine's name.
    http-check send meth GET uri-lf /engines/%[srv_name]/ready
    default-server inter 500ms fall 2 rise 2
    server e1 127.0.0.1:{e1_port} check addr 127.0.0.1 port {supervisor_port}
    server e2 127.0.0.1:{e2_port} check addr 127.0.0.1 port {supervisor_port}
"""


MAX_TOKENS = 48


def _judge(resp: httpx.Response) -> tuple[str, str]:
    """A request succeeded only if it got every token it asked for. vLLM aborting in-flight
    requests on SIGTERM (shutdown-timeout 0) answers 200 with finish_reason "abort" and a
    truncated text: a failure for the client all the same."""
    if resp.status_code != 200:
        return f"http {resp.status_code}", resp.text[:200]
    body = resp.json()
    choice = body["choices"][0]
    tokens = body.get("usage", {}).get("completion_tokens")
    if choice.get("finish_reason") != "length" or tokens != MAX_TOKENS:
        return f"truncated ({choice.get('finish_reason')})", f"{tokens} of {MAX_TOKENS} tokens"
    return "ok", ""


BODY = {"model": "tiny", "prompt": "steady load", "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _load(url: str) -> Load:
    """Four workers, every answer judged by ``_judge``; 180 s for a request on 2 loaded cores."""
    return Load(url, body=BODY, judge=_judge, timeout_s=180).start()


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    haproxy_bin = haproxy()
    model = build_model(python, "tiny")
    tmp = tmp_path_factory.mktemp("haproxy")
    home = tmp / "home"
    home.mkdir()
    gpu = tmp / "gpu.json"
    gpu.write_text(json.dumps({"gpus": [{"index": 0, "temperature_c": 50}]}))
    ports = {"e1": free_port(), "e2": free_port(), "frontend": free_port(), "supervisor": free_port()}
    engines = [
        vllm_engine(
            "e1",
            ports["e1"],
            model,
            home,
            gpus=[0],
            ladder=[{"max-num-seqs": 4}],
            ladder_calm_s=3600,
            detectors={"sustain_s": {"thermal": 1}},
        ),
        # vLLM's own drain off (shutdown-timeout 0: SIGTERM aborts whatever is in flight), so
        # that only the supervisor's drain stands between e2's restarts and failed requests.
        vllm_engine("e2", ports["e2"], model, home),
    ]
    for engine in engines:
        # Out of rotation 5 s (the default) before the stop: HAProxy checks every 0.5 s, and its
        # checks are slower on a loaded 2-core host (CI). Then wait for the
        # engine's own gauges to reach zero; vLLM's own drain (shutdown-timeout 5) comes after.
        engine.update({"drain_grace_s": 5.0, "drain_timeout_s": 60})
        engine["args"] = {**engine["args"], "max-num-seqs": 8}
    engines[1]["args"]["shutdown-timeout"] = 0
    config = {
        "supervisor": {
            "tick_interval_s": 1.0,
            "shutdown_timeout_s": 120,
            "http_listen": f"127.0.0.1:{ports['supervisor']}",
        },
        "engines": engines,
    }
    daemon = Daemon(tmp, config, run_args=("--fake-gpu", str(gpu)))
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(
        HAPROXY_CFG.format(
            frontend_port=ports["frontend"],
            e1_port=ports["e1"],
            e2_port=ports["e2"],
            supervisor_port=ports["supervisor"],
        )
    )
    subprocess.run([haproxy_bin, "-c", "-f", str(cfg)], check=True, capture_output=True)
    daemon.start()
    proxy = subprocess.Popen(
        [haproxy_bin, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield {"daemon": daemon, "ports": ports, "gpu": gpu, "config": config}
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        daemon.cleanup()


def reload_with(d: Daemon, config: dict[str, Any]) -> None:
    d.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    d.signal(1)  # SIGHUP


def both_ready(d: Daemon, frontend_port: int) -> None:
    """Both READY in the daemon, then both UP in HAProxy (its `rise 2` takes a second more):
    the load starts only once the balancer routes to both."""
    for name in ("e1", "e2"):
        d.wait_state(name, "ready", timeout_s=READY_TIMEOUT_S)
    url = f"http://127.0.0.1:{frontend_port}/v1/completions"
    successes: list[int] = []

    def routed_to_both() -> bool:
        resp = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=60)
        successes.append(resp.status_code)
        return successes[-6:] == [200] * 6

    wait_for(routed_to_both, timeout_s=60, what="HAProxy routing to the engines", poll_s=0.2)
    time.sleep(2.0)  # past `rise 2` x `inter 500ms` for the second server too


def test_rolling_restart_and_ladder_step_under_load_fail_no_request(lb: dict[str, Any]) -> None:
    d: Daemon = lb["daemon"]
    both_ready(d, lb["ports"]["frontend"])
    url = f"http://127.0.0.1:{lb['ports']['frontend']}/v1/completions"
    load = _load(url)
    try:
        wait_for(lambda: load.snapshot()["ok"] >= 20, timeout_s=120, what="load flowing through HAProxy")
        before = {n: d.engine(n) for n in ("e1", "e2")}
        # 1. A config change to both engines: rolled one at a time, each drained first.
        config = lb["config"]
        for engine in config["engines"]:
            engine["env"] = {**engine["env"], "LLMSUP_TEST_GENERATION": "2"}
        # e2's drain goes off in the same change, for the next test. A process is drained with
        # the settings it was started with (a new spec applies between stop and start), so this
        # restart of e2 still drains; its next one will not.
        config["engines"][1].update({"drain_grace_s": 0, "drain_timeout_s": 0})
        reload_with(d, config)
        for name in ("e1", "e2"):
            d.wait_state(name, "ready", timeout_s=READY_TIMEOUT_S, restarts=before[name]["restarts"] + 1)
        log = d.log()
        # One at a time: e2 left rotation only after e1 was back.
        e1_back = log.index("[e1] STARTING -> READY", log.index("[e1] READY -> DRAINING"))
        assert e1_back < log.index("[e2] READY -> DRAINING")
        # 2. A thermal throttle on e1's GPU: one ladder step down, drained first.
        lb["gpu"].write_text(
            json.dumps({"gpus": [{"index": 0, "temperature_c": 92, "clock_event_reasons": ["hw_thermal"]}]})
        )
        d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, batch_step=1)
        assert "[e1] action step_down (thermal)" in d.log()
        wait_for(lambda: load.snapshot()["ok"] >= 20 + 10, timeout_s=120, what="load after the restarts")
    finally:
        results = load.stop()
    assert results["ok"] > 0
    seconds = sorted({f.split()[0] for f in load.failures})
    transitions = [
        line
        for line in d.log().splitlines()
        if " -> " in line or "action " in line or "loop ran" in line or "took" in line
    ]
    assert len(load.failures) == 0, f"{results} at {seconds}: {load.failures[:3]}; daemon: {transitions}"
    # HAProxy's checks reset their connections: the client leaving, never a logged error.
    assert "HTTP connection failed" not in d.log()


def test_without_the_drain_the_same_restart_fails_requests(lb: dict[str, Any]) -> None:
    d: Daemon = lb["daemon"]
    both_ready(d, lb["ports"]["frontend"])
    url = f"http://127.0.0.1:{lb['ports']['frontend']}/v1/completions"
    load = _load(url)
    try:
        wait_for(lambda: load.snapshot()["ok"] >= 10, timeout_s=120, what="load flowing through HAProxy")
        config = lb["config"]
        e2 = config["engines"][1]
        # No grace for the load balancer and no wait for in-flight requests; e2 runs with vLLM's
        # shutdown-timeout 0, so SIGTERM aborts what is in flight. The running process must have
        # been started with those settings (the previous test's change did that; alone, this
        # test makes that change first, drained).
        if e2["drain_grace_s"] != 0:
            e2.update({"drain_grace_s": 0, "drain_timeout_s": 0})
            before = d.engine("e2")
            reload_with(d, config)
            d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
        before = d.engine("e2")
        e2["env"] = {
            **e2["env"],
            "LLMSUP_TEST_GENERATION": str(int(e2["env"].get("LLMSUP_TEST_GENERATION", "1")) + 1),
        }
        reload_with(d, config)
        d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
    finally:
        results = load.stop()
    assert load.failures, f"expected failed requests without the drain: {results}"
