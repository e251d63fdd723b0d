"""Exactly-once usage records: one ``UsageRecord`` per response, kept by a ``UsageStore`` chosen by name."""

from baton_serve.cluster.usage.record import COLUMNS, ENDPOINTS, UsageRecord
from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore
from baton_serve.cluster.usage.store import (
    UsageStore,
    UsageStoreClosed,
    UsageStoreFactory,
    make_usage_store,
    register_usage_store,
    usage_store_names,
)

__all__ = [
    "COLUMNS",
    "ENDPOINTS",
    "SQLiteUsageStore",
    "UsageRecord",
    "UsageStore",
    "UsageStoreClosed",
    "UsageStoreFactory",
    "make_usage_store",
    "register_usage_store",
    "usage_store_names",
]
