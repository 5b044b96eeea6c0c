"""The HTTP contract against a real uvicorn server on the tiny stand-in (streaming path real)."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest

from ttsbuild.serve.config import FRAME_SAMPLES

from .conftest import NO_CAPACITY_ADMISSION

SPEECH = "/v1/audio/speech"
GOOD = {"model": "qwen3-tts", "input": "Hi there.", "voice": "ryan", "seed": 7, "max_frames": 6}


def post(url, body=None, **kw):
    return httpx.post(url + SPEECH, json=body, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def assert_still_serving(url):
    r = post(url, {**GOOD, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) == 6 * FRAME_SAMPLES * 2


def test_streamed_pcm_is_frames_times_1920_samples(server):
    url, _ = server
    chunks = []
    body = {**GOOD, "response_format": "pcm", "stream": True, "max_frames": 9}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-sample-rate"] == "24000" and r.headers["x-seed"] == "7"
        assert r.headers["content-type"] == "audio/pcm"
        chunks = [c for c in r.iter_raw() if c]
    assert sum(map(len, chunks)) == 9 * FRAME_SAMPLES * 2
    assert len(chunks) >= 3  # the low-latency ramp: 1, 2, 4, ... frames per chunk
    assert len(chunks[0]) == FRAME_SAMPLES * 2


def test_streamed_wav_has_an_open_ended_header(server):
    url, _ = server
    body = {**GOOD, "response_format": "wav", "stream": True}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        data = r.read()
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert len(data) - 44 == 6 * FRAME_SAMPLES * 2


def test_whole_wav_file_is_valid_and_matches_the_stream(server):
    url, _ = server
    r = post(url, {**GOOD, "response_format": "wav", "stream": False})
    assert r.status_code == 200 and r.headers["x-frames"] == "6"
    data = r.content
    riff, size, wave = struct.unpack("<4sI4s", data[:12])
    assert (riff, wave, size) == (b"RIFF", b"WAVE", len(data) - 8)
    fmt, n, tag, channels, rate, byte_rate, align, bits = struct.unpack("<4sIHHIIHH", data[12:36])
    assert (fmt, n, tag, channels, rate, byte_rate, align, bits) == (
        b"fmt ", 16, 1, 1, 24000, 48000, 2, 16
    )
    assert data[36:40] == b"data" and struct.unpack("<I", data[40:44])[0] == len(data) - 44
    pcm = post(url, {**GOOD, "response_format": "pcm"}).content
    assert data[44:] == pcm  # same seed, same bytes


def test_names_match_case_insensitively_and_unknown_fields_are_ignored(server):
    url, _ = server
    body = {**GOOD, "voice": "RYAN", "language": "English", "stream_format": "audio",
            "response_format": "PCM", "some_future_field": {"x": 1}}  # fmt: skip
    assert post(url, body).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({**GOOD, "input": ""}, 400, "input"),
        ({**GOOD, "input": "   \n"}, 400, "input"),
        ({**GOOD, "input": "x" * 5000}, 400, "input"),
        ({**GOOD, "input": "nul \x00 inside"}, 400, "input"),
        ({**GOOD, "input": "bell \x07"}, 400, "input"),
        ({**GOOD, "voice": "nobody"}, 400, "voice"),
        ({k: v for k, v in GOOD.items() if k != "voice"}, 400, "voice"),
        ({**GOOD, "language": "klingon"}, 400, "language"),
        ({**GOOD, "speed": 5}, 400, "speed"),
        ({**GOOD, "speed": 0.1}, 400, "speed"),
        ({**GOOD, "speed": "fast"}, 400, "speed"),
        ({**GOOD, "response_format": "ogg"}, 400, "response_format"),
        ({**GOOD, "response_format": "mp3", "sample_rate": 8000}, 400, "sample_rate"),
        ({**GOOD, "response_format": "pcm", "sample_rate": 11025}, 400, "sample_rate"),
        ({**GOOD, "response_format": "mulaw", "sample_rate": 24000}, 400, "sample_rate"),
        ({**GOOD, "stream_format": "sse", "stream": False}, 400, "stream"),
        ({**GOOD, "stream_format": "json"}, 400, "stream_format"),
        ({**GOOD, "voice": {"id": 5}}, 400, "voice"),
        ({**GOOD, "instructions": "calm", "instruct": "calm"}, 400, "instructions"),
        ({**GOOD, "input": 42}, 400, "input"),
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "seed": "7"}, 400, "seed"),
        ({**GOOD, "seed": -1}, 400, "seed"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "top_p": 2.0}, 400, "top_p"),
        ({**GOOD, "max_frames": 0}, 400, "max_frames"),
        ({**GOOD, "chunk_schedule": [0]}, 400, "chunk_schedule"),
        ({k: v for k, v in GOOD.items() if k != "input"}, 400, "input"),
    ],
)
def test_bad_fields_get_a_clear_400(server, body, status, param):
    url, _ = server
    assert_error(post(url, body), status, param)


def test_bad_bodies_get_4xx_and_the_server_keeps_serving(server):
    url, _ = server
    assert_error(httpx.post(url + SPEECH, content=b"{not json", timeout=30), 400)
    assert_error(httpx.post(url + SPEECH, content=b"[1, 2]", timeout=30), 400)
    assert_error(httpx.post(url + SPEECH, content=b"\xff\xfe", timeout=30), 400)
    assert_error(httpx.post(url + SPEECH, content=b"", timeout=30), 400)
    huge = b'{"input": "' + b"a" * 200_000 + b'"}'
    assert_error(httpx.post(url + SPEECH, content=huge, timeout=30), 413)
    lone_surrogate = b'{"input": "bad \\ud800 text", "voice": "ryan"}'
    for nested in (b'{"input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                   b'{"input": "hi", "voice": "ryan", "x": ' + b'{"a":' * 10_000 + b"1"
                   + b"}" * 10_001, b'{"input": "hi", "seed": 1' + b"0" * 5000 + b"}",
                   b'{"input": "hi", "voice": "ryan", "temperature": Infinity}'):  # fmt: skip
        assert_error(httpx.post(url + SPEECH, content=nested, timeout=30), 400)
    assert_error(httpx.post(url + SPEECH, content=lone_surrogate, timeout=30), 400, "input")
    assert_error(httpx.get(url + "/v1/nothing-here"), 404)
    assert_still_serving(url)


def test_odd_unicode_is_synthesized(server):
    url, _ = server
    for text in ["héllo wörld ✓", "你好，世界。", "emoji 🙂 and RTL שלום", "zero\u200bwidth"]:
        r = post(url, {**GOOD, "input": text, "response_format": "pcm"})
        assert r.status_code == 200 and len(r.content) == 6 * FRAME_SAMPLES * 2, text


def test_voices_health_ready_metrics(server):
    url, service = server
    voices = httpx.get(url + "/v1/audio/voices").json()
    ids = {v["id"]: v["speaker"] for v in voices["voices"]}
    assert ids["ryan"] == "ryan" and ids["alloy"] == "serena" and ids["ash"] == "ryan"
    assert "english" in voices["languages"] and voices["instructions"] is True
    assert httpx.get(url + "/v1/voices").json() == voices
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-tts"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/ready").json() == {"ready": True}
    post(url, {**GOOD, "voice": "nobody"})
    text = httpx.get(url + "/metrics").text
    for name in [
        "tts_time_to_first_audio_seconds_bucket", "tts_chunk_lateness_seconds_bucket",
        "tts_queue_depth", "tts_batch_size_bucket", "tts_active_streams", "tts_frames_total",
        'tts_schedule_decisions_total{reason="first-audio"}', 'tts_requests_total{api="http"',
    ]:  # fmt: skip
        assert name in text, name
    # the engine thread's host time per call, and the event loop's lag, were observed
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for part in ("plan", "admit", "prefill", "launch_frames", "launch_audio", "collect_frames",
                 "collect_audio", "commit"):  # fmt: skip
        assert float(samples[f'tts_engine_host_seconds_count{{part="{part}"}}']) > 0, part
    assert float(samples["tts_event_loop_lag_seconds_count"]) > 0
    phases = [f'tts_first_audio_phase_seconds_count{{phase="{p}"}}' for p in
              ("admit", "frame", "codec", "read")]  # fmt: skip
    assert all(float(samples[k]) > 0 for k in phases)


def test_the_event_loops_share_of_first_audio_is_timed(server):
    """tts_http_phase_seconds: receive (body read and validated), resolve (before the
    scheduler sees the request), admitted (-> the handler has the admission), handoff (the
    engine thread's first chunk -> its handler) and send (-> bytes written), once per
    stream."""
    url, _ = server

    def samples():
        lines = httpx.get(url + "/metrics").text.splitlines()
        pairs = (line.rsplit(" ", 1) for line in lines if line.startswith("tts_http_phase"))
        return {k: float(v) for k, v in pairs}

    before = samples()
    requests = 3
    for i in range(requests):
        r = post(url, {**GOOD, "seed": 100 + i, "response_format": "pcm"})
        assert r.status_code == 200 and len(r.content) > 0
    after = samples()
    for phase in ("receive", "resolve", "admitted", "handoff", "send"):
        key = f'tts_http_phase_seconds_{{}}{{{{phase="{phase}"}}}}'
        count = after[key.format("count")] - before.get(key.format("count"), 0)
        spent = after[key.format("sum")] - before.get(key.format("sum"), 0)
        assert count == requests, phase
        assert 0 < spent / count < 1.0, phase


def test_startup_objects_are_frozen_and_collector_pauses_timed(server):
    """After the warm-up the startup heap is out of the cyclic collector's reach (a full
    collection of it is a ~0.2 s pause of every thread), and the pauses show in /metrics."""
    import gc

    url, service = server
    assert gc.get_freeze_count() > 100_000  # torch, the models and the web stack
    before = service.metrics.gc_pause.labels("2")._sum.get()
    gc.collect()
    text = httpx.get(url + "/metrics").text
    assert 'tts_gc_pause_seconds_count{generation="2"}' in text
    assert service.metrics.gc_pause.labels("2")._sum.get() > before


def test_dropping_the_bootstrap_frame_as_for_real_checkpoints(tiny_ckpt):
    from ttsbuild.serve.config import ServeConfig

    from .conftest import running_server

    config = ServeConfig(drop_bootstrap_frame=True, scheduler=NO_CAPACITY_ADMISSION.scheduler)
    with running_server(tiny_ckpt, config, slots=1) as (url, _):
        body = {**GOOD, "response_format": "pcm", "stream": True}
        with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
            chunks = [c for c in r.iter_raw() if c]
    assert sum(map(len, chunks)) == 5 * FRAME_SAMPLES * 2  # 6 frames made, the first not sent
    assert len(chunks[0]) == FRAME_SAMPLES * 2  # the first chunk still carries one audible frame


def test_an_idle_server_with_capacity_admission_never_refuses_back_to_back_requests(tiny_ckpt):
    """The default admission (by measured capacity) on a shared 2-core CPU, where the tiny
    stand-in runs near or below real time: one client's requests, one after another, all
    succeed (the engine is measured busy, but nothing else needs audio)."""
    from ttsbuild.serve.config import ServeConfig

    from .conftest import running_server

    with running_server(tiny_ckpt, ServeConfig()) as (url, service):
        assert service.scheduler.config.admit_by_capacity
        statuses, measured = [], []
        for i in range(10):
            body = {**GOOD, "response_format": "pcm", "seed": i, "max_frames": 8}
            r = post(url, body)
            statuses.append((r.status_code, r.text if r.status_code != 200 else ""))
            with service.loop.lock:
                measured.append(service.scheduler.capacity(service.scheduler.clock()))
        assert statuses == [(200, "")] * 10
        assert any(m is not None for m in measured)  # admission had evidence, and admitted


def test_streams_mp3_by_default_as_openai_does(server):
    url, _ = server
    body = {"model": "tts-1", "input": "Hi there.", "voice": "alloy", "max_frames": 12}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
        assert "content-length" not in r.headers and r.headers["transfer-encoding"] == "chunked"
        parts = [c for c in r.iter_raw() if c]
    assert len(parts) >= 3  # sent as generated, not at the end
    from .test_formats import decode

    pcm, rate = decode(b"".join(parts), "mp3")
    assert rate == 24000 and len(pcm) / rate == pytest.approx(12 * 0.08, abs=0.1)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw"])
def test_whole_files_have_their_length_and_decode(server, fmt):
    url, _ = server
    r = post(url, {**GOOD, "response_format": fmt, "stream": False})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    from .test_formats import decode

    pcm, rate = decode(r.content, fmt)
    assert len(pcm) / rate == pytest.approx(6 * 0.08, abs=0.1), fmt  # codec frames pad


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_pcm_at_a_chosen_sample_rate(server, rate):
    url, _ = server
    r = post(url, {**GOOD, "response_format": "pcm", "sample_rate": rate})
    assert r.status_code == 200 and r.headers["x-sample-rate"] == str(rate)
    assert len(r.content) // 2 == pytest.approx(6 * 0.08 * rate, abs=2)


def test_sse_sends_delta_events_then_done_with_usage(server):
    url, _ = server
    body = {**GOOD, "response_format": "pcm", "stream_format": "sse", "max_frames": 7}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 3 and all(e["type"] == "speech.audio.delta" for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == post(url, {**GOOD, "response_format": "pcm", "max_frames": 7}).content
    usage = done["usage"]
    assert done["type"] == "speech.audio.done" and usage["output_tokens"] == 7
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + 7


def test_instructions_reach_the_model(tmp_path_factory):
    """End to end, on the flat-logit stand-in: the peaked one (the default) depends so little
    on its context that an instruction need not change its codes (model.standin); that the
    instruction changes its logits is tested on the model (tests/model/test_standin.py)."""
    from ttsbuild.convert.convert import convert_checkpoint
    from ttsbuild.convert.init_random import init_random

    from .conftest import running_server

    root = tmp_path_factory.mktemp("flat")
    init_random(root / "src", "tiny", seed=0, peaked=False)
    convert_checkpoint(root / "src", root / "ckpt")
    with running_server(root / "ckpt", NO_CAPACITY_ADMISSION, slots=1) as (url, _):
        plain = post(url, {**GOOD, "response_format": "pcm"}).content
        told = post(url, {**GOOD, "response_format": "pcm", "instructions": "Whisper, slowly."})
    assert told.status_code == 200 and len(told.content) == len(plain)
    assert told.content != plain  # same seed: only the instruction differs


def test_instructions_are_a_400_where_the_model_ignores_them():
    from ttsbuild.serve.schema import ApiError, Catalog, SpeechBody, to_request

    small = Catalog(voices=["ryan"], aliases={"ash": "ryan"}, languages=["auto"],
                    needs_voice=True, supports_instruct=False)  # fmt: skip
    body = SpeechBody(input="Hi.", voice="ash", instructions="Calm.")
    with pytest.raises(ApiError) as err:
        to_request(body, body.input, small)
    assert err.value.status == 400 and err.value.param == "instructions"
    assert to_request(SpeechBody(input="Hi.", voice="ash"), "Hi.", small).voice == "ryan"


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_scales_the_duration(server, speed):
    url, _ = server
    r = post(url, {**GOOD, "response_format": "pcm", "speed": speed, "max_frames": 10})
    assert r.status_code == 200
    assert len(r.content) // 2 == round(10 * FRAME_SAMPLES / speed)


def test_voice_aliases_are_checked_against_the_model_at_startup():
    from ttsbuild.serve.config import ServeConfig
    from ttsbuild.serve.service import SpeechService

    from .fakes import FakeClock, FakeEngine

    engine = FakeEngine(FakeClock())  # one speaker: ryan
    default = SpeechService(engine).catalog.aliases
    assert default == {"ash": "ryan", "cedar": "ryan"}  # the default map, less absent speakers
    custom = SpeechService(engine, ServeConfig(voice_aliases={"Nova": "RYAN"})).catalog
    assert custom.aliases == {"nova": "ryan"}
    for bad in ({"alloy": "nobody"}, {"ryan": "ryan"}):
        with pytest.raises(ValueError):
            SpeechService(engine, ServeConfig(voice_aliases=bad))


def test_slow_first_chunks_are_logged_with_their_phases_at_most_once_a_second(caplog):
    from ttsbuild.serve.metrics import ServeMetrics

    m = ServeMetrics(slow_first_audio_s=0.02)
    phases = {"admit": 0.001, "frame": 0.0, "codec": 0.0005, "read": 0.03}
    with caplog.at_level("WARNING", logger="ttsbuild.serve.metrics"):
        m.on_first_audio(0.015, phases)  # under the bar: not logged
        m.on_first_audio(0.0315, phases)
        m.on_first_audio(0.04, phases)  # within the second: counted, not logged
        m._slow_log.logged_at -= 1.0
        m.on_first_audio(0.05, None)
    # the same logger reports cyclic-collector pauses, which may land here at any time
    lines = [r.getMessage() for r in caplog.records if "collector pause" not in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("slow first audio: 31.5 ms (admit 1.0, frame 0.0, codec 0.5, "
                               "read 30.0 ms) with 0 slots in use")  # fmt: skip
    assert "50.0 ms (no phases" in lines[1] and "1 more since the last one" in lines[1]
