"""benchmarks/serve/overload_summary.py: issue 12's overload check read from a bench run:
refusals by the server's code and kind, how fast they were answered, and the admitted
streams' failures, underruns and p95 TTFA against the bound."""

from __future__ import annotations

import gzip
import json
import random

from helpers_scripts import script_fixture

overload = script_fixture("benchmarks/serve/overload_summary.py")


def refused(message: str, code: str, answered: float) -> dict:
    body = {"error": {"message": message, "type": "rate_limit_error", "param": None,
                      "code": code}}  # fmt: skip
    return {"warmup": False, "outcome": "rejected", "http_status": 429,
            "error": f"HTTP 429: {json.dumps(body)}", "headers_s": answered, "ttfa_s": None,
            "underruns": None}  # fmt: skip


def served(ttfa: float, underruns: int = 0, outcome: str = "ok") -> dict:
    return {"warmup": False, "outcome": outcome, "http_status": 200, "error": None,
            "headers_s": ttfa, "ttfa_s": ttfa, "underruns": underruns}  # fmt: skip


def test_refusals_by_kind_answer_times_and_the_target(overload, tmp_path):
    at_once = [refused("server busy: all 128 engine slots held, 3 requests queued; at the 90 "
                       "slots a second freed lately ...", "no_slot", random.uniform(1e-3, 4e-3))
               for _ in range(30)]  # fmt: skip
    later = [refused("no engine slot freed in the 0.03 s it waited", "no_slot", 0.031)] * 3
    later += [refused("no engine slot for it in the 0.03 s it waited: 2 free, 4 requests queued "
                      "before it", "no_slot", 0.03)] * 2  # fmt: skip
    behind = [refused("server at capacity: 2 admitted streams are behind their playback or "
                      "less than 60 ms from it; try again shortly", "capacity", 0.002)] * 5
    ttfas = [random.uniform(0.02, 0.06) for _ in range(100)]
    records = at_once + later + behind + [served(t) for t in ttfas]
    random.shuffle(records)
    run = tmp_path / "run"
    run.mkdir()
    with gzip.open(run / "requests.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    s = overload.summarize(overload.load(run), 170, 0.1)
    assert s["sent"] == 140 and s["rejected"] == 40 and s["admitted"] == 100
    assert s["rejected_by_reason"] == {"429 no_slot: at once: no slot in time": 30,
                                       "429 no_slot: after queueing: no slot": 5,
                                       "429 capacity: at once: streams behind": 5}  # fmt: skip
    assert s["refusal_answer_s"]["max"] == 0.031
    assert s["refusal_answer_s"]["p50"] < 0.004
    assert s["admitted_ttfa_p95_s"] == sorted(ttfas)[94] and s["meets_target"]
    assert "| 170 req/s | 140 | 40 |" in overload.table(s)
    # one admitted stream that underran, or a p95 over the bound, fails the target
    assert not overload.summarize(records + [served(0.05, underruns=1)], 170, 0.1)["meets_target"]
    slow = records + [served(0.5) for _ in range(10)]
    assert not overload.summarize(slow, 170, 0.1)["meets_target"]
    assert not overload.summarize([r for r in records if r["outcome"] == "rejected"], 170,
                                  0.1)["meets_target"]  # nothing admitted
