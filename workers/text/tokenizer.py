"""Tokenizer for a Hugging Face model folder: encode/decode, special ids and chat templates."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from baton_serve.workers.errors import InvalidRequestError, ModelLoadError
from jinja2.sandbox import ImmutableSandboxedEnvironment


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model-folder settings that serving needs.

    Build it with :meth:`from_folder`. Instances are read-only after construction, so one can
    be shared by every request of a worker.
    """

    backend: tokenizers.Tokenizer = field(repr=False)
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = field(default=None, repr=False)
    tokenizer_sha256: str = ""
    _template: jinja2.Template | None = field(default=None, init=False, repr=False)
    _special_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder()
        ids = {i for i, tok in added.items() if tok.special} | set(self.eos_token_ids)
        if self.bos_token_id is not None:
            ids.add(self.bos_token_id)
        self._special_ids = frozenset(ids)
        if self.chat_template is not None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ModelLoadError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and its configs; raise ModelLoadError when unusable."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        raw = tok_file.read_bytes()
        try:
            backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot parse {tok_file}: {e}") from e
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        bos_token = _token_content(tok_cfg.get("bos_token"))
        eos_token = _token_content(tok_cfg.get("eos_token"))
        eos_ids: list[int] = []
        bos_id: int | None = None
        # generation_config.json is what generate() honours, so it comes first.
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json(folder / name)
            eos_ids.extend(_as_id_list(cfg.get("eos_token_id"), folder / name))
            if bos_id is None and isinstance(cfg.get("bos_token_id"), int):
                bos_id = cfg["bos_token_id"]
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        if bos_token is not None and backend.token_to_id(bos_token) is not None:
            bos_id = backend.token_to_id(bos_token)
        return cls(
            backend=backend,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token_id=bos_id,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos_token=_adds_bos(tok_cfg, backend, bos_id),
            chat_template=_load_chat_template(folder, tok_cfg),
            tokenizer_sha256=hashlib.sha256(raw).hexdigest(),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of added tokens marked special, plus the BOS/EOS ids."""
        return set(self._special_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS is prepended only if the
        config sets ``add_bos_token`` (the post-processor is bypassed so BOS never doubles)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 decodes to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary string of one id; InvalidRequestError when the id is unknown."""
        tok = self.backend.id_to_token(token_id) if token_id >= 0 else None
        if tok is None:
            raise InvalidRequestError(f"token id {token_id} is not in the vocabulary", param="token_id")
        return tok

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (see :meth:`id_to_token`)."""
        return [self.id_to_token(i) for i in ids]

    def fingerprint(self) -> str:
        """sha256 of tokenizer.json: equal fingerprints tokenize identically."""
        return self.tokenizer_sha256

    def chat_template_fingerprint(self) -> str:
        """sha256 of the chat template (of "" when there is none), for prefix-cache namespaces."""
        return hashlib.sha256((self.chat_template or "").encode("utf-8")).hexdigest()

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself (the HF convention)."""
        return bool(self.chat_template and "tools" in self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template into a prompt string.

        Raises InvalidRequestError for malformed messages, a missing template, or a
        template that rejects the conversation (``raise_exception``).
        """
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API", "messages")
        context = dict(kwargs)
        context.update(
            messages=_normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            return self._template.render(**context)
        except InvalidRequestError:
            raise
        except (jinja2.TemplateError, TypeError) as e:
            # TypeError: the template did arithmetic on a value it did not expect, such as the None
            # content of an assistant turn that only calls tools ('...' + message['content']).
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; text-part lists become one string joined by newlines."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise InvalidRequestError(f"{where}.role must be a non-empty string", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):
            content = "\n".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        elif content is None and msg.get("tool_calls"):
            pass  # an assistant turn that only calls tools has no text
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
            )
        out.append({**msg, "content": content})
    return out


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise InvalidRequestError(f"{where} must be {{'type': 'text', 'text': str}}", param=where)


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. roles not alternating): a client error.
    raise InvalidRequestError(f"chat template rejected the messages: {message}", param="messages")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes <, > and &, which would corrupt prompts.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _load_chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    """Template from tokenizer_config.json, else from chat_template.jinja / chat_template.json."""
    tmpl = tok_cfg.get("chat_template")
    if tmpl is None and (folder / "chat_template.jinja").is_file():
        tmpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if tmpl is None:
        tmpl = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    if tmpl is not None and not isinstance(tmpl, str):
        raise ModelLoadError(f"chat_template in {folder} is not a string")
    return tmpl


def _adds_bos(tok_cfg: dict[str, Any], backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """``add_bos_token`` from the config; when absent, whether tokenizer.json's post-processor
    prepends BOS (Llama-3-style folders say so only there)."""
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    if bos_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any, source: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"eos_token_id in {source} must be an int or a list of ints, got {value!r}")
    return values
