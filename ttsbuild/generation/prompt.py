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
against E(pad) when not). Their KV is computed once per (voice, language, instruct, text mode)
and reused by every request (runtime.prefix_cache). The reference frames after the transcript
lie against the request's own text when streaming, so they are prefilled per request.

`prompt_layout` writes the layout as ids (host only; the graph backend embeds them inside its
prefill graph); `PromptEmbedder` turns them into embeddings, on first use of `Prompt.embeds`.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ttsbuild.model.config import ModelConfig
from ttsbuild.model.talker import Talker
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.prompt_embed import (  # the layout's columns live with the kernels
    CODES,
    TEXT,
    VOICE,
    codec_track_reference,
    prompt_embed,
    text_embed,
)

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


@dataclass(frozen=True)
class PromptLayout:
    """A prompt as ids, in host memory: what `PromptEmbedder` (or the prefill graph, from the
    same ids staged) turns into the talker's input.

    Every position is P(text id) on the text track plus a codec track that is one of: nothing,
    one codec id (codebook 0's table), a whole frame (the sum of its G codebook embeddings:
    an in-context clone's reference frames) or the voice's x-vector. So a row is
    [text id, x-vector flag, code_0 .. code_{G-1}] with NO_CODE where a codebook is unused."""

    rows: torch.Tensor  # [T, 2 + groups] int64
    trailing_ids: torch.Tensor  # [N] int64 text ids of the track added at decode steps 0..N-1
    shared_prefix_len: int  # leading positions that depend on voice/language/instruct only
    x_vector: torch.Tensor | None = None  # [hidden] the voice's, where a row's flag is set
    # [F, groups] reference codes the codec decodes before the first generated frame; their
    # audio is not part of the output (in-context voice clone), else None.
    codec_context: torch.Tensor | None = None

    @property
    def num_positions(self) -> int:
        return self.rows.shape[0]

    def prefix_key(self, n: int) -> bytes:
        """Identifies the first n positions' content (their KV depends on nothing else)."""
        rows = self.rows[:n]
        digest = hashlib.blake2b(rows.numpy().tobytes(), digest_size=16)
        if self.x_vector is not None and bool(rows[:, VOICE].any()):
            digest.update(self.x_vector.detach().cpu().numpy().tobytes())
        return digest.digest()


NO_CODE = -1  # a codebook a position does not use


# The graph backend's prompt embedding on the kernels in four launches instead of ~14
# (plugins.prompt_embed: the codec track in one, the text table's gather inside fc1's, the
# SiLU, fc2 with the codec track as its residual). GPU tests pass on the H200; the engine
# bench in its own process had every prefill bucket 2-4 % lower (2026-12-05,
# benchmarks/runtime/2026-12-05-h200-new-paths/); graph vs eager with it on passed in every
# mode on an H100 (sm_90, the same kernels; benchmarks/runtime/2026-12-05-h100-checks/).
# On by default (TTSBUILD_PROMPT_EMBED_FUSED=0 turns it off).
PROMPT_EMBED_FUSED = os.environ.get("TTSBUILD_PROMPT_EMBED_FUSED", "1") == "1"


class PromptEmbedder:
    """Layout rows -> talker input embeddings: the text projection and the codebooks' input
    tables (codebook 0: the talker's codec embedding; 1..G-1: the code predictor's).
    text_mlp (text table, fc1, fc2: what embed_text computes) with stacked_rest lets the
    kernels embed a prompt in four launches (PROMPT_EMBED_FUSED)."""

    def __init__(self, embed_text, tables: list[torch.Tensor],
                 stacked_rest: torch.Tensor | None = None,
                 text_mlp: tuple | None = None):  # fmt: skip
        self.embed_text = embed_text  # ids [...] -> P(ids) [..., hidden]
        self.text_mlp = text_mlp
        self.tables = tables  # [vocab_k, hidden] per codebook (only codebook 0 without a CP)
        # tables[1:] as one [G - 1, vocab, hidden] tensor (the graph backend's stacked code
        # predictor embeddings): their rows gathered in one launch instead of one per
        # codebook, into the same [G, T, hidden] block as the per-table gathers (same bits)
        self.stacked_rest = stacked_rest
        if stacked_rest is not None:
            if stacked_rest.shape[0] != len(tables) - 1:
                raise ValueError(f"stacked_rest holds {stacked_rest.shape[0]} tables, "
                                 f"tables[1:] {len(tables) - 1}")  # fmt: skip
            self._books = torch.arange(len(tables) - 1, device=stacked_rest.device)[:, None]

    @classmethod
    def of(cls, talker: Talker, code_predictor=None) -> PromptEmbedder:
        tables = [talker.model.codec_embedding.weight]
        if code_predictor is not None:
            tables += [e.weight for e in code_predictor.model.codec_embedding]
        return cls(talker.embed_text, tables)

    def text(self, ids: torch.Tensor) -> torch.Tensor:
        """P(ids) [N, hidden]: `embed_text`, or with PROMPT_EMBED_FUSED on the kernels the text
        table's gather inside fc1's launch (the graph backend's trailing-text step)."""
        if (PROMPT_EMBED_FUSED and self.text_mlp is not None
                and want_triton(self.text_mlp[0], None)):
            return text_embed(ids, *self.text_mlp)
        return self.embed_text(ids)

    def rows(self, rows: torch.Tensor, x_vector: torch.Tensor | None) -> torch.Tensor:
        """rows [T, 2 + G] (on the tables' device) -> [T, hidden]. Fixed shapes, no host sync:
        the prefill graph runs this on its staged rows."""
        if (PROMPT_EMBED_FUSED and self.text_mlp is not None and self.stacked_rest is not None
                and want_triton(self.stacked_rest, None)):
            xv = None if x_vector is None else x_vector.to(self.stacked_rest.device,
                                                           self.stacked_rest.dtype)  # fmt: skip
            return prompt_embed(rows, *self.text_mlp, self.tables[0], self.stacked_rest, xv)
        rest = self.tables[1:] if self.stacked_rest is None else self.stacked_rest
        index = None if self.stacked_rest is None else self._books
        return self.embed_text(rows[:, TEXT]) + codec_track_reference(
            rows, self.tables[0], rest, x_vector, index)


class Prompt:
    """A prompt: its layout (ids, host) and, computed on first use, its embeddings on the
    model's device. The graph backend embeds the layout inside its prefill graph instead, so
    admission itself never touches the device."""

    def __init__(self, layout: PromptLayout, embedder: Callable[[], PromptEmbedder],
                 tts_pad_id: int):  # fmt: skip
        self.layout, self._embedder, self.tts_pad_id = layout, embedder, tts_pad_id

    @functools.cached_property
    def embedder(self) -> PromptEmbedder:
        """Built on first use: the graph backend never needs it (admission stays host-only
        and cheap)."""
        return self._embedder()

    @property
    def num_positions(self) -> int:
        return self.layout.num_positions

    @property
    def num_trailing(self) -> int:
        return self.layout.trailing_ids.shape[0]

    @property
    def shared_prefix_len(self) -> int:
        return self.layout.shared_prefix_len

    @property
    def codec_context(self) -> torch.Tensor | None:
        return self.layout.codec_context

    @functools.cached_property
    def device(self) -> torch.device:
        return self.embedder.tables[0].device

    @functools.cached_property
    def embeds(self) -> torch.Tensor:  # [T, hidden] prefill input embeddings
        with torch.no_grad():
            return self.embedder.rows(self.layout.rows.to(self.device), self.layout.x_vector)

    @functools.cached_property
    def trailing_text(self) -> torch.Tensor:  # [N, hidden] text track at decode steps 0..N-1
        with torch.no_grad():
            return self.embedder.embed_text(self.layout.trailing_ids.to(self.device))

    @functools.cached_property
    def tts_pad(self) -> torch.Tensor:  # [hidden] text track once trailing_text runs out
        with torch.no_grad():
            ids = torch.tensor([self.tts_pad_id], device=self.device)
            return self.embedder.embed_text(ids)[0]

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


def build_prompt(talker: Talker, spec: PromptSpec, code_predictor=None) -> Prompt:
    """The prompt of `spec`; its embeddings are computed when first used. An in-context clone
    also needs the code predictor (its codebook embeddings give the reference frames' inputs)."""
    clone = spec.clone
    if clone is not None and clone.in_context and code_predictor is None:
        raise PromptError("in-context cloning needs the code predictor's embeddings")
    layout = prompt_layout(talker.cfg, spec)
    embedder = functools.partial(PromptEmbedder.of, talker, code_predictor)
    return Prompt(layout, embedder, talker.cfg.text_ids.tts_pad)


def prompt_layout(cfg: ModelConfig, spec: PromptSpec) -> PromptLayout:
    """The layout of the module doc as ids: host work only, built column by column (a
    Python list per column, one array; on the path to first audio)."""
    text_ids = spec.text_ids
    if len(text_ids) <= ROLE_LEN + TAIL_LEN:
        raise PromptError("the text is empty")
    clone = spec.clone
    if clone is not None:
        _check_clone(cfg, clone)
    tid, cid, G = cfg.text_ids, cfg.codec_ids, cfg.num_code_groups
    instruct = list(spec.instruct_ids) if spec.instruct_ids and cfg.supports_instruct else []
    body = list(text_ids[ROLE_LEN:-TAIL_LEN])

    # Columns: the text id, the x-vector flag and codebook 0's id of every row; a reference
    # frame's other codebooks go in afterwards (`frames_at`).
    text = [*instruct, *text_ids[:ROLE_LEN]]
    voice = [0] * len(text)
    code0 = [NO_CODE] * len(text)

    def add(texts: list[int], code: int = NO_CODE) -> None:
        text.extend(texts)
        voice.extend([0] * len(texts))
        code0.extend([code] * len(texts))

    codec = [[c] for c in codec_prefix(cfg, spec)]
    if clone is not None:
        codec.append([])  # the x-vector's position: its row carries the flag
    codec.append([cid.pad])
    for i, c in enumerate(codec):
        text.append(tid.tts_bos if i == len(codec) - 1 else tid.tts_pad)
        voice.append(int(not c))
        code0.append(c[0] if c else NO_CODE)
    shared = len(text)

    context = frames_at = None
    if clone is not None and clone.in_context:
        context = clone.ref_codes
        ref_ids = list(clone.ref_text_ids[ROLE_LEN:-REF_TAIL_LEN])
        xs = [*ref_ids, *body, tid.tts_eos]  # X
        n = context.shape[0] + 1  # Y: the BOS frame, then the reference frames
        if spec.non_streaming:
            add(xs, cid.pad)
            add([tid.tts_pad], cid.bos)
            frames_at = len(text)
            add([tid.tts_pad] * (n - 1))
            trailing = [tid.tts_pad]
            shared += len(ref_ids)
        else:
            padded = xs[:n] + [tid.tts_pad] * (n - len(xs))
            add(padded[:1], cid.bos)
            frames_at = len(text)
            add(padded[1:])
            trailing = xs[n:] or [tid.tts_pad]
            shared += min(len(ref_ids), n)
    elif spec.non_streaming:
        add([*body, tid.tts_eos], cid.pad)
        add([tid.tts_pad], cid.bos)
        trailing = [tid.tts_pad]
    else:
        add(body[:1], cid.bos)
        trailing = [*body[1:], tid.tts_eos]
    rows = np.full((len(text), CODES + G), NO_CODE, dtype=np.int64)
    rows[:, TEXT], rows[:, VOICE], rows[:, CODES] = text, voice, code0
    if frames_at is not None:
        rows[frames_at : frames_at + context.shape[0], CODES:] = context.cpu().numpy()
    return PromptLayout(
        rows=torch.from_numpy(rows),
        trailing_ids=torch.from_numpy(np.array(trailing, dtype=np.int64)),
        shared_prefix_len=shared,
        x_vector=clone.x_vector if clone is not None else None,
        codec_context=context,
    )
