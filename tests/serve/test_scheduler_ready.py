"""Scheduler._ready inlines, for speed, the per-stream methods a turn's ranking is defined by
(next_stage, _paused, _rank, _slack, playback_end): it must give exactly what they give, for
streams in every state a turn can find them in."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ttsbuild.serve.config import PROFILES, SAMPLE_RATE, ProfileName, SchedulerConfig
from ttsbuild.serve.scheduler import Scheduler, Stage, Status, Stream

SCHEDULES = [(1, 1, 2, 4, 8, 12), (1, 2, 4, 8), (4,), (2, 6)]


def _by_methods(sched: Scheduler, now: float):
    """The ranking as the scheduler's methods define it."""
    return [
        sched._rank(s, stage, now)
        for s in sched.by_slot.values()
        if (stage := s.next_stage()) in (Stage.FRAMES, Stage.AUDIO) and not sched._paused(s)
    ]


def _random_stream(rnd: random.Random, i: int, now: float, others: list[Stream]) -> Stream:
    schedule = rnd.choice(SCHEDULES)
    s = Stream(id=i, request=None, sink=lambda e: None, chunk_schedule=schedule,
               ramp_speed=2.0, trimmer=None, arrived_at=now - rnd.uniform(0, 5))  # fmt: skip
    s.status = rnd.choice([Status.DECODING] * 6 + [Status.PREFILL, Status.FINISHED,
                                                    Status.CANCELLED])  # fmt: skip
    s.decoded = rnd.randrange(0, 40)
    s.frames = s.decoded + rnd.randrange(0, 14)
    s.certain = rnd.randrange(0, 3)
    s.audio_steps = rnd.randrange(0, len(schedule) + 3)
    s.generation_done = rnd.random() < 0.2
    s.samples_sent = rnd.randrange(0, 30) * 1920
    limit = SchedulerConfig().stream_buffer_s * SAMPLE_RATE
    s.samples_unsent = rnd.choice([0, int(limit), int(limit) + 1, rnd.randrange(0, 2 * int(limit))])
    s.first_audio_at = None if rnd.random() < 0.25 else now - rnd.uniform(0, 3)
    s.plays_from = None if rnd.random() < 0.6 else now + rnd.uniform(-2, 2)
    if others and rnd.random() < 0.2:
        s.follows = rnd.choice(others)
    s.last_served_at = rnd.choice([0.0, now - rnd.uniform(0, 1)])
    return s


@pytest.mark.parametrize("profile", list(ProfileName))
def test_ready_gives_what_the_methods_give(profile):
    rnd = random.Random(f"ready-{profile}")
    classes, stages, skipped = Counter(), Counter(), 0
    for turn in range(300):
        config = SchedulerConfig(profile=PROFILES[profile], num_slots=64)
        sched = Scheduler(config, clock=lambda: 0.0)
        for stage in Stage:  # stage costs as a running engine has measured them
            sched.cost_s[stage] = rnd.uniform(0.001, 0.02)
        now = rnd.uniform(10, 1000)
        streams: list[Stream] = []
        for i in range(rnd.randrange(1, 40)):
            s = _random_stream(rnd, i, now, streams)
            streams.append(s)
            sched.by_slot[i] = s
        want, got = _by_methods(sched, now), sched._ready(now)
        assert got == want, f"turn {turn}"
        classes.update(r.klass for r in got)
        stages.update(r.stage for r in got)
        skipped += len(streams) - len(got)
    # every branch was taken, often
    assert min(classes[k] for k in ("deadline", "first-audio", "soon", "round-robin")) > 20, classes
    assert min(stages[Stage.FRAMES], stages[Stage.AUDIO]) > 100, stages
    assert skipped > 500
