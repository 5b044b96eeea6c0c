"""Concurrent requests give the same bytes as the same requests run one at a time."""

from __future__ import annotations

import asyncio

import httpx

TEXTS = [
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "Rice is often served in round bowls.",
]
VOICES = ["ryan", "serena", "aiden", "vivian"]


def bodies():
    return [
        {"input": t, "voice": v, "seed": 100 + i, "response_format": "pcm", "stream": True,
         "max_frames": 12}  # fmt: skip
        for i, (t, v) in enumerate(zip(TEXTS, VOICES, strict=True))
    ]


async def fetch(client: httpx.AsyncClient, url: str, body: dict) -> bytes:
    async with client.stream("POST", url + "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        return b"".join([c async for c in r.aiter_raw()])


def test_concurrent_equals_sequential_bytes(server):
    url, service = server

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            sequential = [await fetch(client, url, b) for b in bodies()]
            concurrent = await asyncio.gather(*(fetch(client, url, b) for b in bodies()))
            permuted = await asyncio.gather(*(fetch(client, url, b) for b in bodies()[::-1]))
        return sequential, concurrent, permuted[::-1]

    sequential, concurrent, permuted = asyncio.run(main())
    assert all(len(pcm) == 12 * 1920 * 2 for pcm in sequential)
    assert len(set(sequential)) == 4  # different voices and seeds: different audio
    assert concurrent == sequential
    assert permuted == sequential
    frames_batches = service.metrics.batch.labels("frames")._sum.get()
    assert frames_batches > 0
