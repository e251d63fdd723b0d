"""KV moving between workers: migration metadata, connectors per transport, pair groups, events."""
