"""``baton convert --quantize int8|int4``: a weight-only quantised copy of an HF model folder.

The copy is a model folder of its own (config.json with a ``quantization_config``, one
safetensors file, the tokenizer files), so it has its own weights fingerprint and therefore its
own prefix-cache namespace: a quantised and a full-precision worker never share KV blocks.
Decoder linear layers become int8 (per output channel) or int4 (group-wise, asymmetric) codes;
the output projection becomes int8 (a separate copy when tied to the embedding, which keeps full
precision for the lookup), as llama.cpp's Q4 files keep a Q8 output; norms and embeddings stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from baton_serve.kernels import quant_linear
from baton_serve.workers.errors import ModelLoadError
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.model.loader import safetensors_files
from baton_serve.workers.model.quantization import GROUP_SIZES, QuantConfig
from safetensors import safe_open
from safetensors.torch import save_file

# checkpoint names of the decoder's linear weights (HF Llama naming)
_LINEAR_SUFFIXES = tuple(f".{name}.weight" for name in (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
           "chat_template.jinja")


def quantized_folder_name(folder: Path, method: str, group_size: int, activations: str = "float") -> str:
    return (f"{folder.name}-{method}" + (f"-g{group_size}" if group_size else "")
            + ("-a8" if activations == "int8" else ""))


def _quantize_tensor(name: str, weight: torch.Tensor, quant: QuantConfig, method: str) -> dict[str, torch.Tensor]:
    stem = name[: -len(".weight")]
    w = weight.float()
    if method == "int8":
        q, s = quant_linear.quantize_int8(w, quant.group_size)
        return {f"{stem}.qweight": q.contiguous(), f"{stem}.scales": s.contiguous()}
    q, s, m = quant_linear.quantize_int4(w, quant.group_size)
    return {f"{stem}.qweight": q.contiguous(), f"{stem}.scales": s.contiguous(), f"{stem}.mins": m.contiguous()}


def quantize_weights(folder: Path, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the quantised checkpoint, by name."""
    cfg = ModelConfig.from_folder(folder)
    if cfg.quantization is not None:
        raise ModelLoadError(f"{folder} is already quantised ({cfg.quantization.method})")
    out: dict[str, torch.Tensor] = {}
    embed: torch.Tensor | None = None
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name.endswith(_LINEAR_SUFFIXES):
                    out.update(_quantize_tensor(name, tensor, quant, quant.method))
                elif name == "lm_head.weight" and quant.lm_head != "full":
                    out.update(_quantize_tensor(name, tensor, quant, quant.lm_head))
                else:
                    out[name] = tensor.contiguous()
                    if name.endswith("embed_tokens.weight"):
                        embed = tensor
    if quant.lm_head != "full" and not any(k.startswith("lm_head.") for k in out):
        if embed is None:
            raise ModelLoadError(f"{folder}: no lm_head.weight and no embed_tokens.weight to quantise")
        out.update(_quantize_tensor("lm_head.weight", embed, quant, quant.lm_head))  # tied: its own copy
    return out


def quantize_folder(folder: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None,
                    method: str = "int8", group_size: int = 32, lm_head: str = "int8",
                    activations: str = "float") -> Path:
    """Write the quantised copy of ``folder`` to ``out_dir`` (default: beside it, named after the
    method) and return it; ``activations = "int8"``: W8A8 (int8 per channel only). The folder appears by an atomic rename, complete or not at all; an
    existing complete one is reused."""
    src = Path(folder)
    if method not in ("int8", "int4"):
        raise ValueError(f"--quantize must be int8 or int4, got {method!r}")
    allowed = GROUP_SIZES if method == "int4" else (0, *GROUP_SIZES)
    if group_size not in allowed:
        raise ValueError(f"--group-size must be one of {allowed} for {method}, got {group_size}")
    if activations == "int8" and (method != "int8" or group_size != 0):
        raise ValueError(f"--activations int8 needs --quantize int8 --group-size 0 (one scale per output "
                         f"channel), got --quantize {method} --group-size {group_size}")
    try:
        quant = QuantConfig(method, group_size, lm_head, activations)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from None
    target = (Path(out_dir) if out_dir is not None
              else src.parent / quantized_folder_name(src, method, group_size, activations))
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tensors = quantize_weights(src, quant)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quant.to_dict()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in _COPIED:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first, or the target exists incomplete
            if not (target / "config.json").is_file():
                raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return target
