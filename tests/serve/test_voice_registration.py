"""Registered voices over HTTP: register, list, speak (HTTP and WebSocket), restart, delete,
and every bad upload refused with a clear 4xx and nothing left behind."""

from __future__ import annotations

import pathlib
import threading
from dataclasses import replace

import httpx
import pytest
from audio_fixtures import encode, voiced

from ttsbuild.serve.config import FRAME_SAMPLES

from .conftest import NO_CAPACITY_ADMISSION, running_server
from .test_ws_api import run, session

VOICES = "/v1/audio/voices"
SPEECH = "/v1/audio/speech"
# Real human speech (tests/data/README.md) and its transcript.
CLIP = (pathlib.Path(__file__).parents[1] / "data" / "librivox-0880.wav").read_bytes()
TRANSCRIPT = "He was not an ill disposed young man."


def register(url, name, clip=CLIP, transcript=None, **fields):
    data = {"name": name, **fields}
    if transcript is not None:
        data["transcript"] = transcript
    return httpx.post(url + VOICES, files={"file": ("clip.wav", clip)}, data=data, timeout=120)


def speak(url, voice, seed=5):
    body = {"input": "Hi there.", "voice": voice, "seed": seed, "max_frames": 4,
            "response_format": "pcm"}  # fmt: skip
    return httpx.post(url + SPEECH, json=body, timeout=120)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def base_server(tiny_base_checkpoint, voices_dir):
    config = replace(NO_CAPACITY_ADMISSION, voices_dir=str(voices_dir))
    with running_server(tiny_base_checkpoint, config, slots=2) as (url, service):
        yield url, service


def test_register_list_speak_and_delete(base_server, voices_dir):
    url, _ = base_server
    r = register(url, "Narrator", transcript=TRANSCRIPT)
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "narrator" and r.json()["mode"] == "in-context"
    r = register(url, "plain")  # no transcript: x-vector only
    assert r.status_code == 201 and r.json()["mode"] == "x-vector"
    listed = httpx.get(url + VOICES).json()["voices"]
    assert [(v["id"], v["type"]) for v in listed] == [("narrator", "cloned"), ("plain", "cloned")]
    assert sorted(p.name for p in voices_dir.iterdir()) == ["narrator", "plain"]
    assert not any(p.name == "clip.bin" for p in voices_dir.rglob("*"))  # not kept unless asked

    for name in ("narrator", "PLAIN"):
        r = speak(url, name)
        assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2
    assert speak(url, "narrator").content != speak(url, "plain").content

    config = {"type": "session.config", "voice": "narrator", "seed": 5, "max_frames": 4}
    events, audio, code = run(session(url, [config, {"type": "input.append", "text": "Hi."},
                                            {"type": "input.done"}]))  # fmt: skip
    assert code == 1000 and len(audio) == 4 * FRAME_SAMPLES * 2, events

    assert httpx.delete(url + VOICES + "/plain").json() == {"id": "plain", "deleted": True}
    assert error_of(speak(url, "plain"), 400)["param"] == "voice"
    assert error_of(httpx.delete(url + VOICES + "/plain"), 404)["code"] == "voice_not_found"
    assert sorted(p.name for p in voices_dir.iterdir()) == ["narrator"]


def test_voices_persist_across_a_restart(tiny_base_checkpoint, tmp_path):
    config = replace(NO_CAPACITY_ADMISSION, voices_dir=str(tmp_path))
    with running_server(tiny_base_checkpoint, config, slots=1) as (url, _):
        assert register(url, "keeper", transcript="Words.", keep_clip="true").status_code == 201
        before = speak(url, "keeper").content
    assert (tmp_path / "keeper" / "clip.bin").read_bytes() == CLIP  # asked to keep it
    with running_server(tiny_base_checkpoint, config, slots=1) as (url, _):
        assert [v["id"] for v in httpx.get(url + VOICES).json()["voices"]] == ["keeper"]
        assert speak(url, "keeper").content == before


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        (b"definitely not audio", "not an audio file"),
        (encode(voiced(0.3), 24000), "at least 1 s"),
        (encode(voiced(31.0, rate=8000), 8000), "at most 30 s"),
        (encode(0 * voiced(2.0), 24000), "silent"),
        (encode(voiced(2.0, level=4.0).clip(-1, 1), 24000), "clipped"),
    ],
    ids=["not-audio", "short", "long", "silent", "clipped"],
)
def test_bad_clips_get_400_and_register_nothing(base_server, voices_dir, clip, message):
    url, _ = base_server
    before = sorted(p.name for p in voices_dir.iterdir())
    err = error_of(register(url, "bad", clip=clip), 400)
    assert message in err["message"] and err["code"] == "invalid_clip"
    assert sorted(p.name for p in voices_dir.iterdir()) == before
    assert "bad" not in [v["id"] for v in httpx.get(url + VOICES).json()["voices"]]


def test_bad_uploads_get_4xx(base_server):
    url, _ = base_server
    assert error_of(register(url, "../etc"), 400)["param"] == "name"
    assert error_of(register(url, ""), 400)["param"] == "name"
    r = httpx.post(url + VOICES, data={"name": "x"}, timeout=30)  # no file
    assert r.status_code in (400, 415)
    r = httpx.post(url + VOICES, json={"name": "x"}, timeout=30)
    assert error_of(r, 415)
    r = httpx.post(url + VOICES, files={"file": ("c.wav", CLIP)},
                   data={"name": "x", "colour": "red"}, timeout=30)
    assert "unknown form fields" in error_of(r, 400)["message"]
    r = httpx.post(url + VOICES, files={"file": ("c.wav", CLIP)},
                   data={"name": "x", "keep_clip": "maybe"}, timeout=30)
    assert error_of(r, 400)["param"] == "keep_clip"
    assert error_of(register(url, "x", transcript="w" * 1001), 400)["param"] == "transcript"
    huge = bytes(17 * 1024 * 1024)
    assert error_of(register(url, "huge", clip=huge), 413)["code"] == "too_large"
    r = httpx.post(url + VOICES, content=b"--xx\r\nbroken", timeout=30,
                   headers={"content-type": "multipart/form-data; boundary=xx"})
    assert r.status_code == 400
    assert speak(url, "narrator-unknown").status_code == 400
    assert httpx.get(url + "/health").status_code == 200


def test_concurrent_registration_of_one_name(base_server, voices_dir):
    url, _ = base_server
    results: list[int] = []
    start = threading.Barrier(4)

    def attempt():
        start.wait()
        results.append(register(url, "race").status_code)

    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [201, 409, 409, 409]
    assert error_of(register(url, "race"), 409)["code"] == "voice_exists"
    assert (voices_dir / "race" / "voice.safetensors").is_file()
    assert not [p for p in voices_dir.iterdir() if p.name.startswith(".")]


def test_registration_needs_a_base_model(server):
    url, _ = server
    err = error_of(register(url, "x"), 400)
    assert "Base" in err["message"]
    listed = httpx.get(url + VOICES).json()["voices"]
    assert {"id": "ryan", "name": "ryan", "speaker": "ryan", "type": "builtin"} in listed
