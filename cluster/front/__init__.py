"""The front's view of the worker pools: decisions as plain code (``routing``, ``placement``,
``streams``, ``admission``), and the thin I/O that carries them out (``links``, ``sync``, ``client``)."""

from baton_serve.cluster.front.client import PoolClient  # noqa: F401
from baton_serve.cluster.front.workers import WorkerRef  # noqa: F401
