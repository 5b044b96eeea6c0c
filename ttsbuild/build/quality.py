"""FP8 quality of what runs, against the bf16 (fp32 on CPU) model, under teacher forcing.

The reference (the checkpoint's eager modules) generates codes for a few calibration texts;
then the reference and the candidate both run on those same sequences, and their
next-token distributions are compared position by position. The candidate is the runtime:
the engine's packed weights as compiled (FP8 e4m3 + per-channel scales, fused q/k/v and
gate/up) through the runtime's own code, `runtime.fast_model.PackedStack` (prefill of the
prompt, then one batched `decode` per frame, Dense FP8 linears: the Triton weight-only
kernels on a GPU, their references on CPU) and the code predictor's frame
(`runtime.cp_fused.FusedCodePredictor.frame_logits`: the fused path and the unfused one,
each where the plan uses it). Measured separately:
  codebook 0 (talker): top-1 agreement and mean KL(p_ref || p_runtime) over the ids the
    sampler may draw (codes and EOS; control/speaker rows are suppressed by generation);
  codebooks 1..15 (code predictor, fed the talker states each side computed): the same
    figures, for each code-predictor path the plan uses.
Teacher forcing keeps the comparison per step: a free-running comparison would diverge after
the first different sample and measure sampling noise, not quantisation error. The talker's
linears run by rows as the plan serves them (`check_quality` sets the stack's
w8a8_min_rows / bf16_min_rows): the prompts' prefill, 16 rows and more by default, as W8A8 (each
activation row quantised to FP8 with its own scale at run time), the decode steps of a few
rows weight-only; and where the plan has decode buckets of W8A8's rows, codebook 0 once more
with the decode as W8A8 (compile's `talker_decode_paths`, since 2026-12-07: on the 1.7B
stand-in KL 0.0049 -> 0.0079), the gate taking the worse. Other activations stay bf16 (the
calibrated activation and KV scales an engine may carry are not used by any runtime path
yet), so the gate measures weight rounding, the activation rounding of the prefill and of
W8A8 decode steps, and the kernels.

The gate (`ttsbuild compile` refuses the engine unless --force-quality), for each group:
  top-1 agreement >= 0.85 and mean KL <= 0.02 nats.
Why these numbers (measured on the 1.7B peaked stand-in on the H200, 4 texts x 32 frames;
benchmarks/quality/RESULTS.md): the correct FP8 engine measures codebook-0 KL 0.006-0.008
and top-1 0.93-0.95 (bf16 kernels alone: 0.002 and 0.97-0.98, near-tied codes flip under
any rounding), codebooks 1-15 KL ~0.002 and top-1 ~0.97; one packed linear of one of 28
layers with its scale off by 4x moves KL several times past 0.02. Published FP8 builds of
trained LMs stay at 0.006-0.02 nats even with FP8 activations (W8A8). KL is the figure that
separates right from wrong; top-1 agreement guards gross breakage (it is noisy: one
position of 128 is 0.008). Real checkpoints are gated the same way (--force-quality
overrides).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ttsbuild.generation.generate import codebook0_logits_mask
from ttsbuild.generation.prompt import build_prompt
from ttsbuild.model.layers import KVCache
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE

MIN_TOP1 = 0.85
MAX_KL = 0.02
CANDIDATE = ("runtime kernels on the engine's packed weights: PackedStack prefill + batched "
             "decode (talker), FusedCodePredictor.frame_logits (code predictor)")
ACTIVATIONS = ("bf16 activations, bf16 KV cache; the talker's FP8 linears W8A8 (rows quantised "
               "per row at run time) from the plan's w8a8_min_rows to its bf16_min_rows, "
               "weight-only below; calibrated input/KV scales, where an engine has them, are "
               "not used by the runtime")


class QualityError(ValueError):
    """The quantised model falls below the quality gate."""


@dataclass
class Agreement:
    """One codebook group: the runtime's logits against the reference's."""

    top1_agreement: float
    mean_kl: float
    max_kl: float
    positions: int

    @classmethod
    def of(cls, ref: torch.Tensor, cand: torch.Tensor) -> Agreement:
        top1 = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
        log_p, log_q = F.log_softmax(ref.float(), -1), F.log_softmax(cand.float(), -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]
        return cls(top1, kl.mean().item(), kl.max().item(), int(ref.shape[0]))

    def passes(self, min_top1: float, max_kl: float) -> bool:
        return self.top1_agreement >= min_top1 and self.mean_kl <= max_kl


@dataclass
class QualityReport:
    codebook0_top1_agreement: float
    codebook0_mean_kl: float
    codebook0_max_kl: float
    code_predictor_top1_agreement: float  # the worst code-predictor path
    code_predictor_mean_kl: float
    code_predictor_max_kl: float
    code_predictor_paths: dict  # "fused" / "unfused" -> Agreement as a dict
    texts: int
    codebook0_positions: int
    code_predictor_positions: int
    min_top1: float
    max_kl: float
    codebook0_passed: bool
    code_predictor_passed: bool
    passed: bool
    compute_dtype: str
    random_weights: bool
    reference_sharpness: dict  # model.standin.sharpness of the reference, per group
    candidate: str = CANDIDATE
    activations: str = ACTIVATIONS
    method: str = "teacher forcing on sequences generated by the reference"
    notes: list[str] = field(default_factory=list)
    # the talker's decode paths measured ("few rows", "w8a8": `talker_decode_paths`) ->
    # Agreement as a dict; codebook0_* above are the worst of them
    codebook0_paths: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        note = " (random-weight stand-in)" if self.random_weights else ""
        s = self.reference_sharpness["codebook0"]
        return (
            f"codebook 0: top-1 agreement {self.codebook0_top1_agreement:.4f} "
            f"(>= {self.min_top1}), mean KL {self.codebook0_mean_kl:.5f} (<= {self.max_kl})"
            f"{' (' + ', '.join(self.codebook0_paths) + ')' if self.codebook0_paths else ''}; "
            f"codebooks 1-15: top-1 {self.code_predictor_top1_agreement:.4f}, mean KL "
            f"{self.code_predictor_mean_kl:.5f} ({', '.join(self.code_predictor_paths)}); "
            f"{self.texts} texts, {self.codebook0_positions} frames; reference mean top-1 "
            f"prob {s['mean_top1_prob']:.3f}, entropy {s['mean_entropy_nats']:.2f} nats{note}"
        )


@torch.no_grad()
def teacher_forced_logits(models, items) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager modules' (codebook-0 logits [N, vocab], code-predictor logits [15 * N,
    codebook_size]), fp32, at every frame of every item, each model fed the item's codes."""
    talker, cp, cfg = models.talker, models.code_predictor, models.cfg
    p = talker.codec_head.weight
    c0_logits, cp_logits = [], []
    for item in items:
        codes = item.codes.to(p.device)  # [F, groups]
        frames = codes.shape[0]
        prompt = build_prompt(talker, item.spec)
        steps = [_frame_input(talker.embed_codec, cp.embed_codes, codes[k], cfg)
                 + prompt.text_track(k) for k in range(frames - 1)]
        x = torch.cat([prompt.embeds, *(s[None] for s in steps)]).to(p.dtype)  # [n + F - 1, H]
        n = x.shape[0]
        cache = KVCache(cfg.talker, 1, n, p.dtype, p.device)
        hidden, logits = talker(
            x[None], cache, torch.zeros(1, dtype=torch.long, device=p.device),
            torch.arange(n, device=p.device)[None],
        )
        first = prompt.embeds.shape[0] - 1  # the position that predicts frame 0
        hidden, logits = hidden[0, first:], logits[0, first:]  # [F, H], [F, vocab]
        c0_logits.append(logits.float())

        cache = cp.new_cache(frames, p.dtype, p.device)
        slots = torch.arange(frames, device=p.device)
        x = torch.stack([hidden, talker.embed_codec(codes[:, 0])], dim=1)
        positions = torch.arange(2, device=p.device)[None].expand(frames, 2)
        for g in range(1, cfg.num_code_groups):
            cp_logits.append(cp(x, cache, slots, positions, g).float())
            if g + 1 < cfg.num_code_groups:
                x = cp.embed_codes(g, codes[:, g])[:, None]
                positions = torch.full((frames, 1), g + 1, device=p.device)
    return torch.cat(c0_logits), torch.cat(cp_logits)


def _frame_input(embed_c0, embed_codes, codes: torch.Tensor, cfg) -> torch.Tensor:
    """A frame's summed code embeddings (the talker's next input, before the text track)."""
    return sum([embed_c0(codes[..., 0])]
               + [embed_codes(g, codes[..., g]) for g in range(1, cfg.num_code_groups)])


@dataclass
class RuntimeLM:
    """The runtime's weights as `runtime.graph_engine.GraphBackend` builds them from an
    engine's packed tensors: the packed stacks, the heads, embeddings and projection."""

    modules: object  # Models-like: cfg, talker and code_predictor without decoder layers
    talker: object  # PackedStack
    codec_head: object  # Dense
    code_predictor: object  # FusedCodePredictor
    # the talker's cache in FP8 with its stack's calibrated k/v scales (plan.talker_kv_fp8)
    kv_fp8: bool = False

    @classmethod
    def from_packed(cls, cfg, packed: dict, sizes: dict, dtype, device,
                    heads_fp8: bool) -> RuntimeLM:
        """heads_fp8: the code predictor's heads in FP8, as the plan runs them
        (`EnginePlan.cp_heads_are_fp8`); its layers are as `packed` holds them."""
        from types import SimpleNamespace

        from ttsbuild.build.engine_dir import _runtime_tensors, lm_modules_from_packed
        from ttsbuild.runtime.cp_fused import FusedCodePredictor
        from ttsbuild.runtime.fast_model import Dense, PackedStack

        talker, cp = lm_modules_from_packed(cfg, packed, sizes, dtype, device,
                                            decoder_layers=False)
        t = {m: _runtime_tensors(packed[m], dtype, device) for m in ("talker", "code_predictor")}
        heads = [Dense.make(h.weight.detach(), heads_fp8) for h in cp.lm_head]
        embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
        fused = FusedCodePredictor(
            PackedStack.from_packed(cfg.code_predictor, t["code_predictor"]), heads,
            cp.small_to_mtp_projection, talker.model.codec_embedding.weight.detach(), embeddings,
        )  # fmt: skip
        return cls(SimpleNamespace(cfg=cfg, talker=talker, code_predictor=cp),
                   PackedStack.from_packed(cfg.talker, t["talker"]),
                   Dense(talker.codec_head.weight.detach()), fused)

    @torch.no_grad()
    def talker_states(self, items) -> torch.Tensor:
        """Final-norm talker hidden [N, H] at every frame of every item (the state that
        predicts it): each prompt prefilled into its slot, then every frame decoded for all
        items together, as the frame step does, fed the items' codes."""
        cfg, stack = self.modules.cfg, self.talker
        talker, cp = self.modules.talker, self.modules.code_predictor
        p = self.codec_head.weight
        prompts = [build_prompt(talker, item.spec) for item in items]
        frames = [int(item.codes.shape[0]) for item in items]
        lengths = [pr.embeds.shape[0] for pr in prompts]
        c = cfg.talker
        shape = (c.num_layers, len(items), c.num_kv_heads, max(lengths) + max(frames), c.head_dim)
        k_cache = torch.zeros(shape, dtype=KV_FP8_DTYPE if self.kv_fp8 else p.dtype,
                              device=p.device)  # fmt: skip
        v_cache = torch.zeros_like(k_cache)
        states: list[list[torch.Tensor]] = []
        for i, prompt in enumerate(prompts):
            slot = torch.tensor([i], device=p.device)
            h = stack.prefill(prompt.embeds[None].to(p.dtype), k_cache, v_cache, slot)[0]
            states.append([h[-1]])
        position = torch.tensor(lengths, device=p.device)
        for f in range(max(frames) - 1):
            rows = [i for i in range(len(items)) if f < frames[i] - 1]
            codes = torch.stack([items[i].codes[f].to(p.device) for i in rows])  # [B, G]
            text = torch.stack([prompts[i].text_track(f) for i in rows])
            x = (_frame_input(talker.embed_codec, cp.embed_codes, codes, cfg) + text).to(p.dtype)
            r = torch.tensor(rows, device=p.device)
            h = stack.decode(x, k_cache, v_cache, r, position[r])
            position[r] += 1
            for j, i in enumerate(rows):
                states[i].append(h[j])
        return torch.cat([torch.stack(s) for s in states])

    @torch.no_grad()
    def code_predictor_logits(self, hidden: torch.Tensor, codes: torch.Tensor, fused: bool,
                              batch: int) -> torch.Tensor:
        """Logits [15 * N, codebook_size] ordered as `teacher_forced_logits` orders them
        (item by item, codebook by codebook), from `batch` rows per frame call."""
        cfg, cp = self.modules.cfg, self.code_predictor
        G, dev = cfg.num_code_groups, hidden.device
        c = cfg.code_predictor
        k_cache = torch.zeros((c.num_layers, batch, c.num_kv_heads, G, c.head_dim),
                              dtype=hidden.dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        positions = [torch.full((batch,), i, device=dev) for i in range(G)]
        out = []
        for start in range(0, hidden.shape[0], batch):
            h, cd = hidden[start : start + batch], codes[start : start + batch]
            slots = torch.arange(h.shape[0], device=dev)
            out.append(cp.frame_logits(h, cd, k_cache, v_cache, slots, positions, fused=fused))
        return torch.cat(out)  # [N, G - 1, V]

    @torch.no_grad()
    def codebook0_logits(self, items, w8a8_min_rows: int) -> torch.Tensor:
        """Codebook-0 logits [N, vocab] with the talker's linears W8A8 from `w8a8_min_rows`
        rows for this measurement (then back as they were): its decode as the plan serves
        batch buckets of that many rows and more. Activations are quantised per row, so W8A8
        from 1 row over the corpus's few rows computes what a 16-row bucket computes."""
        linears = self.talker.linears()
        before = [d.w8a8_min_rows for d in linears]
        try:
            self.talker.set_w8a8_min_rows(w8a8_min_rows)
            return self.codec_head(self.talker_states(items)).float()
        finally:
            for d, rows in zip(linears, before, strict=True):
                d.w8a8_min_rows = rows

    def logits(self, items, cp_paths: dict[str, int]) -> tuple[torch.Tensor, dict]:
        """(codebook-0 logits [N, vocab], {path: code-predictor logits [15 * N, V]}) in the
        order of `teacher_forced_logits`. cp_paths: path ("fused"/"unfused") -> rows per call."""
        hidden = self.talker_states(items)  # [N, H]
        c0 = self.codec_head(hidden).float()
        codes = torch.cat([item.codes.to(hidden.device) for item in items])  # [N, G]
        bounds = torch.tensor([0] + [int(item.codes.shape[0]) for item in items]).cumsum(0)
        cp = {}
        for path, batch in cp_paths.items():
            lg = self.code_predictor_logits(hidden, codes, path == "fused", batch)
            # item-major, then codebook-major within an item (teacher_forced_logits' order)
            cp[path] = torch.cat([lg[a:b].transpose(0, 1).reshape(-1, lg.shape[-1])
                                  for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        return c0, cp


def pack_models(models, groups: list[str], device) -> tuple[dict, dict, dict]:
    """In-memory Models (a stand-in, or a checkpoint loaded eagerly) packed as `compile`
    packs them: (packed with the FP8 `groups` quantised as compile quantises them, the fused
    sizes, packed unquantised), each {"talker": ..., "code_predictor": ...} of bf16 CPU
    tensors; for `RuntimeLM.from_packed` without an engine directory."""
    from ttsbuild.build.compile import quantize_groups
    from ttsbuild.build.pack import fused_sizes, pack_state

    modules = {"talker": models.talker, "code_predictor": models.code_predictor}
    states = {m: {k: v.detach().to("cpu", torch.bfloat16) for k, v in mod.state_dict().items()}
              for m, mod in modules.items()}  # fmt: skip
    sizes = {m: fused_sizes(s) for m, s in states.items()}
    unquantised = {m: pack_state(s) for m, s in states.items()}
    packed = {m: dict(t) for m, t in unquantised.items()}
    quantize_groups(packed, groups, device)
    return packed, sizes, unquantised


def _worst(paths: dict[str, Agreement], min_top1: float, max_kl: float) -> Agreement:
    """The path that fails, else the one of the largest mean KL."""
    return min(paths.values(), key=lambda a: (a.passes(min_top1, max_kl), -a.mean_kl))


def measure_quality(reference, runtime: RuntimeLM, items, cp_paths: dict[str, int],
                    min_top1: float = MIN_TOP1, max_kl: float = MAX_KL,
                    reference_logits: tuple | None = None,
                    talker_paths: dict[str, int] | None = None) -> QualityReport:
    """Compare the runtime (`RuntimeLM`) with the reference `Models` (same config) on corpus
    items generated by the reference. cp_paths: the code-predictor paths the plan uses, with
    the rows per call (see `RuntimeLM.logits`). talker_paths: more of the talker's decode
    paths to measure codebook 0 on, as the w8a8_min_rows of each (`RuntimeLM.codebook0_logits`;
    compile's `talker_decode_paths`); the corpus's own few rows are "few rows".
    reference_logits: `teacher_forced_logits` of the reference on `items`, if already
    computed."""
    from ttsbuild.model.standin import sharpness

    ref_c0, ref_cp = reference_logits or teacher_forced_logits(reference, items)
    cand_c0, cand_cp = runtime.logits(items, cp_paths)
    cfg = reference.cfg
    allowed = ~codebook0_logits_mask(cfg, cfg.codec_vocab_size, ref_c0.device)
    c0_paths = {"few rows": cand_c0}
    for name, rows in (talker_paths or {}).items():
        c0_paths[name] = runtime.codebook0_logits(items, rows)
    c0_agree = {name: Agreement.of(ref_c0[:, allowed], lg[:, allowed].to(ref_c0.device))
                for name, lg in c0_paths.items()}  # fmt: skip
    c0 = _worst(c0_agree, min_top1, max_kl)
    paths = {path: Agreement.of(ref_cp, lg.to(ref_cp.device)) for path, lg in cand_cp.items()}
    worst = _worst(paths, min_top1, max_kl)
    c0_ok, cp_ok = c0.passes(min_top1, max_kl), worst.passes(min_top1, max_kl)
    return QualityReport(
        codebook0_top1_agreement=c0.top1_agreement,
        codebook0_mean_kl=c0.mean_kl,
        codebook0_max_kl=c0.max_kl,
        code_predictor_top1_agreement=worst.top1_agreement,
        code_predictor_mean_kl=worst.mean_kl,
        code_predictor_max_kl=worst.max_kl,
        code_predictor_paths={k: asdict(a) for k, a in paths.items()},
        texts=len(items),
        codebook0_positions=c0.positions,
        code_predictor_positions=worst.positions,
        min_top1=min_top1,
        max_kl=max_kl,
        codebook0_passed=c0_ok,
        code_predictor_passed=cp_ok,
        passed=c0_ok and cp_ok,
        compute_dtype=str(reference.talker.codec_head.weight.dtype).removeprefix("torch."),
        random_weights=reference.length_rule is not None,
        reference_sharpness={"codebook0": sharpness(ref_c0[:, allowed]),
                             "codebooks_1_15": sharpness(ref_cp)},
        codebook0_paths={k: asdict(a) for k, a in c0_agree.items()} if talker_paths else {},
    )
