"""`baton plan sim`: our real scheduler, block manager and front decisions on a virtual clock, with the forward pass and KV transfer taken from a measured latency profile."""
