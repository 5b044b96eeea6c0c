"""Dump and dissect the fused sampler's mismatches of test_fused_sample_token_identical.

Replays the test's random stream (same generator, same order of draws) for the given V /
penalty / dtypes, and for every row where `fused_sample` differs from the reference prints
the reference's kept set, the kernel's intermediates (a debug copy of the kernel that also
stores keep/score/thresholds), an emulation of the kernel's threshold search in torch, and
saves everything to OUT/sampler_rows.pt.

    PYTHONPATH=. python3 benchmarks/kernels/debug_sampler.py --out DIR
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from ttsbuild.generation.sampling import SamplingBatch, filter_top_k_top_p, uniform_noise
from ttsbuild.plugins._tl._math import exp_f32
from ttsbuild.plugins.sampling import fused_sample, fused_sample_reference


@triton.jit
def _debug_kernel(
    logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, keep_ptr, score_ptr, e_ptr,
    scal_ptr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # the threshold part of _sample_kernel (no penalty), storing its intermediates
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    vmask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=vmask, other=float("-inf"))
    x = x.to(tl.float32)
    temp = tl.load(temp_ptr + row)
    scaled = tl.math.div_rn(x, temp + tl.zeros_like(x))
    scaled = tl.where(scaled == 0.0, 0.0, scaled)
    bits = scaled.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = tl.where(vmask, key, 0)
    k = tl.load(topk_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    kth = tl.zeros((), tl.uint32)
    if k < V:
        for i in tl.static_range(32):
            cand = kth | (1 << (31 - i))
            cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
            kth = tl.where(cnt >= k, cand, kth)
    keep = vmask & (key >= kth)
    top_p = tl.load(topp_ptr + row)
    total = tl.zeros((), tl.float32)
    cut = tl.zeros((), tl.uint32)
    kmax = tl.zeros((), tl.uint32)
    e = tl.zeros((BLOCK_V,), tl.float32)
    if top_p < 1.0:
        z = tl.where(keep, scaled, float("-inf"))
        zmax = tl.max(z, axis=0)
        e = tl.where(keep, exp_f32(z - zmax), 0.0)
        total = tl.sum(e, axis=0)
        budget = 1.0 - top_p
        kmax = tl.max(tl.where(keep, key, 0), axis=0)
        for i in tl.static_range(32):
            cand = cut | (1 << (31 - i))
            mass = tl.sum(tl.where(key <= cand, e, 0.0), axis=0) / total
            cut = tl.where(mass <= budget, cand, cut)
        keep = keep & ((key > cut) | (key == kmax))
    base = row.to(tl.int64) * BLOCK_V
    tl.store(keep_ptr + base + offs, keep.to(tl.int8))
    tl.store(score_ptr + base + offs, scaled)
    tl.store(e_ptr + base + offs, e)
    tl.store(scal_ptr + row * 4 + 0, kth.to(tl.int64))
    tl.store(scal_ptr + row * 4 + 1, cut.to(tl.int64))
    tl.store(scal_ptr + row * 4 + 2, kmax.to(tl.int64))
    tl.store(scal_ptr + row * 4 + 3, total.to(tl.int32, bitcast=True).to(tl.int64))


def _keys(scaled: torch.Tensor) -> torch.Tensor:
    s = torch.where(scaled == 0, torch.zeros_like(scaled), scaled)
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >> 31 != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def emulate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The kernel's algorithm in torch (fp32 sums, exact key search): kept mask [V]."""
    V = scaled.numel()
    key = _keys(scaled)
    k = top_k if 0 < top_k <= V else V
    kth = 0
    if k < V:
        for i in range(32):
            cand = kth | (1 << (31 - i))
            if int((key >= cand).sum()) >= k:
                kth = cand
    keep = key >= kth
    if top_p < 1.0:
        z = torch.where(keep, scaled, torch.full_like(scaled, float("-inf")))
        e = torch.where(keep, torch.exp(z - z.max()), torch.zeros_like(z))
        total = e.sum()
        budget = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(top_p, dtype=torch.float32)
        kmax = int(torch.where(keep, key, torch.zeros_like(key)).max())
        cut = 0
        for i in range(32):
            cand = cut | (1 << (31 - i))
            if torch.where(key <= cand, e, torch.zeros_like(e)).sum() / total <= budget:
                cut = cand
        keep = keep & ((key > cut) | (key == kmax))
    return keep


def dissect(tag, logits, batch, seeds, ctr, r, out_rows):
    V = logits.shape[1]
    lg = logits[r : r + 1]
    sub = SamplingBatch(*(getattr(batch, f)[r : r + 1] for f in batch.__dataclass_fields__))
    temp = float(batch.temperature[r])
    top_k, top_p = int(batch.top_k[r]), float(batch.top_p[r])
    scaled = lg.float() / batch.temperature[r : r + 1, None]
    filt = filter_top_k_top_p(scaled, batch.top_k[r : r + 1], batch.top_p[r : r + 1])
    keep_ref = torch.isfinite(filt)[0]
    block = triton.next_power_of_2(V)
    keep = torch.zeros(1, block, dtype=torch.int8, device=lg.device)
    score = torch.zeros(1, block, device=lg.device)
    e = torch.zeros(1, block, device=lg.device)
    scal = torch.zeros(1, 4, dtype=torch.int64, device=lg.device)
    _debug_kernel[(1,)](
        lg, lg.stride(0), V, sub.temperature.float(), sub.top_k, sub.top_p.float(),
        keep, score, e, scal, BLOCK_V=block, num_warps=8,
    )  # fmt: skip
    keep_k = keep[0, :V].bool()
    keep_emu = emulate(scaled[0].cpu(), top_k, top_p).to(lg.device)
    alone = fused_sample(lg, sub, seeds[r : r + 1], ctr[r : r + 1], use_triton=True)
    ref_alone = fused_sample_reference(lg, sub, seeds[r : r + 1], ctr[r : r + 1])
    gumbel = -torch.log(-torch.log(uniform_noise(seeds[r : r + 1], ctr[r : r + 1], V)))[0]
    sc_ref = torch.where(keep_ref, scaled[0], float("-inf")) + gumbel
    sc_k = torch.where(keep_k, scaled[0], float("-inf")) + gumbel
    print(
        f"[{tag}] row {r}: temp {temp:.6f} top_k {top_k} top_p {top_p:.4f}; kept ref "
        f"{int(keep_ref.sum())} kernel {int(keep_k.sum())} emulated {int(keep_emu.sum())}; "
        f"scaled identical {torch.equal(score[0, :V], scaled[0])}; "
        f"kth {int(scal[0, 0]):#x} cut {int(scal[0, 1]):#x} kmax {int(scal[0, 2]):#x}; "
        f"alone: kernel {int(alone)} ref {int(ref_alone)}; argmax ref-set {int(sc_ref.argmax())}"
        f" kernel-set {int(sc_k.argmax())}",
        flush=True,
    )
    diff = (keep_ref != keep_k).nonzero().flatten().tolist()
    for j in diff[:20]:
        print(f"    idx {j}: scaled {float(scaled[0, j])!r} ref {bool(keep_ref[j])} "
              f"kernel {bool(keep_k[j])} emu {bool(keep_emu[j])}")  # fmt: skip
    x64 = scaled[0].double().sort().values
    k = top_k if 0 < top_k <= V else V
    x64 = torch.where(x64 < x64[V - k], float("-inf"), x64)
    cum = torch.softmax(x64, 0).cumsum(0)
    print(f"    float64 cum mass around the cut: {cum[(cum > 0)][:12].tolist()}")
    out_rows.append(dict(
        tag=tag, row=r, logits=lg.cpu(), temperature=temp, top_k=top_k, top_p=top_p,
        do_sample=bool(batch.do_sample[r]), seed=int(seeds[r]), counter=int(ctr[r]),
        keep_ref=keep_ref.cpu(), keep_kernel=keep_k.cpu(), keep_emulated=keep_emu.cpu(),
        kernel_e=e[0, :V].cpu(), scal=scal.cpu(),
    ))  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--V", type=int, default=2048)
    ap.add_argument("--device", default="cuda")  # cpu: under TRITON_INTERPRET=1
    args = ap.parse_args()
    dev = args.device
    out_rows = []
    for dtype in (torch.float32, torch.bfloat16):
        penalty, V = False, args.V
        g = torch.Generator(device=dev).manual_seed(V + int(penalty))
        B = 64
        for trial in range(8):
            logits = (torch.randn(B, V, device=dev, generator=g) * (1 + trial)).to(dtype)
            logits[0, :20] = 0.0
            logits[0, 20:40] = -0.0
            logits[1, 100:] = float("-inf")
            batch = SamplingBatch(
                do_sample=torch.rand(B, device=dev, generator=g) < 0.85,
                temperature=0.3 + torch.rand(B, device=dev, generator=g),
                top_k=torch.tensor([0, 1, 2, 5, 50, 64, V, V + 7], device=dev).repeat(B // 8),
                top_p=torch.tensor([1.0, 0.95, 0.8, 1.0, 0.5, 0.99, 1.0, 0.3], device=dev)
                .repeat(B // 8)
                .roll(trial),
                repetition_penalty=1 + torch.rand(B, device=dev, generator=g),
            )
            seeds = torch.randint(0, 2**62, (B,), device=dev, generator=g)
            ctr = torch.randint(0, 10**6, (B,), device=dev, generator=g)
            ref = fused_sample_reference(logits, batch, seeds, ctr)
            out = fused_sample(logits, batch, seeds, ctr, use_triton=True)
            bad = (ref != out).nonzero().flatten().tolist()
            print(f"{dtype} trial {trial}: mismatching rows {bad}", flush=True)
            for r in bad:
                dissect(f"{dtype} trial {trial}", logits, batch, seeds, ctr, r, out_rows)
    torch.save(out_rows, os.path.join(args.out, "sampler_rows.pt"))


if __name__ == "__main__":
    main()
