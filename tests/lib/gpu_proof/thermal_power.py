"""Check 6, thermal and power: thresholds, margin, the clock-event mask and power, idle and under a
bf16 matmul burn (``--fake``: the fake GPU scripted hot and power-capped instead); the
throttle-duration counters' deltas; and the daemon's GPU detectors fed with every tick, as its
loop feeds them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Final

from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.nvml import (
    FI_HW_POWER_BRAKE_NS,
    FI_HW_THERMAL_NS,
    FI_SW_THERMAL_NS,
    NvmlReader,
)
from tests.lib.gpu_proof.nvml_reads import field_values, read
from tests.lib.gpu_proof.proof import Proof, cuda_env
from tests.lib.gpu_proof.result import Result

THRESHOLDS: Final = {"shutdown": 0, "slowdown": 1, "mem_max": 2, "gpu_max": 3}  # NVML_TEMPERATURE_THRESHOLD_*
THROTTLE_FIELDS: Final = (FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS)

Tick = dict[int, tuple[GpuSample, Any]]  # NVML index -> (the reader's sample, the margin)
Ticks = list[tuple[float, Tick]]  # (seconds since the first tick, the tick)

BURN_CODE: Final = """
import json, sys, time, torch
seconds, n = float(sys.argv[1]), 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
print(json.dumps({"started": time.monotonic()}), flush=True)
t0, iters = time.monotonic(), 0
while time.monotonic() - t0 < seconds:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    iters += 20
took = time.monotonic() - t0
tflops = 2 * n**3 * iters / took / 1e12
print(json.dumps({"stopped": time.monotonic(), "iters": iters, "tflops": tflops}), flush=True)
"""


def _tick(lib: Any, reader: NvmlReader, gpus: list[tuple[int, Any, str]]) -> Tick:
    return {
        index: (reader.sample(uuid), read(lib, "nvmlDeviceGetMarginTemperature", handle))
        for index, handle, uuid in gpus
    }


def _phase_summary(ticks: Ticks) -> dict[str, Any]:
    per_gpu: dict[str, Any] = {}
    for index in sorted({i for _, t in ticks for i in t}):
        samples = [t[index][0] for _, t in ticks if index in t]
        margins = [t[index][1] for _, t in ticks if index in t and isinstance(t[index][1], int)]
        masks: dict[str, int] = {}
        for s in samples:
            key = hex(s.clock_event_reasons) if s.clock_event_reasons is not None else "none"
            masks[key] = masks.get(key, 0) + 1
        powers = [s.power_w for s in samples if s.power_w is not None]
        temps = [s.temperature_c for s in samples if s.temperature_c is not None]
        clocks = [s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]
        per_gpu[str(index)] = {
            "samples": len(samples),
            "clock_event_masks": masks,
            "reasons_seen": sorted(set().union(*(s.clock_event_reason_names for s in samples))),
            "temperature_c_max": max(temps, default=None),
            "margin_c_min": min(margins, default=None),
            "power_w_max": max(powers, default=None),
            "power_limit_w": samples[-1].power_limit_w if samples else None,
            "sm_clock_mhz": [min(clocks, default=None), max(clocks, default=None)],
            "unread": sorted({u for s in samples for u in s.unread}),
        }
    return per_gpu


class Watch:
    """The daemon's GPU detectors fed one tick at a time, with a finding tracker: what each
    detector raised (``raw``) and what the tracker opened (``opened``)."""

    def __init__(self, proof: Proof, reader: NvmlReader, tick_s: float) -> None:
        from llmsupervisor import detectors as det

        self.lib, self.reader, self.gpus, self.tick_s = proof.lib, reader, proof.gpus(), tick_s
        self.cfg = det.DetectorConfig()
        self.window = det.new_window(self.cfg)
        self.tracker = det.FindingTracker(self.cfg)
        self.detectors = (
            det.detect_thermal,
            det.detect_power_throttle,
            det.detect_gpu_fault,
            det.detect_gpu_lost,
            det.detect_nvml_lost,
            det.detect_foreign_gpu_memory,
        )
        self.raw: dict[str, dict[str, Any]] = {}
        self.opened: list[dict[str, Any]] = []
        self.start = time.monotonic()

    def tick(self) -> Tick:
        from llmsupervisor.core.observe import Observation

        got = _tick(self.lib, self.reader, self.gpus)
        now = time.monotonic()
        self.window.append(
            Observation(engine="gpu-proof", at_s=now, gpus={i: s for i, (s, _) in got.items()})
        )
        found = [f for d in self.detectors if (f := d(self.window, now, self.cfg)) is not None]
        for f in found:
            entry = self.raw.setdefault(
                f"{f.kind.value}/{f.severity.value}", {"ticks": 0, "first_s": round(now - self.start, 1)}
            )
            entry["ticks"] += 1
            entry["summary"] = f.summary
        update = self.tracker.update(found, now)
        self.opened.extend(
            {
                "kind": f.kind.value,
                "severity": f.severity.value,
                "at_s": round(now - self.start, 1),
                "summary": f.summary,
            }
            for f in update.opened
        )
        return got

    def phase(self, seconds: float, until: Callable[[], bool] | None = None) -> Ticks:
        ticks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            ticks.append((time.monotonic() - self.start, self.tick()))
            time.sleep(self.tick_s)
        return ticks


def check_thermal_power(proof: Proof, r: Result) -> None:
    lib, opts = proof.lib, proof.opts
    handle0 = proof.handle(opts.gpu)
    r.data["thresholds"] = {
        str(index): {
            name: read(lib, "nvmlDeviceGetTemperatureThreshold", handle, t) for name, t in THRESHOLDS.items()
        }
        for index, handle, _ in proof.gpus()
    }
    reader = proof.reader()
    reader.open()
    watch = Watch(proof, reader, tick_s=1.0 if not opts.fake else 0.1)
    try:
        idle = watch.phase(3 * watch.tick_s)
        fields_before = field_values(lib, handle0, THROTTLE_FIELDS)
        burn_ticks: Ticks = []
        fields_after: dict[str, Any] = {}
        if opts.fake:
            r.skipped.append(
                "the bf16 matmul burn: --fake (the fake GPU is scripted hot and power-capped instead)"
            )
            burn_ticks, fields_after = _scripted_burn(proof, watch)
        elif not proof.no_cuda(r, "the bf16 matmul burn"):
            burn_ticks = _burn(proof, r, watch.phase)
        fields_after = fields_after or field_values(lib, handle0, THROTTLE_FIELDS)
        after = watch.phase(3 * watch.tick_s)
    finally:
        reader.close()
    r.data.update(
        idle=_phase_summary(idle),
        burn=_phase_summary(burn_ticks),
        after=_phase_summary(after),
        throttle_seconds_delta=_deltas(fields_before, fields_after),
        detectors_raw=watch.raw,
        findings_opened=watch.opened,
        sustain_s={
            k.value: v for k, v in watch.cfg.sustain_s.items() if k.value in ("thermal", "power_throttle")
        },
    )
    for phase_name in ("idle", "burn", "after"):
        for index, summary in r.data[phase_name].items():
            r.expect(
                not summary["unread"],
                f"{phase_name}: GPU {index}: the reader could not read {summary['unread']}",
            )
    idle0 = r.data["idle"].get(str(opts.gpu), {})
    if "gpu_idle" not in idle0.get("reasons_seen", ["gpu_idle"]):
        r.notes.append(f"idle clock-event reasons: {idle0.get('reasons_seen')} (gpu_idle expected)")


def _deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Each throttle-duration counter's growth in seconds (or both readings where one failed)."""
    deltas: dict[str, Any] = {}
    for fid in THROTTLE_FIELDS:
        b, a = before.get(str(fid), {}), after.get(str(fid), {})
        deltas[str(fid)] = (
            round((a["value"] - b["value"]) / 1e9, 3)
            if "value" in a and "value" in b
            else {"before": b, "after": a}
        )
    return deltas


def _scripted_burn(proof: Proof, watch: Watch) -> tuple[Ticks, dict[str, Any]]:
    """``--fake``: the fake GPU hot and power-capped for ``burn_s``, its software-thermal counter
    growing 0.8 s a tick; the ticks and the throttle fields read before it cools again."""
    opts = proof.opts
    dev = proof.lib.devices[opts.gpu]
    saved = (dev.clock_event_reasons, dev.temperature_c, dev.power_mw, dict(dev.fields))
    dev.clock_event_reasons, dev.temperature_c, dev.power_mw = 0x4 | 0x20, 84, 690_000
    ticks: Ticks = []
    end = time.monotonic() + opts.burn_s
    while time.monotonic() < end:
        ret, ns = dev.fields[FI_SW_THERMAL_NS]
        dev.fields[FI_SW_THERMAL_NS] = (ret, ns + int(0.8 * watch.tick_s * 1e9))
        ticks += watch.phase(watch.tick_s)
    fields_after = field_values(proof.lib, proof.handle(opts.gpu), THROTTLE_FIELDS)
    dev.clock_event_reasons, dev.temperature_c, dev.power_mw, dev.fields = saved
    return ticks, fields_after


def _burn(proof: Proof, r: Result, phase: Callable[..., Ticks]) -> Ticks:
    opts = proof.opts
    log = proof.workdir / "burn.log"
    with open(log, "w") as err:
        burner = subprocess.Popen(
            [sys.executable, "-c", BURN_CODE, str(opts.burn_s)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=cuda_env(opts.gpu),
            start_new_session=True,
        )
    try:
        assert burner.stdout is not None
        first = burner.stdout.readline()
        if not first:
            r.expect(False, f"the burn did not start: {log.read_text()[-500:]}")
            return []
        ticks = phase(opts.burn_s + 30, until=lambda: burner.poll() is not None)
        rest = burner.stdout.read()
        lines = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
        r.data["burn_result"] = lines[-1] if lines else {"error": log.read_text()[-500:]}
        return ticks
    finally:
        if burner.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(burner.pid, signal.SIGKILL)
        burner.wait(30)
