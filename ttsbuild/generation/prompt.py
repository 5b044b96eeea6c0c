"""The talker prompt (prefill) layout of the 12 Hz models.

Text ids come from "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n":
role = ids[:3], T = ids[3:-5] (the 5-token tail is never fed). Positions, in order:
  1. optional instruct: P(tokenize("<|im_start|>user\\n{instruct}<|im_end|>\\n")), text only;
  2. role: P(role);
  3. codec prefix C = [think, think_bos, lang, think_eos] (or [nothink, think_bos,
     think_eos] for auto) + [speaker] + [pad, bos]; positions C[:-1] get E(C[i]) + P(tts_pad),
     except the last of them, which gets P(tts_bos);
  4. text, non-streaming: P(T_i) + E(pad) for every i, P(tts_eos) + E(pad), P(tts_pad) + E(bos);
     trailing text = [P(tts_pad)];
     text, streaming: P(T_0) + E(bos); trailing text = P(T_1..) then P(tts_eos).
During decoding, step k adds trailing_text[k] (or P(tts_pad) once it runs out).

Base (voice clone) checkpoints put the x-vector in the speaker slot of 3. In-context mode
(reference codes R_0..R_{F-1} and the reference transcript's ids Q = ref_ids[3:-2], from
"<|im_start|>assistant\n{ref_text}<|im_end|>\n") replaces 4 with one track of text
X = P(Q) ++ P(T) ++ [P(tts_eos)] (length L) laid against one track of codes
Y = [E(bos)] ++ [sum_k emb_k(R_j) for each reference frame j] (length F + 1):
     streaming: positions X_i + Y_i for i < F + 1 (X padded with P(tts_pad) when L < F + 1);
                trailing text = X[F + 1:] (or [P(tts_pad)]);
     non-streaming: X_i + E(pad) for every i, then Y_j + P(tts_pad); trailing = [P(tts_pad)].
The codec then decodes the reference frames before the generated ones and their audio is
dropped: exactly F * 1920 samples, which streaming needs (the official code decodes both and
cuts int(F / total * samples), through float rounding one sample fewer for ~4 % of lengths).

Shared prefix. The first `Prompt.shared_prefix_len` positions depend only on the voice
(speaker or cloned voice), the language and the instruction, never on the text: instruct,
role and codec prefix; for an in-context clone also the first len(Q) positions of 4 (the
reference transcript, against bos + reference codes when streaming, at most F + 1 of them, or
against E(pad) when not). Their KV can be computed once per (voice, language, text mode) and
reused by every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttsbuild.model.config import ModelConfig
from ttsbuild.model.talker import Talker

ROLE_LEN = 3  # "<|im_start|>", "assistant", "\n"
TAIL_LEN = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


class PromptError(ValueError):
    """A request that cannot be turned into a prompt (unknown voice, language, empty text)."""


def reference_text(text: str) -> str:
    """The template of a clone's reference transcript (no trailing assistant turn)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


REF_TAIL_LEN = 2  # "<|im_end|>", "\n" after a reference transcript


@dataclass(frozen=True)
class VoiceClone:
    """A cloned voice, as the prompt uses it (see ttsbuild.voices for making one)."""

    x_vector: torch.Tensor  # [hidden] speaker-encoder output for the speaker slot
    ref_codes: torch.Tensor | None = None  # [frames, groups] int64: in-context mode
    ref_text_ids: list[int] | None = None  # tokenized reference_text(transcript)

    @property
    def in_context(self) -> bool:
        return self.ref_codes is not None


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt is built from: token ids and the voice/language choices."""

    text_ids: list[int]  # tokenized assistant_text(text)
    speaker: str | None = None
    language: str = "auto"
    instruct_ids: list[int] | None = None  # tokenized instruct_text(instruct)
    non_streaming: bool = True
    clone: VoiceClone | None = None  # Base checkpoints: the voice to clone


@dataclass
class Prompt:
    embeds: torch.Tensor  # [T, hidden] prefill input embeddings
    trailing_text: torch.Tensor  # [N, hidden] text track added at decode steps 0..N-1
    tts_pad: torch.Tensor  # [hidden] text track once trailing_text runs out
    shared_prefix_len: int = 0  # leading positions that depend on voice/language/instruct only
    # [F, groups] reference codes the codec decodes before the first generated frame; their
    # audio is not part of the output (in-context voice clone), else None.
    codec_context: torch.Tensor | None = None

    def text_track(self, step: int) -> torch.Tensor:
        if step < self.trailing_text.shape[0]:
            return self.trailing_text[step]
        return self.tts_pad


def resolve_language(cfg: ModelConfig, language: str, speaker: str | None) -> int | None:
    """Codec language id (None for auto), with the dialect-speaker rule applied."""
    lang = language.lower()
    if lang != "auto" and lang not in cfg.languages:
        known = ", ".join(["auto", *sorted(k for k in cfg.languages if "dialect" not in k)])
        raise PromptError(f"unknown language {language!r}; known: {known}")
    lang_id = None if lang == "auto" else cfg.languages[lang]
    spk = cfg.speakers.get(speaker.lower()) if speaker else None
    if spk is not None and spk.dialect and lang in ("chinese", "auto"):
        lang_id = cfg.languages[spk.dialect]
    return lang_id


def codec_prefix(cfg: ModelConfig, spec: PromptSpec) -> list[int]:
    """The codec ids of the prefix, speaker row included, before [pad, bos]."""
    ids = cfg.codec_ids
    lang_id = resolve_language(cfg, spec.language, spec.speaker)
    prefix = (
        [ids.nothink, ids.think_bos, ids.think_eos]
        if lang_id is None
        else [ids.think, ids.think_bos, lang_id, ids.think_eos]
    )
    if spec.speaker:
        spk = cfg.speakers.get(spec.speaker.lower())
        if spk is None:
            known = ", ".join(sorted(cfg.speakers)) or "none (this model has no preset voices)"
            raise PromptError(f"unknown voice {spec.speaker!r}; known: {known}")
        prefix.append(spk.codec_id)
    return prefix


def _check_clone(cfg: ModelConfig, clone: VoiceClone) -> None:
    hidden = cfg.talker.hidden_size
    if tuple(clone.x_vector.shape) != (hidden,):
        raise PromptError(f"the voice's x-vector has shape {tuple(clone.x_vector.shape)}, this "
                          f"model needs ({hidden},): it was made for another model size")
    if clone.ref_codes is None:
        return
    codes = clone.ref_codes
    if codes.dim() != 2 or codes.shape[1] != cfg.num_code_groups or codes.shape[0] < 1:
        raise PromptError(f"reference codes must be [frames, {cfg.num_code_groups}], "
                          f"got {tuple(codes.shape)}")
    if codes.dtype != torch.int64 or int(codes.min()) < 0 or int(codes.max()) >= cfg.codebook_size:
        raise PromptError(f"reference codes must be int64 in [0, {cfg.codebook_size})")
    if not clone.ref_text_ids or len(clone.ref_text_ids) <= ROLE_LEN + REF_TAIL_LEN:
        raise PromptError("in-context cloning needs the reference clip's transcript")


@torch.no_grad()
def build_prompt(talker: Talker, spec: PromptSpec, code_predictor=None) -> Prompt:
    """The prefill embeddings of `spec`. An in-context clone also needs the code predictor
    (its codebook embeddings give the reference frames' inputs)."""
    cfg = talker.cfg
    text_ids = spec.text_ids
    if len(text_ids) <= ROLE_LEN + TAIL_LEN:
        raise PromptError("the text is empty")
    clone = spec.clone
    if clone is not None:
        _check_clone(cfg, clone)
        if clone.in_context and code_predictor is None:
            raise PromptError("in-context cloning needs the code predictor's embeddings")
    device = talker.codec_head.weight.device
    tid = cfg.text_ids
    instruct = list(spec.instruct_ids) if spec.instruct_ids and cfg.supports_instruct else []
    body_ids = list(text_ids[ROLE_LEN:-TAIL_LEN])
    in_context = clone is not None and clone.in_context
    ref_ids = list(clone.ref_text_ids[ROLE_LEN:-REF_TAIL_LEN]) if in_context else []
    prefix = codec_prefix(cfg, spec)
    # One host-to-device copy and one embedding pass for every text token, one for the codec
    # ids: a request's admission is a handful of kernels, not dozens.
    all_text = [tid.tts_bos, tid.tts_eos, tid.tts_pad, *instruct, *text_ids[:ROLE_LEN],
                *body_ids, *ref_ids]  # fmt: skip
    codec_ids = [*prefix, cfg.codec_ids.pad, cfg.codec_ids.bos]
    ids = torch.tensor([*all_text, *codec_ids], dtype=torch.long).to(device)
    text_emb = talker.embed_text(ids[: len(all_text)])
    codec_all = talker.embed_codec(ids[len(all_text) :])
    tts_bos, tts_eos, tts_pad = text_emb[0], text_emb[1], text_emb[2]
    i_end = 3 + len(instruct)
    r_end = i_end + ROLE_LEN
    b_end = r_end + len(body_ids)
    parts = [text_emb[3:i_end]] if instruct else []
    parts.append(text_emb[i_end:r_end])

    prefix_emb = codec_all[: len(prefix)]
    if clone is not None:
        x_vector = clone.x_vector.to(device=device, dtype=prefix_emb.dtype)
        prefix_emb = torch.cat([prefix_emb, x_vector[None]])
    pad_bos = codec_all[len(prefix) :]
    codec_emb = torch.cat([prefix_emb, pad_bos])  # [C, hidden]
    n_prefix = codec_emb.shape[0] - 1
    text_track = torch.cat([tts_pad.expand(n_prefix - 1, -1), tts_bos[None]])
    parts.append(codec_emb[:-1] + text_track)
    shared = sum(p.shape[0] for p in parts)

    body = text_emb[r_end:b_end]  # [n_text, hidden]
    bos = codec_emb[-1]
    e_pad = pad_bos[0]
    context = None
    if clone is not None and clone.in_context:
        context = clone.ref_codes.to(device)
        ref_text = text_emb[b_end:]
        text = torch.cat([ref_text, body, tts_eos[None]])  # X: [L, hidden]
        codes = reference_frame_embeds(talker, code_predictor, context)  # [F, hidden]
        codec = torch.cat([bos[None], codes])  # Y: [F + 1, hidden]
        if spec.non_streaming:
            parts += [text + e_pad, codec + tts_pad]
            trailing = tts_pad[None]
            shared += ref_text.shape[0]
        else:
            n = codec.shape[0]
            if text.shape[0] > n:
                parts.append(text[:n] + codec)
                trailing = text[n:]
            else:
                pad = tts_pad.expand(n - text.shape[0], -1)
                parts.append(torch.cat([text, pad]) + codec)
                trailing = tts_pad[None]
            shared += min(ref_text.shape[0], n)
    elif spec.non_streaming:
        parts.append(torch.cat([body, tts_eos[None]]) + e_pad)
        parts.append((tts_pad + bos)[None])
        trailing = tts_pad[None]
    else:
        parts.append((body[0] + bos)[None])
        trailing = torch.cat([body[1:], tts_eos[None]])
    return Prompt(embeds=torch.cat(parts), trailing_text=trailing, tts_pad=tts_pad,
                  shared_prefix_len=shared, codec_context=context)


def reference_frame_embeds(talker: Talker, code_predictor, codes: torch.Tensor) -> torch.Tensor:
    """codes [F, groups] -> [F, hidden]: each frame's summed codebook embeddings (the input a
    generated frame gives the next talker step)."""
    embeds = [talker.embed_codec(codes[:, 0])]
    embeds += [code_predictor.embed_codes(k, codes[:, k]) for k in range(1, codes.shape[1])]
    return torch.stack(embeds).sum(0)
