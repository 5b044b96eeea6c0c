"""Onset detection, WAV parsing and the zero-buffer playback simulation, on exact inputs."""

import numpy as np
import pytest

from ttsbuild.bench.audio import (
    AudioFormat,
    BodyFormat,
    IncompleteHeader,
    audible_onset,
    chunk_end_frames,
    decode_mono,
    detect_format,
    frame_arrival_time,
    parse_wav_header,
    simulate_playback,
    window_levels_dbfs,
)
from ttsbuild.bench.fakeserver import silence, tone, wav_header

SR = 24_000


def samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float64)


def test_sine_at_minus_40_dbfs_after_300_ms_silence_has_onset_at_300_ms():
    audio = samples(silence(0.3) + tone(0.5, peak_dbfs=-40.0))
    assert audible_onset(audio, SR) == round(0.30 * SR)


def test_onset_is_none_for_pure_silence_and_for_sound_below_threshold():
    assert audible_onset(samples(silence(1.0)), SR) is None
    # peak -46 dBFS (RMS -49 dBFS): under the -45 dBFS threshold
    assert audible_onset(samples(tone(1.0, peak_dbfs=-46.0)), SR) is None


def test_single_20ms_click_is_not_sustained_sound():
    click = tone(0.02, peak_dbfs=-6.0)
    audio = samples(silence(0.2) + click + silence(0.5))
    assert audible_onset(audio, SR) is None
    # ... but the same click followed by real sound: onset at the sound, not the click
    audio = samples(silence(0.2) + click + silence(0.1) + tone(0.2, peak_dbfs=-20.0))
    assert audible_onset(audio, SR) == round(0.32 * SR)


def test_dc_offset_is_not_sound():
    dc = np.full(SR, 3000.0)  # about -21 dBFS of constant bias
    assert audible_onset(dc, SR) is None
    with_tone = dc + samples(silence(0.5) + tone(0.5, peak_dbfs=-30.0))
    assert audible_onset(with_tone, SR) == round(0.5 * SR)


def test_window_levels_report_sine_rms_in_dbfs():
    levels = window_levels_dbfs(samples(tone(0.1, peak_dbfs=-20.0, hz=500.0)), SR)
    assert len(levels) == 5
    np.testing.assert_allclose(levels, -23.01, atol=0.05)  # sine RMS = peak - 3.01 dB


def test_streaming_wav_header_is_parsed_and_skipped():
    header = wav_header(16_000)
    assert len(header) == 44
    fmt = parse_wav_header(header + b"\x00\x00")
    assert fmt == AudioFormat(sample_rate=16_000, channels=1, header_bytes=44)
    with pytest.raises(IncompleteHeader):
        parse_wav_header(header[:30])
    with pytest.raises(ValueError, match="not a RIFF"):
        parse_wav_header(b"ID3\x00" + header[4:])


def test_wav_header_with_extra_chunk_before_data():
    header = wav_header(24_000)
    # insert a 5-byte LIST chunk (padded to 6) between fmt and data
    extra = b"LIST" + (5).to_bytes(4, "little") + b"abcde\x00"
    body = header[:36] + extra + header[36:]
    assert parse_wav_header(body).header_bytes == 44 + len(extra)


def test_detect_format_auto_sniffs_riff_and_otherwise_uses_the_given_rate():
    assert detect_format(wav_header(22_050), BodyFormat.auto, 24_000).sample_rate == 22_050
    raw = detect_format(b"\x01\x02\x03\x04", BodyFormat.auto, 16_000)
    assert raw == AudioFormat(16_000, 1, 0)
    with pytest.raises(ValueError):
        detect_format(b"\x01\x02" * 30, BodyFormat.wav, 24_000)


def test_stereo_is_averaged_and_partial_frames_are_dropped():
    fmt = AudioFormat(24_000, channels=2, header_bytes=0)
    pcm = np.array([100, 300, -50, 50, 7], dtype="<i2").tobytes()
    np.testing.assert_array_equal(decode_mono(pcm, fmt), [200.0, 0.0])


def test_frames_complete_when_their_last_byte_arrives():
    fmt = AudioFormat(24_000, 1, header_bytes=44)
    end_frames = chunk_end_frames(np.array([20, 47, 48, 100]), fmt)
    np.testing.assert_array_equal(end_frames, [0, 1, 2, 28])
    times = np.array([0.0, 0.1, 0.2, 0.3])
    assert frame_arrival_time(0, times, end_frames) == 0.1
    assert frame_arrival_time(1, times, end_frames) == 0.2
    assert frame_arrival_time(2, times, end_frames) == 0.3


# Playback simulation: chunk arrival times (s) and cumulative frames at 1000 frames/s, so
# frame counts read as milliseconds of audio.
@pytest.mark.parametrize(
    ("times", "end_frames", "underrun_at", "stall"),
    [
        # every chunk before it is due: no underrun
        ([0.0, 0.09, 0.19], [100, 200, 300], (), 0.0),
        # arriving exactly when due is on time
        ([0.0, 0.1, 0.2], [100, 200, 300], (), 0.0),
        # second chunk 50 ms late (after 0.1 s of audio); the third is then due at 0.25
        ([0.0, 0.15, 0.25], [100, 200, 300], (0.1,), 0.05),
        # two separate stalls: 0.1 s, then due 0.2+0.1=0.3 but arrives 0.5 -> 0.2 s
        ([0.0, 0.2, 0.5], [100, 200, 300], (0.1, 0.2), 0.3),
        # a short first chunk: the second, due after 30 ms of audio, is late
        ([0.0, 0.04, 0.12], [30, 130, 230], (0.03,), 0.01),
        # header-only and empty chunks neither start playback nor underrun
        ([0.0, 0.05, 0.4, 0.45], [0, 0, 100, 200], (), 0.0),
    ],
)
def test_playback_simulation_exact(times, end_frames, underrun_at, stall):
    result = simulate_playback(np.array(times), np.array(end_frames), 1000)
    assert result is not None
    assert result.underruns == len(underrun_at)
    assert result.underrun_at_s == pytest.approx(underrun_at, abs=1e-12)
    assert result.stall_s == pytest.approx(stall, abs=1e-12)


def test_playback_starts_at_first_playable_frame():
    result = simulate_playback(np.array([0.0, 0.05, 0.4]), np.array([0, 0, 10]), 1000)
    assert result is not None and result.start_s == 0.4
    assert simulate_playback(np.array([0.0]), np.array([0]), 1000) is None


def test_blockwise_onset_equals_the_whole_utterance_scan():
    """audible_onset scans blocks from the start; its answer must be the first loud pair of
    the whole-utterance scan, wherever the onset falls (block edges included)."""
    from ttsbuild.bench.audio import ONSET_THRESHOLD_DBFS, window_levels_dbfs

    def whole(x: np.ndarray):
        loud = window_levels_dbfs(x, SR) >= ONSET_THRESHOLD_DBFS
        hits = np.flatnonzero(loud[:-1] & loud[1:]) if len(loud) >= 2 else []
        return int(hits[0]) * round(0.02 * SR) if len(hits) else None

    rng = np.random.default_rng()
    window = round(0.02 * SR)
    cases = 0
    for silent_windows in [0, 1, 14, 15, 16, 17, 46, 47, 48, 111, 112, 300]:
        for loud_windows in (1, 2, 3):
            lead = rng.normal(0, 10, silent_windows * window + rng.integers(0, window))
            burst = rng.normal(0, 3000, loud_windows * window)
            tail = rng.normal(0, 10, rng.integers(0, 40) * window)
            # a lone loud window inside the silence: never an onset by itself
            if silent_windows > 4:
                lead[2 * window : 3 * window] = rng.normal(0, 3000, window)
            x = np.concatenate([lead, burst, tail]).astype(np.float32)
            assert audible_onset(x, SR) == whole(x), (silent_windows, loud_windows)
            cases += whole(x) is not None
    assert cases > 12  # most cases have an onset: the comparison is not all None
