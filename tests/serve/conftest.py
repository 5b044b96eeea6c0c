"""Shared fixtures: one tiny stand-in checkpoint per session, real uvicorn servers on port 0."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from ttsbuild.serve.config import SchedulerConfig, ServeConfig


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint  # the session's tiny stand-in (tests/conftest.py); read-only here


# The tiny model on a shared CPU runs near real time: admission by measured capacity would
# (rightly) refuse concurrent requests there. These servers test other properties; capacity
# admission is tested on a fake clock in test_scheduler.
NO_CAPACITY_ADMISSION = ServeConfig(scheduler=SchedulerConfig(admit_by_capacity=False))


@contextlib.contextmanager
def running_server(
    ckpt: Path | None, config: ServeConfig = NO_CAPACITY_ADMISSION, slots: int = 4, engine=None
):
    """A real uvicorn server on 127.0.0.1:<free port> in a thread; yields (base_url, service).
    Serves `engine` when given (ckpt is then unused), else `ckpt` on the CPU engine."""
    import uvicorn

    from ttsbuild.runtime.loader import open_engine
    from ttsbuild.serve.app import create_app
    from ttsbuild.serve.service import SpeechService

    torch.set_num_threads(1)  # the engine thread and the test client share two cores
    if engine is None:
        engine = open_engine(ckpt, "cpu", num_slots=slots, max_len=512)
    service = SpeechService(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 90  # warm-up is two requests; CI machines are busy
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "server never became ready"
        time.sleep(0.02)
    try:
        yield url, service
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with running_server(tiny_ckpt) as (url, service):
        yield url, service
