"""GlobalController: health checks mark dead workers, the overload signal follows live queues."""

from __future__ import annotations

import os
import time

from baton_serve.cluster.controller import GlobalController


def test_health_checks_and_overload_signal(ray_session):
    ray = ray_session

    class FakeWorker:
        def __init__(self, waiting: int) -> None:
            self.waiting = waiting

        def stats(self) -> dict:
            return {"num_waiting": self.waiting, "alive": True}

    fake = ray.remote(num_cpus=0)(FakeWorker)
    a, b = fake.remote(3), fake.remote(3)
    ctl = ray.remote(num_cpus=0, max_concurrency=4)(GlobalController).remote(
        max_waiting=5, interval_s=0.1, timeout_s=1.0, failure_threshold=2)
    ray.get([ctl.register.remote("a", "prefill", a), ctl.register.remote("b", "decode", b)])

    def wait_for(pred, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = ray.get(ctl.snapshot.remote())
            if pred(snap):
                return snap
            time.sleep(0.05)
        raise AssertionError(f"condition not reached: {snap}")

    snap = wait_for(lambda s: s["num_waiting"] == 6)
    assert snap["overloaded"] and all(m["alive"] for m in snap["members"].values())
    ray.kill(b)
    snap = wait_for(lambda s: not s["members"]["b"]["alive"])
    assert snap["members"]["a"]["alive"] and snap["num_waiting"] == 3 and not snap["overloaded"]
    ray.get(ctl.mark_dead.remote("a"))
    assert not ray.get(ctl.snapshot.remote())["members"]["a"]["alive"]
    ray.get(ctl.shutdown.remote())


def _restartable() -> type:
    """A worker stand-in with what the controller calls on a restart (defined in a function, so
    Ray pickles the class by value: the controller's process cannot import this test module)."""

    class Restartable:
        def __init__(self, worker_id: str, incarnation: int = 0) -> None:
            import os

            self.worker_id, self.peers, self.incarnation = worker_id, {}, incarnation
            self.pid = os.getpid()

        def stats(self) -> dict:
            return {"num_waiting": 0, "alive": True}

        def info(self) -> dict:
            return {"worker_id": self.worker_id, "pid": self.pid, "incarnation": self.incarnation}

        def set_peers(self, peers: dict) -> None:
            self.peers = peers

        def peer_ids(self) -> list:
            return sorted(self.peers)

    return Restartable


def _wait(ray, ctl, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    snap = None
    while time.monotonic() < deadline:
        try:
            snap = ray.get(ctl.snapshot.remote(), timeout=5)
        except ray.exceptions.ActorUnavailableError:
            # A restarted actor's handle can say "restarting" for a while after it answered once;
            # a test that restarts the controller checks it was started only once by its pid.
            time.sleep(0.1)
            continue
        if pred(snap):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"condition not reached: {snap}")


def test_dead_worker_is_restarted_with_backoff_then_quarantined(ray_session):
    """A killed worker comes back as a new actor (same id, new incarnation, peers told); once it
    has died more than max_restarts times within the window, it stays dead (quarantined)."""
    from baton_serve.cluster.restarts import RestartPolicy, WorkerSpec

    ray = ray_session
    cls = _restartable()
    actor = ray.remote(num_cpus=0)(cls)
    a, b = actor.remote("a"), actor.remote("b")
    ctl = ray.remote(num_cpus=0, max_concurrency=8)(GlobalController).remote(
        max_waiting=100, interval_s=0.1, timeout_s=1.0, failure_threshold=1,
        restart=RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.2, max_backoff_s=0.4))
    spec = WorkerSpec("a", "decode", cls, {"num_cpus": 0}, ("a",))
    ray.get([ctl.register.remote("a", "decode", a, spec), ctl.register.remote("b", "prefill", b)])
    first_pid = ray.get(a.info.remote())["pid"]
    try:
        last = 0
        for n in (1, 2):
            _, old, _ = ray.get(ctl.worker.remote("a"))
            ray.kill(old)
            _wait(ray, ctl, lambda s, n=n: s["members"]["a"]["restarts"] == n and s["members"]["a"]["alive"])
            incarnation, handle, info = ray.get(ctl.worker.remote("a"))
            assert incarnation > last and info["incarnation"] == incarnation  # the worker knows it too
            assert info["worker_id"] == "a" and info["pid"] != first_pid
            last = incarnation
            assert ray.get(handle.peer_ids.remote()) == ["a", "b"]  # told of every worker, itself too
            assert ray.get(b.peer_ids.remote()) == ["a", "b"]
        ray.kill(handle)  # a third death within the window: more than max_restarts
        _wait(ray, ctl, lambda s: s["members"]["a"]["quarantined"])
        time.sleep(1.0)  # longer than any backoff: it stays down
        member = ray.get(ctl.snapshot.remote())["members"]["a"]
        assert not member["alive"] and member["restarts"] == 2 and member["restart_at"] is None
        # A worker registered without a spec (b) is watched but never restarted.
        ray.kill(b)
        _wait(ray, ctl, lambda s: not s["members"]["b"]["alive"])
        time.sleep(0.5)
        assert ray.get(ctl.snapshot.remote())["members"]["b"]["incarnation"] == 0
    finally:
        ray.get(ctl.shutdown.remote())
        for h in ray.get(ctl.handles.remote()).values():
            ray.kill(h)


def test_a_stale_death_report_does_not_kill_the_restarted_worker(ray_session):
    from baton_serve.cluster.restarts import RestartPolicy, WorkerSpec

    ray = ray_session
    cls = _restartable()
    a = ray.remote(num_cpus=0)(cls).remote("a")
    ctl = ray.remote(num_cpus=0, max_concurrency=8)(GlobalController).remote(
        max_waiting=100, interval_s=0.1, timeout_s=1.0, failure_threshold=1,
        restart=RestartPolicy(backoff_s=0.1))
    ray.get(ctl.register.remote("a", "decode", a, WorkerSpec("a", "decode", cls, {"num_cpus": 0}, ("a",))))
    try:
        ray.get(ctl.mark_dead.remote("a", 0))  # a front saw incarnation 0 fail
        snap = _wait(ray, ctl, lambda s: s["members"]["a"]["restarts"] == 1 and s["members"]["a"]["alive"])
        incarnation = snap["members"]["a"]["incarnation"]
        ray.get(ctl.mark_dead.remote("a", 0))  # another front, late, about the same death
        time.sleep(0.5)
        member = ray.get(ctl.snapshot.remote())["members"]["a"]
        assert member["alive"] and member["restarts"] == 1 and member["incarnation"] == incarnation
    finally:
        ray.get(ctl.shutdown.remote())
        for h in ray.get(ctl.handles.remote()).values():
            ray.kill(h)


def test_a_restarted_controller_rebuilds_its_view_from_the_workers(ray_session):
    """Killed, the controller is started again by Ray with its members: it finds the workers as
    they are now (a restarted one by its name) and goes on restarting the dead."""
    from baton_serve.cluster.restarts import RestartPolicy, WorkerSpec

    ray = ray_session
    cls = _restartable()
    opts = {"num_cpus": 0, "name": "rb-a", "namespace": "rebuild-test"}
    a = ray.remote(cls).options(**opts).remote("a")
    ctl = ray.remote(GlobalController).options(num_cpus=0, max_concurrency=8, max_restarts=-1).remote(
        max_waiting=100, interval_s=0.1, timeout_s=1.0, failure_threshold=1, restart=RestartPolicy(backoff_s=0.1),
        members=[(WorkerSpec("a", "decode", cls, opts, ("a",)), a)])
    try:
        _wait(ray, ctl, lambda s: s["members"]["a"]["alive"])
        ray.kill(a)
        snap = _wait(ray, ctl, lambda s: s["members"]["a"]["restarts"] == 1 and s["members"]["a"]["alive"])
        incarnation = snap["members"]["a"]["incarnation"]
        _pid = lambda _actor: os.getpid()  # noqa: E731 - a lambda travels by value, a test-module function does not
        first_pid = ray.get(ctl.__ray_call__.remote(_pid), timeout=10)
        ray.kill(ctl, no_restart=False)  # Ray starts it again, from its constructor's members
        deadline = time.monotonic() + 30
        while True:  # calls fail while it restarts; the old process may still answer until it is gone
            try:
                pid = ray.get(ctl.__ray_call__.remote(_pid), timeout=5)
                if pid != first_pid:
                    snap = ray.get(ctl.snapshot.remote(), timeout=5)
                    if snap["members"]["a"]["incarnation"] == incarnation:
                        break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the controller did not come back with the worker's view"
            time.sleep(0.1)
        assert snap["members"]["a"]["alive"]  # the restarted worker found by name, not the dead first one
        for _ in range(50):  # the first calls on a restarted actor's handle may still say it restarted
            try:
                _, handle, _ = ray.get(ctl.worker.remote("a"), timeout=5)
                break
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.1)
        ray.kill(handle)
        snap = _wait(ray, ctl, lambda s: s["members"]["a"]["incarnation"] > incarnation and s["members"]["a"]["alive"])
        assert ray.get(ctl.__ray_call__.remote(_pid), timeout=10) == pid  # not restarted again
    finally:
        ray.get(ctl.shutdown.remote())
        for h in ray.get(ctl.handles.remote()).values():
            ray.kill(h)
        ray.kill(ctl, no_restart=True)
