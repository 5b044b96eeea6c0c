"""Host time of resolving a request at the edge (`plan_admission`: tokenize, lay out the
prompt, resolve sampling and the frame limit), on the CPU, on the voice-agent prompt set, next
to the tokenizer alone both ways: the word table (`TextTokenizer.encode`, ASCII words looked up)
and `tokenizers` encoding each piece whole (the path before the table).

    python benchmarks/runtime/resolve_cost.py [--variant tiny] [--rounds 3]

The tokenizer and the layout code are the same for every variant (the tiny model's layout has
the 1.7B's shape); the engine bench's `host_resolve` on the H200 host is this plus
`GraphBackend.prepare`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

from ttsbuild.generation.guards import GuardConfig
from ttsbuild.generation.prompt import assistant_text
from ttsbuild.runtime.engine import plan_admission, random_models
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest


def _median_us(fn, items) -> float:
    times = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variant", default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    lines = resources.files("ttsbuild.data").joinpath("voice_agent.jsonl").read_text()
    texts = [json.loads(line)["text"] for line in lines.splitlines() if line.strip()]
    models = random_models(a.variant, device="cpu")
    plan, guards = EnginePlan.default(num_slots=8, max_len=2048), GuardConfig()
    tok = models.tokenizer

    def whole(text: str) -> list[int]:  # each plain piece through `tokenizers`, as before
        ids = []
        for piece in tok._pieces(text):
            added = tok._added_by_content.get(piece)
            ids += [added.id] if added else tok._bpe.encode(piece, add_special_tokens=False).ids
        return ids

    prompts = [assistant_text(t) for t in texts]
    print(f"{len(texts)} voice-agent prompts, mean {statistics.mean(map(len, texts)):.0f} chars")
    for r in range(a.rounds):  # the first round fills the word table
        resolve = _median_us(lambda t: plan_admission(
            models, SynthesisRequest(text=t, voice=models.voices[0], seed=0), plan, guards), texts)
        table = _median_us(tok.encode, prompts)
        plain = _median_us(whole, prompts)
        print(f"round {r}: plan_admission {resolve:.1f} us; tokenize {table:.1f} us with the word "
              f"table, {plain:.1f} us through tokenizers whole")  # fmt: skip


if __name__ == "__main__":
    main()
