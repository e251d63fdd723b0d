"""msgpack codecs for what crosses actor boundaries: token-delta batches and sampling params.

One message per engine step carries every request's new tokens, never one per token.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import msgpack
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.sampling.params import SamplingParams

_DELTA_FIELDS = [f.name for f in fields(TokenDelta)]


def encode_deltas(deltas: list[TokenDelta]) -> bytes:
    """Pack a batch of deltas as rows of field values (compact, schema by position)."""
    rows = []
    for d in deltas:
        row = [getattr(d, name) for name in _DELTA_FIELDS]
        rows.append(row)
    return msgpack.packb(rows, use_bin_type=True)


def decode_deltas(data: bytes) -> list[TokenDelta]:
    rows = msgpack.unpackb(data, raw=False, strict_map_key=False)
    out = []
    for row in rows:
        d = TokenDelta(**dict(zip(_DELTA_FIELDS, row)))
        if d.top_logprobs is not None:
            d.top_logprobs = [[(int(t), float(v)) for t, v in step] for step in d.top_logprobs]
        out.append(d)
    return out


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def params_from_dict(raw: dict[str, Any]) -> SamplingParams:
    """Rebuild (and so re-validate) sampling params received from another process."""
    raw = dict(raw)
    if raw.get("logit_bias"):
        raw["logit_bias"] = {int(k): float(v) for k, v in raw["logit_bias"].items()}
    return SamplingParams(**raw)
