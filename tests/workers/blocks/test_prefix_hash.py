"""The block hash chain: determinism, full blocks only, chaining, namespace isolation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from baton_serve.workers.blocks.prefix_hash import HASH_BYTES, CacheNamespace, block_hashes, hash_block_tokens

NS = CacheNamespace(model="m", weights_hash="w", block_size=4)


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from baton_serve.workers.blocks.prefix_hash import CacheNamespace, block_hashes;"
        "r = CacheNamespace(model='m', weights_hash='w', block_size=4).root_hash('t');"
        "print(block_hashes(r, list(range(9)), 4)[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = block_hashes(NS.root_hash("t"), list(range(9)), 4)[-1]
    assert out.stdout.strip() == expected.hex()
    assert len(expected) == HASH_BYTES


def test_only_full_blocks_are_hashed() -> None:
    root = NS.root_hash()
    assert block_hashes(root, [1, 2, 3], 4) == []
    assert len(block_hashes(root, list(range(8)), 4)) == 2
    assert len(block_hashes(root, list(range(11)), 4)) == 2
    assert len(block_hashes(root, list(range(11)), 4, stop=7)) == 1


def test_incremental_extension_matches_full_computation() -> None:
    root = NS.root_hash()
    toks = list(range(30))
    full = block_hashes(root, toks, 4)
    memo = block_hashes(root, toks[:9], 4)
    memo += block_hashes(root, toks, 4, prev=memo)
    assert memo == full
    assert block_hashes(root, toks, 4, start=8, prev=full[:2]) == full[2:]
    with pytest.raises(ValueError):
        block_hashes(root, toks, 4, start=4, prev=full[:2])
    with pytest.raises(ValueError):
        block_hashes(root, toks, 4, start=4)


def test_chain_binds_every_earlier_token() -> None:
    root = NS.root_hash()
    a = block_hashes(root, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], 4)
    b = block_hashes(root, [9, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], 4)
    assert not set(a) & set(b)  # one changed token in block 0 changes every later hash
    # Same block contents at a different position (different parent) hash differently.
    shifted = block_hashes(root, [2, 2, 2, 2, 3, 3, 3, 3], 4)
    assert shifted[0] != a[1] and shifted[1] != a[2]
    assert hash_block_tokens(root, [2, 2, 2, 2]) == shifted[0]


def test_salts_give_distinct_roots() -> None:
    roots = {NS.root_hash(None), NS.root_hash(""), NS.root_hash("a"), NS.root_hash("b")}
    assert len(roots) == 4
    assert NS.root_hash("a") == CacheNamespace(model="m", weights_hash="w", block_size=4).root_hash("a")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"weights_hash": "w2"},
        {"tokenizer_hash": "tok2"},
        {"chat_template_hash": "tpl2"},
        {"kv_dtype": "fp8"},
        {"block_size": 8},
        {"adapter": "lora-a"},
        {"kv_layout": "tp2"},
    ],
)
def test_every_namespace_field_changes_the_chain(change: dict) -> None:
    other = dataclasses.replace(NS, **change)
    assert other.root_hash() != NS.root_hash()
    toks = list(range(16))
    assert not set(block_hashes(other.root_hash(), toks, 4)) & set(block_hashes(NS.root_hash(), toks, 4))
