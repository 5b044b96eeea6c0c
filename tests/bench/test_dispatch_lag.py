"""The harness must add no measurable lag of its own at 50 requests/s.

The bound is p99 < 5 ms. A shared CI machine can be so oversubscribed that even an idle
asyncio loop wakes from its timers later than that. So each attempt also runs, at the same
moment in a separate process, an idle loop that only sleeps to the same schedule; when the
machine itself is that late, the bar becomes "within 1 ms of the idle loop", which still
catches any harness work that blocks the loop, without failing on the machine's noise.
"""

import asyncio
import multiprocessing
from multiprocessing.connection import Connection

from ttsbuild.bench.fakeserver import serve_in_subprocess
from ttsbuild.bench.metrics import nearest_rank
from ttsbuild.bench.runner import run_benchmark
from ttsbuild.bench.schedule import ArrivalProcess, arrival_times

from .helpers import settings_for

RATE = 50.0
DURATION_S = 3.0
ATTEMPTS = 3  # best of three: one unlucky descheduling should not fail the suite
P99_LIMIT_S = 0.005
IDLE_MARGIN_S = 0.001


def idle_loop_lag_p99(rate: float, duration_s: float) -> float:
    """p99 lateness of a bare asyncio loop sleeping to the same Poisson schedule."""

    async def probe() -> list[float]:
        loop = asyncio.get_running_loop()
        origin = loop.time() + 0.05
        lateness = []
        for t in arrival_times(rate, duration_s, seed=0, process=ArrivalProcess.poisson):
            await asyncio.sleep(max(origin + t - loop.time(), 0.0))
            lateness.append(loop.time() - origin - t)
        return lateness

    return nearest_rank(asyncio.run(probe()), 99)


def _idle_probe_main(conn: Connection) -> None:
    conn.send("ready")
    conn.recv()  # start together with the harness run
    conn.send(idle_loop_lag_p99(RATE, DURATION_S))


def harness_and_idle_p99(http_url: str) -> tuple[float, float]:
    """(harness dispatch-lag p99, idle-loop p99), measured over the same seconds."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    probe = context.Process(target=_idle_probe_main, args=(theirs,), daemon=True)
    probe.start()
    try:
        assert ours.poll(30) and ours.recv() == "ready"
        ours.send("go")
        settings = settings_for(
            http_url, rate=RATE, duration_s=DURATION_S, arrival=ArrivalProcess.poisson
        )
        result = run_benchmark(settings, ["The birch canoe slid on the smooth planks."])
        requests = result.summary["requests"]
        assert requests["completed"] == requests["sent"] > 100
        assert ours.poll(30)
        return result.summary["timings"]["dispatch_lag_s"]["p99"], ours.recv()
    finally:
        probe.join(timeout=10)


def test_dispatch_lag_p99_under_5ms_at_50_rps():
    attempts = []  # (harness p99, bound) per attempt, seconds
    # The server runs in its own process so its work never holds this process's GIL.
    with serve_in_subprocess() as (http_url, _ws_url):
        for _ in range(ATTEMPTS):
            harness, idle = harness_and_idle_p99(http_url)
            bound = max(P99_LIMIT_S, idle + IDLE_MARGIN_S)
            attempts.append((harness, idle, bound))
            if harness < bound:
                return
    detail = "; ".join(
        f"harness {h * 1e3:.2f} ms, idle loop {i * 1e3:.2f} ms, bound {b * 1e3:.2f} ms"
        for h, i, b in attempts
    )
    raise AssertionError(f"harness dispatch-lag p99 too high in every attempt: {detail}")


def test_long_waits_allow_for_the_kernels_timer_slack():
    """Linux may end a timed wait 0.1 % of its length late: at 1 req/s that made every send
    ~1-2 ms late. The wait to a send is cut short by that much and finished in steps; a fake
    clock whose sleeps all run 0.1 % (+ the 1 ms epoll rounding) late checks it."""
    from ttsbuild.bench import runner

    class Clock:
        def __init__(self):
            self.now, self.sleeps = 0.0, []

        def time(self) -> float:
            return self.now

        async def sleep(self, seconds: float) -> None:
            self.sleeps.append(seconds)
            late = 0.001 * seconds + (0.001 if seconds > 0 else 0.0)  # slack + epoll rounding
            self.now += seconds + late if seconds > 0 else 1e-5  # sleep(0): one loop turn

    for gap in (0.02, 0.3, 1.0, 1.5, 4.0):
        clock = Clock()
        asyncio.run(runner._sleep_until(clock, gap, sleep=clock.sleep))
        late = clock.now - gap
        assert 0 <= late < 2e-5, (gap, late)  # the spin ends it, never a late timed wait
        timed = [s for s in clock.sleeps if s > 0]
        assert 1 <= len(timed) <= 4, (gap, timed)  # a few timed waits, not a busy loop
