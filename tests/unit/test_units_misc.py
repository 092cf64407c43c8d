"""Small units: wait statuses, the engine environment, vLLM log levels, journal formatting."""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from llmsupervisor import logs
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.restarts import StopLadder
from llmsupervisor.engine.output import engine_log_level
from llmsupervisor.process import (
    MARKER_DAEMON_PID,
    MARKER_ENGINE,
    MARKER_STATE_DIR,
    STRIPPED_ENV,
    ExitStatus,
    engine_environment,
)

# ---- ExitStatus ---------------------------------------------------------------------------------


def wait_status_of(code: str) -> int:
    """The raw waitpid() status of a real child running ``python -c CODE``."""
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))
    waited, status = os.waitpid(pid, 0)
    assert waited == pid
    return status


def test_exit_code_from_a_real_child() -> None:
    status = ExitStatus.from_wait_status(wait_status_of("import os; os._exit(3)"))
    assert status == ExitStatus(code=3, signal=None)
    assert status.describe() == "exited with code 3"


def test_clean_exit_from_a_real_child() -> None:
    status = ExitStatus.from_wait_status(wait_status_of("pass"))
    assert status == ExitStatus(code=0, signal=None)
    assert status.describe() == "exited with code 0"


def test_signal_from_a_real_child() -> None:
    status = ExitStatus.from_wait_status(
        wait_status_of("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    )
    assert status == ExitStatus(code=None, signal=signal.SIGKILL)
    assert status.describe() == "killed by SIGKILL"


def test_describe_other_signals() -> None:
    assert ExitStatus(code=None, signal=signal.SIGTERM).describe() == "killed by SIGTERM"
    assert ExitStatus(code=None, signal=signal.SIGSEGV).describe() == "killed by SIGSEGV"
    # Not a named signal (real-time signals past SIGRTMIN have no name in Python).
    assert (
        ExitStatus(code=None, signal=signal.SIGRTMIN + 3).describe()
        == f"killed by signal {signal.SIGRTMIN + 3}"
    )


def test_unknown_exit_marker_decodes_as_code_255() -> None:
    # EngineProcess reports a child reaped elsewhere as status 255 << 8.
    assert ExitStatus.from_wait_status(255 << 8) == ExitStatus(code=255, signal=None)


# ---- engine_environment -------------------------------------------------------------------------

SYSTEMD_ENV = {
    "NOTIFY_SOCKET": "/run/systemd/notify",
    "WATCHDOG_USEC": "30000000",
    "WATCHDOG_PID": "1234",
    "LISTEN_FDS": "1",
    "LISTEN_PID": "1234",
    "LISTEN_FDNAMES": "http",
}


def make_env(**overrides: object) -> dict[str, str]:
    kwargs: dict[str, object] = {
        "base": {"PATH": "/usr/bin:/bin", "HOME": "/var/lib/llm-supervisor", **SYSTEMD_ENV},
        "engine": "qwen",
        "gpus": [0, 1],
        "state_dir": Path("/var/lib/llm-supervisor"),
        "cache_dir": Path("/var/lib/llm-supervisor/engines/qwen/vllm-cache"),
        "extra": {},
        "daemon_pid": 4321,
    }
    kwargs.update(overrides)
    return engine_environment(**kwargs)  # type: ignore[arg-type]


def test_systemd_plumbing_is_stripped() -> None:
    assert set(STRIPPED_ENV) == set(SYSTEMD_ENV)
    env = make_env()
    assert not set(SYSTEMD_ENV) & set(env)
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["HOME"] == "/var/lib/llm-supervisor"


def test_gpu_and_vllm_variables() -> None:
    env = make_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_CACHE_ROOT"] == "/var/lib/llm-supervisor/engines/qwen/vllm-cache"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env[MARKER_ENGINE] == "qwen"
    assert env[MARKER_STATE_DIR] == "/var/lib/llm-supervisor"
    assert env[MARKER_DAEMON_PID] == "4321"


def test_gpus_replace_the_daemons_own_cuda_visible_devices() -> None:
    env = make_env(base={"CUDA_VISIBLE_DEVICES": "7", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, gpus=(3,))
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # No GPUs (a CPU engine): no GPU is visible.
    assert make_env(gpus=())["CUDA_VISIBLE_DEVICES"] == ""
    # GPUs named by UUID in the config go to CUDA as UUIDs (EngineSpec.cuda_devices).
    uuids = ("GPU-00000000-1111-2222-3333-444444444444", "GPU-aaaaaaaa-1111-2222-3333-444444444444")
    by_uuid = make_env(gpus=uuids)
    assert by_uuid["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert by_uuid["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_extra_env_is_applied_but_markers_win() -> None:
    env = make_env(
        extra={
            "HF_HUB_OFFLINE": "1",
            "PATH": "/opt/vllm/bin:/usr/bin",
            MARKER_ENGINE: "someone-else",
            MARKER_STATE_DIR: "/tmp/elsewhere",
            MARKER_DAEMON_PID: "1",
        }
    )
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PATH"] == "/opt/vllm/bin:/usr/bin"
    assert env[MARKER_ENGINE] == "qwen"
    assert env[MARKER_STATE_DIR] == "/var/lib/llm-supervisor"
    assert env[MARKER_DAEMON_PID] == "4321"


def test_an_engines_env_cannot_move_it_to_other_gpus(caplog: pytest.LogCaptureFixture) -> None:
    # Issue 23: env: CUDA_VISIBLE_DEVICES silently ran the engine on a GPU other than the monitored one.
    env = make_env(gpus=(1,), extra={"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "env CUDA_VISIBLE_DEVICES='0' ignored" in caplog.text


def test_base_is_not_modified() -> None:
    base = {"PATH": "/bin", **SYSTEMD_ENV}
    make_env(base=base)
    assert base == {"PATH": "/bin", **SYSTEMD_ENV}


# ---- engine_log_level ---------------------------------------------------------------------------

DBG, INF, WRN, ERR, CRT = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL


@pytest.mark.parametrize(
    ("line", "previous", "expected"),
    [
        ("INFO 11-22 12:00:00 [x.py:1] msg", ERR, INF),
        ("DEBUG 11-22 12:00:00 [x.py:1] msg", INF, DBG),
        ("WARNING 11-22 12:00:00 [x.py:1] msg", INF, WRN),
        ("ERROR 11-22 12:00:00 [core.py:7] EngineCore failed to start.", INF, ERR),
        ("CRITICAL 11-22 12:00:00 [x.py:1] msg", INF, CRT),
        ("(EngineCore pid=12) WARNING 11-22 12:00:00 [x.py:1] msg", INF, WRN),
        ("(EngineCore_DP0 pid=12) ERROR 11-22 12:00:00 [x.py:1] msg", INF, ERR),
        ("(APIServer pid=1) INFO 11-22 12:00:00 [api_server.py:1] msg", ERR, INF),
        ("(Worker_TP1 pid=99) DEBUG 11-22 12:00:00 [x.py:1] msg", INF, DBG),
        # vLLM 0.8-0.10 worker prefix: a space in the name and, by default, ANSI colour.
        ("(VllmWorker rank=0 pid=1386048) ERROR 07-23 10:22:47 [multiproc_executor.py:546] x", INF, ERR),
        ("\x1b[1;36m(VllmWorker rank=1 pid=219)\x1b[0;0m INFO 08-31 14:42:32 [x.py:1] msg", ERR, INF),
        ("\x1b[1;36m(Worker (TP0))\x1b[0;0m WARNING 11-22 12:00:00 [x.py:1] msg", INF, WRN),
        # uvicorn's access log has its own "INFO:" prefix.
        ('INFO:     127.0.0.1:50312 - "GET /health HTTP/1.1" 200 OK', ERR, INF),
        # Not a level line: keep the level of the line before (tracebacks, raw prints).
        ('  File "/x/y.py", line 3, in <module>', ERR, ERR),
        ("Traceback (most recent call last):", WRN, WRN),
        ("INFOrmation for you", WRN, WRN),
        ("info 11-22 lowercase is not vLLM's format", ERR, ERR),
        ("(EngineCore pid=12) RuntimeError: CUDA error", ERR, ERR),
        ("Loading safetensors checkpoint shards: 100% Completed", DBG, DBG),
        ("", WRN, WRN),
    ],
)
def test_engine_log_level(line: str, previous: int, expected: int) -> None:
    assert engine_log_level(line, previous) == expected


# ---- StopLadder ---------------------------------------------------------------------------------


def test_stop_ladder_from_spec_and_quick() -> None:
    spec = EngineSpec(
        name="a",
        model="m",
        gpus=(),
        port=1,
        stop_timeout_s=45.0,
        group_term_timeout_s=5.0,
        kill_timeout_s=10.0,
    )
    ladder = spec.stop_ladder
    assert ladder == StopLadder(main_term_timeout_s=45.0, group_term_timeout_s=5.0, kill_timeout_s=10.0)
    # No drain: at most a second per SIGTERM step, the SIGKILL wait unchanged.
    assert ladder.quick() == StopLadder(
        main_term_timeout_s=1.0, group_term_timeout_s=1.0, kill_timeout_s=10.0
    )
    short = StopLadder(main_term_timeout_s=0.0, group_term_timeout_s=0.5, kill_timeout_s=2.0)
    assert short.quick() == short


# ---- logs ---------------------------------------------------------------------------------------


def make_record(
    level: int, msg: str, *, engine: str | None = None, exc_info: logging._SysExcInfoType | None = None
) -> logging.LogRecord:
    record = logging.LogRecord("llmsupervisor.test", level, __file__, 1, msg, None, exc_info)
    if engine is not None:
        record.engine = engine
    return record


@pytest.mark.parametrize(
    ("level", "prefix"),
    [
        (logging.CRITICAL, "<2>"),
        (logging.ERROR, "<3>"),
        (logging.WARNING, "<4>"),
        (logging.INFO, "<6>"),
        (logging.DEBUG, "<7>"),
        (logging.INFO + 5, "<6>"),
        (logging.DEBUG - 5, "<7>"),
    ],
)
def test_journal_prefix_on_every_line(level: int, prefix: str) -> None:
    formatter = logs.EngineFormatter(journal=True)
    text = formatter.format(make_record(level, "first\nsecond\n  third", engine="qwen"))
    assert text.splitlines() == [f"{prefix}[qwen] first", f"{prefix}[qwen] second", f"{prefix}[qwen]   third"]


def test_journal_traceback_lines_keep_the_priority() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    text = logs.EngineFormatter(journal=True).format(
        make_record(logging.ERROR, "it failed", exc_info=exc_info)
    )
    lines = text.splitlines()
    assert lines[0] == "<3>it failed"
    assert lines[1] == "<3>Traceback (most recent call last):"
    assert lines[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in lines)


def test_journal_without_engine_has_no_tag() -> None:
    text = logs.EngineFormatter(journal=True).format(make_record(logging.WARNING, "daemon says"))
    assert text == "<4>daemon says"


def test_terminal_format_tags_after_the_level() -> None:
    formatter = logs.EngineFormatter(journal=False)
    text = formatter.format(make_record(logging.WARNING, "first\nsecond", engine="qwen"))
    head, tail = text.splitlines()
    timestamp, rest = head.split(" WARNING ", 1)
    assert timestamp  # asctime
    assert rest == "[qwen] first"
    assert tail == "[qwen] second"
    assert not head.startswith("<")
    plain = formatter.format(make_record(logging.INFO, "no engine"))
    assert plain.endswith(" INFO    no engine")


def test_stderr_is_journal_matches_device_and_inode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "journal", "w") as stream, open(tmp_path / "other", "w") as other:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert logs.stderr_is_journal(stream)
        assert not logs.stderr_is_journal(other)
        assert not logs.stderr_is_journal(io.StringIO())  # no file descriptor at all
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert not logs.stderr_is_journal(stream)
        for value in ("", "garbage", f"{st.st_dev}:", f":{st.st_ino}"):
            monkeypatch.setenv("JOURNAL_STREAM", value)
            assert not logs.stderr_is_journal(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not logs.stderr_is_journal(stream)
    # A closed stream is not the journal either.
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert not logs.stderr_is_journal(stream)


def test_setup_picks_the_journal_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    with open(tmp_path / "journal", "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        try:
            logs.setup("warning", stream=stream)
            assert root.level == logging.WARNING
            assert logging.getLogger("httpx").level == logging.WARNING
            logging.getLogger("llmsupervisor.test").warning("line one\nline two", extra={"engine": "e1"})
            logging.getLogger("llmsupervisor.test").info("filtered out")
        finally:
            # setup() replaced the root handlers (pytest's among them): put them back.
            for handler in list(root.handlers):
                root.removeHandler(handler)
                handler.close()
            for handler in saved_handlers:
                root.addHandler(handler)
            root.setLevel(saved_level)
    assert (tmp_path / "journal").read_text() == "<4>[e1] line one\n<4>[e1] line two\n"


def test_group_gone_reaps_a_member_that_dies_during_the_poll(monkeypatch, tmp_path) -> None:
    """A worker handed to the daemon (its EngineCore exited) that dies between the reap and the
    look must not be counted gone unreaped: it would stay a zombie for the daemon's life."""
    from types import SimpleNamespace

    from llmsupervisor import process
    from llmsupervisor.engine.processes import HostProcesses

    worker = {"alive": True, "reaped": False}

    def reap_adopted(pids, *, skip=None):
        if not worker["alive"]:
            worker["reaped"] = True
        worker["alive"] = False  # it dies just after this reap looked at it

    monkeypatch.setattr(process, "group_members", lambda pgid: [100, 101])
    monkeypatch.setattr(process, "reap_adopted", reap_adopted)
    monkeypatch.setattr(process, "alive", lambda pid: pid == 101 and worker["alive"])
    leader = SimpleNamespace(pid=100, pgid=100, returned=True)
    procs = HostProcesses(tmp_path)
    polls = 0
    while not procs.group_gone(leader):
        polls += 1
        assert polls < 5
    assert worker["reaped"]
