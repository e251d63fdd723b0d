"""Incremental detokenization for streaming: release text only once it can no longer change.

Decoding token by token and concatenating is wrong twice over: a byte-level BPE token can
hold half of a UTF-8 character (Chinese, emoji, combining marks), and SentencePiece-style
decoders treat a sequence's first token differently (leading-space stripping). So each step
decodes a short window ``ids[prefix:]`` that starts one emission back, and releases only the
part past ``ids[prefix:read]``, and only when the window does not end in U+FFFD (the sign of
an unfinished character).
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_serve.workers.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Held tokens before looking for an earlier safe cut: a big chunk ending mid-character, or a
# run of U+FFFD (garbled output), would otherwise grow the window without bound.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one request at a time.

    Contract: ``"".join(step(c) for c in chunks) + flush() == tokenizer.decode(all_ids,
    skip_special_tokens)`` for any chunking of the output ids ``all_ids``, and no delta from
    ``step`` ends with an unfinished character. Deltas are code-point (not grapheme) stable:
    "e" and a following combining accent may arrive in different deltas.

    The prompt ids do not take part: the text is that of the output ids alone, so a streamed
    response equals the non-streamed one.

    Cost per token is O(window) = O(1) amortised: two window decodes per emitting step, one
    per holding step, plus at most ``2 * _MAX_HELD_TOKENS`` extra decodes once every
    ``_MAX_HELD_TOKENS`` held tokens (big chunks ending mid-character, garbled U+FFFD runs).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the read offset of the emission before last
        self._read = 0  # everything before this id has been released
        self._prefix_text = ""  # decode(ids[prefix:read]), kept to diff against
        self._next_search = 0  # earliest length at which _release_settled looks again

    @property
    def token_ids(self) -> list[int]:
        """Every output id given to ``step`` so far (a copy)."""
        return list(self._ids)

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return only the newly stable text (possibly "")."""
        self._ids.extend(new_ids)
        n = len(self._ids)
        if n == self._read:
            return ""
        text = self._decode(self._prefix, n)
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
            return self._advance(n, text)
        if n - self._read > _MAX_HELD_TOKENS:
            return self._release_settled(text)
        return ""

    def flush(self) -> str:
        """End of stream: return everything still held; an unfinished trailing character
        becomes U+FFFD exactly as ``tokenizer.decode`` renders it."""
        n = len(self._ids)
        if n == self._read:
            return ""
        return self._advance(n, self._decode(self._prefix, n))

    def _advance(self, cut: int, window_text: str) -> str:
        """Release ``window_text`` (= decode(ids[prefix:cut])) past the prefix; move offsets."""
        delta = window_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, cut
        self._prefix_text = self._decode(self._prefix, self._read)
        return delta

    def _release_settled(self, text: str) -> str:
        """Release up to the latest earlier cut that no future token can change, if any.

        A cut is safe when ``decode(ids[prefix:cut])`` ends cleanly (the usual rule, as if the
        ids had come one at a time), or, for runs of U+FFFD, when decoding the two sides
        separately gives the same text as decoding them together and the right side is not
        empty: then no character straddles the cut, and the bytes after it already decided
        how the left side ends.
        """
        n = len(self._ids)
        if n < self._next_search:
            return ""
        self._next_search = n + _MAX_HELD_TOKENS  # a futile search is not retried every step
        for cut in range(n - 1, max(self._read, n - _MAX_HELD_TOKENS), -1):
            left = self._decode(self._prefix, cut)
            if len(left) <= len(self._prefix_text):
                continue
            if not left.endswith(_REPLACEMENT):
                return self._advance(cut, left)
            right = self._decode(cut, n)
            if right and left + right == text:
                return self._advance(cut, left)
        return ""

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self._ids[start:stop], skip_special_tokens=self.skip_special_tokens)
