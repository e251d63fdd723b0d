"""One scrape for the whole deployment: a front's ``/metrics`` adds the other fronts' share.

Several HTTP fronts share a port, so a Prometheus scrape lands on any one of them. Each front asks
the others for their exposition and answers with the sum of what is counted per front (requests,
tokens, latencies, admission) and its own view of what every front mirrors (the workers' state,
polled by each front alike). Pure: text in, text out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Families:
    """Parsed families handed back to ``generate_latest`` (a collector over fixed data)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


def merge_expositions(own: bytes, peers: Iterable[bytes], per_front: set[str]) -> bytes:
    """``own`` with, for each family named in ``per_front``, every peer's samples added in: values
    summed (counters, gauges, histogram buckets, sums and counts), ``_created`` the earliest. A
    series only a peer has is added as it is. Families not in ``per_front`` are ``own``'s alone."""
    families = list(text_string_to_metric_families(own.decode()))
    by_name = {f.name: f for f in families}
    for text in peers:
        for peer in text_string_to_metric_families(text.decode()):
            if peer.name not in per_front:
                continue
            mine = by_name.get(peer.name)
            if mine is None:
                by_name[peer.name] = peer
                families.append(peer)
                continue
            index = {_key(s): i for i, s in enumerate(mine.samples)}
            for s in peer.samples:
                i = index.get(_key(s))
                if i is None:
                    index[_key(s)] = len(mine.samples)
                    mine.samples.append(s)
                    continue
                old = mine.samples[i]
                value = min(old.value, s.value) if s.name.endswith("_created") else old.value + s.value
                mine.samples[i] = old._replace(value=value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)
