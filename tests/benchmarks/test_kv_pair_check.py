"""``benchmarks/kv_pair_check.py`` on the CPU (gloo and a memfd, tiny shapes): both mechanisms move
the blocks bit for bit, a corrupted block is caught, and ``--expect-fail`` inverts a stage's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import kv_pair_check

TINY = ["--layers", "2", "--heads", "2", "--head-dim", "8", "--block-size", "4", "--blocks", "16", "--ship", "5",
        "--dtype", "bfloat16", "--iters", "2", "--timeout-s", "60"]


def test_both_mechanisms_move_the_blocks_intact(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    assert kv_pair_check.main([*TINY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["all_ok"] and all(s["passed"] for s in result["stages"].values())
    receiver = result["ranks"][1]["stages"]
    block_bytes = 2 * 2 * 4 * 2 * 8 * 2  # layers x K/V x block_size x heads x head_dim x bf16
    for mode in ("whole", "per_layer"):
        assert receiver["pair_group"][mode]["ok"] and receiver["pair_group"][mode]["bytes"] == 5 * block_bytes
    assert receiver["shared"]["ok"] and receiver["shared"]["mechanism"] == "memfd"
    assert receiver["shared"]["bytes"] == 5 * block_bytes


def test_a_stage_expected_to_fail_that_passes_fails_the_check(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    assert kv_pair_check.main([*TINY, "--expect-fail", "pair_group", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["stages"]["pair_group"] == {"passed": True, "expected_to_fail": True}


def test_a_corrupted_or_unwritten_block_is_caught() -> None:
    spec = {"layers": 2, "heads": 2, "head_dim": 8, "block_size": 4, "blocks": 16, "ship": 5, "dtype": "bfloat16"}
    source = kv_pair_check._caches(torch, spec, "cpu", seed=1)
    src, dst = kv_pair_check._ids(spec, 0), kv_pair_check._ids(spec, 1)

    def received() -> list:
        caches = kv_pair_check._caches(torch, spec, "cpu", seed=None)
        for (k, v), (sk, sv) in zip(caches, source):
            k[dst], v[dst] = sk[src], sv[src]
        return caches

    assert kv_pair_check._received_intact(torch, spec, received(), dst)
    flipped = received()
    flipped[1][0][dst[2], 3, 1, 5] += 1  # one value of one shipped block
    assert not kv_pair_check._received_intact(torch, spec, flipped, dst)
    stray = received()
    stray[0][1][[b for b in range(16) if b not in dst][0]] = 0  # a block nobody shipped was written
    assert not kv_pair_check._received_intact(torch, spec, stray, dst)
