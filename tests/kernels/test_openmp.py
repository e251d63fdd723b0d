"""kernels.openmp: a side thread runs its torch ops without an OpenMP team of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from baton_serve.kernels import openmp

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not torch.backends.openmp.is_available(),
                                reason="needs Linux /proc and torch built with OpenMP")

_SCRIPT = textwrap.dedent("""
    import os, sys, threading, torch
    from baton_serve.kernels import openmp
    torch.set_num_threads(2)
    serial = sys.argv[1] == "serial"
    out = {}
    def side():
        if serial:
            out["applied"] = openmp.serial_here()
        before = len(os.listdir("/proc/self/task"))
        cache = torch.randn(2048, 16, 3, 64).to(torch.bfloat16)  # a KV gather, as shipping does
        ids = torch.arange(0, 2048, 2)
        for _ in range(3):
            cache.index_select(0, ids).clone()
        out["new_threads"] = len(os.listdir("/proc/self/task")) - before
        out["side"] = torch.get_num_threads()
    t = threading.Thread(target=side); t.start(); t.join()
    print(out.get("applied"), out["new_threads"], out["side"], torch.get_num_threads())
""")


def _run(mode: str) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.split()


def test_a_side_thread_with_two_threads_starts_a_team():
    """The control: without serial_here the side thread's gather starts an OpenMP thread."""
    applied, new_threads, side, main = _run("parallel")
    assert int(new_threads) >= 1 and side == "2" and main == "2"


def test_serial_here_keeps_the_side_thread_from_starting_a_team():
    applied, new_threads, side, main = _run("serial")
    assert applied == "True"
    assert new_threads == "0" and side == "1"
    assert main == "2"  # other threads keep their team size


def test_serial_here_is_per_thread_in_this_process():
    before = torch.get_num_threads()
    seen: dict[str, object] = {}

    def side() -> None:
        seen["applied"] = openmp.serial_here()
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=side)
    t.start()
    t.join()
    assert seen == {"applied": True, "threads": 1}
    assert torch.get_num_threads() == before


_RELEASE = textwrap.dedent("""
    import os, time, torch
    from baton_serve.kernels import openmp
    torch.set_num_threads(2)
    def threads():
        return len(os.listdir("/proc/self/task"))
    base = threads()  # no team yet
    x = torch.randn(512, 512)
    want = x @ x
    seen = []
    for _ in range(3):
        assert torch.equal(x @ x, want)
        with_team = threads()
        released = openmp.release_team()
        deadline = time.monotonic() + 5
        while threads() >= with_team and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append((with_team - base, released, with_team - threads()))
    assert torch.equal(x @ x, want) and threads() - base == seen[0][0]
    print(seen)
""")


def test_release_team_ends_the_team_and_the_next_region_starts_a_new_one():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _RELEASE], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    # each round: the team had a thread, release said yes, and that thread was gone after it
    assert eval(done.stdout.strip()) == [(1, True, 1)] * 3
