"""Issue 12's overload check, read from one `ttsbuild bench run` (`requests.jsonl` or
`.jsonl.gz`): the excess must get 429 at once, the admitted streams 0 underruns, 0 failures
and p95 audible TTFA within the bound. Prints one table row and the refusals by reason (the
server's error code, and for `no_slot` whether at once or after queueing), with how long the
refused requests waited for their answer (p50 / p95 / max), and writes overload.json.

    python benchmarks/serve/overload_summary.py RUN_DIR --rate 170 [--slo-ttfa 0.1] [--out F]

(`benchmarks/serve/overload.sh` runs the server, the load and then this.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # underruns.py, beside this one

from underruns import load  # noqa: E402

from ttsbuild.bench.metrics import nearest_rank  # noqa: E402

# the server's message for each way of refusing (ttsbuild/serve/scheduler.py)
KINDS = (
    ("slots held", "at once: no slot in time"),
    ("no engine slot", "after queueing: no slot"),  # freed, or free but for those before it
    ("stayed at capacity", "after queueing: capacity"),
    ("behind their playback", "at once: streams behind"),
    ("real-time streams' worth", "at once: demand over supply"),
    ("requests queued", "at once: queue full"),
    ("unsent", "at once: audio unsent"),
)


def reason(record: dict) -> str:
    """'STATUS code: kind' of a refused request, from the error body the bench kept."""
    error = record.get("error") or ""
    code = re.search(r'"code"\s*:\s*"([^"]+)"', error)
    kind = next((name for key, name in KINDS if key in error), "other")
    return f"{record.get('http_status')} {code.group(1) if code else '?'}: {kind}"


def summarize(records: list[dict], rate: float, slo_ttfa_s: float) -> dict:
    rejected = [r for r in records if r["outcome"] == "rejected"]
    admitted = [r for r in records if r["outcome"] != "rejected"]
    outcomes = Counter(r["outcome"] for r in admitted)
    ttfa = [r["ttfa_s"] for r in admitted if r["ttfa_s"] is not None]
    answered = [r["headers_s"] for r in rejected if r.get("headers_s") is not None]
    underrun_requests = sum(1 for r in admitted if (r["underruns"] or 0) > 0)
    p95 = nearest_rank(ttfa, 95)
    summary = {
        "rate": rate,
        "sent": len(records),
        "rejected": len(rejected),
        "rejected_by_reason": dict(Counter(reason(r) for r in rejected)),
        "refusal_answer_s": {"p50": nearest_rank(answered, 50), "p95": nearest_rank(answered, 95),
                             "max": max(answered, default=None)},  # fmt: skip
        "admitted": len(admitted),
        "admitted_outcomes": dict(outcomes),
        "admitted_underrun_requests": underrun_requests,
        "admitted_underruns": sum(r["underruns"] or 0 for r in admitted),
        "admitted_ttfa_p50_s": nearest_rank(ttfa, 50),
        "admitted_ttfa_p95_s": p95,
    }
    summary["meets_target"] = bool(
        admitted and outcomes.get("failed", 0) == 0 and outcomes.get("timeout", 0) == 0
        and underrun_requests == 0 and p95 is not None and p95 <= slo_ttfa_s
    )  # fmt: skip
    return summary


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"


def table(s: dict) -> str:
    o, a = s["admitted_outcomes"], s["refusal_answer_s"]
    return "\n".join([
        "| offered | sent | 429/503 | answered in p50 / p95 / max | admitted | ok | failed | "
        "timed out | underrun requests | TTFA p50 | TTFA p95 | target met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['rate']:g} req/s | {s['sent']} | {s['rejected']} | {ms(a['p50'])} / "
        f"{ms(a['p95'])} / {ms(a['max'])} | {s['admitted']} | {o.get('ok', 0)} | "
        f"{o.get('failed', 0)} | {o.get('timeout', 0)} | {s['admitted_underrun_requests']} | "
        f"{ms(s['admitted_ttfa_p50_s'])} | {ms(s['admitted_ttfa_p95_s'])} | "
        f"{'yes' if s['meets_target'] else 'NO'} |",
    ])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the bench run's directory (requests.jsonl[.gz])")
    p.add_argument("--rate", type=float, required=True, help="the offered rate, req/s")
    p.add_argument("--slo-ttfa", type=float, default=0.1, help="p95 audible TTFA bound, s")
    p.add_argument("--out", type=Path, help="overload.json (default: beside the run)")
    a = p.parse_args()
    summary = summarize(load(a.run), a.rate, a.slo_ttfa)
    out = a.out or a.run.parent / "overload.json"
    out.write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print("refusals by reason:", summary["rejected_by_reason"] or "none")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
