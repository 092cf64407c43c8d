"""Resetting one GPU while the daemon runs (issue 36 point 8, M7; docs/gpu.md, "Resetting one
GPU"): `gpu release N` stops the GPU's engines (drained, held) and closes NVML; `gpu take-back N`
opens it again, judges the GPU, clears its condition and starts its engines. The real loop,
runners and reader over the pynvml-level fake on virtual time (tests/lib/nvml_daemon.py).

A process that holds the device is not something the fake can be; what it can be is NVML's own
hold: ``FakeNvml.reset`` refuses while NVML is initialised in this process, as `nvidia-smi -r`
refuses a GPU any process holds (nvidia-smi(1), -r), and cleans the GPU when it is not."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import aio, control
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.holds import Holds
from llmsupervisor.daemon.supervisor import Supervisor
from llmsupervisor.probes.fake_nvml import FakeNvml
from tests.lib.nvml_daemon import daemon, engine, state, stopped, two_gpus, until
from tests.lib.virtual_nvml import inline_nvml
from tests.lib.virtual_time import run_virtual

S = EngineState
GPU_RESET = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET


def phase(sup: Supervisor) -> str | None:
    release = sup.status()["gpu_release"]
    return None if release is None else str(release["phase"])


async def ask(sup: Supervisor, command: str, **fields: Any) -> Any:
    """A control-socket request as the server hands it to the daemon (validated, with a peer)."""
    req = control._validated({"command": command, **fields})
    return await sup.intake.on_control({**req, "peer_uid": None})


async def refused(sup: Supervisor, command: str, **fields: Any) -> str:
    with pytest.raises(control.ControlError) as caught:
        await ask(sup, command, **fields)
    return str(caught.value)


async def gpu_1_needs_a_reset(sup: Supervisor, fake: FakeNvml) -> None:
    """Both engines serving, then GPU 1 asks for a reset (field 230): its condition, e1 stopped."""
    await until(lambda: all(s.state is S.READY for s in sup.fleet.statuses()), within_s=60)
    fake.recovery_action_changed(1, GPU_RESET)
    await until(lambda: any(c.gpu == 1 for c in sup.marks.conditions), within_s=30)
    await until(lambda: state(sup, "e1")["state"] == "stopped", within_s=60)


def test_release_stops_the_gpus_engine_closes_nvml_and_take_back_brings_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole procedure on GPU 1 with a gpu_unrecoverable condition: e0 on GPU 0 serves
    throughout, never restarted; NVML is closed while released (the fake reset refuses before and
    succeeds then), every state is in `status`, and the take-back clears the condition and starts
    e1 again."""
    inline_nvml(monkeypatch)
    fake = two_gpus()

    async def scenario() -> dict[str, Any]:
        sup, loop = await daemon(
            tmp_path, fake, (engine("e0", 8000, gpus=(0,)), engine("e1", 8001, gpus=(1,)))
        )
        seen: dict[str, Any] = {}
        await gpu_1_needs_a_reset(sup, fake)
        e0_incarnation = state(sup, "e0")["incarnation"]
        try:
            fake.reset(1)
        except RuntimeError as exc:
            seen["reset_refused"] = str(exc)
        seen["reply"] = await ask(sup, "gpu_release", gpu=1, window_s=300)
        seen["second"] = await refused(sup, "gpu_release", gpu=0)
        await until(lambda: phase(sup) == "released", within_s=60)
        seen["released"] = sup.status()
        seen["summary"] = sup.summary()
        seen["initialised"] = fake.initialised
        seen["start"] = await refused(sup, "start", engine="e1")
        seen["reload"] = await refused(sup, "reload")
        seen["take_back_other"] = await refused(sup, "gpu_take_back", gpu=0)
        await aio.wait_any(timeout_s=60)  # a minute blind on purpose: an INFO finding on e0
        seen["e0_blind"] = state(sup, "e0")
        fake.reset(1)  # nvidia-smi -r: NVML is closed, so it goes through
        seen["take_back"] = await ask(sup, "gpu_take_back", gpu=1)
        await until(lambda: phase(sup) == "done", within_s=60)
        await until(lambda: state(sup, "e1")["state"] == "ready", within_s=60)
        seen["done"] = sup.status()
        seen["initialised_after"] = fake.initialised
        seen["conditions_after"] = sup.marks.conditions
        await until(lambda: state(sup, "e0")["gpu_temperature_c"] is not None, within_s=30)
        await until(
            lambda: not [f for f in state(sup, "e0")["findings"] if f["kind"] == "nvml_lost"], within_s=60
        )
        seen["e0_after"] = state(sup, "e0")
        seen["e0_incarnation"] = e0_incarnation
        await stopped(sup, loop)
        return seen

    seen = run_virtual(scenario())
    assert "in use" in seen["reset_refused"]  # the daemon's NVML holds the GPU until released
    reply = seen["reply"]
    assert reply["engines"] == ["e1"] and reply["release"]["phase"] == "stopping"
    assert (
        reply["release"]["uuid"] == "GPU-fake-0001" and reply["release"]["pci_bus_id"] == "00000000:19:00.0"
    )
    assert "one GPU at a time" in seen["second"]
    # Released: NVML shut down, e1 stopped and held for GPU 1's reset, e0 serving, all said.
    assert seen["initialised"] == 0
    released = seen["released"]
    release = released["gpu_release"]
    assert release["phase"] == "released" and release["nvml_closed"] is True
    assert release["reset_command"] == "nvidia-smi -r -i GPU-fake-0001"
    assert release["take_back_command"] == "llm-supervisor gpu take-back 1"
    assert 0 < release["ends_in_s"] <= 300
    e1 = released["engines"]["e1"]
    assert e1["state"] == "stopped" and e1["pid"] is None
    assert e1["hold"]["hold"] == "stop" and e1["hold"]["gpu_reset"] == {"gpu": 1, "uuid": "GPU-fake-0001"}
    assert released["engines"]["e0"]["state"] == "ready" and released["engines"]["e0"]["in_rotation"]
    nvml = released["nvml"]
    assert nvml["up"] is False and nvml["reason"] == "released" and "gpu take-back 1" in nvml["detail"]
    assert released["node_conditions"][0]["gpu"] == 1  # the condition stays with its GPU meanwhile
    assert "GPU 1 released for its reset: nvidia-smi -r -i GPU-fake-0001" in seen["summary"]
    assert "NVML closed on purpose for a GPU reset" in seen["summary"]
    assert "take it back first" in seen["start"]
    assert "reload refused" in seen["reload"]
    assert "GPU 1 is the one released" in seen["take_back_other"]
    blind = [f for f in seen["e0_blind"]["findings"] if f["kind"] == "nvml_lost"]
    assert blind and blind[0]["severity"] == "info" and "on purpose" in blind[0]["summary"]
    assert seen["e0_blind"]["state"] == "ready"
    # Taken back: NVML open again, the condition cleared, e1 started, its hold gone; e0 untouched.
    assert seen["take_back"]["release"]["phase"] == "taking_back"
    assert seen["initialised_after"] == 1
    assert seen["conditions_after"] == ()
    done = seen["done"]
    assert (
        done["gpu_release"]["phase"] == "done"
        and "gpu_unrecoverable cleared" in done["gpu_release"]["outcome"]
    )
    assert done["node_conditions"] == [] and done["nvml"]["up"] is True
    assert done["engines"]["e1"]["hold"] is None
    e0 = seen["e0_after"]
    assert e0["restarts"] == 0 and e0["incarnation"] == seen["e0_incarnation"]


def test_the_window_runs_out_on_a_gpu_nobody_reset_and_its_engine_stays_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nobody resets the GPU: the daemon takes it back by itself when the window runs out (NVML
    open again, the other GPU monitored again), finds it still asking for a reset, keeps the
    condition and leaves e1 stopped and held."""
    inline_nvml(monkeypatch)
    fake = two_gpus()

    async def scenario() -> dict[str, Any]:
        sup, loop = await daemon(
            tmp_path, fake, (engine("e0", 8000, gpus=(0,)), engine("e1", 8001, gpus=(1,)))
        )
        await gpu_1_needs_a_reset(sup, fake)
        await ask(sup, "gpu_release", gpu=1, window_s=30)
        await until(lambda: phase(sup) == "released", within_s=60)
        took_s = await until(lambda: phase(sup) == "failed", within_s=120)
        seen = {"status": sup.status(), "took_s": took_s, "initialised": fake.initialised}
        await stopped(sup, loop)
        return seen

    with caplog.at_level(logging.WARNING, logger="llmsupervisor"):
        seen = run_virtual(scenario())
    status = seen["status"]
    assert 25 <= seen["took_s"] <= 45 and seen["initialised"] == 1
    assert "the release window ran out" in caplog.text
    outcome = status["gpu_release"]["outcome"]
    assert "not fit after the reset" in outcome and "gpu_reset" in outcome
    assert status["node_conditions"][0]["gpu"] == 1
    assert status["engines"]["e1"]["state"] == "stopped" and status["engines"]["e1"]["hold"]["gpu_reset"]
    assert status["nvml"]["up"] is True


def test_holds_are_given_back_and_an_operators_stop_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU with no condition: a drained engine comes back drained, one an operator stopped
    before the release stays stopped (and keeps the operator's hold), and the release says so."""
    inline_nvml(monkeypatch)
    fake = two_gpus()
    specs = (engine("d", 8000, gpus=(1,)), engine("s", 8001, gpus=(1,)), engine("e0", 8002, gpus=(0,)))

    async def scenario() -> dict[str, Any]:
        sup, loop = await daemon(tmp_path, fake, specs)
        await until(lambda: all(s.state is S.READY for s in sup.fleet.statuses()), within_s=60)
        await ask(sup, "drain", engine="d")
        await ask(sup, "stop", engine="s")
        await until(lambda: state(sup, "s")["state"] == "stopped", within_s=60)
        reply = await ask(sup, "gpu_release", gpu=1)
        await until(lambda: phase(sup) == "released", within_s=60)
        await ask(sup, "gpu_take_back", gpu=1)
        await until(lambda: phase(sup) == "done", within_s=60)
        await until(lambda: state(sup, "d")["state"] == "draining", within_s=60)
        seen = {"reply": reply, "status": sup.status()}
        await stopped(sup, loop)
        return seen

    seen = run_virtual(scenario())
    assert seen["reply"]["engines"] == ["d"] and seen["reply"]["release"]["kept_stopped"] == ["s"]
    engines = seen["status"]["engines"]
    assert engines["d"]["hold"]["hold"] == "drain" and "gpu_reset" not in engines["d"]["hold"]
    assert engines["s"]["state"] == "stopped" and engines["s"]["hold"]["hold"] == "stop"
    assert "gpu_reset" not in engines["s"]["hold"]
    assert (
        "taken back: it answers NVML (recovery action none); started d"
        in seen["status"]["gpu_release"]["outcome"]
    )


def test_take_back_after_a_daemon_restart_finds_the_engines_held_for_the_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon restarted while GPU 1 was released: its engine stays stopped (the hold file
    names the GPU), NVML opens at start, and `gpu take-back 1` starts it."""
    inline_nvml(monkeypatch)
    fake = two_gpus()
    specs = (engine("e0", 8000, gpus=(0,)), engine("e1", 8001, gpus=(1,)))

    async def first() -> None:
        sup, loop = await daemon(tmp_path, fake, specs)
        await until(lambda: all(s.state is S.READY for s in sup.fleet.statuses()), within_s=60)
        await ask(sup, "gpu_release", gpu=1)
        await until(lambda: phase(sup) == "released", within_s=60)
        await stopped(sup, loop)

    async def second() -> dict[str, Any]:
        sup, loop = await daemon(tmp_path, fake, specs)
        await until(lambda: state(sup, "e0")["state"] == "ready", within_s=60)
        held = state(sup, "e1")
        nothing = await refused(sup, "gpu_take_back", gpu=0)
        await ask(sup, "gpu_take_back", gpu=1)
        await until(lambda: state(sup, "e1")["state"] == "ready", within_s=60)
        seen = {
            "held": held,
            "nothing": nothing,
            "after": state(sup, "e1"),
            "release": sup.status()["gpu_release"],
        }
        await stopped(sup, loop)
        return seen

    run_virtual(first())
    hold = Holds(tmp_path / "state" / "holds")
    hold.load(["e1"])
    assert hold.for_gpu_reset("GPU-fake-0001") == ["e1"]
    seen = run_virtual(second())
    assert seen["held"]["state"] == "stopped" and seen["held"]["hold"]["gpu_reset"]["gpu"] == 1
    assert "GPU 0 is not released" in seen["nothing"]
    assert seen["after"]["hold"] is None and seen["release"]["phase"] == "done"


def test_a_release_is_refused_while_nvml_is_not_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to release when NVML cannot be opened: the daemon holds no GPU then."""
    import pynvml

    inline_nvml(monkeypatch)
    fake = two_gpus(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    async def scenario() -> tuple[str, str]:
        sup, loop = await daemon(tmp_path, fake, (engine("e1", 8001, gpus=(1,)),), nvml_wait_s=0)
        closed = await refused(sup, "gpu_release", gpu=1)
        fake.init_error = None
        await until(lambda: sup.gpu_monitor.reader.is_open, within_s=60)
        unknown = await refused(sup, "gpu_release", gpu=7)
        await stopped(sup, loop)
        return closed, unknown

    closed, unknown = run_virtual(scenario())
    assert "NVML is not open (driver_not_loaded)" in closed
    assert "NVML lists no GPU 7 (it lists 0, 1)" in unknown


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"command": "gpu_release"}, "gpu must be a GPU index"),
        ({"command": "gpu_release", "gpu": True}, "gpu must be a GPU index"),
        ({"command": "gpu_take_back", "gpu": -1}, "gpu must be a GPU index"),
        ({"command": "gpu_release", "gpu": 1, "window_s": "10m"}, "window_s must be a number"),
    ],
)
def test_the_control_socket_checks_gpu_requests(request_: dict[str, Any], error: str) -> None:
    with pytest.raises(control.ControlError, match=error):
        control._validated(request_)


def test_engines_that_do_not_stop_in_time_fail_the_release_and_nvml_stays_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the stop deadline the release fails without closing NVML; the engine stays held, and
    `gpu take-back` (with NVML never closed) judges the GPU at once and starts it."""
    from llmsupervisor.daemon import gpu_release

    inline_nvml(monkeypatch)
    monkeypatch.setattr(gpu_release, "stop_deadline_s", lambda specs: 0.0)
    fake = two_gpus()

    async def scenario() -> dict[str, Any]:
        sup, loop = await daemon(tmp_path, fake, (engine("e1", 8001, gpus=(1,)),))
        await until(lambda: state(sup, "e1")["state"] == "ready", within_s=60)
        await ask(sup, "gpu_release", gpu=1)
        await until(lambda: phase(sup) == "failed", within_s=10)
        failed = sup.status()
        initialised = fake.initialised
        await until(lambda: state(sup, "e1")["state"] == "stopped", within_s=60)
        await ask(sup, "gpu_take_back", gpu=1)
        await until(lambda: phase(sup) == "done", within_s=10)
        await until(lambda: state(sup, "e1")["state"] == "ready", within_s=60)
        seen = {"failed": failed, "initialised": initialised, "done": sup.status()}
        await stopped(sup, loop)
        return seen

    seen = run_virtual(scenario())
    release = seen["failed"]["gpu_release"]
    assert "e1 did not stop within" in release["outcome"] and release["nvml_closed"] is False
    assert seen["initialised"] == 1 and seen["failed"]["nvml"]["up"] is True
    assert seen["done"]["engines"]["e1"]["hold"] is None
