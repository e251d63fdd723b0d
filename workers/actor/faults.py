"""Named fault points a test arms on a live worker (``Worker.arm_fault``), in the spirit of
FoundationDB's buggify: the fault suite corrupts a KV transfer at the one place a real
corruption would be caught, instead of patching code it cannot reach inside a Ray actor.
Unarmed, a point costs one dict lookup.
"""

from __future__ import annotations

import threading

# Every point a worker consults, so arming a misspelt one fails loudly.
FAULT_POINTS = {
    "corrupt_received_kv": "flip a byte of the first block a decode worker received, before its checksum is checked",
    "stall_kv_send": "collective connector: once the decode worker has reserved blocks and waits for the data, "
                     "the sender stalls for three KV timeouts (a test kills it meanwhile: death mid-transfer)",
}


class FaultPoints:
    """How many more times each armed point fires."""

    def __init__(self) -> None:
        self._armed: dict[str, int] = {}
        self._lock = threading.Lock()

    def arm(self, name: str, count: int = 1) -> None:
        if name not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {name!r}; known: {sorted(FAULT_POINTS)}")
        with self._lock:
            self._armed[name] = self._armed.get(name, 0) + count

    def fire(self, name: str) -> bool:
        """True (and one fewer left) when ``name`` is armed."""
        if not self._armed:
            return False
        with self._lock:
            left = self._armed.get(name, 0)
            if left <= 0:
                return False
            self._armed[name] = left - 1
            return True
