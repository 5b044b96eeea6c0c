"""The folded codec equals the unfolded one; its ONNX step equals ours in onnxruntime."""

from __future__ import annotations

import torch

from ttsbuild.build.codec_fold import FoldedCodec, fold_codec_state, load_folded_codec
from ttsbuild.model.codec import CodecConfig, CodecDecoder, CodecStream


def _codec_state(ckpt):
    from ttsbuild.convert.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    state = c.tensors("codec")
    # Non-trivial folds: the stand-in has alpha = beta = 0 and cluster_usage = 1.
    gen = torch.Generator().manual_seed(0)
    for k, t in state.items():
        if k.endswith((".alpha", ".beta")):
            state[k] = 0.3 * torch.randn(t.shape, generator=gen)
        elif k.endswith("cluster_usage"):
            state[k] = 3 * torch.rand(t.shape, generator=gen)
    state[next(k for k in state if k.endswith("cluster_usage"))][:4] = 0.0  # hits the clamp
    return CodecConfig.from_official(c.codec_config), state


@torch.no_grad()
def test_folded_equals_unfolded(ckpt):
    cfg, state = _codec_state(ckpt)
    ref = CodecDecoder(cfg).eval()
    ref.load_state_dict(state)
    folded = load_folded_codec(cfg, fold_codec_state(state))
    assert isinstance(folded, FoldedCodec)
    assert not any(k.endswith(("cluster_usage", "embedding_sum", ".beta")) for k in
                   folded.state_dict())
    codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, 6),
                          generator=torch.Generator().manual_seed(1))
    codes[0, :, 0] = torch.arange(cfg.num_quantizers)  # rows whose usage was clamped
    assert (ref(codes) - folded(codes)).abs().max().item() < 1e-5
    a, b = CodecStream(ref, 2), CodecStream(folded, 2)
    for i in range(0, 6, 3):
        assert (a.step(codes[..., i:i + 3]) - b.step(codes[..., i:i + 3])).abs().max() < 1e-5


def test_onnx_step_matches_ours(fp8_engine):
    """The engine's codec.onnx, run in onnxruntime on CPU, against our CodecStream."""
    from ttsbuild.build.engine_dir import load_engine_dir
    from ttsbuild.build.onnx_codec import check_codec_onnx

    art = load_engine_dir(fp8_engine)
    onnx = art.manifest.codec.onnx
    assert onnx is not None and onnx.kind == "streaming_step"
    assert onnx.max_abs_diff_vs_torch < 1e-4
    codec = load_folded_codec(CodecConfig.from_official(art.codec_config), art.tensors("codec"))
    assert check_codec_onnx(codec, fp8_engine / onnx.file, steps=5, seed=3) < 1e-4
