"""The fast engine's code path (packed weights, plugin references, slot buffers, codec ring),
run eagerly on CPU, against the reference engine: same codes, same audio."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_runs import finish

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import EagerEngine, Models
from ttsbuild.runtime.graph_engine import GraphBackend, GraphEngine
from ttsbuild.runtime.loader import plan_update
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import RequestError, SynthesisRequest

REQUESTS = [
    SynthesisRequest(
        text="The birch canoe slid on the smooth planks.", voice="ryan", seed=1, max_frames=10
    ),
    SynthesisRequest(
        text="Glue the sheet to the dark blue background.",
        voice="eric",
        language="auto",
        seed=2,
        max_frames=9,
        non_streaming=False,
    ),
    SynthesisRequest(
        text="Rice is often served in round bowls.",
        voice="vivian",
        seed=3,
        max_frames=7,
        instruct="Speak slowly.",
    ),
]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


# The graph engine's plan in these tests: 4 slots, every batch bucket up to 4.
PLAN = dict(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
            prefill_buckets=(32, 64), codec_chunks=(1, 2, 4), codec_ring=8)  # fmt: skip


def run_all(engine, requests, chunk=3):
    """All requests in one batch; audio pulled in chunks of `chunk` frames as they come."""
    slots, _ = _prefilled(engine, requests)
    return finish(engine, slots, chunk)


def _outputs(engine, *rounds):
    """Each round of requests run (`run_all`), then the backend's last hidden states and
    logits (the tiny model's codes can miss a changed input; its hidden states cannot)."""
    runs = [run_all(engine, requests) for requests in rounds]
    return runs, (engine.backend.hidden.clone(), engine.backend.logits.clone())


def _assert_same_outputs(a, b) -> None:
    """Two `_outputs` bit for bit: every round's codes and PCM, the hidden states, logits."""
    (runs_a, state_a), (runs_b, state_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(state_a, state_b, strict=True))
    for round_a, round_b in zip(runs_a, runs_b, strict=True):
        for (codes_a, pcm_a), (codes_b, pcm_b) in zip(round_a, round_b, strict=True):
            assert torch.equal(codes_a, codes_b)
            assert np.array_equal(pcm_a, pcm_b)


def _prefilled(engine, requests):
    """Admit and prefill `requests`: (slots, each slot's talker state after its prefill)."""
    slots = [engine.admit(r) for r in requests]
    engine.prefill(slots)
    backend = engine.backend
    if isinstance(backend, GraphBackend):
        return slots, [backend.hidden[s].clone() for s in slots]
    return slots, [backend.slots[s].hidden.clone() for s in slots]


def test_fast_engine_matches_reference_engine(models):
    """The same codes and audio as the reference engine, and (more sensitive: the tiny
    model's codes can miss a small error in the talker's states) the same talker state after
    every prefill, to fp32 rounding."""
    eager = EagerEngine(models, num_slots=4, max_len=256)
    ref_slots, ref_hidden = _prefilled(eager, REQUESTS)
    reference = finish(eager, ref_slots, 3)
    fast = GraphEngine(models, EnginePlan(**PLAN), use_graphs=False)
    slots, hidden = _prefilled(fast, REQUESTS)
    got = finish(fast, slots, 3)
    for want, h in zip(ref_hidden, hidden, strict=True):
        assert h.shape == want.shape
        assert ((h.double() - want.double()).norm() / want.double().norm()).item() < 1e-5
    for (ref_codes, ref_pcm), (codes, pcm) in zip(reference, got, strict=True):
        assert torch.equal(codes, ref_codes)
        assert pcm.shape == ref_pcm.shape == (codes.shape[0] * 1920,)
        assert np.abs(pcm - ref_pcm).max() <= 1e-5
    assert fast.free_slots() == 4


def test_fp8_engine_stays_close_to_bf16(models):
    """FP8 weights (emulated on CPU by dequantising) change logits by the rounding of e4m3."""
    rc = dict(num_slots=1, max_len=256, max_text=64, batch_buckets=(1,), prefill_buckets=(32,))
    exact = GraphEngine(models, EnginePlan(**rc), use_graphs=False)
    fp8 = GraphEngine(
        models, EnginePlan(precision="fp8", code_predictor_fp8=True, **rc), use_graphs=False
    )
    req = REQUESTS[0]
    for engine in (exact, fp8):
        slot = engine.admit(req)
        engine.prefill([slot])
    a, b = exact.backend.logits[0], fp8.backend.logits[0]
    rel = float((a - b).abs().max() / a.abs().max())
    assert 1e-6 < rel < 0.1  # different (really quantised) but close
    # One byte per weight instead of four (fp32 on CPU), plus one fp32 scale per channel.
    assert fp8.backend.talker_stack.weight_bytes() < exact.backend.talker_stack.weight_bytes() / 3


def test_megaframe_code_predictor_refuses_what_its_kernel_cannot_run(models):
    """plan.megaframe_code_predictor on weights the kernel has no shapes for (the tiny
    checkpoint's; on the CPU the device would be refused next): a clear error at build."""
    plan = EnginePlan(precision="fp8", code_predictor_fp8=True, megaframe_code_predictor=True,
                      **PLAN)
    with pytest.raises(ValueError, match="cp_megaframe: the kernel is built for the shipped "
                       "12 Hz code predictor's shapes"):
        GraphEngine(models, plan, use_graphs=False)


def test_requests_the_engine_cannot_hold_are_refused(models):
    engine = GraphEngine(
        models,
        EnginePlan(num_slots=1, max_len=64, max_text=4, batch_buckets=(1,), prefill_buckets=(32,)),
        use_graphs=False,
    )
    long_text = SynthesisRequest(text="word " * 40, voice="ryan", non_streaming=False, max_frames=5)
    with pytest.raises(RequestError, match="too long"):
        engine.admit(long_text)
    with pytest.raises(RequestError, match="exceeds the engine's context"):
        # ~20 text tokens: the stand-in length rule asks for ~70 frames, beyond 64 positions.
        engine.admit(
            SynthesisRequest(
                text="one two three four five six seven eight nine ten "
                "eleven twelve thirteen fourteen fifteen",
                voice="ryan",
            )
        )
    assert engine.free_slots() == 1


def test_a_full_code_ring_is_an_error_not_garbage(models):
    """frames() refuses to overwrite codes not yet decoded; what was buffered still decodes
    exactly, in pieces of any size."""
    rc = dict(num_slots=1, max_len=256, max_text=64, batch_buckets=(1,), prefill_buckets=(32,))
    req = REQUESTS[0]

    def start(engine):
        slot = engine.admit(req)
        engine.prefill([slot])
        return slot

    small = GraphEngine(models, EnginePlan(codec_chunks=(1, 2), codec_ring=4, **rc), False)
    slot = start(small)
    for _ in range(4):
        small.frames([slot])
    with pytest.raises(RuntimeError, match="code ring holds 4"):
        small.frames([slot])
    assert small.pending_frames(slot) == 4
    got = [small.audio([slot], max_frames=3)[slot]]
    small.frames([slot])  # room again
    got.append(small.audio([slot])[slot])

    big = GraphEngine(models, EnginePlan(codec_chunks=(1, 2), codec_ring=8, **rc), False)
    slot = start(big)
    for _ in range(5):
        big.frames([slot])
    want = big.audio([slot])[slot]
    assert [len(p) for p in got] == [3 * 1920, 2 * 1920]
    assert np.abs(np.concatenate(got) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_prefill_fork_changes_nothing_but_the_streams(tiny_checkpoint, monkeypatch):
    """The prefill graph with its admission work on a forked stream (PREFILL_FORK) makes the
    same codes and PCM as the graph without: the talker's layers read none of what the branch
    writes, and the frame steps after it see all of it (the join). Three requests in one step,
    the three text and sampling modes of REQUESTS, graphs captured both ways."""
    import ttsbuild.runtime.graph_engine as ge

    gpu = Models.load(load_checkpoint(tiny_checkpoint), device="cuda")
    plan = EnginePlan(**PLAN)
    outputs = []
    for fork in (False, True):
        monkeypatch.setattr(ge, "PREFILL_FORK", fork)
        engine = GraphEngine(gpu, plan, use_graphs=True)
        outputs.append(_outputs(engine, REQUESTS))
        assert bool(engine.backend._fork_streams) == fork  # captured with the branch or not
    _assert_same_outputs(*outputs)


def test_admission_as_one_launch_changes_nothing(models, monkeypatch):
    """ADMIT_FUSED: the prefill step's admission writes through plugins.slot_writes (the
    reference ops here on CPU) make the same codes and PCM, and its table covers the engine's
    real state tensors (every codec state row is a dense block)."""
    import ttsbuild.runtime.graph_engine as ge
    from ttsbuild.plugins._dispatch import triton_available

    plan = EnginePlan(**PLAN)
    outputs = []
    for fused in (False, True):
        monkeypatch.setattr(ge, "ADMIT_FUSED", fused)
        engine = GraphEngine(models, plan, use_graphs=False)
        table = engine.backend.slot_writes.table  # the kernel's, built only when fused
        assert (table is not None) == (fused and triton_available())
        outputs.append(_outputs(engine, REQUESTS))
    _assert_same_outputs(*outputs)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or __import__("ttsbuild.plugins._dispatch",
                                                  fromlist=["x"]).interpret_mode()),
    reason="needs CUDA + Triton (or the interpreter)",
)  # fmt: skip
def test_admission_kernel_writes_what_the_eager_admission_writes(tiny_checkpoint, monkeypatch):
    """The one-launch admission kernel on the engine's own state tensors (every one filled
    with random values first) against `_admit_body`'s per-tensor ops: the same bytes in every
    state tensor and setting, for two slots of a two-prompt prefill."""
    import ttsbuild.runtime.graph_engine as ge
    from ttsbuild.runtime.graph_engine import _ADMIT_FLOATS, _ADMIT_INT_INDEX, _ADMIT_INTS

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(ge, "ADMIT_FUSED", True)
    m = Models.load(load_checkpoint(tiny_checkpoint), device=dev)
    plan = EnginePlan(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2),
                      prefill_buckets=(32,), prefill_batches=(1, 2), codec_chunks=(1,),
                      codec_ring=8)  # fmt: skip
    backend = GraphEngine(m, plan, use_graphs=False).backend
    writes = backend.slot_writes
    tensors = [*writes.zero, *(t for t, _, _ in writes.settings)]
    g = torch.Generator().manual_seed(11)
    for t in tensors:  # random bytes' worth of values, none zero
        t.copy_((torch.rand(t.shape, generator=g) * 100 + 1).to(t.dtype))
    start = [t.clone() for t in tensors]
    ints = torch.randint(1, 1000, (2, len(_ADMIT_INTS)), generator=g)
    ints[:, _ADMIT_INT_INDEX["slot"]] = torch.tensor([3, 1])
    floats = torch.rand(2, len(_ADMIT_FLOATS), generator=g) + 0.25
    floats[1, 0] = 0.0  # a do_sample of 0: False
    backend.admit_ints[:2].copy_(ints)
    backend.admit_floats[:2].copy_(floats)
    backend.slot_writes = backend._slot_writes(kernel=False)  # the per-tensor ops
    backend._admit_body(2)
    eager = [t.clone() for t in tensors]
    for t, s in zip(tensors, start, strict=True):
        t.copy_(s)
    writes(backend.prefill_slot[:2], backend.admit_ints[:2], backend.admit_floats[:2],
           use_triton=True)  # fmt: skip
    for got, want, s in zip(tensors, eager, start, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got[[0, 2]], s[[0, 2]])  # the other slots untouched
    for t in writes.zero:
        assert not t[[1, 3]].any()  # every value was nonzero before
    assert backend.seed[3].item() == ints[0, _ADMIT_INT_INDEX["seed"]].item()
    assert backend.talker_sampling.do_sample[1].item() is False


@pytest.mark.skipif(
    not (torch.cuda.is_available() or __import__("ttsbuild.plugins._dispatch",
                                                  fromlist=["x"]).interpret_mode()),
    reason="needs CUDA + Triton (or the interpreter)",
)  # fmt: skip
def test_prompt_embed_kernel_wiring_matches_the_embedder(tiny_checkpoint, monkeypatch):
    """PROMPT_EMBED_FUSED with the engine's own tables and text projection (the kernels get
    the text table, fc1 and fc2 in the right order): the prompt rows' embeddings equal the
    embedder's ops on random rows of every kind (text only, code 0, whole frames, voice)."""
    from ttsbuild.generation import prompt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = Models.load(load_checkpoint(tiny_checkpoint), device=dev)
    backend = GraphEngine(m, EnginePlan(**PLAN), use_graphs=False).backend
    emb = backend.embedder
    G = len(emb.tables)
    g = torch.Generator().manual_seed(17)
    T = 24
    rows = torch.full((T, 2 + G), -1, dtype=torch.int64)
    rows[:, 0] = torch.randint(0, emb.text_mlp[0].shape[0], (T,), generator=g)
    rows[:, 1] = (torch.arange(T) % 5 == 4).long()
    rows[::2, 2] = torch.randint(0, emb.tables[0].shape[0], (T // 2,), generator=g)
    rows[::3, 3:] = torch.randint(0, emb.tables[1].shape[0], (len(range(0, T, 3)), G - 1),
                                  generator=g)  # fmt: skip
    rows = rows.to(dev)
    xv = torch.randn(emb.tables[0].shape[1], generator=g).to(dev)
    monkeypatch.setattr(prompt, "PROMPT_EMBED_FUSED", True)
    ids = rows[:, 0].reshape(4, T // 4)  # the trailing-text step's ids: [b, length]
    fused, fused_text = emb.rows(rows, xv), emb.text(ids)
    monkeypatch.setattr(prompt, "PROMPT_EMBED_FUSED", False)
    want, want_text = emb.rows(rows, xv), emb.text(ids)
    for got, ref in ((fused, want), (fused_text, want_text)):  # the prompt; trailing text
        rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert got.shape == ref.shape and rel < 1e-5, rel


def test_prefix_copy_of_its_own_positions_changes_nothing(models, monkeypatch):
    """COPY_KERNEL: the prefix pool's entry copied into a slot only below the row's start
    (plugins.kv_copy's semantics, its reference standing in for the kernel here) makes the
    same codes and PCM as copying all max_prefix positions: the requests run twice, so the
    second round's prefixes are pool hits, and the same last hidden states and logits (a copy
    one position short fails this)."""
    import ttsbuild.runtime.prefix_cache as pc
    from ttsbuild.plugins.kv_copy import prefix_copy_reference

    plan = EnginePlan(**PLAN)
    starts = []

    def spy(k, v, pk, pv, slots, entries, start):
        starts.extend(start.tolist())
        prefix_copy_reference(k, v, pk, pv, slots, entries, start)

    outputs = []
    for kernel in (False, True):
        monkeypatch.setattr(pc, "COPY_KERNEL", kernel)
        monkeypatch.setattr(pc, "want_triton", lambda t, use=None: True)
        monkeypatch.setattr(pc, "prefix_copy", spy)
        engine = GraphEngine(models, plan, use_graphs=False)
        # the second round in reverse order: each slot gets another voice's prefix than the
        # one its cache holds from the first round, so only the copy can put it there
        outputs.append(_outputs(engine, REQUESTS, REQUESTS[::-1]))
        assert engine.backend.prefix.hits >= len(REQUESTS)
    assert starts and max(starts) > 0  # the kernel's path ran, with real prefixes
    _assert_same_outputs(*outputs)


def test_megaframe_reads_the_engines_own_bf16_heads(tiny_checkpoint, monkeypatch):
    """The one-kernel code predictor beside bf16 heads (plan.cp_heads_fp8 off, a bf16 engine):
    the kernel's packed heads are the engine's heads, held once (the Dense heads and the
    modules' heads are views of the packed stack; no FP8 copy); an FP8-heads plan packs its
    FP8 heads as they are."""
    from ttsbuild.runtime import cp_megaframe

    packs = []

    class Stand:  # the kernel needs a Hopper GPU: record what it would be given
        def __init__(self, m, eps, ctas=None, opts=0, like=None):
            packs.append(m)

    monkeypatch.setattr(cp_megaframe, "Megaframe", Stand)
    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu", dtype=torch.bfloat16)
    heads = models.code_predictor.lm_head
    before = [h.weight.detach().clone() for h in heads]
    plan = EnginePlan(precision="fp8", code_predictor_fp8=True, megaframe_code_predictor=True,
                      megaframe_regular=False, admission_lane=(1,), **PLAN)
    b = GraphEngine(models, plan, use_graphs=False).backend
    (m,) = packs
    whead = m["whead"]
    assert whead.dtype == torch.bfloat16 and bool((m["shead"] == 1).all())
    lo, hi = whead.data_ptr(), whead.data_ptr() + whead.numel() * whead.element_size()
    for i, (dense, head) in enumerate(zip(b.cp_heads, heads, strict=True)):
        assert not dense.is_fp8 and torch.equal(dense.weight, before[i])
        assert lo <= dense.weight.data_ptr() < hi and lo <= head.weight.data_ptr() < hi
        assert dense.weight.data_ptr() == head.weight.data_ptr()
    packs.clear()
    fp8 = GraphEngine(models, plan_update(plan, cp_heads_fp8=True), use_graphs=False).backend
    assert packs[0]["whead"].dtype == torch.float8_e4m3fn
    assert packs[0]["whead"].data_ptr() == fp8.cp_heads[0].weight.data_ptr()


@pytest.mark.parametrize("regular", [True, False])
def test_megaframe_runs_on_the_steps_the_plan_gives_it(models, monkeypatch, regular):
    """plan.megaframe_regular: the one-kernel code predictor (a stand-in that records its
    calls here: the kernel needs a Hopper GPU) on batch bucket 1's regular step and the
    lane's, or on the lane's only; larger batches never take it. Its codes follow c0."""
    from ttsbuild.runtime import cp_megaframe

    G = models.cfg.num_code_groups
    calls: list[tuple[int, int]] = []

    class Stand:
        made = 0

        def __init__(self, m, eps, ctas=None, opts=0, like=None):
            self.id, Stand.made = Stand.made, Stand.made + 1
            self.like = like

        def run(self, x_in, sampling, seeds, frames, row=0):
            calls.append((self.id, x_in.shape[0]))
            return torch.arange(1, G, dtype=torch.int32)

    monkeypatch.setattr(cp_megaframe, "Megaframe", Stand)
    plan = EnginePlan(precision="fp8", code_predictor_fp8=True, megaframe_code_predictor=True,
                      megaframe_regular=regular, admission_lane=(1,), **PLAN)
    b = GraphEngine(models, plan, use_graphs=False).backend
    assert set(b.cp_mega) == ({False, True} if regular else {True})
    if regular:  # the lane's instance shares the regular one's weights; no lane, no instance
        assert b.cp_mega[True].like is b.cp_mega[False]
        alone = GraphEngine(models, plan_update(plan, admission_lane=()), use_graphs=False).backend
        assert set(alone.cp_mega) == {False}
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, models.cfg.talker.hidden_size, generator=g)
    c0, seeds, frames = torch.tensor([5, 9]), torch.tensor([3, 4]), torch.tensor([0, 0])
    for lane, sizes in ((False, (1, 2)), (True, (1,))):  # the lane's bucket is 1 here
        for rows in sizes:
            calls.clear()
            sampling = b.cp_sampling.select(torch.arange(rows))
            codes = b._code_predictor(hidden[:rows], c0[:rows], sampling, seeds[:rows],
                                      frames[:rows], lane=lane)
            assert codes.shape == (rows, G) and codes[:, 0].tolist() == c0[:rows].tolist()
            kernel = rows == 1 and (lane or regular)
            assert calls == ([(b.cp_mega[lane].id, 2)] if kernel else []), (lane, rows)
            if kernel:
                assert codes[0, 1:].tolist() == list(range(1, G))
