"""Guards that end a generation which will not end by itself: a frame budget from the text,
a detector of code loops and a detector of long silence after speech.

Real checkpoints stop at EOS, but users of every Qwen3-TTS server report generations that
never do: short inputs running to the length cap with garbled audio, repeated phrases, long
trailing silence. One such request holds a slot (and a listener) for minutes. Three guards:

1. Text budget (host, at admission): frames = 12.5 * max(floor_s, margin * expected_s + pad_s),
   where expected_s comes from the speaking-rate model below. The same model gives a stand-in
   its length (the expected length itself), so stand-ins speak for as long as real speech of
   that text would last, and always finish inside their budget.
2. Repetition (device, in the frame step): a ring of each slot's last codebook-0 codes; the
   slot loops when, for some period p <= max_period, at least `repetition_match` of the last
   `repetition_window` codes equal the code p frames earlier. Codebook 0 is the semantic
   codebook: a stuck model repeats it (one code: a held sound or a frozen frame; p codes: an
   n-gram / phrase loop), whereas codebooks 1..15 are re-sampled every frame and rarely repeat.
3. Silence (device, in the codec step; read by the next frame step): per frame of decoded
   audio the DC-removed power; a slot that has produced speech (a frame above silence_dbfs)
   and then `silence_s` of frames below it is stopped. We measure the PCM, not the codes:
   which codes decode to silence is learned by each checkpoint and not documented, and we have
   no real weights to calibrate a code set against, while the PCM is what the listener hears
   and is computed anyway; the reduction over 1920 samples costs next to nothing beside the
   codec. The silence state is written by the codec step and read by the frame step, so a stop
   comes at most one audio chunk late (on separate streams, a read may see the previous
   chunk's value: one chunk later still).

The device guards are batched functions over per-slot state tensors (`GuardState`, indexed by
slot like the engine's other buffers): fixed shapes, no host sync, safe inside a captured CUDA
graph. The frame step returns one stop code per row (CONTINUE, EOS, REPETITION, SILENCE), which
the host reads with the frame's codes; limits (text budget, max_frames, the stand-in length
rule) are frame counts the host already knows. On the GPU each of the two device guards
(`frame_stop_codes`, `observe_audio`) is one Triton launch (`ttsbuild.plugins.guard_kernels`);
the eager code here is their reference.

Speaking rates (characters of text -> seconds of read speech). Sources:
- English: audiobooks are read at 150-160 words per minute (publishers' guideline; the US
  National Center for Voice and Speech gives ~150 wpm for conversation), see
  https://www.lisabmarshall.com/2014/01/23/how-fast-do-i-speak-update/ and
  https://www.promptvo.com/blogs/whats-an-average-speaking-rate-how-many-words-per-minute-wpm-is-average-when-reading-an-audiobook-or-giving-a-presentation
  (130-160 wpm). Words in running English text average 4.95 letters (Leipzig corpus,
  frequency-weighted: https://rosschurchley.com/2007/most-english-words-are-short), so with
  a space per word 155 wpm is 155 * 5.95 / 60 = 15.4 characters per second; we use 15.
  Other alphabetic languages use the same figure: Pellegrino et al. find that languages
  convey text at similar rates (fast syllables carry less each), and the margin covers the
  rest.
- Mandarin: 5.18 syllables per second, Japanese: 7.84 syllables (morae) per second, read
  texts, F. Pellegrino, C. Coupe, E. Marsico, "A cross-language perspective on speech
  information rate", Language 87(3), 2011 (same study: English 6.19, Spanish 7.82). A Chinese
  character is one syllable; a kana is one mora; a kanji read in Japanese is taken as two
  morae (an assumption: on-readings are mostly one or two morae).
- Korean: we found no published syllable rate; a Hangul block is one syllable and we use
  6.5 per second, between Mandarin and Japanese above and inside the 4-9 syllables per second
  that C. Coupe et al., Science Advances 5(9), 2019, report across 17 languages incl. Korean.
- Digits are read as words ("7" -> "seven", "1995" -> "nineteen ninety-five"): 4 letters each.
"""

from __future__ import annotations

import functools
import math
import unicodedata
from dataclasses import dataclass
from enum import IntEnum, StrEnum

import torch

from ttsbuild.plugins._dispatch import want_triton

FRAMES_PER_SECOND = 12.5  # the 12 Hz codec: 1920 samples of 24 kHz audio per frame
SAMPLES_PER_FRAME = 1920

LATIN_CHARS_PER_S = 15.0
MANDARIN_SYLLABLES_PER_S = 5.18
JAPANESE_MORAE_PER_S = 7.84
KANJI_MORAE = 2.0
KOREAN_SYLLABLES_PER_S = 6.5
DIGIT_LETTERS = 4.0


class StopReason(StrEnum):
    """Why a generation ended (reported to clients and counted in metrics)."""

    EOS = "eos"  # the model chose to stop
    TEXT_BUDGET = "text_budget"  # frames allowed by the text's length ran out
    REPETITION = "repetition"  # codebook 0 looped
    SILENCE = "silence"  # near-silent audio after speech for too long
    MAX_FRAMES = "max_frames"  # the request's max_frames, the engine's context or config cap
    LENGTH_RULE = "length_rule"  # a stand-in reached its length rule
    CANCEL = "cancel"  # the client cancelled or went away


class StopCode(IntEnum):
    """Per-row result of the device frame step (one int64 next to the frame's codes)."""

    CONTINUE = 0
    EOS = 1
    REPETITION = 2
    SILENCE = 3

    @property
    def reason(self) -> StopReason | None:
        return None if self is StopCode.CONTINUE else StopReason[self.name]


@dataclass(frozen=True)
class GuardConfig:
    """Every guard knob with its default. Fixed when an engine is built (static shapes)."""

    # Text budget: frames = 12.5 * max(budget_floor_s, budget_margin * expected_s + budget_pad_s)
    text_budget: bool = True
    budget_margin: float = 2.5  # slow deliberate speech is ~100 wpm vs 155: 1.6x, plus pauses
    budget_pad_s: float = 1.0  # leading/trailing silence and breaths around the speech
    budget_floor_s: float = 3.0  # a one-word input may still take a slow, pausing reading
    # Repetition: >= repetition_match of the last repetition_window codebook-0 codes equal the
    # code `p` frames before, for some period 1 <= p <= repetition_max_period.
    repetition: bool = True
    repetition_max_period: int = 32  # frames (2.6 s): longest phrase loop looked for
    repetition_window: int = 50  # frames (4 s): how long a loop must last before it stops
    repetition_match: float = 0.9  # tolerate a few re-sampled codes inside a loop
    # Silence: near-silent frames (DC-removed power below silence_dbfs) after speech.
    silence: bool = True
    silence_s: float = 3.0  # longer than any natural pause; ends trailing silence early
    silence_dbfs: float = -50.0  # 0 dBFS = full scale; breath and room tone sit below speech

    def __post_init__(self):
        if self.budget_margin < 1 or self.budget_pad_s < 0 or self.budget_floor_s <= 0:
            raise ValueError("budget_margin must be >= 1, budget_pad_s >= 0, budget_floor_s > 0")
        if self.repetition_max_period < 1 or self.repetition_window < 2:
            raise ValueError("repetition_max_period must be >= 1 and repetition_window >= 2")
        if not 0 < self.repetition_match <= 1:
            raise ValueError("repetition_match must be in (0, 1]")
        if self.silence_s <= 0:
            raise ValueError("silence_s must be > 0")

    @property
    def silence_frames(self) -> int:
        return math.ceil(self.silence_s * FRAMES_PER_SECOND)

    def earliest_stop_frame(self) -> int:
        """No guard can stop a request before this frame index: frames before it are certain
        once launched (the runtime decodes them without waiting to read their stop code)."""
        earliest = [2**62]
        if self.repetition:
            earliest.append(self.repetition_window)
        if self.silence:
            earliest.append(self.silence_frames + 1)  # an audible frame, then the silence
        return min(earliest)

    @property
    def repetition_matches(self) -> int:
        return math.ceil(self.repetition_match * self.repetition_window)


GUARDS_OFF = GuardConfig(text_budget=False, repetition=False, silence=False)


# -- speaking-rate model and the text budget (host) -----------------------------------------
def _is_kana(cp: int) -> bool:
    return 0x3040 <= cp <= 0x30FF or 0x31F0 <= cp <= 0x31FF or 0xFF66 <= cp <= 0xFF9D


def _is_han(cp: int) -> bool:
    return 0x3400 <= cp <= 0x9FFF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x3FFFF


def _is_hangul(cp: int) -> bool:
    return 0xAC00 <= cp <= 0xD7A3 or 0x1100 <= cp <= 0x11FF or 0x3130 <= cp <= 0x318F


@functools.lru_cache(maxsize=4096)
def expected_seconds(text: str, language: str = "auto") -> float:
    """Seconds a typical reader takes to read `text` aloud (see the module docstring).

    Each character adds its script's time; a run of whitespace counts as one character (the
    space between words). A Han character reads as Japanese when the language is japanese, or
    when it is auto and the text holds kana; otherwise as Mandarin. Admission asks twice per
    request (the budget and a stand-in's length rule), on the path to first audio: cached, and
    ASCII text is counted without a per-character loop."""
    words = text.split()
    if text.isascii():
        letters = sum(map(len, words))
        digits = sum(text.count(d) for d in "0123456789")
        units = max(0, len(words) - 1) + letters - digits + digits * DIGIT_LETTERS
        return units / LATIN_CHARS_PER_S
    japanese = language == "japanese" or (
        language == "auto" and any(_is_kana(ord(c)) for w in words for c in w)
    )
    han_s = KANJI_MORAE / JAPANESE_MORAE_PER_S if japanese else 1 / MANDARIN_SYLLABLES_PER_S
    seconds = max(0, len(words) - 1) / LATIN_CHARS_PER_S
    for word in words:
        for ch in word:
            cp = ord(ch)
            if _is_kana(cp):
                seconds += 1 / JAPANESE_MORAE_PER_S
            elif _is_han(cp):
                seconds += han_s
            elif _is_hangul(cp):
                seconds += 1 / KOREAN_SYLLABLES_PER_S
            elif unicodedata.category(ch) == "Nd":
                seconds += DIGIT_LETTERS / LATIN_CHARS_PER_S
            else:
                seconds += 1 / LATIN_CHARS_PER_S
    return seconds


def expected_frames(text: str, language: str = "auto") -> int:
    """Frames of the expected reading (12.5 per second), at least 1."""
    return max(1, round(FRAMES_PER_SECOND * expected_seconds(text, language)))


def text_frame_budget(text: str, language: str = "auto", cfg: GuardConfig = GuardConfig()) -> int:
    """The most frames a real checkpoint may spend on `text` before TEXT_BUDGET stops it."""
    seconds = max(cfg.budget_floor_s, cfg.budget_margin * expected_seconds(text, language)
                  + cfg.budget_pad_s)  # fmt: skip
    return math.ceil(FRAMES_PER_SECOND * seconds)


# -- device guards ---------------------------------------------------------------------------
@dataclass
class GuardState:
    """Per-slot guard state (row = slot), on the engine's device."""

    recent_c0: torch.Tensor  # [S, window + max_period] int64: last codebook-0 codes, newest last
    frames_seen: torch.Tensor  # [S] int64: codes pushed into recent_c0
    silent_frames: torch.Tensor  # [S] int64: near-silent frames since the last audible one
    heard: torch.Tensor  # [S] bool: an audible frame was decoded
    lag_index: torch.Tensor  # [max_period, window] int64: column of the code p frames earlier
    periods: torch.Tensor  # [max_period] int64: 1..max_period

    @classmethod
    def zeros(cls, num_rows: int, cfg: GuardConfig, device) -> GuardState:
        W, P = cfg.repetition_window, cfg.repetition_max_period
        ring = W + P
        periods = torch.arange(1, P + 1, device=device)
        lag_index = (ring - W) + torch.arange(W, device=device)[None, :] - periods[:, None]
        return cls(
            recent_c0=torch.zeros(num_rows, ring, dtype=torch.int64, device=device),
            frames_seen=torch.zeros(num_rows, dtype=torch.int64, device=device),
            silent_frames=torch.zeros(num_rows, dtype=torch.int64, device=device),
            heard=torch.zeros(num_rows, dtype=torch.bool, device=device),
            lag_index=lag_index,
            periods=periods,
        )

    def reset(self, rows) -> None:
        """Start new requests in `rows` (slot indices: a device tensor inside captured steps,
        where `t[rows] = 0` would copy a CPU scalar, which CUDA-graph capture refuses)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.heard.device).reshape(-1)
        for t in self.tensors():
            t.index_fill_(0, rows, 0)

    def tensors(self) -> list[torch.Tensor]:
        """The per-slot tensors a new request starts from zero (False)."""
        return [self.recent_c0, self.frames_seen, self.silent_frames, self.heard]


def push_codebook0(state: GuardState, cfg: GuardConfig, rows: torch.Tensor, c0: torch.Tensor):
    """Append each row's new codebook-0 code; returns [B] bool: the row now loops."""
    W = cfg.repetition_window
    recent = torch.cat([state.recent_c0[rows, 1:], c0[:, None]], dim=1)  # [B, W + P]
    seen = state.frames_seen[rows] + 1
    state.recent_c0[rows] = recent
    state.frames_seen[rows] = seen
    latest = recent[:, -W:]  # [B, W]
    earlier = recent[:, state.lag_index]  # [B, P, W]: the code p frames before each of them
    matches = (earlier == latest[:, None, :]).sum(-1)  # [B, P]
    complete = seen[:, None] >= W + state.periods[None, :]  # every compared code is real
    return ((matches >= cfg.repetition_matches) & complete).any(-1)


def observe_audio(
    state: GuardState,
    cfg: GuardConfig,
    rows: torch.Tensor,
    pcm: torch.Tensor,
    *,
    use_triton: bool | None = None,
):
    """Account each row's newly decoded audio, pcm [B, n * 1920] (float, full scale 1.0).

    On the GPU one Triton launch (`ttsbuild.plugins.guard_kernels`); the code below is its
    reference."""
    if want_triton(pcm, use_triton):
        from ttsbuild.plugins.guard_kernels import observe_audio_triton  # imports this module

        return observe_audio_triton(state, cfg, rows, pcm)
    B = pcm.shape[0]
    frames = pcm.float().reshape(B, -1, SAMPLES_PER_FRAME)  # [B, n, 1920]
    n = frames.shape[1]
    power = frames.var(dim=-1, unbiased=False)  # DC-removed: an offset is not sound
    audible = power >= 10.0 ** (cfg.silence_dbfs / 10)  # [B, n]
    index = torch.arange(n, device=pcm.device)
    last_audible = torch.where(audible, index, -1).amax(dim=-1)  # [B], -1: none
    heard = state.heard[rows] | (last_audible >= 0)
    run = torch.where(last_audible >= 0, n - 1 - last_audible, state.silent_frames[rows] + n)
    state.silent_frames[rows] = torch.where(heard, run, 0)
    state.heard[rows] = heard


def frame_stop_codes(
    state: GuardState | None,
    cfg: GuardConfig,
    rows: torch.Tensor,  # [B] slots
    c0: torch.Tensor,  # [B] the codebook-0 code just sampled
    eos_id: int,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[B] int64 StopCode for the frame just sampled: EOS > SILENCE > REPETITION > CONTINUE.

    A stopped row's frame is dropped by the host (as the EOS frame always was): for SILENCE
    it is more of the silence, for REPETITION one more turn of the loop. On the GPU one
    Triton launch (`ttsbuild.plugins.guard_kernels`); the code below is its reference."""
    if want_triton(c0, use_triton):
        from ttsbuild.plugins.guard_kernels import frame_stop_codes_triton  # imports this module

        return frame_stop_codes_triton(state, cfg, rows, c0, eos_id)
    code = torch.zeros_like(c0)
    if state is not None and cfg.repetition:
        code = torch.where(push_codebook0(state, cfg, rows, c0), int(StopCode.REPETITION), code)
    if state is not None and cfg.silence:
        silent = state.heard[rows] & (state.silent_frames[rows] >= cfg.silence_frames)
        code = torch.where(silent, int(StopCode.SILENCE), code)
    return torch.where(c0 == eos_id, int(StopCode.EOS), code)
