"""Whether speculation pays at batch 1, from a draft's measured acceptance (`compile
--speculative auto`).

A frame's codebooks 2..G-1 (14 of them) take one plain pass each without speculation; with a
window of k, each round drafts k codebooks and verifies them in one pass over k + 1 positions:
it decides the accepted prefix plus one code. So what a round buys depends on acceptance, which
random weights cannot tell (`benchmarks/spec/2026-12-05-h200-tokens-parallel/`: 0.5-0.8 per
depth on one random code predictor, 0.07 on another), and what it costs on the GPU it runs on.
`distill-draft` measures acceptance per drafted depth on the target's own frames (held out) for
its trained heads and for the target's own (the self draft) and writes both into the draft's
metadata; this module turns them into an expected frame time per (kind, window) with the round
and pass costs measured on the H200 and picks the fastest, or none.

Only batch 1: a batch runs as many rounds as its slowest row, and at batch 8 speculation lost
on every stand-in measured (0.53-0.96x), so larger buckets stay off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The 1.7B CustomVoice code predictor at batch 1, bf16, fused kernels, PDL on, the rounds one
# WHILE node (H200, 2026-12-05, benchmarks/spec/2026-12-05-h200-tokens-parallel/call1): the
# plain frame 2.02-2.03 ms for 15 passes; speculative frames of 7-11 passes at windows 2-4
# fit first + rounds x round(window) with the first pass ~0.15 ms and a round 0.23-0.25 ms.
PLAIN_PASS_MS = 0.135
FIRST_PASS_MS = 0.15
# windows 2-4 fitted; window 1 and windows above 4 (+0.01 ms a depth) extrapolated, not timed
ROUND_MS = {1: 0.226, 2: 0.231, 3: 0.235, 4: 0.248}
MIN_GAIN = 0.05  # on only when the expected frame is at least 5 % faster


def round_ms(window: int) -> float:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    top = max(ROUND_MS)
    return ROUND_MS[window] if window in ROUND_MS else ROUND_MS[top] + 0.01 * (window - top)


def expected_rounds(acceptance: list[float], window: int, codes: int = 14) -> float:
    """Expected rounds to decide `codes` codebooks when the draft at depth t (1..window) is
    accepted with probability acceptance[t - 1], independently: a round decides its accepted
    prefix plus one code (the first rejection's resample, or the bonus code after all k)."""
    if not 1 <= window <= len(acceptance):
        raise ValueError(f"window {window} needs acceptance for depths 1..{window}, "
                         f"got {len(acceptance)}")  # fmt: skip
    if any(not 0.0 <= a <= 1.0 for a in acceptance[:window]):
        raise ValueError(f"acceptance must be within [0, 1], got {acceptance[:window]}")
    # P(a round decides j + 1 codes): the first j drafts accepted, then a rejection (or j = k)
    decided, reach = [], 1.0
    for j in range(window + 1):
        stop = 1.0 if j == window else 1.0 - acceptance[j]
        decided.append((j + 1, reach * stop))
        if j < window:
            reach *= acceptance[j]

    rounds = [0.0] * (codes + 1)  # rounds[n]: expected rounds with n codebooks left
    for left in range(1, codes + 1):
        rounds[left] = 1.0 + sum(p * rounds[max(left - n, 0)] for n, p in decided)
    return rounds[codes]


def expected_frame_ms(acceptance: list[float], window: int) -> float:
    return FIRST_PASS_MS + expected_rounds(acceptance, window) * round_ms(window)


def plain_frame_ms(groups: int = 16) -> float:
    return (groups - 1) * PLAIN_PASS_MS


@dataclass(frozen=True)
class Choice:
    kind: str | None  # "self" / "draft", or None: speculation off
    window: int
    expected_ms: float  # the code predictor's frame at batch 1, speculation as chosen
    plain_ms: float  # and without speculation
    considered: dict  # "kind k=window" -> expected ms

    def plan(self) -> dict[int, tuple[str, int]]:
        return {} if self.kind is None else {1: (self.kind, self.window)}


def choose(acceptance: dict[str, list[float]], max_window: int | None = None,
           exact: bool = False) -> Choice:  # fmt: skip
    """The fastest (kind, window) at batch 1 by expected frame time, or off where none is
    MIN_GAIN faster than the plain frame. acceptance: kind -> per-depth acceptance under the
    standard rule; exact: verification by exact match, priced at `exact_acceptance` of it."""
    plain = plain_frame_ms()
    considered, best = {}, None
    for kind, acc in sorted(acceptance.items()):
        acc = exact_acceptance(acc) if exact else acc
        for window in range(1, min(len(acc), max_window or len(acc)) + 1):
            ms = expected_frame_ms(acc, window)
            considered[f"{kind} k={window}"] = round(ms, 4)
            if best is None or ms < best[0]:
                best = (ms, kind, window)
    if best is None or best[0] > (1.0 - MIN_GAIN) * plain:
        return Choice(None, 0, plain, plain, considered)
    return Choice(best[1], best[2], best[0], plain, considered)


def exact_acceptance(acceptance: list[float]) -> list[float]:
    """A lower bound of the per-depth acceptance of exact-match verification (the draft drawn
    with the target draw's noise, kept only where equal: EnginePlan.speculative_exact) from the
    standard rule's a = 1 - TV: shared-noise (Gumbel) coupling matches with probability at
    least (1 - TV) / (1 + TV) = a / (2 - a). On the 1.7B stand-in's self draft: 0.425 ->
    0.300 measured, 0.270 by the bound (benchmarks/spec/coupled_acceptance.py)."""
    return [a / (2.0 - a) for a in acceptance]


def draft_acceptance(meta: dict[str, str]) -> dict[str, list[float]]:
    """kind -> per-depth acceptance from a draft's metadata (`distill-draft` writes
    `acceptance` for its heads and `self_acceptance` for the target's own); a draft without
    them (made elsewhere) gives {}."""
    out = {}
    for kind, key in (("draft", "acceptance"), ("self", "self_acceptance")):
        if key not in meta:
            continue
        try:
            values = [float(a) for a in json.loads(meta[key])]
        except (ValueError, TypeError):
            raise ValueError(f"draft metadata {key} is not a JSON list of numbers: "
                             f"{meta[key]!r}") from None  # fmt: skip
        if not values or any(not 0.0 <= a <= 1.0 for a in values):
            raise ValueError(f"draft metadata {key} must be acceptances in [0, 1], got {values}")
        out[kind] = values
    return out
