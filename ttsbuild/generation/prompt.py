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


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt is built from: token ids and the voice/language choices."""

    text_ids: list[int]  # tokenized assistant_text(text)
    speaker: str | None = None
    language: str = "auto"
    instruct_ids: list[int] | None = None  # tokenized instruct_text(instruct)
    non_streaming: bool = True


@dataclass
class Prompt:
    embeds: torch.Tensor  # [T, hidden] prefill input embeddings
    trailing_text: torch.Tensor  # [N, hidden] text track added at decode steps 0..N-1
    tts_pad: torch.Tensor  # [hidden] text track once trailing_text runs out

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


@torch.no_grad()
def build_prompt(talker: Talker, spec: PromptSpec) -> Prompt:
    cfg = talker.cfg
    text_ids = spec.text_ids
    if len(text_ids) <= ROLE_LEN + TAIL_LEN:
        raise PromptError("the text is empty")
    device = talker.codec_head.weight.device
    tid = cfg.text_ids
    instruct = list(spec.instruct_ids) if spec.instruct_ids and cfg.supports_instruct else []
    body_ids = text_ids[ROLE_LEN:-TAIL_LEN]
    codec = codec_prefix(cfg, spec) + [cfg.codec_ids.pad, cfg.codec_ids.bos]
    # One host-to-device copy and one embedding pass for every text token, one for the codec
    # ids: a request's admission is a handful of kernels, not dozens.
    all_text = [tid.tts_bos, tid.tts_eos, tid.tts_pad, *instruct, *text_ids[:ROLE_LEN], *body_ids]
    ids = torch.tensor([*all_text, *codec, cfg.codec_ids.pad], dtype=torch.long).to(device)
    text_emb = talker.embed_text(ids[: len(all_text)])
    codec_emb = talker.embed_codec(ids[len(all_text) :])  # [C + 1, hidden]
    tts_bos, tts_eos, tts_pad = text_emb[0], text_emb[1], text_emb[2]
    i_end = 3 + len(instruct)
    r_end = i_end + ROLE_LEN
    parts = [text_emb[3:i_end]] if instruct else []
    parts.append(text_emb[i_end:r_end])

    e_pad = codec_emb[-1]
    codec_emb = codec_emb[:-1]
    n_prefix = len(codec) - 1
    text_track = torch.cat([tts_pad.expand(n_prefix - 1, -1), tts_bos[None]])
    parts.append(codec_emb[:-1] + text_track)

    body = text_emb[r_end:]  # [n_text, hidden]
    bos = codec_emb[-1]
    if spec.non_streaming:
        parts.append(torch.cat([body, tts_eos[None]]) + e_pad)
        parts.append((tts_pad + bos)[None])
        trailing = tts_pad[None]
    else:
        parts.append((body[0] + bos)[None])
        trailing = torch.cat([body[1:], tts_eos[None]])
    return Prompt(embeds=torch.cat(parts), trailing_text=trailing, tts_pad=tts_pad)
