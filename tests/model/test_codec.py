"""Codec decoder: parity with the official decoder, key layout, exact streaming, audible init."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from official import import_official  # noqa: E402

from ttsbuild.model.codec import (  # noqa: E402
    CodecConfig,
    CodecDecoder,
    CodecStream,
    audible_random_init_,
    decoder_state_shapes,
    random_codec_state,
)
from ttsbuild.model.codec_schema import (  # noqa: E402
    codec_decoder_shapes,
    codec_encoder_shapes,
    codec_shapes,
)

DATA = pathlib.Path(__file__).parent / "data"
REAL = json.loads((DATA / "speech_tokenizer-12hz.json").read_text())
STREAM_TOL = 1e-5
PARITY_TOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny convs are ~50x slower with 2 OpenMP threads on a busy 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def official_modules():
    import_official()
    modeling = importlib.import_module(
        "qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2"
    )
    configuration = importlib.import_module(
        "qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2"
    )
    return modeling, configuration


def small_config(**kw) -> CodecConfig:
    """The real structure (16 codebooks, rates 8-5-4-3 and 2-2, window 72) with narrow layers."""
    small = dict(
        latent_dim=64, codebook_dim=32, codebook_size=64, decoder_dim=64, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8,
    )
    small.update(kw)
    return dataclasses.replace(CodecConfig.from_official(REAL), **small)


def test_state(cfg: CodecConfig, seed: int) -> dict[str, torch.Tensor]:
    """Audible random weights with every bias, norm, Snake parameter and codebook usage count
    perturbed too (the generic init leaves them constant, which would hide a bug in them)."""
    state = random_codec_state(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for name, t in state.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            t.add_(0.02 * torch.randn(t.shape, generator=g))
        elif leaf in ("alpha", "beta"):
            t.add_(0.1 * torch.randn(t.shape, generator=g))
        elif leaf == "cluster_usage":
            t.copy_(0.5 + 1.5 * torch.rand(t.shape, generator=g))
        elif t.dim() == 1:  # norms, layer scales, gamma
            t.mul_(1 + 0.1 * torch.randn(t.shape, generator=g))
    return state


test_state.__test__ = False  # a helper, not a test


def our_decoder(cfg: CodecConfig, state: dict) -> CodecDecoder:
    with torch.device("meta"):  # skip the default init of ~114M parameters
        dec = CodecDecoder(cfg).eval()
    dec.load_state_dict(state, strict=True, assign=True)
    return dec


def official_decoder(cfg: CodecConfig, state: dict, attn: str):
    modeling, configuration = official_modules()
    oc = configuration.Qwen3TTSTokenizerV2DecoderConfig(**cfg.to_official())
    oc._attn_implementation = attn
    dec = modeling.Qwen3TTSTokenizerV2Decoder(oc).eval()
    dec.load_state_dict(state, strict=True)
    return dec


def rand_codes(cfg: CodecConfig, b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, t), generator=g)


def rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()


def assert_audible(wav: torch.Tensor) -> None:
    ac = wav - wav.mean(-1, keepdim=True)
    assert rms(ac) > 10 ** (-45 / 20), f"near-silent reference (AC RMS {rms(ac):.2e})"
    clipped = (wav.abs() >= 1).float().mean().item()
    assert clipped < 0.01, f"{clipped:.1%} of samples clipped"


# --------------------------------------------------------------------------------------------
# The official model with the real config (built once)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def official_real():
    core, _ = import_official()
    config = core.Qwen3TTSTokenizerV2Config(**copy.deepcopy(REAL))
    model = core.Qwen3TTSTokenizerV2Model(config).eval()
    return model


@pytest.fixture(scope="module")
def real_state():
    return test_state(CodecConfig.from_official(REAL), seed=0)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_config_from_official():
    cfg = CodecConfig.from_official(REAL)
    assert cfg.sliding_window == 72 and cfg.num_quantizers == 16 and cfg.codebook_size == 2048
    assert cfg.total_upsample == cfg.decode_upsample_rate == 1920
    assert cfg.sample_rate == 24000 and cfg.output_dim == 96
    assert CodecConfig.from_official(REAL["decoder_config"]) == cfg
    assert CodecConfig.from_official({**REAL, "decoder_config": cfg.to_official()}) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sliding_window = 10  # type: ignore[misc]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["decoder_config"].pop("head_dim"), "missing required fields.*head_dim"),
        (lambda d: d["decoder_config"].pop("sliding_window"), "sliding_window"),
        (lambda d: d["decoder_config"].update(qk_norm=True), "unknown decoder_config.*qk_norm"),
        (lambda d: d.update(extra_field=1), "unknown speech tokenizer config.*extra_field"),
        (lambda d: d.update(decode_upsample_rate=960), "decode_upsample_rate"),
        (lambda d: d["decoder_config"].update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d.update(model_type="mimi"), "model_type"),
        (lambda d: d["decoder_config"].update(num_semantic_quantizers=2), "semantic"),
    ],
)
def test_config_rejects(edit, match):
    d = copy.deepcopy(REAL)
    edit(d)
    with pytest.raises(ValueError, match=match):
        CodecConfig.from_official(d)


# --------------------------------------------------------------------------------------------
# Key layout
# --------------------------------------------------------------------------------------------


def _shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {k[len(prefix) :]: tuple(v.shape) for k, v in state.items() if k.startswith(prefix)}


def test_decoder_keys_match_official(official_real):
    official = _shapes(official_real.decoder.state_dict())
    ours = _shapes(CodecDecoder(CodecConfig.from_official(REAL)).state_dict())
    assert ours == official
    assert list(ours) == list(official)  # same order too
    assert decoder_state_shapes(REAL) == official
    assert codec_decoder_shapes(REAL) == {f"decoder.{k}": v for k, v in official.items()}


def test_schema_matches_official(official_real):
    official = _shapes(official_real.state_dict())
    enc = {k: v for k, v in official.items() if k.startswith("encoder.")}
    dec = {k: v for k, v in official.items() if k.startswith("decoder.")}
    assert codec_encoder_shapes(REAL) == enc
    assert list(codec_encoder_shapes(REAL)) == list(enc)
    assert codec_decoder_shapes(REAL) == dec
    assert codec_shapes(REAL) == official
    assert len(official) == 496


def test_schema_matches_official_variant():
    """A different encoder/decoder config: residual stacks, conv shortcuts, attention biases,
    GQA, other strides and quantizer counts all change the listing the same way."""
    core, _ = import_official()
    d = copy.deepcopy(REAL)
    e = d["encoder_config"]
    e.update(
        num_filters=8, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, codebook_dim=16,
        codebook_size=32, vector_quantization_hidden_dimension=24, num_quantizers=6,
        num_semantic_quantizers=2, num_residual_layers=2, use_conv_shortcut=True,
        attention_bias=True, upsampling_ratios=[4, 3, 2], residual_kernel_size=5,
        upsample_groups=32,  # Mimi's decoder-side upsample, built then dropped by Qwen
    )
    e.pop("frame_rate")
    d["decoder_config"].update(
        latent_dim=48, codebook_dim=24, codebook_size=32, decoder_dim=32, hidden_size=16,
        intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, attention_bias=True, num_quantizers=6,
        upsample_rates=[5, 4], upsampling_ratios=[2],
    )
    d["decode_upsample_rate"] = 40
    model = core.Qwen3TTSTokenizerV2Model(core.Qwen3TTSTokenizerV2Config(**d))
    official = _shapes(model.state_dict())
    assert codec_shapes(d) == official
    assert list(codec_encoder_shapes(d)) == [k for k in official if k.startswith("encoder.")]


# --------------------------------------------------------------------------------------------
# Parity with the official decoder
# --------------------------------------------------------------------------------------------


def test_parity_real_config(official_real, real_state):
    cfg = CodecConfig.from_official(REAL)
    official_real.decoder.load_state_dict(real_state, strict=True)
    ours = our_decoder(cfg, real_state)
    codes = rand_codes(cfg, 1, 20, seed=1)
    with torch.no_grad():
        ref = official_real.decoder(codes)
        out = ours(codes)
    assert ref.shape == out.shape == (1, 1, 20 * 1920)
    assert_audible(ref)
    err = (out - ref).abs().max().item()
    assert err <= PARITY_TOL, err


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("window", "frames"), [(8, 40), (72, 100)])
def test_parity_sliding_window(attn, window, frames):
    """Longer than the window: the exact window semantics matter. A query sees itself and the
    window - 1 previous frames (official mask: q - window < k <= q); one more or one fewer
    visible frame is measurably different."""
    cfg = small_config(sliding_window=window)
    state = test_state(cfg, seed=2)
    ref_dec, ours = official_decoder(cfg, state, attn), our_decoder(cfg, state)
    codes = rand_codes(cfg, 2, frames, seed=3)
    with torch.no_grad():
        ref = ref_dec(codes)
        out = ours(codes)
    assert_audible(ref)
    err = (out - ref).abs().max().item()
    assert err <= PARITY_TOL, err
    for wrong in (window - 1, window + 1):
        ours.pre_transformer.window = wrong
        with torch.no_grad():
            off_by_one = (ours(codes) - ref).abs().max().item()
        assert off_by_one > 100 * max(err, 1e-6), (wrong, off_by_one, err)
    ours.pre_transformer.window = window


# --------------------------------------------------------------------------------------------
# Exact incremental decoding
# --------------------------------------------------------------------------------------------


def stream_decode(dec: CodecDecoder, codes: torch.Tensor, splits: list[int]) -> torch.Tensor:
    assert sum(splits) == codes.shape[-1]
    st = CodecStream(dec, codes.shape[0])
    out, i = [], 0
    for n in splits:
        out.append(st.step(codes[..., i : i + n]))
        i += n
    return torch.cat(out, dim=-1)


@pytest.fixture(scope="module")
def small_long():
    """Window 72, 90 frames (the window wraps), batch of 2, with its full decode."""
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=4))
    codes = rand_codes(cfg, 2, 90, seed=5)
    with torch.no_grad():
        full = dec(codes)
    assert_audible(full)
    return dec, codes, full


def _random_splits(total: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    splits = []
    while sum(splits) < total:
        splits.append(min(int(torch.randint(1, 12, (1,), generator=g)), total - sum(splits)))
    return splits


@pytest.mark.parametrize(
    "splits",
    [
        [1] * 90,
        [1, 2, 4, 8, 16, 32, 27],
        [75, 1, 14],
        _random_splits(90, seed=6),
    ],
    ids=["ones", "powers", "long-first", "random"],
)
def test_stream_equals_full(small_long, splits):
    dec, codes, full = small_long
    wav = stream_decode(dec, codes, splits)
    assert wav.shape == full.shape
    err = (wav - full).abs().max().item()
    assert err <= STREAM_TOL, err


def test_stream_real_config(real_state):
    cfg = CodecConfig.from_official(REAL)
    dec = our_decoder(cfg, real_state)
    codes = rand_codes(cfg, 1, 8, seed=8)
    with torch.no_grad():
        full = dec(codes)
    assert_audible(full)
    err = (stream_decode(dec, codes, [1, 3, 4]) - full).abs().max().item()
    assert err <= STREAM_TOL, err


@pytest.mark.parametrize("window", [8, 72])
def test_stream_rows_at_different_positions(window):
    """Rows start requests at different steps (different positions, some with less than a
    window of history), one row restarts mid-batch; every row equals its own full decode."""
    cfg = small_config(sliding_window=window)
    dec = our_decoder(cfg, test_state(cfg, seed=9))
    n, steps = 2, 46  # fixed step size, as a captured graph would run
    # (row, first step, last step exclusive): row 1 serves two requests back to back.
    requests = [(0, 0, 46), (1, 3, 30), (1, 30, 46), (2, 9, 46)]
    codes = {
        (row, s, e): rand_codes(cfg, 1, (e - s) * n, seed=10 + i)
        for i, (row, s, e) in enumerate(requests)
    }
    st = CodecStream(dec, 3)
    ptrs = [t.data_ptr() for t in st.tensors()]
    shapes = [t.shape for t in st.tensors()]
    got = {r: [] for r in requests}
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        batch = torch.randint(0, cfg.codebook_size, (3, cfg.num_quantizers, n), generator=g)
        active = {}
        for r in requests:
            row, s, e = r
            if s <= step < e:
                active[row] = r
                batch[row] = codes[r][0, :, (step - s) * n : (step - s + 1) * n]
        starting = [row for row, (_, s, _) in active.items() if s == step]
        if starting:
            st.reset(starting)
        wav = st.step(batch)
        for row, r in active.items():
            got[r].append(wav[row : row + 1])
    assert [t.data_ptr() for t in st.tensors()] == ptrs  # state updated in place
    assert [t.shape for t in st.tensors()] == shapes
    assert st.pos.tolist() == [92, 32, 74]
    for r in requests:
        with torch.no_grad():
            full = dec(codes[r])
        err = (torch.cat(got[r], dim=-1) - full).abs().max().item()
        assert err <= STREAM_TOL, (r, err)


def test_stream_reset_forms():
    cfg = small_config(sliding_window=8)
    dec = our_decoder(cfg, test_state(cfg, seed=12))
    st = CodecStream(dec, 3)
    st.step(rand_codes(cfg, 3, 3, seed=13))
    assert all(t.abs().sum() > 0 for t in st.tensors())
    st.reset(torch.tensor([False, True, False]))
    assert st.pos.tolist() == [3, 0, 3]
    assert all(t[1].abs().sum() == 0 and t[0].abs().sum() > 0 for t in st.tensors())
    st.reset()
    assert all(t.abs().sum() == 0 for t in st.tensors())


# --------------------------------------------------------------------------------------------
# Audible random init
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["real", "small"])
def test_random_state_is_audible(which):
    cfg = CodecConfig.from_official(REAL) if which == "real" else small_config()
    state = random_codec_state(cfg, seed=14)
    assert {k: tuple(v.shape) for k, v in state.items()} == decoder_state_shapes(cfg)
    assert all(v.dtype == torch.float32 for v in state.values())
    dec = our_decoder(cfg, state)
    with torch.no_grad():
        wav = dec(rand_codes(cfg, 1, 8, seed=15))
    db = 20 * torch.log10(torch.tensor(rms(wav))).item()
    assert -30 < db < -3, db
    assert_audible(wav)
    if which == "small":
        again = random_codec_state(cfg, seed=14)
        assert all(torch.equal(state[k], again[k]) for k in state)  # deterministic in the seed


def test_audible_init_fixes_official_default_init():
    """The official init decodes to silence (zero codebooks); after audible_random_init_ the
    same state is audible, and the official decoder agrees with ours on it."""
    cfg = small_config(sliding_window=8)
    official = official_decoder(cfg, test_state(cfg, seed=16), "eager")
    modeling, configuration = official_modules()
    # The official init draws from the global generator: seeded here, so the test does not
    # depend on what earlier tests drew (2 of 200 unseeded draws clip > 1 % after
    # audible_random_init_, which keeps each matrix's draw; 2026-12-07 a CI run met one)
    with torch.random.fork_rng():
        torch.manual_seed(19)
        fresh = modeling.Qwen3TTSTokenizerV2Decoder(
            configuration.Qwen3TTSTokenizerV2DecoderConfig(**cfg.to_official())
        ).eval()
    state = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    codes = rand_codes(cfg, 1, 12, seed=17)
    with torch.no_grad():
        assert rms(our_decoder(cfg, state)(codes)) < 1e-6  # silent as initialised
        audible_random_init_(state, torch.Generator().manual_seed(18))
        official.load_state_dict(state, strict=True)
        ref = official(codes)
        out = our_decoder(cfg, state)(codes)
    assert_audible(ref)
    assert (out - ref).abs().max().item() <= PARITY_TOL
