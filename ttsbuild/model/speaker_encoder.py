"""The Base checkpoints' speaker encoder: 24 kHz waveform -> 128-bin log-mel -> x-vector.

Front end (what the speaker encoder was trained on): reflect-pad (n_fft - hop) / 2 samples on
both sides, STFT (n_fft 1024, hop 256, periodic Hann window of 1024, no centering),
magnitude sqrt(re^2 + im^2 + 1e-9), a Slaney-style mel filterbank (128 bands, 0..12 kHz,
Slaney mel scale, area-normalised triangles), natural log of max(mel, 1e-5).

Encoder: ECAPA-TDNN (Desplanques et al. 2020, arXiv 2005.07143): a TDNN, SE-Res2Net blocks
with growing dilation, multi-layer feature aggregation, attentive statistics pooling, and a
1x1 conv to the talker's hidden size. Every conv is "same"-padded by reflection. Parameter
names mirror the official `speaker_encoder.*` keys (prefix removed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SAMPLE_RATE = 24000
N_FFT = 1024
HOP = 256
N_MELS = 128
F_MAX = 12000.0

# Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above.
_HZ_PER_MEL = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: Tensor) -> Tensor:
    linear = hz / _HZ_PER_MEL
    log = _BREAK_MEL + torch.log(hz.clamp(min=_BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return torch.where(hz >= _BREAK_HZ, log, linear)


def _mel_to_hz(mel: Tensor) -> Tensor:
    linear = mel * _HZ_PER_MEL
    log = _BREAK_HZ * torch.exp(_LOG_STEP * (mel - _BREAK_MEL))
    return torch.where(mel >= _BREAK_MEL, log, linear)


@lru_cache(maxsize=4)
def mel_filterbank(
    sample_rate: int = SAMPLE_RATE,
    n_fft: int = N_FFT,
    n_mels: int = N_MELS,
    f_min: float = 0.0,
    f_max: float = F_MAX,
) -> Tensor:
    """[n_mels, n_fft // 2 + 1] float32: triangles evenly spaced on the Slaney mel scale, each
    scaled by 2 / (its width in Hz) so every band has the same area ("slaney" norm).
    Built in float64, stored in float32."""
    bins = torch.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1, dtype=torch.float64)
    edges_mel = torch.linspace(
        float(_hz_to_mel(torch.tensor(f_min, dtype=torch.float64))),
        float(_hz_to_mel(torch.tensor(f_max, dtype=torch.float64))),
        n_mels + 2,
        dtype=torch.float64,
    )
    edges = _mel_to_hz(edges_mel)  # [n_mels + 2] Hz: left, centre, right of each band
    width = edges.diff()  # [n_mels + 1]
    offset = edges[:, None] - bins[None, :]  # [n_mels + 2, n_bins]
    rising = -offset[:-2] / width[:-1, None]
    falling = offset[2:] / width[1:, None]
    weights = torch.clamp(torch.minimum(rising, falling), min=0.0)
    weights = weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.to(torch.float32)


def log_mel_spectrogram(wav: Tensor) -> Tensor:
    """wav: [B, N] float at 24 kHz -> [B, frames, 128] log-mel, frames = N // 256 (N >= 384)."""
    pad = (N_FFT - HOP) // 2
    x = F.pad(wav[:, None, :], (pad, pad), mode="reflect")[:, 0]  # [B, N + 2 * pad]
    window = torch.hann_window(N_FFT, device=wav.device, dtype=wav.dtype)
    spec = torch.stft(
        x, N_FFT, hop_length=HOP, win_length=N_FFT, window=window, center=False,
        normalized=False, onesided=True, return_complex=True,
    )  # [B, n_bins, frames]
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    basis = mel_filterbank().to(device=wav.device, dtype=wav.dtype)
    mel = torch.matmul(basis, magnitude)  # [B, 128, frames]
    return torch.log(mel.clamp(min=1e-5)).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# ECAPA-TDNN
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    enc_dim: int  # x-vector size = the talker's hidden size
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    @classmethod
    def from_official(cls, config: dict) -> SpeakerEncoderConfig:
        """From a Base checkpoint's config.json (its `speaker_encoder_config`); the published
        configs give only enc_dim and sample_rate, the rest are the official defaults."""
        sc = dict(config.get("speaker_encoder_config") or {})
        if "enc_dim" not in sc:
            raise ValueError("speaker_encoder_config.enc_dim is missing")
        for key in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
            if key in sc:
                sc[key] = tuple(int(v) for v in sc[key])
        cfg = cls(**sc)
        if cfg.mel_dim != N_MELS or cfg.sample_rate != SAMPLE_RATE:
            raise ValueError(
                f"the speaker encoder front end is {N_MELS} mels at {SAMPLE_RATE} Hz; the "
                f"config asks for {cfg.mel_dim} mels at {cfg.sample_rate} Hz"
            )
        n = len(cfg.enc_channels)
        if not (n == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations)) or n < 3:
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have one "
                             "entry per block (at least 3)")
        if sum(cfg.enc_channels[1:-1]) != cfg.enc_channels[-1]:
            raise ValueError("enc_channels[-1] must be the sum of the SE-Res2Net channels "
                             "(feature aggregation concatenates them)")
        if any(c % cfg.enc_res2net_scale for c in cfg.enc_channels[1:-1]):
            raise ValueError("SE-Res2Net channels must be multiples of enc_res2net_scale")
        return cfg


def _same_conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Conv (same length, reflect padding) + ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _same_conv(cin, cout, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channels split in `scale` groups: group 0 passes through, group i > 0 goes through its
    TDNN after adding the previous group's output (a growing receptive field)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        prev = None
        for i, block in enumerate(self.blocks, start=1):
            prev = block(parts[i] if prev is None else parts[i] + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, bottleneck: int):
        super().__init__()
        self.conv1 = _same_conv(channels, bottleneck, 1)
        self.conv2 = _same_conv(bottleneck, channels, 1)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(cin, cout, 1, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout, 1, 1)
        self.se_block = SqueezeExcitation(cout, se)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted mean and std over time; weights [B, C or 1, T] sum to 1 over T."""
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean[:, :, None]).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp(min=1e-12))


class AttentiveStatsPool(nn.Module):
    """Per-channel attention over time, conditioned on the utterance's global mean and std;
    returns the attention-weighted mean and std concatenated: [B, 2C, 1]."""

    def __init__(self, channels: int, attention: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention, 1, 1)
        self.conv = _same_conv(attention, channels, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        T = x.shape[-1]
        uniform = torch.full((1, 1, T), 1.0 / T, dtype=x.dtype, device=x.device)
        mean, std = _mean_std(x, uniform)
        context = torch.cat(
            [x, mean[:, :, None].expand(-1, -1, T), std[:, :, None].expand(-1, -1, T)], dim=1
        )
        scores = self.conv(torch.tanh(self.tdnn(context)))  # [B, C, T]
        mean, std = _mean_std(x, torch.softmax(scores, dim=2))
        return torch.cat([mean, std], dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """log-mel [B, T, mel_dim] -> x-vector [B, enc_dim]."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.cfg = cfg
        self.blocks = nn.ModuleList([TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels,
                               ks[i], dil[i])
            )
        # Multi-layer feature aggregation: the SE-Res2Net outputs concatenated.
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _same_conv(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mel: Tensor) -> Tensor:
        x = mel.transpose(1, 2)  # [B, mel_dim, T]
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x))[:, :, 0]  # [B, enc_dim]

    @torch.no_grad()
    def embed(self, wav: Tensor) -> Tensor:
        """wav: [B, N] at 24 kHz -> x-vector [B, enc_dim] (the mel in the weights' dtype)."""
        dtype = self.fc.weight.dtype
        mel = log_mel_spectrogram(wav.to(device=self.fc.weight.device, dtype=torch.float32))
        return self(mel.to(dtype))
