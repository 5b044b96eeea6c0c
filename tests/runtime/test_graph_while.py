"""runtime.graph_while: WHILE nodes added to a graph under capture (the step driver's
csrc/graph_while.cu), and the speculative code predictor's rounds as one WHILE node.

GPU only, with a step driver built with graph_while.cu (CUDA >= 12.4); on the CPU machines the
source's compile is checked by test_driver_cuda_build.py and the rounds' staging (the inputs
the WHILE body reads) by test_cp_spec.py's CPU tests, which run the same frame()."""

import pytest
import torch

from ttsbuild.runtime.driver import driver_module
from ttsbuild.runtime.graph_while import WhileBody, full_edges, while_nodes_available

pytestmark = pytest.mark.skipif(
    not while_nodes_available(),
    reason="needs a GPU and the step driver built with graph_while.cu",
)


class Counter:
    """Body: x += step; live = x < limit. The loop's trip count lives in device tensors, so
    one captured graph runs a different number of iterations per replay."""

    def __init__(self):
        dev = "cuda"
        self.x = torch.zeros(1, dtype=torch.int64, device=dev)
        self.step = torch.ones(1, dtype=torch.int64, device=dev)
        self.limit = torch.zeros(1, dtype=torch.int64, device=dev)
        self.live = torch.zeros(1, dtype=torch.int32, device=dev)
        self.trail = torch.zeros(64, dtype=torch.int64, device=dev)  # x after each iteration

    def body(self) -> None:
        self.x += self.step
        self.trail[self.x.clamp(0, 63)] = self.x  # a scatter: a kernel reading x's new value
        self.live.copy_((self.x < self.limit).to(torch.int32))

    def graph(self, body: WhileBody, max_iterations: int, scratch: torch.Tensor):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream):
            self.x.zero_()
            self.trail.zero_()
            self.live.copy_((self.x < self.limit).to(torch.int32))
            body.run(max_iterations)
            scratch.copy_(self.x * 10 + 1)  # work after the loop sees its last iteration
        return graph


# How the node holds its body: as probed (`full_edges()`: programmatic edges kept where the
# probe graph ran with one), or with every programmatic edge made full (what a runtime that
# refuses them gets)
EDGES = ["probed", "full"]


def _edges(body: WhileBody, edges: str) -> WhileBody:
    if edges == "full":
        body.full_edges = True
    return body


def test_the_switch_follows_the_probe(monkeypatch):
    kept = driver_module(True).while_keeps_programmatic_edges()
    print(f"WHILE bodies keep programmatic edges on this device: {kept}")  # in the GPU log
    monkeypatch.setenv("TTSBUILD_WHILE_EDGES", "auto")
    full_edges.cache_clear()
    try:
        assert full_edges() is (not kept)
    finally:
        full_edges.cache_clear()


@pytest.mark.parametrize("edges", EDGES)
def test_the_loop_runs_until_the_body_clears_its_flag(edges):
    c = Counter()
    body = _edges(WhileBody.capture(c.body, c.live), edges)
    after = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = c.graph(body, 20, after)
    for limit, want in ((3, 3), (7, 7), (1, 1), (0, 0), (50, 20), (20, 20)):
        # limit 0: the flag is clear before the first iteration; 50: the cap of 20 stops it
        c.limit.fill_(limit)
        graph.replay()
        torch.cuda.synchronize()
        assert int(c.x) == want, (limit, int(c.x))
        assert body.iterations() == want
        assert int(after) == want * 10 + 1
        trail = c.trail.cpu()
        assert trail[1 : want + 1].tolist() == list(range(1, want + 1))
        assert int(trail[want + 1 :].abs().sum()) == 0


def test_steps_of_another_size_and_a_body_run_twice_in_one_graph():
    c = Counter()
    body = WhileBody.capture(c.body, c.live)
    c.step.fill_(3)
    c.limit.fill_(10)
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        c.x.zero_()
        c.live.fill_(1)
        body.run(100)
        out[0] = c.x[0]
        c.x.fill_(-5)
        c.live.fill_(1)
        body.run(100)
        out[1] = c.x[0]
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [12, 10]  # 0 -> 12 (four steps of 3), -5 -> 10 (five)


def test_refusals():
    c = Counter()
    body = WhileBody.capture(c.body, c.live)
    with pytest.raises(RuntimeError, match="graph being captured"):
        body.run(3)
    with pytest.raises(ValueError, match="int32"):
        WhileBody(body.graph, torch.zeros(1, dtype=torch.int64, device="cuda"))


def _spec_case(do_sample: bool):
    from test_cp_fused import _frame_inputs, _predictor
    from test_cp_spec import _draft_near

    from ttsbuild.runtime.cp_spec import SpeculativeCodePredictor

    B = 3
    cp = _predictor(torch.float32, "cuda")
    hidden, c0, sampling, seeds, frames, *_ = _frame_inputs(B, "cuda", do_sample)
    draft = _draft_near(cp).to("cuda")
    looped = SpeculativeCodePredictor(cp, B, 3, draft_heads=draft, loop=True, stats=True)
    every = SpeculativeCodePredictor(cp, B, 3, draft_heads=draft, loop=False, conditional=False,
                                     stats=True)  # fmt: skip
    return looped, every, (hidden.cuda(), c0, sampling, seeds, frames)


def _row(inputs, r: int):
    hidden, c0, sampling, seeds, frames = inputs
    rows = torch.tensor([r], device=hidden.device)
    return (hidden[r : r + 1], c0[r : r + 1], sampling.select(rows), seeds[r : r + 1].clone(),
            frames[r : r + 1])  # fmt: skip


@pytest.mark.parametrize("edges", EDGES)
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("kind", ["self", "draft"])
def test_speculative_rounds_as_a_while_node_give_the_codes_of_every_round_run(kind, do_sample,
                                                                             edges):
    """The captured frame with its rounds as one WHILE node == the same frame with every
    round run (eager, same kernels): the same codes, bit for bit; and the loop ran exactly the
    rounds its rows needed (as the every-round path's stats count them), no more: each of the
    case's rows alone (batch 1), and all three together (batch 3).
    On random weights the drafts are mostly rejected (a row needs up to G - 2 rounds), so the
    self kind's case asserts that some row needed fewer: a loop that never stops early fails
    it. (The near draft's noise flips these random heads' greedy picks: its greedy rows needed
    all 4 rounds on the H200, 2026-12-05, and its sampled rows fewer.)"""
    looped, every, inputs = _spec_case(do_sample)
    G = looped.groups
    needed = []
    for case in [_row(inputs, r) for r in range(3)] + [inputs]:
        B = case[0].shape[0]
        every.reset_stats()
        want = every.frame(*case, kind, 3)
        rounds_needed = round(every.report()["passes_per_batch_frame"]) - 1
        looped.prepare(B, 3, kind)
        body = looped.bodies[(B, 3, kind)]
        _edges(body, edges)  # its kernels launch with PDL
        out = torch.zeros_like(want)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(looped.frame(*case, kind, 3))
        looped.reset_stats()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        rounds = body.iterations()
        assert 1 <= rounds <= G - 2 and rounds == rounds_needed, (B, rounds, rounds_needed)
        # the stats count a batch pass per round with a live row, plus the first pass
        assert looped.report()["passes_per_batch_frame"] == rounds + 1
        needed.append(rounds)
        # a second replay with other seeds: the graph follows its inputs
        case[3].add_(1)
        want = every.frame(*case, kind, 3)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    if kind == "self":  # see the docstring: here the draft kind's greedy rows reject it all
        assert min(needed[:3]) < G - 2, f"no row stopped early: {needed} (the case lost its point)"


@pytest.mark.parametrize("kind", ["self", "draft"])
def test_exact_match_rounds_as_a_while_node_give_the_plain_frames_codes(kind):
    """speculative_exact on the GPU: the captured frame (its rounds one WHILE node) draws every
    code as the plain fused frame does for the same seeds and counters, sampled rows included,
    bit for bit (fp32 weights: no near-ties between the two paths' logits in this case)."""
    from test_cp_fused import _frame_inputs, _predictor
    from test_cp_spec import _draft_near

    from ttsbuild.runtime.cp_spec import SpeculativeCodePredictor

    B = 3
    cp = _predictor(torch.float32, "cuda")
    hidden, c0, sampling, seeds, frames, shape, slots, positions = _frame_inputs(B, "cuda", True)
    hidden = hidden.cuda()
    k, v = torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")
    want = cp.frame(hidden, c0, sampling, seeds, frames, k, v, slots, positions)
    spec = SpeculativeCodePredictor(cp, B, 3, draft_heads=_draft_near(cp).to("cuda"),
                                    loop=True, exact=True)  # fmt: skip
    spec.prepare(B, 3, kind)
    out = torch.zeros_like(want)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        out.copy_(spec.frame(hidden, c0, sampling, seeds, frames, kind, 3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert 1 <= spec.bodies[(B, 3, kind)].iterations() <= spec.groups - 2


def test_capturing_a_looped_frame_without_its_body_is_refused():
    looped, _, inputs = _spec_case(False)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.graph(graph, stream=stream):
            looped.frame(*inputs, "self", 3)
