"""How the implicit-GEMM conv kernel (plugins.causal_conv) loads its input tile, compiled
offline for sm_90 (no GPU needed: Triton's NVIDIA backend and its ptxas): for [B, C, T]
storage (the default: time contiguous, channel stride T) and for channels-last operands
(CodecEngine(channels_last=True): channel stride 1, time stride C). Prints the global loads,
stores and cp.async copies in the PTX of each.

    python benchmarks/codec/ptx_loads.py [--block-ci 32] [--warps 8] [--stages 3]
    python benchmarks/codec/ptx_loads.py --registers

--registers: the registers and spills a thread of each served kind and tile takes
(channels-last): the k = 7 conv with and without the SnakeBeta in its epilogue (out_alpha;
also capped at 128 registers),
the 1x1 conv with and without the SnakeBeta in its load, at the 128 x 128 tiles of two
warpgroups (>= 2048 rows) and the 64-row tiles of one (fewer rows); the last 1x1 conv with
the output stage's taps in its epilogue (OUTPUT_EPILOGUE; its tile: every channel); the 1x1
conv storing the next unit's SnakeBeta'd input too (NEXT_ACT_FOLD); the k = 7 conv with its
epilogue SnakeBeta on the TMA kernel (CONV_TMA: whether its PTX has TMA copies, mbarriers
and wgmma, and its shared memory).

The integer arguments are specialised as Triton specialises them at run time: a stride of 1
as a constant, the others (and the pointers) as multiples of 16 (the codec's channel counts,
96-1536, all are). The version of Triton here may not be the GPU host's; read the counts as
what the layout lets the compiler do, and time it on the GPU (profile_codec.py
--channels-last).
"""

from __future__ import annotations

import argparse
import collections
import re

PTRS = ("x_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr", "alpha_ptr", "inv_beta_ptr",
        "out_alpha_ptr", "out_inv_beta_ptr", "ws_ptr", "cnt_ptr", "taps_ptr", "z_ptr",
        "next_ptr", "next_alpha_ptr", "next_inv_beta_ptr")


def compile_ptx(channels_last: bool, a, k: int = 7, unit_conv: bool = False) -> str:
    """unit_conv: a residual unit's 1x1 conv (k 1, SnakeBeta in the input load, the residual
    added), else a conv of `k` taps with a bias."""
    return compile_conv(channels_last, a, k, unit_conv,
                        flat_k=a.flat_k if channels_last else 0).asm["ptx"]


def compile_conv(channels_last: bool, a, k: int = 7, unit_conv: bool = False,
                 snake: bool | None = None, out_snake: bool = False, block_m: int = 128,
                 block_o: int = 128, maxnreg: int | None = None, flat_k: int = 0,
                 out_taps: bool = False, next_snake: bool = False):
    """The compiled kernel (snake: the SnakeBeta in the input load, default unit_conv;
    out_snake: one in the epilogue; maxnreg: a cap on a thread's registers; flat_k: the
    flattened (tap, channel) K steps, runs of this many channels, causal_conv.FLAT_RUN;
    out_taps: the output stage's SnakeBeta and taps in the epilogue, conv_output_taps;
    next_snake: the next conv's SnakeBeta'd input stored beside the output, next_act)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ttsbuild.plugins.causal_conv import _causal_conv_kernel as kernel

    names = list(kernel.arg_names)
    consts = {"K": 1 if unit_conv else k, "HAS_BIAS": True, "HAS_RES": unit_conv,
              "HAS_SNAKE": unit_conv if snake is None else snake, "HAS_OUT_SNAKE": out_snake,
              "OUT_TAPS": out_taps, "NEXT_SNAKE": next_snake, "FLAT_K": flat_k, "SPLIT_K": 1,
              "BLOCK_M": block_m,
              "BLOCK_CI": a.block_ci, "BLOCK_O": block_o}  # fmt: skip
    # the strides that are 1: the input's, output's and residual's channel strides
    # (channels-last), else their time strides
    for unit in ("sxc", "soo", "sro", "sno") if channels_last else ("sxt", "sot", "srt", "snt"):
        consts[unit] = 1
    fp32 = ("alpha_ptr", "inv_beta_ptr", "out_alpha_ptr", "out_inv_beta_ptr", "ws_ptr",
            "taps_ptr", "z_ptr", "next_alpha_ptr", "next_inv_beta_ptr")
    sig = {n: ("*i32" if n == "cnt_ptr" else "*fp32" if n in fp32 else "*fp16")
           if n in PTRS else
           "constexpr" if n in consts else "i32" for n in names}  # fmt: skip
    aligned = [*PTRS, "CIN", "COUT", "sob", "srb", "sxb", "snb"]
    aligned += ["sxt", "sot", "srt", "snt"] if channels_last else ["sxc", "soo", "sro", "sno"]
    src = ASTSource(
        fn=kernel, signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )  # fmt: skip
    options = {"num_warps": a.warps, "num_stages": a.stages,
               **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_tma(bm: int, bci: int, bo: int, warps: int, stages: int):
    """The TMA kernel (causal_conv._conv_tma_kernel) for a k = 7 conv with a bias and the
    epilogue SnakeBeta, channels-last output and residual (channel stride 1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ttsbuild.plugins.causal_conv import _conv_tma_kernel as kernel

    names = list(kernel.arg_names)
    consts = {"K": 7, "HAS_BIAS": True, "HAS_RES": False, "HAS_OUT_SNAKE": True,
              "BLOCK_M": bm, "BLOCK_CI": bci, "BLOCK_O": bo, "NUM_STAGES": stages,
              "PDL": False, "soo": 1, "sro": 1}  # fmt: skip
    descs = {"x_desc": f"tensordesc<fp16[1,{bm},{bci}]>", "w_desc": f"tensordesc<fp16[{bci},{bo}]>"}
    sig = {n: descs.get(n) or ("*fp32" if n in ("out_alpha_ptr", "out_inv_beta_ptr") else
                               "*fp16" if n.endswith("_ptr") else
                               "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def registers() -> None:
    """Registers and spills a thread, per served kind and tile (see the module docstring)."""
    from types import SimpleNamespace

    print("| kind | tile (M, CI, O, warps, stages) | registers | spilled bytes |")
    print("|---|---|---|---|")
    tiles = ((128, 64, 128, 8, 3), (64, 64, 64, 4, 3))
    unit_tiles = ((64, 32, 128, 4, 3), (64, 64, 64, 4, 3))
    kinds = [(f"k7{' + epilogue SnakeBeta' if out else ''}", dict(k=7, out_snake=out), tiles)
             for out in (False, True)]
    kinds.append(("k7 + epilogue SnakeBeta, maxnreg 128", dict(k=7, out_snake=True,
                                                               maxnreg=128), tiles[:1]))
    plain_tiles = ((128, 64, 128, 8, 3), (128, 64, 64, 8, 3))  # PLAIN_1X1_TILES's
    kinds += [(f"1x1 + residual{' + SnakeBeta in the load' if snake else ''}",
               dict(k=1, unit_conv=True, snake=snake),
               unit_tiles if snake else unit_tiles + plain_tiles) for snake in (True, False)]
    kinds.append(("1x1 + residual + output taps (OUTPUT_EPILOGUE)",
                  dict(k=1, unit_conv=True, snake=False, out_taps=True),
                  (unit_tiles[0], (64, 32, 128, 8, 3))))
    kinds.append(("1x1 + residual + the next conv's SnakeBeta'd input (NEXT_ACT_FOLD)",
                  dict(k=1, unit_conv=True, snake=False, next_snake=True),
                  ((64, 64, 64, 4, 3), (128, 64, 128, 8, 3), (128, 64, 64, 8, 3),
                   unit_tiles[0])))
    for name, kw, tile_list in kinds:
        for bm, bci, bo, warps, stages in tile_list:
            a = SimpleNamespace(block_ci=bci, warps=warps, stages=stages, flat_k=0)
            regs, spills = ptxas_usage(compile_conv(True, a, block_m=bm, block_o=bo, **kw))
            print(f"| {name} | ({bm}, {bci}, {bo}, {warps}, {stages}) | {regs} | {spills} |",
                  flush=True)
    for tile in ((128, 64, 128, 8, 4), (128, 64, 64, 8, 4), (64, 32, 128, 4, 4)):
        compiled = compile_tma(*tile)
        ptx = compiled.asm["ptx"]
        has = [w for w, key in (("TMA", "cp.async.bulk.tensor"), ("mbarrier", "mbarrier"),
                                ("wgmma", "wgmma")) if key in ptx]
        regs, spills = ptxas_usage(compiled)
        print(f"| k7 + epilogue SnakeBeta, TMA kernel ({' + '.join(has)}; "
              f"{compiled.metadata.shared} B shared) | {tile} | {regs} | {spills} |", flush=True)


def ptxas_usage(compiled) -> tuple[str, str]:
    """(registers, spill stores in bytes) of a thread: Triton's ptxas, -v, on the kernel's PTX
    (the loaded kernel's own counts need a GPU)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "-arch=sm_90a", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return (regs.group(1) if regs else "?"), (spills.group(1) if spills else "?")


def load_forms(ptx: str) -> collections.Counter:
    """Global loads, stores and async copies, operands stripped: what kind, how wide, how
    many."""
    forms = collections.Counter()
    for line in ptx.splitlines():
        op = line.strip().split(";")[0]
        if "ld.global" in op or "st.global" in op or "cp.async.cg" in op or "cp.async.ca" in op:
            op = re.sub(r"^@%p\d+\s+", "@p ", op)
            op = re.sub(r"\{[^}]*\}|\[[^\]]*\]|%r\d+", "_", op)
            forms[op] += 1
    return forms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--block-ci", type=int, default=32)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--registers", action="store_true", help="registers and spills instead")
    p.add_argument("--flat-k", type=int, default=0,
                   help="channels-last rows with the flattened K steps (runs of this many)")
    a = p.parse_args()
    if a.registers:
        registers()
        return
    import triton

    print(f"triton {triton.__version__}, sm_90, BLOCK_M 128, BLOCK_CI {a.block_ci}, "
          f"BLOCK_O 128, {a.warps} warps, {a.stages} stages, flat K {a.flat_k}")  # fmt: skip
    for unit_conv in (False, True):
        what = ("a residual unit's 1x1 conv (SnakeBeta in the load, residual added)"
                if unit_conv else "a 7-tap conv with a bias")  # fmt: skip
        for channels_last in (False, True):
            forms = load_forms(compile_ptx(channels_last, a, unit_conv=unit_conv))
            layout = "channels-last operands" if channels_last else "[B, C, T] operands"
            print(f"\n{what}, {layout}:")
            for form, count in sorted(forms.items()):
                print(f"  {count:3d} x {form}")


if __name__ == "__main__":
    main()
