"""Prompts of exact token lengths, built with the served model's tokenizer.

With a tokenizer, a prompt of n tokens is n random ids whose text re-encodes to the very same n
ids, so it is n tokens long whether it is sent as ids or as text. Without one, prompts are
common English words, roughly one token each, and ``exact`` is False so reports can say so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from baton_serve.cluster.bench.workload import RequestSpec

# Short, frequent words: one token each in every BPE vocabulary we know, so n words ~ n tokens.
_WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know"
).split()
_MAX_ROUNDS = 16


class TokenizerLike(Protocol):
    """What prompt synthesis needs of a tokenizer (``workers.text.tokenizer.Tokenizer`` has it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_token_ids(self) -> set[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """A prompt in both forms. ``token_ids`` is None without a tokenizer; ``system`` is the shared
    prefix's text when the chat API should send it as a system message."""

    text: str
    token_ids: list[int] | None
    num_tokens: int
    system: str | None = None
    user: str | None = None


class PromptFactory:
    """Builds :class:`Prompt` objects for :class:`RequestSpec` lists, deterministically per seed."""

    def __init__(self, tokenizer: TokenizerLike | None, seed: int = 0) -> None:
        """``tokenizer`` None means approximate lengths (common words, about a token each)."""
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self._pool = self._word_pool(tokenizer) if tokenizer is not None else []

    @property
    def exact(self) -> bool:
        """Whether prompt lengths are exact token counts."""
        return self.tokenizer is not None

    @staticmethod
    def _word_pool(tok: TokenizerLike) -> list[int]:
        """Ids that decode to ' word' and encode back to themselves alone: random sequences of
        them round-trip almost always. Empty for tokenizers that do not decode that way."""
        special = tok.special_token_ids
        ids = [i for i in range(tok.vocab_size) if i not in special]
        texts = [tok.decode([i]) for i in ids]
        cand = [(i, t) for i, t in zip(ids, texts) if len(t) >= 3 and t[0] == " " and t[1:].isascii()
                and t[1:].isalpha()]
        return [i for i, t in cand if tok.encode(t) == [i]]

    def _random_ids(self, tok: TokenizerLike, n: int) -> list[int]:
        if self._pool:
            return [self.rng.choice(self._pool) for _ in range(n)]
        special = tok.special_token_ids
        vocab = tok.vocab_size
        out: list[int] = []
        while len(out) < n:
            i = self.rng.randrange(vocab)
            if i not in special:
                out.append(i)
        return out

    def exact_ids(self, tok: TokenizerLike, n: int, prefix: list[int] | None = None) -> list[int]:
        """``n`` new ids such that ``encode(decode(prefix + ids)) == prefix + ids``.

        Re-encodes and trims or tops up until the round trip is stable; after a bounded number of
        rounds it returns ids of length n anyway (exact as token ids, perhaps not as text).
        """
        head = prefix or []
        ids = self._random_ids(tok, n)
        for _ in range(_MAX_ROUNDS):
            again = tok.encode(tok.decode(head + ids))
            if again == head + ids:
                return ids
            tail = again[len(head):] if again[:len(head)] == head else ids
            ids = tail[:n] + self._random_ids(tok, max(0, n - len(tail)))
        return ids

    def _approx_text(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def build(self, specs: list[RequestSpec]) -> list[Prompt]:
        """One prompt per spec; specs sharing a ``prefix_group`` share the same prefix tokens."""
        prefixes: dict[int, list[int] | str] = {}
        out = []
        for spec in specs:
            prefix: list[int] | str | None = None
            if spec.prefix_group >= 0:
                if spec.prefix_group not in prefixes:
                    tok = self.tokenizer
                    prefixes[spec.prefix_group] = (self._approx_text(spec.prefix_len) if tok is None
                                                   else self.exact_ids(tok, spec.prefix_len))
                prefix = prefixes[spec.prefix_group]
            out.append(self._one(spec, prefix))
        return out

    def prefix_warmups(self, specs: list[RequestSpec], prompts: list[Prompt]) -> list[tuple[RequestSpec, Prompt]]:
        """One request per shared prefix of ``prompts`` (built from ``specs``), in order of first
        use: the same prefix, a fresh suffix as long as that first request's, so a warm-up puts
        the system prompts in the server's caches and nothing of a measured request beyond them."""
        out: list[tuple[RequestSpec, Prompt]] = []
        seen: set[int] = set()
        for spec, prompt in zip(specs, prompts):
            if spec.prefix_group < 0 or spec.prefix_group in seen:
                continue
            seen.add(spec.prefix_group)
            if prompt.token_ids is not None:
                prefix: list[int] | str | None = prompt.token_ids[:spec.prefix_len]
            else:
                prefix = prompt.system
            out.append((spec, self._one(spec, prefix)))
        return out

    def _one(self, spec: RequestSpec, prefix: list[int] | str | None) -> Prompt:
        tok = self.tokenizer
        if spec.text is not None:  # a trace's literal prompt
            ids = tok.encode(spec.text) if tok is not None else None
            n = len(ids) if ids is not None else (spec.prompt_len or len(spec.text.split()))
            return Prompt(text=spec.text, token_ids=ids, num_tokens=n)
        suffix_len = spec.prompt_len - spec.prefix_len
        if tok is None:
            user = self._approx_text(suffix_len)
            system = prefix if isinstance(prefix, str) else None
            text = f"{system} {user}" if system else user
            return Prompt(text=text, token_ids=None, num_tokens=spec.prompt_len, system=system, user=user)
        head = prefix if isinstance(prefix, list) else []
        ids = head + self.exact_ids(tok, suffix_len, head)
        system = tok.decode(head) if head else None
        user = tok.decode(ids[len(head):]) if head else None
        return Prompt(text=tok.decode(ids), token_ids=ids, num_tokens=len(ids),
                      system=system, user=user)


def load_tokenizer(tokenizer: str | None, model: str | None) -> tuple[TokenizerLike | None, str]:
    """The served model's tokenizer and a line saying where it came from (or why there is none).

    ``tokenizer`` (a folder) wins; else ``model`` when it is a local folder, or the default model
    (``resolve_model``) when ``model`` names it. Never raises: failure means approximate lengths.
    """
    from baton_serve.workers.checkpoint.default_model import DEFAULT_MODEL_NAME, resolve_model
    from baton_serve.workers.errors import ModelLoadError
    from baton_serve.workers.text.tokenizer import Tokenizer

    try:
        if tokenizer is not None:
            return Tokenizer.from_folder(tokenizer), f"tokenizer from {tokenizer}"
        if model is not None and Path(model).expanduser().is_dir():
            return Tokenizer.from_folder(Path(model).expanduser()), f"tokenizer from {model}"
        if model is None or model == "default" or model.startswith(DEFAULT_MODEL_NAME):
            folder = resolve_model(None)
            return Tokenizer.from_folder(folder), f"tokenizer of the default model ({folder.name})"
    except (ModelLoadError, OSError) as e:
        return None, f"no tokenizer ({e})"
    return None, f"no local tokenizer for model {model!r} (pass --tokenizer)"
