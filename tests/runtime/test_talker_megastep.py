"""The one-kernel talker step's CPU side (runtime/talker_megastep.py): its float32 reference,
which the kernel is checked against on a GPU (benchmarks/kernels/megatalker/), against the
runtime's own decode step; the shapes it refuses; its constants against the CUDA source."""

from __future__ import annotations

import re

import pytest
import torch
from reference_models import randomize_

from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.model.layers import DecoderStack
from ttsbuild.runtime import talker_megastep as tm
from ttsbuild.runtime.fast_model import PackedStack


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_stack(cfg: DecoderStackConfig, seed: int, device="cpu", dtype=torch.float32,
                 fp8: bool = True) -> PackedStack:
    """A PackedStack of `reference_models.randomize_`'s weights (O(1) activations)."""
    with torch.device(device):
        module = DecoderStack(cfg)
    randomize_(module, seed)
    return PackedStack.from_module(module.to(dtype), fp8)


def _stack(seed: int, fp8: bool = True) -> PackedStack:
    cfg = DecoderStackConfig(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4)
    return random_stack(cfg, seed, fp8=fp8)


def _caches(stack: PackedStack, S: int, dtype, seed: int):
    c = stack.cfg
    g = torch.Generator().manual_seed(seed)
    shape = (c.num_layers, 3, c.num_kv_heads, S, c.head_dim)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos", [0, 5, 40])
def test_reference_is_the_runtimes_decode_step(cache_dtype, pos):
    """Same output and same cache writes as PackedStack.decode (fp32 activations, the cache
    in its own dtype) for a fresh random stack, cache and token; positions at the start,
    inside the first 32-position chunk and past it."""
    stack = _stack(seed=pos + 1)
    k1, v1 = _caches(stack, 48, cache_dtype, seed=pos + 2)
    k2, v2 = k1.clone(), v1.clone()
    x = torch.randn(1, stack.cfg.hidden_size, generator=torch.Generator().manual_seed(pos + 3))
    slot = 2
    want = stack.decode(x, k1, v1, torch.tensor([slot]), torch.tensor([pos]))[0]
    got = tm.reference(stack, x[0], k2, v2, slot, pos)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-5
    for a, b in ((k1, k2), (v1, v2)):  # the same k, v written at (slot, pos), nothing else
        assert rel_err(b[:, slot, :, pos], a[:, slot, :, pos]) < 1e-5
        a[:, slot, :, pos] = b[:, slot, :, pos]
        assert torch.equal(a, b)
    # the comparison can fail: another slot's (other past k and v) output is far off
    other = tm.reference(stack, x[0], k2.clone(), v2.clone(), 0, pos + 1)
    assert rel_err(other, want) > 1e-3


def test_reference_attends_to_the_cache_it_is_given():
    """Past positions matter: changing the cache below the position changes the output."""
    stack = _stack(seed=7)
    k, v = _caches(stack, 48, torch.bfloat16, seed=8)
    x = torch.randn(stack.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    a = tm.reference(stack, x, k.clone(), v.clone(), 1, 20)
    v2 = v.clone()
    v2[:, 1, :, :20] = torch.randn_like(v2[:, 1, :, :20].float()).to(v2.dtype)
    b = tm.reference(stack, x, k.clone(), v2, 1, 20)
    assert rel_err(a, b) > 1e-3


def _real_stack(fp8: bool = True) -> PackedStack:
    """A PackedStack of the kernel's shapes on the meta device (shapes and dtypes only)."""
    from ttsbuild.runtime.fast_model import Dense, PackedLayer

    s = tm.SHAPE
    H, hd, inter = s["hidden"], s["head_dim"], s["intermediate"]
    qkv = (s["heads"] + 2 * s["kv_heads"]) * hd
    cfg = DecoderStackConfig(hidden_size=H, intermediate_size=inter, num_layers=2,
                             num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=hd,
                             rms_norm_eps=1e-6, rope_theta=1e6)
    wd = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def dense(n, k):
        return Dense(torch.empty(n, k, dtype=wd, device="meta"),
                     torch.empty(n, device="meta") if fp8 else None)

    layers = [PackedLayer(torch.empty(H, device="meta"), dense(qkv, H),
                          torch.empty(hd, device="meta"), torch.empty(hd, device="meta"),
                          dense(H, s["heads"] * hd), torch.empty(H, device="meta"),
                          dense(2 * inter, H), dense(H, inter)) for _ in range(2)]
    return PackedStack(cfg, layers, torch.empty(H, device="meta"))


def test_unsupported_names_the_reason():
    assert tm.unsupported(_real_stack()) is None
    assert "FP8" in tm.unsupported(_real_stack(fp8=False))
    why = tm.unsupported(_stack(seed=1))
    assert "shapes" in why and "'hidden': 64" in why
    with pytest.raises(ValueError, match="shapes"):
        tm.KernelTensors(_stack(seed=1), torch.device("cpu"))
    cache = torch.empty(2, 1, 8, 64, 128, dtype=torch.float32, device="meta")
    assert "bf16" in tm.unsupported(_real_stack(), cache)
    cache = torch.empty(3, 1, 8, 64, 128, dtype=torch.bfloat16, device="meta")
    assert "layers" in tm.unsupported(_real_stack(), cache)  # 3 layers of cache for a 2-layer stack
    cache = torch.empty(2, 1, 8, 64, 128, dtype=torch.bfloat16, device="meta")
    assert tm.unsupported(_real_stack(), cache) is None


def test_the_python_constants_are_the_kernels():
    src = tm.SOURCE.read_text()
    consts = dict(re.findall(r"\b(H|NH|NKV|HD|I|CH) = (\d+)", src))
    s = tm.SHAPE
    assert int(consts["H"]) == s["hidden"] and int(consts["I"]) == s["intermediate"]
    assert int(consts["NH"]) == s["heads"] and int(consts["NKV"]) == s["kv_heads"]
    assert int(consts["HD"]) == s["head_dim"] and int(consts["CH"]) == tm.CHUNK
    assert "PART = 4 + 2 * HD" in src and tm.PART == 4 + 2 * s["head_dim"]
    assert "64 + 32 * NKV" in src and tm.COUNTER_WORDS == 64 + 32 * s["kv_heads"]
    # the scratch the binding checks for: qkv + 3 hidden + intermediate + the partials
    assert "(int64_t)QKV + 3 * H + I + (int64_t)NKV * max_chunks * PART" in src
    assert tm.scratch_floats(64) == 4096 + 3 * 2048 + 6144 + 8 * 2 * tm.PART


def _nvcc_extension(source_text: str, tmp_path, name: str):
    """nvcc on the kernel source with its torch binding (torch's headers, the CUDA runtime's,
    and the library headers a CPU wheel names, stubbed), for sm_90a, ptxas verbose."""
    import subprocess

    from test_driver_cuda_build import NVCC, torch_cuda_includes

    includes = torch_cuda_includes(tmp_path / "stubs")
    src = tmp_path / f"{name}.cu"
    src.write_text(source_text)
    cmd = [NVCC, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           "-DTORCH_EXTENSION_NAME=ttsbuild_talker_step", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *(f"-I{p}" for p in includes), "-c", str(src), "-o", str(tmp_path / f"{name}.o")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_kernel_and_its_binding_compile_for_hopper(tmp_path):
    """The source as torch.utils.cpp_extension builds it on the GPU host (where a mistake
    costs device time), here where nvcc exists (not the CI machine): it compiles, without
    register spills; a mistake in the binding fails the check."""
    from pathlib import Path

    from test_driver_cuda_build import NVCC

    if not Path(NVCC).exists():
        pytest.skip("needs nvcc")
    text = tm.SOURCE.read_text()
    assert "p.pos = pos.data_ptr<int64_t>();" in text
    runs = [_nvcc_extension(text, tmp_path, "ok"),
            _nvcc_extension(text.replace("p.pos = pos.data_ptr<int64_t>();",
                                         "p.pos = pos.data_ptr<int>();"), tmp_path, "broken")]
    (ok_out, ok_err), (_, bad_err) = (r.communicate(timeout=600) for r in runs)
    assert runs[0].returncode == 0, ok_err[-3000:]
    assert "0 bytes spill stores" in ok_err + ok_out and "Used" in ok_err + ok_out
    assert runs[1].returncode != 0 and "p.pos" in bad_err


def test_the_wrapper_hands_the_binding_what_it_checks(monkeypatch):
    """TalkerStep's call, on CPU with the extension replaced by a recorder: the binding's
    arguments in its order (talker_step.cu), with the dtypes, sizes and addresses its checks
    and its kernel read (the stack's own weights and scales by address, layer by layer)."""
    from ttsbuild.runtime.fast_model import Dense, PackedLayer

    s = tm.SHAPE
    H, hd, inter, L = s["hidden"], s["head_dim"], s["intermediate"], 2
    qkv = (s["heads"] + 2 * s["kv_heads"]) * hd
    cfg = DecoderStackConfig(hidden_size=H, intermediate_size=inter, num_layers=L,
                             num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=hd,
                             rms_norm_eps=1e-5, rope_theta=1e6)

    def dense(n, k):
        return Dense(torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.rand(n))

    layers = [PackedLayer(torch.rand(H), dense(qkv, H), torch.rand(hd), torch.rand(hd),
                          dense(H, H), torch.rand(H), dense(2 * inter, H), dense(H, inter))
              for _ in range(L)]
    stack = PackedStack(cfg, layers, torch.rand(H))
    calls = []

    class Recorder:
        def talker_step(self, *args):
            calls.append(args)

    monkeypatch.setattr(tm, "extension", Recorder)
    S = 96
    step = tm.TalkerStep(stack, S, device="cpu", dist=3, ctas=5)
    k = torch.zeros(L, 2, s["kv_heads"], S, hd, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    x = torch.randn(1, H).bfloat16()
    slot, pos = torch.tensor([1]), torch.tensor([40])
    out = step(x, k, v, slot, pos)
    (x_in, o, wptr, sptr, norms, final, freqs, kc, vc, sl, ps, scratch, counter, ctas, dist,
     eps), = calls  # fmt: skip
    assert x_in.dtype == torch.bfloat16 and x_in.numel() == H and o is out and o.numel() == H
    assert wptr.dtype == sptr.dtype == torch.int64 and wptr.shape == sptr.shape == (L, 4)
    for i, p in enumerate(layers):
        for j, d in enumerate((p.qkv, p.o, p.gate_up, p.down)):
            assert wptr[i, j] == d.weight.data_ptr() and sptr[i, j] == d.scale.data_ptr()
    assert norms.dtype == torch.float32 and norms.shape == (L, 2 * H + 2 * hd)
    assert torch.equal(norms[1, H:2 * H], layers[1].post_norm)
    assert torch.equal(norms[0, 2 * H + hd:], layers[0].k_norm)
    assert final.dtype == torch.float32 and freqs.shape == (hd // 2,)
    assert kc is k and vc is v and sl.dtype == ps.dtype == torch.int64 and int(ps) == 40
    need = qkv + 3 * H + inter + s["kv_heads"] * (-(-S // tm.CHUNK)) * tm.PART
    assert scratch.dtype == torch.float32 and scratch.numel() >= need
    assert counter.dtype == torch.int32 and counter.numel() >= 64 + 32 * s["kv_heads"]
    assert (ctas, dist, eps) == (5, 3, 1e-5)
    with pytest.raises(ValueError, match="bf16 cache"):
        step(x, k.float(), v.float(), slot, pos)
    with pytest.raises(ValueError, match="scratch for 96"):
        step(x, torch.zeros(L, 2, s["kv_heads"], 128, hd, dtype=torch.bfloat16), v, slot, pos)


def test_the_engine_refuses_the_kernel_where_it_cannot_run(tiny_checkpoint):
    """plan.talker_megastep on a talker the kernel has no shapes for: the graph engine stops
    at load with the reason (never a silent fallback to the unfused step)."""
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.runtime.engine import Models
    from ttsbuild.runtime.graph_engine import GraphEngine
    from ttsbuild.runtime.plan import EnginePlan

    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    plan = EnginePlan(num_slots=2, max_len=256, max_text=64, batch_buckets=(1, 2),
                      prefill_buckets=(32, 64), codec_chunks=(1, 2), codec_ring=8,
                      talker_megastep=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"plan.talker_megastep: shapes \{'hidden'"):
        GraphEngine(models, plan)
