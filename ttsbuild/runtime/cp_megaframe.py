"""The code predictor's frame at batch 1 as one persistent CUDA kernel
(`ttsbuild/csrc/cp_megaframe.cu`): 16 single-token passes in one launch, one CTA an SM, grid
barriers between the dependent stages, FP8 weight slices streamed into shared memory by a
producer warp, and the sampler run by every CTA.

Here: the kernel's tensors packed from the engine's code-predictor weights (`pack`), its
float32 CPU reference (`reference`: what the kernel is checked against; it is checked against
the official code predictor in tests/runtime/test_megaframe_reference.py), the shapes it
takes (`unsupported`), and the GPU wrapper (`Megaframe`, built on first use with
torch.utils.cpp_extension: sm_90).

Status (2026-12-05): 1.43x faster than the served fused frame in its bench on an H100 (1.475
against 2.108 ms, same call; benchmarks/kernels/megapass/bench_megaframe.py). In the engine,
batch bucket 1 runs it behind `EnginePlan.megaframe_code_predictor` (compile and serve:
--megaframe-code-predictor). There, on an H100:
- the frame at batch 1 took 3.20 -> 2.81 ms;
- an idle request's first chunk took 4.81 -> 4.29 ms;
- codes and PCM were identical to the same plan without the kernel (graph_vs_eager.py
  --megaframe, fp32, greedy and sampled).
Limits: batch 1, FP8 linears (FP8 or bf16 heads: the engine's own, read as they are),
Hopper GPUs, and the shipped code predictor's shapes (0.6B and 1.7B alike).
"""

from __future__ import annotations

import functools
import math
import operator
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ttsbuild.generation.sampling import (
    SamplingBatch,
    draw_counter,
    sample,
    uniform_noise,
)
from ttsbuild.model.layers import rope_cos_sin
from ttsbuild.runtime import l2_persist
from ttsbuild.runtime.fast_model import Dense, PackedStack

# The shapes compiled into the kernel (the 1.7B CustomVoice code predictor's)
SHAPE = {"layers": 5, "hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128,
         "intermediate": 3072, "vocab": 2048, "groups": 16}
SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cp_megaframe.cu"
# The kernel's OPT_* bits (cp_megaframe.cu). FETCH, how the fastest measured kernel fetches:
# TMA bulk copies issued by a producer warp, each stage's activations read first. COOPERATIVE:
# a cooperative launch (the grid starts only when all of it fits: no grid barrier waits on a
# CTA that cannot start beside another stream's kernels). TWO_TOKEN: the frame's first two
# inputs (positions 0 and 1) as one pass of two tokens: 20 stages fewer (of 335) and 19 grid
# barriers (of 334). XREDUCE: a GEMV's row sums reduced across the warp together
# (`xreduce_lanes` mirrors it), stage B's o projection 8 rows a warp. Both served: 1.446 ->
# 1.368 ms a frame (H100 run 11, every check passing). KV_AHEAD (with PRODUCER): stage B's
# past K/V rows copied by the producer beside its weights (no faster: run 10). SPLIT_DOWN:
# stage D split by input columns (a CTA's own act columns from C times W_d's columns,
# transposed, added to d by atomics): no barrier after C, 3 a layer, not 4; 8 % slower
# (run 10: the atomics and the transposed slice cost more than the barrier saved).
READ_FIRST, TMA, DIST1, PRODUCER, COOPERATIVE = 1, 2, 4, 8, 16
TWO_TOKEN, XREDUCE, KV_AHEAD, SPLIT_DOWN = 32, 64, 128, 256
FETCH = TMA | READ_FIRST | PRODUCER
SERVED_OPTS = FETCH | TWO_TOKEN | XREDUCE
# GENERIC (host): the kernel compiled for any options, read at run time. Without it, the full
# frame with options (less COOPERATIVE) in SPECIALIZED runs an instance compiled for exactly
# them: less than half the machine code, which a persistent kernel walking 320 stages needs
# (the instruction cache: FETCH took 1.741 ms a frame in the generic instance, 1.446 in its
# own; H100 run 11). Mirrors cp_megaframe.cu's SPECIALIZED.
GENERIC = 512
# RAW (timing only, wrong results): the GEMVs take each FP8 weight word's bits as floats,
# unconverted: the conversion's share of the linear time (an instance of its own)
RAW = 1024
# EARLY_FREE (with PRODUCER): a stage's buffer goes back to the producer when its CTA arrives
# at the stage's grid barrier, not at the next stage's top, so the copy NBUF - 1 stages ahead
# streams while the CTA waits (the ncu profile: the barrier after A, during which C's 48 KB
# copy is in flight, took twice the others, ~45 % of it in the release fence). Measured (H100
# run 13): 6 % slower, the wait moves to the next stages' weights; off.
EARLY_FREE = 2048
# TAGGED: C's act and D's d as tagged 64-bit words (value bits | writing stage's id + 1 << 32),
# polled by their readers: no grid barrier after C or D (2 of a layer's 4), no release fence
# there; o rotates over three buffers by layer (6 rows: `scratch`). Not with SPLIT_DOWN.
# TAGGED_QKV (with TAGGED): A's qkv tagged too, so B polls its head's rows and the barrier
# after A goes: one grid barrier a layer is left (after B). Measured (H100 run 14): TAGGED
# alone 6-8 % slower, with TAGGED_QKV level (the barriers' time was the slowest producer's,
# which a poll waits for as long); served with WARP_QK (ENGINE_EXTRA).
TAGGED, TAGGED_QKV = 4096, 8192
# WARP_QK: stage B's q/k norms and RoPE by one warp a vector (one block sync, not five a token)
WARP_QK = 16384
SPECIALIZED = (SERVED_OPTS, FETCH, FETCH | TWO_TOKEN, FETCH | XREDUCE, SERVED_OPTS | RAW,
               SERVED_OPTS | EARLY_FREE, SERVED_OPTS | TAGGED, SERVED_OPTS | TAGGED | TAGGED_QKV,
               SERVED_OPTS | TAGGED | TAGGED_QKV | WARP_QK, SERVED_OPTS | WARP_QK)


def specialized(opts: int, barrier: int = 0) -> bool:
    """Whether the full frame with `opts` and grid barrier variant `barrier` (the kernel's
    flag_barrier; such instances have the plain one, 0, only) runs an instance compiled for
    them."""
    return barrier == 0 and not opts & GENERIC and (opts & ~COOPERATIVE) in SPECIALIZED


# The kernel's tensors, in its argument order
ORDER = ("wqkv", "sqkv", "wo", "so", "wgu", "sgu", "wd", "sd", "whead", "shead", "in_norm",
         "post_norm", "q_norm", "k_norm", "final_norm", "tables", "x_in", "rope_cos",
         "rope_sin", "qkv", "o", "act", "d", "logits", "kcache", "vcache", "tokens", "counter",
         "wdt")
_LINEARS = ("qkv", "o", "gu", "d", "head")
# ORDER's weights (the rest: the kernel's buffers and inputs)
_WEIGHTS = ("wqkv", "sqkv", "wo", "so", "wgu", "sgu", "wd", "sd", "whead", "shead", "in_norm",
            "post_norm", "q_norm", "k_norm", "final_norm", "tables", "rope_cos", "rope_sin",
            "wdt")

# the heads' dtypes the kernel takes: FP8 (EnginePlan.cp_heads_fp8) or the engine's bf16 heads,
# read as they are (no FP8 copy beside them)
HEAD_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


def _rows(dense: Dense) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale a row): FP8 as held, else the weight as held with scales of 1."""
    if dense.is_fp8:
        return dense.weight, dense.scale.float()
    w = dense.weight
    return w, torch.ones(w.shape[0], device=w.device)


def _linears(stack: PackedStack, heads: list[Dense]) -> dict[str, list[Dense]]:
    """The kernel's linears by name (as ORDER's "w" + name): each layer's, then the heads."""
    layers = stack.layers
    return {"qkv": [p.qkv for p in layers], "o": [p.o for p in layers],
            "gu": [p.gate_up for p in layers], "d": [p.down for p in layers], "head": heads}


def pack(stack: PackedStack, heads: list[Dense], project: Callable[[torch.Tensor], torch.Tensor],
         embeddings: torch.Tensor, one_allocation: bool = False) -> dict[str, torch.Tensor]:
    """The kernel's weights (names as ORDER; W_o row-major, `kernel_tensors` stores it
    head-major) from the code predictor as the engine holds it: its packed stack (qkv and
    gate/up rows concatenated), the heads of codebooks 1..G-1, small_to_mtp_projection
    (`project`), and the talker-width input embeddings of codebooks 1..G-1 ([G - 1, V, talker
    hidden]), of which 1..G-2 are folded through the projection into lookup tables (float32).
    Weights keep their dtype (FP8 with its scales; a float one with scales of 1): the kernel
    takes FP8 linears and FP8 or bf16 heads. one_allocation: the stacked linears and heads
    copied into one allocation (`l2_persist.arena`), so one L2 access-policy window covers
    them (TTSBUILD_CP_L2_PERSIST; off, pack makes no second copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, denses in _linears(stack, heads).items():
        ws, ss = zip(*(_rows(d) for d in denses), strict=True)
        out["w" + name], out["s" + name] = torch.stack(ws), torch.stack(ss)
    if one_allocation:  # (`share_weights` then makes the engine's linears views of it)
        stacked = ["w" + name for name in _LINEARS]
        for k, v in zip(stacked, l2_persist.arena([out[k] for k in stacked]), strict=True):
            out[k] = v
    with torch.no_grad():
        out["in_norm"] = torch.stack([layer.input_norm for layer in stack.layers]).float()
        out["post_norm"] = torch.stack([layer.post_norm for layer in stack.layers]).float()
        out["q_norm"] = torch.stack([layer.q_norm for layer in stack.layers]).float()
        out["k_norm"] = torch.stack([layer.k_norm for layer in stack.layers]).float()
        out["final_norm"] = stack.norm.float()
        groups = len(heads) + 1
        out["tables"] = torch.stack([project(embeddings[j]) for j in range(groups - 2)]).float()
        out["rope_cos"], out["rope_sin"] = rope_tables(groups, stack.cfg.head_dim,
                                                       stack.cfg.rope_theta, stack.norm.device)
    return {k: v.detach().contiguous() for k, v in out.items()}


def share_weights(m: dict[str, torch.Tensor], stack: PackedStack, heads: list[Dense]) -> None:
    """Make the code predictor's linears and heads views of `pack`'s stacked weights (and an
    FP8 one's scales), the same values, so each weight is held once (a float head's module
    weight must follow: `GraphEngine` points it at the view)."""
    for name, denses in _linears(stack, heads).items():
        for i, d in enumerate(denses):
            w, s = m["w" + name][i], m["s" + name][i]
            if d.is_fp8:
                same = (torch.equal(w.view(torch.uint8), d.weight.view(torch.uint8))
                        and torch.equal(s, d.scale.float()))  # fmt: skip
            else:
                same = w.dtype == d.weight.dtype and torch.equal(w, d.weight)
            if not same:
                raise ValueError(f"cp_megaframe: the packed {name}[{i}] differs from the "
                                 f"stack's")  # fmt: skip
            d.weight = w
            if d.is_fp8:
                d.scale = s


def rope_tables(groups: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, ...]:
    """cos and sin [groups, head_dim / 2] of positions 0..groups-1 (the model's rotary
    embedding, `rope_cos_sin`, whose second half repeats the first)."""
    cos, sin = rope_cos_sin(torch.arange(groups, device=device), head_dim, theta, torch.float32)
    return cos[:, :head_dim // 2], sin[:, :head_dim // 2]


def pack_module(cp, fp8: bool, bf16_heads: bool = False) -> dict[str, torch.Tensor]:
    """`pack` of a `ttsbuild.model.talker.CodePredictor` (FP8 rows, or its float weights);
    bf16_heads: its heads in bf16 instead (as an engine serves them beside FP8 layers)."""
    stack = PackedStack.from_module(cp.model, fp8)
    heads = [Dense(h.weight.detach().to(torch.bfloat16)) if bf16_heads
             else Dense.make(h.weight.detach(), fp8) for h in cp.lm_head]  # fmt: skip
    embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
    return pack(stack, heads, cp.small_to_mtp_projection, embeddings)


def shape_of(m: dict[str, torch.Tensor]) -> dict[str, int]:
    """`pack`'s tensors' shapes, named as SHAPE."""
    n_layers, qkv_rows, hidden = m["wqkv"].shape
    hd = m["q_norm"].shape[-1]
    heads = m["wo"].shape[-1] // hd
    return {"layers": n_layers, "hidden": hidden, "heads": heads,
            "kv_heads": (qkv_rows // hd - heads) // 2, "head_dim": hd,
            "intermediate": m["wd"].shape[-1], "vocab": m["whead"].shape[1],
            "groups": m["rope_cos"].shape[0]}


def xreduce_lanes(values: torch.Tensor) -> torch.Tensor:
    """The kernel's `xreduce` on the host: values [32 lanes, R] (R a power of 2) -> what each
    lane holds at the end [32]: in each of the first log2 R rounds (lane bit 16, 8, ...) a lane
    keeps the upper half of its values where that bit is set, else the lower half, and adds
    its partner's copy of that half; the value left is summed over the remaining lane bits.
    Lane l ends with row l >> (5 - log2 R)'s sum (tests/runtime/test_megaframe_reference.py)."""
    s = values.clone()
    lanes = torch.arange(32)
    n, o = s.shape[1], 16
    while n > 1:
        h = n // 2
        upper = (lanes & o).bool()[:, None]
        keep = torch.where(upper, s[:, h:n], s[:, :h])
        send = torch.where(upper, s[:, :h], s[:, h:n])
        s = keep + send[lanes ^ o]
        n, o = h, o // 2
    v = s[:, 0]
    while o > 0:
        v = v + v[lanes ^ o]
        o //= 2
    return v


def config_shape(cfg) -> dict[str, int]:
    """SHAPE's entries of a checkpoint's ModelConfig (its code predictor's stack)."""
    c = cfg.code_predictor
    return {"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "intermediate": c.intermediate_size, "vocab": cfg.codebook_size,
            "groups": cfg.num_code_groups}


def unsupported_config(cfg) -> str | None:
    """Why the kernel cannot run a checkpoint of this ModelConfig, or None (before any weight
    is packed: `compile` refuses at once)."""
    return _mismatch(config_shape(cfg), "this checkpoint's")


def _mismatch(got: dict[str, int], whose: str) -> str | None:
    if got == SHAPE:
        return None
    diff = {k: v for k, v in got.items() if v != SHAPE[k]}
    return (f"the kernel is built for the shipped 12 Hz code predictor's shapes (0.6B and 1.7B "
            f"alike) {SHAPE}; {whose} differ: {diff}")


def unsupported_device(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device`, or None: it is built for sm_90a only (TMA,
    mbarriers), so neither older GPUs nor Blackwell."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "needs a Hopper GPU (CUDA compute capability 9.0, H100 / H200)"
    return None


def unsupported(m: dict[str, torch.Tensor]) -> str | None:
    """Why the kernel cannot run these weights, or None."""
    why = _mismatch(shape_of(m), "these weights'")
    if why:
        return why
    if any(m["w" + k].dtype != torch.float8_e4m3fn for k in _LINEARS if k != "head"):
        return ("the kernel takes FP8 e4m3 weights only (an engine compiled with an FP8 code "
                "predictor)")
    if m["whead"].dtype not in HEAD_DTYPES:
        return f"the kernel takes FP8 e4m3 or bf16 heads, not {m['whead'].dtype}"
    return None


def reference(m: dict[str, torch.Tensor], x_in: torch.Tensor, tokens: torch.Tensor,
              eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 logits [G - 1, V] and K/V caches [L, NKV, G, HD] of the kernel's math, on m's
    device: x_in [2, hidden] the projected inputs of positions 0 and 1 (the talker's hidden
    state, codebook 0's embedding), teacher-forced on `tokens` (the codes of codebooks
    1..G-2: position p >= 2 reads row tokens[p - 2] of table p - 2). Any shapes."""
    deq = {k: m["w" + k].float() * m["s" + k][..., None].float() for k in _LINEARS}
    s = shape_of(m)
    n_layers, hd, nh, nkv = s["layers"], s["head_dim"], s["heads"], s["kv_heads"]
    inter, groups, vocab = s["intermediate"], s["groups"], s["vocab"]
    dev = m["wqkv"].device

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(t, pos):  # t [n, hd]
        c = torch.cat([m["rope_cos"][pos]] * 2)
        s = torch.cat([m["rope_sin"][pos]] * 2)
        rot = torch.cat([-t[:, hd // 2:], t[:, :hd // 2]], dim=1)
        return t * c + rot * s

    kc = torch.zeros(n_layers, nkv, groups, hd, device=dev)
    vc = torch.zeros_like(kc)
    logits = torch.zeros(groups - 1, vocab, device=dev)
    for pos in range(groups):
        x = x_in[pos] if pos < 2 else m["tables"][pos - 2][int(tokens[pos - 2])]
        x = x.float().clone()
        for layer in range(n_layers):
            qkv = deq["qkv"][layer] @ rms(x, m["in_norm"][layer])
            q = qkv[:nh * hd].view(nh, hd)
            k = qkv[nh * hd:(nh + nkv) * hd].view(nkv, hd)
            v = qkv[(nh + nkv) * hd:].view(nkv, hd)
            q = rope(rms(q, m["q_norm"][layer]), pos)
            k = rope(rms(k, m["k_norm"][layer]), pos)
            kc[layer, :, pos], vc[layer, :, pos] = k, v
            kk = kc[layer, :, :pos + 1].repeat_interleave(nh // nkv, dim=0)  # [nh, pos+1, hd]
            vv = vc[layer, :, :pos + 1].repeat_interleave(nh // nkv, dim=0)
            p = torch.softmax((kk @ q[:, :, None]).squeeze(-1) / math.sqrt(hd), dim=-1)
            att = (p[:, None, :] @ vv).squeeze(1).reshape(-1)
            x = x + deq["o"][layer] @ att
            gu = deq["gu"][layer] @ rms(x, m["post_norm"][layer])
            x = x + deq["d"][layer] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:])
        if pos >= 1:
            logits[pos - 1] = deq["head"][pos - 1] @ rms(x, m["final_norm"])
    return logits, kc, vc


def reference_draws(logits: torch.Tensor, sampling: SamplingBatch, seeds: torch.Tensor,
                    frames: torch.Tensor) -> list[int]:
    """`sampling.sample`'s code for each codebook 1..G-1 from a frame's logits [G - 1, V]
    (row 0 of `sampling`, `seeds`, `frames`): what the kernel must draw from `reference`'s
    logits."""
    groups = logits.shape[0] + 1
    return [int(sample(logits[i:i + 1], sampling, seeds, draw_counter(frames, groups, i + 1)))
            for i in range(groups - 1)]


def near_tie(logits: torch.Tensor, sampling: SamplingBatch, seeds: torch.Tensor,
             frames: torch.Tensor, codebook: int, groups: int = SHAPE["groups"]) -> bool:
    """Whether float summation order may decide `codebook`'s draw (1..G-1; logits [V] of
    its pass, row 0 of the settings): its top two scores (logits, or logits / T + Gumbel
    noise) within 1e-4 of the logits' spread, or, with top-p, a cumulative probability within
    1e-5 of 1 - p. The kernel sums in another order than `reference`: a code differing from
    `reference_draws` is allowed only there."""
    z = logits.double()
    do_sample, top_p = bool(sampling.do_sample[0]), float(sampling.top_p[0])
    temperature = float(sampling.temperature[0])
    if do_sample and top_p < 1:
        mass = torch.softmax(logits.float() / temperature, -1).sort().values.cumsum(-1)
        if bool(((mass - (1 - top_p)).abs() < 1e-5).any()):
            return True
    if do_sample:
        u = uniform_noise(seeds, draw_counter(frames, groups, codebook), z.numel())[0].double()
        z = z / temperature - torch.log(-torch.log(u))
    top2 = z.topk(2).values
    return float(top2[0] - top2[1]) < 1e-4 * float(logits.std())


@functools.cache
def extension(threads: int = 256):
    """The kernel's extension, compiled for sm_90a on first use (~1-2 minutes; cached by
    torch.utils.cpp_extension across processes). threads: the stages' threads a CTA (256, or
    512: 16 warps, an extension of its own built with -DMEGAFRAME_THREADS=512)."""
    from torch.utils.cpp_extension import load

    if threads not in THREADS_CHOICES:
        raise ValueError(f"threads: one of {THREADS_CHOICES}, not {threads}")
    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]
    name = "ttsbuild_cp_megaframe"
    if threads != 256:
        flags, name = flags + [f"-DMEGAFRAME_THREADS={threads}"], f"{name}_t{threads}"
    if os.environ.get(LINEINFO_ENV) == "1":  # a profile's source lines (same machine code)
        flags, name = flags + ["-lineinfo"], name + "_lineinfo"
    return load(name=name, sources=[str(SOURCE)], verbose=False, extra_cuda_cflags=flags)


def scratch(device) -> dict[str, torch.Tensor]:
    """The kernel's working buffers (its activations, logits, per-frame K/V caches, tokens and
    barrier words): the ORDER names after `x_in`'s inputs. The activations have two rows (a
    pass of two tokens, TWO_TOKEN)."""
    f = dict(device=device, dtype=torch.float32)
    s = SHAPE
    qkv = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    cache = (s["layers"], s["kv_heads"], s["groups"], s["head_dim"])
    # room for TAGGED and TAGGED_QKV too: o three buffers (rotating by layer) of two rows; qkv,
    # act and d a 64-bit tagged word a value
    return {
        "qkv": torch.zeros(4, qkv, **f), "o": torch.zeros(6, s["hidden"], **f),
        "act": torch.zeros(4, s["intermediate"], **f), "d": torch.zeros(4, s["hidden"], **f),
        "logits": torch.zeros(s["groups"] - 1, s["vocab"], **f),
        "kcache": torch.zeros(cache, **f), "vcache": torch.zeros(cache, **f),
        "tokens": torch.zeros(s["groups"] - 1, device=device, dtype=torch.int32),
        "counter": torch.zeros(256, device=device, dtype=torch.int32),  # >= 32 x 8 stripes
    }


# the weights `kernel_tensors` lays out anew (copies): another instance's can be shared
_RELAID = ("wo", "wdt")


def kernel_tensors(m: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                   wdt: bool = True, like: list[torch.Tensor] | None = None
                   ) -> list[torch.Tensor]:
    """The kernel's 29 arguments (ORDER) from `pack`'s weights, x_in and `scratch`'s buffers:
    FP8 as uint8 views, W_o head-major ([L, heads, hidden, head_dim]: a CTA's slice of its
    head's columns is one contiguous copy), and W_d transposed as `wdt` ([L, intermediate,
    hidden]: SPLIT_DOWN's column slice of a CTA, one contiguous copy; wdt False: an empty
    tensor in its place, for a kernel run without SPLIT_DOWN). like: another call's list on
    the same weights, whose W_o and W_d copies are taken instead of made again."""
    out = []
    for i, name in enumerate(ORDER):
        if like is not None and name in _RELAID:
            out.append(like[i])
            continue
        if name == "wdt":
            wd = m["wd"]
            out.append(wd.transpose(1, 2).contiguous().view(torch.uint8) if wdt
                       else torch.empty(0, dtype=torch.uint8, device=wd.device))
            continue
        t = m[name] if name in m else buffers[name]
        if name == "wo":
            s = SHAPE
            t = t.view(s["layers"], s["hidden"], s["heads"], s["head_dim"])
            t = t.permute(0, 2, 1, 3).contiguous()
        out.append(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    return out


THREADS_CHOICES = (256, 512)  # the kernel's stage threads a CTA (MEGAFRAME_THREADS)
THREADS_ENV = "TTSBUILD_MEGAFRAME_THREADS"  # an experiment's switch: the engine's kernel build
LINEINFO_ENV = "TTSBUILD_MEGAFRAME_LINEINFO"  # 1: built with -lineinfo (profile_megaframe)
EXTRA_ENV = "TTSBUILD_MEGAFRAME_EXTRA"  # an experiment's switch: options beside the served
# The engine's options beside SERVED_OPTS unless $EXTRA_ENV names others ("0": none): the
# tagged words and WARP_QK. H100, the same call (benchmarks/kernels/2026-12-06-h100-megaframe-
# tagged, benchmarks/runtime/2026-12-06-h100-megaengine-warpqk): the kernel's frame 1.328 ->
# 1.249 ms greedy, 1.355 -> 1.292 sampled (its checks pass: the fp32 reference's tokens,
# logits within 4e-7); in the engine, lane only, the idle first chunk 4.00 -> 3.95 ms (its
# frame 1.43 -> 1.39) and beside 1 / 63 stepping rows 4.85 / 4.92 -> 4.72 / 4.83 ms.
ENGINE_EXTRA = TAGGED | TAGGED_QKV | WARP_QK


def threads_from_env() -> int:
    """The stage threads the engine's kernel is built with: $TTSBUILD_MEGAFRAME_THREADS (256 or
    512; unset: 256), an experiment's switch to time the 512-thread build in the engine."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return 256
    if not raw.isdigit() or int(raw) not in THREADS_CHOICES:
        raise ValueError(f"${THREADS_ENV}: one of {THREADS_CHOICES}, not {raw!r}")
    return int(raw)


# The options $EXTRA_ENV may name, by name (its error message lists them)
EXTRA_OPTIONS = {"TWO_TOKEN": TWO_TOKEN, "XREDUCE": XREDUCE, "KV_AHEAD": KV_AHEAD,
                 "SPLIT_DOWN": SPLIT_DOWN, "EARLY_FREE": EARLY_FREE, "TAGGED": TAGGED,
                 "TAGGED_QKV": TAGGED_QKV, "WARP_QK": WARP_QK}


def engine_opts() -> int:
    """The engine's options: SERVED_OPTS and a cooperative launch, plus ENGINE_EXTRA, or what
    $EXTRA_ENV asks for instead of the EXTRA_OPTIONS (an integer, 0 for none; unset or empty:
    ENGINE_EXTRA; for timing options in the engine before they are served)."""
    raw = os.environ.get(EXTRA_ENV, "").strip() or str(ENGINE_EXTRA)
    try:
        extra = int(raw, 0)
    except ValueError:
        raise ValueError(f"{EXTRA_ENV} must be an integer of option bits, got {raw!r}") from None
    if extra & ~functools.reduce(operator.or_, EXTRA_OPTIONS.values()):
        names = ", ".join(f"{name} ({bit})" for name, bit in EXTRA_OPTIONS.items())
        raise ValueError(f"{EXTRA_ENV}={extra}: only {names} can be added")
    if extra & TAGGED and extra & SPLIT_DOWN:
        raise ValueError(f"{EXTRA_ENV}={extra}: TAGGED and SPLIT_DOWN do not go together")
    if extra & TAGGED_QKV and not extra & TAGGED:
        raise ValueError(f"{EXTRA_ENV}={extra}: TAGGED_QKV needs TAGGED")
    return SERVED_OPTS | COOPERATIVE | extra


class Megaframe:
    """The kernel for one engine's code predictor: `run` fills codebooks 1..G-1 of a batch-1
    frame from its projected inputs (capturable in a CUDA graph: every input is read from
    device memory at each replay)."""

    def __init__(self, m: dict[str, torch.Tensor], eps: float, ctas: int | None = None,
                 opts: int = SERVED_OPTS | COOPERATIVE, like: Megaframe | None = None):
        """like: an instance on the same weights `m` and options (another stream's): its
        re-laid-out weights are shared, not copied again."""
        why = unsupported(m)
        if why:
            raise ValueError(f"cp_megaframe: {why}")
        device = m["wqkv"].device
        why = unsupported_device(device)
        if why:
            raise ValueError(f"cp_megaframe: {why}; turn megaframe_code_predictor off elsewhere")
        self.ext = extension(threads_from_env())
        self.eps, self.opts = eps, opts
        self.ctas = ctas or torch.cuda.get_device_properties(device).multi_processor_count
        self.buffers = scratch(device)
        self.x_in = torch.zeros(2, SHAPE["hidden"], device=device)
        if like is not None and like.opts != opts:
            raise ValueError("cp_megaframe: a shared instance must have the same options")
        self.args = kernel_tensors({**m, "x_in": self.x_in}, self.buffers,
                                   wdt=bool(opts & SPLIT_DOWN),
                                   like=None if like is None else like.args)
        self.no_stamps = torch.empty(0, dtype=torch.int64, device=device)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The kernel's weight arguments (not its buffers or inputs), for memory reports."""
        return [t for name, t in zip(ORDER, self.args, strict=True) if name in _WEIGHTS]

    def run(self, x_in: torch.Tensor, sampling: SamplingBatch, seeds: torch.Tensor,
            frames: torch.Tensor, row: int = 0) -> torch.Tensor:
        """Codes of codebooks 1..G-1 [G - 1] (int32, the kernel's buffer: copy before the
        next run) of row `row` of `sampling`, `seeds` and `frames` (int64), from x_in [2,
        hidden] (small_to_mtp_projection of the talker's hidden state and codebook 0's
        embedding), drawn as `sampling.sample` (temperature, top-k, top-p)."""
        self.x_in.copy_(x_in)
        self.ext.run(self.args, 0, self.ctas, self.no_stamps, sampling.do_sample,
                     sampling.top_k, sampling.temperature, sampling.top_p, seeds, frames, row,
                     self.eps, 0, self.opts, 0)
        return self.buffers["tokens"]
