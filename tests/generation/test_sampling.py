"""Sampling: definitions on known distributions, reproducibility and batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ttsbuild.generation.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    filter_top_k_top_p,
    sample,
    uniform_noise,
)

PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
N_DRAWS = 40000


def draw_many(logits: torch.Tensor, params: SamplingParams, seed: int = 1) -> torch.Tensor:
    """N_DRAWS draws from one distribution: one row per draw, counters 0..N-1."""
    batch = SamplingBatch.from_params([params] * N_DRAWS)
    rows = logits[None].expand(N_DRAWS, -1)
    seeds = torch.full((N_DRAWS,), seed, dtype=torch.int64)
    return sample(rows, batch, seeds, torch.arange(N_DRAWS))


def assert_frequencies(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=len(expected)).double() / len(tokens)
    sigma = (expected * (1 - expected) / len(tokens)).sqrt()
    # 5 sigma per bin: a correct sampler fails this with probability ~1e-6.
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-12), (freq, expected)


def test_plain_sampling_matches_softmax():
    tokens = draw_many(PROBS.log(), SamplingParams(temperature=1.0, top_k=0))
    assert_frequencies(tokens, PROBS.double())


def test_temperature_sharpens_as_defined():
    t = 0.5
    tokens = draw_many(PROBS.log(), SamplingParams(temperature=t, top_k=0))
    expected = PROBS.double() ** (1 / t)
    assert_frequencies(tokens, expected / expected.sum())


def test_top_k_keeps_the_k_most_probable():
    tokens = draw_many(PROBS.log(), SamplingParams(temperature=1.0, top_k=2))
    assert_frequencies(tokens, torch.tensor([2 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Ascending cumulative mass: .0625 .125 .25 .5 1 -> tokens with mass <= 0.3 are dropped.
    tokens = draw_many(PROBS.log(), SamplingParams(temperature=1.0, top_k=0, top_p=0.7))
    assert_frequencies(tokens, torch.tensor([2 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (7, 1.0), (0, 0.8), (20, 0.6), (1, 0.9)])
def test_filters_equal_hf_warpers_on_random_logits(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    logits = torch.randn(6, 300, generator=g) * 3
    ours = filter_top_k_top_p(
        logits, torch.full((6,), top_k, dtype=torch.int64), torch.full((6,), top_p)
    )
    ref = logits.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


def test_repetition_penalty_matches_definition_and_hf():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 50, generator=g)
    generated = torch.tensor([[3, 7, 7, 20], [0, 1, 2, 49]])
    history = torch.zeros(2, 50, dtype=torch.bool)
    history.scatter_(1, generated, True)
    ours = apply_repetition_penalty(logits, history, torch.tensor([1.3, 1.3]))
    ref = RepetitionPenaltyLogitsProcessor(1.3)(generated, logits.clone())
    assert torch.allclose(ours, ref, rtol=0, atol=1e-7)
    neg = logits[0, 3] < 0
    expected = logits[0, 3] * 1.3 if neg else logits[0, 3] / 1.3
    assert math.isclose(float(ours[0, 3]), float(expected), rel_tol=1e-6)
    assert torch.equal(ours[~history], logits[~history])


def test_seeded_draws_repeat_and_seeds_differ():
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(5))
    batch = SamplingBatch.from_params([SamplingParams()] * 4)
    counters = torch.tensor([0, 1, 17, 300])
    a = sample(logits, batch, torch.tensor([1, 2, 3, 2**62 + 5]), counters)
    b = sample(logits, batch, torch.tensor([1, 2, 3, 2**62 + 5]), counters)
    assert torch.equal(a, b)
    draws = [sample(logits, batch, torch.full((4,), s), counters) for s in range(20)]
    assert len({tuple(d.tolist()) for d in draws}) > 10


def test_a_row_samples_the_same_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 3072, generator=g) * 2
    params = [
        SamplingParams(temperature=0.7 + 0.1 * i, top_k=10 * i, top_p=1 - 0.1 * i) for i in range(5)
    ]
    seeds, counters = torch.arange(5) * 977 + 3, torch.arange(5) * 16
    batched = sample(logits, SamplingBatch.from_params(params), seeds, counters)
    perm = torch.tensor([3, 0, 4, 1, 2])
    permuted = sample(
        logits[perm],
        SamplingBatch.from_params([params[i] for i in perm]),
        seeds[perm],
        counters[perm],
    )
    assert torch.equal(permuted, batched[perm])
    for i in range(5):
        alone = sample(
            logits[i : i + 1],
            SamplingBatch.from_params([params[i]]),
            seeds[i : i + 1],
            counters[i : i + 1],
        )
        assert int(alone) == int(batched[i])


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(7))
    batch = SamplingBatch.from_params([SamplingParams(do_sample=False)] * 3)
    out = sample(logits, batch, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    assert torch.equal(out, logits.argmax(-1))


def test_uniform_noise_is_uniform_in_open_interval():
    u = uniform_noise(torch.tensor([123, 2**62 + 1]), torch.tensor([5, 9]), 50000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    for row in u:
        sorted_u = row.double().sort().values
        ks = float((sorted_u - torch.arange(1, len(row) + 1) / len(row)).abs().max())
        assert ks < 1.63 / math.sqrt(len(row))  # Kolmogorov-Smirnov at the 1% level
    assert not torch.equal(u[0], u[1])


# (seed, counter, column) whose 24 noise bits are all ones: the bin centre 1 - 2^-25 rounds
# to 1.0 in float32 (found by the GPU sampler test, 2026-11-29).
TOP_BIN = (2797625467267785684, 439565, 964)


def test_uniform_noise_top_bin_is_below_one():
    seed, ctr, col = TOP_BIN
    u = uniform_noise(torch.tensor([seed]), torch.tensor([ctr]), col + 1)[0]
    assert float(u[col]) == 1.0 - 2.0**-24
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_sample_never_draws_a_filtered_token_from_the_top_bin():
    # Before the clamp, Gumbel noise +inf on a filtered-out token made its score NaN, and
    # argmax drew it.
    seed, ctr, col = TOP_BIN
    logits = torch.zeros(1, 2048)
    logits[0, 7] = 5.0
    batch = SamplingBatch.from_params([SamplingParams(top_k=1)])
    out = sample(logits, batch, torch.tensor([seed]), torch.tensor([ctr]))
    assert int(out) == 7 and col != 7


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5}, {"repetition_penalty": 0}],
)
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
