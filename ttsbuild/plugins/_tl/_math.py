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
