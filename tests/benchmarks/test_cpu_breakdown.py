"""The served run's CPU breakdown: /proc sampling per thread name, buckets by process and thread,
and the per-1k-token arithmetic."""

from __future__ import annotations

import os
import threading
import time

import pytest
from baton_serve.workers.thread_name import name_this_thread

from benchmarks import cpu_breakdown
from benchmarks.cpu_breakdown import ProcessCPU, bucket_of, per_1k_tokens

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def test_a_named_threads_cpu_is_sampled_under_its_name() -> None:
    stop = threading.Event()

    def spin() -> None:
        name_this_thread("baton-engine")
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            threads = cpu_breakdown.sample([os.getpid()])[os.getpid()].threads
            if threads.get("baton-engine", 0) >= 0.05:
                break
            time.sleep(0.05)
        assert threads.get("baton-engine", 0) >= 0.05, threads
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("cmd,thread,bucket", [
    ("ray::Worker.generate", "baton-engine", "engine"),
    ("ray::Worker", "baton-output", "output_stream"),
    ("ray::Worker.stats", "grpc_global_tim", "worker_other"),
    ("ray::RankActor.serve", "python", "engine"),
    ("ray::HTTPFront.serve", "python", "front"),
    ("ray::GlobalController", "health", "controller"),
    ("ray::IDLE", "python", "ray"),
    ("/x/ray/core/src/ray/raylet/raylet --node", "raylet", "ray"),
    ("/x/ray/core/src/ray/gcs/gcs_server --port", "gcs_server", "ray"),
    ("/x/.venv/bin/python /x/.venv/bin/baton serve", "python", "server_other"),
    ("python -m vllm.entrypoints.openai.api_server", "python", "server_other"),
])
def test_buckets(cmd: str, thread: str, bucket: str) -> None:
    assert bucket_of(cmd, thread) == bucket


def test_per_1k_tokens_counts_deltas_and_new_processes() -> None:
    before = {1: ProcessCPU("ray::Worker", {"baton-engine": 10.0, "grpc": 1.0}),
              2: ProcessCPU("ray::HTTPFront", {"python": 2.0})}
    after = {1: ProcessCPU("ray::Worker", {"baton-engine": 14.0, "grpc": 1.5}),
             2: ProcessCPU("ray::HTTPFront", {"python": 3.0}),
             3: ProcessCPU("raylet", {"raylet": 0.25})}  # started in between: counts from zero
    got = per_1k_tokens(before, after, client_s=0.5, output_tokens=2000)
    assert got["engine"] == 2.0 and got["worker_other"] == 0.25 and got["front"] == 0.5
    assert got["ray"] == 0.125 and got["client"] == 0.25 and got["output_stream"] == 0.0
    assert got["total"] == pytest.approx(3.125)


def test_a_pid_reused_by_another_command_counts_from_zero() -> None:
    before = {7: ProcessCPU("ray::IDLE", {"python": 5.0})}
    after = {7: ProcessCPU("ray::Worker", {"python": 1.0})}
    assert per_1k_tokens(before, after, 0.0, 1000)["worker_other"] == 1.0
