"""The harness must add no measurable lag of its own at 50 requests/s."""

from ttsbuild.bench.fakeserver import serve_in_subprocess
from ttsbuild.bench.runner import run_benchmark
from ttsbuild.bench.schedule import ArrivalProcess

from .helpers import settings_for

ATTEMPTS = 3  # a shared CI machine can be descheduled for milliseconds: best of three
P99_LIMIT_S = 0.005


def test_dispatch_lag_p99_under_5ms_at_50_rps():
    p99s = []
    # The server runs in its own process so its work never holds this process's GIL.
    with serve_in_subprocess() as (http_url, _ws_url):
        for _ in range(ATTEMPTS):
            settings = settings_for(
                http_url, rate=50.0, duration_s=3.0, arrival=ArrivalProcess.poisson
            )
            result = run_benchmark(settings, ["The birch canoe slid on the smooth planks."])
            requests = result.summary["requests"]
            assert requests["completed"] == requests["sent"] > 100
            p99s.append(result.summary["timings"]["dispatch_lag_s"]["p99"])
            if p99s[-1] < P99_LIMIT_S:
                break
    assert min(p99s) < P99_LIMIT_S, f"dispatch-lag p99 per attempt (s): {p99s}"
