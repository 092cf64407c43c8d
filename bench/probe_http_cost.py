#!/usr/bin/env python3
"""CPU per probe request: httpx (what the probes used) against the probes' own client
(llmsupervisor/probes/probe_http.py), for ``GET /health`` and ``GET /metrics``.

One fake vLLM (tests/lib/fake_vllm.py, a separate process, so its CPU is not counted) serves the
captured vLLM 0.32 ``/metrics`` body; this process sends ``--requests`` sequential requests of
each kind through each client, on one kept-alive connection, and reports the CPU time of this
process (user + system) per request, the median of ``--repeats`` runs. The body is fetched, not
parsed: parsing is the same for both clients.

    python bench/probe_http_cost.py                 # 2000 requests x 5 repeats, ~1 min

Not a test: nothing is asserted. Writes bench/results/probe-http-cost-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmsupervisor.probes.probe_http import ProbeHttp  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32.0-cpu.txt"
RESULTS = ROOT / "bench" / "results"
MAX_BODY = 16 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


async def per_request_ms(get: Callable[[], Awaitable[bytes]], requests: int) -> float:
    for _ in range(20):  # warm: the connection, the first allocations
        await get()
    started = cpu_s()
    for _ in range(requests):
        await get()
    return (cpu_s() - started) / requests * 1000


async def measure(url: str, requests: int) -> dict[str, float]:
    async with httpx.AsyncClient(trust_env=False, verify=ssl.create_default_context()) as client:
        probe = ProbeHttp(url)

        async def httpx_get(path: str) -> bytes:
            response = await client.get(url + path)
            return response.content

        async def probe_get(path: str) -> bytes:
            return (await probe.get(path, max_body_bytes=MAX_BODY)).body

        try:
            return {
                "httpx /health": await per_request_ms(lambda: httpx_get("/health"), requests),
                "probe /health": await per_request_ms(lambda: probe_get("/health"), requests),
                "httpx /metrics": await per_request_ms(lambda: httpx_get("/metrics"), requests),
                "probe /metrics": await per_request_ms(lambda: probe_get("/metrics"), requests),
            }
        finally:
            probe.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "lib" / "fake_vllm.py"),
            "--model",
            "tiny",
            "--port",
            str(port),
            "--fake-startup-delay-s",
            "0",
            "--fake-metrics-file",
            str(FIXTURE),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        runs = [asyncio.run(measure(url, args.requests)) for _ in range(args.repeats)]
    finally:
        server.terminate()
        server.wait()
    result = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "when": stamp,
        "requests": args.requests,
        "repeats": args.repeats,
        "ms_cpu_per_request": result,
        "runs": runs,
        "loadavg": os.getloadavg(),
    }
    (args.out / f"probe-http-cost-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"CPU per request, median of {args.repeats} x {args.requests} (load {os.getloadavg()[0]:.1f}):")
    for name, ms in result.items():
        print(f"  {name:16} {ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
