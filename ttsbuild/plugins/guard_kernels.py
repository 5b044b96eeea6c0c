"""The device guards of `ttsbuild.generation.guards`, one launch each (the eager references,
`frame_stop_codes` and `observe_audio` there, are ~10-15 small kernels each, run every frame
step and every codec step).

    frame_stop_codes_triton(state, cfg, rows [B], c0 [B], eos_id) -> code [B] int64
    per row b, slot s = rows[b]:
      repetition (cfg.repetition): ring = recent_c0[s] ([R = W + P]) shifted left by one with
        c0[b] appended; seen = frames_seen[s] + 1; both written back. For p in 1..P,
        hits[p] = #{j < W : ring[R - W + j] == ring[R - W + j - p]}; the row loops when
        hits[p] >= cfg.repetition_matches and seen >= W + p for some p.
      silence (cfg.silence): heard[s] and silent_frames[s] >= cfg.silence_frames.
      code = EOS if c0[b] == eos_id, else SILENCE, else REPETITION, else CONTINUE.

    observe_audio_triton(state, cfg, rows [B], pcm [B, n * 1920]) -> None
    per row b, slot s = rows[b]: power of frame f = var(pcm[b, f*1920 : (f+1)*1920]) (biased,
    fp32), audible = power >= 10 ** (silence_dbfs / 10); last = the last audible frame or -1;
    heard[s] |= last >= 0; silent_frames[s] = (n - 1 - last if last >= 0 else
    silent_frames[s] + n) if heard[s] else 0.

Integer state and codes equal the reference's bit for bit; the variance is summed in another
order than torch's, so a frame within float rounding of the threshold may fall on the other
side. Rows that share a slot (padding rows on the scratch slot) race on that slot's state:
whichever wins, nobody reads the scratch slot; every access stays inside the tensors.

Triton: one program per row. The frame kernel loads the old ring (R <= a few hundred codes),
compares the [P, W] lagged codes in registers and, after a barrier (every thread has read
the old ring before any thread overwrites it), stores the shifted ring. The audio kernel
loops over the row's n frames, one 2048-wide block (1920 samples) at a time.
"""

from __future__ import annotations

import torch

from ttsbuild.generation.guards import SAMPLES_PER_FRAME, GuardConfig, GuardState, StopCode
from ttsbuild.plugins._dispatch import triton_available


def frame_stop_codes_triton(
    state: GuardState | None, cfg: GuardConfig, rows: torch.Tensor, c0: torch.Tensor, eos_id: int
) -> torch.Tensor:
    """`guards.frame_stop_codes` in one launch (see the module docstring)."""
    import triton

    repetition = state is not None and cfg.repetition
    silence = state is not None and cfg.silence
    W, P = cfg.repetition_window, cfg.repetition_max_period
    if repetition:
        ring = state.recent_c0
        if ring.shape[1] != W + P or not ring.is_contiguous():
            raise ValueError(f"recent_c0 must be contiguous [S, {W + P}], got {tuple(ring.shape)}")
    code = torch.empty_like(c0)
    B = c0.shape[0]
    if B == 0:
        return code
    # Without a state the kernel reads none of it: c0 stands in for its pointers.
    tensors = (
        (c0,) * 4
        if state is None
        else (state.recent_c0, state.frames_seen, state.silent_frames, state.heard)
    )
    _frame_stop_kernel[(B,)](
        rows, c0, code, *tensors,
        rows.stride(0), c0.stride(0), int(eos_id), cfg.repetition_matches, cfg.silence_frames,
        R=W + P, W=W, P=P, REPETITION=repetition, SILENCE=silence,
        EOS_CODE=int(StopCode.EOS), REPETITION_CODE=int(StopCode.REPETITION),
        SILENCE_CODE=int(StopCode.SILENCE),
        BLOCK_R=triton.next_power_of_2(W + P), BLOCK_W=triton.next_power_of_2(W),
        BLOCK_P=triton.next_power_of_2(P), num_warps=4,
    )  # fmt: skip
    return code


def observe_audio_triton(
    state: GuardState, cfg: GuardConfig, rows: torch.Tensor, pcm: torch.Tensor
) -> None:
    """`guards.observe_audio` in one launch (see the module docstring)."""
    B, T = pcm.shape
    if T % SAMPLES_PER_FRAME:
        raise ValueError(f"pcm must hold whole frames of {SAMPLES_PER_FRAME}, got {T} samples")
    if B == 0:
        return
    _observe_audio_kernel[(B,)](
        pcm, rows, state.silent_frames, state.heard, T // SAMPLES_PER_FRAME,
        pcm.stride(0), pcm.stride(1), rows.stride(0), 10.0 ** (cfg.silence_dbfs / 10),
        FRAME=SAMPLES_PER_FRAME, BLOCK=2048, num_warps=8,
    )  # fmt: skip


if triton_available():  # the kernels exist only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    @triton.jit
    def _frame_stop_kernel(
        rows_ptr, c0_ptr, code_ptr, ring_ptr, seen_ptr, silent_ptr, heard_ptr,
        stride_rows, stride_c0, eos_id, matches_needed, silence_frames,
        R: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
        REPETITION: tl.constexpr, SILENCE: tl.constexpr,
        EOS_CODE: tl.constexpr, REPETITION_CODE: tl.constexpr, SILENCE_CODE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        c0 = tl.load(c0_ptr + b * stride_c0)
        slot = tl.load(rows_ptr + b * stride_rows).to(tl.int64)
        code = tl.zeros_like(c0)  # CONTINUE
        if REPETITION:
            ring = ring_ptr + slot * R
            seen = tl.load(seen_ptr + slot) + 1
            # Column i of the new ring is column i + 1 of the old one; c0 is the new last (R - 1).
            i = tl.arange(0, BLOCK_R)
            new = tl.load(ring + i + 1, mask=i < R - 1, other=0)
            new = tl.where(i == R - 1, c0, new)
            # The latest W codes (new columns R - W + j) and the codes p frames before them
            # (new columns R - W + j - p >= 0, never the new code), read from the old ring.
            j = tl.arange(0, BLOCK_W)
            p = 1 + tl.arange(0, BLOCK_P)
            col = R - W + j
            latest = tl.load(ring + col + 1, mask=(j < W) & (col < R - 1), other=0)
            latest = tl.where(col == R - 1, c0, latest)
            valid = (p <= P)[:, None] & (j < W)[None, :]
            earlier = tl.load(ring + (col[None, :] - p[:, None]) + 1, mask=valid, other=0)
            hits = tl.sum(((earlier == latest[None, :]) & valid).to(tl.int32), axis=1)  # [P]
            loops = (hits >= matches_needed) & (seen >= W + p) & (p <= P)
            code = tl.where(tl.max(loops.to(tl.int32), axis=0) > 0, REPETITION_CODE, code)
            tl.debug_barrier()  # every thread has read the old ring before any overwrites it
            tl.store(ring + i, new, mask=i < R)
            tl.store(seen_ptr + slot, seen)
        if SILENCE:
            heard = tl.load(heard_ptr + slot).to(tl.int1)
            silent = heard & (tl.load(silent_ptr + slot) >= silence_frames)
            code = tl.where(silent, SILENCE_CODE, code)
        code = tl.where(c0 == eos_id, EOS_CODE, code)
        tl.store(code_ptr + b, code)

    @triton.jit
    def _observe_audio_kernel(
        pcm_ptr, rows_ptr, silent_ptr, heard_ptr, n, stride_pb, stride_pt, stride_rows,
        threshold, FRAME: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(rows_ptr + b * stride_rows).to(tl.int64)
        t = tl.arange(0, BLOCK)
        in_frame = t < FRAME
        last = tl.full([], -1, tl.int32)  # the last audible frame, -1: none
        for f in range(0, n):
            x = tl.load(
                pcm_ptr + b * stride_pb + (f * FRAME + t) * stride_pt, mask=in_frame, other=0.0
            ).to(tl.float32)
            mean = tl.sum(x, axis=0) / FRAME
            d = tl.where(in_frame, x - mean, 0.0)
            power = tl.sum(d * d, axis=0) / FRAME  # DC-removed: an offset is not sound
            last = tl.where(power >= threshold, f, last)
        heard = tl.load(heard_ptr + slot).to(tl.int1) | (last >= 0)
        old = tl.load(silent_ptr + slot)
        run = tl.where(last >= 0, (n - 1 - last).to(old.dtype), old + n)
        tl.store(silent_ptr + slot, tl.where(heard, run, 0))
        tl.store(heard_ptr + slot, heard)
