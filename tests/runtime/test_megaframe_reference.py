"""The one-kernel code-predictor frame (benchmarks/kernels/megapass/) is checked on the GPU
against `bench_megaframe.reference`, a float32 model of its math on its own tensor layout.
Here that reference, on tensors packed from our code predictor (`bench_megaframe.pack`), is
checked against the official Qwen3-TTS code predictor on random weights: so the kernel's
layout and math (qkv and gate/up concatenation, the folded codebook tables, the projected
inputs, RoPE, q/k norms, GQA, one head a codebook) are the model's, not only the kernel's."""

import torch
from helpers_scripts import script_fixture
from reference_models import build_pair, small_config

bench = script_fixture("benchmarks/kernels/megapass/bench_megaframe.py")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _frame(seed: int):
    official, talker, cp = build_pair(small_config(), seed=seed, dtype=torch.float32)
    cfg = talker.cfg
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(1, 1, cfg.talker.hidden_size, generator=g)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_code_groups), generator=g)
    with torch.no_grad():
        embeds = [hidden, talker.embed_codec(codes[:, :1])]
        embeds += [cp.embed_codes(i, codes[:, i:i + 1]) for i in range(1, cfg.num_code_groups - 1)]
        official_logits = official.talker.code_predictor.forward_finetune(
            inputs_embeds=torch.cat(embeds, 1)).logits[0]  # [15, V]: head i on position i + 1
    inputs = torch.cat(embeds[:2], 1)[0]  # [2, talker hidden]
    return cp, inputs, codes[0, 1:cfg.num_code_groups - 1], official_logits


def test_reference_is_the_official_code_predictor(bench):
    cp, inputs, tokens, official_logits = _frame(seed=11)
    m = bench.pack(cp, inputs, fp8=False)
    eps = cp.cfg.code_predictor.rms_norm_eps
    logits, kc, vc = bench.reference(m, tokens, eps=eps)
    assert logits.shape == official_logits.shape == (15, cp.cfg.codebook_size)
    for i in range(15):  # every codebook's logits, each on its own
        assert rel_err(logits[i], official_logits[i]) < 1e-4, i
    # the caches were written for every position of the frame (a pass that skipped its row
    # would leave zeros there)
    assert bool((kc.abs().sum(-1) > 0).all()) and bool((vc.abs().sum(-1) > 0).all())


def test_fp8_pack_dequantises_to_the_weights(bench):
    cp, inputs, tokens, official_logits = _frame(seed=12)
    exact, fp8 = bench.pack(cp, inputs, fp8=False), bench.pack(cp, inputs, fp8=True)
    for k in ("qkv", "o", "gu", "d", "head"):
        assert fp8["w" + k].dtype == torch.float8_e4m3fn
        deq = fp8["w" + k].float() * fp8["s" + k][..., None]
        err = rel_err(deq, exact["w" + k])
        assert 1e-4 < err < 0.05, (k, err)  # e4m3: ~2-3% per weight; zero would mean no rounding
    logits, _, _ = bench.reference(fp8, tokens, eps=cp.cfg.code_predictor.rms_norm_eps)
    err = rel_err(logits, official_logits)
    assert 1e-4 < err < 0.1, err
