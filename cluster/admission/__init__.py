"""Admission: who may send work (tenants, keys, rate limits) and whether it fits now (KV reservations)."""
