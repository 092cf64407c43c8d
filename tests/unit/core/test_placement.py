"""CPU placement: cpulists, the auto plan, the config checks, the binding at spawn."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from llmsupervisor import process
from llmsupervisor.config import load_config
from llmsupervisor.core.placement import (
    AUTO,
    Topology,
    Wanted,
    omp_threads_bind,
    overlaps,
    plan,
    split_evenly,
)
from llmsupervisor.daemon.placement import place_config, resolve_gpus
from llmsupervisor.errors import ConfigError
from llmsupervisor.probes.cpus import allowed_cpus_of, format_cpu_list, host_cpus, parse_cpu_list


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list(" 5, 2-4 ") == (2, 3, 4, 5)
    assert format_cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert format_cpu_list(()) == ""
    for bad in ("", "1-", "3-1", "a", "0,,1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_even_split_and_omp_bind() -> None:
    assert split_evenly(range(7), 3) == [(0, 1, 2), (3, 4), (5, 6)]
    assert split_evenly([0], 2) == [(0,), ()]
    assert omp_threads_bind((0, 1, 2, 3), 1) == "0-3"
    # vLLM wants one list per worker rank, separated by '|'.
    assert omp_threads_bind((0, 1, 2, 3, 8, 9), 2) == "0-2|3,8-9"


def test_auto_on_the_cpu_build_splits_the_cores_left_after_explicit_lists() -> None:
    host = Topology(cpus=frozenset(range(8)), gpu_cpus={})
    placed = plan([Wanted("a", AUTO), Wanted("pinned", (0, 1)), Wanted("b", AUTO), Wanted("free", ())], host)
    assert placed == {"pinned": (0, 1), "a": (2, 3, 4), "b": (5, 6, 7), "free": ()}
    assert overlaps(placed) == []
    # Two engines on a 2-core host: {0} and {1}.
    assert plan([Wanted("e1", AUTO), Wanted("e2", AUTO)], Topology(frozenset({0, 1}), {})) == {
        "e1": (0,),
        "e2": (1,),
    }


def test_auto_on_a_gpu_box_follows_each_gpus_numa_node() -> None:
    node0, node1 = frozenset(range(0, 8)), frozenset(range(8, 16))
    host = Topology(cpus=node0 | node1, gpu_cpus={0: node0, 1: node0, 2: node1, 3: node1})
    placed = plan(
        [
            Wanted("g0", AUTO, (0,)),
            Wanted("g1", AUTO, (1,)),
            Wanted("g23", AUTO, (2, 3)),
        ],
        host,
    )
    assert placed == {"g0": (0, 1, 2, 3), "g1": (4, 5, 6, 7), "g23": tuple(range(8, 16))}
    assert overlaps(placed) == []
    # Without NVML affinity an engine with GPUs is placed like a CPU engine.
    assert plan([Wanted("g0", AUTO, (0,))], Topology(node0, {})) == {"g0": tuple(range(8))}


def test_overlaps_are_named() -> None:
    assert overlaps({"a": (0, 1), "b": (1, 2), "c": (3,)}) == [("b", "a", (1,))]


def write(tmp_path: Path, engines: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("engines:\n" + engines)
    return path


def engine(name: str, port: int, cpus: str) -> str:
    return f"  - {{name: {name}, model: org/m, port: {port}, command: /bin/true, cpus: {cpus}}}\n"


def test_config_takes_lists_ranges_and_auto(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, engine("a", 8000, "[0]") + engine("b", 8001, '"1"') + engine("c", 8002, "auto")),
        check_paths=False,
    )
    a, b, c = config.engines
    assert (a.cpus, a.placement) == ((0,), (0,))
    assert (b.cpus, b.placement) == ((1,), (1,))
    assert (c.cpus, c.placement) == (AUTO, ())  # placed by the daemon, with what the host reports
    placed = place_config(config, Topology(frozenset({0, 1, 2, 3}), {}))
    assert [s.placement for s in placed.engines] == [(0,), (1,), (2, 3)]
    # Placing again gives the same specs: a reload of an unchanged file changes nothing.
    assert place_config(config, Topology(frozenset({0, 1, 2, 3}), {})) == placed


def test_check_config_catches_overlaps_missing_cpus_and_too_few(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, engine("a", 8000, '"0-1"') + engine("b", 8001, "[1]")), check_paths=False)
    assert "engines[1].cpus: CPU(s) 1 are already placed with engines[0]" in str(err.value)
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, engine("a", 8000, f"[{missing}]")))
    assert f"CPU(s) {missing} do not exist on this host" in str(err.value)
    too_many = "".join(engine(f"e{i}", 8000 + i, "auto") for i in range(len(host_cpus()) + 1))
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, too_many))
    assert "they cannot have disjoint sets" in str(err.value)
    for bad in ('"x"', "[]", "[-1]", "true"):
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, engine("a", 8000, bad)), check_paths=False)
        assert "engines[0].cpus:" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(
            write(tmp_path, engine("a", 8000, "[0]")[:-2] + ", env: {VLLM_CPU_OMP_THREADS_BIND: '0'}}\n"),
            check_paths=False,
        )
    assert "set by the supervisor from the engine's 'cpus'" in str(err.value)


def test_spawn_binds_the_engine_from_its_first_instruction_and_leaves_the_daemon_alone() -> None:
    target = (min(host_cpus()),)
    before = os.sched_getaffinity(0)

    async def main() -> tuple[tuple[int, ...] | None, str]:
        script = "import os, time; print(sorted(os.sched_getaffinity(0)), flush=True); time.sleep(30)"
        proc = process.spawn(["python3", "-c", script], dict(os.environ), cpus=target)
        try:
            line = await asyncio.to_thread(os.read, proc.stdout_fd, 200)
            return allowed_cpus_of(proc.pid), line.decode().strip()
        finally:
            proc.signal_group(9)
            await proc.wait()

    allowed, said = asyncio.run(main())
    assert allowed == target
    assert said == str(list(target))
    assert os.sched_getaffinity(0) == before


def test_launch_passes_the_cpus_to_the_spawn_and_to_vllm(tmp_path: Path) -> None:
    from llmsupervisor.config import EngineSpec
    from llmsupervisor.engine.launch import launch
    from tests.lib.engine_fakes import FakeProcesses

    cpu = min(host_cpus())
    spec = EngineSpec(name="e", model="m", gpus=(), port=8000, command=("x",), cpus=(cpu,), placement=(cpu,))

    async def main() -> tuple[tuple[int, ...], str, str]:
        procs = FakeProcesses(tmp_path)
        launched = await launch(spec, 0, procs)
        assert launched.proc is not None and not launched.failure
        (proc,) = procs.spawned
        away = await launch(
            EngineSpec(name="f", model="m", gpus=(), port=8001, command=("x",), placement=(4096,)), 0, procs
        )
        return proc.cpus, proc.env["VLLM_CPU_OMP_THREADS_BIND"], away.failure

    cpus, bind, failure = asyncio.run(main())
    assert cpus == (cpu,) and bind == str(cpu)
    assert "cannot bind to CPU(s) 4096: the daemon may use only" in failure


def test_doctor_shows_where_each_engine_runs(tmp_path: Path) -> None:
    from llmsupervisor import doctor

    config = load_config(
        write(tmp_path, engine("a", 8000, "[0]") + engine("b", 8001, "auto")), check_paths=False
    )
    a, b = doctor.check_placement(config, {})
    assert str(a) == "ok    engine a cpus: 0 (as configured; VLLM_CPU_OMP_THREADS_BIND=0)"
    rest = format_cpu_list(host_cpus() - {0})
    assert (
        str(b)
        == f"ok    engine b cpus: {rest} (auto: an even share of the CPUs; VLLM_CPU_OMP_THREADS_BIND={rest})"
    )


def test_gpus_named_by_uuid_resolve_or_the_engine_is_not_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    u0, u1 = "GPU-00000000-1111-2222-3333-444444444444", "GPU-aaaaaaaa-1111-2222-3333-444444444444"
    unknown = "GPU-99999999-9999-9999-9999-999999999999"
    path = tmp_path / "config.yaml"
    path.write_text(
        f"""
engines:
  - {{name: by-index, model: org/m, port: 8000, gpus: [0]}}
  - {{name: by-uuid, model: org/m, port: 8001, gpus: [{u1}]}}
  - {{name: lost, model: org/m, port: 8002, gpus: [{unknown}]}}
  - {{name: twice, model: org/m, port: 8003, gpus: [{u0}]}}
"""
    )
    config = load_config(path, check_paths=False)
    # NVML's order differs from the config's: the UUID finds its board wherever it is.
    resolved = {s.name: s for s in resolve_gpus(config, {u0: 0, u1: 5}, mig_enabled=()).engines}
    assert resolved["by-index"].gpus == (0,) and resolved["by-index"].enabled
    assert resolved["by-uuid"].gpus == (5,) and resolved["by-uuid"].cuda_devices == (u1,)
    assert resolved["by-uuid"].enabled
    assert not resolved["lost"].enabled and resolved["lost"].unresolved_gpus
    assert f"engine lost not started: NVML does not list GPU(s) {unknown}" in caplog.text
    # GPU 0 is already by-index's: the same board under its UUID is not taken twice.
    assert not resolved["twice"].enabled
    assert f"engine twice not started: GPU {u0} is GPU 0 of engine by-index" in caplog.text
    # MIG on the board by-uuid names (NVML index 5).
    with_mig = {s.name: s for s in resolve_gpus(config, {u0: 0, u1: 5}, mig_enabled=[5]).engines}
    assert not with_mig["by-uuid"].enabled
    assert "engine by-uuid not started: GPU(s) [5] have MIG enabled" in caplog.text
