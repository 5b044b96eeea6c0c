# ruff: noqa: B023  (the timed closures run before their loop variables change)
"""Check every plugin kernel against its reference and time it next to the PyTorch baseline.

    PYTHONPATH=. python3 benchmarks/kernels/bench_kernels.py [--out DIR] [--quick]

GPU only. Times are medians of CUDA-graph replays (each graph holds >= 64 calls, inputs
rotated over enough copies that the weights do not sit in the 50 MB L2), in microseconds
per call. GB/s = the fewest bytes the op must move / time, against 4.0 TB/s.
Writes DIR/bench_kernels.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

PEAK_BW = 4.0e12
L2_DEFEAT_BYTES = 256 << 20

TALKER_SHAPES = {  # name: (K, N)
    "talker.qkv": (2048, 4096),
    "talker.o": (2048, 2048),
    "talker.gate_up": (2048, 12288),
    "talker.down": (6144, 2048),
}
CP_SHAPES = {
    "cp.qkv": (1024, 4096),
    "cp.o": (2048, 1024),
    "cp.gate_up": (1024, 6144),
    "cp.down": (3072, 1024),
    "cp.head": (1024, 2048),
}
BATCHES = [1, 8, 32, 64]


def graph_time_us(calls, min_calls: int = 64, replays: int = 9) -> float:
    """Median us per call over CUDA-graph replays of `calls` (a list of thunks), repeated."""
    reps = max(1, math.ceil(min_calls / len(calls)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (reps * len(calls)))
    del g
    return statistics.median(times)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def row(table, **kw):
    table.append(kw)
    return kw


def bench_copy_ceiling(rows):
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_time_us([lambda: b.copy_(a)], min_calls=8, replays=5)
    bw = gbps(2 * a.numel(), us)
    row(rows, op="d2d copy 1 GiB", shape="", M=0, base_us=us, ours_us=us,
        base_gbps=bw, ours_gbps=bw, err=0.0)  # fmt: skip


def bench_fp8_linear(rows, sweep: bool):
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8
    from ttsbuild.plugins.fp8_linear import dequantize_weight_fp8, fp8_linear, quantize_weight_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (K, N) in {**TALKER_SHAPES, **CP_SHAPES}.items():
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / (2 * N * K)))
        w_bf16 = [torch.randn(N, K, device="cuda", generator=g).mul_(0.02).bfloat16()]
        for _ in range(copies - 1):
            w_bf16.append(w_bf16[0].roll(1 + len(w_bf16), 0))  # distinct memory, same values
        q, s = quantize_weight_fp8(w_bf16[0])
        qs = [(q.view(torch.uint8).roll(i, 0).view(q.dtype), s.roll(i, 0)) for i in range(copies)]
        for M in BATCHES:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            out = fp8_linear(x, q, s, use_triton=True)  # autotunes (outside any graph)
            ref = x.float() @ dequantize_weight_fp8(q, s).t()
            err = rel_err(out, ref)
            base = graph_time_us([lambda w=w: F.linear(x, w) for w in w_bf16])
            ours = graph_time_us([lambda q=q, s=s: fp8_linear(x, q, s) for q, s in qs])
            fp8_bytes = N * K + 4 * N + 2 * M * (K + N)
            r = row(rows, op="fp8_linear", shape=f"{name} {K}->{N}", M=M, base_us=base,
                    ours_us=ours, base_gbps=gbps(2 * N * K + 2 * M * (K + N), base),
                    ours_gbps=gbps(fp8_bytes, ours), err=err,
                    config=tl_fp8.best_config(M, N, K))  # fmt: skip
            if sweep:  # every config of the set, timed the same way (rotated, in-graph)
                cfgs = tl_fp8.GEMV_CONFIGS if M == 1 else tl_fp8.GEMM_CONFIGS
                res = {}
                for c in cfgs:
                    d = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                    if K % (d["BLOCK_K"] * d["SPLIT_K"]) or d["BLOCK_K"] > K:
                        continue
                    try:
                        o = tl_fp8.fp8_linear_triton(x, q, s, config=d)
                        e = rel_err(o, ref)
                        run = tl_fp8.fp8_linear_triton
                        t = graph_time_us([lambda q=q, s=s, d=d: run(x, q, s, d) for q, s in qs])
                        res[str(d)] = (round(t, 2), round(e, 5))
                    except Exception as exc:  # noqa: BLE001
                        res[str(d)] = repr(exc)[:120]
                r["sweep"] = res
            print(
                f"  {name} M={M}: bf16 {base:.2f} us, fp8 {ours:.2f} us, err {err:.1e}", flush=True
            )
        del w_bf16, qs
        torch.cuda.empty_cache()


def bench_qk_norm_rope(rows):
    from ttsbuild.plugins.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    Hq, Hkv, D, S = 16, 8, 128, 2048
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    for R in BATCHES:
        n_slots = 64
        qkv = torch.randn(R, (Hq + 2 * Hkv) * D, device="cuda", generator=g).bfloat16()
        qw = (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        kwt = (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        pos = torch.randint(0, S, (R,), device="cuda", generator=g)
        slots = torch.randperm(n_slots, device="cuda", generator=g)[:R]
        kc = torch.randn(n_slots, Hkv, S, D, device="cuda", generator=g).bfloat16()
        vc = torch.randn_like(kc)
        kr, vr = kc.float(), vc.float()
        q = qk_norm_rope(qkv, qw, kwt, pos, slots, kc, vc, use_triton=True, **kw)
        qr = qk_norm_rope_reference(qkv.float(), qw.float(), kwt.float(), pos, slots, kr, vr, **kw)
        err = max(rel_err(q, qr), rel_err(kc[slots, :, pos], kr[slots, :, pos]))
        del kr, vr
        base = graph_time_us(
            [lambda: qk_norm_rope_reference(qkv, qw, kwt, pos, slots, kc, vc, **kw)]
        )
        ours = graph_time_us([lambda: qk_norm_rope(qkv, qw, kwt, pos, slots, kc, vc, **kw)])
        nbytes = qkv.numel() * 2 + R * (Hq + 2 * Hkv) * D * 2
        row(rows, op="qk_norm_rope+kv", shape="16q/8kv x128", M=R, base_us=base, ours_us=ours,
            base_gbps=gbps(nbytes, base), ours_gbps=gbps(nbytes, ours), err=err)  # fmt: skip


def bench_attention(rows):
    from ttsbuild.plugins.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(2)
    Hq, Hkv, D = 16, 8, 128
    for label, S, batches in [("cp S=16", 16, BATCHES), ("talker S=1024", 1024, BATCHES),
                              ("talker S=4096", 4096, [1, 8, 32])]:  # fmt: skip
        for B in batches:
            n_slots = B
            q = torch.randn(B, Hq, D, device="cuda", generator=g).bfloat16()
            kc = torch.randn(n_slots, Hkv, S, D, device="cuda", generator=g).bfloat16()
            vc = torch.randn_like(kc)
            slots = torch.randperm(n_slots, device="cuda", generator=g)
            lengths = torch.randint(S // 2, S + 1, (B,), device="cuda", generator=g)
            lengths[0] = S
            out = decode_attention(q, kc, vc, slots, lengths, S, use_triton=True)
            ref = decode_attention_reference(q, kc, vc, slots, lengths, S)
            err = rel_err(out, ref)
            base = graph_time_us(
                [lambda: decode_attention_reference(q, kc, vc, slots, lengths, S, None, None)]
            )
            ours = graph_time_us([lambda: decode_attention(q, kc, vc, slots, lengths, S)])
            nbytes = int(lengths.sum()) * Hkv * D * 2 * 2 + 2 * 2 * B * Hq * D
            row(rows, op="decode_attention", shape=label, M=B, base_us=base, ours_us=ours,
                base_gbps=gbps(nbytes, base), ours_gbps=gbps(nbytes, ours), err=err)  # fmt: skip


def bench_sampling(rows):
    from ttsbuild.generation.sampling import SamplingBatch
    from ttsbuild.plugins.sampling import fused_sample, fused_sample_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    for V, top_p, pen in [(3072, 1.0, True), (2048, 1.0, False), (3072, 0.8, False)]:
        for B in BATCHES:
            logits = torch.randn(B, V, device="cuda", generator=g) * 3
            batch = SamplingBatch(
                do_sample=torch.ones(B, dtype=torch.bool, device="cuda"),
                temperature=torch.full((B,), 0.9, device="cuda"),
                top_k=torch.full((B,), 50, dtype=torch.int64, device="cuda"),
                top_p=torch.full((B,), top_p, device="cuda"),
                repetition_penalty=torch.full((B,), 1.05, device="cuda"),
            )
            seeds = torch.randint(0, 2**62, (B,), device="cuda", generator=g)
            ctr = torch.randint(0, 10**6, (B,), device="cuda", generator=g)
            hist = torch.rand(B, V, device="cuda", generator=g) < 0.05 if pen else None
            mism = 0
            for t in range(20):  # token identity over fresh draws
                ref = fused_sample_reference(logits, batch, seeds, ctr + t, hist)
                out = fused_sample(logits, batch, seeds, ctr + t, hist, use_triton=True)
                mism += int((ref != out).sum())
            base = graph_time_us([lambda: fused_sample_reference(logits, batch, seeds, ctr, hist)])
            ours = graph_time_us([lambda: fused_sample(logits, batch, seeds, ctr, hist)])
            nbytes = B * V * 4 + (B * V if pen else 0)
            row(rows, op="sample", shape=f"V={V} k=50 p={top_p}{' +pen' if pen else ''}", M=B,
                base_us=base, ours_us=ours, base_gbps=gbps(nbytes, base),
                ours_gbps=gbps(nbytes, ours), err=float(mism))  # fmt: skip


def bench_guards(rows):
    """The device guards (frame step, codec step of 4 frames): eager reference vs one launch;
    err counts stop codes and state entries that differ after a few steps from one state."""
    from ttsbuild.generation.guards import GuardConfig, GuardState, frame_stop_codes, observe_audio

    cfg = GuardConfig()
    g = torch.Generator(device="cuda").manual_seed(4)
    for B in BATCHES:
        slots = torch.randperm(B + 1, device="cuda", generator=g)[:B]
        c0 = torch.randint(0, 4, (B,), device="cuda", generator=g)  # 4 codes: some loop
        pcm = 10 ** (torch.rand(B, 4, 1, device="cuda", generator=g) * -3) * torch.randn(
            B, 4, 1920, device="cuda", generator=g
        )  # -60..0 dB frames
        pcm = pcm.reshape(B, -1)
        states = [GuardState.zeros(B + 1, cfg, "cuda") for _ in range(2)]
        mism = 0
        for _ in range(100):
            outs = [
                frame_stop_codes(st, cfg, slots, c0, 2150, use_triton=t)
                for st, t in zip(states, (False, True), strict=True)
            ]
            for st, t in zip(states, (False, True), strict=True):
                observe_audio(st, cfg, slots, pcm, use_triton=t)
            mism += int((outs[0] != outs[1]).sum())
        for f in ("recent_c0", "frames_seen", "silent_frames", "heard"):
            mism += int((getattr(states[0], f) != getattr(states[1], f)).sum())
        st = states[0]
        for op, call, nbytes in [
            (
                "guards.frame",
                lambda t: frame_stop_codes(st, cfg, slots, c0, 2150, use_triton=t),
                B * 16 * st.recent_c0.shape[1],
            ),
            (
                "guards.audio",
                lambda t: observe_audio(st, cfg, slots, pcm, use_triton=t),
                pcm.numel() * 4,
            ),
        ]:
            base = graph_time_us([lambda: call(False)])
            ours = graph_time_us([lambda: call(True)])
            row(rows, op=op, shape=f"W={cfg.repetition_window} P={cfg.repetition_max_period}",
                M=B, base_us=base, ours_us=ours, base_gbps=gbps(nbytes, base),
                ours_gbps=gbps(nbytes, ours), err=float(mism))  # fmt: skip


def print_table(rows):
    print(f"\n{'op':<17}{'shape':<26}{'M/B':>4}{'torch us':>10}{'ours us':>9}{'speedup':>8}"
          f"{'ours GB/s':>10}{'%4TB/s':>7}{'err':>9}")  # fmt: skip
    for r in rows:
        sp = r["base_us"] / r["ours_us"] if r["ours_us"] else float("nan")
        print(f"{r['op']:<17}{r['shape']:<26}{r['M']:>4}{r['base_us']:>10.2f}{r['ours_us']:>9.2f}"
              f"{sp:>7.2f}x{r['ours_gbps']:>10.0f}{100 * r['ours_gbps'] * 1e9 / PEAK_BW:>6.0f}%"
              f"{r['err']:>9.1e}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--sweep", action="store_true", help="also time every fp8 config")
    ap.add_argument("--only", default="", help="comma list: copy,fp8,qk,attn,sample,guards")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton

    os.makedirs(args.out, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "command": " ".join(sys.argv),
    }
    print(meta, flush=True)
    rows: list[dict] = []
    errors = {}
    sections = {
        "copy": bench_copy_ceiling,
        "fp8": lambda r: bench_fp8_linear(r, args.sweep),
        "qk": bench_qk_norm_rope,
        "attn": bench_attention,
        "sample": bench_sampling,
        "guards": bench_guards,
    }
    only = [s for s in args.only.split(",") if s] or list(sections)
    for name in only:
        t0 = time.time()
        try:
            sections[name](rows)
        except Exception:  # noqa: BLE001 - keep going, report
            errors[name] = traceback.format_exc()
            print(errors[name], flush=True)
        print(f"[{name}] {time.time() - t0:.1f} s", flush=True)
        with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "errors": errors}, f, indent=1)
    print_table(rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
