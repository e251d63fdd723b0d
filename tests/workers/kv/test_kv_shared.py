"""Same-machine KV sharing: another process maps an exported cache and copies blocks out of it."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.shared import KVExport, allocate_shared, export_alive, map_export
from baton_serve.workers.kv.transfer import KVTransferEngine, KVTransferRejected

ROOT = Path(__file__).resolve().parents[3]
LAYERS, SHAPE = 3, (12, 8, 2, 16)  # [blocks, block_size, kv_heads, head_dim]

# The exporting process: fills its cache from a seed, prints how to map it, waits for a line.
_EXPORTER = textwrap.dedent(f"""
    import base64, json, sys, torch
    sys.path.append({str(ROOT)!r})
    from baton_serve.workers.kv.shared import allocate_shared
    caches, export = allocate_shared({LAYERS}, {SHAPE}, torch.bfloat16, sys.argv[1])
    g = torch.Generator().manual_seed(7)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g)); v.copy_(torch.randn(v.shape, generator=g))
    if sys.argv[1] == "cuda":
        torch.cuda.synchronize()
    print(json.dumps(export.to_dict(), default=lambda b: {{"b64": base64.b64encode(b).decode()}}), flush=True)
    sys.stdin.readline()
""")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA IPC)")


def _read_export(line: str) -> KVExport:
    """The exporter's JSON, with the CUDA IPC handle's bytes back from base64."""
    def unpack(obj: dict) -> object:
        return base64.b64decode(obj["b64"]) if set(obj) == {"b64"} else obj

    return KVExport.from_dict(json.loads(line, object_hook=unpack))


def _expected() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(SHAPE, generator=g).bfloat16(), torch.randn(SHAPE, generator=g).bfloat16())
            for _ in range(LAYERS)]


def _local(blocks: int = 10, device: str = "cpu") -> tuple[list[tuple[torch.Tensor, torch.Tensor]], KVTransferEngine]:
    caches = [(torch.zeros((blocks,) + SHAPE[1:], dtype=torch.bfloat16, device=device),
               torch.zeros((blocks,) + SHAPE[1:], dtype=torch.bfloat16, device=device)) for _ in range(LAYERS)]
    return caches, KVTransferEngine(caches, SHAPE[1], device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_another_process_cache_is_mapped_and_copied_bit_identical(device: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", _EXPORTER, device], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        export = _read_export(child.stdout.readline())
        assert export.pid == child.pid and export_alive(export)
        assert (export.cuda is not None) == (device == "cuda")
        source = map_export(export)
        caches, engine = _local(device=device)
        src, dst = [11, 0, 5], [2, 9, 4]
        nbytes = engine.copy_blocks_from(source, src, dst)
        expected = _expected()
        for (k, v), (ek, ev) in zip(caches, expected):
            k, v = k.cpu(), v.cpu()
            for s, d in zip(src, dst):
                assert torch.equal(k[d], ek[s]) and torch.equal(v[d], ev[s])
            untouched = [b for b in range(10) if b not in dst]
            assert not k[untouched].any() and not v[untouched].any()
        assert nbytes == 2 * LAYERS * len(src) * ek[0].nbytes == engine.stats.bytes
    finally:
        child.communicate("exit\n", timeout=30)
    assert not export_alive(export)  # the exporter is gone: no new mapping
    with pytest.raises(KVTransferError, match="cannot open"):
        map_export(export)
    if device == "cpu":  # a memfd mapping held stays readable (no SIGBUS)
        caches, engine = _local()
        engine.copy_blocks_from(source, [3], [0])
        assert torch.equal(caches[1][1][0], _expected()[1][1][3])


@pytest.mark.gpu
@GPU
def test_a_gpu_cache_this_process_cannot_see_is_refused() -> None:
    """A decode worker on another GPU (Ray gives each its own ``CUDA_VISIBLE_DEVICES``) is told so,
    and the connector falls back to the pair group."""
    _, export = allocate_shared(LAYERS, SHAPE, torch.bfloat16, "cuda")
    assert export.cuda["uuid"] and export.cuda["handle"]
    other = dataclasses.replace(export, cuda={**export.cuda, "uuid": "GPU-00000000-not-here"})
    with pytest.raises(KVTransferError, match="not visible"):
        map_export(other)


def test_a_foreign_or_stale_export_is_refused() -> None:
    _, export = allocate_shared(LAYERS, SHAPE, torch.float32)
    assert map_export(export)[0][0].shape == SHAPE  # this process can map its own
    with pytest.raises(KVTransferError, match="another machine"):
        map_export(dataclasses.replace(export, machine="other-boot/1"))
    with pytest.raises(KVTransferError, match="not the exported KV cache"):  # a reused pid/fd
        map_export(dataclasses.replace(export, token="0" * 32))
    with pytest.raises(KVTransferError, match="not the exported KV cache"):
        map_export(dataclasses.replace(export, shape=(SHAPE[0] * 2,) + SHAPE[1:]))
    assert not export_alive(dataclasses.replace(export, token="0" * 32))


def test_copy_rejects_a_mismatched_source_before_writing() -> None:
    caches, engine = _local()
    good, _ = allocate_shared(LAYERS, SHAPE, torch.bfloat16)
    wrong_heads, _ = allocate_shared(LAYERS, SHAPE[:2] + (1, 32), torch.bfloat16)
    wrong_dtype, _ = allocate_shared(LAYERS, SHAPE, torch.float16)
    for source, src, dst in [(wrong_heads, [0], [0]), (wrong_dtype, [0], [0]), (good[:2], [0], [0]),
                             (good, [12], [0]), (good, [0, 1], [0]), (good, [0], [10]), (good, [0, 1], [3, 3])]:
        for k, _ in good:
            k.fill_(1)
        with pytest.raises(KVTransferRejected):
            engine.copy_blocks_from(source, src, dst)
    assert not any(k.any() or v.any() for k, v in caches)
    assert engine.stats.failures == 7 and engine.stats.bytes == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_an_engine_with_a_shared_cache_generates_the_same(tiny_model_dir, device: str) -> None:
    kw = dict(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=32, device=device)
    shared, plain = LLM(kv_cache_shared=True, **kw), LLM(**kw)
    assert shared.engine.runner.kv_export is not None and plain.engine.runner.kv_export is None
    prompts = [shared.tokenizer.encode(t) for t in ("Hello world! How are you today?", "def f(x):")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in shared.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    if device == "cuda":  # CUDA opens an IPC handle only in another process (the test above)
        return
    # what the engine wrote is what a peer mapping its export reads
    peer = map_export(shared.engine.runner.kv_export)
    assert all(torch.equal(k, pk) and torch.equal(v, pv)
               for (k, v), (pk, pv) in zip(shared.engine.runner.kv_caches, peer))
    assert any(k.any() for k, _ in peer)
