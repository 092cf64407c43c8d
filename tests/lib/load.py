"""Steady concurrent completions through whatever stands in front of the engines (HAProxy, a
router), for the fleet and vllm tiers: every outcome kept with the time its request started.

``Load(url)`` sends ``{"model": "tiny", "prompt": "hi", "max_tokens": 4}`` from 4 workers, one
request after another, and counts a 200 as ``ok``; ``body``, ``judge``, ``timeout_s`` and
``pause_s`` change that. Use it as a context manager, or ``start()`` and ``stop()``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

# A request's outcome ("ok", "http 503", "truncated (abort)", or the exception's name) and a
# detail for the failure message.
Judge = Callable[[httpx.Response], tuple[str, str]]
BODY: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


def by_status(resp: httpx.Response) -> tuple[str, str]:
    """A 200 is ok; anything else is a failure named by its status."""
    return ("ok", "") if resp.status_code == 200 else (f"http {resp.status_code}", resp.text[:200])


class Load:
    """Completions from ``workers`` threads until stopped. ``outcomes``: (start time on the
    monotonic clock, outcome) in the order they finished; ``results``: their count;
    ``failures``: "HH:MM:SS outcome detail" for each that was not ok."""

    def __init__(
        self,
        url: str,
        workers: int = 4,
        *,
        body: dict[str, Any] | None = None,
        judge: Judge = by_status,
        timeout_s: float = 30.0,
        pause_s: float = 0.0,
    ) -> None:
        self.url = url
        self.body = BODY if body is None else body
        self.judge = judge
        self.timeout_s = timeout_s
        self.pause_s = pause_s  # between one worker's requests
        self.outcomes: list[tuple[float, str]] = []
        self.results: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    outcome, detail = self.judge(client.post(self.url, json=self.body))
                except httpx.HTTPError as exc:
                    outcome, detail = type(exc).__name__, str(exc)[:200]
                with self._lock:
                    self.outcomes.append((started, outcome))
                    self.results[outcome] += 1
                    if outcome != "ok":
                        self.failures.append(f"{time.strftime('%H:%M:%S')} {outcome} {detail}")
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Counter[str]:
        """Stop every worker (each finishes its request in flight); the counts."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 30)
        return self.results

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.results)

    def since(self, t: float) -> list[str]:
        """The outcomes of the requests started at ``t`` or later."""
        with self._lock:
            return [outcome for started, outcome in self.outcomes if started >= t]
