"""Triton: a new request's per-slot writes in one launch (see plugins.slot_writes).

The table holds one row of int64 per target: address, bytes to write per slot (a zero row's
bytes, or a setting's element size), row stride in bytes, kind (0 zero, 1 int64 setting,
2 fp32 setting, 3 bool setting) and the setting's column in the staged rows. Program
(target, slot j, chunk): a zero target's chunk of slot j's row as bytes; a setting's one
element, written by chunk 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_writes_kernel(table_ptr, slots_ptr, ints_ptr, floats_ptr, stride_s, stride_i,
                        stride_f, CHUNK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    entry = table_ptr + i * 5
    addr = tl.load(entry)
    nbytes = tl.load(entry + 1)
    stride = tl.load(entry + 2)
    kind = tl.load(entry + 3)
    column = tl.load(entry + 4)
    row = addr + tl.load(slots_ptr + j * stride_s) * stride  # the slot's first byte
    if kind == 0:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        dst = row.to(tl.pointer_type(tl.uint8))
        tl.store(dst + offs, tl.zeros([CHUNK], dtype=tl.uint8), mask=offs < nbytes)
    elif c == 0:
        if kind == 1:
            tl.store(row.to(tl.pointer_type(tl.int64)), tl.load(ints_ptr + j * stride_i + column))
        else:
            value = tl.load(floats_ptr + j * stride_f + column)
            if kind == 2:
                tl.store(row.to(tl.pointer_type(tl.float32)), value)
            else:
                tl.store(row.to(tl.pointer_type(tl.uint8)), (value != 0).to(tl.uint8))
