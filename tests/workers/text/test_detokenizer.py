"""workers.text.detokenizer: streamed text never breaks a character, never repeats or drops text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from baton_serve.workers.text.detokenizer import IncrementalDetokenizer
from baton_serve.workers.text.tokenizer import Tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workers.text.test_tokenizer import write_bpe_model

TEXTS = [
    "Hello world! How are you today?",
    "你好，世界！今天天气很好。",
    "👩‍👩‍👧‍👦 🙂👍🏽",
    "e\u0301 n\u0303",
    "def add(a, b):\n    return a + b  # 注释 🙂\n",
    "Mixed 中文 and emoji 👍🏽 with accents e\u0301 and “quotes”.",
]
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(write_bpe_model(tmp_path_factory.mktemp("detok") / "model"))


class CountingTokenizer:
    """Forwards decode and records the length of every window it was asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.windows: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok: Tokenizer, ids: list[int], chunks: Sequence[int] = (), skip: bool = True) -> list[str]:
    """Feed ``ids`` in chunks of the given sizes (1 when exhausted); return the step outputs
    followed by the flush output."""
    detok = IncrementalDetokenizer(tok, [1, 5, 7], skip_special_tokens=skip)
    pieces, pos, sizes = [], 0, list(chunks)
    while pos < len(ids):
        size = max(1, sizes.pop(0)) if sizes else 1
        pieces.append(detok.step(ids[pos : pos + size]))
        pos += size
    pieces.append(detok.flush())
    return pieces


def test_fixture_splits_characters_across_tokens(tok: Tokenizer) -> None:
    """Otherwise the tests below would not exercise the hold-back path at all."""
    for text in TEXTS[1:4]:
        assert any(FFFD in tok.decode([i]) for i in tok.encode(text)), text


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert pieces[-1] == ""  # valid text: nothing left for flush
    assert all(FFFD not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert sum(len(p) for p in pieces) == len(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(TEXTS), chunks=st.lists(st.integers(1, 12), max_size=40))
def test_random_chunks(tok: Tokenizer, text: str, chunks: list[int]) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids, chunks)
    assert all(FFFD not in p for p in pieces)
    assert "".join(pieces) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_full_decode(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    """Arbitrary id sequences (invalid UTF-8, specials, partial characters) still concatenate to
    exactly what a one-shot decode gives."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 12), max_size=40), label="chunks")
    assert "".join(stream(tok, ids, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_tokens_in_random_order(tok: Tokenizer, data: st.DataObject) -> None:
    """Single-byte tokens only: the densest mix of partial, stray and invalid UTF-8 bytes."""
    byte_ids = sorted({tok.backend.token_to_id(c) for c in _byte_alphabet()})
    ids = data.draw(st.lists(st.sampled_from(byte_ids), max_size=60), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 12), max_size=40), label="chunks")
    assert "".join(stream(tok, ids, chunks)) == tok.decode(ids)


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def test_flush_renders_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 世界！")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, [])
    emitted = "".join(detok.step([i]) for i in ids[:cut])
    assert FFFD not in emitted
    tail = detok.flush()
    assert tail.endswith(FFFD) and emitted + tail == tok.decode(ids[:cut])
    assert detok.flush() == ""


def test_special_tokens_follow_the_flag(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>你好<|im_end|>")
    assert "".join(stream(tok, ids)) == "你好"
    assert "".join(stream(tok, ids, skip=False)) == "<|im_start|>你好<|im_end|>"


def test_window_stays_small_on_long_output(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(counting, [])  # type: ignore[arg-type]
    out = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert max(counting.windows) <= 8  # no decode ever looks back past a few tokens
    assert len(counting.windows) <= 2 * len(ids) + 2


@pytest.mark.parametrize("garbage", [FFFD * 300, (FFFD + "中") * 150])
def test_replacement_runs_do_not_grow_the_window(tok: Tokenizer, garbage: str) -> None:
    """A model emitting literal U+FFFD (garbled output) must not make the hold-back unbounded."""
    counting = CountingTokenizer(tok)
    ids = tok.encode(garbage)
    detok = IncrementalDetokenizer(counting, [])  # type: ignore[arg-type]
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == garbage
    assert max(counting.windows) <= 20
    assert len(counting.windows) <= 6 * len(ids)
    assert sum(len(p) for p in pieces) >= len(garbage) - 10  # released while streaming


def test_big_chunk_ending_mid_character_releases_the_rest(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, this is a longer sentence. 世界！")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, [])
    first = detok.step(ids[:cut])
    assert first.startswith("Hello world, this is a longer sentence.") and FFFD not in first
    assert first + detok.step(ids[cut:]) + detok.flush() == tok.decode(ids)


# --- the real default model's tokenizer, when it can be converted here ---




@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_streams(real_tok: Tokenizer, text: str) -> None:
    ids = real_tok.encode(text)
    for chunks in ([], [2, 3, 1, 5, 2, 7, 1, 1, 4]):
        pieces = stream(real_tok, ids, chunks)
        assert all(FFFD not in p for p in pieces)
        assert "".join(pieces) == text


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_real_tokenizer_random_ids(real_tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, real_tok.vocab_size - 1), max_size=30), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 6), max_size=30), label="chunks")
    assert "".join(stream(real_tok, ids, chunks)) == real_tok.decode(ids)


def test_prompt_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt = tok.encode("你好")[:1]  # ends mid-character
    ids = tok.encode("ok")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == "ok"


def test_skipped_specials_inside_a_character_do_not_force_a_cut(tok: Tokenizer) -> None:
    """Many zero-width (skipped) tokens between a character's bytes overflow the hold limit;
    the character must still come out whole."""
    lead, *rest = (tok.backend.token_to_id(c) for c in ("ä", "¸", "Ń"))  # UTF-8 bytes of 中
    ids = [lead, *[2] * 12, *rest, *tok.encode("ok")]
    assert tok.decode(ids) == "中ok"
    for chunks in ([], [1, 13, 1]):
        pieces = stream(tok, ids, chunks)
        assert "".join(pieces) == "中ok" and all(FFFD not in p for p in pieces)
