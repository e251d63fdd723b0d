"""Which node this process runs on, as Ray knows it: the address peers on other nodes reach it
by, and the node's id (workers on one node may share memory; an address says nothing of that)."""

from __future__ import annotations


def _ray() -> object | None:
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def node_address() -> str:
    """The address Ray knows this node by, or loopback outside Ray."""
    ray = _ray()
    return ray.util.get_node_ip_address() if ray is not None else "127.0.0.1"


def node_id() -> str | None:
    """Ray's id for this node, or None outside Ray."""
    ray = _ray()
    return ray.get_runtime_context().get_node_id() if ray is not None else None
