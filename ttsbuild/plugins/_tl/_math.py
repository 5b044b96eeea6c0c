"""Correctly rounded math for kernels that must match PyTorch bit for bit.

On the GPU these are libdevice's (__nv_logf etc.: what PyTorch's CUDA kernels call); the
Triton interpreter has no libdevice, so there they fall back to tl.math.
"""

import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode

if interpret_mode():

    @triton.jit
    def log_f32(x):
        return tl.log(x)

    @triton.jit
    def exp_f32(x):
        return tl.exp(x)

    @triton.jit
    def cos_f32(x):
        return tl.cos(x)

    @triton.jit
    def sin_f32(x):
        return tl.sin(x)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def log_f32(x):
        return libdevice.log(x)

    @triton.jit
    def exp_f32(x):
        return libdevice.exp(x)

    @triton.jit
    def cos_f32(x):
        return libdevice.cos(x)

    @triton.jit
    def sin_f32(x):
        return libdevice.sin(x)


E4M3_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn (constexpr: read inside kernels)

if interpret_mode():

    @triton.jit
    def e4m3_value(x, scale):
        """x / scale clamped to e4m3's range and rounded to the nearest e4m3 value (ties to
        even), as fp32: what `.to(tl.float8e4nv)` then stores exactly. Rounded here by hand:
        the interpreter's fp32 -> e4m3 cast rounds values just under a power of two down a
        binade (124.2 -> 64; fp8_w8a8.fp8_row_buffers)."""
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX), E4M3_MAX)
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        quantum = ((tl.maximum(e, -6) + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        # |v / quantum| < 16: adding and taking away 1.5 * 2^23 rounds it to an integer (RNE)
        r = ((v / quantum + 12582912.0) - 12582912.0) * quantum
        return tl.where(r == 0.0, v * 0.0, r)  # (zero keeps v's sign, as the cast's)

else:

    @triton.jit
    def e4m3_value(x, scale):
        """x / scale clamped to e4m3's range, as fp32: its `.to(tl.float8e4nv)` (the
        hardware's round-to-nearest-even cast) is the e4m3 value stored."""
        return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX), E4M3_MAX)


# Programmatic dependent launch (Hopper+): a kernel launched with launch_pdl=True may start
# while the kernel before it on the stream is still running (its programs become resident
# and wait here), which hides the launch gap between the decode's many small kernels. Every
# program waits for the previous kernel to complete (and its writes to be visible) before it
# reads or writes anything in global memory, and at once lets the next kernel launch.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older Triton: PDL stays off (see _dispatch.pdl_enabled)
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Bring [ptr, ptr + nbytes) into L2 ahead of its use: one `cp.async.bulk.prefetch.L2`
    (sm_90), issued by the program's thread 0; nothing waits for it. ptr 16-byte aligned,
    nbytes a multiple of 16. GPU only (inline PTX): callers keep it out of the interpreter."""
    addr = ptr.to(tl.int64) + tl.zeros([1], tl.int64)
    size = tl.zeros([1], tl.int32) + nbytes
    tl.inline_asm_elementwise(
        "{ .reg .pred pf_p; .reg .b32 pf_t; mov.u32 pf_t, %tid.x; setp.eq.u32 pf_p, pf_t, 0; "
        "@pf_p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def l2_prefetch_tile(w_ptr, n0, N, K, BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr):
    """Rows [n0, n0 + BLOCK_N) of an [N, K] row-major weight (and of its up half, rows N on,
    with GATE_UP) into L2: one contiguous block each (`l2_prefetch`). Callers check
    `_dispatch.bulk_prefetchable(weight)`."""
    ELT: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    tile = w_ptr + n0.to(tl.int64) * K
    nbytes = tl.minimum(N - n0, BLOCK_N) * K * ELT
    l2_prefetch(tile, nbytes)
    if GATE_UP:
        l2_prefetch(tile + N * K, nbytes)
