"""Greedy codes of both voice-clone modes against the official `generate` (fp64, 32 frames)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from reference_models import build_pair, small_config
from test_clone_encoders import SMALL_SPEAKER
from test_talker_parity import (
    ASSISTANT,
    FRAMES,
    GREEDY,
    IM_END,
    IM_START,
    NEWLINE,
    random_text,
    template_ids,
)

from ttsbuild.generation.generate import ReferenceModel, generate_codes
from ttsbuild.generation.prompt import PromptSpec, VoiceClone, build_prompt


def reference_ids(body: list[int]) -> list[int]:
    return [IM_START, ASSISTANT, NEWLINE, *body, IM_END, NEWLINE]


def base_config() -> dict:
    cfg = small_config("1.7b-base")
    cfg["speaker_encoder_config"] = dict(SMALL_SPEAKER, enc_dim=cfg["talker_config"]["hidden_size"])
    return cfg


@pytest.fixture(scope="module")
def pair():
    return build_pair(base_config(), seed=11)


def make_clone(hidden: int, ref_frames: int | None, ref_tokens: int, seed: int) -> VoiceClone:
    g = torch.Generator().manual_seed(seed)
    x_vector = torch.randn(hidden, generator=g, dtype=torch.float64)
    if ref_frames is None:
        return VoiceClone(x_vector)
    codes = torch.randint(0, 2048, (ref_frames, 16), generator=g)
    return VoiceClone(x_vector, codes, reference_ids(random_text(ref_tokens, seed=seed + 1)))


def official_clone_codes(official, spec: PromptSpec, frames: int) -> torch.Tensor:
    clone = spec.clone
    icl = clone.in_context
    codes, _ = official.generate(
        input_ids=[torch.tensor([spec.text_ids])],
        ref_ids=[torch.tensor([clone.ref_text_ids])] if icl else None,
        voice_clone_prompt={
            "ref_code": [clone.ref_codes if icl else None],
            "ref_spk_embedding": [clone.x_vector],
            "x_vector_only_mode": [not icl],
            "icl_mode": [icl],
        },
        languages=[spec.language],
        non_streaming_mode=spec.non_streaming,
        max_new_tokens=frames + 1,
        do_sample=False,
        subtalker_dosample=False,
        repetition_penalty=1.05,
    )
    return codes[0]


def our_codes(talker, cp, spec: PromptSpec, frames: int) -> torch.Tensor:
    model = ReferenceModel(talker, cp, num_slots=1, max_len=256)
    prompt = build_prompt(talker, spec, cp)
    params = replace(GREEDY, max_frames=frames)
    return generate_codes(model, [prompt], [params], seeds=[0])[0].codes


# (language, non_streaming, reference frames (None: x-vector only), reference text tokens)
CASES = {
    "xvec-english-streaming": ("english", False, None, 0),
    "xvec-auto-nonstreaming": ("auto", True, None, 0),
    "icl-streaming-text-longer": ("english", False, 6, 24),
    "icl-streaming-codes-longer": ("auto", False, 30, 5),
    "icl-nonstreaming": ("german", True, 12, 9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clone_greedy_codes_match_official(pair, case):
    official, talker, cp = pair
    language, non_streaming, ref_frames, ref_tokens = CASES[case]
    spec = PromptSpec(
        text_ids=template_ids(random_text(12, seed=len(case))),
        language=language,
        non_streaming=non_streaming,
        clone=make_clone(talker.cfg.talker.hidden_size, ref_frames, ref_tokens, seed=len(case)),
    )
    expected = official_clone_codes(official, spec, FRAMES)
    got = our_codes(talker, cp, spec, FRAMES)
    assert expected.shape == (FRAMES, 16)
    assert len(set(expected[:, 0].tolist())) > 5
    assert torch.equal(got, expected)


def test_the_voice_changes_the_output(pair):
    """Both the x-vector and the reference codes must reach the talker."""
    _, talker, cp = pair
    hidden = talker.cfg.talker.hidden_size
    text = template_ids(random_text(12, seed=3))
    base = make_clone(hidden, 10, 8, seed=4)
    other_x = VoiceClone(make_clone(hidden, None, 0, seed=5).x_vector, base.ref_codes,
                         base.ref_text_ids)
    other_codes = VoiceClone(base.x_vector, (base.ref_codes + 1) % 2048, base.ref_text_ids)
    runs = [our_codes(talker, cp, PromptSpec(text, language="english", non_streaming=False,
                                             clone=c), 8)
            for c in (base, other_x, other_codes)]
    assert not torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_shared_prefix_depends_only_on_the_voice(pair):
    """The first shared_prefix_len positions are the same for any text; the next one is not."""
    _, talker, cp = pair
    clone = make_clone(talker.cfg.talker.hidden_size, 20, 7, seed=6)
    prompts = [
        build_prompt(talker, PromptSpec(template_ids(random_text(n, seed=n)), language="english",
                                        non_streaming=False, clone=clone), cp)
        for n in (5, 9)
    ]
    n = prompts[0].shared_prefix_len
    assert n == prompts[1].shared_prefix_len == 3 + 6 + 7  # role, codec prefix, ref text
    assert torch.equal(prompts[0].embeds[:n], prompts[1].embeds[:n])
    assert not torch.equal(prompts[0].embeds[n], prompts[1].embeds[n])
    assert torch.equal(prompts[0].codec_context, clone.ref_codes)
    non_streaming = [
        build_prompt(talker, PromptSpec(template_ids(random_text(n, seed=n)), language="english",
                                        non_streaming=True, clone=clone), cp)
        for n in (5, 9)
    ]
    n = non_streaming[0].shared_prefix_len
    assert n == 3 + 6 + 7
    assert torch.equal(non_streaming[0].embeds[:n], non_streaming[1].embeds[:n])
    assert not torch.equal(non_streaming[0].embeds[n], non_streaming[1].embeds[n])
