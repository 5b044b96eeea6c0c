"""Arrival process and prompt sequence: distribution, determinism, exact constant spacing."""

import json
import math

import numpy as np
import pytest

from ttsbuild.bench.schedule import (
    ArrivalProcess,
    arrival_times,
    load_prompts,
    plan_requests,
    prompt_order,
)


def test_poisson_gaps_follow_the_exponential_distribution():
    rate = 20.0
    times = arrival_times(rate, 1000.0, seed=7, process=ArrivalProcess.poisson)
    gaps = np.diff(np.concatenate([[0.0], times]))
    n = len(gaps)
    assert abs(n - 20_000) < 5 * math.sqrt(20_000)
    # Kolmogorov-Smirnov against Exp(rate): D below the 1% critical value 1.63/sqrt(n).
    ordered = np.sort(gaps)
    cdf = 1.0 - np.exp(-rate * ordered)
    upper = np.arange(1, n + 1) / n - cdf
    lower = cdf - np.arange(0, n) / n
    assert max(upper.max(), lower.max()) < 1.63 / math.sqrt(n)
    # Exponential: mean 1/rate and variance 1/rate^2 (within 3 standard errors).
    assert gaps.mean() == pytest.approx(1 / rate, rel=3 / math.sqrt(n))
    assert gaps.var() == pytest.approx(1 / rate**2, rel=3 * math.sqrt(8 / n))


def test_same_seed_same_schedule_different_seed_different_schedule():
    a = arrival_times(8.0, 30.0, seed=3, process=ArrivalProcess.poisson)
    b = arrival_times(8.0, 30.0, seed=3, process=ArrivalProcess.poisson)
    c = arrival_times(8.0, 30.0, seed=4, process=ArrivalProcess.poisson)
    np.testing.assert_array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)
    assert np.all(np.diff(a) > 0) and a[0] > 0 and a[-1] < 30.0


def test_rate_only_scales_the_schedule_and_keeps_the_prompt_sequence():
    prompts = [f"prompt {i}" for i in range(50)]
    slow = plan_requests(prompts, ["v"], 2.0, 20.0, 0.0, 11, ArrivalProcess.poisson)
    fast = plan_requests(prompts, ["v"], 8.0, 20.0, 0.0, 11, ArrivalProcess.poisson)
    shared = min(len(slow), len(fast))
    assert [r.text for r in slow[:shared]] == [r.text for r in fast[:shared]]
    for s, f in zip(slow[:shared], fast[:shared], strict=True):
        assert f.send_at_s == pytest.approx(s.send_at_s / 4)


def test_constant_spacing_is_exact():
    times = arrival_times(4.0, 2.5, seed=0, process=ArrivalProcess.constant)
    np.testing.assert_array_equal(times, [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25])
    assert len(arrival_times(3.0, 1.0, seed=0, process=ArrivalProcess.constant)) == 3


def test_warmup_flags_and_voice_rotation():
    planned = plan_requests(["a", "b"], ["v1", "v2"], 2.0, 2.0, 1.0, 0, ArrivalProcess.constant)
    assert [r.send_at_s for r in planned] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [r.warmup for r in planned] == [True, True, False, False, False, False]
    assert [r.voice for r in planned] == ["v1", "v2"] * 3


def test_prompt_order_uses_every_prompt_before_repeating():
    order = prompt_order(10, 25, seed=5)
    assert sorted(order[:10]) == list(range(10))
    assert sorted(order[10:20]) == list(range(10))
    np.testing.assert_array_equal(order, prompt_order(10, 25, seed=5))


def test_default_dataset_is_the_shipped_harvard_sentences():
    prompts = load_prompts(None)
    assert len(prompts) == 720
    assert prompts[0] == "The birch canoe slid on the smooth planks."


def test_txt_and_jsonl_datasets(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n  two  \n")
    assert load_prompts(txt) == ["one", "two"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"text": "hello", "id": 1}) + "\n\n" + json.dumps({"text": "x"}))
    assert load_prompts(jsonl) == ["hello", "x"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", "\n  \n", "no prompts"),
        ("bad.jsonl", "{not json}\n", "not valid JSON"),
        ("wrong.jsonl", '{"prompt": "x"}\n', '"text" string'),
    ],
)
def test_bad_datasets_are_rejected_with_a_clear_message(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.txt")
