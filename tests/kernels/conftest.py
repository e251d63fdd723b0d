"""Shared fixtures for the kernel tests: paged batches, float64 ground truth, poisoned outputs.

Without CUDA the Triton kernels run under the interpreter on CPU tensors; it must be switched on
before any ``@triton.jit`` decorator runs, i.e. before ``kernels.triton_*`` is imported, which is
why the environment is set here at import time. Helpers are handed to tests through fixtures so the test
modules need no imports from this file.
"""

from __future__ import annotations

import math
import os
import platform
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # CPU-only machine: the Triton tests feed CPU tensors to the interpreter. With a GPU the same
    # tests run the compiled kernels on CUDA tensors instead (see the ``device`` fixture), and
    # other test directories keep compiled Triton.
    os.environ["TRITON_INTERPRET"] = "1"
# The interpreter is single-threaded Python; extra torch threads only fight other processes.
torch.set_num_threads(1)

import pytest  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class PagedBatch:
    """Inputs of one paged attention call; decode batches have one query per sequence."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, W] int32, padded with invalid ids past each sequence
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    scale: float

    def to(self, device: torch.device) -> PagedBatch:
        return PagedBatch(*(t.to(device) for t in (self.query, self.k_cache, self.v_cache,
                                                   self.block_tables, self.seq_lens,
                                                   self.query_start_loc)), self.scale)


def make_paged_batch(
    seed: int,
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> PagedBatch:
    """Random paged batch whose every slot outside the sequences' contexts holds NaN.

    Blocks are assigned in random order, a few spare blocks belong to nobody, and block-table
    entries past a sequence's length are -1 or out of range, so a kernel that reads anything it
    should ignore produces NaN or crashes.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    width = max(per_seq, default=0) + 2
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        ids = order[used : used + nb]
        used += nb
        tables[s, :nb] = ids.int()
        tables[s, nb:] = -1 if s % 2 else num_blocks + 7
        pos = torch.arange(n)
        slots = ids[pos // block_size] * block_size + pos % block_size
        k_flat[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    total = int(sum(q_lens))
    query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    return PagedBatch(query, k_cache, v_cache, tables, torch.tensor(list(seq_lens), dtype=torch.int32),
                      starts, head_dim**-0.5)


@dataclass(frozen=True)
class AttnCase:
    """One randomised attention configuration; ``q_lens`` are all 1 for decode."""

    seed: int
    block_size: int
    ratio: int  # Hq // Hkv
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    sliding_window: int | None

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        win = f"-w{self.sliding_window}" if self.sliding_window is not None else ""
        return f"bs{self.block_size}-g{self.ratio}-d{self.head_dim}-{dt}{win}-s{self.seed}"

    def batch(self) -> PagedBatch:
        return make_paged_batch(self.seed, self.seq_lens, self.q_lens, self.ratio * self.num_kv_heads,
                                self.num_kv_heads, self.head_dim, self.block_size, self.dtype)


def _attention_cases(decode: bool) -> list[AttnCase]:
    """Every block size x GQA ratio x dtype (plus fp16), with seeded random lengths that always
    include a one-token sequence, a context ending exactly on a block boundary, odd lengths and
    a context spanning several 64-key tiles; every other case uses a sliding window."""
    cases = []
    grid = [(bs, g, dt) for bs in (8, 16, 32) for g in (1, 3, 8) for dt in (torch.float32, torch.bfloat16)]
    grid += [(16, 4, torch.float16), (8, 2, torch.float16)]
    for i, (bs, g, dt) in enumerate(grid):
        seed = 1000 * int(decode) + i
        rng = random.Random(seed)
        if decode:
            seq_lens = [1, bs * rng.randint(1, 5), rng.randrange(3, 120, 2), rng.randint(129, 230)]
            q_lens = [1] * len(seq_lens)
        else:  # (context before the chunk, chunk length)
            parts = [(0, rng.randrange(1, 40, 2)), (bs * rng.randint(1, 4), 1),
                     (bs * rng.randint(1, 3), rng.randrange(5, 30, 2)),
                     (rng.randint(0, 80), rng.randint(65, 90))]
            seq_lens = [c + q for c, q in parts]
            q_lens = [q for _, q in parts]
        order = list(range(len(seq_lens)))
        rng.shuffle(order)
        window = None if i % 2 == 0 else rng.choice([1, rng.randint(2, 40), rng.randint(41, 150)])
        cases.append(AttnCase(seed, bs, g, 1 + i % 2, (16, 32, 40)[i % 3], dt,
                              tuple(seq_lens[j] for j in order), tuple(q_lens[j] for j in order), window))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Share one case list between the reference and the Triton tests without imports."""
    for name, decode in (("decode_case", True), ("prefill_case", False)):
        if name in metafunc.fixturenames:
            cases = _attention_cases(decode)
            metafunc.parametrize(name, cases, ids=[c.id for c in cases])


def naive_paged_attention(batch: PagedBatch, sliding_window: int | None) -> torch.Tensor:
    """float64 ground truth: explicit loops over sequences, heads and queries.

    Query ``i`` of a sequence with ``L`` positions and a chunk of ``q_len`` sits at position
    ``L - q_len + i`` and sees keys ``p <= pos`` with ``pos - p < sliding_window``.
    """
    batch = batch.to(torch.device("cpu"))
    q_all, k_cache, v_cache = batch.query, batch.k_cache, batch.v_cache
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q_all.shape[1]
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q_start, q_len = starts[s], starts[s + 1] - starts[s]
        pos = torch.arange(seq_len)
        slots = batch.block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        for h in range(num_heads):
            for i in range(q_len):
                q_pos = seq_len - q_len + i
                seen = pos <= q_pos
                if sliding_window is not None:
                    seen &= q_pos - pos < sliding_window
                scores = k[seen, h] @ q_all[q_start + i, h].double() * batch.scale
                out[q_start + i, h] = torch.softmax(scores, 0) @ v[seen, h]
    return out


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def naive_rotary(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """float64 RoPE with explicit (first, second) index pairs per layout."""
    half = cos_sin_cache.shape[1] // 2
    table = cos_sin_cache.double()[positions.long()]  # [T, rot_dim]
    cos, sin = table[:, None, :half], table[:, None, half:]
    out = x.double().clone()
    first = torch.arange(half) if is_neox else torch.arange(half) * 2
    second = first + half if is_neox else first + 1
    x1, x2 = x.double()[..., first], x.double()[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def naive_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    a, b = x.double()[..., :half], x.double()[..., half:]
    return a / (1 + torch.exp(-a)) * b


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Make ``torch.empty``/``empty_like`` return NaN-filled (float) or sentinel-filled (int)
    tensors, so outputs and scratch buffers a kernel forgets to write cannot pass by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -123456789)

    def poisoned_empty(*args, **kwargs):
        return poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return poison(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """Compare in float64 with the tolerance of ``dtype``; NaN anywhere fails."""
    actual, expected = actual.cpu(), expected.cpu()
    assert not actual.isnan().any(), f"{msg}: NaN in output (unwritten or masked-slot leak)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=ATOL[dtype], rtol=RTOL[dtype],
                               msg=lambda m: f"{msg}: {m}")


@pytest.fixture(scope="session")
def kt() -> SimpleNamespace:
    """The helpers above, for test modules (which should not import conftest directly)."""
    return SimpleNamespace(
        make_paged_batch=make_paged_batch,
        naive_paged_attention=naive_paged_attention,
        naive_rms_norm=naive_rms_norm,
        naive_rotary=naive_rotary,
        naive_silu_and_mul=naive_silu_and_mul,
        poisoned=poisoned_allocations,
        assert_close=assert_close,
        ATOL=ATOL,
        RTOL=RTOL,
    )


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the Triton tests put their tensors: CUDA when present, else the interpreter's CPU."""
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(scope="session")
def triton_ops() -> ModuleType:
    """``kernels.triton_ops``, or a skip when Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # the only reason to skip: the package is absent
        pytest.skip(f"triton cannot be imported ({exc}); Triton kernel tests need it")
    from baton_serve.kernels import triton_ops as ops

    return ops


# --- which build of the native CPU kernels a test runs ----------------------------------------

def _kernel_targets() -> list[str]:
    """Every build the kernel tests run: the machine's own, plus lower ISA levels it can also run,
    so the AVX2 and portable paths stay tested on an AVX-512 machine (and the portable one on an
    AVX2 machine; it is what aarch64 without extensions compiles)."""
    arch = platform.machine()
    if arch in ("x86_64", "AMD64"):
        return ["native", "x86-64-v3", "x86-64"]
    if arch == "aarch64":
        return ["native", "armv8-a"]
    return ["native"]


@pytest.fixture(params=_kernel_targets())
def kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Runs the test against the kernels built for one ``-march`` target; returns (target, ISA the
    build uses). Skips a target this CPU cannot run, or one that compiles to the same ISA as the
    native build (already covered by the ``native`` case)."""
    from baton_serve.kernels import cpu_ops

    target = request.param
    try:
        lib = cpu_ops.build_library(target)
        native = cpu_ops.build_library("native")
    except cpu_ops.UnsupportedTarget as exc:
        pytest.skip(str(exc))
    except cpu_ops.KernelBuildError as exc:
        pytest.skip(f"no native kernels here: {exc}")
    if target != "native" and cpu_ops.isa(lib) == cpu_ops.isa(native):
        pytest.skip(f"-march={target} builds the same ISA as native ({cpu_ops.isa(lib)})")
    monkeypatch.setattr(cpu_ops, "_lib", lib)
    return target, cpu_ops.isa(lib)

