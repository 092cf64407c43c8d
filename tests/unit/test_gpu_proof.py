"""bench/gpu_proof.py's runner (issue 24) in this process, against the pynvml-level fake: a failing
or overrunning check prints its error and the run goes on. The script itself, run as a command
over the fake (every check, each line's shape), is in tests/system/test_gpu_proof_fake.py."""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stdout

import pytest

from tests.lib.gpu_proof import CHECKS, Proof, Result, runner
from tests.lib.paths import REPO


def test_a_failing_check_prints_its_error_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(proof: Proof, r: Result) -> None:
        r.data["partial"] = True
        raise RuntimeError("NVML said no")

    def slow(proof: Proof, r: Result) -> None:
        time.sleep(30)

    table = {n: (n, name, fn) for n, name, fn in CHECKS}
    table[1] = (1, "facts", broken)
    table[5] = (5, "fault_state", slow)
    monkeypatch.setattr(runner, "CHECKS", tuple(table.values()))
    monkeypatch.setattr(runner, "budget_s", lambda number, opts: 0.3)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    out = io.StringIO()
    with redirect_stdout(out):
        rc = runner.main(["--fake", "--checks", "1,5,4"])
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rc == 1
    assert [(x["check"], x["ok"]) for x in lines] == [(1, False), (5, False), (4, True)]
    assert lines[0]["error"] == "RuntimeError: NVML said no" and lines[0]["data"]["partial"] is True
    assert lines[1]["error"] == "CheckTimeout: ran past its budget of 0.3 s"
