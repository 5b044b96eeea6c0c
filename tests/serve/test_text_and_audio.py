"""The WebSocket segmenter and the audio helpers."""

from __future__ import annotations

import numpy as np

from ttsbuild.serve.audio import SilenceTrimmer, pcm16, wav_header
from ttsbuild.serve.config import FRAME_SAMPLES
from ttsbuild.serve.segmenter import Segmenter


def feed(text: str, piece: int = 3) -> list[str]:
    seg = Segmenter()
    out = []
    for i in range(0, len(text), piece):
        out += seg.append(text[i : i + piece])
    if (rest := seg.flush()) is not None:
        out.append(rest)
    return out


def test_segments_cut_at_sentences_then_clauses_then_word_limits():
    assert feed("Hello there. How are you? Fine") == ["Hello there.", "How are you?", "Fine"]
    # the first segment cuts early at a clause; later ones need six words before a comma
    assert feed("Well, I think so, and you, my friend, what do you say about it, really") == [
        "Well, I think so,", "and you, my friend, what do you say about it,", "really",
    ]  # fmt: skip
    words = " ".join(f"w{i}" for i in range(50)) + " "
    first, second, *rest = feed(words)
    assert len(first.split()) == 12 and len(second.split()) == 30
    assert " ".join([first, second, *rest]).split() == words.split()


def test_segments_keep_every_character_in_order():
    text = "Dr. Smith paid $3.50, then left!  Quietly… she said: “no”. 你好。再见！"
    assert "".join(feed(text, 1)).replace(" ", "") == text.replace(" ", "")


def test_pcm16_and_wav_header():
    pcm = pcm16(np.array([0.0, 1.0, -1.0, 2.0], dtype=np.float32))
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 32767, -32767, 32767]
    assert len(wav_header(10)) == 44 and wav_header(10)[40:44] == (10).to_bytes(4, "little")


def test_trimmer_drops_the_bootstrap_frame_then_finds_the_onset():
    loud = np.full(FRAME_SAMPLES, 0.5, np.float32)
    quiet = np.full(FRAME_SAMPLES, 1e-4, np.float32)
    t = SilenceTrimmer(FRAME_SAMPLES)
    assert len(t(np.concatenate([loud, loud]))) == FRAME_SAMPLES  # only the first frame goes
    assert len(t(loud)) == FRAME_SAMPLES
    onset = SilenceTrimmer(FRAME_SAMPLES, onset_dbfs=-45)
    assert len(onset(loud)) == 0  # the bootstrap frame
    assert len(onset(quiet)) == 0  # still silent
    assert len(onset(np.concatenate([quiet[:480], loud]))) == FRAME_SAMPLES
    assert len(onset(quiet)) == FRAME_SAMPLES  # onset found: nothing more is trimmed
    capped = SilenceTrimmer(0, onset_dbfs=-45, max_trim_s=0.1)
    assert len(capped(quiet)) == 0 and len(capped(quiet)) == FRAME_SAMPLES  # gave up trimming
