"""The paged KV cache's bookkeeping: block pool, per-request block tables, prefix-cache keys."""
