"""plugins.prefill_attention: a prefill layer's attention in one launch against the per-token
reference (qk_norm_rope, then a decode-attention query per token), fresh random inputs:
rows with and without a cached prefix, padding past the cache's end, GQA groups of 1, 2, 4."""

import pytest
import torch
from kernel_device import KDEV, kernel_cases, needs_kernel

from ttsbuild.plugins.prefill_attention import prefill_attention

CASES = [  # (Hq, Hkv, D, T, with a prefix, dtype)
    (4, 2, 32, 8, True, torch.float32),
    (4, 2, 32, 37, True, torch.bfloat16),
    (16, 8, 128, 32, True, torch.bfloat16),
    (16, 8, 128, 64, False, torch.float32),
    (4, 1, 64, 20, True, torch.float32),
    (8, 8, 32, 40, False, torch.bfloat16),
]
INTERPRETED = [CASES[0], CASES[1], CASES[3], CASES[4], CASES[5]]


def _inputs(Hq, Hkv, D, T, prefix, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, n_slots, S = 3, 5, T + 24
    qkv = (torch.randn(B * T, (Hq + 2 * Hkv) * D, generator=g) * 2).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    kc = torch.randn(n_slots, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4])
    # a row near the cache's end: its padding tokens clamp to the last position
    start = torch.tensor([0, 17, S - T + 5]) if prefix else None
    return qkv, qw, kw, start, slots, kc, vc


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_kernel
@pytest.mark.parametrize("Hq,Hkv,D,T,prefix,dtype", kernel_cases(CASES, INTERPRETED))
def test_prefill_attention_kernel_matches_the_reference(Hq, Hkv, D, T, prefix, dtype,
                                                        monkeypatch):  # fmt: skip
    qkv, qw, kw, start, slots, kc, vc = _inputs(Hq, Hkv, D, T, prefix, dtype, seed=Hq + D + T)
    args = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    kc_dev, vc_dev = kc.to(KDEV), vc.to(KDEV)
    dev_start = None if start is None else start.to(KDEV)
    out = prefill_attention(qkv.to(KDEV), qw.to(KDEV), kw.to(KDEV), dev_start, slots.to(KDEV),
                            kc_dev, vc_dev, T, use_triton=True, **args).cpu()  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference: CPU, float32
    kc_ref, vc_ref = kc.float(), vc.float()
    ref = prefill_attention(qkv.float(), qw.float(), kw.float(), start, slots, kc_ref, vc_ref, T,
                            use_triton=False, **args)  # fmt: skip
    B, S = slots.shape[0], kc.shape[2]
    # tokens before the cache's last position: the padding tokens of the row near the end
    # all write that position (the reference's last write wins, the kernel's is any)
    real = torch.ones(B, T, dtype=torch.bool)
    if start is not None:
        real = (start[:, None] + torch.arange(T)) < S - 1
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    got, want = out.reshape(B, T, -1)[real], ref.reshape(B, T, -1)[real]
    assert out.dtype == dtype and _rel(got, want) < tol, _rel(got, want)
    # the caches: every real token's k/v written, nothing else touched
    for name, got_c, want_c, before in (("k", kc_dev, kc_ref, kc), ("v", vc_dev, vc_ref, vc)):
        written = torch.zeros_like(before, dtype=torch.bool)
        for b in range(B):
            s0 = 0 if start is None else int(start[b])
            written[slots[b], :, s0 : min(s0 + T, S - 1)] = True
        assert _rel(got_c.cpu()[written], want_c[written]) < tol, name
        untouched = ~written
        untouched[:, :, S - 1] = False  # the padding's position (see above)
        assert torch.equal(got_c.cpu()[untouched], before[untouched]), name
    if start is not None:  # the check sees a prefix ignored: attend the new tokens only
        ref_none = prefill_attention(qkv.float(), qw.float(), kw.float(), None, slots,
                                     kc.float().clone(), vc.float().clone(), T, use_triton=False,
                                     **args).reshape(B, T, -1)  # fmt: skip
        assert _rel(ref_none[1], ref.reshape(B, T, -1)[1]) > 10 * tol


def test_prefill_attention_refuses_a_shape_that_does_not_fit():
    qkv, qw, kw, start, slots, kc, vc = _inputs(4, 2, 32, 8, True, torch.float32, 0)
    with pytest.raises(ValueError, match="rows x"):
        prefill_attention(qkv[:-1], qw, kw, start, slots, kc, vc, 8, num_heads=4,
                          num_kv_heads=2, eps=1e-6, theta=1e6)  # fmt: skip
