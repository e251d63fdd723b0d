"""Two Ray nodes on one machine, for tests and benchmarks: Linux network namespaces joined by a
veth pair (addresses from 198.18.0.0/15), a Ray head in namespace A and a Ray node in B, each with
a custom resource (``node_a``, ``node_b``) to pin pools by. Needs root and iproute2.

Everything it starts lives in the two namespaces, so ``stop`` kills exactly that (``ray stop``
would kill every Ray instance on the machine) and deletes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no permission)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def ray_env() -> dict[str, str]:
    """The environment for Ray and Baton processes in the namespaces."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Multi-node needs this on: Ray refuses to join nodes when it reads 0.
    env.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return env


@dataclass
class TwoNodes:
    """Names and addresses of one lab; ``start`` builds it, ``stop`` removes every trace."""

    tag: str = field(default_factory=lambda: f"bt{os.getpid() % 100000}")
    ray_port: int = 6390
    cpus_per_node: int = 1

    def __post_init__(self) -> None:
        octet = os.getpid() % 200 + 20
        self.ns_a, self.ns_b = f"{self.tag}a", f"{self.tag}b"
        self.dev_a, self.dev_b = f"{self.tag}va", f"{self.tag}vb"
        self.addr_a, self.addr_b = f"198.18.{octet}.1", f"198.18.{octet}.2"
        self.temp_dir = ""

    @property
    def ray_address(self) -> str:
        return f"{self.addr_a}:{self.ray_port}"

    def run_in(self, ns: str, *cmd: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                              timeout=timeout, env=ray_env(), **kwargs)

    def popen_in(self, ns: str, *cmd: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=ray_env(), text=True, **kwargs)

    def link(self, up: bool) -> None:
        """Bring the veth between the nodes up or down (a cable pulled, a switch port lost)."""
        ip("-n", self.ns_a, "link", "set", self.dev_a, "up" if up else "down")

    def start(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unavailable("network namespaces need root and iproute2")
        probe = ip("netns", "add", self.ns_a, check=False)
        if probe.returncode != 0:
            raise Unavailable(f"cannot create a network namespace here: {probe.stderr.strip()}")
        self.temp_dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        try:
            ip("netns", "add", self.ns_b)
            ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            ip("link", "set", self.dev_a, "netns", self.ns_a)
            ip("link", "set", self.dev_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a), (self.ns_b, self.dev_b, self.addr_b)):
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", dev, "up")
            ray = str(BIN / "ray")
            common = ["--num-cpus", str(self.cpus_per_node), "--disable-usage-stats",
                      "--object-store-memory", str(256 << 20)]
            head = self.run_in(self.ns_a, ray, "start", "--head", "--node-ip-address", self.addr_a,
                               "--port", str(self.ray_port), "--resources", '{"node_a": 1}',
                               "--temp-dir", self.temp_dir, "--include-dashboard", "false", *common)
            if head.returncode != 0:
                raise RuntimeError(f"ray start --head failed: {head.stdout}{head.stderr}")
            node = self.run_in(self.ns_b, ray, "start", "--address", self.ray_address, "--node-ip-address",
                               self.addr_b, "--resources", '{"node_b": 1}', *common)
            if node.returncode != 0:
                raise RuntimeError(f"ray start on node B failed: {node.stdout}{node.stderr}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _kill_namespace(ns)
            ip("netns", "del", ns, check=False)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def gone(self) -> bool:
        listed = ip("netns", "list").stdout
        return self.ns_a not in listed and self.ns_b not in listed

    @contextlib.contextmanager
    def running(self) -> Iterator[TwoNodes]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns`` (Ray daemons, workers, servers) and wait until none is left."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ip("netns", "pids", ns, check=False).stdout.strip():
        time.sleep(0.1)
