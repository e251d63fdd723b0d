"""The KV connectors, one module per transport (``workers.kv.connector`` is their contract)."""
