"""RestartPolicy / RestartHistory: backoff doubles within the window, capped; too many deaths quarantine."""

from __future__ import annotations

from baton_serve.cluster.restarts import RestartHistory, RestartPolicy
from hypothesis import given
from hypothesis import strategies as st


def test_backoff_doubles_and_is_capped():
    p = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [p.delay_s(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


@given(gaps=st.lists(st.floats(0.0, 400.0), min_size=1, max_size=30), max_restarts=st.integers(0, 6))
def test_quarantine_only_after_more_than_max_restarts_within_the_window(gaps, max_restarts):
    policy = RestartPolicy(max_restarts=max_restarts, window_s=600.0, backoff_s=1.0, max_backoff_s=30.0)
    history = RestartHistory(policy)
    now, times, quarantined = 0.0, [], False
    for gap in gaps:
        now += gap
        times.append(now)
        delay = history.died(now)
        recent = [t for t in times if now - t <= policy.window_s]
        quarantined = quarantined or len(recent) > max_restarts
        if quarantined:
            assert delay is None and history.quarantined  # once quarantined, never restarted
        else:
            assert delay == policy.delay_s(len(recent))


def test_restarts_off_never_restart():
    history = RestartHistory(RestartPolicy(enabled=False))
    assert history.died(0.0) is None and not history.quarantined
