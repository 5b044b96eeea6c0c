"""The one-kernel code-predictor frame (ttsbuild/csrc/cp_megaframe.cu) is checked on the GPU
against `cp_megaframe.reference`, a float32 model of its math on its own tensor layout. Here
that reference, on tensors packed from our code predictor (`pack_module`, through the
engine's PackedStack and Dense), is checked against the official Qwen3-TTS code predictor on
random weights: so the kernel's layout and math (qkv and gate/up concatenation, the folded
codebook tables, the projected inputs, RoPE, q/k norms, GQA, one head a codebook) are the
model's, not only the kernel's. And the wrapper's refusals and argument layout, on the CPU."""

import re

import pytest
import torch
from reference_models import build_pair, small_config

from ttsbuild.runtime import cp_megaframe as cpm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _frame(seed: int):
    official, talker, cp = build_pair(small_config(), seed=seed, dtype=torch.float32)
    cfg = talker.cfg
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(1, 1, cfg.talker.hidden_size, generator=g)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_code_groups), generator=g)
    with torch.no_grad():
        embeds = [hidden, talker.embed_codec(codes[:, :1])]
        embeds += [cp.embed_codes(i, codes[:, i:i + 1]) for i in range(1, cfg.num_code_groups - 1)]
        official_logits = official.talker.code_predictor.forward_finetune(
            inputs_embeds=torch.cat(embeds, 1)).logits[0]  # [15, V]: head i on position i + 1
        x_in = cp.small_to_mtp_projection(torch.cat(embeds[:2], 1)[0])  # [2, cp hidden]
    return cp, x_in, codes[0, 1:cfg.num_code_groups - 1], official_logits


def test_reference_is_the_official_code_predictor():
    cp, x_in, tokens, official_logits = _frame(seed=11)
    m = cpm.pack_module(cp, fp8=False)
    logits, kc, vc = cpm.reference(m, x_in, tokens, eps=cp.cfg.code_predictor.rms_norm_eps)
    assert logits.shape == official_logits.shape == (15, cp.cfg.codebook_size)
    for i in range(15):  # every codebook's logits, each on its own
        assert rel_err(logits[i], official_logits[i]) < 1e-4, i
    # the caches were written for every position of the frame (a pass that skipped its row
    # would leave zeros there)
    assert bool((kc.abs().sum(-1) > 0).all()) and bool((vc.abs().sum(-1) > 0).all())
    # and the check can fail: the tokens one codebook off, or RoPE turned the other way
    wrong, _, _ = cpm.reference(m, x_in, tokens.roll(1), eps=cp.cfg.code_predictor.rms_norm_eps)
    assert rel_err(wrong, official_logits) > 0.1
    flipped = dict(m, rope_sin=-m["rope_sin"])
    wrong, _, _ = cpm.reference(flipped, x_in, tokens, eps=cp.cfg.code_predictor.rms_norm_eps)
    assert rel_err(wrong, official_logits) > 0.01


def test_fp8_pack_dequantises_to_the_weights():
    cp, x_in, tokens, official_logits = _frame(seed=12)
    exact, fp8 = cpm.pack_module(cp, fp8=False), cpm.pack_module(cp, fp8=True)
    for k in ("qkv", "o", "gu", "d", "head"):
        assert fp8["w" + k].dtype == torch.float8_e4m3fn and exact["w" + k].dtype == torch.float32
        deq = fp8["w" + k].float() * fp8["s" + k][..., None]
        err = rel_err(deq, exact["w" + k])
        assert 1e-4 < err < 0.05, (k, err)  # e4m3: ~2-3% a weight; 0 would mean no rounding
    logits, _, _ = cpm.reference(fp8, x_in, tokens, eps=cp.cfg.code_predictor.rms_norm_eps)
    err = rel_err(logits, official_logits)
    assert 1e-4 < err < 0.1, err


def _real_shapes(device="meta", fp8=True) -> dict[str, torch.Tensor]:
    """pack's tensors at the kernel's shapes (on the meta device: shapes and dtypes only)."""
    s = cpm.SHAPE
    L, H, hd, V, G = s["layers"], s["hidden"], s["head_dim"], s["vocab"], s["groups"]
    qkv, inter = (s["heads"] + 2 * s["kv_heads"]) * hd, s["intermediate"]
    w = torch.float8_e4m3fn if fp8 else torch.float32
    shapes = {"qkv": (L, qkv, H), "o": (L, H, s["heads"] * hd), "gu": (L, 2 * inter, H),
              "d": (L, H, inter), "head": (G - 1, V, H)}
    m = {}
    for k, shape in shapes.items():
        m["w" + k] = torch.empty(shape, dtype=w, device=device)
        m["s" + k] = torch.empty(shape[:-1], device=device)
    m.update(in_norm=torch.empty(L, H, device=device), post_norm=torch.empty(L, H, device=device),
             q_norm=torch.empty(L, hd, device=device), k_norm=torch.empty(L, hd, device=device),
             final_norm=torch.empty(H, device=device),
             tables=torch.empty(G - 2, V, H, device=device),
             rope_cos=torch.empty(G, hd // 2, device=device),
             rope_sin=torch.empty(G, hd // 2, device=device))
    return m


def test_unsupported_names_the_reason():
    assert cpm.unsupported(_real_shapes()) is None
    assert "FP8" in cpm.unsupported(_real_shapes(fp8=False))
    cp, _, _, _ = _frame(seed=13)
    why = cpm.unsupported(cpm.pack_module(cp, fp8=True))
    assert "these weights' differ" in why and "'hidden': 48" in why
    with pytest.raises(ValueError, match="shapes"):
        cpm.Megaframe(cpm.pack_module(cp, fp8=True), eps=1e-6)


def test_heads_fp8_or_bf16_as_held():
    """The kernel takes FP8 linears and FP8 or bf16 heads: `pack` keeps a bf16 head's weights
    as they are (scales of 1, the reference reads them so), `share_weights` makes the engine's
    heads views of the packed stack and refuses heads that differ from it, and the kernel's
    argument for bf16 heads is the bf16 tensor itself (the extension reads its element size)."""
    real = _real_shapes()
    real["whead"] = torch.empty(real["whead"].shape, dtype=torch.bfloat16, device="meta")
    assert cpm.unsupported(real) is None
    real["whead"] = torch.empty(real["whead"].shape, dtype=torch.float32, device="meta")
    assert "heads" in cpm.unsupported(real)

    cp, x_in, tokens, official_logits = _frame(seed=14)
    stack = cpm.PackedStack.from_module(cp.model, True)
    heads = [cpm.Dense(h.weight.detach().to(torch.bfloat16)) for h in cp.lm_head]
    embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
    m = cpm.pack(stack, heads, cp.small_to_mtp_projection, embeddings)
    assert m["whead"].dtype == torch.bfloat16 and m["wqkv"].dtype == torch.float8_e4m3fn
    assert bool((m["shead"] == 1).all())
    for k, v in cpm.pack_module(cp, fp8=True, bf16_heads=True).items():  # the same packing
        assert v.dtype == m[k].dtype and torch.equal(v.float(), m[k].float()), k
    eps = cp.cfg.code_predictor.rms_norm_eps
    logits, _, _ = cpm.reference(m, x_in, tokens, eps=eps)
    fp8_logits, _, _ = cpm.reference(cpm.pack_module(cp, fp8=True), x_in, tokens, eps=eps)
    # bf16 heads round less than FP8 ones: nearer the official logits
    assert rel_err(logits, official_logits) < rel_err(fp8_logits, official_logits)
    cpm.share_weights(m, stack, heads)
    for i, d in enumerate(heads):
        assert d.weight.data_ptr() == m["whead"][i].data_ptr() and d.scale is None
    other = [cpm.Dense(d.weight.clone()) for d in heads]
    other[3].weight[0, 0] += 1.0
    with pytest.raises(ValueError, match=r"head\[3\] differs"):
        cpm.share_weights(m, stack, other)
    real["whead"] = torch.empty(real["whead"].shape, dtype=torch.bfloat16, device="meta")
    x = torch.empty(2, cpm.SHAPE["hidden"], device="meta")
    args = cpm.kernel_tensors({**real, "x_in": x}, cpm.scratch("meta"))
    assert args[cpm.ORDER.index("whead")] is real["whead"]  # bf16 as is, not a byte view


def test_kernel_arguments_in_order_with_w_o_head_major():
    s = cpm.SHAPE
    m = _real_shapes(device="meta")
    g = torch.Generator().manual_seed(3)
    m["wo"] = torch.randn(s["layers"], s["hidden"], s["heads"] * s["head_dim"],
                          generator=g).to(torch.float8_e4m3fn)
    buffers = cpm.scratch("meta")
    args = cpm.kernel_tensors({**m, "x_in": torch.empty(2, s["hidden"], device="meta")}, buffers)
    assert len(args) == len(cpm.ORDER) == 29
    assert all(a.dtype != torch.float8_e4m3fn for a in args)  # FP8 goes as bytes
    wo = args[cpm.ORDER.index("wo")]
    assert wo.shape == (s["layers"], s["heads"], s["hidden"], s["head_dim"])
    for _ in range(20):
        layer, h, r, d = (int(torch.randint(0, n, (1,), generator=g)) for n in (
            s["layers"], s["heads"], s["hidden"], s["head_dim"]))
        assert int(wo[layer, h, r, d]) == int(m["wo"][layer, r, h * s["head_dim"] + d].view(
            torch.uint8))
    assert args[cpm.ORDER.index("tokens")] is buffers["tokens"]
    wdt = args[cpm.ORDER.index("wdt")]  # W_d transposed: [L, intermediate, hidden] bytes
    assert wdt.shape == (s["layers"], s["intermediate"], s["hidden"]) and wdt.dtype == torch.uint8
    # a second instance's arguments: those two copies shared, its own buffers
    other = cpm.scratch("meta")
    again = cpm.kernel_tensors({**m, "x_in": torch.empty(2, s["hidden"], device="meta")}, other,
                               like=args)
    for name, a, b in zip(cpm.ORDER, args, again, strict=True):
        if name in ("wo", "wdt"):
            assert a is b, name
        if name in other:
            assert b is other[name] and a is not b, name


# -- the kernel's sampler, step for step in torch (pick_token in cp_megaframe.cu) -------------
def _order_key(v: torch.Tensor) -> torch.Tensor:
    """cp_megaframe.cu's order_key: ascending uint32 keys of float32 values (as int64)."""
    b = v.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(b & 0x80000000 != 0, b ^ 0xFFFFFFFF, b ^ 0x80000000)


def _kth_key(keys: torch.Tensor, k: int) -> int:
    t = 0
    for bit in range(31, -1, -1):
        if int((keys >= (t | 1 << bit)).sum()) >= k:
            t |= 1 << bit
    return t


def _kernel_pick(logits, do_sample, top_k, top_p, temperature, gumbel) -> int:
    """The token pick_token draws: its fast path, its bit-by-bit k-th key and top-p searches."""
    if not do_sample:
        return int(logits.argmax())
    v = logits.float() / temperature
    z = v + gumbel
    arg = int(z.argmax())
    use_k, use_p = 0 < top_k < v.numel(), top_p < 1.0
    if not use_k and not use_p:
        return arg
    keys = _order_key(v)
    if not use_p:
        if int((v > v[arg]).sum()) < top_k:
            return arg
        keep = _kth_key(keys, top_k)
    else:
        keep = _kth_key(keys, top_k) if use_k else 0
        e = torch.where(keys >= keep, torch.exp(v - v.max()), torch.zeros_like(v))
        budget = (1.0 - top_p) * float(e.sum())
        t = 0
        for bit in range(31, -1, -1):
            if float(e[keys < (t | 1 << bit)].sum()) <= budget:
                t |= 1 << bit
        keep = max(keep, t)
    return int(torch.where(keys >= keep, z, torch.full_like(z, float("-inf"))).argmax())


def test_kernel_sampler_algorithm_is_sample():
    """pick_token's algorithm (greedy, temperature, top-k, top-p and both, ties included)
    against `sampling.sample` on random peaked logits, case by case. Cases where float
    summation order may decide (a cumulative mass within 1e-5 of 1 - p, or the draw's top two
    scores within 1e-6) are counted apart; the rest must all agree."""
    from ttsbuild.generation.sampling import SamplingBatch, SamplingParams, sample, uniform_noise

    g = torch.Generator().manual_seed(31)
    V, agree, boundary, cases = 2048, 0, 0, 600
    for case in range(cases):
        logits = torch.randn(V, generator=g) * 4.0
        if case % 4 == 0:  # ties: values on a coarse grid
            logits = (logits * 2).round() / 2
        do_sample = case % 7 != 0
        top_k = [0, 1, 5, 50, 2048, 3000][case % 6]
        top_p = [1.0, 0.95, 0.8, 0.5, 0.1][(case // 6) % 5]
        temperature = [0.7, 0.9, 1.3][case % 3]
        params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k,
                                top_p=top_p)
        batch = SamplingBatch.from_params([params])
        seeds, counters = torch.tensor([1000 + case]), torch.tensor([case * 16 + 3])
        u = uniform_noise(seeds, counters, V)[0]
        gumbel = -torch.log(-torch.log(u))
        want = int(sample(logits[None], batch, seeds, counters)[0])
        got = _kernel_pick(logits, do_sample, top_k, top_p, temperature, gumbel)
        scaled = logits / temperature
        mass = torch.softmax(scaled.sort().values, -1).cumsum(-1)
        z = (scaled + gumbel).topk(2).values
        near = do_sample and (bool(((mass - (1 - top_p)).abs() < 1e-5).any()) and top_p < 1
                              or float(z[0] - z[1]) < 1e-6)
        if got == want:
            agree += 1
        else:
            assert near, (case, got, want, top_k, top_p)
            boundary += 1
    assert agree >= cases - 5 and boundary <= 5, (agree, boundary)


def test_near_ties_are_where_summation_order_may_decide():
    """`near_tie` (the tolerance of the kernel's GPU checks): true at a tie of the top two
    scores and at a cumulative probability on 1 - p, false for a clear draw."""
    from ttsbuild.generation.sampling import SamplingBatch, SamplingParams

    def settings(do_sample, top_p=1.0):
        return (SamplingBatch.from_params([SamplingParams(do_sample=do_sample, temperature=1.0,
                                                          top_k=0, top_p=top_p)]),
                torch.tensor([7]), torch.tensor([2]))

    clear = torch.tensor([0.0, 1.0, 9.0, 2.0])
    assert not cpm.near_tie(clear, *settings(False), 1)
    assert cpm.near_tie(torch.tensor([0.0, 5.0, 5.0, 2.0]), *settings(False), 1)
    # two equal logits of all the mass: cumulative probability 0.5 after the first
    halves = torch.tensor([3.0, 3.0, -50.0, -50.0])
    assert cpm.near_tie(halves, *settings(True, top_p=0.5), 1)
    draws = cpm.reference_draws(torch.stack([clear] * 3), *settings(False))
    assert draws == [2, 2, 2]


def test_compile_knows_before_packing_which_checkpoints_the_kernel_runs():
    """`unsupported_config`: every shipped variant's code predictor (0.6B and 1.7B) has the
    kernel's shapes; the tiny test model's is refused, naming what differs."""
    from ttsbuild.convert.init_random import load_variant
    from ttsbuild.model.config import ModelConfig

    def cfg(variant):
        return ModelConfig.from_official(load_variant(variant)[0])

    for variant in ("1.7b-customvoice", "1.7b-base", "1.7b-voicedesign", "0.6b-customvoice"):
        assert cpm.unsupported_config(cfg(variant)) is None, variant
    assert cpm.config_shape(cfg("1.7b-customvoice")) == cpm.SHAPE
    why = cpm.unsupported_config(cfg("tiny"))
    assert why and "code predictor's shapes" in why and "'hidden': 64" in why


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_the_gemv_reduction_leaves_each_rows_sum_where_the_kernel_reads_it(rows):
    """OPT_XREDUCE's warp reduction of R row sums together (`xreduce_lanes`, the kernel's
    `xreduce` step for step): lane l ends with the sum over the 32 lanes of row
    l >> (5 - log2 R), the row the kernel's lane l % (32 / R) == 0 writes."""
    g = torch.Generator().manual_seed(100 + rows)
    values = torch.randn(32, rows, generator=g, dtype=torch.float64)
    got = cpm.xreduce_lanes(values)
    want = values.sum(0)
    lane = torch.arange(32)
    assert torch.allclose(got, want[lane // (32 // rows)], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, want[lane % rows]) or rows == 1  # the mapping matters


def test_the_engines_options_take_only_the_new_bits_from_the_environment(monkeypatch):
    """$TTSBUILD_MEGAFRAME_EXTRA names the options beside SERVED_OPTS in place of
    ENGINE_EXTRA (the tagged words and WARP_QK; "0" none: the served instance alone), to time
    them in the engine; anything else is a clear error, not a silent kernel mode. The
    default's instance is one of the kernel's own."""
    monkeypatch.delenv(cpm.EXTRA_ENV, raising=False)
    served = cpm.SERVED_OPTS | cpm.COOPERATIVE
    default = served | cpm.TAGGED | cpm.TAGGED_QKV | cpm.WARP_QK
    assert cpm.engine_opts() == default and cpm.specialized(default)
    monkeypatch.setenv(cpm.EXTRA_ENV, "")
    assert cpm.engine_opts() == default
    monkeypatch.setenv(cpm.EXTRA_ENV, "0")
    assert cpm.engine_opts() == served
    monkeypatch.setenv(cpm.EXTRA_ENV, str(cpm.TWO_TOKEN | cpm.KV_AHEAD))
    assert cpm.engine_opts() == served | cpm.TWO_TOKEN | cpm.KV_AHEAD
    for bad, message in (("16", "only TWO_TOKEN"), ("fast", "integer of option bits")):
        monkeypatch.setenv(cpm.EXTRA_ENV, bad)
        with pytest.raises(ValueError, match=message):
            cpm.engine_opts()


def test_the_kernels_thread_count_comes_from_the_environment_or_fails_clearly(monkeypatch):
    """$TTSBUILD_MEGAFRAME_THREADS picks the engine's kernel build (256 or 512 stage threads);
    unset it is 256, and any other value is refused before a build starts. The kernel source
    accepts exactly the choices the module offers."""
    monkeypatch.delenv(cpm.THREADS_ENV, raising=False)
    assert cpm.threads_from_env() == 256
    monkeypatch.setenv(cpm.THREADS_ENV, "512")
    assert cpm.threads_from_env() == 512
    for bad in ("384", "many", "-256"):
        monkeypatch.setenv(cpm.THREADS_ENV, bad)
        with pytest.raises(ValueError, match="256, 512"):
            cpm.threads_from_env()
    with pytest.raises(ValueError, match="threads"):
        cpm.extension(threads=128)
    src = cpm.SOURCE.read_text()
    allowed = re.search(r"static_assert\(THREADS == (\d+) \|\| THREADS == (\d+)", src)
    assert allowed and tuple(int(v) for v in allowed.groups()) == cpm.THREADS_CHOICES


def test_the_scratch_has_room_for_tagged_words(monkeypatch):
    """TAGGED keeps act and d (TAGGED_QKV also qkv) as 64-bit tagged words and o as three
    buffers rotating by layer: the scratch buffers have the sizes the kernel's host checks ask
    for (o 6 rows of hidden; qkv, act and d 2 floats a value of two token rows), and the engine
    refuses TAGGED beside SPLIT_DOWN and TAGGED_QKV without TAGGED, as the kernel does."""
    b = cpm.scratch("cpu")
    s = cpm.SHAPE
    qkv = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    assert b["o"].numel() >= 6 * s["hidden"]
    assert b["qkv"].numel() >= 2 * 2 * qkv
    assert b["act"].numel() >= 2 * 2 * s["intermediate"]
    assert b["d"].numel() >= 2 * 2 * s["hidden"]
    src = cpm.SOURCE.read_text()
    assert "ws[20].numel() >= 6 * megaframe::H" in src
    assert "ws[19].numel() >= 2 * tt * megaframe::QKV" in src
    assert "ws[21].numel() >= 2 * tt * megaframe::I" in src
    assert "ws[22].numel() >= 2 * tt * megaframe::H" in src
    monkeypatch.setenv(cpm.EXTRA_ENV, str(cpm.TAGGED | cpm.TAGGED_QKV))
    assert cpm.engine_opts() & cpm.TAGGED_QKV
    for bad, message in ((cpm.TAGGED | cpm.SPLIT_DOWN, "do not go together"),
                         (cpm.TAGGED_QKV, "needs TAGGED")):
        monkeypatch.setenv(cpm.EXTRA_ENV, str(bad))
        with pytest.raises(ValueError, match=message):
            cpm.engine_opts()


def test_the_specialized_instances_are_the_kernels_own():
    """cpm.SPECIALIZED (which options run an instance compiled for them) is the list the
    kernel source instantiates; the served options are among them, and GENERIC or options
    outside the list take the generic instance."""
    src = cpm.SOURCE.read_text()
    names = dict(re.findall(r"\b(OPT_[A-Z_0-9]+) = (\d+)", src))
    fetch = re.search(r"constexpr int FETCH = ([^;]+);", src).group(1)
    listed = re.search(r"constexpr int SPECIALIZED\[\] = \{([^}]+)\}", src).group(1)

    def value(expr: str) -> int:
        out = 0
        for term in expr.split("|"):
            term = term.strip()
            out |= value(fetch) if term == "FETCH" else int(names[term])
        return out

    assert value(fetch) == cpm.FETCH
    assert tuple(value(e) for e in listed.split(",")) == cpm.SPECIALIZED
    assert int(names["OPT_GENERIC"]) == cpm.GENERIC
    assert cpm.specialized(cpm.SERVED_OPTS | cpm.COOPERATIVE)
    assert cpm.specialized(cpm.FETCH) and cpm.SERVED_OPTS == cpm.SPECIALIZED[0]
    assert not cpm.specialized(cpm.SERVED_OPTS | cpm.GENERIC)
    assert not cpm.specialized(cpm.SERVED_OPTS | cpm.SPLIT_DOWN)
    assert not cpm.specialized(cpm.SERVED_OPTS, barrier=3)  # the striped barrier: generic
    assert cpm.specialized(cpm.SERVED_OPTS | cpm.EARLY_FREE)  # the options timed beside it
    assert cpm.specialized(cpm.SERVED_OPTS | cpm.TAGGED)
    assert cpm.specialized(cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV)
    assert cpm.specialized(cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV | cpm.WARP_QK)
    assert int(names["OPT_WARP_QK"]) == cpm.WARP_QK
    assert int(names["OPT_TAGGED_QKV"]) == cpm.TAGGED_QKV
    assert int(names["OPT_EARLY_FREE"]) == cpm.EARLY_FREE
    assert int(names["OPT_TAGGED"]) == cpm.TAGGED
    assert "flag_barrier == 0 &&" in src  # ...as the binding dispatches
