"""The talker's decode attention on a bf16 cache against an FP8 one (plan talker_kv_fp8).

    PYTHONPATH=. python3 benchmarks/kernels/kv_fp8_attention.py [--rows 1,16,64,256]
        [--lengths 200,600] [--max-len 2048] [--tiles "128,4,3;128,8,3;64,4,4"]

GPU only. For the 1.7B talker's heads (16 query, 8 KV, head_dim 128) and a cache of --max-len
positions per slot (the engine's max_len: the kernel's splits are planned over it), each row
attending to `length` positions: `decode_attention` as the talker's decode step calls it
(split kernel + combine), on a bf16 cache and on an e4m3 cache with k/v scales, and the
cache write (`qk_norm_rope`) of each. Median us per call over CUDA-graph replays
(`bench_kernels.graph_time_us`); every result is checked against the float32 reference on the
same cache (relative error <= 2e-2, else the run fails). The last columns: the cache bytes a
call reads (k and v over the rows' lengths) per us, and the talker step's 28 layers' worth.
Then the splits dividing each row's length against the capacity (`dynamic_chunk`,
TTSBUILD_ATTN_DYNAMIC_CHUNK) on both caches, and the dynamic kind with 2x and 4x the planned
splits, each checked the same way: a table of them.
--tiles: the split kernel's other (BLOCK_S, num_warps, num_stages) for a long cache
(`LONG_TILES` holds the served ones), each timed on both caches at each rows x length and
checked the same way, the FP8 cache's with bf16 and with fp16 dots (`f16_dot`,
TTSBUILD_ATTN_FP8_F16); a second table, the best of each marked.
Appends to $OUT/kv_fp8_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import graph_time_us, rel_err  # noqa: E402

from ttsbuild.plugins._tl.decode_attention import (  # noqa: E402
    LONG_TILES,
    _tiles,
    decode_attention_triton,
)
from ttsbuild.plugins.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
)
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, qk_norm_rope, quantize_kv  # noqa: E402

HQ, HKV, D, LAYERS = 16, 8, 128, 28
ATTN = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-6, theta=1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--lengths", default="200,600")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--tiles", default="", help="';'-separated BLOCK_S,num_warps,num_stages")
    args = ap.parse_args()
    try:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";") if t.strip()]
    except ValueError:
        raise SystemExit(f"--tiles wants 'BLOCK_S,WARPS,STAGES;...', got {args.tiles!r}") from None
    if any(len(t) != 3 for t in tiles):
        raise SystemExit(f"--tiles wants three numbers a config, got {args.tiles!r}")
    sweep, dynamic = [], []
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    S = args.max_len
    results = []
    print(f"{'rows':>5} {'len':>5} | {'bf16 us':>8} {'fp8 us':>8} {'x':>5} | {'bf16 GB/s':>9} "
          f"{'fp8 GB/s':>9} | {'write bf16':>10} {'write fp8':>9} | step ms saved (x{LAYERS})")
    for B in (int(v) for v in args.rows.split(",")):
        # one cache pair per precision, B slots; k as the norm leaves it (~N(0, 1)), v wider
        k = torch.randn(B, HKV, S, D, device=dev, generator=g)
        v = torch.randn(B, HKV, S, D, device=dev, generator=g) * 2
        ks, vs = float(k.abs().amax()) / 448, float(v.abs().amax()) / 448
        caches = {"bf16": (k.bfloat16(), v.bfloat16(), {}),
                  "fp8": (quantize_kv(k, ks, KV_FP8_DTYPE), quantize_kv(v, vs, KV_FP8_DTYPE),
                          dict(k_scale=ks, v_scale=vs))}  # fmt: skip
        del k, v
        q = torch.randn(B, HQ, D, device=dev, generator=g).bfloat16()
        qkv = torch.randn(B, (HQ + 2 * HKV) * D, device=dev, generator=g).bfloat16()
        qw = torch.ones(D, device=dev, dtype=torch.bfloat16)
        slots = torch.randperm(B, device=dev, generator=g)
        for length in (int(v) for v in args.lengths.split(",")):
            lengths = torch.full((B,), length, device=dev)
            positions = lengths - 1
            us, write = {}, {}
            for name, (kc, vc, kv) in caches.items():
                out = decode_attention(q, kc, vc, slots, lengths, S, **kv)
                ref = decode_attention_reference(q.float(), kc, vc, slots, lengths, S, **kv)
                err = rel_err(out, ref)
                if not err <= 2e-2:
                    raise SystemExit(f"{name} B={B} len={length}: rel err {err:.2e} > 2e-2")
                us[name] = graph_time_us(
                    [partial(decode_attention, q, kc, vc, slots, lengths, S, **kv)])
                write[name] = graph_time_us(
                    [partial(qk_norm_rope, qkv, qw, qw, positions, slots, kc, vc, **ATTN, **kv)])
            read = {n: B * length * HKV * D * 2 * (2 if n == "bf16" else 1) for n in us}
            saved = (us["bf16"] + write["bf16"] - us["fp8"] - write["fp8"]) * LAYERS / 1e3
            print(f"{B:>5} {length:>5} | {us['bf16']:8.1f} {us['fp8']:8.1f} "
                  f"{us['bf16'] / us['fp8']:5.2f} | {read['bf16'] / us['bf16'] / 1e3:9.0f} "
                  f"{read['fp8'] / us['fp8'] / 1e3:9.0f} | {write['bf16']:10.1f} "
                  f"{write['fp8']:9.1f} | {saved:.3f}", flush=True)
            results.append({"rows": B, "length": length, "max_len": S, "attn_us": us,
                            "write_us": write, "step_ms_saved": round(saved, 4)})
            for name, (kc, vc, kv) in caches.items():
                ref = decode_attention_reference(q.float(), kc, vc, slots, lengths, S, **kv)
                times = []
                planned = _tiles(B, HKV, S, dev, None)[1]
                # static, dynamic, then dynamic with 2x and 4x the planned splits (with each
                # row's length divided, more splits shorten the longest program)
                for dyn, splits in ((False, None), (True, None), (True, min(64, 2 * planned)),
                                    (True, min(64, 4 * planned))):  # fmt: skip
                    run = partial(decode_attention_triton, q, kc, vc, slots, lengths, S,
                                  splits=splits, dynamic_chunk=dyn, **kv)  # fmt: skip
                    err = rel_err(run(), ref)
                    if not err <= 2e-2:
                        raise SystemExit(f"{name} dynamic={dyn} splits={splits} B={B} "
                                         f"len={length}: rel err {err:.2e} > 2e-2")  # fmt: skip
                    times.append(graph_time_us([run]))
                dynamic.append((B, length, name, planned, *times))
            for name, (kc, vc, kv) in caches.items() if tiles else ():
                # the FP8 cache's tiles with bf16 dots, then fp16 ones (f16_dot)
                dots = (False, True) if name == "fp8" else (False,)
                for f16, t in ((f, t) for f in dots for t in [LONG_TILES[name == "fp8"], *tiles]):
                    run = partial(decode_attention_triton, q, kc, vc, slots, lengths, S,
                                  tiles=t, f16_dot=f16, **kv)  # fmt: skip
                    err = rel_err(run(), decode_attention_reference(
                        q.float(), kc, vc, slots, lengths, S, **kv))  # fmt: skip
                    label = f"{name}{'/f16' if f16 else ''}"
                    if not err <= 2e-2:
                        raise SystemExit(f"{label} tiles {t} B={B} len={length}: rel err "
                                         f"{err:.2e} > 2e-2")  # fmt: skip
                    t_us = graph_time_us([run])
                    sweep.append((B, length, label, t, t_us, read[name]))
        del caches
        torch.cuda.empty_cache()
    print(f"\nsplits by capacity against by each row's length (dynamic_chunk), us\n{'rows':>5} "
          f"{'len':>5} {'cache':>5} {'splits':>6} {'static':>8} {'dynamic':>8} {'x':>5} "
          f"{'dyn 2x':>8} {'dyn 4x':>8}")
    for B, length, name, planned, st, dy, dy2, dy4 in dynamic:
        print(f"{B:>5} {length:>5} {name:>5} {planned:>6} {st:8.1f} {dy:8.1f} {st / dy:5.2f} "
              f"{dy2:8.1f} {dy4:8.1f}")
    results.append({"dynamic_chunk": [
        dict(rows=b, length=n_, cache=c, splits=sp, static_us=st, dynamic_us=dy,
             dynamic_2x_splits_us=d2, dynamic_4x_splits_us=d4)
        for b, n_, c, sp, st, dy, d2, d4 in dynamic]})  # fmt: skip
    if tiles:
        print(f"\ntiles sweep (first row of each cache: LONG_TILES's; fp8/f16: the FP8 cache "
              f"with fp16 dots)\n{'rows':>5} {'len':>5} {'cache':>8} {'tiles':>12} {'us':>8} "
              f"{'GB/s':>6}")
        for B, length, name, t, t_us, nbytes in sweep:
            best = min(u for b, n_, c, _, u, _ in sweep if (b, n_, c) == (B, length, name))
            print(f"{B:>5} {length:>5} {name:>8} {str(t):>12} {t_us:8.1f} "
                  f"{nbytes / t_us / 1e3:6.0f}{'  best' if t_us == best else ''}")
        results.append({"tiles_sweep": [dict(rows=b, length=n_, cache=c, tiles=t, us=u)
                                        for b, n_, c, t, u, _ in sweep]})  # fmt: skip
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kv_fp8_attention.json", "a") as f:
        f.write(json.dumps({"device": torch.cuda.get_device_name(), "results": results}) + "\n")


if __name__ == "__main__":
    main()
