"""The guards' pieces on their own: the speaking-rate model and text budget, and the batched
device detectors against plain per-row Python references on fresh random inputs."""

from __future__ import annotations

import math
from importlib import resources

import numpy as np
import pytest
import torch

from ttsbuild.convert.init_random import LENGTH_RULE
from ttsbuild.generation.generate import LengthRule
from ttsbuild.generation.guards import (
    SAMPLES_PER_FRAME,
    GuardConfig,
    GuardState,
    StopCode,
    StopReason,
    expected_seconds,
    frame_stop_codes,
    observe_audio,
    push_codebook0,
    text_frame_budget,
)

EOS = 2150


def shipped_prompt_sets() -> dict[str, list[str]]:
    """Every prompt set shipped in ttsbuild/data (one prompt a line, or JSONL {"text": ...})."""
    import json

    sets = {}
    for f in resources.files("ttsbuild.data").iterdir():
        if f.name.endswith(".txt"):
            sets[f.name] = [t for t in f.read_text(encoding="utf-8").splitlines() if t.strip()]
        elif f.name.endswith(".jsonl"):
            lines = f.read_text(encoding="utf-8").splitlines()
            sets[f.name] = [json.loads(t)["text"] for t in lines if t.strip()]
    return sets


# -- speaking-rate model ------------------------------------------------------------------
def test_expected_reading_time_follows_the_published_rates():
    english = "The birch canoe slid on the smooth planks."  # 42 characters
    assert expected_seconds(english, "english") == pytest.approx(42 / 15)
    assert expected_seconds("  The birch\n canoe ") == pytest.approx(15 / 15)  # runs of space: 1
    # One syllable per Chinese character at 5.18 per second (Pellegrino et al. 2011).
    assert expected_seconds("我们今天去公园", "chinese") == pytest.approx(7 / 5.18)
    # Kana one mora each at 7.84 per second; with kana present a kanji reads as two morae.
    assert expected_seconds("きょうは公園", "auto") == pytest.approx((4 + 2 * 2) / 7.84)
    assert expected_seconds("안녕하세요", "korean") == pytest.approx(5 / 6.5)
    # Digits are read as words: "1995" takes as long as 16 letters.
    assert expected_seconds("1995") == pytest.approx(16 / 15)


def test_text_budget_is_generous_with_a_floor():
    cfg = GuardConfig()
    assert text_frame_budget("Hi.", "english", cfg) == math.ceil(12.5 * 3.0)  # the floor
    long = "The birch canoe slid on the smooth planks. " * 10
    expected = expected_seconds(long)
    assert text_frame_budget(long, "auto", cfg) == math.ceil(12.5 * (2.5 * expected + 1.0))
    tight = GuardConfig(budget_margin=1.0, budget_pad_s=0.0, budget_floor_s=0.1)
    assert text_frame_budget(long, "auto", tight) == math.ceil(12.5 * expected)


@pytest.mark.parametrize("name", sorted(shipped_prompt_sets()))
def test_standin_length_always_fits_inside_the_text_budget(name):
    """No stand-in request can be cut by the text budget: over every shipped prompt, the length
    rule (the expected reading time) stays below the budget, with room to spare."""
    rule = LengthRule.from_standin({"length_rule": LENGTH_RULE})
    prompts = shipped_prompt_sets()[name]
    assert len(prompts) >= 50
    for text in prompts:
        frames, budget = rule.frames_for(text), text_frame_budget(text)
        assert frames * 1.5 < budget, text
    # The rule is by characters: a Harvard sentence (~39 characters) lasts ~2.6 s.
    mean_s = np.mean([rule.frames_for(t) for t in prompts]) / 12.5
    mean_chars = np.mean([len(t) for t in prompts])
    assert mean_chars / 18 < mean_s < mean_chars / 12


def test_bad_guard_settings_are_refused():
    for bad in (dict(budget_margin=0.5), dict(repetition_match=0), dict(silence_s=0),
                dict(repetition_window=1)):  # fmt: skip
        with pytest.raises(ValueError):
            GuardConfig(**bad)


def test_metrics_list_every_stop_reason():
    from ttsbuild.serve.metrics import STOP_REASONS

    assert set(STOP_REASONS) == {r.value for r in StopReason}


# -- repetition ---------------------------------------------------------------------------
def looping_reference(codes: list[int], cfg: GuardConfig) -> list[bool]:
    """Per frame: does the history up to it loop? Straight from the definition."""
    W, P, need = cfg.repetition_window, cfg.repetition_max_period, cfg.repetition_matches
    out = []
    for t in range(len(codes)):
        hist = codes[: t + 1]
        loops = False
        for p in range(1, P + 1):
            if len(hist) < W + p:
                continue
            matches = sum(hist[-1 - i] == hist[-1 - i - p] for i in range(W))
            loops |= matches >= need
        out.append(loops)
    return out


def random_code_stream(rng, n: int, max_period: int, noise: float, vocab: int = 2048):
    """Random codes with a planted loop (random period, start, a few re-sampled codes)."""
    codes = rng.integers(0, vocab, n).tolist()
    period = int(rng.integers(1, max_period + 1))
    start = int(rng.integers(0, n // 4))
    motif = rng.integers(0, vocab, period).tolist()
    for t in range(start, n):
        clean = rng.random() >= noise
        codes[t] = motif[(t - start) % period] if clean else int(rng.integers(vocab))
    return codes


def test_repetition_detector_matches_the_reference():
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rng = np.random.default_rng(seed)
    cfg = GuardConfig(repetition_window=int(rng.integers(8, 40)),
                      repetition_max_period=int(rng.integers(4, 33)))  # fmt: skip
    B, n = 6, 160
    # Loops within and beyond the periods looked for, clean and with re-sampled codes.
    streams = [random_code_stream(rng, n, cfg.repetition_max_period, 0.0)] + [
        random_code_stream(rng, n, 40, float(rng.choice([0.0, 0.05, 0.2]))) for _ in range(B - 1)
    ]
    expected = [looping_reference(s, cfg) for s in streams]
    state = GuardState.zeros(B + 2, cfg, "cpu")
    rows = torch.tensor(rng.permutation(B + 2)[:B])  # slots in any order, some rows unused
    got = []
    for t in range(n):
        c0 = torch.tensor([s[t] for s in streams])
        got.append(push_codebook0(state, cfg, rows, c0).tolist())
    got = [list(r) for r in zip(*got, strict=True)]
    assert got == expected, f"seed {seed}"
    assert expected[0][-1] and not all(expected[0]), f"seed {seed}"  # found, and not at once


def test_a_new_request_in_a_slot_starts_with_a_clean_history():
    cfg = GuardConfig(repetition_window=10, repetition_max_period=4)
    state = GuardState.zeros(2, cfg, "cpu")
    rows = torch.tensor([1])
    for _ in range(20):
        looping = push_codebook0(state, cfg, rows, torch.tensor([7]))
    assert looping.item()
    state.reset([1])
    for _ in range(10):  # 10 < window + 1 codes: too few to call a loop
        assert not push_codebook0(state, cfg, rows, torch.tensor([7])).item()


# -- silence ------------------------------------------------------------------------------
def silence_reference(chunks: list[np.ndarray], dbfs: float) -> tuple[int, bool]:
    """(near-silent frames since the last audible one, audible frame seen) after all chunks."""
    run, heard = 0, False
    for pcm in chunks:
        for frame in pcm.reshape(-1, SAMPLES_PER_FRAME):
            loud = frame.astype(np.float64).var() >= 10 ** (dbfs / 10)
            heard |= loud
            run = 0 if loud else run + 1
    return (run if heard else 0), heard


def test_silence_detector_matches_the_reference():
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rng = np.random.default_rng(seed)
    cfg = GuardConfig()
    B = 5
    state = GuardState.zeros(B, cfg, "cpu")
    rows = torch.arange(B)
    chunks: list[list[np.ndarray]] = [[] for _ in range(B)]
    for _ in range(12):
        n = int(rng.integers(1, 5))  # frames in this codec step
        pcm = np.empty((B, n * SAMPLES_PER_FRAME), dtype=np.float32)
        for b in range(B):
            for f in range(n):
                level = rng.choice([0.3, 1e-2, 1e-4, 0.0])  # loud, -40, -80 dBFS, digital zero
                offset = rng.uniform(-0.2, 0.2)  # a DC offset alone is not sound
                frame = offset + level * rng.standard_normal(SAMPLES_PER_FRAME)
                pcm[b, f * SAMPLES_PER_FRAME : (f + 1) * SAMPLES_PER_FRAME] = frame
            chunks[b].append(pcm[b])
        observe_audio(state, cfg, rows, torch.from_numpy(pcm))
    for b in range(B):
        run, heard = silence_reference(chunks[b], cfg.silence_dbfs)
        assert (int(state.silent_frames[b]), bool(state.heard[b])) == (run, heard), f"seed {seed}"


def test_stop_codes_rank_eos_then_silence_then_repetition():
    cfg = GuardConfig(repetition_window=4, repetition_max_period=2, silence_s=0.2)  # 3 frames
    state = GuardState.zeros(4, cfg, "cpu")
    rows = torch.arange(4)
    loud = 0.5 * torch.randn(1, SAMPLES_PER_FRAME)
    quiet = 1e-4 * torch.randn(1, 3 * SAMPLES_PER_FRAME)
    for r in (0, 1):  # rows 0 and 1: speech, then three near-silent frames
        observe_audio(state, cfg, torch.tensor([r]), torch.cat([loud, quiet], 1))
    for step in range(5):  # rows 0 and 2 loop on one code; rows 1 and 3 do not
        codes = frame_stop_codes(state, cfg, rows, torch.tensor([3, 10 + step, 3, 20 + step]), EOS)
    assert codes.tolist() == [StopCode.SILENCE, StopCode.SILENCE, StopCode.REPETITION, 0]
    eos = frame_stop_codes(state, cfg, rows, torch.tensor([EOS, 5, 3, 6]), EOS)
    assert eos.tolist() == [StopCode.EOS, StopCode.SILENCE, StopCode.REPETITION, 0]
    off = GuardConfig(repetition=False, silence=False)
    assert frame_stop_codes(state, off, rows, torch.tensor([EOS, 5, 3, 6]), EOS).tolist() == [
        StopCode.EOS, 0, 0, 0]  # fmt: skip
    assert [StopCode(c).reason for c in (1, 2, 3)] == ["eos", "repetition", "silence"]
