"""Reference clip -> cloned voice: the x-vector and the reference codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttsbuild.generation.prompt import VoiceClone, reference_text
from ttsbuild.model.codec_encoder import CodecEncoder, CodecEncoderConfig
from ttsbuild.model.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
from ttsbuild.voices.clip import Clip

MAX_TRANSCRIPT_CHARS = 1000


@dataclass(frozen=True)
class ClonedVoice:
    """What is kept of a clip: never the audio itself."""

    x_vector: torch.Tensor  # [hidden] float32
    ref_codes: torch.Tensor  # [frames, 16] int64
    transcript: str | None  # None: x-vector-only mode

    def prompt_clone(self, tokenizer) -> VoiceClone:
        """The prompt's view: in-context with a transcript, x-vector only without."""
        if self.transcript is None:
            return VoiceClone(self.x_vector)
        ids = tokenizer.encode(reference_text(self.transcript))
        return VoiceClone(self.x_vector, self.ref_codes, ids)


def check_transcript(transcript: str | None) -> str | None:
    """None or a non-blank transcript of sane length (ValueError otherwise)."""
    if transcript is None:
        return None
    text = transcript.strip()
    if not text:
        return None
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise ValueError(f"the transcript is longer than {MAX_TRANSCRIPT_CHARS} characters")
    return text


class VoiceEncoder:
    """The speaker encoder and codec encoder of a Base checkpoint, in fp32 on one device."""

    def __init__(self, speaker: SpeakerEncoder, codec: CodecEncoder):
        self.speaker = speaker.float().eval()
        self.codec = codec.float().eval()

    @classmethod
    def from_tensors(cls, config: dict, codec_config: dict, speaker_tensors: dict,
                     codec_tensors: dict, device: str | torch.device = "cpu") -> VoiceEncoder:
        speaker = SpeakerEncoder(SpeakerEncoderConfig.from_official(config))
        speaker.load_state_dict(speaker_tensors, strict=True)
        codec = CodecEncoder(CodecEncoderConfig.from_official(codec_config))
        codec.load_official(codec_tensors)
        return cls(speaker.to(device), codec.to(device))

    @classmethod
    def random(cls, config: dict, codec_config: dict, device: str | torch.device = "cpu",
               seed: int = 0) -> VoiceEncoder:
        """Random weights of the real shapes (in-memory stand-ins for load tests)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            speaker = SpeakerEncoder(SpeakerEncoderConfig.from_official(config))
            codec = CodecEncoder(CodecEncoderConfig.from_official(codec_config))
            for name, buf in codec.named_buffers():
                if name.endswith("embed_sum"):  # all-zero codebooks would give one code
                    buf.normal_()
        return cls(speaker.to(device), codec.to(device))

    @property
    def x_vector_size(self) -> int:
        return self.speaker.cfg.enc_dim

    @torch.no_grad()
    def encode(self, clip: Clip, transcript: str | None) -> ClonedVoice:
        device = self.speaker.fc.weight.device
        wav = torch.from_numpy(clip.wav)[None].to(device)  # [1, N]
        return ClonedVoice(
            x_vector=self.speaker.embed(wav)[0].float().cpu(),
            ref_codes=self.codec(wav)[0].cpu(),
            transcript=check_transcript(transcript),
        )
