"""The prefill path of the graph backend, run eagerly on CPU: prompt embeddings built from
staged id rows equal the prompt's own, and the prefix KV cache changes no code and no sample
(greedy and sampled; built-in speakers, x-vector and in-context clones), under eviction, a
full pool, and an entry overwritten while the request that used it still runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_runs import finish

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.generation.prompt import (
    CODES,
    NO_CODE,
    VOICE,
    PromptEmbedder,
    VoiceClone,
    reference_text,
)
from ttsbuild.runtime.engine import EagerEngine, Models, plan_admission
from ttsbuild.runtime.graph_engine import GraphEngine, _settings
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.prefix_cache import PrefixPool
from ttsbuild.runtime.request import SamplingOverrides, SynthesisRequest

TEXT = "The birch canoe slid on the smooth planks."
GREEDY = SamplingOverrides(do_sample=False, subtalker_do_sample=False)
PLAN = dict(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
            prefill_buckets=(16, 32, 64), codec_chunks=(1, 2, 4), codec_ring=8)  # fmt: skip


@pytest.fixture(scope="module")
def custom(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


@pytest.fixture(scope="module")
def base(tiny_base_checkpoint):
    return Models.load(load_checkpoint(tiny_base_checkpoint), device="cpu")


def random_clone(models: Models, seed: int, frames: int | None, transcript: str = "") -> VoiceClone:
    """A cloned voice of fresh random content (the engine only sees its x-vector and codes)."""
    g = torch.Generator().manual_seed(seed)
    x_vector = torch.randn(models.cfg.talker.hidden_size, generator=g)
    if frames is None:
        return VoiceClone(x_vector)
    codes = torch.randint(0, models.cfg.codebook_size, (frames, models.cfg.num_code_groups),
                          generator=g)  # fmt: skip
    return VoiceClone(x_vector, codes, models.tokenizer.encode(reference_text(transcript)))


def custom_requests() -> list[SynthesisRequest]:
    return [
        SynthesisRequest(TEXT, voice="ryan", seed=1, max_frames=6, sampling=GREEDY),
        SynthesisRequest(
            TEXT,
            voice="vivian",
            seed=2,
            max_frames=5,
            non_streaming=False,
            instruct="Speak slowly.",
        ),  # fmt: skip
        SynthesisRequest(
            "Rice is often served in round bowls.",
            voice="ryan",
            language="english",
            seed=3,
            max_frames=5,
        ),  # fmt: skip
    ]


def base_requests(models: Models) -> list[SynthesisRequest]:
    xvec = random_clone(models, 10, None)
    icl = random_clone(models, 11, 9, "A short reference line.")
    long_text = random_clone(models, 12, 3, "A reference transcript longer than its frames.")
    return [
        SynthesisRequest(TEXT, clone=xvec, seed=4, max_frames=5, sampling=GREEDY),
        SynthesisRequest(TEXT, clone=xvec, seed=5, max_frames=5, non_streaming=True),
        SynthesisRequest(TEXT, clone=icl, seed=6, max_frames=5, sampling=GREEDY),
        SynthesisRequest(TEXT, clone=icl, seed=7, max_frames=5, non_streaming=True),
        SynthesisRequest(TEXT, clone=long_text, seed=8, max_frames=4),
    ]


def graph(models: Models, pool: int, max_prefix: int = 128, batches=(1,)) -> GraphEngine:
    plan = EnginePlan(prefix_pool=pool, max_prefix=max_prefix, prefill_batches=batches, **PLAN)
    return GraphEngine(models, plan, use_graphs=False)


def run(engine, requests, chunk: int = 2) -> list[tuple[torch.Tensor, np.ndarray]]:
    """All requests admitted, prefilled and run together; audio pulled every `chunk` frames."""
    slots = [engine.admit(r) for r in requests]
    engine.prefill(slots)
    return finish(engine, slots, chunk)




def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (codes, pcm), (ref_codes, ref_pcm) in zip(got, want, strict=True):
        assert torch.equal(codes, ref_codes)
        assert pcm.shape == ref_pcm.shape == (codes.shape[0] * 1920,)
        assert np.abs(pcm - ref_pcm).max() <= 1e-5 * max(1.0, np.abs(ref_pcm).max())


# -- in-graph prompt embeddings ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["custom", "base"])
@torch.no_grad()
def test_staged_rows_embed_to_the_prompts_embeddings(custom, base, kind):
    """Every prompt kind, from position 0 and from its shared prefix on, padded to a bucket:
    the rows the prefill graph embeds give the prompt's embeddings and text track."""
    models = custom if kind == "custom" else base
    requests = custom_requests() if kind == "custom" else base_requests(base)
    backend = graph(models, pool=4).backend
    for req in requests:
        prompt = plan_admission(models, req, backend.plan).prompt
        layout = prompt.layout
        n = layout.num_positions
        settings = _settings(slot=backend.scratch)
        trailing = layout.trailing_ids.numpy()
        for start in (0, min(prompt.shared_prefix_len, n - 1)):  # as GraphBackend.admit
            rows = layout.rows[start:].numpy()
            b, length, text_length = backend._stage([(*settings, rows, trailing,
                                                             layout.x_vector)])
            assert b == 1 and length == backend.plan.prefill_bucket(n - start)
            assert text_length == backend._text_bucket(trailing.shape[0])
            staged = backend.staging.prompt_rows(b, length)[0].cpu()
            assert torch.equal(staged[: n - start], layout.rows[start:])
            assert (staged[n - start :, :CODES] == 0).all()  # padding: no text, no voice,
            assert (staged[n - start :, CODES:] == NO_CODE).all()  # no codes
            got = backend.embedder.rows(staged, backend.admit_xvec[0])
            assert torch.isfinite(got).all()
            # the stacked tables' one gather: the bits of one gather per codebook
            assert backend.embedder.stacked_rest is not None
            per_table = PromptEmbedder(backend.embedder.embed_text, backend.embedder.tables)
            assert torch.equal(got, per_table.rows(staged, backend.admit_xvec[0]))
            assert_close(got[: n - start], prompt.embeds[start:])
        backend._embed_text(b, text_length)  # into the staged slot's text track
        assert_close(backend.text_track[backend.scratch, : prompt.num_trailing],
                     prompt.trailing_text)  # fmt: skip


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to fp32 rounding: the text projection is a GEMM, and a row's rounding may depend
    on how many rows it runs with (one row takes a GEMV path); every lookup and sum is exact."""
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert scale > 0
    assert float((got - want).abs().max()) <= 1e-6 * scale


def test_clones_put_their_voice_and_reference_frames_in_the_rows(base):
    """Two voices with one transcript: their prompts differ exactly at the x-vector row and
    the reference frames' rows, and so do their prefix keys."""
    a, b = (random_clone(base, seed, 6, "Same transcript.") for seed in (20, 21))
    plan = EnginePlan(**PLAN)
    prompts = [plan_admission(base, SynthesisRequest(TEXT, clone=c), plan).prompt for c in (a, b)]
    rows = prompts[0].layout.rows
    differs = (prompts[0].embeds != prompts[1].embeds).any(-1)
    assert torch.equal(differs, (rows[:, VOICE] > 0) | (rows[:, CODES + 1] >= 0))
    assert int(differs.sum()) == 1 + 6
    n = prompts[0].shared_prefix_len
    assert prompts[0].layout.prefix_key(n) != prompts[1].layout.prefix_key(n)


# -- the prefix cache changes nothing --------------------------------------------------------


def test_prefix_cache_gives_the_same_codes_and_audio_custom_voice(custom):
    requests = custom_requests()
    reference = run(EagerEngine(custom, plan=EnginePlan(**PLAN)), requests)
    assert_same(run(graph(custom, pool=0), requests), reference)
    cached = graph(custom, pool=4)
    assert_same(run(cached, requests), reference)  # first use: prefixes computed
    assert_same(run(cached, requests), reference)  # again: every prefix a hit
    pool = cached.backend.prefix
    assert (pool.misses, pool.hits, len(pool)) == (3, 3, 3)


def test_prefix_cache_gives_the_same_codes_and_audio_clones(base):
    requests = base_requests(base)
    reference = run(EagerEngine(base, plan=EnginePlan(**PLAN)), requests[:4])
    cached = graph(base, pool=4)
    assert_same(run(cached, requests[:4]), reference)
    assert_same(run(cached, requests[:4]), reference)
    # An x-vector clone's prefix is the same in both text modes (one entry); an in-context
    # clone's differs (its transcript lies against codes when streaming, pads when not).
    pool = cached.backend.prefix
    assert pool.misses == 3 and pool.hits == 5
    short_prefix = graph(base, pool=2, max_prefix=5)  # the shared prefix cached in part
    assert_same(run(short_prefix, requests[2:3]), reference[2:3])
    # A transcript longer than the reference frames: the whole prompt is shared but one.
    alone = requests[4]
    assert_same(run(graph(base, pool=2), [alone]), run(graph(base, pool=0), [alone]))


def test_a_new_prefix_never_passes_through_the_scratch_slot(custom, monkeypatch):
    """The first use of a prefix prefills it and stores its KV. The scratch slot is written by
    padding rows of frame steps that may run meanwhile on another stream (the admission
    lane), so nothing stored may come from it: here the scratch slot's cache turns to NaN
    right before every store, as such a write would, and the codes and audio do not change."""
    requests = custom_requests()
    reference = run(EagerEngine(custom, plan=EnginePlan(**PLAN)), requests)
    cached = graph(custom, pool=4)
    backend, store = cached.backend, PrefixPool.store
    stores = []

    def poisoned_store(pool, k_cache, v_cache, slot, entry):
        k_cache[:, backend.scratch] = float("nan")
        v_cache[:, backend.scratch] = float("nan")
        stores.append(slot)
        return store(pool, k_cache, v_cache, slot, entry)

    monkeypatch.setattr(PrefixPool, "store", poisoned_store)
    assert_same(run(cached, requests), reference)
    assert len(stores) == 3 and backend.scratch not in stores
    assert torch.isnan(backend.kv_k[:, backend.scratch]).all()  # the poison was real


@pytest.mark.parametrize("pool", [0, 4])
@pytest.mark.parametrize("kind", ["custom", "base"])
def test_batched_prefill_gives_the_same_codes_and_audio(custom, base, kind, pool):
    """Prompts admitted together run as prefill steps of up to 4 (same length bucket, padded
    with scratch rows): the same codes and audio as the eager reference. Custom: two prompts
    of one bucket and one of another, instruct and both text modes; base: x-vector and
    in-context clones in one step, so rows with and without reference frames mix."""
    models = custom if kind == "custom" else base
    requests = custom_requests() if kind == "custom" else base_requests(models)[:4]
    reference = run(EagerEngine(models, plan=EnginePlan(**PLAN)), requests)
    one, batched = graph(models, pool=pool), graph(models, pool=pool, batches=(1, 2, 4))
    for engine in (one, batched, one, batched):  # the second time every prefix is cached
        assert_same(run(engine, requests), reference)
    # the same prompts in fewer steps: some share a length bucket, and so a step
    assert batched.backend.prefill_steps < one.backend.prefill_steps


# -- eviction, held entries, a full pool -------------------------------------------------------


def test_least_recently_used_prefix_is_evicted_and_recomputed(custom):
    reqs = {
        v: SynthesisRequest(TEXT, voice=v, seed=9, max_frames=3)
        for v in ("ryan", "aiden", "serena")
    }
    reference = {v: run(graph(custom, pool=0), [r]) for v, r in reqs.items()}
    cached = graph(custom, pool=2)
    pool = cached.backend.prefix
    for v in ("ryan", "aiden", "serena", "ryan", "serena"):
        assert_same(run(cached, [reqs[v]]), reference[v])
    # ryan, aiden: fill; serena evicts ryan; ryan evicts aiden; serena hits.
    assert (pool.misses, pool.evictions, pool.hits) == (4, 2, 1)


def test_a_held_entry_is_never_evicted_and_a_full_pool_means_a_full_prefill(custom):
    a = SynthesisRequest(TEXT, voice="ryan", seed=1, max_frames=3)
    b = SynthesisRequest(TEXT, voice="aiden", seed=2, max_frames=3)
    reference = run(graph(custom, pool=0), [a, b])
    cached = graph(custom, pool=1)
    pool = cached.backend.prefix
    assert_same(run(cached, [a, b]), reference)  # b admitted while a holds the only entry
    assert (pool.misses, pool.full, pool.evictions) == (1, 1, 0)
    # An admission released before its prefill leaves no half-made entry behind.
    slot = cached.admit(b)
    cached.release(slot)
    assert (pool.evictions, len(pool)) == (1, 0)
    assert_same(run(cached, [a]), reference[:1])


def test_an_entry_overwritten_while_its_request_runs_changes_nothing(base):
    """A registered voice deleted (or its entry evicted) mid-request: the slot has its own
    copy of the prefix KV."""
    first = SynthesisRequest(TEXT, clone=random_clone(base, 30, 7, "Gone soon."), seed=3,
                             max_frames=6)  # fmt: skip
    other = SynthesisRequest(TEXT, clone=random_clone(base, 31, 5, "Another voice."), seed=4,
                             max_frames=3)  # fmt: skip
    ((want_codes, want_pcm),) = run(graph(base, pool=0), [first])
    engine = graph(base, pool=1)
    pool = engine.backend.prefix
    slot = engine.admit(first)
    engine.prefill([slot])
    head = [out.codes for out in engine.frames([slot])]
    engine.release(engine.admit(other))  # admitted and released before its prefill
    late = engine.admit(other)
    engine.prefill([late])  # fills the only entry: the running request's prefix is gone
    engine.release(late)
    assert (pool.misses, pool.evictions, len(pool)) == (3, 1, 1)
    codes, pcm = finish(engine, [slot])[0]
    assert_same([(torch.cat([torch.stack(head), codes]), pcm)], [(want_codes, want_pcm)])


def test_prefix_pool_bookkeeping_and_copies(custom):
    cfg = custom.cfg.talker
    pool = PrefixPool(cfg, entries=2, max_prefix=4, dtype=torch.float32, device="cpu")
    shape = (cfg.num_layers, 3, cfg.num_kv_heads, 16, cfg.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    a, b = pool.acquire(b"a"), pool.acquire(b"b")
    assert pool.acquire(b"c") is None and pool.full == 1  # both held
    for entry in (a, b):
        pool.store(k, v, 1, entry)
        pool.release(entry)
    pool.release(pool.acquire(b"a"))  # a is now the most recently used
    c = pool.acquire(b"c")
    assert c.index == b.index and not c.ready and pool.evictions == 1
    dst_k, dst_v = torch.zeros(shape), torch.zeros(shape)
    pool.copy_into(dst_k, dst_v, torch.tensor([2]), torch.tensor([a.index]))
    assert torch.equal(dst_k[:, 2, :, :4], k[:, 1, :, :4])
    assert torch.equal(dst_v[:, 2, :, :4], v[:, 1, :, :4])
    assert not dst_k[:, 2, :, 4:].any() and not dst_k[:, :2].any()


# -- staging prepared at the edge ----------------------------------------------------------


@torch.no_grad()
def test_settings_prepared_at_the_edge_reach_the_slot(custom):
    """A request resolved at the edge carries its staged rows and prefix key (made once,
    off the engine loop); admitted and prefilled, its slot holds its own settings, the same
    as when the backend prepares it at admission."""
    from ttsbuild.runtime.core import ResolvedRequest

    engine = graph(custom, pool=4)
    be = engine.backend
    over = SamplingOverrides(temperature=0.55, top_k=17, top_p=0.85, repetition_penalty=1.07,
                             subtalker_temperature=0.65, subtalker_top_k=9,
                             subtalker_top_p=0.75, subtalker_do_sample=False)  # fmt: skip
    req = SynthesisRequest(TEXT, voice="vivian", seed=123456, max_frames=7, sampling=over)
    resolved = engine.resolve(req)
    prep, layout = resolved.plan.staged, resolved.plan.prompt.layout
    n = min(layout.shared_prefix_len, layout.num_positions - 1, be.prefix.max_prefix)
    assert prep is not None and prep.prefix_len == n > 0
    assert prep.prefix_key == layout.prefix_key(n)
    assert np.array_equal(prep.ids, layout.rows.numpy())
    bare = ResolvedRequest(req, dataclasses.replace(resolved.plan, staged=None))
    params = resolved.plan.params
    for r in (resolved, bare):
        slot = engine.admit(r)
        engine.prefill([slot])
        t, c = be.talker_sampling, be.cp_sampling
        got = (t.temperature[slot].item(), t.top_k[slot].item(), t.top_p[slot].item(),
               t.repetition_penalty[slot].item(), bool(t.do_sample[slot]),
               c.temperature[slot].item(), c.top_k[slot].item(), c.top_p[slot].item(),
               bool(c.do_sample[slot]))  # fmt: skip
        want = (params.talker.temperature, params.talker.top_k, params.talker.top_p,
                params.talker.repetition_penalty, params.talker.do_sample,
                params.code_predictor.temperature, params.code_predictor.top_k,
                params.code_predictor.top_p, params.code_predictor.do_sample)  # fmt: skip
        assert got == pytest.approx(want, rel=1e-6), (got, want)
        assert (t.temperature[slot].item(), c.top_k[slot].item()) == pytest.approx((0.55, 9))
        assert be.seed[slot].item() == 123456
        assert be.eos_min_frames[slot].item() == resolved.plan.eos_from
        assert be.text_len[slot].item() == layout.trailing_ids.shape[0]
        assert be.position[slot].item() == layout.num_positions
        engine.release(slot)
    with pytest.raises(KeyError, match="not a prefill setting"):
        _settings(temprature=1.0)
