"""Registered voices: atomic, persistent, and one name one voice under concurrency."""

from __future__ import annotations

import threading

import pytest
import torch

from ttsbuild.voices.encoder import ClonedVoice
from ttsbuild.voices.store import VoiceStore, VoiceStoreError


def a_voice(seed: int, transcript: str | None = "hello there") -> ClonedVoice:
    g = torch.Generator().manual_seed(seed)
    return ClonedVoice(torch.randn(16, generator=g), torch.randint(0, 2048, (7, 16), generator=g),
                       transcript)


def register(store: VoiceStore, name: str, voice: ClonedVoice, clip: bytes | None = None):
    with store.reserve(name) as checked:
        return store.add(checked, voice, {"seconds": 1.0}, clip)


def test_voices_survive_a_restart_exactly(tmp_path):
    store = VoiceStore(tmp_path, 16)
    v1, v2 = a_voice(1), a_voice(2, transcript=None)
    register(store, "Alice", v1, clip=b"original bytes")
    register(store, "bob", v2)
    again = VoiceStore(tmp_path, 16)
    assert again.names() == ["alice", "bob"]
    a, b = again.get("alice"), again.get("bob")
    assert torch.equal(a.voice.x_vector, v1.x_vector)
    assert torch.equal(a.voice.ref_codes, v1.ref_codes)
    assert a.voice.transcript == "hello there" and a.info()["mode"] == "in-context"
    assert b.voice.transcript is None and b.info()["mode"] == "x-vector"
    assert (tmp_path / "alice" / "clip.bin").read_bytes() == b"original bytes"
    assert not (tmp_path / "bob" / "clip.bin").exists()  # never kept unless asked


def test_remove_deletes_from_disk_and_listing(tmp_path):
    store = VoiceStore(tmp_path, 16)
    register(store, "alice", a_voice(1))
    store.remove("ALICE")
    assert store.names() == [] and VoiceStore(tmp_path, 16).names() == []
    with pytest.raises(VoiceStoreError) as err:
        store.remove("alice")
    assert err.value.status == 404


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import ttsbuild.voices.store as mod

    store = VoiceStore(tmp_path, 16)

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mod, "_write_json", broken)
    with pytest.raises(OSError):
        register(store, "alice", a_voice(1))
    assert list(tmp_path.iterdir()) == [] and store.names() == []
    monkeypatch.undo()
    register(store, "alice", a_voice(1))  # the name is free again
    assert store.names() == ["alice"]


def test_leftovers_of_a_crash_are_cleaned_and_damaged_voices_skipped(tmp_path):
    (tmp_path / ".tmp-deadbeef").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "voice.json").write_text("{not json")
    store = VoiceStore(tmp_path, 16)
    assert store.names() == []
    assert not (tmp_path / ".tmp-deadbeef").exists()


def test_voices_of_another_model_size_are_not_loaded(tmp_path):
    register(VoiceStore(tmp_path, 16), "alice", a_voice(1))
    assert VoiceStore(tmp_path, 32).names() == []


@pytest.mark.parametrize("name", ["", " ", "-x", "a" * 65, "a/b", "../x", "é"])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(VoiceStoreError, match="voice name"):
        register(VoiceStore(tmp_path, 16), name, a_voice(1))


def test_concurrent_registration_of_one_name_stores_exactly_one(tmp_path):
    store = VoiceStore(tmp_path, 16)
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def attempt(i: int) -> None:
        start.wait()
        try:
            register(store, "shared", a_voice(i))
            outcomes.append(f"ok{i}")
        except VoiceStoreError as exc:
            outcomes.append(str(exc.status))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o.startswith("ok")]
    assert len(winners) == 1 and outcomes.count("409") == 7
    stored = VoiceStore(tmp_path, 16).get("shared")
    assert torch.equal(stored.voice.x_vector, a_voice(int(winners[0][2:])).x_vector)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]


def test_two_stores_on_one_directory_cannot_both_take_a_name(tmp_path):
    first, second = VoiceStore(tmp_path, 16), VoiceStore(tmp_path, 16)
    register(first, "alice", a_voice(1))
    with pytest.raises(VoiceStoreError) as err:
        register(second, "alice", a_voice(2))  # its in-memory view has no alice
    assert err.value.status == 409
    assert torch.equal(VoiceStore(tmp_path, 16).get("alice").voice.x_vector, a_voice(1).x_vector)
