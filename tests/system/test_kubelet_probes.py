"""The probe contract a kubelet relies on, against the real daemon and fake vLLM engines.

A poller plays the kubelet: it calls /livez and /readyz (and /engines/NAME/ready, as a load
balancer would) every 0.1 s for the daemon's whole life and records the answers. Over a slow
start, a hang and its repair, an operator's drain and SIGTERM, /livez stays 200 from its first
answer to the daemon's last moment, while /readyz follows the engines: a kubelet restarts the pod
only when the daemon itself is stuck, and takes it out of Services whenever an engine is.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.lib.daemon import FAST_DETECTORS, fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


@dataclass(frozen=True)
class Sample:
    at_s: float
    wall_s: float  # time.time() at the sample's start, to compare with the daemon's log
    livez: int  # 0: no answer (connection refused, timeout)
    readyz: int
    a_ready: int


class Kubelet:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _get(self, client: httpx.Client, path: str) -> int:
        try:
            return client.get(self.base_url + path, timeout=3).status_code
        except httpx.HTTPError:
            return 0

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                at_s, wall_s = time.monotonic(), time.time()
                livez, readyz = self._get(client, "/livez"), self._get(client, "/readyz")
                a_ready = self._get(client, "/engines/a/ready")
                self.samples.append(Sample(at_s, wall_s, livez, readyz, a_ready))
                self._stop.wait(0.1)

    def between(self, start_s: float, end_s: float) -> list[Sample]:
        return [s for s in self.samples if start_s <= s.at_s <= end_s]


def _get(url: str) -> httpx.Response | None:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5)
    return None


def _logged_at(log: str, text: str) -> float:
    """The Unix time of the daemon's one log line that holds ``text`` (its own clock)."""
    (line,) = [x for x in log.splitlines() if text in x]
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _status(url: str) -> int:
    response = _get(url)
    return response.status_code if response is not None else 0


def test_kubelet_sequence_over_slow_start_hang_drain_and_sigterm(daemon_factory) -> None:
    pa, pb = free_port(), free_port()
    slow = fake_engine(
        "a",
        pa,
        fake_startup_delay_s=3,  # a model load: every (re)start of a takes 3 s
        canary_interval_s=0.5,
        live_canary_timeout_s=1,
        drain_grace_s=1,
        drain_timeout_s=3,
        action_cooldown_s=0,
    )
    d = daemon_factory({"engines": [slow, fake_engine("b", pb, drain_grace_s=1)]})
    with Kubelet(d.http_url) as kubelet:
        d.start()
        # Slow start: alive at once, not ready until a has loaded (readyz_requires: all).
        wait_for(lambda: _status(d.http_url + "/livez") == 200, timeout_s=20, what="/livez 200")
        d.wait_state("b", "ready")
        wait_for(lambda: _status(d.http_url + "/readyz") == 200, timeout_s=30, what="/readyz 200")
        started = kubelet.samples
        assert any(s.livez == 200 and s.readyz == 503 and s.a_ready == 503 for s in started), started
        d.wait_state("a", "ready")

        # A hang: a's completions never answer while its /health says 200. The daemon finds it
        # and restarts a (3 s to load again): a and the pod are out of rotation, /livez stays 200.
        hang_s = time.monotonic()
        httpx.post(f"http://127.0.0.1:{pa}/fake/hang", timeout=5)
        wait_for(lambda: _status(d.http_url + "/engines/a/ready") == 503, timeout_s=40, what="a out")
        assert _status(d.http_url + "/readyz") == 503
        assert _status(d.http_url + "/livez") == 200
        d.wait_log("[a] finding hang (critical)", timeout_s=10)
        wait_for(lambda: _status(d.http_url + "/readyz") == 200, timeout_s=40, what="a repaired")
        during_hang = kubelet.between(hang_s, time.monotonic())
        assert any(s.readyz == 503 and s.a_ready == 503 for s in during_hang)

        # An operator's drain of a: a out (503 while it drains and after), but a drained engine is
        # not meant to serve, so the pod stays ready on b.
        d.cli_ok("drain", "a")
        wait_for(lambda: _status(d.http_url + "/engines/a/ready") == 503, timeout_s=10, what="a drained")
        body = _get(d.http_url + "/readyz")
        assert body is not None and body.status_code == 200, body
        assert body.json()["engines_in_rotation"] == ["b"]
        d.cli_ok("start", "a")
        wait_for(lambda: _status(d.http_url + "/engines/a/ready") == 200, timeout_s=20, what="a back")

        # A restart drains first: a is 503 while DRAINING, and the pod with it.
        d.cli_ok("restart", "a")
        d.wait_state("a", "draining")
        assert _status(d.http_url + "/engines/a/ready") == 503
        assert _status(d.http_url + "/readyz") == 503
        wait_for(lambda: _status(d.http_url + "/readyz") == 200, timeout_s=30, what="a restarted")

        # SIGTERM: /readyz 503 from the first moment, /livez 200 through the drain, exit 0.
        d.signal(signal.SIGTERM)
        readyz = wait_for(
            lambda: (r := _get(d.http_url + "/readyz")) is not None and r.status_code == 503 and r,
            timeout_s=10,
            what="/readyz 503 on SIGTERM",
        )
        assert readyz.json()["reason"] == "the daemon is shutting down"
        d.wait_state("a", "draining", timeout_s=10)
        livez = _get(d.http_url + "/livez")
        assert livez is not None and livez.status_code == 200 and livez.json()["stopping"] is True
        assert d.wait_exit(timeout_s=60) == 0
        assert _status(d.http_url + "/livez") == 0
    assert d.engine_processes() == []

    # Over the whole life: once /livez said 200 it never said anything else until the daemon's
    # last engine was stopped (its log says when; then it closes its listener and exits). By the
    # daemon's own clock, not a margin before the exit the test saw: on a loaded host the exit
    # is seen late.
    stopped_wall_s = _logged_at(d.log(), "all engines stopped")
    first_up = next(i for i, s in enumerate(kubelet.samples) if s.livez == 200)
    alive = [s for s in kubelet.samples[first_up:] if s.wall_s < stopped_wall_s]
    assert alive and all(s.livez == 200 for s in alive), [s for s in alive if s.livez != 200]
    # And no /readyz 200 was given to a check begun after the daemon began its shutdown (it sets
    # its stopping flag, then logs the line).
    shutdown_wall_s = _logged_at(d.log(), "shutting down: stopping")
    assert not [s for s in kubelet.samples if s.wall_s >= shutdown_wall_s and s.readyz == 200]


def test_a_gpu_condition_keeps_the_pod_alive_and_unready_across_a_container_restart(
    daemon_factory, tmp_path
) -> None:
    """Why the startupProbe is on /livez (issue 27): while a GPU condition holds, /readyz says 503
    until the node is repaired, also after a restart of the container on the same state (the
    pod's emptyDir). A startupProbe on /readyz killed the pod every 960 s; on /livez the daemon
    is alive at once, and the pod stays out of its Services without restarting."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"gpus": [{"index": 0}], "events": []}))
    d = daemon_factory(
        {"engines": [fake_engine("a", free_port(), gpus=[0], detectors=FAST_DETECTORS)]},
        run_args=("--fake-gpu", str(gpu)),
    )
    with Kubelet(d.http_url) as kubelet:
        d.start()
        d.wait_state("a", "ready")
        # XID 79: GPU 0 fell off the bus; the condition holds at once.
        gpu.write_text(json.dumps({"gpus": [{"index": 0}], "events": [{"id": 1, "gpu": 0, "xid": 79}]}))
        d.wait_log("node condition gpu_unrecoverable on GPU 0", timeout_s=30)
        held_s = time.monotonic()
        wait_for(
            lambda: len(kubelet.between(held_s + 0.2, time.monotonic())) >= 10, timeout_s=20, what="samples"
        )
        held = kubelet.between(held_s + 0.2, time.monotonic())
        assert all(s.livez == 200 and s.readyz == 503 for s in held), held
        assert d.stop() == 0

        # The container restarts on the same state directory: alive within seconds, still not ready.
        d.start()
        wait_for(lambda: _status(d.http_url + "/livez") == 200, timeout_s=20, what="/livez 200 again")
        ready = _get(d.http_url + "/readyz")
        assert ready is not None and ready.status_code == 503
        assert ready.json()["reason"].startswith("gpu_unrecoverable on GPU 0")
        assert d.stop() == 0
