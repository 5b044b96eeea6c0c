"""runtime.l2_persist on the CPU: the arena, the window over it, the attribute's C layout, the
switch; and the engine's code-predictor weights in one allocation (cp_megaframe.pack)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from reference_models import build_pair, small_config

from ttsbuild.runtime import cp_megaframe as cpm
from ttsbuild.runtime import l2_persist as l2
from ttsbuild.runtime.fast_model import Dense, PackedStack


def _fresh(gen: torch.Generator) -> list[torch.Tensor]:
    return [
        torch.randn(37, 11, generator=gen).to(torch.bfloat16),
        (torch.randn(64, 48, generator=gen) * 100).to(torch.float8_e4m3fn),
        torch.randn(5, 3, 7, generator=gen),
        torch.randint(-(2**40), 2**40, (9,), generator=gen),
    ]


def test_arena_holds_equal_views_in_one_aligned_allocation():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    src = _fresh(gen)
    views = l2.arena(src)
    base = views[0].untyped_storage().data_ptr()
    for s, v in zip(src, views, strict=True):
        assert v.dtype == s.dtype and v.shape == s.shape
        assert torch.equal(v.view(torch.uint8), s.view(torch.uint8))
        assert v.untyped_storage().data_ptr() == base  # one allocation
        assert (v.data_ptr() - base) % 256 == 0
        assert v.data_ptr() != s.data_ptr()  # a copy: the originals are left alone
    held = sum(s.numel() * s.element_size() for s in src)
    start, size = l2.span(views)
    assert start == base and held <= size < held + 256 * len(src)
    s0 = src[0].clone()
    views[0].add_(1)
    assert torch.equal(src[0], s0)


def test_window_asks_the_set_aside_share_of_its_span():
    gen = torch.Generator().manual_seed(7)
    views = l2.arena(_fresh(gen))
    start, size = l2.span(views)
    w = l2.window_for(views, set_aside=size // 4, max_window=1 << 30, share=1.0)
    assert (w.base, w.num_bytes) == (start, size)
    assert w.hit_ratio == pytest.approx((size // 4) / size)
    assert l2.window_for(views, size // 4, 1 << 30, share=0.5).hit_ratio == pytest.approx(
        0.5 * (size // 4) / size)
    assert l2.window_for(views, 10 * size, 1 << 30).hit_ratio == 1.0  # all of it fits
    assert l2.window_for(views, 0, 1 << 30) is None  # no set-aside on this device
    assert l2.window_for(views, size, size - 1) is None  # beyond the largest window
    assert l2.window_for([], size, 1 << 30) is None


def test_window_refuses_tensors_scattered_over_other_data():
    buf = torch.randn(100_000)
    ends = [buf[:100], buf[-100:]]  # 800 bytes held across a 400,000-byte span
    assert l2.window_for(ends, 1 << 20, 1 << 30) is None
    assert l2.window_for(l2.arena(ends), 1 << 20, 1 << 30) is not None


def test_attribute_value_has_the_runtimes_layout():
    # union cudaLaunchAttributeValue: 64 bytes; struct cudaAccessPolicyWindow: base_ptr,
    # num_bytes, hitRatio, hitProp, missProp
    assert ctypes.sizeof(l2._AttrValue) == 64
    offsets = [getattr(l2._Window, f).offset for f in
               ("base_ptr", "num_bytes", "hitRatio", "hitProp", "missProp")]  # fmt: skip
    assert offsets == [0, 8, 16, 20, 24]
    v = l2.Window(0x7F00_1234_5600, 123_456_789, 0.375, l2.NORMAL).value()
    raw = bytes(v)
    assert int.from_bytes(raw[:8], "little") == 0x7F00_1234_5600
    assert int.from_bytes(raw[8:16], "little") == 123_456_789
    assert ctypes.c_float.from_buffer_copy(raw[16:20]).value == 0.375
    assert int.from_bytes(raw[20:24], "little") == l2.PERSISTING
    assert int.from_bytes(raw[24:28], "little") == l2.NORMAL


def test_switch_reads_a_share_or_fails_clearly(monkeypatch):
    monkeypatch.delenv("TTSBUILD_CP_L2_PERSIST", raising=False)
    assert l2.env_share() == 0.0
    monkeypatch.setenv("TTSBUILD_CP_L2_PERSIST", "0.5")
    assert l2.env_share() == 0.5
    for bad in ("yes", "1.5", "-0.1"):
        monkeypatch.setenv("TTSBUILD_CP_L2_PERSIST", bad)
        with pytest.raises(ValueError, match="TTSBUILD_CP_L2_PERSIST"):
            l2.env_share()


def test_pack_puts_the_linears_and_heads_in_one_window():
    """The engine's window covers the code predictor's linears once `pack(one_allocation=True)`
    (what the engine asks under TTSBUILD_CP_L2_PERSIST) has laid them out and `share_weights`
    made the engine's linears views of them: their span is theirs alone. Without it pack
    makes no second copy; the values are the same."""
    _, _, cp = build_pair(small_config(), seed=21, dtype=torch.float32)
    stack = PackedStack.from_module(cp.model, True)
    heads = [Dense.make(h.weight.detach(), True) for h in cp.lm_head]
    before = {k: getattr(layer, k).weight.clone() for layer in stack.layers[:1]
              for k in ("qkv", "o", "gate_up", "down")}  # fmt: skip
    embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
    apart = cpm.pack(stack, heads, cp.small_to_mtp_projection, embeddings)
    m = cpm.pack(stack, heads, cp.small_to_mtp_projection, embeddings, one_allocation=True)
    stacked = [m["w" + k] for k in ("qkv", "o", "gu", "d", "head")]
    assert len({t.untyped_storage().data_ptr() for t in stacked}) == 1
    assert len({apart["w" + k].untyped_storage().data_ptr() for k in ("qkv", "o")}) == 2
    for k, v in apart.items():  # the same values either way
        assert torch.equal(v.view(torch.uint8) if v.is_floating_point() else v,
                           m[k].view(torch.uint8) if v.is_floating_point() else m[k]), k
    cpm.share_weights(m, stack, heads)
    linears = [d.weight for layer in stack.layers for d in (layer.qkv, layer.o, layer.gate_up,
                                                            layer.down)]  # fmt: skip
    start, size = l2.span(linears)
    held = sum(t.numel() for t in linears)  # FP8: a byte each
    assert start == m["wqkv"].data_ptr() and size < held + 256 * 4
    assert l2.window_for(linears, size // 2, 1 << 40) is not None
    for k, w in before.items():
        assert torch.equal(getattr(stack.layers[0], k).weight.view(torch.uint8),
                           w.view(torch.uint8))  # fmt: skip
