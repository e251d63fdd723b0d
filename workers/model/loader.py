"""Load a Hugging Face model folder (sharded safetensors) into a Baton model."""

from __future__ import annotations

from pathlib import Path

import torch
from baton_serve.kernels import kernel_choice
from baton_serve.workers.errors import ModelLoadError
from baton_serve.workers.model.checkpoint_slice import CheckpointSlice
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.model.layers import ParallelContext, default_weight_loader
from baton_serve.workers.model.llama import LlamaForCausalLM
from safetensors import safe_open

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ValueError naming the allowed values."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return files


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32,
               ctx: ParallelContext | None = None, max_positions: int | None = None,
               device: torch.device | str = "cpu", deterministic: bool = False,
               workload: kernel_choice.Workload | None = None) -> LlamaForCausalLM:
    """Build the model from ``config.json``, copy every weight in (all parameters must be filled)
    and move it to ``device``; ``deterministic``: batch-invariant numerics (``LlamaForCausalLM``);
    ``workload``: the row counts the CPU kernel choice is measured at (``kernels.kernel_choice``)."""
    folder = Path(folder)
    device = torch.device(device)
    cfg = ModelConfig.from_folder(folder)
    if cfg.quantization is not None and device.type != "cpu":
        raise ModelLoadError(f"{folder}: {cfg.quantization.method} weights have CPU kernels only; serve the "
                             f"full-precision model on {device.type}, or this one with device = 'cpu'")
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, dtype=dtype, ctx=ctx, max_positions=max_positions,
                                 deterministic=deterministic)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_target(name)
                if target is None:
                    continue
                pname, shard = target
                param = params.get(pname)
                if param is None:
                    raise ModelLoadError(f"{file.name}: unexpected tensor {name!r} (no parameter {pname!r})")
                loader = getattr(param, "weight_loader", default_weight_loader)
                # to the parameter's own dtype: float weights take the model's, while quantised
                # weights keep their integer codes and fp32 scales; read lazily, so that a
                # tensor-parallel rank reads only the slice it holds
                tensor = CheckpointSlice(f.get_slice(name), param.dtype)
                try:
                    loader(param, tensor, shard)
                except (RuntimeError, ValueError) as exc:  # a shape that does not fit this model
                    raise ModelLoadError(f"{file.name}: tensor {name!r} of shape {tuple(tensor.shape)} does not "
                                         f"fit parameter {pname!r} of shape {tuple(param.shape)}: {exc}") from None
                loaded.add(pname if shard is None else f"{pname}#{shard}")
    missing = [n for n in params if not _is_loaded(n, loaded)]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks weights for {missing[:5]}")
    # Weights are read on the CPU (safetensors maps the files) and moved once; packing is for the
    # CPU matmul and a no-op on other devices, so it follows the move.
    if device.type != "cpu":
        model.to(device)
    plan = None
    if device.type == "cpu" and not deterministic:  # the deterministic mode's kernels are fixed by its contract
        try:
            plan = kernel_choice.plan_for(*model.kernel_shapes(), dtype, workload)
        except kernel_choice.KernelChoiceError as exc:
            raise ModelLoadError(str(exc)) from None
    model.pack_weights(plan)
    return model.eval()


def _is_loaded(pname: str, loaded: set[str]) -> bool:
    return pname in loaded or any(key.startswith(pname + "#") for key in loaded)
