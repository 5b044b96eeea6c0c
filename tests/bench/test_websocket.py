"""WebSocket mode: words streamed at a fixed cadence, time from the last word to audio."""

import pytest

from ttsbuild.bench.fakeserver import FakeSpeechServer, Reply, silence, tone
from ttsbuild.bench.target import Mode

from .helpers import one_request

TOL = 0.015
WORD_INTERVAL = 0.02


def script(request):
    text = request["input"].strip()
    if text.startswith("fail"):
        return Reply(status=500)
    if text.startswith("drop"):
        return Reply(chunks=[(0.0, tone(0.1))], disconnect=True)
    # audio starts 50 ms after input.done: 0.1 s of silence, then speech
    return Reply(chunks=[(0.05, silence(0.1)), (0.0, tone(0.3)), (0.02, tone(0.1))])


@pytest.fixture(scope="module")
def server():
    with FakeSpeechServer(script) as running:
        yield running


def test_ws_words_are_streamed_and_audio_is_timed_from_the_last_word(server):
    text = "one two three four five"
    r = one_request(server.ws_url, text, mode=Mode.ws, word_interval_s=WORD_INTERVAL)
    assert r.outcome == "ok", r.error
    received = server.requests[-1]
    assert received["input"] == "one two three four five "
    assert received["session"]["voice"] == "alice"
    assert received["session"]["language"] == "en"
    assert r.text_done_to_audio_s == pytest.approx(0.05, abs=TOL)
    # five words at 20 ms: the last is sent 80 ms after the first, then 50 ms to audio
    # (plus the WebSocket handshake, so only a lower bound is exact)
    assert 0.13 - 1e-3 <= r.ttfa_s < 0.13 + 3 * TOL
    # the silence frame plays first; the speech frame follows it immediately
    assert 0 < r.ttfa_s - r.first_playable_s < TOL
    assert r.leading_silence_s == pytest.approx(0.1, abs=1e-9)
    assert r.audio_s == pytest.approx(0.5, abs=1e-9)
    assert r.underruns == 0
    assert r.server_stats == {"type": "done", "audio_bytes": 24_000}


def test_ws_error_event_is_a_failure(server):
    r = one_request(server.ws_url, "fail now", mode=Mode.ws)
    assert r.outcome == "failed" and "server error" in r.error


def test_ws_close_without_done_is_a_failure(server):
    r = one_request(server.ws_url, "drop it", mode=Mode.ws)
    assert r.outcome == "failed"
    assert r.audio_s == pytest.approx(0.1, abs=1e-9)
