"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from baton_serve.kernels import capabilities, cpu_ops, deterministic
from baton_serve.kernels.auto_dtype import resolve_dtype
from baton_serve.kernels.device import resolve_device
from baton_serve.kernels.kernel_choice import Workload
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.checkpoint.default_model import resolve_model
from baton_serve.workers.engine.config import EngineConfig, engine_config
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.gpu_memory import plan_gpu_kv_cache
from baton_serve.workers.engine.model_runner import kv_cache_block_bytes
from baton_serve.workers.engine.output_processor import OutputProcessor
from baton_serve.workers.engine.outputs import RequestOutput
from baton_serve.workers.errors import InvalidRequestError, ModelLoadError
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.model.layers import ParallelContext
from baton_serve.workers.model.loader import load_model, parse_dtype, safetensors_files
from baton_serve.workers.node import node_address
from baton_serve.workers.parallel.executor import TPExecutor
from baton_serve.workers.parallel.rank import RankSpec
from baton_serve.workers.parallel.sizes import TensorParallelSizeError, check_tensor_parallel_size
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.text.tokenizer import Tokenizer

Prompt = str | list[int]


def weights_fingerprint(folder: Path) -> str:
    """Cheap identity of a model's weights: config, file names, sizes and safetensors headers."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(file.name.encode())
            h.update(str(file.stat().st_size).encode())
            h.update(f.read(min(header_len, 1 << 24)))
    return h.hexdigest()[:32]


def kernel_workload(config: EngineConfig) -> Workload:
    """The row counts every rank's CPU kernel choice is measured at, from the scheduler's limits."""
    return Workload.for_engine(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)


def build_engine(config: EngineConfig) -> tuple[EngineCore, Tokenizer, Path]:
    """Load model and tokenizer on the configured device, size the KV cache, and return a ready
    engine (whose config has ``dtype`` and ``device`` = "auto" resolved for this machine)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    where = resolve_device(config.device)
    choice = resolve_dtype(config.dtype, where.device.type)
    config = dataclasses.replace(config, dtype=choice.dtype, device=str(where.device))
    capabilities.log_once(f"{cpu_ops.describe()}; device {where.device} ({where.reason}); dtype {choice.dtype} "
                          f"({choice.reason}); {torch.get_num_threads()} threads"
                          f"{'; deterministic (batch-invariant) numerics' if config.deterministic else ''}")
    folder = resolve_model(config.model)
    tokenizer = Tokenizer.from_folder(folder)
    dtype = parse_dtype(config.dtype)
    if config.deterministic:
        try:
            deterministic.check(dtype, where.device, ModelConfig.from_folder(folder).head_dim)
        except deterministic.DeterministicModeError as exc:
            raise ModelLoadError(str(exc)) from None
    tensor_parallel = start_tensor_parallel(config, folder, where.device)
    try:
        engine = _build_core(config, folder, tokenizer, dtype, where, tensor_parallel)
    except BaseException:
        if tensor_parallel is not None:
            tensor_parallel.close()
        raise
    return engine, tokenizer, folder


def start_tensor_parallel(config: EngineConfig, folder: Path, device: torch.device,
                          host: str | None = None) -> TPExecutor | None:
    """Ranks 1..N-1 of this replica, started and joined (None without tensor parallelism); a size
    the model cannot be split into raises ``ModelLoadError`` naming the sizes that work."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return None
    try:
        check_tensor_parallel_size(ModelConfig.from_folder(folder), tp)
    except TensorParallelSizeError as exc:
        raise ModelLoadError(f"{folder.name}: {exc}") from None
    workload = kernel_workload(config)
    base = RankSpec({}, 0, str(folder), config.dtype, str(device), config.max_model_len, config.deterministic,
                    config.num_threads, workload.decode_rows, workload.prefill_rows)
    ray_backend = config.distributed_executor_backend == "ray"
    if host is None:
        host = node_address() if ray_backend else "127.0.0.1"
    # a Ray rank asks for what its placement-group bundle holds: its threads' CPUs, and its own GPU
    options = ({"num_cpus": float(config.num_threads or 1), "num_gpus": 1.0 if device.type == "cuda" else 0.0}
               if ray_backend else {})
    return TPExecutor(tp, base, backend=config.distributed_executor_backend, host=host, **options)


def _build_core(config: EngineConfig, folder: Path, tokenizer: Tokenizer, dtype: torch.dtype, where: Any,
                tensor_parallel: TPExecutor | None) -> EngineCore:
    ctx = None if tensor_parallel is None else ParallelContext(config.tensor_parallel_size, 0, tensor_parallel.group)
    model = load_model(folder, dtype=dtype, ctx=ctx, max_positions=config.max_model_len, device=where.device,
                       deterministic=config.deterministic,
                       workload=kernel_workload(config))
    eos = list(model.cfg.eos_token_ids) or list(tokenizer.eos_token_ids)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif where.is_cuda:
        max_len = config.max_model_len or model.cfg.max_position_embeddings
        num_blocks = plan_gpu_kv_cache(model, config, where.device, eos, max_len).num_blocks
        if num_blocks < 1:
            raise ModelLoadError(f"no room for a KV block on {where.device} at gpu_memory_utilization = "
                                 f"{config.gpu_memory_utilization}: raise it, or lower max_num_batched_tokens")
    else:
        num_blocks = int(config.kv_cache_memory_gib * (1 << 30)) // kv_cache_block_bytes(
            model, config.block_size, dtype)
    namespace = CacheNamespace(
        model=folder.name, weights_hash=weights_fingerprint(folder),
        tokenizer_hash=tokenizer.fingerprint(), chat_template_hash=tokenizer.chat_template_fingerprint(),
        kv_dtype=config.dtype, block_size=config.block_size,
        # KV computed in the deterministic mode is bitwise what a re-prefill gives: never mix it with other KV
        kv_layout="deterministic" if config.deterministic else "")
    return EngineCore(model, config, num_blocks, eos_token_ids=eos, namespace=namespace, device=where.device,
                      tokenizer_json=tokenizer.backend.to_str(), tensor_parallel=tensor_parallel)


class LLM:
    """Offline batch generation on one engine, in the style of ``vllm.LLM``."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **kwargs: Any) -> None:
        if "num_threads" not in kwargs and "BATON_NUM_THREADS" in os.environ:
            kwargs["num_threads"] = int(os.environ["BATON_NUM_THREADS"])
        self.engine, self.tokenizer, self.model_path = build_engine(
            engine_config(model=model, dtype=dtype, **kwargs))
        self.config = self.engine.config  # dtype resolved
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # a tensor-parallel engine's other ranks stop with this object, or at exit
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks now (they stop on their own at exit)."""
        self._finalizer()

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("a prompt must be a string or a list of token ids", param="prompt")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion; results in input order. Invalid input raises before any work."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt", param="sampling_params")
        encoded = [self._encode(p) for p in prompts]
        for (_, ids), p in zip(encoded, param_list):
            self.engine.validate(ids, p)
        ids_in_order = []
        for i, ((text, ids), p) in enumerate(zip(encoded, param_list)):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p, priority=priority[i] if priority else 0,
                                    cache_salt=cache_salt)
            self.processor.add_request(rid, text, ids, p)
            ids_in_order.append(rid)
        return self._run(ids_in_order, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, **kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template, then ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)  # type: ignore[arg-type]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(request_ids), desc="requests")
        while self.engine.has_unfinished_requests():
            outputs, matches = self.processor.process(self.engine.step())
            for m in matches:
                self.engine.finish_request(m.request_id, m.index, "stop", m.stop)
            for o in outputs:
                if o.finished:
                    results[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in request_ids]
