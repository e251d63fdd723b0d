"""Where a served run's CPU time goes, per 1k output tokens: read from /proc before and after a
workload, for every process of the server (Ray's included) and every thread of Baton's workers.

Buckets: ``engine`` (the worker's ``baton-engine`` thread and the OpenMP team it starts: the steps,
their scheduling and output processing), ``output_stream`` (the worker's ``baton-output`` socket
writer), ``worker_other`` (the rest of a worker process: Ray's core-worker threads, the actor's
asyncio loop, KV shipping), ``front`` (the HTTP fronts: request parsing, detokenization, stop
checks, SSE encoding), ``controller``, ``ray`` (raylet, GCS, dashboard, idle Ray workers),
``server_other`` (the ``baton serve`` driver and anything else under it; a peer server's processes
all land here), and ``client`` (the load generator, this process).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUCKETS = ("engine", "output_stream", "worker_other", "front", "controller", "ray", "server_other", "client")
_RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent.py",
               "default_worker.py", "ray::IDLE", "ray::JobSupervisor")


@dataclass
class ProcessCPU:
    """One process's command line and CPU seconds (user + system) per thread name."""

    cmd: str
    threads: dict[str, float] = field(default_factory=dict)


def _cpu_s(stat_text: str) -> tuple[str, float]:
    comm = stat_text[stat_text.index("(") + 1:stat_text.rindex(")")]
    fields = stat_text.rsplit(")", 1)[1].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def sample(pids: list[int]) -> dict[int, ProcessCPU]:
    """CPU so far of each of ``pids`` and of its threads (processes gone by now are left out)."""
    out: dict[int, ProcessCPU] = {}
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            proc = ProcessCPU(cmd or Path(f"/proc/{pid}/comm").read_text().strip())
            for task in Path(f"/proc/{pid}/task").iterdir():
                comm, cpu = _cpu_s((task / "stat").read_text())
                proc.threads[comm] = proc.threads.get(comm, 0.0) + cpu
        except (OSError, ValueError, IndexError):
            continue
        out[pid] = proc
    return out


def bucket_of(cmd: str, thread: str) -> str:
    """The bucket a thread of a process with command line ``cmd`` counts in."""
    if cmd.startswith("ray::"):
        actor = cmd[5:].split(".", 1)[0].split()[0]
        if "Worker" in actor and actor != "IDLE":
            return {"baton-engine": "engine", "baton-output": "output_stream"}.get(thread, "worker_other")
        if actor == "RankActor":  # a tensor-parallel rank: its whole process computes shards of steps
            return "engine"
        if actor in ("HTTPFront", "IdempotencyOwners"):
            return "front"
        if actor == "GlobalController":
            return "controller"
        return "ray"
    if any(part in cmd for part in _RAY_SYSTEM):
        return "ray"
    return "server_other"


def client_cpu_s() -> float:
    """CPU seconds so far of this process (the load generator), all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_1k_tokens(before: dict[int, ProcessCPU], after: dict[int, ProcessCPU], client_s: float,
                  output_tokens: int) -> dict[str, float]:
    """CPU seconds per 1k output tokens in each bucket between two samples, and their ``total``
    (a process that started in between counts from zero; threads that ended are lost)."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    for pid, proc in after.items():
        was = before.get(pid)
        for thread, cpu in proc.threads.items():
            start = was.threads.get(thread, 0.0) if was is not None and was.cmd == proc.cmd else 0.0
            seconds[bucket_of(proc.cmd, thread)] += max(0.0, cpu - start)
    seconds["client"] = client_s
    scale = 1000.0 / max(output_tokens, 1)
    out = {name: round(s * scale, 4) for name, s in seconds.items()}
    out["total"] = round(sum(seconds.values()) * scale, 4)
    return out
