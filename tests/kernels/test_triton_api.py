"""The Triton module is a drop-in for the reference: same names, same signatures, reachable
through ``kernels.backend`` when forced."""

from __future__ import annotations

import inspect

import pytest
import torch
from baton_serve.kernels import backend, reference

PUBLIC = sorted(
    name for name, fn in vars(reference).items()
    if inspect.isfunction(fn) and fn.__module__ == reference.__name__ and not name.startswith("_")
)


def test_every_backend_op_is_public() -> None:
    assert set(backend._OPS) <= set(PUBLIC)


@pytest.mark.parametrize("op", PUBLIC)
def test_same_signature_as_reference(triton_ops, op: str) -> None:
    ours = inspect.signature(getattr(triton_ops, op))
    theirs = inspect.signature(getattr(reference, op))
    assert ours == theirs, f"{op}: {ours} != {theirs}"


def test_backend_dispatches_to_triton_when_forced(triton_ops, kt, device, monkeypatch) -> None:
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "triton")
    assert backend.select("rms_norm", torch.device("cpu")) is triton_ops.rms_norm
    b = kt.make_paged_batch(4, [20, 5], [1, 1], 4, 2, 16, 8, torch.float32)
    want = kt.naive_paged_attention(b, None)
    b = b.to(device)
    # Positional max_seq_len hint, exactly as workers/model/attention.py passes it.
    got = backend.paged_decode_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                         b.scale, None, 20)
    kt.assert_close(got, want, torch.float32, "backend decode")
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    assert backend.select("rms_norm", torch.device("cpu")) is reference.rms_norm


def test_cpu_tensors_need_the_interpreter(triton_ops) -> None:
    """A compiled (non-interpreted) kernel given a host tensor fails with a clear message."""
    from baton_serve.kernels.triton_common import check_device, is_interpreted
    from baton_serve.kernels.triton_norm import _rms_norm_kernel

    if not torch.cuda.is_available():
        assert is_interpreted(_rms_norm_kernel), "conftest must enable TRITON_INTERPRET before import"
    compiled_stand_in = object()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        check_device(compiled_stand_in, torch.zeros(1))
