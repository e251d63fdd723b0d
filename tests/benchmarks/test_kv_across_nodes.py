"""benchmarks/kv_across_nodes.py's table: medians per prompt length, both placements side by side
(the measuring itself needs root and namespaces: it is what tests/cluster/test_two_nodes.py runs)."""

from __future__ import annotations

from benchmarks import kv_across_nodes


def _rows(*ms: float, nbytes: int = 2_000_000) -> list[dict]:
    return [{"seconds": m / 1e3, "bytes": nbytes, "mb_per_s": nbytes / (m / 1e3) / 1e6} for m in ms]


def test_the_table_shows_median_transfer_times_and_the_served_ratio():
    results = {"prompt_lens": [256], "modes": {
        "across_nodes": {"transfers": {"256": _rows(30, 10, 20)}, "served": {"requests": 4, "output_tok_per_s": 9.0}},
        "one_node": {"transfers": {"256": _rows(5, 4, 6)}, "served": {"requests": 4, "output_tok_per_s": 10.0}},
    }}
    table = kv_across_nodes._summary(results).splitlines()
    assert table[2] == "| 256 | 2.0 | 20.0 | 100 | 5.0 | 400 |"
    assert table[-1] == ("Served output tok/s, 4 concurrent requests: across nodes 9.0, one node 10.0 "
                         "(ratio 0.90)")
