"""In the deterministic mode a position's logits are bitwise the same whether the position was
decoded (alone or beside other sequences) or prefilled (in one chunk or several): the model
forward itself, below the engine, so nothing in scheduling or sampling can mask a difference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from baton_serve.kernels import cpu_ops
from baton_serve.workers.model.attention import AttentionMetadata
from baton_serve.workers.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the mode needs the native CPU kernels")

BS = 16
I32 = torch.int32


@pytest.fixture(scope="module", params=["d16", "d64"])
def folder(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "d16":
        return tiny_model_dir
    from tests.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("logits-d64"), seed=4, hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, num_layers=2)


def _caches(model, blocks: int):
    cfg = model.cfg
    shape = (blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)) for _ in model.layers]


def _empty() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((0, 1), dtype=I32), torch.zeros(0, dtype=I32)


def _prefill(model, caches, tables: torch.Tensor, chunks: list[tuple[list[int], int]]) -> torch.Tensor:
    """One forward over prefill chunks (tokens, first position) of sequences ``tables[i]``; the
    logits of each chunk's last token."""
    ids = torch.tensor([t for toks, _ in chunks for t in toks])
    pos = torch.cat([torch.arange(p, p + len(toks)) for toks, p in chunks])
    slots = torch.cat([tables[i].long().repeat_interleave(BS)[p:p + len(toks)] * BS + torch.arange(p, p + len(toks)) % BS
                       for i, (toks, p) in enumerate(chunks)])
    lens = torch.tensor([p + len(toks) for toks, p in chunks], dtype=I32)
    qlen = torch.tensor([len(toks) for toks, _ in chunks], dtype=I32)
    dt, dl = _empty()
    meta = AttentionMetadata(slots, 0, dt, dl, 0, tables, lens, torch.cat([torch.zeros(1, dtype=I32), qlen.cumsum(0).to(I32)]))
    last = (qlen.cumsum(0) - 1).long()
    return model.compute_logits(model(ids, pos, caches, meta, last))


def _decode(model, caches, tables: torch.Tensor, tokens: list[int], positions: list[int]) -> torch.Tensor:
    pos = torch.tensor(positions)
    slots = tables.long().gather(1, (pos // BS).view(-1, 1)).view(-1) * BS + pos % BS
    lens = (pos + 1).to(I32)
    pt, pl = _empty()
    meta = AttentionMetadata(slots, len(tokens), tables, lens, int(lens.max()), pt, pl, torch.zeros(1, dtype=I32))
    return model.compute_logits(model(torch.tensor(tokens), pos, caches, meta))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoded_equals_prefilled_bitwise(folder: Path, dtype: torch.dtype) -> None:
    model = load_model(folder, dtype=dtype, deterministic=True)
    rng = random.Random(0)
    seq = [rng.randrange(3, 300) for _ in range(41)]
    others = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 29, 40)]
    per = 4  # blocks per sequence
    # (a) the whole sequence in one prefill: the last position's logits
    one = _prefill(model, _caches(model, per), torch.arange(per, dtype=I32)[None], [(seq, 0)])[0]
    # (b) two prefill chunks, then the last token decoded alone
    caches = _caches(model, per)
    table = torch.arange(per, dtype=I32)[None]
    _prefill(model, caches, table, [(seq[:17], 0)])
    _prefill(model, caches, table, [(seq[17:-1], 17)])
    alone = _decode(model, caches, table, [seq[-1]], [len(seq) - 1])[0]
    # (c) the last token decoded in the middle of a batch of other sequences' decodes
    caches = _caches(model, per * 4)
    tables = torch.arange(per * 4, dtype=I32).view(4, per)
    order = [others[0], others[1], seq, others[2]]
    _prefill(model, caches, tables, [(s[:-1], 0) for s in order])
    batch = _decode(model, caches, tables, [s[-1] for s in order], [len(s) - 1 for s in order])[2]
    assert torch.equal(one, alone)
    assert torch.equal(one, batch)
