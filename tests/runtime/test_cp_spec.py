"""runtime.cp_spec: the verify pass equals sequential decoding, speculative frames give the
target's greedy codes exactly and its sampled distribution (chi-square, with a wrong
acceptance rule shown to fail the same test), on the references (CPU)."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel
from scipy.stats import chi2_contingency, chisquare
from test_cp_fused import CFG, G, V, _f32_cpu, _frame_inputs, _predictor, _rel, _stack

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.runtime import cp_spec
from ttsbuild.runtime.cp_spec import (
    SPEC_KINDS,
    SpeculativeCodePredictor,
    noise,
    plain_sampling,
    speculative_accept,
)

ALPHA = 1e-3  # a correct sampler fails one test in 1000


def test_extend_equals_sequential_decode():
    stack = _stack(torch.float32, False)
    g = torch.Generator().manual_seed(3)
    B, T, S = 3, 4, 12
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    x = torch.randn(B, T, CFG.hidden_size, generator=g)
    slots, start = torch.tensor([2, 0, 1]), torch.tensor([1, 5, 3])  # rows at other depths
    k2, v2 = k.clone(), v.clone()
    out = stack.extend(x, k, v, slots, start)
    ref = torch.stack([stack.decode(x[:, t], k2, v2, slots, start + t) for t in range(T)], 1)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    assert ((k - k2).norm() / k2.norm()).item() < 1e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_path_matches_reference(dtype, monkeypatch):
    """extend on the kernels (each token a decode-attention query up to its own position)
    == the reference (masked SDPA over the gathered cache), fresh random inputs."""
    stack = _stack(dtype, False, KDEV)
    g = torch.Generator().manual_seed(13)
    B, T, S = 3, 5, 16
    shape = (CFG.num_layers, 4, CFG.num_kv_heads, S, CFG.head_dim)
    k, v = torch.randn(shape, generator=g) * 2, torch.randn(shape, generator=g) * 2
    x = torch.randn(B, T, CFG.hidden_size, generator=g)
    slots, start = torch.tensor([3, 0, 1]), torch.tensor([1, 9, 4])
    k_dev, v_dev = k.to(KDEV, dtype), v.to(KDEV, dtype)
    k_in, v_in = k_dev.cpu().float(), v_dev.cpu().float()
    out = stack.extend(x.to(KDEV, dtype), k_dev, v_dev, slots.to(KDEV), start.to(KDEV))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference: CPU, fp32
    ref = _f32_cpu(stack).extend(x.to(dtype).float(), k_in, v_in, slots, start)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    if KDEV == "cuda" and dtype == torch.float32:
        tol = 3e-3  # tl.dot on fp32 inputs runs TF32 on the GPU
    assert out.dtype == dtype and _rel(out.cpu(), ref) < tol
    assert _rel(k_dev.cpu().float(), k_in) < tol


def _rows(n, do_sample=True, top_k=4, temperature=1.0):
    return SamplingBatch(
        do_sample=torch.full((n,), do_sample),
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.ones(n),
        repetition_penalty=torch.ones(n),
    )


def _draft_near(cp, scale=0.15, seed=9):
    """Draft heads = the target's + noise: high but imperfect acceptance (q != p)."""
    g = torch.Generator().manual_seed(seed)
    heads = torch.stack([h.weight for h in cp.heads])
    return heads + scale * torch.randn(heads.shape, generator=g).to(heads.device)  # CPU draws


@pytest.mark.parametrize("fused_verify", [False, True])
@pytest.mark.parametrize("B", [1, 4])  # head_logits: gathered heads (1) and all heads (4)
@pytest.mark.parametrize("kind", ["self", "draft"])
def test_greedy_codes_equal_the_target(kind, B, fused_verify, monkeypatch):
    """With the verify pass as `extend` and as the fused decode over k + 1 tokens."""
    monkeypatch.setattr(cp_spec, "FUSED_VERIFY", fused_verify)
    cp = _predictor(torch.float32, "cpu")
    hidden, c0, sampling, seeds, frames, shape, slots, positions = _frame_inputs(B, "cpu", False)
    ref = cp.frame_unfused(
        hidden, c0, sampling, seeds, frames, torch.zeros(shape), torch.zeros(shape), slots,
        positions,
    )  # fmt: skip
    spec = SpeculativeCodePredictor(cp, 8, 5, draft_heads=_draft_near(cp), stats=True)
    for window in (1, 2, 3, 5):
        assert torch.equal(spec.frame(hidden, c0, sampling, seeds, frames, kind, window), ref)
    assert sum(spec.report()["tested"]) > 0


def _accept_samples(rule, n=20000, k=3, vocab=6):
    """The codes a round emits at offsets 0 and 1 for fixed p, q over n seeds."""
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(2 * torch.randn(1, k + 1, vocab, generator=g), -1).expand(n, -1, -1)
    q = torch.softmax(2 * torch.randn(1, k, vocab, generator=g), -1).expand(n, -1, -1)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    books = torch.arange(1, k + 1).expand(n, k)
    frames = torch.zeros(n, dtype=torch.int64)

    def counters(kind, b):
        return cp_spec.spec_counters(frames, b, kind, 16).reshape(-1)

    def draw(probs, kind, b):  # the fused sampler on log-probabilities: a draw from probs
        rows = probs.shape[0] * probs.shape[1]
        out = fused_sample(
            torch.log(probs).reshape(rows, vocab),
            plain_sampling(rows, "cpu"),
            seeds.repeat_interleave(probs.shape[1]),
            counters(kind, b),
        )
        return out.reshape(probs.shape[:2])

    drafts = draw(q, cp_spec.DRAFT_DRAW, books)
    u = noise(seeds, cp_spec.spec_counters(frames, books, cp_spec.ACCEPT_TEST, 16), 1)[..., 0]
    accepted, dist, _ = rule(p, q, drafts, u)
    final = draw(dist[:, None], cp_spec.FINAL_DRAW, accepted[:, None] + 1)[:, 0]
    first = torch.where(accepted > 0, drafts[:, 0], final)
    second = torch.where(accepted > 1, drafts[:, 1], final)[accepted > 0]
    return p[0], first, second


def _chisquare_vs(probs, samples):
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    probs = probs.double() / probs.double().sum()
    keep = probs > 0
    return chisquare(observed[keep], probs[keep] / probs[keep].sum() * observed.sum()).pvalue


def _always_accept(p, q, drafts, u):
    return speculative_accept(p, q, drafts, torch.zeros_like(u))


def _no_residual(p, q, drafts, u):  # resamples from p instead of max(0, p - q)
    accepted, _, ok = speculative_accept(p, q, drafts, u)
    return accepted, p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0], ok


def test_accept_rule_gives_the_target_distribution():
    p, first, second = _accept_samples(speculative_accept)
    assert _chisquare_vs(p[0], first) > ALPHA
    assert _chisquare_vs(p[1], second) > ALPHA


@pytest.mark.parametrize("wrong", [_always_accept, _no_residual])
def test_wrong_accept_rules_fail_the_same_test(wrong):
    p, first, _ = _accept_samples(wrong)
    assert _chisquare_vs(p[0], first) < 1e-6


def _frame_samples(cp, kind, window, n, offset):
    """Codes of n rows (one context, n seeds) through the target frame or a speculative one."""
    hidden, c0, _, _, _, shape, _, positions = _frame_inputs(1, "cpu", True)
    sampling = _rows(n)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + offset
    frames = torch.full((n,), 3)
    hidden, c0 = hidden.expand(n, -1), c0.expand(n)
    if kind is None:
        shape = (shape[0], n, *shape[2:])
        positions = [torch.full((n,), i) for i in range(G)]
        return cp.frame_unfused(
            hidden, c0, sampling, seeds, frames, torch.zeros(shape), torch.zeros(shape),
            torch.arange(n), positions,
        )  # fmt: skip
    spec = SpeculativeCodePredictor(cp, n, window, draft_heads=_draft_near(cp))
    return spec.frame(hidden, c0, sampling, seeds, frames, kind, window)


def _min_pvalue(a, b):
    """The smallest two-sample chi-square p-value over codebooks 1..G-1 of two runs."""
    pvalues = []
    for cb in range(1, G):
        counts = torch.stack([torch.bincount(x[:, cb], minlength=V) for x in (a, b)])
        counts = counts[:, counts.sum(0) > 0]
        pvalues.append(chi2_contingency(counts.numpy()).pvalue)
    return min(pvalues) * (G - 1)  # Bonferroni over the codebooks


N = 3000


@pytest.fixture(scope="module")
def target_run():
    return _predictor(torch.float32, "cpu"), _frame_samples(
        _predictor(torch.float32, "cpu"), None, 1, N, offset=1
    )


@pytest.mark.parametrize("kind,window", [("self", 1), ("self", 3), ("draft", 2), ("draft", 4)])
def test_sampled_frames_have_the_target_distribution(target_run, kind, window):
    cp, target = target_run
    spec = _frame_samples(cp, kind, window, N, offset=2)
    assert _min_pvalue(target, spec) > ALPHA


@pytest.mark.parametrize("kind", ["self", "draft"])
def test_a_wrong_rule_fails_the_frame_test(target_run, kind, monkeypatch):
    cp, target = target_run
    monkeypatch.setattr(cp_spec, "speculative_accept", _always_accept)
    spec = _frame_samples(cp, kind, 3, N, offset=2)
    assert _min_pvalue(target, spec) < 1e-6


@needs_kernel
@pytest.mark.parametrize("fused_verify", [False, True])
@pytest.mark.parametrize("do_sample", [False, True])
def test_kernel_path_matches_the_references(do_sample, fused_verify, monkeypatch):
    """fp32 on the kernels (CUDA, or the interpreter): the same codes as the reference path
    (greedy: all; sampled: Gumbel-max over logits equal to rounding, so nearly all); the
    verify pass as `extend` or as the fused decode over k + 1 tokens (rows at different
    depths after the first round)."""
    monkeypatch.setattr(cp_spec, "FUSED_VERIFY", fused_verify)
    B = 3
    cp = _predictor(torch.float32, KDEV)
    hidden, c0, sampling, seeds, frames, *_ = _frame_inputs(B, KDEV, do_sample)
    spec = SpeculativeCodePredictor(cp, B, 3, draft_heads=_draft_near(cp).to(KDEV))
    got = {k: spec.frame(hidden.to(KDEV), c0, sampling, seeds, frames, k, 3) for k in SPEC_KINDS}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_cp = _predictor(torch.float32, "cpu")
    ref = SpeculativeCodePredictor(ref_cp, B, 3, draft_heads=_draft_near(ref_cp))
    cpu = [t.cpu() for t in (hidden, c0, seeds, frames)]
    for kind, codes in got.items():
        want = ref.frame(cpu[0], cpu[1], sampling.to("cpu"), cpu[2], cpu[3], kind, 3)
        agree = (codes.cpu() == want).float().mean().item()
        assert agree == 1.0 if not do_sample else agree >= 0.9, (kind, agree)


@needs_kernel
@pytest.mark.parametrize("fused_verify", [False, True])
def test_exact_match_kernel_path_draws_the_plain_frames_codes(fused_verify, monkeypatch):
    """speculative_exact on the kernels (CUDA, or the interpreter), sampled rows: the
    speculative frame's codes are the plain fused frame's, for both draft kinds, with the
    verify pass as `extend` or fused."""
    monkeypatch.setattr(cp_spec, "FUSED_VERIFY", fused_verify)
    B = 3
    cp = _predictor(torch.float32, KDEV)
    hidden, c0, sampling, seeds, frames, shape, slots, positions = _frame_inputs(B, KDEV, True)
    hidden = hidden.to(KDEV)
    k, v = torch.zeros(shape, device=KDEV), torch.zeros(shape, device=KDEV)
    want = cp.frame(hidden, c0, sampling, seeds, frames, k, v, slots, positions)
    spec = SpeculativeCodePredictor(cp, B, 3, draft_heads=_draft_near(cp).to(KDEV), exact=True)
    for kind in SPEC_KINDS:
        assert torch.equal(spec.frame(hidden, c0, sampling, seeds, frames, kind, 3), want), kind
