"""A synthesis request as the engine sees it, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ttsbuild.generation.prompt import VoiceClone

MAX_TEXT_CHARS = 4096


class RequestError(ValueError):
    """A request the model cannot serve: the message is safe to show the client."""


@dataclass(frozen=True)
class SamplingOverrides:
    """Optional per-request overrides of generation_config.json (None = checkpoint default)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    subtalker_do_sample: bool | None = None


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    voice: str | None = None
    language: str = "auto"
    instruct: str | None = None
    non_streaming: bool | None = None  # None: the model's default text mode
    seed: int | None = None  # None: drawn at admission (reported back)
    max_frames: int | None = None
    sampling: SamplingOverrides = SamplingOverrides()
    # Base checkpoints: the cloned voice (resolved at the edge from a clip or a registered
    # voice; `voice` then names it for logs and errors only).
    clone: VoiceClone | None = None

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise RequestError("input text is empty")
        if len(self.text) > MAX_TEXT_CHARS:
            raise RequestError(f"input text is longer than {MAX_TEXT_CHARS} characters")
        if self.max_frames is not None and self.max_frames < 1:
            raise RequestError("max_frames must be >= 1")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed must be in [0, 2^63)")
