"""What to send and when: a deterministic open-loop arrival schedule and prompt sequence.

Determinism: the seed alone fixes (a) the sequence of unit-rate inter-arrival gaps and (b) the
prompt/voice sequence. The rate only scales the gaps, so the same seed replays the same prompts,
in the same order, against any target and at any rate, and the same seed + rate replays
identical send times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path

import numpy as np

# Prompt sets shipped in ttsbuild/data, by the short name `--dataset` accepts.
BUILTIN_DATASETS = {
    "harvard": "harvard720.txt",  # 720 Harvard sentences, ~39 characters each
    "voice-agent": "voice_agent.jsonl",  # 720 voice-agent replies, 15-250 characters, mean ~90
}
DEFAULT_DATASET = "harvard"

# Independent random streams derived from the one user seed, so that changing how many
# arrivals are drawn never shifts the prompt sequence (and vice versa).
_ARRIVAL_STREAM = 0
_PROMPT_STREAM = 1


class ArrivalProcess(StrEnum):
    poisson = "poisson"  # exponential inter-arrival gaps: the classic open-loop model
    constant = "constant"  # exactly 1/rate apart


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # position in the run, 0-based
    send_at_s: float  # scheduled send time, seconds after the run starts
    text: str
    voice: str
    warmup: bool  # sent but excluded from summaries


def arrival_times(rate: float, horizon_s: float, seed: int, process: ArrivalProcess) -> np.ndarray:
    """Send times in [0, horizon_s), seconds, shape (n,), increasing.

    Poisson: the first arrival comes one exponential gap after t=0, like every later one.
    Constant: arrivals at 0, 1/rate, 2/rate, ...
    """
    if process is ArrivalProcess.constant:
        count = int(np.ceil(horizon_s * rate - 1e-9))
        times = np.arange(count, dtype=np.float64) / rate
        return times[times < horizon_s]
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    expected = horizon_s * rate
    gaps = rng.standard_exponential(int(expected + 10 * np.sqrt(expected) + 16))
    times = np.cumsum(gaps) / rate
    while times[-1] < horizon_s:  # rare: draw more, continuing the same stream
        more = np.cumsum(rng.standard_exponential(len(gaps))) / rate + times[-1]
        times = np.concatenate([times, more])
    return times[times < horizon_s]


def prompt_order(num_prompts: int, count: int, seed: int) -> np.ndarray:
    """Indices into the dataset, shape (count,): shuffled passes over the whole dataset, so
    every prompt is used once before any repeats (no accidental cache-friendly repeats)."""
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    passes = -(-count // num_prompts)
    order = np.concatenate([rng.permutation(num_prompts) for _ in range(max(passes, 1))])
    return order[:count]


def plan_requests(
    prompts: list[str],
    voices: list[str],
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
    process: ArrivalProcess,
) -> list[PlannedRequest]:
    """The whole run: warmup arrivals in [0, warmup_s), measured ones up to warmup_s+duration_s.
    Voices rotate in request order, so each voice sees the same load shape."""
    times = arrival_times(rate, warmup_s + duration_s, seed, process)
    order = prompt_order(len(prompts), len(times), seed)
    return [
        PlannedRequest(
            index=i,
            send_at_s=float(t),
            text=prompts[int(p)],
            voice=voices[i % len(voices)],
            warmup=bool(t < warmup_s),
        )
        for i, (t, p) in enumerate(zip(times, order, strict=True))
    ]


def load_prompts(dataset: str | Path | None) -> list[str]:
    """A shipped set by name (BUILTIN_DATASETS; None: DEFAULT_DATASET), else a .txt file (one
    prompt per line) or .jsonl ({"text": ...} per line); blank lines are skipped. A name wins
    over a file of the same name in the working directory (write ./name for the file).
    Raises ValueError for the user."""
    name = DEFAULT_DATASET if dataset is None else str(dataset)
    if name in BUILTIN_DATASETS:
        filename = BUILTIN_DATASETS[name]
        text = resources.files("ttsbuild").joinpath("data").joinpath(filename).read_text("utf-8")
        return _parse_lines(text, jsonl=filename.endswith(".jsonl"), name=filename)
    path = Path(name)
    if not path.is_file():
        names = ", ".join(BUILTIN_DATASETS)
        raise ValueError(f"dataset file {str(path)!r} does not exist (built-in sets: {names})")
    jsonl = path.suffix.lower() in {".jsonl", ".ndjson"}
    prompts = _parse_lines(path.read_text("utf-8"), jsonl=jsonl, name=str(path))
    if not prompts:
        raise ValueError(f"dataset file {str(path)!r} has no prompts")
    return prompts


def _parse_lines(text: str, *, jsonl: bool, name: str) -> list[str]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{name}:{lineno}: expected an object with a "text" string')
            line = record["text"].strip()
            if not line:
                continue
        prompts.append(line)
    return prompts
