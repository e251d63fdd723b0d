"""The prefix-cache hash chain: H_i = Hash(H_{i-1}, token_ids of block i), H_{-1} = root.

The root binds everything that makes KV reusable (model, weights, adapter,
tokenizer, chat template, KV dtype/layout, block size) plus an optional tenant
salt, so a hit is only possible for the same namespace, the same salt and the
same tokens from position 0 on. Hashes use blake2b (not Python's ``hash()``), so
they are identical across processes and hosts and a router can compare them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

HASH_BYTES = 16
# Bump when the serialisation below changes, so old and new hashes never collide.
_SCHEME = b"baton-prefix-v1\x00"


@dataclass(frozen=True)
class CacheNamespace:
    """Everything besides the tokens that determines a block's KV contents.

    ``kv_layout`` is an addition to the original design: a free-form fingerprint of
    attention/positional config, memory layout and tensor-parallel sharding.
    """

    model: str
    weights_hash: str
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    kv_dtype: str = "bfloat16"
    block_size: int = 16
    adapter: str = ""
    kv_layout: str = ""

    def root_hash(self, salt: str | None = None) -> bytes:
        """Chain root for this namespace; distinct salts give distinct roots.

        ``None`` is the shared (unsalted) namespace and differs from every string
        salt, including ``""``.
        """
        fields = asdict(self)
        fields["__salt__"] = salt
        payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(_SCHEME + payload, digest_size=HASH_BYTES).digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one block given its parent's hash (or the root) and its tokens."""
    # Fixed-width little-endian ints keep the encoding unambiguous and platform-independent.
    data = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def block_hashes(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    prev: list[bytes] | None = None,
    stop: int | None = None,
) -> list[bytes]:
    """Hashes of the FULL blocks of ``token_ids[start:stop]`` (``stop`` defaults to the end).

    ``prev`` holds the hashes of the blocks before ``start`` (the chain continues from
    ``prev[-1]``); when ``prev`` is given and ``start`` is 0, ``start`` defaults to
    where ``prev`` ends. Returns only the new hashes; neither argument is modified,
    so incremental use is ``memo += block_hashes(root, toks, bs, prev=memo)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = prev or []
    if start == 0 and prev:
        start = len(prev) * block_size
    if start != len(prev) * block_size:
        raise ValueError(f"start={start} does not continue {len(prev)} previous blocks of {block_size}")
    parent = prev[-1] if prev else root
    out: list[bytes] = []
    end = len(token_ids) if stop is None else min(stop, len(token_ids))
    for begin in range(start, end - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[begin : begin + block_size])
        out.append(parent)
    return out
