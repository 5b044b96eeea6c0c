"""Speculative decoding of the code predictor: several codebooks per pass, lossless.

A frame's codebooks 1..15 take 15 sequential passes of the code predictor, each streaming
all of its weights for one code. Here a draft proposes the next k codebooks of every row,
one pass of the target over k + 1 positions (`PackedStack.extend`) scores them, and
speculative sampling keeps what the target agrees with:
  accept draft x of codebook c with probability min(1, p(x) / q(x)); at the first
  rejection draw from normalise(max(0, p - q)); when all k are accepted, draw a bonus code
  from p at the last position.
Every code is then distributed exactly as the target's sampler draws it (p is the
temperature / top-k / top-p distribution of `generation.sampling.sample`; on the GPU the
fused sampler's top-p cut may differ from it by float rounding, `plugins.sampling`). Greedy
rows have one-hot p and q at their argmax, so they get the target's greedy codes exactly.

Drafts (the same code path: a head per codebook on the hidden state at depth d, so all k
drafts of a round come from one GEMV-like pass, no sequential draft steps):
- "self": the target's own head c on the hidden state at depth d < c (no new weights);
- "draft": trained draft heads of the same layout (`runtime.draft`, `ttsbuild distill-draft`).

Randomness is counter-based like `generation.sampling`: each draw is keyed by (seed,
counter), counters (kind << 28) + frame * G + codebook for kind = draft draw, acceptance
test, final (resample or bonus) draw, all distinct from the plain sampler's frame * G +
codebook. Each is consumed at most once per frame (a codebook is decided once; draws past a
row's first rejection influence nothing kept), as the losslessness argument needs, and a
row's codes do not depend on the other rows of its batch. They are not the plain sampler's
draws, though: a frame run without speculation (another bucket) draws other codes.
`exact=True` (EnginePlan.speculative_exact) verifies by exact match instead
(`plugins.spec_accept.spec_accept(exact=True)`): the drafts draw with the plain sampler's
counters, the target's draw at each verified position is the plain sampler's, and a row keeps
its drafts while they equal those draws, so every code is the plain sampler's at any bucket;
accepted less often.

On the device: fixed shapes, no host sync. Each row's depth (the last codebook it has)
lives on the device, rows accept different lengths; a row past codebook G - 1 runs on with
clamped indices and writes only columns >= G of its code buffer, which are dropped. A
frame needs at most G - 2 rounds. Captured into a CUDA graph, the rounds are one WHILE node
on "some row is not done" when the step driver has them (`runtime.graph_while`: the round is
captured ahead as a body graph of its own by `prepare(B, window, kind)`, reading the frame's
inputs from this object's buffers), so rounds after all rows finished cost nothing but the
node's check; else, where torch has conditional nodes in Python
(`CUDAGraph.begin_capture_to_if_node`), every round after the first is an IF node; without
either, every round runs (on the CPU the host stops early).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ttsbuild.generation.sampling import (
    SamplingBatch,
    draw_counter,
    filter_top_k_top_p,
    uniform_noise,
)
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.fused_linear import norm_linear
from ttsbuild.plugins.head_gemv import head_gemv
from ttsbuild.plugins.norm_act import rms_norm_reference
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.plugins.spec_accept import RoundState, spec_accept
from ttsbuild.plugins.spec_round import frame_start, round_books, stage_frame, verify_index
from ttsbuild.runtime.cp_fused import FusedCodePredictor, decode_fused
from ttsbuild.runtime.fast_model import Dense
from ttsbuild.runtime.graph_while import WhileBody, while_nodes_available
from ttsbuild.runtime.plan import MAX_SPEC_WINDOW

SPEC_KINDS = ("self", "draft")
_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
MAX_WINDOW = MAX_SPEC_WINDOW
# Counter kinds (bits 28+): frame * G + codebook stays below 2^28 for frames < 2^24.
DRAFT_DRAW, ACCEPT_TEST, FINAL_DRAW = 1, 2, 3
# The verify pass over k + 1 positions on the fused decode kernels (`cp_fused.decode_fused`
# with tokens=k + 1: five launches a layer, each row's k + 1 tokens attended in turn by one
# program per KV head) for batches up to FUSED_VERIFY_MAX_ROWS rows (the fused code
# predictor's buckets), instead of `PackedStack.extend` (~9 launches a layer). Built
# 2026-12-04, not yet timed; speculation itself is off in every bucket of the served plan.
# TTSBUILD_SPEC_FUSED_VERIFY=0 turns it off.
FUSED_VERIFY = os.environ.get("TTSBUILD_SPEC_FUSED_VERIFY", "1") == "1"
FUSED_VERIFY_MAX_ROWS = 8
# A round's acceptance (the draft's and the target's filtered distributions, the tests, the
# residual or bonus draw: ~45 launches) as one kernel (`plugins.spec_accept`) wherever the
# kernels run. GPU tests pass on the H200 (2026-12-05); TTSBUILD_SPEC_FUSED_ACCEPT=0 turns it
# off.
FUSED_ACCEPT = os.environ.get("TTSBUILD_SPEC_FUSED_ACCEPT", "1") == "1"


def conditional_nodes_available() -> bool:
    """Whether this torch can capture IF nodes into a CUDA graph (torch.cond's machinery)."""
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def spec_counters(frames: torch.Tensor, books: torch.Tensor, kind: int, groups: int):
    """Counters [B, T] of a speculative draw for codebooks `books` [B, T] of `frames` [B]."""
    return (kind << 28) + draw_counter(frames[:, None], groups, books)


def noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """Uniforms [B, T, width] keyed by (seed of the row, counter)."""
    B, T = counters.shape
    u = uniform_noise(seeds.repeat_interleave(T), counters.reshape(-1), width)
    return u.reshape(B, T, width)


def target_probs(logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """The distribution `generation.sampling.sample` draws from, [B, T, V] fp32 -> [B, T, V]:
    softmax of the temperature / top-k / top-p filtered logits; one-hot at the argmax of
    the raw logits for greedy rows."""
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V).float()

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(T)

    scaled = flat / per_token(sampling.temperature)[:, None]
    filtered = filter_top_k_top_p(scaled, per_token(sampling.top_k), per_token(sampling.top_p))
    probs = torch.softmax(filtered, dim=-1)
    greedy = torch.zeros_like(probs).scatter_(-1, flat.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(per_token(sampling.do_sample)[:, None], probs, greedy)
    return probs.reshape(B, T, V)


def per_draft(sampling: SamplingBatch, k: int) -> SamplingBatch:
    """Each row's settings repeated for its k drafts (rows of [B * k] logits)."""
    return SamplingBatch(**{f: getattr(sampling, f).repeat_interleave(k) for f in _FIELDS})


def plain_sampling(n: int, device) -> SamplingBatch:
    """Draw as-is: temperature 1, no top-k / top-p (for logits that are log-probabilities)."""
    return SamplingBatch(
        do_sample=torch.ones(n, dtype=torch.bool, device=device),
        temperature=torch.ones(n, device=device),
        top_k=torch.zeros(n, dtype=torch.int64, device=device),
        top_p=torch.ones(n, device=device),
        repetition_penalty=torch.ones(n, device=device),
    )


def speculative_accept(
    p: torch.Tensor,  # [B, k + 1, V] target distributions of the k drafted codebooks + 1
    q: torch.Tensor,  # [B, k, V] draft distributions
    drafts: torch.Tensor,  # [B, k] drafted ids (drawn from q)
    u: torch.Tensor,  # [B, k] uniforms of the acceptance tests
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling's rule. Returns (accepted [B] in 0..k: the length of the
    accepted prefix, the distribution [B, V] of the code after it: normalised
    max(0, p - q) at the first rejection, p itself after k acceptances, ok [B, k] bool)."""
    px = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    qx = q.gather(-1, drafts[..., None])[..., 0]
    ok = u * qx < px  # u < p(x) / q(x); q(x) > 0 as x was drawn from q
    accepted = ok.long().cumprod(1).sum(1)
    residual = torch.cat([(p[:, :-1] - q).clamp(min=0), p[:, -1:]], dim=1)  # [B, k + 1, V]
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    dist = residual.gather(1, at)[:, 0]
    # p == q to rounding leaves no residual mass: then the target's own distribution.
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p.gather(1, at)[:, 0])
    return accepted, dist, ok


def head_logits(heads: torch.Tensor, h: torch.Tensor, books: torch.Tensor,
                norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:  # fmt: skip
    """Logits fp32 [B, T, V] of head `books[b, t]` (codebooks 1..C, clamped) on h [B, T|1, H];
    norm: (weight, eps) of the final RMSNorm when h is the residual stream.
    On the kernels each row's head is read in place (normalising h itself); on the references
    few rows gather just the heads they need and many rows apply all C heads once and pick."""
    C, V, H = heads.shape
    B, T = books.shape
    if want_triton(h, None):  # each head read in place, h and books as views
        return head_gemv(heads, h.expand(B, T, H), books, offset=-1, norm=norm)
    if norm is not None:
        h = rms_norm_reference(h, norm[0], norm[1])
    index = (books - 1).clamp(0, C - 1)
    if B * T <= C:
        return torch.einsum("btvh,bth->btv", heads[index], h.expand(B, T, H)).float()
    every = (h @ heads.reshape(C * V, H).T).reshape(B, h.shape[1], C, V).expand(B, T, C, V)
    return every.gather(2, index[:, :, None, None].expand(B, T, 1, V))[:, :, 0].float()


def dense_weight(d: Dense, dtype: torch.dtype) -> torch.Tensor:
    """A head's weight [V, H] in the activation dtype (FP8 heads dequantised)."""
    if d.is_fp8:
        return (d.weight.float() * d.scale.float().reshape(-1, 1)).to(dtype)
    return d.weight.to(dtype)


@contextmanager
def _if_node(pred: torch.Tensor):
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


class SpeculativeCodePredictor:
    """Speculative frames of a `FusedCodePredictor`'s target, with its own scratch cache
    (G + max_window + 1 positions: a round may write up to k + 1 past the last codebook)
    and per-row device state for up to `max_batch` rows."""

    def __init__(
        self,
        cp: FusedCodePredictor,
        max_batch: int,
        max_window: int,
        draft_heads: torch.Tensor | None = None,  # [G - 1, V, H] (runtime.draft)
        conditional: bool | None = None,  # IF nodes under capture (None: when available)
        stats: bool = False,  # count drafts tested / accepted per depth, passes (benchmarks)
        loop: bool | None = None,  # the rounds as a WHILE node under capture (None: if built)
        exact: bool = False,  # verify by exact match: every code the plain sampler's draw
    ):
        if not 1 <= max_window <= MAX_WINDOW:
            raise ValueError(f"speculation window must be 1..{MAX_WINDOW}, got {max_window}")
        self.cp = cp
        self.exact = exact
        c = cp.stack.cfg
        dtype, dev = cp.codec_embedding.dtype, cp.codec_embedding.device
        self.groups, self.max_window = cp.num_code_groups, max_window
        self.heads = torch.stack([dense_weight(h, dtype) for h in cp.heads])  # [G - 1, V, H]
        if draft_heads is not None and draft_heads.shape != self.heads.shape:
            raise ValueError(
                f"draft heads {tuple(draft_heads.shape)} do not fit the target's heads "
                f"{tuple(self.heads.shape)}"
            )
        self.draft_heads = None if draft_heads is None else draft_heads.to(dev, dtype)
        self.conditional = conditional_nodes_available() if conditional is None else conditional
        on_gpu = torch.device(dev).type == "cuda"
        self.loop = (on_gpu and while_nodes_available()) if loop is None else loop
        self.bodies: dict[tuple[int, int, str], WhileBody] = {}  # (B, window, kind)
        # On CPU (never captured) stop once every row is done; reads a device value, so the
        # capture-safety test turns it off (tests/runtime/test_capture_safety.py).
        self.early_exit_on_cpu = True
        G, W = self.groups, max_window
        shape = (c.num_layers, max_batch, c.num_kv_heads, G + W + 1, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=dev)
        self.slots = torch.arange(max_batch, device=dev)
        self.zeros = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # first positions
        # the input embeddings of codebooks 1..G-1 as one table [(G - 1) * V, H] (a view of a
        # contiguous stack; made once, never per round), rows picked by `verify_index`
        self.table = cp.embeddings.reshape(-1, cp.embeddings.shape[-1])
        # the first pass's two tokens of every row, token by token (its fused form)
        self.pair = torch.zeros(2 * max_batch, c.hidden_size, dtype=dtype, device=dev)
        self.depth = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.pending = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.source = torch.zeros(max_batch, c.hidden_size, dtype=dtype, device=dev)
        self.codes = torch.zeros(max_batch, G + W + 2, dtype=torch.int64, device=dev)
        # A frame's inputs as the rounds read them: fixed addresses, so a round captured
        # ahead (the WHILE body) reads the inputs of the frame that runs it.
        self.in_sampling = plain_sampling(max_batch, dev)
        self.in_seeds = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.in_frames = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        # per drafted row (B rows x k drafts): the settings and seeds repeated, and each
        # row's draft counter base, staged once per frame instead of once per round
        self.in_draft_sampling = plain_sampling(max_batch * max_window, dev)
        self.in_draft_seeds = torch.zeros(max_batch * max_window, dtype=torch.int64, device=dev)
        self.in_draft_base = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.in_first = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # frames * G + 1
        self.live = torch.zeros(1, dtype=torch.int32, device=dev)  # some row is not done
        self.arrivals = torch.zeros(1, dtype=torch.int32, device=dev)  # spec_accept's count
        self.trash = G + W + 1  # the column that writes past a row's accepted codes go to
        self.stats = stats
        # drafts tested [0] / accepted [1] at offset t; passes of rows, passes of batches
        # (a batch runs a pass while any row is live), rows, frame calls
        self.tested = torch.zeros(2, W + 1, dtype=torch.int64, device=dev)
        self.passes = torch.zeros(4, dtype=torch.int64, device=dev)

    def _fused(self, B: int) -> bool:
        """Whether a frame of B rows runs its passes on the fused kernels (the verify pass
        over k + 1 tokens, the final norm inside the heads: the rows' source is then the
        residual stream) or as `PackedStack.prefill` / `extend` (final-norm hidden states)."""
        return FUSED_VERIFY and B <= FUSED_VERIFY_MAX_ROWS

    def heads_of(self, kind: str) -> torch.Tensor:
        if kind == "self":
            return self.heads
        if kind == "draft":
            if self.draft_heads is None:
                raise ValueError("speculation with a trained draft needs draft heads")
            return self.draft_heads
        raise ValueError(f"speculation kind must be one of {SPEC_KINDS}, got {kind!r}")

    def frame(
        self,
        hidden: torch.Tensor,  # [B, talker hidden]
        c0: torch.Tensor,  # [B]
        sampling: SamplingBatch,
        seeds: torch.Tensor,  # [B]
        frames: torch.Tensor,  # [B]
        kind: str,
        window: int,
    ) -> torch.Tensor:
        """Codes [B, G] (codebook 0 = c0), distributed as the target's frame."""
        if not 1 <= window <= self.max_window:
            raise ValueError(f"window {window} outside 1..{self.max_window}")
        heads = self.heads_of(kind)
        B, G, cp = hidden.shape[0], self.groups, self.cp
        capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
        body = self.bodies.get((B, window, kind)) if capturing and self.loop else None
        if capturing and self.loop and body is None:
            raise RuntimeError(
                f"the speculative rounds of batch {B}, window {window}, kind {kind!r} are a "
                "WHILE node under capture: call prepare(B, window, kind) before capturing"
            )
        slots = self.slots[:B]
        self._stage(sampling, seeds, frames, B, window)
        sampling, seeds, frames = self._staged(B)
        # Codebook 1: the plain first pass (positions 0, 1) and the target's own sampler;
        # where the verify pass is fused, as the fused frame runs it (`PAIR_PREFILL`): both
        # tokens of every row in one pass, each input projected straight into place, and the
        # final norm inside the head (the rounds keep the residual stream as their source)
        if self._fused(B):
            x = self.pair[: 2 * B]
            cp._project(hidden, None, out=x[:B])
            cp._project(cp.codec_embedding, c0, out=x[B:])
            h = decode_fused(cp.stack, x, self.k_cache, self.v_cache, slots, self.zeros[:B],
                             final_norm=False, tokens=2)[B:]  # fmt: skip
            head, eps = cp.heads[0], cp.stack.cfg.rms_norm_eps
            logits = norm_linear(h, cp.stack.norm, head.weight, head.scale, eps=eps,
                                 out_dtype=torch.float32)  # fmt: skip
        else:
            x = torch.stack([hidden, cp.codec_embedding[c0]], dim=1)  # [B, 2, H]
            h = cp.stack.prefill(cp.proj(x), self.k_cache, self.v_cache, slots)[:, -1]
            logits = cp.heads[0](h).float()
        code1 = fused_sample(logits, sampling, seeds, self.in_first[:B])  # frames * G + 1
        depth, codes = self.depth[:B], self.codes[:B]
        # depth 1, pending code1, source h, codes 0 and 1, live: one launch on the kernels
        frame_start(code1, c0, h, depth, self.pending[:B], self.source[:B], codes, self.live, G)
        if self.stats:  # scalar adds: no host-to-device copy (graph-safe)
            self.passes[0::2] += B
            self.passes[1::2] += 1
        if body is not None:  # every round on the device: a WHILE node on "some row live"
            body.run(max_iterations=G - 2)  # (live set by frame_start)
            return codes[:, :G].clone()
        for r in range(G - 2):  # each round decides >= 1 codebook of every live row
            args = (heads, sampling, seeds, frames, window, B)
            if r == 0:
                self._round(*args)
            elif capturing and self.conditional:
                with _if_node((depth < G - 1).any()):
                    self._round(*args)
            elif (
                self.early_exit_on_cpu
                and hidden.device.type == "cpu"
                and not bool((depth < G - 1).any())
            ):
                break
            else:
                self._round(*args)
        return codes[:, :G].clone()

    def prepare(self, B: int, window: int, kind: str) -> None:
        """Capture the round of B rows, window `window`, draft `kind` as a WHILE body (GPU,
        outside any capture; a no-op without WHILE nodes). Frames captured later with these
        settings run their rounds as one WHILE node."""
        if not self.loop or (B, window, kind) in self.bodies:
            return
        if not 1 <= window <= self.max_window:
            raise ValueError(f"window {window} outside 1..{self.max_window}")
        heads = self.heads_of(kind)
        sampling, seeds, frames = self._staged(B)

        def step() -> None:  # the round leaves "some row is not done" in self.live
            self._round(heads, sampling, seeds, frames, window, B)

        self.bodies[(B, window, kind)] = WhileBody.capture(step, self.live)

    def _stage(self, sampling: SamplingBatch, seeds, frames, B: int, k: int) -> None:
        """The frame's inputs into the buffers the rounds read, and repeated per draft draw,
        with the draft counters' base (`plugins.spec_round.stage_frame`: one launch)."""
        fields = [getattr(sampling, f) for f in _FIELDS] + [seeds, frames]
        plain = [getattr(self.in_sampling, f) for f in _FIELDS] + [self.in_seeds, self.in_frames]
        draft = [getattr(self.in_draft_sampling, f) for f in _FIELDS] + [self.in_draft_seeds]
        # exact: the drafts draw with the plain sampler's counters (its noise), else their own
        stage_frame(fields, plain, draft, self.in_draft_base, self.in_first, k, self.groups,
                    0 if self.exact else DRAFT_DRAW << 28)  # fmt: skip

    def _staged(self, B: int) -> tuple[SamplingBatch, torch.Tensor, torch.Tensor]:
        sampling = SamplingBatch(**{f: getattr(self.in_sampling, f)[:B] for f in _FIELDS})
        return sampling, self.in_seeds[:B], self.in_frames[:B]

    def _round(self, heads, sampling, seeds, frames, k: int, B: int) -> None:
        """Draft k codebooks past each row's depth, verify them in one pass, keep the
        accepted prefix + one code; the row state is updated in place (graph-safe)."""
        G, cp = self.groups, self.cp
        depth, pending = self.depth[:B], self.pending[:B]
        source, codes = self.source[:B], self.codes[:B]
        # [B, k + 1] codebooks verified, the draft draws' counters (`spec_counters`) and the
        # verify pass's first positions (depth + 1)
        books, counters, start = round_books(depth, self.in_draft_base[:B], k)
        V = heads.shape[1]

        # draft: codebooks d+1..d+k from the hidden state at depth d, drawn from
        # q = target_probs(draft logits) by the fused sampler (one launch for all B * k), with
        # the settings, seeds and counter bases staged per drafted row (`_stage`)
        fused = self._fused(B)
        norm = (cp.stack.norm, cp.stack.cfg.rms_norm_eps) if fused else None
        draft_logits = head_logits(heads, source[:, None], books[:, :k], norm)  # [B, k, V]
        per_row = SamplingBatch(**{f: getattr(self.in_draft_sampling, f)[: B * k]
                                   for f in _FIELDS})  # fmt: skip
        drafts = fused_sample(draft_logits.reshape(B * k, V), per_row,
                              self.in_draft_seeds[: B * k], counters).reshape(B, k)  # fmt: skip

        # verify: inputs code_d, drafts at positions d+1..d+k+1 -> p of codebooks d+1..d+k+1;
        # the projection gathers each position's embedding row itself (`verify_index`)
        index = verify_index(pending, drafts, books, G, cp.embeddings.shape[1], fused)
        x = cp._project(self.table, index)  # [(k + 1) B, H] by position if fused, else by row
        if fused:  # token by token
            h = decode_fused(cp.stack, x, self.k_cache, self.v_cache, self.slots[:B], start,
                             final_norm=False, tokens=k + 1)  # fmt: skip
            h = h.view(k + 1, B, -1).transpose(0, 1)  # [B, k + 1, H]
        else:
            h = cp.stack.extend(x.view(B, k + 1, -1), self.k_cache, self.v_cache,
                                self.slots[:B], start)  # fmt: skip
        target_logits = head_logits(self.heads, h, books, norm)  # [B, k + 1, V]
        if self.stats:  # the rows' depths before the round: counted first
            depth_before = depth.clone()
        # the acceptance and the rows' new state (codes, source, pending, depth, live) in
        # one launch where the kernels run (else the reference ops)
        state = RoundState(codes, source, pending, depth, self.live, self.arrivals, self.trash)
        accepted, final, ok = spec_accept(draft_logits, target_logits, drafts, books, sampling,
                                          seeds, frames, G, h, state, exact=self.exact,
                                          use_triton=None if FUSED_ACCEPT else False)  # fmt: skip
        if self.stats:
            self._count(depth_before, books[:, :k], ok)

    def _count(self, depth, books, ok) -> None:
        live = depth < self.groups - 1
        earlier = torch.cat([torch.ones_like(ok[:, :1]), ok[:, :-1].long().cumprod(1).bool()], 1)
        tested = live[:, None] & (books <= self.groups - 1) & earlier  # [B, k]
        k = ok.shape[1]
        self.tested[0, 1 : k + 1] += tested.sum(0)
        self.tested[1, 1 : k + 1] += (tested & ok).sum(0)
        self.passes[0] += live.sum()
        self.passes[1] += live.any()

    def reset_stats(self) -> None:
        self.tested.zero_()
        self.passes.zero_()

    def report(self) -> dict:
        """Acceptance per drafted depth (a draft at offset t is tested when offsets < t were
        accepted), passes per frame per row and per batch (the max over its rows)."""
        tested, passes = self.tested.cpu(), self.passes.cpu()
        rows, calls = max(1, int(passes[2])), max(1, int(passes[3]))
        acceptance = {
            t: round(int(tested[1, t]) / int(tested[0, t]), 4)
            for t in range(1, tested.shape[1]) if int(tested[0, t])
        }  # fmt: skip
        return {
            "acceptance_per_depth": acceptance,
            "passes_per_row_frame": int(passes[0]) / rows,
            "passes_per_batch_frame": int(passes[1]) / calls,
            "tested": tested[0, 1:].tolist(),
        }
