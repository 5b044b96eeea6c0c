"""Strip a Triton cache to what a cache hit loads, so it fits the device call's carry.

    python3 benchmarks/runtime/strip_triton_cache.py /tmp/tc

Each compiled kernel is a group in the cache (`__grp__<name>.json` listing its files): the
metadata JSON, the binary (`.cubin`) and the compiler's intermediate forms (`.source`,
`.ttir`, `.ttgir`, `.llir`, `.ptx`). A cache hit builds the kernel from the group's files,
and only the metadata and the binary are used to launch it; the intermediates are for
inspection. A group that names a missing file is a miss (Triton 3.x `get_group`), so the
intermediates are dropped from the group's list as well as from disk. A 1.7B engine's cache
came back at 45 MB compressed (2026-12-07), too big to carry beside `.whl` and the driver
(64 MiB in all), and every session's first engine then compiled for ~5 min.
A tool that reads a cached kernel's PTX (`benchmarks/codec/ptx_loads.py`) needs the kernel
compiled again: run it with TRITON_ALWAYS_COMPILE=1 or its own TRITON_CACHE_DIR.
Prints the bytes before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEEP = (".json", ".cubin")  # what a cache hit needs: the metadata and the binary


def strip(cache: Path) -> tuple[int, int]:
    """Strip every group under `cache` in place; returns (bytes before, bytes after)."""
    before = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    for group in cache.rglob("__grp__*.json"):
        data = json.loads(group.read_text())
        children = data.get("child_paths")
        if not isinstance(children, dict):
            continue
        kept = {name: path for name, path in children.items() if name.endswith(KEEP)}
        if not any(name.endswith(".json") for name in kept) or len(kept) == len(children):
            continue  # not a kernel's group (no metadata), or nothing to drop
        for name, path in children.items():
            if name not in kept:
                # the group's paths are absolute, as written on the host that compiled
                # them: the file beside the group of the same name is the one to drop
                (group.parent / Path(path).name).unlink(missing_ok=True)
        group.write_text(json.dumps({**data, "child_paths": kept}))
    after = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    return before, after


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", type=Path)
    a = p.parse_args()
    if not a.cache.is_dir():
        raise SystemExit(f"{a.cache}: not a directory")
    before, after = strip(a.cache)
    print(f"Triton cache {a.cache}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
