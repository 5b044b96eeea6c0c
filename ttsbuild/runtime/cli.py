"""`ttsbuild synth`: text in, a 24 kHz PCM16 WAV out, with a progress bar and a summary."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

_err = Console(stderr=True)


def synth(
    checkpoint: Path = typer.Argument(..., help="Converted checkpoint (or compiled engine) dir."),
    text: str = typer.Argument(..., help="The text to speak."),
    output: Path = typer.Option(Path("out.wav"), "--output", "-o", help="WAV file to write."),
    voice: str = typer.Option(None, "--voice", help="Preset voice (CustomVoice), e.g. ryan."),
    ref_audio: Path = typer.Option(
        None, "--ref-audio", help="Base models: a 1-30 s clip of the voice to clone "
        "(WAV, FLAC, OGG or MP3; any sample rate)."
    ),
    ref_text: str = typer.Option(
        None, "--ref-text", help="Transcript of --ref-audio: clones in context (closer to the "
        "clip); without it only the speaker embedding is used."
    ),
    language: str = typer.Option("auto", "--language", help="Language name, or auto."),
    instruct: str = typer.Option(None, "--instruct", help="Style instruction (1.7B models)."),
    seed: int = typer.Option(None, "--seed", help="Seed; the same seed repeats the audio."),
    max_frames: int = typer.Option(None, "--max-frames", min=1, help="Stop after N frames."),
    non_streaming: bool = typer.Option(
        None, "--non-streaming/--streaming-text", help="Text mode (default: the model's)."
    ),
    temperature: float = typer.Option(None, "--temperature", help="Codebook-0 temperature."),
    top_k: int = typer.Option(None, "--top-k", help="Codebook-0 top-k (0 = off)."),
    top_p: float = typer.Option(None, "--top-p", help="Codebook-0 top-p."),
    repetition_penalty: float = typer.Option(None, "--repetition-penalty"),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax decoding for every codebook."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda if present)."),
) -> None:
    """Synthesize TEXT to a WAV file."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ttsbuild.convert.checkpoint import CheckpointError
    from ttsbuild.runtime.engine import SAMPLE_RATE, synthesize
    from ttsbuild.runtime.loader import open_engine
    from ttsbuild.runtime.request import RequestError, SamplingOverrides, SynthesisRequest
    from ttsbuild.runtime.wav import write_wav

    if output.exists() and output.is_dir():
        raise typer.BadParameter(f"{output} is a directory", param_hint="--output")
    if not output.parent.exists():
        raise typer.BadParameter(f"directory {output.parent} does not exist", param_hint="--output")
    try:
        sampling = SamplingOverrides(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            do_sample=False if greedy else None,
            subtalker_do_sample=False if greedy else None,
        )
        req = SynthesisRequest(
            text=text,
            voice=voice,
            language=language,
            instruct=instruct,
            seed=seed,
            max_frames=max_frames,
            non_streaming=non_streaming,
            sampling=sampling,
        )
        if ref_text is not None and ref_audio is None:
            raise ValueError("--ref-text needs --ref-audio")
        clip_bytes = _read_clip(ref_audio) if ref_audio is not None else None
        t0 = time.perf_counter()
        engine = open_engine(checkpoint, device=device, num_slots=1)
        if clip_bytes is not None:
            req = replace(req, clone=_clone_from_clip(engine.models, clip_bytes, ref_text))
        load_s = time.perf_counter() - t0
    except (CheckpointError, RequestError, ValueError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None

    with Progress(
        TextColumn("[bold]synthesizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("frames"),
        console=_err,
        transient=True,
    ) as bar:
        task = bar.add_task("synth", total=max_frames)

        def on_frames(done: int) -> None:
            bar.update(task, completed=done)

        t0 = time.perf_counter()
        try:
            pcm, stats = synthesize(engine, req, on_frames=on_frames)
        except RequestError as exc:
            _err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(1) from None
        wall = time.perf_counter() - t0
    tmp = output.with_name(output.name + ".partial")
    write_wav(tmp, pcm, SAMPLE_RATE)
    tmp.replace(output)
    audio_s = len(pcm) / SAMPLE_RATE
    rms = float((pcm.astype("float64") ** 2).mean() ** 0.5) if len(pcm) else 0.0
    rtf = wall / max(audio_s, 1e-9)
    kind = " (random-weight stand-in)" if engine.models.manifest.get("standin") else ""
    _err.print(
        f"[green]wrote[/green] {output}{kind}\n"
        f"  frames {stats['frames']} ({stats['stopped_by']}), audio {audio_s:.2f} s, "
        f"wall {wall:.2f} s (+ load {load_s:.2f} s), real-time factor {rtf:.3f}"
        f"\n  device {engine.device}, seed {stats['seed']}, "
        f"RMS {20 * math.log10(max(rms, 1e-10)):.1f} dBFS",
        highlight=False,
    )


def _read_clip(path: Path) -> bytes:
    from ttsbuild.voices.clip import MAX_CLIP_BYTES, ClipError

    if not path.is_file():
        raise ValueError(f"--ref-audio {path} is not a file")
    if path.stat().st_size > MAX_CLIP_BYTES:
        raise ClipError(f"--ref-audio {path} is larger than {MAX_CLIP_BYTES // 2**20} MiB")
    return path.read_bytes()


def _clone_from_clip(models, clip_bytes: bytes, transcript: str | None):
    """The prompt's cloned voice from a reference clip (ValueError with the reason)."""
    from ttsbuild.voices.clip import decode_clip

    if models.voice_encoder is None:
        raise ValueError("--ref-audio needs a Base (voice-clone) checkpoint; this one is "
                         f"{models.cfg.tts_model_type}")
    clip = decode_clip(clip_bytes)
    voice = models.voice_encoder.encode(clip, transcript)
    return voice.prompt_clone(models.tokenizer)
