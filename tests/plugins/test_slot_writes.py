"""plugins.slot_writes: a new request's per-slot zeroing and settings in one launch, against
the per-tensor index_fill_ / index_copy_ it replaces (on CUDA, or on the CPU under
TRITON_INTERPRET=1; tests/plugins/test_fused_kernels.py runs the kernel test here under the
interpreter on CPU CI)."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.slot_writes import CHUNK, SlotWrites, _dense_rows

S = 7


def _state(device, g):
    """Per-slot tensors of the engine's kinds, every byte random (no zeros to hide behind)."""

    def rnd(*shape, dtype=torch.float32):
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        if dtype == torch.int64:
            return torch.randint(1, 1 << 40, shape, generator=g)
        return (torch.rand(shape, generator=g) + 0.5).to(dtype)

    zero = [
        rnd(S, 5, 7, dtype=torch.float16),  # a codec conv tail
        rnd(S, 4, 3).transpose(1, 2),  # inner dimensions in another order: still dense rows
        rnd(S, dtype=torch.int64),  # a counter
        rnd(S, 37, dtype=torch.bool),  # an odd number of bytes
        rnd(S, 3 * CHUNK // 2 + 5, dtype=torch.float16),  # a row over two chunks
        rnd(S, 2, 3, dtype=torch.int64),
    ]
    settings = [(rnd(S, dtype=torch.int64), "int", 2), (rnd(S, dtype=torch.int64), "int", 0),
                (rnd(S), "float", 1), (rnd(S), "float", 3),
                (rnd(S, dtype=torch.bool), "bool", 0), (rnd(S, dtype=torch.bool), "bool", 2)]
    zero = [t.to(device) for t in zero]
    settings = [(t.to(device), kind, col) for t, kind, col in settings]
    return zero, settings


def _tensors(zero, settings):
    return [*zero, *(t for t, _, _ in settings)]


@needs_kernel
@pytest.mark.parametrize("slots", [[4], [6, 0, 3]])
def test_slot_writes_kernel_matches_index_fill_and_copy(slots):
    g = torch.Generator().manual_seed(len(slots))
    zero, settings = _state(KDEV, g)
    before = [t.clone() for t in _tensors(zero, settings)]
    ref_zero, ref_settings = _state(KDEV, torch.Generator().manual_seed(len(slots)))
    b = len(slots)
    ints = torch.randint(-(1 << 40), 1 << 40, (b + 1, 4), generator=g).to(KDEV)
    floats = torch.randn(b + 1, 5, generator=g)
    floats[0, 0] = 0.0  # a bool setting read from 0 (False) and from nonzero values (True)
    floats = floats.to(KDEV)
    # the slots as the engine stages them: a column of the staged int rows (strided)
    staged = torch.randint(0, S, (b, 3), generator=g)
    staged[:, 1] = torch.tensor(slots)
    idx = staged.to(KDEV)[:, 1]
    SlotWrites(zero, settings)(idx, ints, floats, use_triton=True)
    SlotWrites(ref_zero, ref_settings).reference(idx, ints, floats)
    for got, want, old in zip(_tensors(zero, settings), _tensors(ref_zero, ref_settings),
                              before, strict=True):  # fmt: skip
        assert torch.equal(got, want)
        others = [s for s in range(S) if s not in slots]
        assert torch.equal(got[others], old[others])  # no other slot touched
    for t in zero:
        assert not t[idx].any()  # zeroed (every byte was nonzero or random before)
    assert settings[0][0][slots[0]].item() == ints[0, 2].item()
    assert settings[4][0][slots[0]].item() is False  # floats[0, 0] == 0
    assert settings[2][0][slots[-1]].item() == floats[b - 1, 1].item()


def test_rows_must_be_dense_and_settings_typed():
    t = torch.zeros(S, 4, 6)
    assert _dense_rows(t) and _dense_rows(t.transpose(1, 2)) and _dense_rows(t[:, 1])
    assert not _dense_rows(t[:, :, :3]) and not _dense_rows(t[:, ::2])
    with pytest.raises(ValueError, match="dense"):
        SlotWrites([t[:, :, :3]], [])
    with pytest.raises(ValueError, match="1-D"):
        SlotWrites([], [(torch.zeros(S, dtype=torch.int32), "int", 0)])
    with pytest.raises(ValueError, match="1-D"):
        SlotWrites([], [(torch.zeros(S), "half", 0)])
    with pytest.raises(ValueError, match="column"):
        SlotWrites([], [(torch.zeros(S), "float", -1)])


def test_without_a_kernel_the_writes_are_the_eager_ops(monkeypatch):
    """On CPU tensors outside the interpreter the call is the reference: the same tensors
    written as the per-tensor ops write them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(3)
    zero, settings = _state("cpu", g)
    ints = torch.randint(0, 100, (2, 4), generator=g)
    floats = torch.randn(2, 5, generator=g)
    idx, others = torch.tensor([5, 1]), [0, 2, 3, 4, 6]
    before = [t.clone() for t in _tensors(zero, settings)]
    SlotWrites(zero, settings)(idx, ints, floats)
    for t, old in zip(_tensors(zero, settings), before, strict=True):
        assert torch.equal(t[others], old[others])
    for t in zero:
        assert not t[idx].any()
    for t, kind, col in settings:
        src = ints[:, col] if kind == "int" else floats[:, col]
        assert torch.equal(t[idx], src.to(t.dtype))
