"""Triton: one code-predictor pass (projection, every decoder layer, the head) in ONE launch.

A persistent kernel: one program per SM walks the pass's stages in order, and all programs
meet at a grid barrier between stages (each stage reads what every program wrote in the one
before). Stages, numbered as `stage` below:
  0             x = proj(table[idx]) (+ bias), or the row itself without a projection
  1 + 5 l + 0   qkv = rms_norm(x) @ Wqkv.T                    (layer l)
  1 + 5 l + 1   q/k norm + RoPE + K/V cache write + attention  (qk_norm_rope_attend's body)
  1 + 5 l + 2   x += attn @ Wo.T
  1 + 5 l + 3   act = silu(h @ Wg.T) * (h @ Wu.T), h = rms_norm(x)
  1 + 5 l + 4   x += act @ Wd.T
  1 + 5 L       logits = rms_norm(x) @ Whead.T (fp32)
A linear stage splits its output columns into BLOCK_N tiles dealt round-robin to the
programs; each tile is the tile of `fused_linear` (the same `_mac` and `_epilogue`, so the
same arithmetic and rounding), its weights read once for all rows. Activations written by
other programs are read with .cg (from L2: L1 is not coherent across SMs). A residual tile
is read and written only by the program that owns its column tile in every stage, so the
in-place residual update needs no extra care.

The grid barrier (`_grid_sync`) is a generation barrier on two int32 words that never need
resetting: arrive on the count; the last to arrive zeroes it and bumps the generation, the
others spin on the generation. It needs every program resident at once, so the grid is at
most one program per SM. Under the Triton interpreter, which runs programs one after
another, SYNC=False and the host launches one stage at a time: the same stage code, checked
on CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ttsbuild.plugins._tl._math import l2_prefetch_tile
from ttsbuild.plugins._tl.fused_linear import _epilogue, _load_residual, _mac, _out_vectors
from ttsbuild.plugins._tl.qk_norm_rope_attend import attend_item, kv_group_of, old_kv

STAGES_PER_LAYER = tl.constexpr(5)


GEN_OFFSET = tl.constexpr(32)  # the generation word sits a 128-byte line after the count
EXIT_OFFSET = tl.constexpr(64)  # the counting barrier's exit word, a line further


@triton.jit
def _grid_sync(bar_ptr, NPROG):
    tl.debug_barrier()  # this program's stores of the stage are issued
    gen_ptr = bar_ptr + GEN_OFFSET
    gen = tl.load(gen_ptr, volatile=True)  # ordered before the arrival by its acq_rel
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NPROG - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(gen_ptr, 1, sem="release", scope="gpu")
    else:
        cur = tl.load(gen_ptr, volatile=True)
        while cur == gen:
            cur = tl.load(gen_ptr, volatile=True)
        tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_linear(w_ptr, pid, NPROG, N: tl.constexpr, K: tl.constexpr,
                     BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr):  # fmt: skip
    """This program's weight tiles of a `_linear_stage` (the same tiles, dealt the same way)
    into L2: a tile's BLOCK_N rows of [N, K] row-major weights are one contiguous block."""
    for tile in range(pid, tl.cdiv(N, BLOCK_N), NPROG):
        l2_prefetch_tile(w_ptr, tile * BLOCK_N, N, K, BLOCK_N, GATE_UP)


@triton.jit
def _prefetch_stage(
    stage, pid, NPROG, pw_ptr, qkv_w_ptr, o_w_ptr, gu_w_ptr, down_w_ptr, head_w_ptr,
    L: tl.constexpr, H: tl.constexpr, I: tl.constexpr, V: tl.constexpr, NQKV: tl.constexpr,
    NO: tl.constexpr, SRC_K: tl.constexpr, BN_PROJ: tl.constexpr, BN_QKV: tl.constexpr,
    BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr, BN_HEAD: tl.constexpr,
    HAS_PROJ: tl.constexpr, HAS_HEAD: tl.constexpr,
):  # fmt: skip
    """The weights `stage` of `cp_pass_kernel` will read, this program's tiles, into L2 (an
    attention stage reads none)."""
    if stage == 0:
        if HAS_PROJ:
            _prefetch_linear(pw_ptr, pid, NPROG, H, SRC_K, BN_PROJ, False)
    elif stage == 1 + STAGES_PER_LAYER * L:
        if HAS_HEAD:
            _prefetch_linear(head_w_ptr, pid, NPROG, V, H, BN_HEAD, False)
    elif stage < 1 + STAGES_PER_LAYER * L:
        rel = stage - 1
        lw = tl.cast(rel // STAGES_PER_LAYER, tl.int64)
        kind = rel % STAGES_PER_LAYER
        if kind == 0:
            _prefetch_linear(qkv_w_ptr + lw * NQKV * H, pid, NPROG, NQKV, H, BN_QKV, False)
        elif kind == 2:
            _prefetch_linear(o_w_ptr + lw * H * NO, pid, NPROG, H, NO, BN_O, False)
        elif kind == 3:
            _prefetch_linear(gu_w_ptr + lw * 2 * I * H, pid, NPROG, I, H, BN_GU, True)
        elif kind == 4:
            _prefetch_linear(down_w_ptr + lw * H * I, pid, NPROG, H, I, BN_DOWN, False)


@triton.jit
def _ld_acquire(ptr):
    """*ptr (int32) by a gpu-scope acquire load (`ld.acquire.gpu`, sm_70+)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr.to(tl.int64)], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _grid_sync_count(bar_ptr, target):
    """A counting grid barrier: arrive (release), then wait until the count reaches `target`
    (the launch's barriers so far times its programs) and acquire. The count is not reset
    between barriers (`_count_exit` zeroes it when the launch ends), so the last program to
    arrive makes no second and third atomic (reset, generation flip) before the others may
    go on, and no program reads a generation word first: about half the dependent L2 round
    trips of `_grid_sync` on the critical path."""
    tl.debug_barrier()  # this program's stores of the stage are issued
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")  # (a `red`: nothing waits for it)
    # Polls with acquire loads: an acquire RMW after a relaxed poll loop, as `_grid_sync`
    # has it, compiles to nothing when its result is unused (no atom in its PTX, 2026-12-04)
    cur = _ld_acquire(bar_ptr)
    while cur < target:
        cur = _ld_acquire(bar_ptr)
    tl.debug_barrier()


@triton.jit
def _count_exit(bar_ptr, NPROG):
    """A launch's end under `_grid_sync_count`: the last program out (every program has
    passed every barrier by then) zeroes the count and the exit word for the next launch,
    which stream order starts after this one ends."""
    tl.debug_barrier()
    out = tl.atomic_add(bar_ptr + EXIT_OFFSET, 1, sem="acq_rel", scope="gpu")
    if out == NPROG - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + EXIT_OFFSET, 0, sem="release", scope="gpu")


@triton.jit
def barrier_bench_kernel(bar_ptr, n, COUNT: tl.constexpr = False):
    """n grid barriers and nothing else: what one costs (benchmarks/kernels); COUNT: the
    counting barrier."""
    for i in range(n):
        if COUNT:
            _grid_sync_count(bar_ptr, (i + 1) * tl.num_programs(0))
        else:
            _grid_sync(bar_ptr, tl.num_programs(0))
    if COUNT:
        _count_exit(bar_ptr, tl.num_programs(0))


@triton.jit
def _k_step(
    acc_g, acc_u, sq, k0, x_cols, nw_ptr, g_rows, u_rows, n_mask, m_mask, K,
    X_DTYPE: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr, PRE_NORM: tl.constexpr,
    GATE_UP: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    xm = m_mask[None, :] & k_mask[:, None]
    xt = tl.load(x_cols + offs_k[:, None], mask=xm, other=0.0, cache_modifier=".cg")
    if PRE_NORM:  # the rows' sums of squares ride along, elementwise, reduced after the loop
        xf = xt.to(tl.float32)
        sq += xf * xf
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        xt = (xf * nw[:, None]).to(X_DTYPE)
    w_mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0)
    # GEMV (BM == 1): elementwise products accumulate; no cross-thread reduction between the
    # K steps, so the unrolled steps' loads can all be in flight. MMA tiles: tl.dot.
    acc_g = _mac(acc_g, w, xt, BM, DOT_F32)
    if GATE_UP:
        wu = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0)
        acc_u = _mac(acc_u, wu, xt, BM, DOT_F32)
    return acc_g, acc_u, sq


@triton.jit
def _linear_stage(
    x_ptr, idx_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, B, eps, pid, NPROG,
    N: tl.constexpr, K: tl.constexpr, STRIDE_X: tl.constexpr, STRIDE_O: tl.constexpr,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr,
    PRE_NORM: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, GATE_UP: tl.constexpr, DOT_F32: tl.constexpr,
    gcnt_ptr=None, COUNT: tl.constexpr = False, HQ: tl.constexpr = 1, HKV: tl.constexpr = 1,
    D: tl.constexpr = 1, GROUP: tl.constexpr = 1,
):  # fmt: skip
    """out[b, n] = epilogue(sum_k prologue(x)[b, k] w[n, k]) for this program's column tiles
    (w is [N, K] row-major, [2N, K] with GATE_UP; HAS_RES: out is the residual, updated in
    place). The K loop is unrolled (K is a constant), so a tile's weight loads are all
    issued before the first is used: a program has one tile in flight, not one K step.
    COUNT (the qkv stage, BLOCK_N dividing D): each tile written counts toward its KV group
    (that of its q head, k head or v head) on gcnt_ptr; returns a bit mask of the groups whose
    last tile this program wrote (their counters reset), for it to attend."""
    won = tl.cast(0, tl.int32)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < B
    if GATHER:
        rows = tl.load(idx_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    x_cols = x_ptr + rows[None, :] * STRIDE_X
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    for tile in range(pid, tl.cdiv(N, BLOCK_N), NPROG):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        g_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
        u_rows = g_rows + N * K  # GATE_UP: the up half of the packed matrix
        if BM == 1:  # GEMV: elementwise [BLOCK_N, BLOCK_K] products, reduced after the loop
            acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_N, BM), tl.float32)
        acc_u = tl.zeros_like(acc_g)
        # PRE_NORM: each row's sum of squares over all of K, gathered in the tile's own K
        # loop (recomputed per tile: a program has about one), so no separate pass over x
        # stands between the stage's start and its weight loads
        sq = tl.zeros((BLOCK_K, BM), tl.float32)
        if BM == 1:  # unrolled: every K step's weight loads in flight at once
            for k0 in tl.static_range(0, K, BLOCK_K):
                acc_g, acc_u, sq = _k_step(
                    acc_g, acc_u, sq, k0, x_cols, nw_ptr, g_rows, u_rows, n_mask, m_mask, K,
                    X_DTYPE, BM, BLOCK_K, PRE_NORM, GATE_UP, DOT_F32,
                )  # fmt: skip
        else:  # MMA tiles: a software-pipelined loop (unrolled, their smem would not fit)
            for kt in range(0, K, BLOCK_K):
                acc_g, acc_u, sq = _k_step(
                    acc_g, acc_u, sq, kt, x_cols, nw_ptr, g_rows, u_rows, n_mask, m_mask, K,
                    X_DTYPE, BM, BLOCK_K, PRE_NORM, GATE_UP, DOT_F32,
                )  # fmt: skip
        ss = tl.sum(sq, axis=0)
        if BM == 1:
            acc_g = tl.sum(acc_g, axis=1)[:, None]
            acc_u = tl.sum(acc_u, axis=1)[:, None]
        sc, sc_u, bias = _out_vectors(s_ptr, b_ptr, offs_n, n_mask, N, HAS_SCALE, HAS_BIAS,
                                      GATE_UP)  # fmt: skip
        r = _load_residual(out_ptr, offs_n, n_mask, offs_m, m_mask, STRIDE_O, HAS_RES)
        _epilogue(
            acc_g, acc_u, ss, K, eps, offs_n, n_mask, offs_m, m_mask, sc, sc_u, bias, r,
            out_ptr, STRIDE_O,
            X_DTYPE, PRE_NORM, HAS_SCALE, HAS_BIAS, HAS_RES, GATE_UP,
        )  # fmt: skip
        if COUNT:  # as norm_linear_attend's protocol: stores issued, then the release
            kvh = kv_group_of(tile * BLOCK_N // D, HQ, HKV, GROUP)
            tl.debug_barrier()
            arrived = tl.atomic_add(gcnt_ptr + kvh, 1, sem="acq_rel", scope="gpu")
            if arrived == (GROUP + 2) * (D // BLOCK_N) - 1:
                tl.atomic_xchg(gcnt_ptr + kvh, 0, sem="relaxed", scope="gpu")
                won = won | (1 << kvh)
    return won


@triton.jit
def _attend(
    qkv_ptr, q_norm_ptr, k_norm_ptr, freqs_ptr, kc_ptr, vc_ptr, attn_ptr, slots_ptr, row, kvh,
    pos64, eps, qk_scale, stride_cslot, stride_ch, stride_cs,
    NQKV: tl.constexpr, NO: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) of a layer (its caches and norms given): q/k norm + RoPE + K/V cache
    write + attention, qk_norm_rope_attend's body."""
    row = tl.cast(row, tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    ok1, ok2, ov1, ov2 = old_kv(
        kc_ptr, vc_ptr, kvh, pos64, slot, stride_cslot, stride_ch, stride_cs, D, BLOCK_S,
    )  # fmt: skip
    attend_item(
        qkv_ptr, q_norm_ptr, k_norm_ptr, freqs_ptr, kc_ptr, vc_ptr, attn_ptr, row, kvh, pos64,
        slot, NQKV, NO, stride_cslot, stride_ch, stride_cs, eps, qk_scale, ok1, ok2, ov1, ov2,
        HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
    )  # fmt: skip


@triton.jit(do_not_specialize=["B", "pos", "stage_lo", "stage_hi"])
def cp_pass_kernel(
    src_ptr, idx_ptr, pw_ptr, pb_ptr,
    in_norm_ptr, qkv_w_ptr, qkv_s_ptr, q_norm_ptr, k_norm_ptr, o_w_ptr, o_s_ptr,
    post_norm_ptr, gu_w_ptr, gu_s_ptr, down_w_ptr, down_s_ptr, norm_ptr, head_w_ptr,
    head_s_ptr, freqs_ptr, slots_ptr, kc_ptr, vc_ptr,
    x_ptr, qkv_ptr, attn_ptr, act_ptr, logits_ptr, bar_ptr, gcnt_ptr,
    B, pos, stage_lo, stage_hi, eps, qk_scale,
    stride_cl, stride_cslot, stride_ch, stride_cs,
    L: tl.constexpr, H: tl.constexpr, I: tl.constexpr, V: tl.constexpr, HQ: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    SRC_K: tl.constexpr, STRIDE_SRC: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr,
    BN_PROJ: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
    BN_DOWN: tl.constexpr, BN_HEAD: tl.constexpr,
    HAS_PROJ: tl.constexpr, HAS_PBIAS: tl.constexpr,
    FP8: tl.constexpr, HEAD_FP8: tl.constexpr, DOT_F32: tl.constexpr, SYNC: tl.constexpr,
    PREFETCH: tl.constexpr = False, HAS_HEAD: tl.constexpr = True,
    ATTEND_IN_QKV: tl.constexpr = False, COUNT_BARRIER: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    nsync = tl.cast(0, tl.int32)  # COUNT_BARRIER: the barriers passed so far
    NPROG = tl.num_programs(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    NO: tl.constexpr = HQ * D
    GROUP: tl.constexpr = HQ // HKV
    pos64 = tl.cast(pos, tl.int64)
    for stage in range(stage_lo, stage_hi):
        if PREFETCH:  # the next two stages' weights into L2 while this one runs
            for ahead in tl.static_range(1, 3):
                if stage + ahead < stage_hi:
                    _prefetch_stage(
                        stage + ahead, pid, NPROG, pw_ptr, qkv_w_ptr, o_w_ptr, gu_w_ptr,
                        down_w_ptr, head_w_ptr, L, H, I, V, NQKV, NO, SRC_K, BN_PROJ, BN_QKV,
                        BN_O, BN_GU, BN_DOWN, BN_HEAD, HAS_PROJ, HAS_HEAD,
                    )  # fmt: skip
        if stage == 0:
            if HAS_PROJ:  # x = table[idx] @ Wp.T + bias
                _linear_stage(
                    src_ptr, idx_ptr, pw_ptr, pw_ptr, pw_ptr, pb_ptr, x_ptr, B, eps, pid, NPROG,
                    H, SRC_K, STRIDE_SRC, H,
                    BM, BN_PROJ, BLOCK_K, True, False, False, HAS_PBIAS, False, False, DOT_F32,
                )  # fmt: skip
            else:  # the table's rows are already of the code predictor's width
                chunks = tl.cdiv(H, BLOCK_K)
                offs = tl.arange(0, BLOCK_K)
                for item in range(pid, B * chunks, NPROG):
                    b = item // chunks
                    cols = (item % chunks) * BLOCK_K + offs
                    row = tl.load(idx_ptr + b).to(tl.int64)
                    v = tl.load(src_ptr + row * STRIDE_SRC + cols, mask=cols < H, other=0.0)
                    tl.store(x_ptr + b * H + cols, v.to(x_ptr.dtype.element_ty), mask=cols < H)
        elif stage == 1 + STAGES_PER_LAYER * L:  # logits = rms_norm(x) @ Whead.T, fp32
            _linear_stage(
                x_ptr, idx_ptr, norm_ptr, head_w_ptr, head_s_ptr, head_w_ptr, logits_ptr, B,
                eps, pid, NPROG, V, H, H, V,
                BM, BN_HEAD, BLOCK_K, False, True, HEAD_FP8, False, False, False, DOT_F32,
            )  # fmt: skip
        else:
            rel = stage - 1
            lw = tl.cast(rel // STAGES_PER_LAYER, tl.int64)
            kind = rel % STAGES_PER_LAYER
            kc_l, vc_l = kc_ptr + lw * stride_cl, vc_ptr + lw * stride_cl
            if kind == 0:  # qkv = rms_norm(x) @ Wqkv.T
                won = _linear_stage(
                    x_ptr, idx_ptr, in_norm_ptr + lw * H, qkv_w_ptr + lw * NQKV * H,
                    qkv_s_ptr + lw * NQKV, qkv_w_ptr, qkv_ptr, B, eps, pid, NPROG,
                    NQKV, H, H, NQKV,
                    BM, BN_QKV, BLOCK_K, False, True, FP8, False, False, False, DOT_F32,
                    gcnt_ptr, ATTEND_IN_QKV, HQ, HKV, D, GROUP,
                )  # fmt: skip
                if ATTEND_IN_QKV:  # the groups whose last qkv tile this program wrote
                    for g in range(HKV):
                        if ((won >> g) & 1) != 0:
                            for row in range(B):
                                _attend(
                                    qkv_ptr, q_norm_ptr + lw * D, k_norm_ptr + lw * D,
                                    freqs_ptr, kc_l, vc_l, attn_ptr, slots_ptr, row, g, pos64,
                                    eps, qk_scale, stride_cslot, stride_ch, stride_cs,
                                    NQKV, NO, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
                                )  # fmt: skip
            elif kind == 1:  # per (row, KV head): norm + RoPE + cache write + attention
                if not ATTEND_IN_QKV:  # (else done at the end of the qkv stage)
                    for item in range(pid, B * HKV, NPROG):
                        _attend(
                            qkv_ptr, q_norm_ptr + lw * D, k_norm_ptr + lw * D, freqs_ptr,
                            kc_l, vc_l, attn_ptr, slots_ptr, item // HKV, item % HKV, pos64,
                            eps, qk_scale, stride_cslot, stride_ch, stride_cs,
                            NQKV, NO, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
                        )  # fmt: skip
            elif kind == 2:  # x += attn @ Wo.T
                _linear_stage(
                    attn_ptr, idx_ptr, post_norm_ptr, o_w_ptr + lw * H * NO, o_s_ptr + lw * H,
                    o_w_ptr, x_ptr, B, eps, pid, NPROG, H, NO, NO, H,
                    BM, BN_O, BLOCK_K, False, False, FP8, False, True, False, DOT_F32,
                )  # fmt: skip
            elif kind == 3:  # act = silu(h @ Wg.T) * (h @ Wu.T), h = rms_norm(x)
                _linear_stage(
                    x_ptr, idx_ptr, post_norm_ptr + lw * H, gu_w_ptr + lw * 2 * I * H,
                    gu_s_ptr + lw * 2 * I, gu_w_ptr, act_ptr, B, eps, pid, NPROG, I, H, H, I,
                    BM, BN_GU, BLOCK_K, False, True, FP8, False, False, True, DOT_F32,
                )  # fmt: skip
            else:  # x += act @ Wd.T
                _linear_stage(
                    act_ptr, idx_ptr, post_norm_ptr, down_w_ptr + lw * H * I,
                    down_s_ptr + lw * H, down_w_ptr, x_ptr, B, eps, pid, NPROG, H, I, I, H,
                    BM, BN_DOWN, BLOCK_K, False, False, FP8, False, True, False, DOT_F32,
                )  # fmt: skip
        if SYNC:
            # with ATTEND_IN_QKV a qkv stage needs none: its (empty) attention stage's comes
            qkv_stage = stage >= 1 and stage < 1 + STAGES_PER_LAYER * L and (
                (stage - 1) % STAGES_PER_LAYER == 0)
            if stage + 1 < stage_hi and not (ATTEND_IN_QKV and qkv_stage):
                if COUNT_BARRIER:
                    nsync += 1
                    _grid_sync_count(bar_ptr, nsync * NPROG)
                else:
                    _grid_sync(bar_ptr, NPROG)
    if SYNC:
        if COUNT_BARRIER:
            _count_exit(bar_ptr, NPROG)
