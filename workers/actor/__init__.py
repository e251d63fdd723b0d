"""The Ray worker actor and what it needs around the engine: output streams, core sharing, wire messages."""
