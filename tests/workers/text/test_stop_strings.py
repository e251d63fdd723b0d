"""workers.text.stop_strings: stop strings spanning chunk boundaries, hold-back and flush."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.text.stop_strings import StopStringMatcher, reference_truncate
from hypothesis import given, settings
from hypothesis import strategies as st


def brute_force(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Scan start positions left to right; the first position where some stop begins wins,
    and among stops beginning there the longest. Returns (output text, stop or None)."""
    for i in range(len(text)):
        here = [s for s in stops if text.startswith(s, i)]
        if here:
            stop = max(here, key=len)
            return (text[: i + len(stop)] if include else text[:i]), stop
    return text, None


def run(m: StopStringMatcher, chunks: Sequence[str]) -> tuple[list[str], str, str | None]:
    """Feed every chunk; return the feed outputs, the flush output and the matched stop."""
    outs, matched = [], None
    for c in chunks:
        emit, hit = m.feed(c)
        outs.append(emit)
        if matched is not None:
            assert (emit, hit) == ("", matched)  # nothing after a stop, ever
        matched = matched or hit
    tail = m.flush()
    return outs, tail, m.matched


def test_d03_stop_split_across_three_chunks() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcS") == ("abc", None)
    assert m.held_back == "S"
    assert m.feed("TO") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("ignored") == ("", "STOP")
    assert m.flush() == ""
    assert m.matched == "STOP"


def test_d03_no_match_is_recovered_by_flush() -> None:
    outs, tail, matched = run(StopStringMatcher(["STOP"]), ["abcS", "TO"])
    assert (outs, tail, matched) == (["abc", ""], "STO", None)
    # A chunk that rules the stop out releases the held text at once.
    outs, tail, matched = run(StopStringMatcher(["STOP"]), ["abcS", "TO", "p"])
    assert (outs, tail, matched) == (["abc", "", "STOp"], "", None)


def test_include_stop_str_in_output() -> None:
    outs, tail, matched = run(
        StopStringMatcher(["STOP"], include_stop_str_in_output=True), ["abcS", "TO", "Pxyz"]
    )
    assert "".join(outs) + tail == "abcSTOP" and matched == "STOP"


def test_stop_inside_one_chunk() -> None:
    m = StopStringMatcher(["\n\n", "END"])
    assert m.feed("line one\n\nline two END") == ("line one", "\n\n")


def test_overlapping_self_prefix() -> None:
    # "aab" inside "aaab": the held "aa" must shift by one, not be dropped or re-emitted.
    outs, tail, matched = run(StopStringMatcher(["aab"]), list("aaab"))
    assert "".join(outs) + tail == "a" and matched == "aab"


def test_earliest_start_wins_over_earliest_end() -> None:
    # "bc" completes first, but "abcd" starts earlier; the decision waits for the "d".
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", None)
    assert m.feed("d") == ("", "abcd")
    outs, tail, matched = run(StopStringMatcher(["bc", "abcd"]), ["xabc", "e"])
    assert "".join(outs) + tail == "xa" and matched == "bc"


def test_same_start_longest_wins() -> None:
    m = StopStringMatcher(["ab", "abc"], include_stop_str_in_output=True)
    assert m.feed("xab") == ("x", None)
    assert m.feed("cd") == ("abc", "abc")
    m = StopStringMatcher(["ab", "abc"], include_stop_str_in_output=True)
    assert m.feed("xabd") == ("xab", "ab")


def test_pending_match_is_settled_by_flush() -> None:
    m = StopStringMatcher(["ab", "abc"])
    assert m.feed("xab") == ("x", None)
    assert m.flush() == "" and m.matched == "ab"


def test_no_stops_passes_everything() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


@pytest.mark.parametrize("stops", [[""], ["ok", ""], [None]])
def test_empty_stop_rejected(stops: list) -> None:
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(stops)


def test_brute_force_agrees_with_reference() -> None:
    for text, stops in [
        ("abcd", ["bc", "abcd"]),
        ("aaab", ["aab", "a"]),
        ("xyz", ["q"]),
        ("abab", ["ab", "aba"]),
    ]:
        for include in (False, True):
            assert reference_truncate(text, stops, include) == brute_force(text, stops, include)[0]


@st.composite
def chunked(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet="abST", max_size=30),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_any_chunking_equals_brute_force(
    data: st.DataObject, text: str, stops: list[str], include: bool
) -> None:
    chunks = data.draw(chunked(text), label="chunks")
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    max_len = max(map(len, stops))
    outs = []
    for c in chunks:
        emit, hit = m.feed(c)
        outs.append(emit)
        if hit is None:
            assert len(m.held_back) < max_len  # only a possible stop prefix is ever held
    outs.append(m.flush())
    assert ("".join(outs), m.matched) == brute_force(text, stops, include)
