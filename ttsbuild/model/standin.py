"""Random-weight stand-ins whose logits are as peaked as a trained model's, and as robust.

Plain N(0, 0.02) weights give near-flat logits (mean top-1 probability ~0.002 over 2048
codes), and a deep random residual stack is chaotic: a small change of any weight grows
layer by layer, so FP8 rounding flips the argmax at random (top-1 agreement 0.58 on the
1.7B stand-in). A trained model is neither: its next-code distributions are peaked and its
argmax survives weight rounding. Two scalings of the random weights give a stand-in both:

1. Heads (the talker's codec_head, the code predictor's lm_head.i): the logits' standard
   deviation is set to LOGIT_STD. A head reads the final RMSNorm's output h (norm weight 1,
   so |h|^2 = d); with iid N(0, s^2) head entries, the logits z = W h are iid N(0, s^2 d) for
   any h, so the scale fixes the whole top-1 / entropy distribution: that of `vocab` iid
   Gaussians (`expected_sharpness`). At std 6 over 2048 codes: mean top-1 probability 0.59
   (10th/50th/90th percentile 0.28 / 0.56 / 0.94), mean entropy 1.44 nats. Target: the
   middle of 0.5-0.8, the mean top-1 probability issue 9 names for a trained LM (no
   trained Qwen3-TTS logits are available here to measure; a calibrated LM's mean top-1
   probability equals its next-token accuracy, ~0.5-0.6 for LMs on text), with the spread
   of certain and uncertain positions a trained model has.
2. Residual branches (o_proj and down_proj of every layer): scaled by
   RESIDUAL_GAIN / sqrt(2 L) for a stack of L layers (2 L branches), as depth-scaled
   initialisations do to keep a deep residual stack well conditioned (GPT-2 scales residual
   layers by 1/sqrt(N); Fixup and ReZero/SkipInit start the branches near zero). Peaking the
   heads alone does not make the argmax robust: it scales the logits' error with them.
   RESIDUAL_GAIN = 0.05 is chosen so that per-channel FP8 weights change the stand-in's
   logits about as much as FP8 changes a trained LM's. Measured on the 1.7B stand-in on the
   H200 (the gate of `build.quality`: 4 texts x 32 frames, the runtime's kernels against
   the eager model): gain 0.05 gives codebook-0 mean KL 0.006-0.008 nats (top-1 agreement
   0.93-0.95, of which bf16 kernels alone cost 0.97-0.98: near-ties), gain 0.1 KL 0.020;
   the flat stand-in measured top-1 0.58. Published FP8 builds of trained LMs: top-1
   agreement 0.979 and 0.006 nats (a 33B LM, W8A8), KL 0.020 (Qwen3-1.7B, W8A8,
   WikiText-2); weight-only FP8, which is what runs here, rounds less. A broken scale still
   moves them far (benchmarks/quality/RESULTS.md).

The stand-in's length rule is untouched (EOS is never sampled for a stand-in), and codebook
0 does not fall into loops the repetition guard would stop: its argmax follows the context.
"""

from __future__ import annotations

import math
import re

import torch

LOGIT_STD = 6.0
RESIDUAL_GAIN = 0.05
INIT_STD = 0.02  # the stand-ins' base init (init-random, random_models)

# Official-layout names (init-random writes these).
_HEAD = re.compile(r"^talker\.(codec_head|code_predictor\.lm_head\.\d+)\.weight$")
_BRANCH = re.compile(
    r"^talker\.(code_predictor\.)?model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"
)


def _residual_std(num_layers: int, gain: float = RESIDUAL_GAIN) -> float:
    return INIT_STD * gain / math.sqrt(2 * num_layers)


def record(peaked: bool = True, logit_std: float = LOGIT_STD,
           residual_gain: float = RESIDUAL_GAIN) -> dict:
    """The stand-in metadata's description of its logits."""
    if not peaked:
        return {"method": "flat (plain N(0, 0.02) weights)"}
    return {
        "method": "peaked heads + depth-scaled residual branches (ttsbuild.model.standin)",
        "logit_std": logit_std,
        "residual_gain": residual_gain,
    }


def tensor_std(name: str, config: dict) -> float:
    """The init std of an official-layout stand-in tensor drawn N(0, std) (peaked)."""
    t = config["talker_config"]
    if _HEAD.match(name):
        hidden = (t["code_predictor_config"] if ".code_predictor." in name else t)["hidden_size"]
        return LOGIT_STD / math.sqrt(hidden)
    if m := _BRANCH.match(name):
        stack = t["code_predictor_config"] if m.group(1) else t
        return _residual_std(stack["num_hidden_layers"])
    return INIT_STD


@torch.no_grad()
def peak_logits(models, logit_std: float = LOGIT_STD,
                residual_gain: float = RESIDUAL_GAIN) -> dict:
    """Rescale an in-memory random stand-in (`runtime.engine.Models` with decoder layers) in
    place: heads to logit std `logit_std`, residual branches to the depth-scaled std. Each
    tensor is scaled to its target std from its own, so a second call changes nothing.
    Returns the metadata record. Refuses a real checkpoint (no length rule): its weights are
    what they are."""
    if models.length_rule is None:
        raise ValueError("peak_logits rewrites random weights: stand-ins only")
    cfg = models.cfg
    targets = [(models.talker.codec_head.weight, logit_std / math.sqrt(cfg.talker.hidden_size))]
    targets += _branches(models.talker, cfg.talker, residual_gain)
    targets += _code_predictor_targets(models.code_predictor, cfg, logit_std, residual_gain)
    _rescale(targets)
    return record(True, logit_std, residual_gain)


def peak_code_predictor(cp, cfg, logit_std: float = LOGIT_STD,
                        residual_gain: float = RESIDUAL_GAIN) -> None:
    """`peak_logits` for a random code predictor module alone (`model.CodePredictor`, e.g.
    the code-predictor benchmarks' own): its heads and residual branches as a stand-in's."""
    with torch.no_grad():
        _rescale(_code_predictor_targets(cp, cfg, logit_std, residual_gain))


def _rescale(targets: list) -> None:
    """Each weight scaled in place to its target std, from its own."""
    for w, std in targets:
        w.mul_(std / w.float().std().clamp_min(1e-12).to(w.dtype))


def _code_predictor_targets(cp, cfg, logit_std: float, residual_gain: float) -> list:
    heads = [(h.weight, logit_std / math.sqrt(cfg.code_predictor.hidden_size))
             for h in cp.lm_head]
    return heads + _branches(cp, cfg.code_predictor, residual_gain)


def _branches(module, stack, residual_gain: float) -> list:
    """(weight, target std) of each layer's residual branches (o_proj, down_proj)."""
    if len(module.model.layers) != stack.num_layers:
        raise ValueError("peak_logits needs the decoder layers (not dropped)")
    std = _residual_std(stack.num_layers, residual_gain)
    return [(w, std) for layer in module.model.layers
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]


def sharpness(logits: torch.Tensor) -> dict:
    """Mean top-1 probability and mean entropy (nats) of logits [N, vocab], with the top-1
    probability's 10th / 50th / 90th percentiles."""
    p = logits.float().softmax(-1)
    top = p.amax(-1)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    q = torch.quantile(top, torch.tensor([0.1, 0.5, 0.9], device=top.device)).tolist()
    return {
        "mean_top1_prob": round(top.mean().item(), 4),
        "mean_entropy_nats": round(entropy.mean().item(), 4),
        "top1_prob_p10_p50_p90": [round(x, 4) for x in q],
        "positions": int(logits.shape[0]),
    }


def expected_sharpness(logit_std: float = LOGIT_STD, vocab: int = 2048, samples: int = 2000,
                       seed: int = 0) -> dict:
    """`sharpness` of `samples` draws of `vocab` iid N(0, logit_std^2) logits: what a peaked
    head gives over any RMS-normalised hidden state (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    return sharpness(torch.randn(samples, vocab, generator=g) * logit_std)


def measure_sharpness(models, num_texts: int = 4, frames: int = 32, seed: int = 0) -> dict:
    """The model's own sharpness: it speaks `num_texts` shipped texts (published sampling
    settings), then its logits on those codes (teacher forcing) are summarised, codebook 0
    over the ids the sampler may draw and codebooks 1-15 together."""
    from ttsbuild.build.quality import teacher_forced_logits
    from ttsbuild.calibration.corpus import generate_corpus, load_texts
    from ttsbuild.generation.generate import codebook0_logits_mask

    items = generate_corpus(models, load_texts(None, num_texts), seed=seed, max_frames=frames)
    c0, cp = teacher_forced_logits(models, items)
    cfg = models.cfg
    allowed = ~codebook0_logits_mask(cfg, cfg.codec_vocab_size, c0.device)
    return {"codebook0": sharpness(c0[:, allowed]), "codebooks_1_15": sharpness(cp),
            "texts": num_texts, "max_frames": frames}
