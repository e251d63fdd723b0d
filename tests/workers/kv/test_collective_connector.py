"""The collective connector's abandon: only a broken pair group goes, and never under a transfer."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from baton_serve.workers.kv.connectors.collective import CollectiveConnector


class _Group:
    def __init__(self, usable: bool) -> None:
        self.usable, self.closed = usable, False

    def close(self) -> None:
        self.closed = True


class _Peer:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.kv_cancel = SimpleNamespace(remote=lambda member, index: self.cancelled.append(member))


def _shipment(member: str) -> SimpleNamespace:
    return SimpleNamespace(member_id=member, meta=SimpleNamespace(index=int(member.rsplit("#", 1)[-1] or 0)
                                                                 if "#" in member else 0))


def test_a_shipment_that_failed_before_the_wire_leaves_the_group_for_the_next_one():
    c = CollectiveConnector(SimpleNamespace())
    group = c._pairs["decode-0"] = _Group(usable=True)
    peer = _Peer()
    c.abandon("decode-0", peer, _shipment("a#0"))  # aborted at its reservation: the group is fine
    assert c._pairs["decode-0"] is group and not group.closed and peer.cancelled == ["a#0"]
    group.usable = False  # a transfer failed part-way
    c.abandon("decode-0", peer, _shipment("b#0"))
    assert "decode-0" not in c._pairs and group.closed


def test_abandon_waits_for_the_transfer_on_the_pair_before_looking_at_the_group():
    c = CollectiveConnector(SimpleNamespace())
    group = c._pairs["decode-0"] = _Group(usable=True)
    done = threading.Event()
    with c._lock("decode-0"):  # another request's transfer holds the pair
        t = threading.Thread(target=lambda: (c.abandon("decode-0", _Peer(), _shipment("x")), done.set()))
        t.start()
        time.sleep(0.1)
        assert not done.is_set()  # blocked behind the transfer
        group.usable = False
    t.join(5)
    assert done.is_set() and group.closed
