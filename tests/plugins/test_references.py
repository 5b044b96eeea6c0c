"""CPU checks of the plugin references (no GPU, no Triton needed); the sampler kernel's
threshold test runs the kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""

import pytest
import torch
from kernel_device import HAS_TRITON, KDEV, needs_kernel

from ttsbuild.generation.sampling import (
    SamplingBatch,
    filter_top_k_top_p,
    sample,
    uniform_noise,
)
from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.model.layers import Attention
from ttsbuild.plugins.decode_attention import decode_attention, decode_attention_reference
from ttsbuild.plugins.fp8_linear import (
    FP8_MAX,
    FP8Linear,
    dequantize_weight_fp8,
    fp8_linear,
    fp8_linear_reference,
    quantize_weight_fp8,
)
from ttsbuild.plugins.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from ttsbuild.plugins.sampling import fused_sample

CFG = DecoderStackConfig(
    hidden_size=256, intermediate_size=512, num_layers=1, num_heads=16, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
)  # fmt: skip


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantize_round_trip_bounds():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 320, generator=g) * torch.rand(96, 1, generator=g) * 0.2
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_weight_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (96,)
    assert torch.isfinite(q.float()).all()
    # each row's amax maps to the largest e4m3 value
    assert torch.allclose(q.float().abs().amax(1)[s > 1e-11], torch.full((95,), FP8_MAX))
    deq = dequantize_weight_fp8(q, s)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 * s
    bound = w.abs() * 2**-4 + s[:, None] * 2**-10 + 1e-12
    assert ((deq - w).abs() <= bound * 1.0001).all()
    assert _rel(deq, w) < 0.04
    assert (deq[3] == 0).all()


def test_fp8_linear_reference_and_module():
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(256, 192, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(192, 256, generator=g) * 0.05)
    x = torch.randn(3, 5, 256, generator=g).bfloat16()
    mod = FP8Linear.from_linear(lin)
    out = mod(x)  # CPU: the reference
    assert out.shape == (3, 5, 192) and out.dtype == torch.bfloat16
    ref = x.double() @ dequantize_weight_fp8(mod.weight, mod.scale, torch.float64).t()
    assert _rel(out, ref) < 1e-2
    assert torch.equal(fp8_linear(x, mod.weight, mod.scale), fp8_linear_reference(x, *_qs(mod)))
    # against the unquantised layer: quantisation error only
    assert _rel(out, lin(x.float())) < 0.05


def _qs(mod):
    return mod.weight, mod.scale


def _decode_inputs(seed, B=4, S=24, num_slots=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    D, Hq, Hkv = CFG.head_dim, CFG.num_heads, CFG.num_kv_heads
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    positions = torch.randint(0, S, (B,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:B]
    kc = torch.randn(num_slots, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(num_slots, Hkv, S, D, generator=g).to(dtype)
    return qkv, qw, kw, positions, slots, kc, vc


def test_qk_norm_rope_reference_matches_model_attention_fp32():
    """reference norm+rope+cache write, then reference attention + o_proj == Attention."""
    torch.manual_seed(3)
    attn = Attention(CFG).float()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    B, S, slots_n = 4, 24, 6
    _, _, _, positions, slots, kc, vc = _decode_inputs(4, B, S, slots_n)
    x = torch.randn(B, 1, CFG.hidden_size)
    kc_model, vc_model = kc.clone(), vc.clone()
    from ttsbuild.model.layers import rope_cos_sin

    cos, sin = rope_cos_sin(positions[:, None], CFG.head_dim, CFG.rope_theta, torch.float32)
    # the model attends over [0, kv_len) with a causal mask by absolute position
    kv_len = int(positions.max()) + 1
    out_model = attn(x, cos, sin, kc_model, vc_model, slots, positions[:, None], kv_len)

    with torch.no_grad():
        qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)[:, 0]
        kw = dict(num_heads=16, num_kv_heads=8, eps=CFG.rms_norm_eps, theta=CFG.rope_theta)
        q = qk_norm_rope_reference(
            qkv, attn.q_norm.weight, attn.k_norm.weight, positions, slots, kc, vc, **kw
        )
        o = decode_attention_reference(q, kc, vc, slots, positions + 1, kv_len)
        out = attn.o_proj(o.reshape(B, 1, -1))
    assert (kc - kc_model).abs().max() < 1e-6 and torch.equal(vc, vc_model)
    assert (out - out_model).abs().max() < 1e-6 * max(1.0, out_model.abs().max().item())
    # dispatcher on CPU = reference
    kc2, vc2 = kc.clone(), vc.clone()
    q2 = qk_norm_rope(qkv, attn.q_norm.weight, attn.k_norm.weight, positions, slots, kc2, vc2, **kw)
    assert torch.equal(q2, q) and torch.equal(kc2, kc)


def test_decode_attention_reference_vs_float64_softmax():
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, S = 3, 16, 8, 128, 40
    q = torch.randn(B, Hq, D, generator=g)
    kc = torch.randn(5, Hkv, S, D, generator=g)
    vc = torch.randn(5, Hkv, S, D, generator=g)
    slots = torch.tensor([4, 0, 2])
    lengths = torch.tensor([40, 1, 17])
    out = decode_attention(q, kc, vc, slots, lengths)
    for b in range(B):
        k = kc[slots[b], :, : lengths[b]].double().repeat_interleave(2, 0)  # [Hq, L, D]
        v = vc[slots[b], :, : lengths[b]].double().repeat_interleave(2, 0)
        w = torch.softmax((q[b].double()[:, None] * k).sum(-1) / D**0.5, -1)
        ref = (w[..., None] * v).sum(1)
        assert _rel(out[b], ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sample_reference_on_cpu_is_sample(dtype):
    g = torch.Generator().manual_seed(6)
    B, V = 8, 100
    logits = (torch.randn(B, V, generator=g) * 2).to(dtype)
    batch = SamplingBatch(
        do_sample=torch.tensor([True] * 6 + [False] * 2),
        temperature=0.5 + torch.rand(B, generator=g),
        top_k=torch.tensor([0, 1, 5, 50, 0, 3, 10, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 0.5, 1.0, 0.9, 1.0]),
        repetition_penalty=torch.ones(B),
    )
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    ctr = torch.randint(0, 10**6, (B,), generator=g)
    assert torch.equal(fused_sample(logits, batch, seeds, ctr), sample(logits, batch, seeds, ctr))


@needs_kernel
@pytest.mark.parametrize(("radix_bits", "early_exit", "first_try"),
                         [(1, False, False), (4, False, False), (1, True, False), (1, True, True)])
@pytest.mark.parametrize("V", [2048, 3072])
def test_fused_sample_kernel_thresholds_vs_reference(monkeypatch, radix_bits, early_exit,
                                                     first_try, V):  # fmt: skip
    """The kernel's top-k / top-p threshold searches (over the float bit patterns) against
    the reference's sort: every top_k x top_p pair, fine fp32, tied fp32 (a coarse grid),
    near-tied fp32 and bf16 logits, at random temperatures and spreads. Every row draws (fresh
    noise) from its filtered set, so a threshold off in any bit keeps or drops tokens that the
    draws then hit; the near ties (many tokens a few ulps to a few million ulps apart, at
    exact power-of-2 temperatures) put such tokens next to the thresholds at every bit.
    Every search: 4 bits per reduction, bit by bit (the default), and bit by bit stopped
    once decided (EARLY_EXIT: the ties, the near ties and bf16 put equal or adjacent keys at
    the k-th, where only the tie check or bit 32 may end it); and the unrestricted draw tried
    first (FIRST_TRY: rows of top-p 1 whose winner is in the top k skip the search, the others
    fall back to it; the count below checks that both happen). Every fourth row greedy."""
    from ttsbuild.plugins._tl import sampling as tl_sampling

    monkeypatch.setattr(tl_sampling, "_RADIX_BITS", radix_bits)
    monkeypatch.setattr(tl_sampling, "EARLY_EXIT", early_exit)
    monkeypatch.setattr(tl_sampling, "FIRST_TRY", first_try)
    g = torch.Generator().manual_seed(23 + V + radix_bits)
    first_hits = set()
    reps = 4
    ks = torch.tensor([1, 2, 50, V - 1, V, 0])
    ps = torch.tensor([0.1, 0.5, 0.9, 1.0])
    top_k, top_p = ks.repeat_interleave(len(ps)).repeat(reps), ps.repeat(len(ks) * reps)
    B = len(top_k)
    for kind in ("fp32", "ties", "near", "bf16"):
        logits = torch.randn(B, V, generator=g) * (0.5 + 4 * torch.rand(B, 1, generator=g))
        temperature = 0.3 + 1.2 * torch.rand(B, generator=g)
        if kind == "ties":
            logits = (logits * 2).round() / 2  # few distinct values: ties at both thresholds
        if kind == "near":  # a quarter of the row 0..2^23 ulps (log-uniform) below one value
            below = torch.randint(0, 2**30, (B, V), generator=g)
            below = below >> 30 - torch.randint(0, 24, (B, V), generator=g)
            top = (1 + torch.rand(B, 1, generator=g)).view(torch.int32) - below.to(torch.int32)
            near = torch.rand(B, V, generator=g) < 0.25
            logits = torch.where(near, top.view(torch.float32), logits - 2)
            temperature = 2.0 ** torch.randint(-1, 2, (B,), generator=g).float()  # exact
        logits[0, :20], logits[1, 20:40], logits[2, 64:] = 0.0, -0.0, float("-inf")
        logits = logits.to(torch.bfloat16 if kind == "bf16" else torch.float32)
        batch = SamplingBatch(
            do_sample=torch.arange(B) % 7 != 6,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=torch.ones(B),
        )
        seeds = torch.randint(0, 2**62, (B,), generator=g)
        ctr = torch.randint(0, 10**6, (B,), generator=g)
        ref = sample(logits, batch, seeds, ctr)
        if first_try:  # which sampled rows of top-p 1 the unrestricted draw decides
            scaled = logits.float() / batch.temperature[:, None]
            gumbel = -torch.log(-torch.log(uniform_noise(seeds, ctr, V)))
            unrestricted = (scaled + gumbel).argmax(-1)
            above = (scaled > scaled.gather(1, unrestricted[:, None])).sum(1)
            k_eff = torch.where((top_k <= 0) | (top_k > V), V, top_k)
            rows = batch.do_sample & (top_p >= 1)
            first_hits |= set((above[rows] < k_eff[rows]).tolist())
        out = tl_sampling.sample_triton(
            logits.to(KDEV), batch.to(KDEV), seeds.to(KDEV), ctr.to(KDEV)
        )
        out = out.cpu()
        bad = (out != ref).nonzero().flatten().tolist()
        scaled = logits.float() / batch.temperature[:, None]
        for r in bad:  # allowed only: a top-p cut within summation rounding of 1 - top_p
            kept = filter_top_k_top_p(scaled[r : r + 1], top_k[r : r + 1], torch.ones(1))[0]
            cum = torch.softmax(kept.double().sort().values, 0).cumsum(0)
            gap = (cum - (1 - float(top_p[r]))).abs().min().item()
            assert top_p[r] < 1 and gap < 1e-5, (kind, r, int(top_k[r]), float(top_p[r]))
        assert len(bad) <= 1, (kind, bad)
    assert not first_try or first_hits == {True, False}  # both the first try and its fallback


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The sampler's order keys of fp32 values, as int64 in [0, 2^32): unsigned order = float
    order, -0.0 as +0.0 (an independent restatement of the kernel's transform)."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


if HAS_TRITON:  # the kernel the threshold test runs: at module level, where Triton's JIT
    import triton  # resolves the names it calls
    import triton.language as tl

    from ttsbuild.plugins._tl.sampling import topk_threshold_early

    @triton.jit
    def _threshold_kernel(key_ptr, k_ptr, out_ptr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_V)
        key = tl.load(key_ptr + row * BLOCK_V + offs).to(tl.uint32, bitcast=True)
        t = topk_threshold_early(key, tl.load(k_ptr + row), BLOCK_V)
        tl.store(out_ptr + row, t.to(tl.int32, bitcast=True))


@needs_kernel
@pytest.mark.parametrize("V", [2048, 3072])
def test_topk_threshold_early_keeps_exactly_the_top_k(V):
    """`topk_threshold_early`'s threshold t keeps exactly the keys at or above the k-th
    largest K (sort of fp32 order keys), whichever way its search ends: fine fp32 (decided by
    the count, mostly before the tie check), bf16 and coarse grids (ties at K: the check after
    TIE_CHECK_STEP bits, or bit 32), rows whose boundary is a few ulps wide, padding beyond V,
    k from 1 to V - 1."""
    g = torch.Generator().manual_seed(V)
    block = 1 << (V - 1).bit_length()
    rows = []
    for kind in ("fp32", "bf16", "grid", "ulps"):
        x = torch.randn(48, V, generator=g) * (0.5 + 4 * torch.rand(48, 1, generator=g))
        if kind == "bf16":
            x = x.to(torch.bfloat16).float() / 0.9
        elif kind == "grid":
            x = (x * 2).round() / 2
        elif kind == "ulps":  # a third of the row within 64 ulps of 1.0
            near = torch.rand(48, V, generator=g) < 0.33
            ulps = torch.randint(0, 64, (48, V), generator=g).to(torch.int32)
            x = torch.where(near, (torch.ones(48, V).view(torch.int32) - ulps).view(torch.float32),
                            x - 3)  # fmt: skip
        rows.append(x)
    x = torch.cat(rows)
    n = x.shape[0]
    k = torch.tensor([1, 2, 50, 51, 64, V // 2, V - 1, 50], dtype=torch.int32).repeat(n // 8)
    keys = torch.zeros(n, block, dtype=torch.int64)  # padding: key 0, below every value
    keys[:, :V] = _order_keys(x)
    dev = KDEV
    out = torch.empty(n, dtype=torch.int32, device=dev)
    _threshold_kernel[(n,)](keys.to(torch.int32).to(dev), k.to(dev), out, BLOCK_V=block)
    t = out.cpu().to(torch.int64) & 0xFFFFFFFF
    kth = keys.sort(dim=1, descending=True).values.gather(1, (k.long() - 1)[:, None])[:, 0]
    kept = (keys >= t[:, None]).sum(1)
    want = (keys >= kth[:, None]).sum(1)
    assert (t <= kth).all(), "a threshold above the k-th largest key"
    assert torch.equal(kept, want), (kept - want).nonzero().flatten().tolist()[:10]
