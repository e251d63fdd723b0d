"""The traces the rebalancer benchmarks make: the day's curve, and arrivals that follow it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.rebalance_diurnal import day_curve, make_diurnal_trace
from benchmarks.rebalance_sim import make_trace, parse_phases


def test_the_day_peaks_at_noon_and_the_shifted_class_at_midnight():
    assert day_curve(0.0, 100.0, 0.2) == pytest.approx(0.2)
    assert day_curve(50.0, 100.0, 0.2) == pytest.approx(1.0)
    assert day_curve(0.0, 100.0, 0.2, shift=0.5) == pytest.approx(1.0)
    assert day_curve(50.0, 100.0, 0.2, shift=0.5) == pytest.approx(0.2)
    assert all(0.2 - 1e-9 <= day_curve(t, 100.0, 0.2) <= 1.0 + 1e-9 for t in range(101))


def test_diurnal_arrivals_follow_each_class_curve(tmp_path):
    path = tmp_path / "day.jsonl"
    n = make_diurnal_trace(path, 1000.0, [(64, 256, 20.0, 0.0), (1024, 16, 20.0, 0.5)], 0.1, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == n and [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    chat = [r for r in rows if r["prompt_len"] < 200]
    noon = sum(1 for r in chat if 400 <= r["timestamp"] < 600)
    night = sum(1 for r in chat if r["timestamp"] < 100 or r["timestamp"] >= 900)
    assert noon > 4 * night  # the curve's mean over each span: ~0.97 against ~0.12 of the peak
    expected = 20.0 * 1000.0 * (0.1 + 0.9 / 2)  # the curve's mean over a day, per class
    assert abs(len(chat) - expected) < 5 * math.sqrt(expected)
    assert all(48 <= r["prompt_len"] <= 80 and 192 <= r["output_len"] <= 320 for r in chat)


def test_phases_parse_and_refuse_what_does_not_pair(tmp_path):
    assert parse_phases("1024:16,64:256", "2,7") == ([(1024, 16), (64, 256)], [2.0, 7.0])
    with pytest.raises(ValueError, match="one entry per phase"):
        parse_phases("1024:16", "2,7")
    with pytest.raises(ValueError, match="prompt:output"):
        parse_phases("1024-16", "2")
    n = make_trace(tmp_path / "t.jsonl", [(100, 10), (10, 100)], [5.0, 5.0], 20.0, seed=0)
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(rows) == n and all(r["timestamp"] < 40.0 for r in rows)
    assert all(r["prompt_len"] >= 75 for r in rows if r["timestamp"] < 20.0)
