"""The front's view of the worker pools: decisions as plain code (``routing``, ``placement``,
``streams``, ``admission``), and the thin I/O that carries them out (``links``, ``sync``, ``client``)."""

from cluster.front.client import PoolClient  # noqa: F401
from cluster.front.workers import WorkerRef  # noqa: F401
