"""The engine core on CPU: slot table, plan, the C++ step driver, pipelined steps (launch
ahead, EOS decided one step late), and the graph backend's code path against the eager one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.core import (
    NoFreeSlot,
    SlotPlan,
    SlotRecord,
    SlotTable,
    run_to_completion,
)
from ttsbuild.runtime.engine import EagerEngine, Models, synthesize
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import RequestError, SamplingOverrides, SynthesisRequest

PLAN = EnginePlan(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
                  prefill_buckets=(32, 64), codec_chunks=(1, 2, 4), codec_ring=8)  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


def req(i: int, frames: int = 7, **kw) -> SynthesisRequest:
    texts = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue.",
             "It's easy to tell the depth of a well."]  # fmt: skip
    return SynthesisRequest(text=texts[i % 3], voice=["ryan", "vivian", "eric"][i % 3],
                            seed=10 + i, max_frames=frames, **kw)  # fmt: skip


# -- plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(batch_buckets=(4, 2)), "strictly ascending"),
        (dict(num_slots=2, batch_buckets=(1, 4)), "exceeds 2 slots"),
        (dict(codec_chunks=(2, 4)), "must include 1"),
        (dict(codec_ring=4, codec_chunks=(1, 8)), "codec_ring"),
        (dict(num_slots=300, batch_buckets=(1,)), "num_slots"),
        (dict(max_len=256, prefill_buckets=(32, 256)), "prefill bucket"),
        (dict(extra_field=1), "Extra inputs"),
        (dict(prefill_batches=(2, 4)), "must start at 1"),
        (dict(prefill_batches=(1, 4, 2)), "strictly ascending"),
        (dict(admission_lane=(2, 1)), "admission_lane must be strictly ascending"),
        (dict(admission_lane=(), lane_reserved_sms=16), "needs an admission_lane"),
        (dict(admission_lane=(1,), persistent_code_predictor=(1,)), "every SM at once"),
        (dict(megaframe_code_predictor=True), "needs code_predictor_fp8"),
        (dict(megaframe_code_predictor=True, code_predictor_fp8=True,
              persistent_code_predictor=(1,), admission_lane=()), "one of them"),
        (dict(megaframe_code_predictor=True, code_predictor_fp8=True, admission_lane=(1,),
              lane_reserved_sms=16), "cannot run with lane_reserved_sms"),
        (dict(megaframe_code_predictor=True, code_predictor_fp8=True, megaframe_regular=False,
              admission_lane=(2,)), "needs the lane on batch bucket 1"),
        (dict(num_slots=2, batch_buckets=(1, 2), prefill_batches=(1, 4)), "within 2 slots"),
        (dict(talker_megastep=True, num_slots=4, batch_buckets=(2, 4), admission_lane=()),
         "talker_megastep runs batch bucket 1"),
        (dict(talker_megastep=True, fused_talker=(1,)), "talker_megastep or fused_talker"),
        (dict(talker_megastep=True, admission_lane=(1,), lane_reserved_sms=8),
         "talker_megastep needs every SM"),
    ],
)
def test_plan_refuses_inconsistent_shapes(bad, message):
    with pytest.raises(ValueError, match=message):
        EnginePlan(**{**PLAN.model_dump(), **bad})


def test_plan_gives_the_codec_engine_its_settings(monkeypatch):
    # what the graph engine builds its codec with and the compile gate measures: every codec
    # field of the plan, the convs resolved for the device
    monkeypatch.delenv("TTSBUILD_CODEC_CONV", raising=False)
    plan = EnginePlan(**{**PLAN.model_dump(), "codec_fused_layers_max_rows": 3,
                         "codec_channels_last": False})  # fmt: skip
    kw = plan.codec_engine_kwargs("cpu")
    assert kw == dict(max_chunk=plan.max_chunk, conv_impl="cudnn", fused=plan.codec_fused,
                      channels_last=False, fused_output=plan.codec_fused_output,
                      fused_attention=plan.codec_fused_attention,
                      state_channels_last=plan.codec_state_channels_last,
                      fused_layers_max_rows=3, transformer_half_weights=None, qkv_attend=None,
                      tf32_layers_max_rows=None, ring_half=None,
                      fold_block_act=None, conv_split_max_streams=None,
                      pdl_max_rows=None, tconv_conv=None, lookup_fused=None,
                      output_epilogue=None, next_act_fold=None)  # fmt: skip
    assert plan.codec_engine_kwargs("cuda")["conv_impl"] == "triton"  # resolved, not "auto"
    # the 2026-12-06 switches: None leaves each to its environment variable; a plan that
    # pins one gives the engine the value (test_codec_engine: the value wins over the
    # environment's)
    pinned = EnginePlan(**{**plan.model_dump(), "codec_ring_half": False,
                           "codec_tf32_layers_max_rows": 64, "codec_pdl_max_rows": 0,
                           "codec_conv_split_max_streams": 4})  # fmt: skip
    kw = pinned.codec_engine_kwargs("cpu")
    assert kw["ring_half"] is False and kw["tf32_layers_max_rows"] == 64
    assert kw["pdl_max_rows"] == 0 and kw["conv_split_max_streams"] == 4
    assert EnginePlan.model_validate_json(pinned.model_dump_json()) == pinned
    with pytest.raises(ValueError):
        EnginePlan(**{**plan.model_dump(), "codec_tf32_layers_max_rows": -1})
    with pytest.raises(ValueError):
        EnginePlan(**{**plan.model_dump(), "codec_pdl_max_rows": -1})


def test_plan_buckets_and_prompt_checks():
    assert [PLAN.bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="largest bucket 4"):
        PLAN.bucket(5)
    assert PLAN.prefill_bucket(33) == 64 and PLAN.prefill_bucket(65) is None
    with pytest.raises(ValueError, match="text is too long"):
        PLAN.check_prompt(10, 65, 5)
    with pytest.raises(ValueError, match="exceeds the engine's context of 256"):
        PLAN.check_prompt(200, 10, 57)
    PLAN.check_prompt(200, 10, 56)
    roundtrip = EnginePlan.model_validate_json(PLAN.model_dump_json())
    assert roundtrip == PLAN
    small = EnginePlan.default(num_slots=3, max_len=100)
    assert small.batch_buckets == (1, 2, 3) and small.prefill_buckets == (32, 64)
    assert small.max_frames == 99 and small.fused_code_predictor == (1, 2, 3)
    assert small.admission_lane == (1, 2)  # on by default where it was measured to pay
    assert EnginePlan.default(num_slots=1).admission_lane == (1,)
    assert EnginePlan.default(admission_lane=()).admission_lane == ()
    with pytest.raises(ValueError, match="admission_lane"):
        EnginePlan(**{**PLAN.model_dump(), "admission_lane": (3,)})
    with pytest.raises(ValueError, match="fused_code_predictor"):
        EnginePlan(**{**PLAN.model_dump(), "fused_code_predictor": (8,)})


# -- slot table ----------------------------------------------------------------------------


def _record(limit=5, by_rule=True):
    params = type("P", (), {"min_new_tokens": 2})()
    return SlotRecord(SlotPlan(None, params, limit, by_rule, 0))


def test_slot_table_claims_lowest_free_and_refuses_when_full():
    table = SlotTable(2)
    a, b = table.claim(_record()), table.claim(_record())
    assert (a, b) == (0, 1) and table.free_count() == 0
    with pytest.raises(NoFreeSlot):
        table.claim(_record())
    uid = table[0].uid
    table.release(0)
    assert table.claim(_record()) == 0 and table[0].uid != uid


def test_known_frames_follow_the_eos_gate():
    stand_in, real = _record(limit=5, by_rule=True), _record(limit=5, by_rule=False)
    for rec in (stand_in, real):
        rec.launched = 4
    assert stand_in.known_frames == 4  # EOS is never sampled: launched frames are real
    assert real.known_frames == 2  # frames 2.. could be EOS until read back
    real.committed = 3
    assert real.known_frames == 3


# -- the C++ driver ------------------------------------------------------------------------


def test_the_step_driver_is_the_compiled_extension(models):
    from ttsbuild import _driver

    engine = GraphEngine(models, PLAN, use_graphs=False)
    assert isinstance(engine.backend.driver, _driver.StepDriver)
    assert not engine.backend.driver.cuda


def test_driver_copies_in_runs_the_step_and_copies_out():
    from ttsbuild import _driver

    drv = _driver.StepDriver(False)
    state, inputs, out = torch.zeros(5), torch.randn(5), torch.zeros(5)
    ticket = drv.launch(lambda: state.mul_(3.0).add_(1.0), [inputs], [state], [state], [out])
    drv.wait(ticket)
    assert drv.ready(ticket)
    torch.testing.assert_close(out, inputs * 3 + 1)
    with pytest.raises(RuntimeError, match="sources but"):
        drv.launch(lambda: None, [inputs], [], [], [])
    with pytest.raises(RuntimeError, match="shape"):
        drv.launch(lambda: None, [inputs], [torch.zeros(4)], [], [])
    with pytest.raises(RuntimeError, match="unknown ticket"):
        drv.wait(ticket + 100)


# -- pipelined steps -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "graph"])
def test_launching_ahead_gives_the_same_frames_as_reading_each_step(models, backend):
    def make():
        if backend == "eager":
            return EagerEngine(models, plan=PLAN, keep_codes=True)
        return GraphEngine(models, PLAN, use_graphs=False, keep_codes=True)

    ahead, stepwise = make(), make()
    reqs = [req(0, 7), req(1, 4), req(2, 6)]
    slots = [ahead.admit(r) for r in reqs]
    run_to_completion(ahead, slots, on_step=lambda _: ahead.audio(slots))
    one = [stepwise.admit(r) for r in reqs]
    stepwise.prefill(one)
    while not all(stepwise.is_finished(s) for s in one):
        stepwise.frames([s for s in one if not stepwise.is_finished(s)])
        stepwise.audio(one)
    for a, b, r in zip(slots, one, reqs, strict=True):
        assert ahead.frames_of(a) == r.max_frames
        assert torch.equal(ahead.codes_of(a), stepwise.codes_of(b))
    assert not torch.equal(ahead.codes_of(slots[0])[:4], ahead.codes_of(slots[1]))


def test_eos_is_decided_one_step_late_and_the_extra_step_dropped(tiny_checkpoint):
    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    models.length_rule = None  # a real checkpoint: EOS decides
    eos = models.cfg.codec_ids.eos
    # EOS far above every code (the stand-in's peaked logits would outvote a mere weight edit)
    models.talker.codec_head.register_forward_hook(
        lambda _m, _i, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    engine = EagerEngine(models, plan=PLAN, keep_codes=True)
    slot = engine.admit(req(0, frames=None))
    engine.prefill([slot])
    t0 = engine.launch_frames([slot])
    t1 = engine.launch_frames([slot])
    assert engine.pending_frames(slot) == 2  # frames 0 and 1 cannot be EOS (min_new_tokens)
    first = engine.audio([slot], max_frames=1)[slot]  # before any codes were read back
    assert first.shape == (1920,)
    t2 = engine.launch_frames([slot])  # frame 2 (EOS) in flight; frame 3 launched behind it
    t3 = engine.launch_frames([slot])
    outs = [engine.collect(t) for t in (t0, t1, t2, t3)]
    assert [len(o) for o in outs] == [1, 1, 1, 0]  # the step after EOS is dropped
    assert outs[2][0].codes is None and outs[2][0].finished
    assert engine.stopped_by(slot) == "eos" and engine.frames_of(slot) == 2
    assert engine.audio([slot])[slot].shape == (1920,)  # only frame 1 was left
    with pytest.raises(RuntimeError, match="finished"):
        engine.launch_frames([slot])


def test_a_ticket_of_a_released_slot_never_reaches_its_next_occupant(models):
    engine = GraphEngine(models, PLAN, use_graphs=False, keep_codes=True)
    slot = engine.admit(req(0))
    engine.prefill([slot])
    stale = engine.launch_frames([slot])
    engine.release(slot)
    again = engine.admit(req(1))
    assert again == slot
    assert engine.collect(stale) == []
    assert engine.frames_of(again) == 0 and engine.free_slots() == 3


def test_the_code_ring_is_never_overrun(models):
    engine = GraphEngine(models, PLAN, use_graphs=False)
    slot = engine.admit(req(0, frames=20))
    engine.prefill([slot])
    for _ in range(PLAN.codec_ring):
        engine.frames([slot])
    with pytest.raises(RuntimeError, match="code ring holds 8"):
        engine.frames([slot])
    assert engine.audio([slot])[slot].shape == (PLAN.codec_ring * 1920,)
    engine.frames([slot])  # room again


def test_requests_beyond_the_plan_are_refused_at_the_edge(models):
    engine = EagerEngine(models, plan=PLAN)
    with pytest.raises(RequestError, match="exceeds this engine's limit"):
        engine.admit(req(0, frames=PLAN.max_frames + 1))
    greedy = SamplingOverrides(do_sample=False)
    slot = engine.admit(req(0, frames=3, sampling=greedy))
    assert engine.free_slots() == 3
    engine.release(slot)


def test_graph_backend_matches_eager_backend_with_joins_and_leaves(models):
    """Rows join and leave mid-batch, so the bucketed batch changes every step."""
    reqs = [req(i, 3 + 2 * i) for i in range(5)]
    reference = {}
    eager = EagerEngine(models, plan=PLAN, keep_codes=True)
    for i, r in enumerate(reqs):
        pcm, stats = synthesize(eager, r, chunk_frames=2)
        reference[i] = (stats["codes"], pcm)
    engine = GraphEngine(models, PLAN, use_graphs=False, keep_codes=True)
    live, pcm, done = {}, {i: [] for i in range(5)}, {}
    waiting = list(range(5))
    pending = None
    while waiting or live:
        if waiting and len(live) < 3:
            i = waiting.pop(0)
            s = engine.admit(reqs[i])
            engine.prefill([s])
            live[s] = i
        ticket = engine.launch_frames([s for s in live if engine.table[s].can_launch])
        if pending is not None:
            engine.collect(pending)
        pending = ticket
        for s, p in engine.audio(list(live), max_frames=2).items():
            pcm[live[s]].append(p)
        for s in [s for s in live if engine.is_finished(s) and engine.pending_frames(s) == 0]:
            done[live.pop(s)] = engine.codes_of(s)
            engine.release(s)
    for i, (codes, ref_pcm) in reference.items():
        assert torch.equal(done[i], codes), i
        got = np.concatenate(pcm[i])
        assert got.shape == ref_pcm.shape and np.abs(got - ref_pcm).max() <= 1e-5
    assert engine.free_slots() == PLAN.num_slots


@pytest.fixture(scope="module")
def text_models(tiny_checkpoint):
    """The tiny stand-in with a text projection whose outputs matter: its random weights
    (std 0.02) make every text token's embedding nearly the same (within ~2e-3 of tts_pad),
    so a text track read one frame off would go unnoticed."""
    m = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    with torch.no_grad():
        for lin in (m.talker.text_projection.linear_fc1, m.talker.text_projection.linear_fc2):
            lin.weight.mul_(40.0)
    return m


@pytest.mark.parametrize("lane", [(), (1, 2)])
def test_graph_backend_matches_eager_past_the_end_of_streamed_text(text_models, lane):
    """Short streamed texts, frames well past their last text token (tts_pad from there on):
    the talker step runs at the start of a frame on the previous frame's codes and text
    token, and a new row's first frame (on the admission lane, or in a regular step beside
    stepped rows) uses its prefill's logits. Codes must equal the eager reference's."""
    models = text_models
    texts = ["Hi.", "Yes, okay.", "Go"]
    reqs = [SynthesisRequest(text=t, voice="ryan", seed=3 + i, max_frames=14, non_streaming=False)
            for i, t in enumerate(texts)]  # fmt: skip
    eager = EagerEngine(models, plan=PLAN, keep_codes=True)
    reference = [synthesize(eager, r, chunk_frames=2)[1]["codes"] for r in reqs]
    plan = EnginePlan(**{**PLAN.model_dump(), "admission_lane": lane})
    engine = GraphEngine(models, plan, use_graphs=False, keep_codes=True)
    text_lens = []
    slots = {}
    for i, r in enumerate(reqs):  # each joins rows already stepping (from the third step on)
        s = engine.admit(r)
        engine.prefill([s])
        text_lens.append(int(engine.backend.text_len[s]))
        slots[s] = i
        for _ in range(2):
            engine.frames([s for s in slots if engine.table[s].can_launch])
            engine.audio(list(slots))
    while any(engine.table[s].can_launch for s in slots):
        engine.frames([s for s in slots if engine.table[s].can_launch])
        engine.audio(list(slots))
    track = engine.backend.text_track
    assert (track[next(iter(slots)), 0] - engine.backend.tts_pad).abs().max() > 0.1
    for s, i in slots.items():
        assert reference[i].shape[0] > text_lens[i] + 2, (reference[i].shape, text_lens[i])
        assert torch.equal(engine.codes_of(s), reference[i]), i


def test_a_lone_streams_next_frame_step_follows_its_first_codec_step_on_the_lane(models):
    """With the admission lane, a regular frame step holding only rows whose first codec step
    ran on the lane is ordered after that step (the first chunk has the device to itself); a
    step that also holds another stream's rows is not held back by it."""
    plan = EnginePlan(**{**PLAN.model_dump(), "admission_lane": (1, 2)})
    engine = GraphEngine(models, plan, use_graphs=False, keep_codes=True)
    be = engine.backend
    seen = []
    launch = be._launch

    def spy(ring, slots, step, outputs, width, rows_in, lane, after, buckets=None):
        staged = launch(ring, slots, step, outputs, width, rows_in, lane, after, buckets)
        seen.append((list(slots), list(after), staged.ticket))
        return staged

    be._launch = spy
    old = engine.admit(req(0, 12))
    engine.prefill([old])
    engine.frames([old])  # its first frame, on the lane
    engine.audio([old], max_frames=1)  # its first codec step, on the lane
    first_codec = seen[-1][2]
    engine.frames([old])
    assert first_codec in seen[-1][1]  # alone: follows its first codec step
    new = engine.admit(req(1, 12))
    engine.prefill([new])
    engine.frames([new])
    engine.audio([new], max_frames=1)
    engine.frames([old, new])
    assert seen[-1][0] == [old, new] and seen[-1][2] > first_codec
    lane_codec_of_new = seen[-2][2]
    assert lane_codec_of_new not in seen[-1][1]  # beside another stream's row: not held back


def test_default_plans_reserve_sms_for_the_lane_and_pick_the_fp8_talkers_linears():
    """Measured defaults (H200): 16 SMs kept for the admission lane wherever there is one
    (serving at 40 req/s); the FP8 talker's linears W8A8 from 16 rows and never on bf16
    copies (engine bench, 2026-12-04 and 2026-12-07: no weight held twice); a bf16 plan has
    neither, a plan without a lane reserves nothing."""
    from ttsbuild.build.compile import BuildConfig
    from ttsbuild.runtime.plan import (
        DEFAULT_BF16_MIN_ROWS,
        DEFAULT_LANE_RESERVED_SMS,
        DEFAULT_W8A8_MIN_ROWS,
    )

    fp8 = EnginePlan.default(num_slots=8, precision="fp8")
    assert fp8.admission_lane and fp8.lane_reserved_sms == DEFAULT_LANE_RESERVED_SMS == 16
    assert fp8.bf16_min_rows == DEFAULT_BF16_MIN_ROWS == 0
    assert fp8.w8a8_min_rows == DEFAULT_W8A8_MIN_ROWS == 16
    bf16_default = EnginePlan.default(num_slots=8, precision="bf16")
    assert (bf16_default.bf16_min_rows, bf16_default.w8a8_min_rows) == (0, 0)
    no_lane = EnginePlan.default(num_slots=8, admission_lane=())
    assert no_lane.lane_reserved_sms == 0
    compiled = BuildConfig(precision="fp8", max_batch=8, graph_batches=(1, 2, 4, 8)).runtime_plan()
    assert (compiled.lane_reserved_sms, compiled.bf16_min_rows, compiled.w8a8_min_rows,
            compiled.cp_w8a8_min_rows) == (16, 0, 16, 0)  # fmt: skip
    bf16 = BuildConfig(precision="bf16", max_batch=8, graph_batches=(1, 2, 4, 8),
                       admission_lane=()).runtime_plan()  # fmt: skip
    assert (bf16.lane_reserved_sms, bf16.bf16_min_rows, bf16.w8a8_min_rows,
            bf16.cp_w8a8_min_rows) == (0, 0, 0, 0)
    # a persistent code predictor needs every SM: compile's default lane is off with it, and
    # a lane asked for beside it is refused
    persistent = BuildConfig(precision="fp8", max_batch=8, graph_batches=(1, 2, 4, 8),
                             persistent_cp_max_batch=1).runtime_plan()  # fmt: skip
    assert persistent.persistent_code_predictor == (1,)
    assert (persistent.admission_lane, persistent.lane_reserved_sms) == ((), 0)
    with pytest.raises(ValueError, match="every SM at once"):
        BuildConfig(precision="fp8", max_batch=8, graph_batches=(1, 2, 4, 8),
                    persistent_cp_max_batch=1, admission_lane=(1,)).runtime_plan()  # fmt: skip


def test_the_code_predictors_w8a8_threshold_reaches_its_linears_and_heads(models):
    """`EnginePlan.cp_w8a8_min_rows` (0 by default: it fails the quality gate): an FP8 code
    predictor's packed linears and heads take W8A8 from that many rows (its unfused path,
    batch buckets above the fused ones), and not below; the talker keeps its own threshold."""
    plan = EnginePlan(num_slots=16, max_len=256, max_text=64, batch_buckets=(1, 2, 4, 8, 16),
                      prefill_buckets=(32,), codec_chunks=(1,), codec_ring=8, precision="fp8",
                      code_predictor_fp8=True, cp_w8a8_min_rows=16, w8a8_min_rows=32,
                      fused_code_predictor=(1, 2, 4, 8), cp_heads_fp8=True)  # fmt: skip
    assert EnginePlan.default(num_slots=8, precision="fp8").cp_w8a8_min_rows == 0
    assert EnginePlan.default(num_slots=8, precision="bf16").cp_w8a8_min_rows == 0
    backend = GraphEngine(models, plan, use_graphs=False).backend
    cp = backend.cp_stack.layers[0]
    for dense in (cp.qkv, cp.o, cp.gate_up, cp.down, *backend.cp_heads):
        assert dense.is_fp8 and dense.w8a8_min_rows == 16
        assert dense.takes_w8a8(16) and not dense.takes_w8a8(8)
    assert backend.talker_stack.layers[0].qkv.w8a8_min_rows == 32


def test_the_code_predictors_bf16_copies_where_a_bucket_reaches_their_threshold(models):
    """`EnginePlan.cp_bf16_min_rows` (DEFAULT_CP_BF16_MIN_ROWS for FP8 plans): an FP8 code
    predictor's linears, and its heads where FP8, run on bf16 copies of their dequantised
    weights from that many rows, before W8A8; a plan whose largest bucket is below the
    threshold holds no copy; the talker's linears keep their own threshold (none)."""
    from ttsbuild.build.compile import BuildConfig
    from ttsbuild.plugins.fp8_linear import dequantize_weight_fp8
    from ttsbuild.runtime.plan import DEFAULT_CP_BF16_MIN_ROWS

    assert EnginePlan.default(num_slots=8, precision="fp8").cp_bf16_min_rows \
        == DEFAULT_CP_BF16_MIN_ROWS > 0
    assert EnginePlan.default(num_slots=8, precision="bf16").cp_bf16_min_rows == 0
    compiled = BuildConfig(precision="fp8", max_batch=8, graph_batches=(1, 2, 4, 8)).runtime_plan()
    assert compiled.cp_bf16_min_rows == DEFAULT_CP_BF16_MIN_ROWS
    plan = EnginePlan(num_slots=8, max_len=256, max_text=64, batch_buckets=(1, 2, 4, 8),
                      prefill_buckets=(32,), codec_chunks=(1,), codec_ring=8, precision="fp8",
                      code_predictor_fp8=True, cp_heads_fp8=True, cp_bf16_min_rows=4,
                      cp_w8a8_min_rows=2, fused_code_predictor=(1, 2))  # fmt: skip
    backend = GraphEngine(models, plan, use_graphs=False).backend
    cp = backend.cp_stack.layers[0]
    for dense in (cp.qkv, cp.o, cp.gate_up, cp.down, *backend.cp_heads):
        assert dense.is_fp8 and dense.bf16_min_rows == 4
        assert torch.equal(dense.bf16_weight,
                           dequantize_weight_fp8(dense.weight, dense.scale, torch.bfloat16))
        # the copies from 4 rows, W8A8 (cp_w8a8_min_rows 2) only below them
        assert dense.takes_w8a8(2) and not dense.takes_w8a8(4)
    talker = backend.talker_stack.layers[0].qkv
    assert talker.bf16_min_rows == 0 and talker.bf16_weight is None
    # the largest bucket below the threshold: nothing held for nothing
    small = GraphEngine(models, plan.model_copy(update={"cp_bf16_min_rows": 16}),
                        use_graphs=False).backend  # fmt: skip
    for dense in (*small.cp_stack.linears(), *small.cp_heads):
        assert dense.bf16_min_rows == 0 and dense.bf16_weight is None


def test_bf16_heads_beside_an_fp8_code_predictor(models, tiny_checkpoint):
    """`EnginePlan.cp_heads_fp8` off (the default): the FP8 code predictor's layers stay FP8
    and its heads are the checkpoint's own weights (bf16 here fp32, not re-rounded), on every
    path the plan runs (fused buckets 1-2, unfused 4); a bf16 code predictor ignores it."""
    plan = EnginePlan(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
                      prefill_buckets=(32,), codec_chunks=(1,), codec_ring=8, precision="fp8",
                      code_predictor_fp8=True, fused_code_predictor=(1, 2))  # fmt: skip
    assert not plan.cp_heads_fp8 and not plan.cp_heads_are_fp8
    assert plan.model_copy(update={"cp_heads_fp8": True}).cp_heads_are_fp8
    assert not plan.model_copy(update={"cp_heads_fp8": True,
                                       "code_predictor_fp8": False}).cp_heads_are_fp8
    backend = GraphEngine(models, plan, use_graphs=False).backend
    assert backend.cp_stack.is_fp8
    for dense, head in zip(backend.cp_heads, models.code_predictor.lm_head, strict=True):
        assert not dense.is_fp8 and dense.scale is None and torch.equal(dense.weight, head.weight)
    fp8 = GraphEngine(models, plan.model_copy(update={"cp_heads_fp8": True}),
                      use_graphs=False).backend  # fmt: skip
    assert all(d.is_fp8 for d in fp8.cp_heads)
    bf16 = GraphEngine(models, plan.model_copy(update={"code_predictor_fp8": False}),
                       use_graphs=False).backend  # fmt: skip
    assert not bf16.cp_stack.is_fp8 and not any(d.is_fp8 for d in bf16.cp_heads)
    # released modules: a bf16 head is the module's own weight, held once
    released = GraphEngine(Models.load(load_checkpoint(tiny_checkpoint), device="cpu"), plan,
                           use_graphs=False, release_modules=True)  # fmt: skip
    rb, rm = released.backend, released.backend.models.code_predictor
    for dense, head in zip(rb.cp_heads, rm.lm_head, strict=True):
        assert dense.weight.untyped_storage().data_ptr() == head.weight.untyped_storage().data_ptr()
    # bf16 heads run on every bucket's path: three rows (bucket 4, unfused) finishing at
    # different frames (buckets 2 and 1, fused), each to its frame limit
    engine = GraphEngine(models, plan, use_graphs=False, keep_codes=True)
    reqs = [req(0, 7), req(1, 4), req(2, 6)]
    slots = [engine.admit(r) for r in reqs]
    run_to_completion(engine, slots, on_step=lambda _: engine.audio(slots))
    for s, r in zip(slots, reqs, strict=True):
        assert engine.frames_of(s) == r.max_frames
        assert engine.codes_of(s).shape == (r.max_frames, models.cfg.num_code_groups)


def test_a_released_engine_holds_each_weight_once(tiny_checkpoint):
    """GraphEngine(release_modules=True) with an FP8 code predictor: the modules' code
    predictor input embeddings become views of the engine's stacked ones, its FP8 heads leave
    no bf16 original, and memory_report's weights_lm counts each storage once (views of one
    storage once, whole). The one-kernel code predictor's `share_weights` makes the stack's
    FP8 linears and heads views of `pack`'s stacked weights, values unchanged (its kernel
    needs CUDA; `pack` itself runs anywhere)."""
    from ttsbuild.runtime import cp_megaframe
    from ttsbuild.runtime.graph_engine import _storage_bytes

    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    plan = EnginePlan(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
                      prefill_buckets=(32,), codec_chunks=(1,), codec_ring=8, precision="fp8",
                      code_predictor_fp8=True, cp_heads_fp8=True)  # fmt: skip
    be = GraphEngine(models, plan, use_graphs=False, release_modules=True).backend
    cp = models.code_predictor
    for i, e in enumerate(cp.model.codec_embedding):
        assert e.weight.data_ptr() == be.cp_embeddings[i].data_ptr()
    assert all(h.weight.numel() == 0 for h in cp.lm_head) and all(d.is_fp8 for d in be.cp_heads)
    report = be.memory_report()["weights_lm"]
    denses = [*be.talker_stack.linears(), *be.cp_stack.linears(), *be.cp_heads, be.codec_head]
    tensors = [t for d in denses for t in (d.weight, d.scale) if t is not None]
    tensors += [*models.talker.parameters(), *cp.parameters(), be.cp_embeddings]
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t.numel()}
    assert report == sum(distinct.values()) > 0
    # counted once: the embeddings' views add nothing beside the stack
    assert _storage_bytes([be.cp_embeddings, *be.cp_embeddings.unbind(0)], be.device) == (
        be.cp_embeddings.numel() * be.cp_embeddings.element_size())
    before = [(d.weight.clone(), d.scale.clone()) for d in be.cp_heads]
    m = cp_megaframe.pack(be.cp_stack, be.cp_heads, lambda t: be.cp_fused._project(t, None),
                          be.cp_embeddings)  # fmt: skip
    cp_megaframe.share_weights(m, be.cp_stack, be.cp_heads)
    for i, d in enumerate(be.cp_heads):
        assert d.weight.untyped_storage().data_ptr() == m["whead"].untyped_storage().data_ptr()
        assert torch.equal(d.weight.view(torch.uint8), before[i][0].view(torch.uint8))
        assert torch.equal(d.scale, before[i][1])
    assert all(p.down.weight.untyped_storage().data_ptr() == m["wd"].untyped_storage().data_ptr()
               for p in be.cp_stack.layers)
    # a packed weight that differs from the stack's is refused
    be.cp_stack.layers[0].qkv.weight = be.cp_stack.layers[0].qkv.weight.clone()  # its own
    m["wqkv"][0].view(torch.uint8)[0, 0] ^= 1
    with pytest.raises(ValueError, match="packed qkv"):
        cp_megaframe.share_weights(m, be.cp_stack, be.cp_heads)
