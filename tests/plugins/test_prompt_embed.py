"""plugins.prompt_embed: the prefill's prompt embedding in four launches against the prompt
embedder's ops, fresh random tables and rows: unused codebooks, codebook 0 only, whole
frames, rows flagged for the x-vector (one for all rows, or one per row)."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel
from torch import nn

from ttsbuild.plugins.prompt_embed import codec_track, prompt_embed

G, V0, V, H, VT = 4, 30, 20, 48, 50


def _case(T: int, dtype, seed: int, per_row_xv: bool):
    g = torch.Generator().manual_seed(seed)
    table0 = torch.randn(V0, H, generator=g).to(dtype)
    rest = torch.randn(G - 1, V, H, generator=g).to(dtype)
    text_table = torch.randn(VT, H, generator=g).to(dtype)
    fc1, fc2 = nn.Linear(H, H), nn.Linear(H, H)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    fc1, fc2 = fc1.to(dtype), fc2.to(dtype)
    rows = torch.full((T, 2 + G), -1, dtype=torch.int64)
    rows[:, 0] = torch.randint(0, VT, (T,), generator=g)
    rows[:, 1] = 0
    kind = torch.randint(0, 4, (T,), generator=g)  # 0: text only, 1: code 0, 2: frame, 3: voice
    rows[kind == 1, 2] = torch.randint(0, V0, (int((kind == 1).sum()),), generator=g)
    frame = kind == 2
    rows[frame, 2] = torch.randint(0, V0, (int(frame.sum()),), generator=g)
    rows[frame, 3:] = torch.randint(0, V, (int(frame.sum()), G - 1), generator=g)
    rows[kind == 3, 1] = 1
    xv = torch.randn(T if per_row_xv else 1, H, generator=g).to(dtype)
    xv = xv if per_row_xv else xv[0]
    assert {0, 1, 2, 3} <= set(kind.tolist())
    return rows, text_table, fc1, fc2, table0, rest, xv


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_kernel
@pytest.mark.parametrize("dtype,per_row_xv", [(torch.float32, False), (torch.bfloat16, True)])
def test_prompt_embed_kernels_match_the_embedder_ops(dtype, per_row_xv, monkeypatch):
    rows, text_table, fc1, fc2, table0, rest, xv = _case(40, dtype, 3 + per_row_xv, per_row_xv)
    on = [t.to(KDEV) for t in (rows, text_table, table0, rest, xv)]
    track = codec_track(on[0], on[2], on[3], on[4], use_triton=True).cpu()
    out = prompt_embed(on[0], on[1], fc1.to(KDEV), fc2.to(KDEV), on[2], on[3], on[4],
                       use_triton=True).cpu()  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fc1, fc2 = fc1.cpu(), fc2.cpu()
    want_track = codec_track(rows, table0, rest, xv, use_triton=False)
    want = prompt_embed(rows, text_table, fc1, fc2, table0, rest, xv, use_triton=False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert track.dtype == dtype and _rel(track, want_track) < tol
    assert out.dtype == dtype and out.shape == want.shape and _rel(out, want) < tol
    # a codebook left out of the sum is seen
    rest_off = rest.clone()
    rest_off[1] = 0
    assert _rel(codec_track(rows, table0, rest_off, xv, use_triton=False), want_track) > 10 * tol
