"""GPU tests (sm_90) of `cp_megaframe.Megaframe`, the one-kernel code-predictor frame: on a
code predictor of the 1.7B CustomVoice shapes with random FP8 weights, its codes against the
float32 reference's logits (teacher-forced on the kernel's own codes: greedy picks the
reference's argmax, sampling picks `sampling.sample`'s draw, top-p 1 and 0.8, a differing
code allowed only at a near-tie), and a captured graph replayed with another row's settings
against an eager run. Skipped without such a GPU: the CPU checks are in
test_megaframe_reference.py."""

import json

import pytest
import torch
from reference_models import DATA, randomize_

from ttsbuild.generation.sampling import SamplingBatch, SamplingParams
from ttsbuild.model.config import ModelConfig
from ttsbuild.model.talker import CodePredictor
from ttsbuild.runtime import cp_megaframe as cpm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (compute capability 9.0: the kernel is built for sm_90a)",
)
G = cpm.SHAPE["groups"]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_official(json.loads((DATA / "1.7b-customvoice.json").read_text()))
    cp = CodePredictor(cfg)
    randomize_(cp, seed=21)
    with torch.no_grad():  # peaked heads, as a trained model's (logit std ~4)
        for head in cp.lm_head:
            head.weight.mul_(4.0)
    cp = cp.cuda().eval()
    m = cpm.pack_module(cp, fp8=True)
    assert cpm.unsupported(m) is None
    g = torch.Generator(device="cuda").manual_seed(22)
    x_in = torch.randn(2, cfg.code_predictor.hidden_size, generator=g, device="cuda")
    return cp, m, x_in, cpm.Megaframe(m, eps=cfg.code_predictor.rms_norm_eps)


def _settings(do_sample: bool, seed: int, frame: int, top_p: float = 1.0):
    batch = SamplingBatch.from_params(
        [SamplingParams(do_sample=do_sample, temperature=0.9, top_k=50, top_p=top_p)],
        device="cuda")
    return (batch, torch.tensor([seed], device="cuda"), torch.tensor([frame], device="cuda"))


F, TT, XR = cpm.FETCH, cpm.TWO_TOKEN, cpm.XREDUCE


@pytest.mark.parametrize("opts", [
    cpm.SERVED_OPTS, cpm.SERVED_OPTS | cpm.GENERIC, F, F | cpm.GENERIC, F | TT, F | XR,
    F | cpm.KV_AHEAD, F | cpm.SPLIT_DOWN, F | cpm.SPLIT_DOWN | TT,
    F | TT | XR | cpm.KV_AHEAD | cpm.SPLIT_DOWN, cpm.SERVED_OPTS | cpm.EARLY_FREE,
    cpm.SERVED_OPTS | cpm.TAGGED, F | cpm.TAGGED | cpm.GENERIC,
    cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV, F | cpm.TAGGED | cpm.TAGGED_QKV | cpm.GENERIC,
    cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV | cpm.WARP_QK, F | cpm.WARP_QK | cpm.GENERIC,
    cpm.SERVED_OPTS | cpm.WARP_QK,
], ids=["served", "served-generic", "fetch", "fetch-generic", "two-token", "xreduce",
        "kv-ahead", "split-down", "split-down+two-token", "all", "early-free", "tagged",
        "fetch-tagged-generic", "tagged-qkv", "fetch-tagged-qkv-generic", "tagged-qkv-warp-qk",
        "fetch-warp-qk-generic", "warp-qk"])
@pytest.mark.parametrize("do_sample, top_p", [(False, 1.0), (True, 1.0), (True, 0.8)])
def test_codes_follow_the_reference(model, do_sample, top_p, opts):
    """opts: the served options (FETCH, TWO_TOKEN: the frame's two inputs as one pass of two
    tokens, XREDUCE: the GEMVs' row sums reduced together), each in its own instance and in
    the generic one; FETCH alone and with one option each (KV_AHEAD: stage B's past K/V rows
    copied ahead by the producer; SPLIT_DOWN: stage D split by input columns); EARLY_FREE (a
    stage's buffer back to the producer at its barrier) and TAGGED (act and d as tagged
    words, no barrier after C or D; with TAGGED_QKV A's qkv too, no barrier after A; WARP_QK:
    B's q/k norms and RoPE a warp a vector) on the served options, and one token a pass in
    the generic instance."""
    cp, m, x_in, mf = model
    if opts != cpm.SERVED_OPTS:
        mf = cpm.Megaframe(m, eps=mf.eps, opts=opts | cpm.COOPERATIVE)
    _check_frame(mf, m, x_in, _settings(do_sample, seed=-987654321, frame=41, top_p=top_p))


def _check_frame(mf, m, x_in, settings, apart_from=None) -> None:
    """One kernel frame against the float32 reference on the same weights m, teacher-forced
    on the kernel's codes: logits within 1e-4, each code the reference's draw (a near-tie
    aside), and not one code over and over. apart_from: other weights whose reference logits
    the kernel's must differ from (by > 1e-3: the kernel read m's, not those)."""
    batch, seeds, frames = settings
    tokens = mf.run(x_in, batch, seeds, frames).clone()
    logits, _, _ = cpm.reference(m, x_in, tokens, eps=mf.eps)
    other = None if apart_from is None else cpm.reference(apart_from, x_in, tokens,
                                                          eps=mf.eps)[0]  # fmt: skip
    kernel_logits = mf.buffers["logits"]
    want = cpm.reference_draws(logits, batch, seeds, frames)
    for i in range(G - 1):
        rel = float((kernel_logits[i] - logits[i]).norm() / logits[i].norm())
        assert rel < 1e-4, (i, rel)
        if other is not None:
            apart = float((kernel_logits[i] - other[i]).norm() / other[i].norm())
            assert apart > 1e-3, (i, apart)
        assert int(tokens[i]) == want[i] or cpm.near_tie(logits[i], batch, seeds, frames, i + 1), i
    assert len(set(tokens.tolist())) > 3  # not one code over and over


@pytest.fixture(scope="module")
def bf16_heads(model):
    """The same code predictor with its heads in bf16, as the engine holds them beside an FP8
    code predictor (EnginePlan.cp_heads_fp8 off): the kernel reads them as they are."""
    cp, _, x_in, _ = model
    m = cpm.pack_module(cp, fp8=True, bf16_heads=True)
    assert m["whead"].dtype == torch.bfloat16 and cpm.unsupported(m) is None
    return m, x_in


@pytest.mark.parametrize("opts", [cpm.SERVED_OPTS | cpm.ENGINE_EXTRA, cpm.SERVED_OPTS,
                                  cpm.SERVED_OPTS | cpm.GENERIC],
                         ids=["engine-default", "served", "served-generic"])
@pytest.mark.parametrize("do_sample, top_p", [(False, 1.0), (True, 1.0), (True, 0.8)])
def test_bf16_heads_follow_the_reference(model, bf16_heads, do_sample, top_p, opts):
    """bf16 heads (2 bytes a weight in the head stage's copy and GEMV): logits within 1e-4 of
    the float32 reference on the same bf16 weights, codes its draws (a near-tie aside), and
    apart from the FP8 heads' logits (the kernel did read the bf16 weights)."""
    _, m_fp8, _, mf_fp8 = model
    m, x_in = bf16_heads
    mf = cpm.Megaframe(m, eps=mf_fp8.eps, opts=opts | cpm.COOPERATIVE)
    _check_frame(mf, m, x_in, _settings(do_sample, seed=123456789, frame=17, top_p=top_p),
                 apart_from=m_fp8)


@pytest.mark.parametrize("opts", [cpm.SERVED_OPTS, cpm.SERVED_OPTS | cpm.TAGGED,
                                  cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV,
                                  cpm.SERVED_OPTS | cpm.ENGINE_EXTRA],
                         ids=["served", "tagged", "tagged-qkv", "engine-default"])
def test_a_graph_replays_with_the_rows_settings(model, opts):
    """Replays take each row's settings from device memory; with TAGGED each replay also
    re-zeroes the tagged words (a replay never reads the last one's tags)."""
    cp, m, x_in, mf = model
    if opts != cpm.SERVED_OPTS:
        mf = cpm.Megaframe(m, eps=mf.eps, opts=opts | cpm.COOPERATIVE)
    batch, seeds, frames = _settings(True, seed=5, frame=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mf.run(x_in, batch, seeds, frames)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mf.run(x_in, batch, seeds, frames)
    runs = []
    for seed, frame, do_sample in ((5, 3, True), (6, 3, True), (5, 4, True), (5, 3, False)):
        seeds.fill_(seed)
        frames.fill_(frame)
        batch.do_sample.fill_(do_sample)
        graph.replay()
        replayed = out.clone()
        eager = mf.run(x_in, *_settings(do_sample, seed, frame)).clone()
        assert torch.equal(replayed, eager), (seed, frame, do_sample)
        runs.append(replayed)
    assert not torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
