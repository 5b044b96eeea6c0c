"""Driving an engine to the end in tests: every slot's codes and audio, pulled as they come."""

from __future__ import annotations

import numpy as np
import torch


def finish(engine, slots, chunk: int = 2) -> list[tuple[torch.Tensor, np.ndarray]]:
    """Frames for `slots` until each is finished, audio pulled `chunk` frames at a time;
    the slots are released. Returns (codes [F, groups], pcm) per slot."""
    codes = {s: [] for s in slots}
    pcm = {s: [] for s in slots}
    active = list(slots)
    while active:
        for out in engine.frames(active):
            if out.codes is not None:
                codes[out.slot].append(out.codes)
        for s, p in engine.audio(active, max_frames=chunk).items():
            pcm[s].append(p)
        active = [s for s in active if not engine.is_finished(s)]
    for s, p in engine.audio(slots).items():
        pcm[s].append(p)
    for s in slots:
        engine.release(s)
    return [(torch.stack(codes[s]), np.concatenate(pcm[s])) for s in slots]
