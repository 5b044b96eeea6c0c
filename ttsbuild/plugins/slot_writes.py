"""A new request's per-slot writes in one launch: zero its rows of every per-slot state tensor
and write its staged settings into their per-slot tensors.

    writes = SlotWrites(zero=[t0, t1, ...],                       # each [S, ...]
                        settings=[(target [S], kind, column), ...])  # kind: int | float | bool
    writes(slots [b] int64 (any stride), ints [b, n_int] int64, floats [b, n_float] fp32)
    t[slots[j]] = 0 for every zero tensor t
    target[slots[j]] = ints[j, column]          (kind int: target int64)
    target[slots[j]] = floats[j, column]        (kind float: target fp32)
    target[slots[j]] = floats[j, column] != 0   (kind bool: target bool)

Eager that is one `index_fill_` per zero tensor and one `index_copy_` (plus a cast for bool
targets) per setting: ~60 launches in the engine's prefill graph for the codec's streaming
state, the guards, the counters and the sampling settings, each a few bytes to a few KB per
slot, on the prefill's critical path. The 2026-12-03 profile of the 1x32 prefill graph gave
~80 such kernels 0.19 ms of kernel time (PDL off).

Triton: a table of the targets (address, row bytes, row stride, kind, column) built once on
the device; one program per (target, slot, chunk of a row): zero rows are stored as bytes,
settings as one element. A zero tensor's row must be one dense block of memory (any order of
its inner dimensions), which the constructor checks; the tensors stay where they were when
the table was built (they are the engine's fixed state). Slots must be in range: the kernel
does not check them (`index_fill_` does, in the reference).
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import triton_available, want_triton

KINDS = {"zero": 0, "int": 1, "float": 2, "bool": 3}
_DTYPES = {"int": torch.int64, "float": torch.float32, "bool": torch.bool}
CHUNK = 2048  # bytes of a zero row per program


def _dense_rows(t: torch.Tensor) -> bool:
    """Each t[s] is one dense block of t[0].numel() elements starting at s * t.stride(0)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return False
    inner = sorted((st, n) for st, n in zip(t.stride()[1:], t.shape[1:], strict=True) if n > 1)
    expect = 1
    for st, n in inner:
        if st != expect:
            return False
        expect *= n
    return t.stride(0) >= expect


class SlotWrites:
    """See the module docstring. Built once per engine from its state tensors."""

    def __init__(self, zero: list[torch.Tensor], settings: list[tuple[torch.Tensor, str, int]],
                 *, kernel: bool = True):  # fmt: skip
        """kernel: build the device table for the one-launch kernel (its zeroed tensors'
        rows must be dense blocks); else every call runs the per-tensor ops."""
        entries = []
        for t in zero:
            if kernel and not _dense_rows(t):
                raise ValueError(f"a zeroed tensor's rows must be dense blocks: shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}")  # fmt: skip
            entries.append((t, KINDS["zero"], 0))
        for t, kind, column in settings:
            if kind not in _DTYPES or t.dtype != _DTYPES[kind] or t.dim() != 1:
                raise ValueError(f"a {kind!r} setting needs a 1-D {_DTYPES.get(kind)} target, "
                                 f"got {t.dtype} {tuple(t.shape)}")  # fmt: skip
            if column < 0:
                raise ValueError(f"setting column {column} < 0")
            entries.append((t, KINDS[kind], column))
        devices = {t.device for t, _, _ in entries}
        if len(devices) > 1:
            raise ValueError(f"slot writes span devices {sorted(map(str, devices))}")
        self.zero, self.settings = list(zero), list(settings)
        self.device = devices.pop() if devices else torch.device("cpu")
        self.table = None
        self.max_chunks = 1
        if kernel and entries and triton_available():
            rows = [(t.data_ptr(), t[0].numel() * t.element_size() if k == KINDS["zero"]
                     else t.element_size(), t.stride(0) * t.element_size(), k, c)
                    for t, k, c in entries]  # fmt: skip
            self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self.max_chunks = max(-(-r[1] // CHUNK) for r in rows)

    def reference(self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """The per-tensor ops (staged rows past the slots' count are not read)."""
        b = slots.shape[0]
        ints, floats = ints[:b], floats[:b]
        for t in self.zero:
            t.index_fill_(0, slots, 0)
        for t, kind, column in self.settings:
            src = ints[:, column] if kind == "int" else floats[:, column]
            t.index_copy_(0, slots, src.to(t.dtype))

    def __call__(self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, *,
                 use_triton: bool | None = None) -> None:  # fmt: skip
        if self.table is None or not want_triton(slots, use_triton):
            self.reference(slots, ints, floats)
            return
        from ttsbuild.plugins._tl.slot_writes import _slot_writes_kernel

        b = slots.shape[0]
        if b == 0:
            return
        if slots.dtype != torch.int64 or ints.dtype != torch.int64 or floats.dtype != torch.float32:
            raise ValueError("slots and staged settings must be int64, int64 and float32")
        if ints.shape[0] < b or floats.shape[0] < b or ints.stride(1) != 1 or floats.stride(1) != 1:
            raise ValueError("staged settings need a row per slot, columns contiguous")
        grid = (self.table.shape[0], b, self.max_chunks)
        _slot_writes_kernel[grid](self.table, slots, ints, floats, slots.stride(0),
                                  ints.stride(0), floats.stride(0), CHUNK=CHUNK,
                                  num_warps=4)  # fmt: skip
