"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

The forward takes flattened tokens of many sequences at once; attention metadata says which
K/V slots each token writes and what it attends to.
"""

from __future__ import annotations

import torch
from baton_serve.kernels import backend, invariant_linear, packed_linear
from baton_serve.kernels.kernel_choice import KernelPlan, prepare_weight
from baton_serve.kernels.logits import upcast_with_candidates
from baton_serve.workers.model.attention import AttentionMetadata, PagedAttention
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    default_weight_loader,
)
from baton_serve.workers.model.quantization import FullPrecision
from baton_serve.workers.parallel.sizes import check_tensor_parallel_size, kv_heads_of_rank
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary: RotaryEmbedding,
                 dtype: torch.dtype, deterministic: bool = False) -> None:
        super().__init__()
        check_tensor_parallel_size(cfg, ctx.tp_size)
        self.num_heads = cfg.num_attention_heads // ctx.tp_size
        # More ranks than KV heads: each rank holds the one KV head its query heads read (replicated)
        first_kv, self.num_kv_heads = kv_heads_of_rank(cfg.num_key_value_heads, ctx.tp_size, ctx.tp_rank)
        self.head_dim = hd = cfg.head_dim
        q_size = cfg.num_attention_heads * hd
        kv_size = cfg.num_key_value_heads * hd
        kv_rows = (first_kv * hd, self.num_kv_heads * hd)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                             cfg.attention_bias, ctx, dtype, cfg.quantization,
                                             shard_rows=[(ctx.tp_rank * self.num_heads * hd, self.num_heads * hd),
                                                         kv_rows, kv_rows])
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, False, ctx, dtype, cfg.quantization)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.sliding_window,
                                   deterministic)
        self.split = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's K/V goes to the cache; with ``keep`` only those rows' outputs are projected."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, meta).view(t, -1)
        return self.o_proj(out if keep is None else out[keep])


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], False, ctx, dtype,
                                                 cfg.quantization)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, ctx, dtype, cfg.quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary: RotaryEmbedding,
                 dtype: torch.dtype, deterministic: bool = False) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, ctx, rotary, dtype, deterministic)
        self.mlp = LlamaMLP(cfg, ctx, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``keep`` (row indices) the outputs are those rows only: past attention nothing else
        depends on the other tokens."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, keep)
        if keep is not None:
            residual = residual[keep]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` the fp32 logits.

    ``deterministic``: every row's numbers depend on that row alone, not on the batch, its place in
    it, the prompt's chunking or whether the KV came from a decode or a prefill (the engine's
    deterministic mode; batch-invariant linears and one attention kernel for both phases).
    """

    # checkpoint name fragment -> (our parameter name fragment, shard id)
    stacked_params = (
        (".q_proj.", ".qkv_proj.", 0),
        (".k_proj.", ".qkv_proj.", 1),
        (".v_proj.", ".qkv_proj.", 2),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 ctx: ParallelContext | None = None, max_positions: int | None = None,
                 deterministic: bool = False) -> None:
        super().__init__()
        ctx = ctx or ParallelContext()
        self.cfg = cfg
        self.dtype = dtype
        self.deterministic = deterministic
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                 cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ctx, rotary, dtype, deterministic)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # The output projection: the embedding itself when tied, unless the checkpoint quantised
        # it (a separate copy: the embedding lookup keeps full precision).
        head_quant = cfg.quantization.for_lm_head() if cfg.quantization else None
        self.lm_head: ColumnParallelLinear | None = None
        if not cfg.tie_word_embeddings or head_quant is not None:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, [cfg.vocab_size], False, ParallelContext(),
                                                dtype, head_quant)
        self._lm_head_packed: torch.Tensor | invariant_linear.InvariantWeight | None = None
        self.kernel_plan: KernelPlan | None = None  # what pack_weights ran (kernels.kernel_choice)

    def kernel_shapes(self) -> tuple[dict[tuple[int, int], bool], tuple[int, int, int] | None]:
        """What ``kernels.kernel_choice`` measures for this model: each full-precision linear weight
        shape (-> True where only decode-sized batches reach it: the LM head) and the attention
        geometry ``(hq, hkv, d)`` (None for a windowed model, whose kernel stays the default)."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        shapes: dict[tuple[int, int], bool] = {}
        for module in self.modules():
            weight = getattr(module, "weight", None)
            full = isinstance(getattr(module, "method", None), FullPrecision) or (
                module is self.embed_tokens and self.lm_head is None)
            if full and weight is not None:
                key = (int(weight.shape[0]), int(weight.shape[1]))
                shapes[key] = shapes.get(key, True) and module is head
        attn = self.layers[0].self_attn if len(self.layers) else None
        geometry = None
        if attn is not None and self.cfg.sliding_window is None:
            geometry = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        return shapes, geometry

    def pack_weights(self, plan: KernelPlan | None = None) -> None:
        """Pack every matmul weight for the CPU (a no-op elsewhere) in the layouts ``plan`` measured,
        and give the attention layers its prefill kernel; call once the weights are loaded."""
        invariant = self.deterministic
        self.kernel_plan = plan
        for module in self.modules():
            if module is not self and hasattr(module, "pack_weights"):
                # the output projection keeps its plain weight: compute_logits reads rows of it
                module.pack_weights(release_plain=module is not self.lm_head, invariant=invariant, plan=plan)
            if isinstance(module, PagedAttention) and plan is not None:
                module.prefill_kernel = plan.prefill_attention_impl()
        if self.lm_head is None:
            weight = self.embed_tokens.weight
            self._lm_head_packed = prepare_weight(weight, None if plan is None else plan.linear_kernel(weight),
                                                  invariant)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self._lm_head_packed, invariant_linear.InvariantWeight):
            return invariant_linear.linear(hidden, self._lm_head_packed)
        if self.lm_head is None:
            return packed_linear.linear(hidden, self.embed_tokens.weight, self._lm_head_packed)
        return self.lm_head(hidden)

    def _weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows of the output projection's weight."""
        if self.lm_head is None:
            return self.embed_tokens.weight[index].float()
        return self.lm_head.method.rows(self.lm_head, index)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states, of every token or (``output_rows``) of those rows only.

        Only the rows that are sampled need the last layer past its attention: in a prefill chunk
        that skips the last layer's o_proj and MLP for all but one token per prompt (about 3% of a
        30-layer model's prefill FLOPs), as llama.cpp does for its unused outputs.
        """
        x = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(positions, x, residual, cache, meta, output_rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``.

        In bf16/fp16 the matmul's output is rounded to 8 (or 11) mantissa bits and near-ties flip
        greedy choices: the tokens within two output ulps of each row's max (``kernels.logits``)
        are recomputed in fp32, so the argmax (and the head of the distribution that sampling
        draws from) is exact for the given hidden state.
        """
        logits = self._project(hidden)
        if hidden.dtype == torch.float32:
            return logits
        logits, rows, cols = upcast_with_candidates(logits, margin_ulps=2.0)
        exact = (hidden[rows].float() * self._weight_rows(cols)).sum(-1)
        logits[rows, cols] = exact
        return logits

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id), or None to skip it."""
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        for ckpt, ours, shard in self.stacked_params:
            if ckpt in name:
                return name.replace(ckpt, ours), shard
        return name, None
