"""The core-share board: steps that fit run side by side, others take turns in asking order,
a turn passes by ringing the waiter's bell (no polling), and a dead worker never holds the cores."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from baton_serve.workers.actor import core_share
from baton_serve.workers.actor.core_share import (
    RUNNING,
    WAITING,
    CoreShare,
    bell_path,
    create_board,
    remove_board,
)


@pytest.fixture
def board(tmp_path, monkeypatch):
    # Waiters re-read the board only when rung: a turn that passed by the fallback re-check
    # would time these tests out.
    monkeypatch.setattr(core_share, "_RECHECK_S", 60.0)

    def make(slots: int, cores: int, threads: int) -> list[CoreShare]:
        path = create_board(slots, directory=str(tmp_path))
        return [CoreShare(path, i, cores=cores, threads=threads) for i in range(slots)]
    return make


def _start(seat: CoreShare, log: list[int], tag: int, on_wake=None) -> threading.Thread:
    def run() -> None:
        seat.before_step(on_wake=on_wake)
        log.append(tag)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_steps_that_fit_run_side_by_side(board):
    a, b = board(2, cores=4, threads=2)
    a.before_step()
    b.before_step()  # 2 + 2 threads fit 4 cores: no wait
    assert [s[1] for s in a.state()] == [RUNNING, RUNNING]
    a.after_step()
    b.after_step()


def _a_running_b_waiting(board, on_wake=None) -> tuple[CoreShare, CoreShare, list[int], threading.Thread]:
    """Two workers of 2 threads on 2 cores: a is mid-step, b has asked and waits."""
    a, b = board(2, cores=2, threads=2)
    a.before_step()
    log: list[int] = []
    t = _start(b, log, 1, on_wake)
    _wait_until(lambda: a.state()[1][1] == WAITING)
    return a, b, log, t


def test_a_step_that_does_not_fit_waits_for_the_running_one(board):
    a, b, log, t = _a_running_b_waiting(board)
    assert log == []  # still waiting: a holds both cores
    a.after_step()
    t.join(5)
    assert log == [1] and a.state()[1][1] == RUNNING
    b.after_step()
    assert b.wait_seconds > 0


def test_a_worker_ends_its_team_before_it_waits_and_when_it_hands_over(board):
    a, b = board(2, cores=2, threads=2)
    log: list[int] = []
    ends: list[tuple[str, int]] = []  # (who, steps let in so far)
    a._release_team = lambda: ends.append(("a", len(log)))
    b._release_team = lambda: ends.append(("b", len(log)))
    a.before_step()  # admitted at once: keeps its team
    t = _start(b, log, 1)
    _wait_until(lambda: ends == [("b", 0)])  # b must wait: its team must not spin on a's cores
    a.after_step()  # hands over: ends its team before b is let in
    t.join(5)
    assert ends == [("b", 0), ("a", 0)] and log == [1] and a.handoffs == 1
    b.after_step()
    a.before_step()  # nobody waits, nobody runs: a keeps its team for its next step
    a.after_step()
    assert len(ends) == 2 and a.handoffs == 1 and b.handoffs == 0


def test_busy_workers_alternate_in_asking_order(board):
    a, b, log, tb = _a_running_b_waiting(board)
    a.after_step()
    ta = _start(a, log, 0)  # a asks again at once, but b asked first
    tb.join(5)
    _wait_until(lambda: a.state()[0][1] == WAITING)
    assert log == [1]
    b.after_step()
    ta.join(5)
    assert log == [1, 0]
    a.after_step()


def test_a_waiter_sleeps_until_rung(board):
    """No polling: a waiting worker wakes only for its bell (a command, or freed cores)."""
    wakes: list[float] = []
    a, b, log, t = _a_running_b_waiting(board, on_wake=lambda: wakes.append(time.monotonic()))
    time.sleep(0.3)
    assert wakes == []  # nothing happened, so nothing woke it
    b.ring()  # e.g. a KV reservation arrived for b's engine loop
    _wait_until(lambda: len(wakes) == 1)
    assert log == []  # handled its command, still waiting for the cores
    a.after_step()
    t.join(5)
    assert log == [1] and len(wakes) == 2
    b.after_step()


def test_a_later_asker_that_fits_beside_an_earlier_one_is_woken(board, tmp_path):
    """4 cores: a (4 threads) runs while b then c (2 threads each) wait. When a finishes, c may
    wake first and defer to b's earlier ticket; b's admission must then wake c, as both fit."""
    path = create_board(3, directory=str(tmp_path))
    a = CoreShare(path, 0, cores=4, threads=4)
    b, c = (CoreShare(path, i, cores=4, threads=2) for i in (1, 2))
    a.before_step()
    log: list[int] = []
    tb = _start(b, log, 1, on_wake=lambda: time.sleep(0.2))  # b is slow to look: c looks first
    _wait_until(lambda: a.state()[1][1] == WAITING)
    tc = _start(c, log, 2)
    _wait_until(lambda: a.state()[2][1] == WAITING)
    a.after_step()
    tb.join(5)
    tc.join(5)
    assert sorted(log) == [1, 2] and [s[1] for s in a.state()] == [0, RUNNING, RUNNING]
    b.after_step()
    c.after_step()


def test_a_team_larger_than_the_machine_asks_for_all_of_it(board):
    [a] = board(1, cores=2, threads=8)
    assert a.threads == 2
    a.before_step()
    a.after_step()


def test_a_dead_worker_holds_nothing(board, tmp_path):
    a, b = board(2, cores=2, threads=2)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    # b's slot claims the cores for a process that has exited (killed mid-step)
    core_share._SLOT.pack_into(b._map, b._offset(1), int(gone.stdout), RUNNING, 1, 2)
    a.before_step()  # not blocked
    assert a.state()[0][1] == RUNNING
    a.after_step()


def test_a_bell_past_descriptor_1024_still_wakes_its_waiter(board):
    """Ray workers hold many sockets: the wait must not rely on select(), which stops at 1024."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip("cannot open 1100 descriptors here")
    if soft != resource.RLIM_INFINITY and soft < 1100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        a, b, log, t = _a_running_b_waiting(board)
        assert b._bell > 1024
        a.after_step()
        t.join(5)
        assert log == [1]
        b.after_step()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_remove_board_deletes_the_bells(tmp_path):
    path = create_board(2, directory=str(tmp_path))
    seat = CoreShare(path, 0, cores=2, threads=1)
    assert bell_path(path, 0).exists() and bell_path(path, 1).exists()
    remove_board(path)
    assert list(tmp_path.iterdir()) == []
    seat.before_step()  # a worker that still has it open keeps working
    seat.after_step()  # ringing a bell that is gone is not an error
    seat.close()


def test_bad_boards_and_slots_are_errors(tmp_path):
    with pytest.raises(ValueError):
        create_board(0, directory=str(tmp_path))
    path = create_board(1, directory=str(tmp_path))
    with pytest.raises(ValueError, match="slot"):
        CoreShare(path, 1, cores=2, threads=1)
    with pytest.raises(ValueError):
        CoreShare(path, 0, cores=0, threads=1)
