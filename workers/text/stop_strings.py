"""Streaming stop-string matching that holds back text which could still become a stop string.

A stop string can span token (and therefore chunk) boundaries, so text is only released
once no stop string can start inside it any more. The result does not depend on how the
text is chunked: it always equals the whole text truncated at the first stop occurrence,
where "first" means the earliest start position, ties going to the longest stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from baton_serve.workers.errors import InvalidRequestError


@dataclass
class StopStringMatcher:
    """Incremental matcher for a fixed set of stop strings.

    Contract: the concatenation of every ``feed`` output and the final ``flush`` equals
    ``reference_truncate(full_text, stops, include_stop_str_in_output)`` for any chunking.
    Text after a stop string is never emitted. Per feed the work is
    O((len(text) + max_stop_len) * len(stops)) for the search plus O(max_stop_len**2) for
    the hold-back check, so a stream costs O(total_len * len(stops)) overall.
    """

    stops: Sequence[str]
    include_stop_str_in_output: bool = False
    matched: str | None = field(default=None, init=False)
    _pending: str = field(default="", init=False, repr=False)
    _prefixes: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _max_len: int = field(default=0, init=False, repr=False)
    _done: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        self.stops = tuple(dict.fromkeys(self.stops))
        # Every proper prefix of every stop: a pending suffix found here may still grow into a stop.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_len = max((len(s) for s in self.stops), default=0)

    @property
    def held_back(self) -> str:
        """Text received but not yet released (it could still be part of a stop string)."""
        return self._pending

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return (text safe to emit now, the matched stop string or None).

        Once a stop string has matched, every later call returns ``("", matched)``.
        """
        if self._done:
            return "", self.matched
        buf = self._pending + text
        best = self._best_match(buf)
        hold_from = len(buf) - self._longest_partial_suffix(buf)
        if best is not None:
            start, stop = best
            # A partial stop string starting at or before ``start`` may still complete and
            # would win (earlier start, or same start and longer, since it already covers
            # ``stop``), so the decision waits until more text rules it out.
            if hold_from > start:
                return self._finish(buf, start, stop), stop
        self._pending = buf[hold_from:]
        return buf[:hold_from], None

    def flush(self) -> str:
        """End of stream: return whatever is still held back (stop string excluded unless asked).

        A stop string that matched but was waiting on a possibly longer/earlier one is final
        now; ``matched`` reports it afterwards.
        """
        if self._done:
            return ""
        buf, self._pending = self._pending, ""
        best = self._best_match(buf)
        if best is not None:
            return self._finish(buf, *best)
        self._done = True
        return buf

    def _finish(self, buf: str, start: int, stop: str) -> str:
        self._done = True
        self.matched = stop
        self._pending = ""
        return buf[: start + len(stop)] if self.include_stop_str_in_output else buf[:start]

    def _best_match(self, buf: str) -> tuple[int, str] | None:
        """Earliest-starting complete stop string in ``buf``; ties go to the longest."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx < 0:
                continue
            if best is None or (idx, -len(stop)) < (best[0], -len(best[1])):
                best = (idx, stop)
        return best

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0


def reference_truncate(text: str, stops: Sequence[str], include_stop_str_in_output: bool = False) -> str:
    """Brute-force definition of the matcher's output for the whole ``text`` at once."""
    hits = [(text.find(s), -len(s), s) for s in stops if s and s in text]
    if not hits:
        return text
    start, _, stop = min(hits)
    return text[: start + len(stop)] if include_stop_str_in_output else text[:start]
