"""The Triton kernels against their references (GPU only; skipped without CUDA/Triton)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton = pytest.importorskip("triton")

from ttsbuild.generation.sampling import SamplingBatch, apply_repetition_penalty  # noqa: E402
from ttsbuild.plugins.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
)
from ttsbuild.plugins.fp8_linear import (  # noqa: E402
    dequantize_weight_fp8,
    fp8_linear,
    quantize_weight_fp8,
)
from ttsbuild.plugins.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference  # noqa: E402
from ttsbuild.plugins.sampling import fused_sample, fused_sample_reference  # noqa: E402

DEV = "cuda"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("M", [1, 3, 8, 32, 64, 80])
@pytest.mark.parametrize("N,K", [(4096, 2048), (1024, 3072), (2048, 1024), (200, 328)])
def test_fp8_linear(M, N, K):
    g = torch.Generator(device=DEV).manual_seed(M * 7919 + N + K)
    w = torch.randn(N, K, device=DEV, generator=g) * 0.02
    q, s = quantize_weight_fp8(w)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    out.copy_(fp8_linear(x, q, s, use_triton=True))
    ref = x.float() @ dequantize_weight_fp8(q, s).t()
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2
    # twice: split-K counters reset, same bits (deterministic)
    assert torch.equal(fp8_linear(x, q, s, use_triton=True), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R", [1, 7, 64])
def test_qk_norm_rope(R, dtype):
    g = torch.Generator(device=DEV).manual_seed(R)
    Hq, Hkv, D, S, n_slots = 16, 8, 128, 4096, R + 3
    qkv = torch.randn(R, (Hq + 2 * Hkv) * D, device=DEV, generator=g).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).to(dtype)
    pos = torch.randint(0, S, (R,), device=DEV, generator=g)
    slots = torch.randperm(n_slots, device=DEV, generator=g)[:R]
    kc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).to(dtype)
    kc_ref, vc_ref = kc.float(), vc.float()
    args = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    q = qk_norm_rope(qkv, qw, kw, pos, slots, kc, vc, use_triton=True, **args)
    q_ref = qk_norm_rope_reference(
        qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref, vc_ref, **args
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(q, q_ref) < tol
    assert _rel(kc[slots, :, pos], kc_ref[slots, :, pos]) < tol
    assert torch.equal(vc[slots, :, pos].float(), vc_ref[slots, :, pos])
    # untouched cache positions are unchanged
    mask = torch.ones(n_slots, S, dtype=torch.bool, device=DEV)
    mask[slots, pos] = False
    assert torch.equal(kc.float().permute(0, 2, 1, 3)[mask], kc_ref.permute(0, 2, 1, 3)[mask])


@pytest.mark.parametrize(
    "B,S,max_len",
    [(1, 16, 16), (33, 16, 16), (1, 2048, 2048), (8, 4096, 3000), (64, 1024, 1024), (5, 300, None)],
)
def test_decode_attention(B, S, max_len):
    g = torch.Generator(device=DEV).manual_seed(B * 131 + S)
    Hq, Hkv, D = 16, 8, 128
    n_slots = B + 3
    q = torch.randn(B, Hq, D, device=DEV, generator=g).bfloat16()
    kc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).bfloat16()
    vc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).bfloat16()
    slots = torch.randperm(n_slots, device=DEV, generator=g)[:B]
    L = max_len or S
    lengths = torch.randint(1, L + 1, (B,), device=DEV, generator=g)
    lengths[0] = L
    out = decode_attention(q, kc, vc, slots, lengths, max_len, use_triton=True)
    ref = decode_attention_reference(q, kc, vc, slots, lengths, max_len, None, torch.float32)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [2048, 3072])
@pytest.mark.parametrize("penalty", [False, True])
def test_fused_sample_token_identical(V, dtype, penalty):
    g = torch.Generator(device=DEV).manual_seed(V + int(penalty))
    B, mismatches = 64, 0
    for trial in range(8):
        logits = (torch.randn(B, V, device=DEV, generator=g) * (1 + trial)).to(dtype)
        logits[0, :20] = 0.0
        logits[0, 20:40] = -0.0
        logits[1, 100:] = float("-inf")
        batch = SamplingBatch(
            do_sample=torch.rand(B, device=DEV, generator=g) < 0.85,
            temperature=0.3 + torch.rand(B, device=DEV, generator=g),
            top_k=torch.tensor([0, 1, 2, 5, 50, 64, V, V + 7], device=DEV).repeat(B // 8),
            top_p=torch.tensor([1.0, 0.95, 0.8, 1.0, 0.5, 0.99, 1.0, 0.3], device=DEV)
            .repeat(B // 8)
            .roll(trial),
            repetition_penalty=1 + torch.rand(B, device=DEV, generator=g),
        )
        seeds = torch.randint(0, 2**62, (B,), device=DEV, generator=g)
        ctr = torch.randint(0, 10**6, (B,), device=DEV, generator=g)
        hist = torch.rand(B, V, device=DEV, generator=g) < 0.1 if penalty else None
        ref = fused_sample_reference(logits, batch, seeds, ctr, hist)
        out = fused_sample(logits, batch, seeds, ctr, hist, use_triton=True)
        for r in (ref != out).nonzero().flatten().tolist():
            # the only allowed difference: a top-p cut within fp32 summation rounding
            assert batch.do_sample[r] and batch.top_p[r] < 1, f"row {r}"
            lg = logits[r].float()
            if hist is not None:
                lg = apply_repetition_penalty(lg[None], hist[r][None], batch.repetition_penalty[r])[
                    0
                ]
            gap = _top_p_gap(lg / batch.temperature[r], int(batch.top_k[r]), float(batch.top_p[r]))
            assert gap < 1e-4, f"row {r}: top-p cut {gap:.2e} from the boundary"
            mismatches += 1
    assert mismatches <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sample_top_noise_bin(dtype):
    # (seed, counter) whose noise at column 964 is the top bin (u rounds to 1.0 before the
    # clamp): the reference drew the filtered-out 964 through a NaN score, the kernel did not.
    seed, ctr, col = 2797625467267785684, 439565, 964
    g = torch.Generator(device=DEV).manual_seed(3)
    B, V = 4, 2048
    logits = torch.randn(B, V, device=DEV, generator=g).to(dtype)
    logits[:, col] = -30.0
    batch = SamplingBatch(
        do_sample=torch.ones(B, dtype=torch.bool, device=DEV),
        temperature=torch.full((B,), 0.7, device=DEV),
        top_k=torch.tensor([1, 50, 0, 0], device=DEV),
        top_p=torch.tensor([1.0, 0.5, 0.9, 1.0], device=DEV),
        repetition_penalty=torch.ones(B, device=DEV),
    )
    seeds = torch.full((B,), seed, dtype=torch.int64, device=DEV)
    ctrs = torch.full((B,), ctr, dtype=torch.int64, device=DEV)
    ref = fused_sample_reference(logits, batch, seeds, ctrs)
    out = fused_sample(logits, batch, seeds, ctrs, use_triton=True)
    assert torch.equal(out, ref)
    assert (ref != col).all()  # filtered out in rows 0-2; kept in row 3, but finite noise


def _top_p_gap(scaled: torch.Tensor, top_k: int, top_p: float) -> float:
    """Distance (float64) between 1 - top_p and the nearest cumulative mass of the kept set."""
    x = scaled.double().sort().values
    k = top_k if 0 < top_k <= len(x) else len(x)
    x = torch.where(x < x[len(x) - k], float("-inf"), x)
    cum = torch.softmax(x, 0).cumsum(0)
    return (cum - (1 - top_p)).abs().min().item()
