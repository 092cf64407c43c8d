"""Hand-made process sweeps of a vLLM 0.32 engine for the hang rules' unit tests: the API server
(the group's leader), EngineCore and Worker, and the CPU each has used (virtual time)."""

from __future__ import annotations

from llmsupervisor.probes.host import ProcInfo, ProcSample

API, CORE, WORKER = 4100, 4101, 4102
TITLES = {API: "vllm serve", CORE: "VLLM::EngineCore", WORKER: "VLLM::Worker"}


def sweep(
    at_s: float,
    cpu_s: dict[int, float],
    status: dict[int, str] | None = None,
    *,
    main_thread_cpu_s: dict[int, float] | None = None,
) -> ProcSample:
    """The engine's group at ``at_s``: each process's CPU seconds, asleep unless ``status`` says,
    and its main thread's where ``main_thread_cpu_s`` has it (the sweep reads the leader's)."""
    infos = tuple(
        ProcInfo(
            pid=pid,
            title=TITLES[pid],
            rss_bytes=1 << 30,
            cpu_seconds=cpu,
            status=(status or {}).get(pid, "sleeping"),
            zombie=False,
            main_thread_cpu_seconds=(main_thread_cpu_s or {}).get(pid),
        )
        for pid, cpu in sorted(cpu_s.items())
    )
    return ProcSample(
        pgid=API,
        processes=infos,
        rss_bytes_total=len(infos) << 30,
        cpu_seconds_total=sum(cpu_s.values()),
        process_count=len(infos),
        zombie_count=0,
        at_s=at_s,
    )


class Engine:
    """The engine's CPU per process: ``run`` adds ``rate[pid]`` of a core from the last time up
    to ``until_s``."""

    def __init__(self) -> None:
        self.cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
        self.t = 0.0

    def run(self, until_s: float, rate: dict[int, float]) -> dict[int, float]:
        for pid, r in rate.items():
            self.cpu[pid] += r * (until_s - self.t)
        self.t = until_s
        return dict(self.cpu)
