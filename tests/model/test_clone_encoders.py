"""Parity of the voice-clone front ends with the official code: log-mel, x-vector, codes."""

from __future__ import annotations

import copy
import json
import math
import types

import pytest
import torch
from official import import_official
from reference_models import DATA

from ttsbuild.model.codec_encoder import CodecEncoder, CodecEncoderConfig
from ttsbuild.model.speaker_encoder import (
    SpeakerEncoder,
    SpeakerEncoderConfig,
    log_mel_spectrogram,
)

SMALL_SPEAKER = {
    "enc_dim": 24,
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 16,
    "enc_res2net_scale": 4,
    "enc_se_channels": 8,
    "sample_rate": 24000,
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def speech_like(n: int, seed: int) -> torch.Tensor:
    """Fresh random audio in [-1, 1]: a few random partials plus noise, with an envelope."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64) / 24000
    f = 80 + 3000 * torch.rand(6, 1, generator=g, dtype=torch.float64)
    tone = torch.sin(2 * math.pi * f * t + 6.3 * torch.rand(6, 1, generator=g)).sum(0)
    env = 0.5 + 0.5 * torch.sin(2 * math.pi * 3 * t)
    x = env * tone / 6 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    return (0.9 * x / x.abs().max()).float()


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations through deep conv stacks; codebooks with distinct, non-unit usage."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if not p.is_floating_point():
                continue
            if name.endswith("cluster_usage"):
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("layer_scale.scale"):
                p.copy_(0.1 + 0.2 * torch.rand(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2 and "embed_sum" not in name:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------------------- log-mel + x-vector


def official_models():
    _, models = import_official()
    import qwen_tts.core.models.modeling_qwen3_tts as modeling

    return models, modeling


def test_log_mel_matches_official():
    _, modeling = official_models()
    wav = torch.stack([speech_like(24000 + 517, seed=1), speech_like(24000 + 517, seed=2)])
    expected = modeling.mel_spectrogram(
        wav, n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024,
        fmin=0, fmax=12000,
    ).transpose(1, 2)
    got = log_mel_spectrogram(wav)
    assert got.shape == expected.shape == (2, (24000 + 517) // 256, 128)
    assert rel_err(got, expected) < 1e-5


def build_speaker_pair(seed: int, dtype: torch.dtype):
    official_models()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder

    ref = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**copy.deepcopy(SMALL_SPEAKER)))
    randomize_(ref, seed)
    ours = SpeakerEncoder(SpeakerEncoderConfig.from_official({"speaker_encoder_config":
                                                              SMALL_SPEAKER}))
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref.to(dtype).eval(), ours.to(dtype).eval()


def test_speaker_encoder_matches_official_fp64():
    ref, ours = build_speaker_pair(seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    mel = torch.randn(3, 57, 128, generator=g, dtype=torch.float64) - 4
    with torch.no_grad():
        expected = ref(mel)
        got = ours(mel)
    assert got.shape == (3, SMALL_SPEAKER["enc_dim"])
    assert rel_err(got, expected) < 1e-10


def test_x_vector_from_audio_matches_official():
    """The whole path, waveform -> x-vector, through the official extract_speaker_embedding."""
    models, _ = official_models()
    ref, ours = build_speaker_pair(seed=5, dtype=torch.float32)
    wav = speech_like(3 * 24000 + 101, seed=6)
    host = types.SimpleNamespace(speaker_encoder=ref, device=torch.device("cpu"),
                                 dtype=torch.float32)
    expected = models.Qwen3TTSForConditionalGeneration.extract_speaker_embedding(
        host, wav.numpy(), 24000
    )
    got = ours.embed(wav[None])[0]
    assert rel_err(got, expected) < 1e-4


def test_speaker_config_rejects_inconsistent_channels():
    bad = dict(SMALL_SPEAKER, enc_channels=[32, 32, 32, 32, 64])
    with pytest.raises(ValueError, match="sum of the SE-Res2Net channels"):
        SpeakerEncoderConfig.from_official({"speaker_encoder_config": bad})


# ---------------------------------------------------------------------------------- codec codes


def small_tokenizer_config(sliding_window: int = 250) -> dict:
    st = json.loads((DATA / "speech_tokenizer-12hz.json").read_text())
    st["encoder_config"].update(
        num_filters=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, codebook_size=64,
        codebook_dim=16, vector_quantization_hidden_dimension=16, num_quantizers=20,
        sliding_window=sliding_window, upsample_groups=32,
    )
    st["decoder_config"].update(
        latent_dim=32, codebook_dim=16, decoder_dim=32, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        vector_quantization_hidden_dimension=16,
    )
    return st


def build_codec_pair(st: dict, seed: int, dtype: torch.dtype):
    core, _ = import_official()
    config = core.Qwen3TTSTokenizerV2Config(**copy.deepcopy(st))
    config.encoder_config._attn_implementation = "sdpa"
    config.decoder_config._attn_implementation = "sdpa"
    ref = core.Qwen3TTSTokenizerV2Model(config).eval()
    randomize_(ref.encoder, seed)
    ref = ref.to(dtype)
    ours = CodecEncoder(CodecEncoderConfig.from_official(st)).eval()
    state = {k[len("encoder."):]: v for k, v in ref.state_dict().items()
             if k.startswith("encoder.")}
    ours.load_official(state)
    return ref, ours.to(dtype)


def official_encode(ref, wav: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return ref.encode(wav, torch.ones_like(wav, dtype=torch.long)).audio_codes


@pytest.mark.parametrize("n_samples", [1920 * 9, 1920 * 9 + 777])
def test_codec_encoder_codes_match_official(n_samples):
    ref, ours = build_codec_pair(small_tokenizer_config(), seed=7, dtype=torch.float64)
    wav = torch.stack([speech_like(n_samples, seed=8), speech_like(n_samples, seed=9)])
    expected = official_encode(ref, wav.double())
    got = ours(wav)
    frames = -(-n_samples // 1920)
    assert got.shape == (2, frames, 16)
    for b in range(2):
        assert expected[b].shape == (frames, 16)
        # The reference must vary, or equality proves little.
        assert len(set(expected[b].flatten().tolist())) > 20
        assert torch.equal(got[b], expected[b])


def test_codec_encoder_attends_past_the_sliding_window():
    """A clip longer than `sliding_window` (25 Hz steps): one-shot encoding is fully causal."""
    ref, ours = build_codec_pair(small_tokenizer_config(sliding_window=4), seed=10,
                                 dtype=torch.float64)
    wav = speech_like(1920 * 12, seed=11)[None]
    assert torch.equal(ours(wav)[0], official_encode(ref, wav.double())[0])
