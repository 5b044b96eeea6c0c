"""Weight-only FP8 tile configs measured on one GPU model, per launch shape: a table instead
of the autotuner (and of `fp8_linear.wo_config`'s rule).

Why: the autotuner times each candidate in the serving process for 25 ms, one launch at a time
with L2 flushed, and its picks move between processes (an engine's code predictor at 64 rows
took 3.75-4.30 ms in three processes of one plan, H200) and differ from the configs that run
fastest back to back in a graph (benchmarks/runtime/2026-12-07-h100-rules). A sweep times a
grid of configs as the engine runs them and writes its winners here
(`benchmarks/kernels/sweep_fp8.py --table PATH`); TTSBUILD_FP8_WO_TABLE=PATH (read at import)
makes every launch of a shape in the table take its config, on the GPU model it was measured on
(another model's launches keep the autotuner, with a warning once).

The file (JSON):
    {"gpu": "NVIDIA H200", "configs": [{"rows": 16, "N": 4096, "K": 2048, "gate_up": false,
      "config": {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4,
                 "num_stages": 3}, "us": 7.64}, ...]}
rows: the launch's row tile (`fp8_linear.m_bucket`: 1 for one row, else 16 / 32 / 64 / 128),
N, K the output columns and the reduction (gate_up: N is each half's), us informative.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

ROW_TILES = (1, 16, 32, 64, 128)
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")

Key = tuple[int, int, int, bool]  # (rows, N, K, gate_up)


class WoTable:
    """The configs of one GPU model, by launch shape."""

    def __init__(self, gpu: str, configs: dict[Key, dict]):
        self.gpu = gpu
        self.configs = configs
        self._checked: dict[str, bool] = {}  # device name -> whether the table applies

    def lookup(self, rows: int, N: int, K: int, gate_up: bool, device_name: str) -> dict | None:
        """The config for this launch shape on a device of that name, or None."""
        applies = self._checked.get(device_name)
        if applies is None:
            applies = self._checked[device_name] = device_name == self.gpu
            if not applies:
                log.warning("the weight-only FP8 config table was measured on %s, not this %s: "
                            "not used", self.gpu, device_name)  # fmt: skip
        if not applies:
            return None
        c = self.configs.get((rows, N, K, bool(gate_up)))
        return dict(c) if c is not None else None


def _check_config(c: object, K: int, gate_up: bool, where: str) -> dict:
    # the kernel's own bounds: the split-K workspace's depth, gate_up's tile (imported here:
    # fp8_linear loads its table at import, after defining them)
    from ttsbuild.plugins._tl.fp8_linear import _MAX_SPLIT as MAX_SPLIT
    from ttsbuild.plugins._tl.fp8_linear import GATE_UP_MAX_TILE

    if not isinstance(c, dict) or set(c) != set(CONFIG_KEYS):
        raise ValueError(f"{where}: config needs exactly {', '.join(CONFIG_KEYS)}, got {c!r}")
    for k in CONFIG_KEYS:
        v = c[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {k} must be a positive integer, got {v!r}")
        if k != "num_stages" and v & (v - 1):
            raise ValueError(f"{where}: {k} must be a power of 2, got {v}")
    if c["SPLIT_K"] > MAX_SPLIT or c["num_stages"] > 8 or c["num_warps"] > 16:
        raise ValueError(f"{where}: SPLIT_K <= {MAX_SPLIT}, num_warps <= 16 and num_stages <= 8, "
                         f"got {c}")  # fmt: skip
    if K % (c["BLOCK_K"] * c["SPLIT_K"]):
        raise ValueError(f"{where}: K {K} is not a multiple of BLOCK_K x SPLIT_K "
                         f"({c['BLOCK_K']} x {c['SPLIT_K']})")  # fmt: skip
    if gate_up and c["BLOCK_N"] * c["BLOCK_K"] > GATE_UP_MAX_TILE:
        raise ValueError(f"{where}: gate_up tiles hold at most {GATE_UP_MAX_TILE} weights, got "
                         f"{c['BLOCK_N']} x {c['BLOCK_K']}")  # fmt: skip
    return dict(c)


def parse(data: object, source: str = "the table") -> WoTable:
    """A table from its JSON value; a clear ValueError for anything it cannot use."""
    if not isinstance(data, dict) or not isinstance(data.get("gpu"), str) or not data["gpu"]:
        raise ValueError(f"{source}: needs a \"gpu\" name and a \"configs\" list")
    entries = data.get("configs")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: \"configs\" must be a non-empty list")
    configs: dict[Key, dict] = {}
    for i, e in enumerate(entries):
        where = f"{source}, configs[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: an object, got {e!r}")
        rows, N, K, gate_up = e.get("rows"), e.get("N"), e.get("K"), e.get("gate_up", False)
        if rows not in ROW_TILES or isinstance(rows, bool):
            raise ValueError(f"{where}: rows must be a row tile, one of {ROW_TILES}, got {rows!r}")
        for name, v in (("N", N), ("K", K)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {v!r}")
        if not isinstance(gate_up, bool):
            raise ValueError(f"{where}: gate_up must be true or false, got {gate_up!r}")
        key = (rows, N, K, gate_up)
        if key in configs:
            raise ValueError(f"{where}: a second config for rows {rows}, N {N}, K {K}, "
                             f"gate_up {gate_up}")  # fmt: skip
        configs[key] = _check_config(e.get("config"), K, gate_up, where)
    return WoTable(data["gpu"], configs)


def load(path: str | Path) -> WoTable:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"TTSBUILD_FP8_WO_TABLE: no file {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return parse(data, str(path))


def from_sweep(report: dict, row_tile) -> dict:
    """The table's JSON value from a weight-only sweep's report (`sweep_fp8.py`: "gpu" and
    "results", each with shape, M, N, K and its best configs first in "top"): per row tile
    and shape, the winner at the most rows swept in that tile (the engine's buckets fill it
    up to there). row_tile: rows -> the launch's row tile (`fp8_linear.m_bucket`)."""
    best: dict[Key, dict] = {}
    for r in report["results"]:
        if not r.get("top"):
            continue
        key = (row_tile(r["M"]), r["N"], r["K"], bool(r.get("gate_up", False)))
        if key not in best or r["M"] > best[key]["at_rows"]:
            top = r["top"][0]
            best[key] = {"config": {k: top[k] for k in CONFIG_KEYS}, "us": round(top["us"], 3),
                         "at_rows": r["M"]}  # fmt: skip
    configs = [{"rows": k[0], "N": k[1], "K": k[2], "gate_up": k[3], **v}
               for k, v in sorted(best.items())]  # fmt: skip
    table = {"gpu": report["gpu"], "torch": report.get("torch"), "configs": configs}
    parse(table, "the sweep's table")  # what it writes, it can load
    return table
