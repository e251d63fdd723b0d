"""The whole engine on one device, for ``gpu_check.py``'s engine stage: greedy parity with a plain
``transformers`` forward loop on the same device (fp32, so both sides compute the same numbers),
and offline output tok/s for the default model and for a random-weight Llama of ~1B shape (real
matmul sizes). On a CPU with a tiny model (``--engine-smoke``) the same code stays tested.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

PARITY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "List three prime numbers:")
# ~1.07B parameters with SmolLM2's vocabulary (tied embeddings): the shape of a Llama-3.2-1B-class model.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8}


def hf_greedy(hf_model: Any, prompt: list[int], n: int, device: torch.device | str = "cpu") -> list[int]:
    """``n`` greedy tokens from a plain ``transformers`` forward loop with its own KV cache (no
    generate()): the parity reference, here and in the tests."""
    out: list[int] = []
    with torch.no_grad():
        step = hf_model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = hf_model(input_ids=torch.tensor([[out[-1]]], device=device),
                            past_key_values=step.past_key_values, use_cache=True)
    return out


def greedy_parity(model_dir: Path, device: torch.device, new_tokens: int = 32, **engine: Any) -> dict[str, Any]:
    """Engine vs ``transformers`` on ``device`` in fp32: per prompt, how many leading tokens agree."""
    from baton_serve.workers.llm import LLM
    from baton_serve.workers.sampling.params import SamplingParams
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(model_dir), dtype="float32", device=str(device), **engine)
    prompts = [llm.tokenizer.encode(p) for p in PARITY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    _release(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on both sides, not TF32
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    theirs = [hf_greedy(hf, p, new_tokens, device) for p in prompts]
    del hf
    _release(device)
    agree = [_common_prefix(a, b) for a, b in zip(ours, theirs)]
    return {"prompts": len(prompts), "new_tokens": new_tokens, "agreeing_prefix": agree,
            "identical": sum(a == new_tokens for a in agree), "ok": all(a == new_tokens for a in agree)}


def offline_throughput(model_dir: Path, device: torch.device, dtype: str, num_requests: int, input_len: int,
                       output_len: int, seed: int = 0, **engine: Any) -> dict[str, Any]:
    """Output tok/s of ``LLM.generate`` on random-token prompts, all submitted at once (after one warm-up)."""
    from baton_serve.workers.llm import LLM
    from baton_serve.workers.sampling.params import SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, device=str(device), **engine)
    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.vocab_size
    prompts = [torch.randint(0, vocab, (input_len,), generator=g).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"model": model_dir.name, "dtype": llm.config.dtype, "device": llm.config.device,
              "num_kv_blocks": llm.engine.block_manager.num_blocks, "requests": num_requests,
              "input_len": input_len, "output_len": output_len, "output_tokens": tokens,
              "seconds": elapsed, "output_tok_per_s": tokens / elapsed}
    del llm
    _release(device)
    return result


def write_random_llama(folder: Path, tokenizer_from: Path, shape: dict[str, int], dtype: torch.dtype,
                       seed: int = 0) -> Path:
    """A Llama folder of ``shape`` with random weights and ``tokenizer_from``'s tokenizer (kept
    when it exists already: a 1B shape takes a while to write)."""
    from safetensors.torch import save_file

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    base = json.loads((tokenizer_from / "config.json").read_text())
    cfg = {**base, **shape, "tie_word_embeddings": True, "torch_dtype": str(dtype).removeprefix("torch.")}
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*dims: int) -> torch.Tensor:  # ~unit-variance activations through every layer
        return (torch.randn(*dims, generator=g) / dims[-1] ** 0.5).to(dtype)

    tensors = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                        p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
                        p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                        p + "mlp.down_proj.weight": rnd(h, inter),
                        p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
