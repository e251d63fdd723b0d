"""workers.text.tokenizer: loading a model folder, special ids, encode/decode and chat templates."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from baton_serve.workers.errors import InvalidRequestError, ModelLoadError
from baton_serve.workers.text.tokenizer import Tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Small enough to train in well under a second, varied enough that the learned merges split
# Chinese characters and emoji across tokens (which the detokenizer tests rely on).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "你好，世界！今天天气很好。我们去公园散步吧。你好你好，天气天气。",
    "👩‍👩‍👧‍👦 family 🙂👍🏽 thumbs 👍🏽👍🏽 smile 🙂🙂 and e\u0301 n\u0303 e\u0301e\u0301",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 注释 comment",
    "Numbers 12345, 3.14159 and 2024-01-01; Ünïcödé àçcénts — “quotes”.",
]


def write_bpe_model(folder: Path, **config: Any) -> Path:
    """Write a byte-level BPE tokenizer folder (ChatML template); ``config`` overrides
    tokenizer_config.json entries."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}
    tok_cfg.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bpe_model(tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture(scope="session")
def tok(bpe_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(bpe_dir)


@pytest.fixture
def model_copy(bpe_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bpe_dir, tmp_path / "copy"))


def test_loads_special_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == [2, 0]  # generation_config first, duplicates dropped
    assert tok.bos_token_id is None
    assert tok.special_token_ids == {0, 1, 2}
    assert tok.vocab_size == len(tok.backend.get_vocab(with_added_tokens=True)) > 300
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize(
    "text",
    ["Hello world!", "你好，世界！今天天气很好。", "👩‍👩‍👧‍👦 🙂👍🏽", "e\u0301 n\u0303", "", "  spaces  "],
)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == ids  # add_bos_token is false


def test_special_tokens_in_text_are_parsed_and_skippable(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_bos_prepended_only_when_configured_and_never_doubled(model_copy: Path) -> None:
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|endoftext|>", add_bos_token=True)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(model_copy)
    assert t.bos_token_id == 0
    assert t.encode("hi", add_special_tokens=True) == [0, *t.encode("hi")]
    assert t.encode("<|endoftext|>hi", add_special_tokens=True) == [0, *t.encode("hi")]
    assert t.encode("hi")[0] != 0


def test_bos_inferred_from_post_processor_when_config_is_silent(model_copy: Path) -> None:
    backend = HFTokenizer.from_file(str(model_copy / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(model_copy / "tokenizer.json"))
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<|endoftext|>"
    del cfg["add_bos_token"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(model_copy)
    assert t.add_bos_token
    assert t.encode("hi", add_special_tokens=True) == [0, *t.encode("hi")]


def test_unknown_id_is_a_request_error(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.id_to_token(10**6)
    with pytest.raises(InvalidRequestError):
        tok.convert_ids_to_tokens([1, -1])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_bad_eos_token_id(model_copy: Path) -> None:
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        Tokenizer.from_folder(model_copy)


def test_eos_from_int_config_and_token(model_copy: Path) -> None:
    (model_copy / "generation_config.json").unlink()
    assert Tokenizer.from_folder(model_copy).eos_token_ids == [0, 2]


def test_fingerprints(tok: Tokenizer, bpe_dir: Path, model_copy: Path) -> None:
    assert tok.fingerprint() == hashlib.sha256((bpe_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.chat_template_fingerprint() == hashlib.sha256(CHATML.encode()).hexdigest()
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML + " "
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    other = Tokenizer.from_folder(model_copy)
    assert other.fingerprint() == tok.fingerprint()
    assert other.chat_template_fingerprint() != tok.chat_template_fingerprint()


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "你好"},
    {"role": "assistant", "content": "Hi 🙂"},
]


def test_chatml_render(tok: Tokenizer) -> None:
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == expected
    assert (
        tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
        == expected.rsplit("<|im_start|>", 1)[0]
    )
    ids = tok.encode(expected)
    assert ids.count(1) == 4 and ids.count(2) == 3


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    out = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\na\nb<|im_end|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def _with_template(folder: Path, template: str | None) -> Tokenizer:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_folder(folder)


def test_missing_template_rejects_chat_but_not_encode(model_copy: Path) -> None:
    t = _with_template(model_copy, None)
    assert t.decode(t.encode("hi")) == "hi"
    with pytest.raises(InvalidRequestError, match="chat template"):
        t.apply_chat_template(CONVERSATION)


def test_template_features(model_copy: Path) -> None:
    t = _with_template(
        model_copy,
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ extra }}\n"
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{% endfor %}",
    )
    out = t.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "<a&b>"}], extra=7)
    assert out == '|<|im_end|>|[{"name": "<a&b>"}]|7\n'  # tojson must not HTML-escape
    with pytest.raises(InvalidRequestError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": "x"}])


def test_template_is_sandboxed(model_copy: Path) -> None:
    t = _with_template(model_copy, "{{ messages.append(1) }}{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        t.apply_chat_template(CONVERSATION)


def test_broken_template_is_a_load_error(model_copy: Path) -> None:
    with pytest.raises(ModelLoadError, match="chat template"):
        _with_template(model_copy, "{% for m in messages %}")


# --- the real default model (SmolLM2-135M-Instruct), when it can be converted here ---




@pytest.mark.slow
def test_real_tokenizer(real_tok: Tokenizer) -> None:
    im_end = real_tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in real_tok.eos_token_ids
    assert im_end[0] in real_tok.special_token_ids
    for text in ["Hello world!", "你好，世界！今天天气很好。", "👩‍👩‍👧‍👦 🙂👍🏽", "e\u0301 n\u0303"]:
        assert real_tok.decode(real_tok.encode(text)) == text
    prompt = real_tok.apply_chat_template(CONVERSATION)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\n你好<|im_end|>" in prompt
    assert real_tok.decode(real_tok.encode(prompt), skip_special_tokens=False) == prompt
