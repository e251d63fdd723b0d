"""Ray for cluster tests: a local instance on loopback per test module, shut down after it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import local_ray

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    yield from local_ray(2)


@contextlib.contextmanager
def serving(proc: subprocess.Popen, timeout_s: float = 120.0) -> Iterator[list[str]]:
    """Yield what a ``baton serve`` process printed up to its "ready in" line (or its exit); on
    leaving, SIGINT it and require a clean exit (code 0) within 60 s."""
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(ln.startswith("ready in") for ln in lines):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
        yield lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, "".join(lines) + (proc.stdout.read() or "")
