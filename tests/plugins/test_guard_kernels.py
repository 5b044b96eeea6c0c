"""The device guards in one launch each: the kernels (CUDA, or CPU under TRITON_INTERPRET=1)
give the reference's stop codes and leave the same guard state, step after step from the
same random state, with padding rows on a scratch slot and every guard switch."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.generation.guards import (
    SAMPLES_PER_FRAME,
    GuardConfig,
    GuardState,
    StopCode,
    frame_stop_codes,
    observe_audio,
)

EOS = 2150
VOCAB = 2048
FIELDS = ("recent_c0", "frames_seen", "silent_frames", "heard")


def _random_state(S, cfg, g, device) -> GuardState:
    """Guard state mid-generation: rings of codes from a small alphabet (partial matches),
    some rows already looping, counters below and above the thresholds."""
    state = GuardState.zeros(S, cfg, device)
    R = state.recent_c0.shape[1]
    ring = torch.randint(0, 4, (S, R), generator=g)
    for s in range(0, S, 3):  # a loop of period 1..3 already in the ring
        ring[s] = ring[s, : s % 3 + 1].repeat(R)[:R]
    state.recent_c0.copy_(ring)
    state.frames_seen.copy_(torch.randint(0, 2 * R, (S,), generator=g))
    state.silent_frames.copy_(torch.randint(0, 2 * cfg.silence_frames, (S,), generator=g))
    state.heard.copy_(torch.rand(S, generator=g) < 0.5)
    return state


def _clone(state: GuardState) -> GuardState:
    return GuardState(**{k: v.clone() for k, v in vars(state).items()})


def _code_streams(B, steps, cfg, g) -> torch.Tensor:
    """[steps, B] codebook-0 codes: loops of several periods (some beyond max_period, some
    with re-sampled codes), random codes, and EOS now and then."""
    periods = [1, 2, cfg.repetition_max_period, cfg.repetition_max_period + 3, 3]
    out = torch.randint(0, VOCAB, (steps, B), generator=g)
    for b in range(B):
        if b % 2 == 0:  # odd rows stay random
            p = periods[(b // 2) % len(periods)]
            start = int(torch.randint(0, steps // 3, (), generator=g))
            phrase = torch.randint(0, VOCAB, (p,), generator=g)
            t = torch.arange(start, steps)
            out[start:, b] = phrase[(t - start) % p]
            if b % 4 == 2:  # a few re-sampled codes inside the loop
                noise = torch.rand(steps - start, generator=g) < 0.05
                out[start:, b] = torch.where(
                    noise, torch.randint(0, VOCAB, (steps - start,), generator=g), out[start:, b]
                )
    out[torch.rand(steps, B, generator=g) < 0.03] = EOS
    return out


def _pcm(B, n, g, device) -> torch.Tensor:
    """[B, n * 1920] frames of speech (-10 dBFS), quiet sound (-40 dBFS), 3 dB either side of
    the -50 dBFS threshold (30 standard errors of a 1920-sample variance away from it), near
    silence (-80 dBFS) and digital zero, each on a DC offset; a slice of a wider buffer (row
    stride > n * 1920), as the engine's pcm_out[:b, :n * 1920]."""
    dbfs = torch.tensor([-10.0, -40.0, -47.0, -53.0, -80.0, -1000.0])
    level = 10 ** (dbfs / 20)[torch.randint(0, 6, (B, n, 1), generator=g)]
    offset = 0.4 * torch.rand(B, n, 1, generator=g) - 0.2
    frames = offset + level * torch.randn(B, n, SAMPLES_PER_FRAME, generator=g)
    buf = torch.zeros(B, (n + 1) * SAMPLES_PER_FRAME)
    buf[:, : n * SAMPLES_PER_FRAME] = frames.reshape(B, -1)
    return buf.to(device)[:, : n * SAMPLES_PER_FRAME]


CONFIGS = {
    "small": dict(repetition_window=12, repetition_max_period=5, repetition_match=0.8,
                  silence_s=0.4),
    "default": dict(silence_s=0.4),
    "no repetition": dict(repetition_window=12, repetition_max_period=5, repetition=False,
                          silence_s=0.4),
    "no silence": dict(repetition_window=12, repetition_max_period=5, silence=False),
    "off": dict(repetition=False, silence=False),
}  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernels_equal_reference_over_steps(name):
    cfg = GuardConfig(**CONFIGS[name])
    g = torch.Generator().manual_seed(len(name))
    B_real, pad, S = 10, 3, 14  # slots 0..12 for requests, 13 the scratch slot
    scratch = S - 1
    slots = torch.randperm(S - 1, generator=g)[:B_real]
    rows = torch.cat([slots, torch.full((pad,), scratch)]).to(KDEV)
    ref = _random_state(S, cfg, g, KDEV)
    ker = _clone(ref)
    steps = 2 * (cfg.repetition_window + cfg.repetition_max_period)
    codes = _code_streams(B_real + pad, steps, cfg, g).to(KDEV)
    seen = set()
    for step in range(steps):
        want = frame_stop_codes(ref, cfg, rows, codes[step], EOS, use_triton=False)
        got = frame_stop_codes(ker, cfg, rows, codes[step], EOS, use_triton=True)
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got[:B_real], want[:B_real]), f"step {step}"
        seen |= set(want[:B_real].tolist())
        if step % 2 == 0 and cfg.silence:  # a codec step of 1..3 frames every other frame
            pcm = _pcm(B_real + pad, 1 + step % 3, g, KDEV)
            observe_audio(ref, cfg, rows, pcm, use_triton=False)
            observe_audio(ker, cfg, rows, pcm, use_triton=True)
        for f in FIELDS:  # every slot but the scratch slot (garbage nobody reads)
            assert torch.equal(getattr(ker, f)[:scratch], getattr(ref, f)[:scratch]), (step, f)
    expected = {StopCode.CONTINUE, StopCode.EOS}
    expected |= {StopCode.REPETITION} if cfg.repetition else set()
    expected |= {StopCode.SILENCE} if cfg.silence else set()
    assert seen == expected  # every outcome the switches allow happened


@needs_kernel
def test_without_state_only_eos_stops():
    cfg = GuardConfig()
    c0 = torch.tensor([EOS, 5, EOS, 0], device=KDEV)
    rows = torch.arange(4, device=KDEV)
    want = frame_stop_codes(None, cfg, rows, c0, EOS, use_triton=False)
    assert torch.equal(frame_stop_codes(None, cfg, rows, c0, EOS, use_triton=True), want)


@needs_kernel
@pytest.mark.parametrize("n", [1, 4])
def test_observe_audio_alone(n):
    """The audio kernel by itself on a fresh state and a random one (rows in any order)."""
    cfg = GuardConfig(silence_s=0.4)
    g = torch.Generator().manual_seed(n)
    for ref in (GuardState.zeros(9, cfg, KDEV), _random_state(9, cfg, g, KDEV)):
        ker = _clone(ref)
        rows = torch.randperm(9, generator=g)[:7].to(KDEV)
        for _ in range(4):
            pcm = _pcm(7, n, g, KDEV)
            observe_audio(ref, cfg, rows, pcm, use_triton=False)
            observe_audio(ker, cfg, rows, pcm, use_triton=True)
            for f in FIELDS:
                assert torch.equal(getattr(ker, f), getattr(ref, f)), f
