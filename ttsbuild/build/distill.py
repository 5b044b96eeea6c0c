"""`ttsbuild distill-draft`: train draft heads on the target's own outputs (`runtime.draft`).

1. Generate with the target (the reference loop, the published sampling settings, a fixed
   seed) over a text set, recording each frame's talker hidden state and codes.
2. Teacher-force the code predictor on those codes: its final-norm hidden state h_d at every
   depth d and its sampling distribution p_c (temperature / top-k / top-p) of every codebook.
3. Fit draft head c, initialised from the target's head c (= the self-speculative draft),
   so that softmax(head_c(h_d) / T) matches p_c for every depth d in c - window .. c - 1:
   the KL(p_c || q) that speculative sampling's acceptance sum_v min(p_c, q) rewards.
Every `eval_every` steps the expected acceptance per drafted depth on held-out frames is
measured (exactly: sum_v min(p, q) with q processed as the runtime processes it) and a
resumable checkpoint (heads, Adam state, step; safetensors) is written; the recorded data is
cached beside it, so a resumed run continues where it stopped with the same result.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ttsbuild.generation.generate import ReferenceModel, generate_codes
from ttsbuild.generation.prompt import build_prompt
from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.runtime.cp_spec import target_probs
from ttsbuild.runtime.draft import write_draft


@dataclass(frozen=True)
class DistillConfig:
    window: int = 4  # drafted depths trained for (the largest window it will serve)
    steps: int = 2000
    batch_frames: int = 256  # frames per step
    lr: float = 1e-4  # the heads start at the target's: small steps (1e-3 overfits a small set)
    eval_every: int = 100
    num_texts: int = 64
    max_frames: int = 64  # per text
    held_out: float = 0.1  # fraction of frames kept for the acceptance evaluation
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.window <= 8:
            raise ValueError(f"window must be 1..8, got {self.window}")
        if self.steps < 1 or self.batch_frames < 1 or self.eval_every < 1:
            raise ValueError("steps, batch frames and eval every must be positive")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be in (0, 1), got {self.held_out}")


class _Recorder(ReferenceModel):
    """The reference model, keeping each frame's code-predictor inputs and its codes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.frames: list[tuple[torch.Tensor, torch.Tensor]] = []

    def complete_frames(self, hidden, c0, sampling, seeds, frames):
        codes = super().complete_frames(hidden, c0, sampling, seeds, frames)
        self.frames.append((hidden.float().cpu(), codes.cpu()))
        return codes


@torch.no_grad()
def record_frames(models, texts: list[str], cfg: DistillConfig, on_frames=None) -> dict:
    """Generate with the target; returns {"hidden": [N, talker H], "codes": [N, G]}."""
    from ttsbuild.calibration.corpus import requests_for

    reqs = requests_for(models, texts, cfg.seed, cfg.max_frames)
    prompts = [build_prompt(models.talker, models.prompt_spec(r)) for r in reqs]
    params = [models.generation_params(r) for r in reqs]
    rule = models.length_rule
    targets = [min(rule.frames_for(r.text, r.language), cfg.max_frames) if rule else None
               for r in reqs]  # fmt: skip
    longest = max(p.embeds.shape[0] for p in prompts) + cfg.max_frames + 1
    hidden, codes = [], []
    for start in range(0, len(reqs), 8):
        sl = slice(start, start + 8)
        ref = _Recorder(models.talker, models.code_predictor, len(prompts[sl]), longest)
        generate_codes(ref, prompts[sl], params[sl], [r.seed for r in reqs[sl]], targets[sl],
                       on_frames=(lambda s, a, c: on_frames(len(a))) if on_frames else None)
        hidden += [h for h, _ in ref.frames]
        codes += [c for _, c in ref.frames]
    codes = torch.cat(codes)
    keep = codes[:, 0] < models.cfg.codebook_size  # EOS frames carry no codes to learn
    return {"hidden": torch.cat(hidden)[keep], "codes": codes[keep]}


@torch.no_grad()
def teacher_force(models, data: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target code predictor on recorded frames: final-norm hidden [N, G, Hc] at
    positions 0..G-1 and the logits [N, G - 1, V] of codebooks 1..G-1."""
    cp, talker = models.code_predictor, models.talker
    G = models.cfg.num_code_groups
    dtype = cp.lm_head[0].weight.dtype
    hs, logits = [], []
    for start in range(0, data["codes"].shape[0], 256):
        codes = data["codes"][start : start + 256].to(device)
        N = codes.shape[0]
        x = [data["hidden"][start : start + 256].to(device, dtype), talker.embed_codec(codes[:, 0])]
        x += [cp.embed_codes(c, codes[:, c]) for c in range(1, G - 1)]
        cache = cp.new_cache(N, dtype, device)
        positions = torch.arange(G, device=device)[None].expand(N, G)
        h = cp.model(cp.small_to_mtp_projection(torch.stack(x, 1)), cache,
                     torch.arange(N, device=device), positions)  # fmt: skip
        hs.append(h.float())
        logits.append(torch.stack([cp.lm_head[c - 1](h[:, c]).float() for c in range(1, G)], 1))
    return torch.cat(hs), torch.cat(logits)


def _sampling(models, n: int, device) -> SamplingBatch:
    from ttsbuild.generation.generate import GenerationParams

    p = GenerationParams.from_generation_config(models.generation_config).code_predictor
    return SamplingBatch.from_params([p] * n, device)


def draft_logits(heads: torch.Tensor, h: torch.Tensor, offset: int) -> torch.Tensor:
    """Logits [N, G - 1 - offset, V] of codebooks c = d + offset from depths d = 1.. ."""
    G1 = heads.shape[0]
    sources = h[:, 1 : G1 + 1 - offset]  # depths 1..G-1-offset
    return torch.einsum("ndh,dvh->ndv", sources, heads[offset:])


def acceptance(heads, h, p, sampling_of, window: int) -> list[float]:
    """Expected acceptance sum_v min(p, q) per drafted depth (offset 1..window)."""
    out = []
    for t in range(1, window + 1):
        logits = draft_logits(heads, h, t)  # [N, D, V]
        if logits.shape[1] == 0:
            break
        q = target_probs(logits, sampling_of(logits.shape[0]))
        out.append(float(torch.minimum(p[:, t:], q).sum(-1).mean()))
    return out


class Distiller:
    """The training state: heads, optimiser, step; saved and resumed as safetensors."""

    def __init__(self, models, cfg: DistillConfig, h, logits, device):
        self.models, self.cfg, self.device = models, cfg, device
        n = h.shape[0]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
        held = max(1, int(n * cfg.held_out))
        self.eval_idx, self.train_idx = perm[:held], perm[held:]
        if self.train_idx.numel() == 0:
            raise ValueError(f"{n} recorded frames are too few to train on; add texts")
        self.h, self.logits = h.to(device), logits.to(device)
        cp = models.code_predictor
        init = torch.stack([head.weight.detach().float() for head in cp.lm_head]).to(device)
        self.initial_heads = init  # the target's own: the self-speculative draft
        self.heads = torch.nn.Parameter(init.clone())
        self.opt = torch.optim.Adam([self.heads], lr=cfg.lr)
        self.step = 0
        params = _sampling(models, 1, device)
        self.temperature = float(params.temperature[0])
        self.p = self._probs(self.logits)

    def sampling_of(self, n: int) -> SamplingBatch:
        return _sampling(self.models, n, self.device)

    def _probs(self, logits):
        return target_probs(logits, self.sampling_of(logits.shape[0]))

    def train_step(self) -> float:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step)
        pick = torch.randint(0, self.train_idx.numel(), (self.cfg.batch_frames,), generator=g)
        rows = self.train_idx[pick].to(self.device)
        h, p = self.h[rows], self.p[rows]
        loss = 0.0
        for t in range(1, self.cfg.window + 1):
            logits = draft_logits(self.heads, h, t) / self.temperature
            if logits.shape[1] == 0:
                break
            target = p[:, t:]  # codebooks c = d + t, d >= 1
            logq = torch.log_softmax(logits, -1)
            loss = loss + (target * (torch.log(target.clamp(min=1e-12)) - logq)).sum(-1).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self, heads=None) -> list[float]:
        rows = self.eval_idx.to(self.device)
        heads = self.heads.detach() if heads is None else heads
        return acceptance(heads, self.h[rows], self.p[rows], self.sampling_of, self.cfg.window)

    def save(self, path: Path) -> None:
        state = self.opt.state[self.heads]
        tensors = {"heads": self.heads.detach().cpu().contiguous()}
        if state:
            tensors |= {"exp_avg": state["exp_avg"].cpu(), "exp_avg_sq": state["exp_avg_sq"].cpu()}
        meta = {"step": str(self.step), "config": json.dumps(asdict(self.cfg))}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        saved = json.loads(meta["config"])
        ours = asdict(self.cfg)
        differ = [k for k in ours if k != "steps" and saved.get(k) != ours[k]]
        if differ:
            raise ValueError(f"checkpoint {path} was made with other settings ({', '.join(differ)}"
                             "); start over without --resume or use the same settings")
        t = load_file(str(path), device=str(self.device))
        with torch.no_grad():
            self.heads.copy_(t["heads"])
        self.step = int(meta["step"])
        if "exp_avg" in t:
            self.opt.state[self.heads] = {
                "step": torch.tensor(float(self.step)), "exp_avg": t["exp_avg"],
                "exp_avg_sq": t["exp_avg_sq"],
            }  # fmt: skip


def checkpoint_paths(output: Path) -> tuple[Path, Path]:
    """Where a run keeps its resumable state and its recorded data, beside the draft."""
    return output.with_name(output.name + ".state"), output.with_name(output.name + ".data")


def distill_draft(models, output: Path, cfg: DistillConfig, texts: list[str], device,
                  resume: bool = False, progress=None) -> dict:  # fmt: skip
    """Train and write the draft; returns a summary (acceptance before and after)."""
    output = Path(output)
    state_path, data_path = checkpoint_paths(output)
    progress = progress or _Silent()
    if resume and data_path.is_file():
        data = load_file(str(data_path))
    else:
        data = record_frames(models, texts, cfg, on_frames=progress.frames)
        save_file(data, str(data_path))
    h, logits = teacher_force(models, data, device)
    run = Distiller(models, cfg, h, logits, device)
    if resume and state_path.is_file():
        run.load(state_path)
    initial = run.evaluate(run.initial_heads)
    progress.start(cfg.steps, run.step)
    latest = run.evaluate()
    while run.step < cfg.steps:
        loss = run.train_step()
        if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
            latest = run.evaluate()
            run.save(state_path)
        progress.step(loss, latest)
    write_draft(output, run.heads.detach().to(torch.float32), models.cfg, cfg.window,
                steps=str(run.step), frames=str(h.shape[0]),
                acceptance=json.dumps([round(a, 4) for a in latest]),
                self_acceptance=json.dumps([round(a, 4) for a in initial]))  # fmt: skip
    return {"frames": h.shape[0], "steps": run.step, "self_speculative": initial,
            "acceptance": latest}  # fmt: skip


class _Silent:
    def frames(self, n: int) -> None: ...
    def start(self, total: int, done: int) -> None: ...
    def step(self, loss: float, acceptance: list[float]) -> None: ...
