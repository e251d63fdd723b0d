"""GlobalController: health checks mark dead workers, the overload signal follows live queues."""

from __future__ import annotations

import time

from cluster.controller import GlobalController


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
