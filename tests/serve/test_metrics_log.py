"""What the server logs beside its metrics: late chunks (at most once a second, with how many
were not logged) and long collector pauses, so a sweep's log shows when they happened."""

from __future__ import annotations

import logging

from ttsbuild.serve.metrics import ServeMetrics


def test_late_chunks_are_counted_and_logged_once_a_second(caplog):
    metrics = ServeMetrics()
    with caplog.at_level(logging.WARNING, logger="ttsbuild.serve.metrics"):
        metrics.on_chunk(-0.010)  # on time: no log, no underrun
        metrics.on_chunk(0.0042, 1, 0.08)  # the ramp's second chunk
        metrics.on_chunk(0.0015)  # within the second: counted, not logged
        metrics.on_chunk(0.0030)
        metrics._late_log.logged_at -= 1.5  # a second and a half later
        metrics.on_chunk(0.0021)
    late = [r.getMessage() for r in caplog.records if "late for its playback" in r.getMessage()]
    assert late[0].startswith("chunk 1 (after 0.08 s of audio) late for its playback by 4.2 ms")
    assert "2 more since the last one" in late[1] and "by 2.1 ms" in late[1]
    assert len(late) == 2
    assert metrics.underruns._value.get() == 4


def test_collector_pauses_are_timed_and_long_ones_logged(caplog):
    metrics = ServeMetrics()
    with caplog.at_level(logging.WARNING, logger="ttsbuild.serve.metrics"):
        metrics.on_gc_pause(0, 0.0007, 120)
        metrics.on_gc_pause(2, 0.0081, 5)
    logged = [r.getMessage() for r in caplog.records if "collector pause" in r.getMessage()]
    assert logged == ["collector pause: generation 2, 8.1 ms, 5 objects collected"]
    assert metrics.gc_pause.labels("0")._sum.get() == 0.0007
    assert metrics.gc_pause.labels("2")._sum.get() == 0.0081


def test_codec_launches_per_step_are_counted_from_the_engines_ticket():
    """The runner reports how many codec launches a codec step made (the engine's ticket
    lists them; a fake's has no list and reports nothing)."""
    from types import SimpleNamespace

    from ttsbuild.serve.loop import Runner
    from ttsbuild.serve.scheduler import Plan, Stage

    class Engine:
        def __init__(self, launches):
            self.launches = launches

        def pending_frames(self, slot):
            return 3

        def launch_audio(self, slots, max_frames=None):
            return SimpleNamespace(launched=[object()] * self.launches) if self.launches else 7

    metrics = ServeMetrics()
    for launches in (3, 1, 0):
        runner = Runner(Engine(launches), codec_launches=metrics.on_codec_launches)
        runner.launch(Plan(release=[], admit=[], prefill=None, stage=Stage.AUDIO, slots=[0, 1]))
    assert metrics.codec_launches._sum.get() == 4  # 3 + 1; the ticket without a list: none
    assert metrics.codec_launches._buckets[0].get() == 1  # one step of one launch


def test_exact_chunks_cap_each_rows_codec_step_at_its_chunk():
    """Plan.audio_frames (SchedulerConfig.exact_chunks) reaches the engine as per-row caps and
    the step's accounting decodes no more than that; a plan without it passes no cap."""
    from ttsbuild.serve.loop import Runner
    from ttsbuild.serve.scheduler import Plan, Stage

    class Engine:
        def __init__(self):
            self.calls = []

        def pending_frames(self, slot):
            return {0: 5, 1: 3}[slot]

        def launch_audio(self, slots, max_frames=None):
            self.calls.append((list(slots), max_frames))
            return None

    engine = Engine()
    runner = Runner(engine)
    plan = Plan(release=[], admit=[], prefill=None, stage=Stage.AUDIO, slots=[0, 1],
                audio_frames={0: 4})  # row 1's generation ended: all it has
    step = runner.launch(plan)
    assert engine.calls == [([0, 1], [4, None])]
    assert step.result.decoded == {0: 4, 1: 3}
    runner.launch(Plan(release=[], admit=[], prefill=None, stage=Stage.AUDIO, slots=[0, 1]))
    assert engine.calls[-1] == ([0, 1], None)


def test_stalls_are_logged_with_what_stalled_once_a_second_per_kind(caplog):
    """Stalls that hold every stream at once (the grouped underruns under load): the event
    loop late, the engine thread late back from a poll, a frame or codec step far over its
    usual time; each kind at most once a second, the short ones only counted in histograms."""
    from ttsbuild.serve.scheduler import Stage

    metrics = ServeMetrics(stall_s=0.02)
    with caplog.at_level(logging.WARNING, logger="ttsbuild.serve.metrics"):
        metrics.on_event_loop_lag(0.004)  # usual: not logged
        metrics.on_event_loop_lag(0.0315)
        metrics.on_event_loop_lag(0.05)  # within the second: counted
        metrics.on_host("poll_lag", 0.019)
        metrics.on_host("collect_frames", 0.5)  # not a poll: never a stall
        metrics.on_host("poll_lag", 0.0264)
        metrics.on_step(Stage.FRAMES, 48, 0.012, 48)
        metrics.on_step(Stage.FRAMES, 48, 0.0512, 48)
        metrics.on_step(Stage.AUDIO, 9, 0.0433, 0)
        metrics.on_step(Stage.PREFILL, 3, 0.09, 0)  # a prefill may be long: not a stall
        metrics._stall_logs["event loop woke"].logged_at -= 1.5
        metrics.on_event_loop_lag(0.0222)
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls == [
        "stall: event loop woke 31.5 ms late with 0 slots in use",
        "stall: engine thread back from a poll 26.4 ms late with 0 slots in use",
        "stall: frames step 51.2 ms with 48 rows with 0 slots in use",
        "stall: audio step 43.3 ms with 9 rows with 0 slots in use",
        "stall: event loop woke 22.2 ms late with 0 slots in use; 1 more since the last one",
    ]
    assert metrics.event_loop_lag._sum.get() == 0.004 + 0.0315 + 0.05 + 0.0222


def test_a_standing_queue_sets_its_gauge_and_is_logged(caplog):
    metrics = ServeMetrics()
    with caplog.at_level(logging.INFO, logger="ttsbuild.serve.metrics"):
        metrics.on_queue_standing(True, 0.02)
        assert metrics.queue_standing._value.get() == 1
        metrics.on_queue_standing(False, 2.0)
    assert metrics.queue_standing._value.get() == 0
    logged = [r.getMessage() for r in caplog.records if "queue for slots" in r.getMessage()]
    assert "requests wait at most 20 ms" in logged[0] and "up to 2 s" in logged[1]
