"""The eager engine: batch invariance, reproducibility, exact streaming audio, stopping rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import EagerEngine, Models, NoFreeSlot, synthesize
from ttsbuild.runtime.request import RequestError, SamplingOverrides, SynthesisRequest

TEXTS = [
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


def request(i: int, **kw) -> SynthesisRequest:
    # 12 frames keep the suite fast; the length-rule test runs a request to its natural end.
    kw.setdefault("max_frames", 12)
    return SynthesisRequest(text=TEXTS[i], voice=["ryan", "vivian", "eric"][i], seed=100 + i, **kw)


def run_to_end(engine: EagerEngine, slots: list[int]) -> dict[int, list[torch.Tensor]]:
    engine.prefill(slots)
    codes: dict[int, list[torch.Tensor]] = {s: [] for s in slots}
    active = list(slots)
    while active:
        for out in engine.frames(active):
            if out.codes is not None:
                codes[out.slot].append(out.codes)
        active = [s for s in active if not engine.is_finished(s)]
    return codes


def test_batched_single_and_permuted_runs_agree(models):
    single = {}
    for i in range(3):
        engine = EagerEngine(models, num_slots=1, max_len=512)
        slot = engine.admit(request(i))
        single[i] = torch.stack(run_to_end(engine, [slot])[slot])

    for order in ([0, 1, 2], [2, 0, 1]):
        engine = EagerEngine(models, num_slots=4, max_len=512)
        slot_of = {i: engine.admit(request(i)) for i in order}
        got = run_to_end(engine, list(slot_of.values()))
        for i, slot in slot_of.items():
            assert torch.equal(torch.stack(got[slot]), single[i]), (order, i)
    # Different requests really differ (the comparison above could not pass vacuously).
    assert not torch.equal(single[0], single[1])


def test_same_seed_repeats_and_other_seeds_differ(models):
    engine = EagerEngine(models, num_slots=1, max_len=512)
    a, _ = synthesize(engine, request(0))
    b, _ = synthesize(engine, request(0))
    c, _ = synthesize(
        engine, SynthesisRequest(text=TEXTS[0], voice="ryan", seed=999, max_frames=12)
    )
    assert np.array_equal(a, b)
    assert a.shape == c.shape and not np.array_equal(a, c)


def test_streamed_audio_equals_full_decode(models):
    engine = EagerEngine(models, num_slots=1, max_len=512, keep_codes=True)
    slot = engine.admit(request(1))
    engine.prefill([slot])
    pieces, sizes = [], [1, 2, 4, 8, 3]
    while not engine.is_finished(slot):
        engine.frames([slot])
        if engine.pending_frames(slot) >= sizes[0]:
            pieces.append(engine.audio([slot], max_frames=sizes[0])[slot])
            sizes = sizes[1:] or [5]
    pieces.append(engine.audio([slot])[slot])
    streamed = np.concatenate(pieces)
    codes = engine.codes_of(slot).T[None]  # [1, 16, n]
    with torch.no_grad():
        full = models.codec(codes)[0, 0].numpy()
    assert streamed.shape == full.shape == (codes.shape[-1] * 1920,)
    assert np.abs(full).max() > 0.05  # audible: a silent codec would prove nothing
    assert np.abs(streamed - full).max() <= 1e-5


def test_standin_length_rule_sets_the_duration(models):
    rule = models.length_rule
    assert rule is not None
    engine = EagerEngine(models, num_slots=1, max_len=512)
    pcm, stats = synthesize(engine, request(2, max_frames=None))
    frames = rule.frames_for(TEXTS[2], "auto")
    assert stats == {"frames": frames, "stopped_by": "length_rule", "seed": 102}
    # 38 characters of English read at 12-18 characters per second, 12.5 frames per second.
    assert 38 / 18 * 12.5 <= frames <= 38 / 12 * 12.5
    assert pcm.shape == (stats["frames"] * 1920,)


def test_real_checkpoint_stops_at_eos_after_min_new_tokens(tiny_checkpoint):
    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    models.length_rule = None  # behave as a real checkpoint: EOS decides
    eos = models.cfg.codec_ids.eos
    with torch.no_grad():
        models.talker.codec_head.weight[eos] = models.talker.model.norm.weight * 50
    engine = EagerEngine(models, num_slots=1, max_len=512)
    _, stats = synthesize(engine, request(0))
    # EOS wins every step but is banned for the first min_new_tokens (2) frames.
    assert stats["frames"] == 2 and stats["stopped_by"] == "eos"


def test_max_frames_and_greedy_overrides(models):
    engine = EagerEngine(models, num_slots=1, max_len=512)
    greedy = SamplingOverrides(do_sample=False, subtalker_do_sample=False)
    a, stats = synthesize(engine, request(0, max_frames=5, sampling=greedy))
    assert stats["frames"] == 5
    b, _ = synthesize(
        engine, SynthesisRequest(text=TEXTS[0], voice="ryan", seed=1, max_frames=5, sampling=greedy)
    )
    assert np.array_equal(a, b)  # greedy ignores the seed


def test_bad_requests_are_refused_and_slots_are_freed(models):
    engine = EagerEngine(models, num_slots=2, max_len=512)
    with pytest.raises(RequestError, match="unknown voice"):
        engine.admit(SynthesisRequest(text="hi", voice="nobody"))
    with pytest.raises(RequestError, match="unknown language"):
        engine.admit(SynthesisRequest(text="hi", voice="ryan", language="klingon"))
    with pytest.raises(RequestError, match="voice is required"):
        engine.admit(SynthesisRequest(text="hi"))
    with pytest.raises(RequestError, match="temperature"):
        engine.admit(
            SynthesisRequest(text="hi", voice="ryan", sampling=SamplingOverrides(temperature=0.0))
        )
    with pytest.raises(RequestError, match="empty"):
        SynthesisRequest(text="   ")
    assert engine.free_slots() == 2
    a, b = engine.admit(request(0)), engine.admit(request(1))
    with pytest.raises(NoFreeSlot):
        engine.admit(request(2))
    engine.release(a)
    engine.release(b)
    assert engine.free_slots() == 2


def test_generation_params_defaults_parsed_once_and_overrides_applied(models):
    """The checkpoint's sampling is parsed once (admission path); a request without
    overrides gets it as parsed, one with overrides or a frame cap gets them, and a new
    generation_config is parsed again."""
    from ttsbuild.generation.generate import GenerationParams

    parsed = GenerationParams.from_generation_config(models.generation_config)
    plain = SynthesisRequest(text="Hello there.", voice="ryan")
    assert models.generation_params(plain) == parsed
    assert models.generation_params(plain) is models.generation_params(plain)
    over = SamplingOverrides(temperature=0.5, subtalker_top_k=7)
    p = models.generation_params(SynthesisRequest(text="Hi.", voice="ryan", sampling=over))
    assert (p.talker.temperature, p.code_predictor.top_k) == (0.5, 7)
    assert p.talker.top_k == parsed.talker.top_k and p.max_frames == parsed.max_frames
    capped = models.generation_params(SynthesisRequest(text="Hi.", voice="ryan", max_frames=9))
    assert capped.max_frames == 9 and capped.talker == parsed.talker
    old = models.generation_config
    try:
        models.generation_config = {**old, "temperature": 0.25}
        assert models.generation_params(plain).talker.temperature == 0.25
    finally:
        models.generation_config = old
    assert models.generation_params(plain) == parsed
