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
