"""qk_norm_rope_decode_attention (the talker's decode attention in one launch): the reference
is the two unfused ops; the Triton kernel against a float32 reference on fresh random inputs
(on CUDA, or on CPU under TRITON_INTERPRET=1)."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.decode_attention import (
    decode_attention_reference,
    qk_norm_rope_decode_attention,
)
from ttsbuild.plugins.qk_norm_rope import qk_norm_rope_reference

# The interpreter rounds fp32 -> bf16 by truncation: a few biased roundings per output.
BF16_TOL = 1e-2 if KDEV == "cuda" else 4e-2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _case(seed: int, R: int, S: int, dtype, Hq=4, Hkv=2, D=32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    n_slots = R + 3
    qkv = torch.randn(R, (Hq + 2 * Hkv) * D, device=device, generator=g).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=device, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=device, generator=g)).to(dtype)
    pos = torch.randint(0, S, (R,), device=device, generator=g)
    pos[0] = S - 1  # the last position; below, the first (attends to itself only)
    if R > 1:
        pos[1] = 0
    slots = torch.randperm(n_slots, device=device, generator=g)[:R]
    kc = torch.randn(n_slots, Hkv, S, D, device=device, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, device=device, generator=g).to(dtype)
    return qkv, qw, kw, pos, slots, kc, vc, dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6,
                                                 theta=1e6)  # fmt: skip


def test_reference_is_the_two_ops():
    qkv, qw, kw, pos, slots, kc, vc, a = _case(1, 3, 40, torch.float32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = qk_norm_rope_decode_attention(qkv, qw, kw, pos, slots, kc, vc, 40, use_triton=False,
                                        **a)  # fmt: skip
    q = qk_norm_rope_reference(qkv, qw, kw, pos, slots, kc2, vc2, **a)
    ref = decode_attention_reference(q, kc2, vc2, slots, pos + 1, 40).reshape(3, -1)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,S,splits,dynamic", [
    (1, 16, None, False), (1, 300, None, False), (3, 100, 1, False), (5, 300, 3, False),
    (2, 300, 7, False), (5, 300, 3, True), (4, 300, 7, True), (1, 300, None, True),
])  # fmt: skip
def test_kernel_against_reference(R, S, splits, dynamic, dtype):
    """dynamic: the splits divide each row's pos + 1 positions (DYNAMIC_CHUNK), rows at the
    cache's last position, at its first and in between."""
    from ttsbuild.plugins._tl.decode_attention import qk_norm_rope_decode_attention_triton
    from ttsbuild.plugins.qk_norm_rope import inv_freq

    qkv, qw, kw, pos, slots, kc, vc, a = _case(R * 7 + S, R, S, dtype, device=KDEV)
    for call in range(2):  # the second call finds the counters reset by the first
        if call:
            pos = (pos + 1 + torch.arange(R, device=KDEV)) % S
            qkv = torch.randn_like(qkv.float()).to(dtype)
        kc_ref, vc_ref = kc.float(), vc.float()
        theta = a["theta"]
        kwargs = {k: v for k, v in a.items() if k != "theta"}
        out = qk_norm_rope_decode_attention_triton(
            qkv, qw, kw, inv_freq(32, theta, qkv.device), pos, slots, kc, vc, S,
            scale=32**-0.5, splits=splits, dynamic_chunk=dynamic, **kwargs,
        )  # fmt: skip
        q = qk_norm_rope_reference(qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref,
                                   vc_ref, **a)  # fmt: skip
        ref = decode_attention_reference(q, kc_ref, vc_ref, slots, pos + 1, S).reshape(R, -1)
        tol = 2e-5 if dtype == torch.float32 else BF16_TOL
        assert out.shape == (R, 4 * 32) and out.dtype == dtype
        assert _rel(out, ref) < tol, call
        assert _rel(kc[slots, :, pos], kc_ref[slots, :, pos]) < tol
        assert torch.equal(vc[slots, :, pos].float(), vc_ref[slots, :, pos])
        untouched = torch.ones(R + 3, S, dtype=torch.bool, device=KDEV)
        untouched[slots, pos] = False
        for c, c_ref in ((kc, kc_ref), (vc, vc_ref)):
            assert torch.equal(
                c.float().transpose(1, 2)[untouched], c_ref.transpose(1, 2)[untouched]
            )


@needs_kernel
def test_public_op_takes_the_kernel():
    qkv, qw, kw, pos, slots, kc, vc, a = _case(5, 2, 200, torch.float32, device=KDEV)
    kc2, vc2 = kc.clone(), vc.clone()
    out = qk_norm_rope_decode_attention(qkv, qw, kw, pos, slots, kc, vc, 200, use_triton=True,
                                        **a)  # fmt: skip
    ref = qk_norm_rope_decode_attention(qkv, qw, kw, pos, slots, kc2, vc2, 200,
                                        use_triton=False, **a)  # fmt: skip
    assert _rel(out, ref) < 2e-5 and _rel(kc, kc2) < 2e-5
