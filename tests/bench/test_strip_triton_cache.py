"""benchmarks/runtime/strip_triton_cache.py: a kernel's group keeps its metadata and binary,
loses the compiler's intermediate forms from disk and from its list, and Triton's own cache
manager still finds the group whole afterwards."""

from __future__ import annotations

import json
import os

import pytest
from helpers_scripts import script_fixture

strip_cache = script_fixture("benchmarks/runtime/strip_triton_cache.py")

IR = (".source", ".ttir", ".ttgir", ".llir", ".ptx")


def _kernel_group(cache_dir, name: str, rng) -> dict:
    """A compiled kernel's files as Triton writes them (random bytes), and its group."""
    cache_dir.mkdir(parents=True)
    children = {}
    for ext in (*IR, ".cubin", ".json"):
        path = cache_dir / f"{name}{ext}"
        body = {"name": name, "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}
        if ext == ".json":
            path.write_text(json.dumps(body))
        else:
            path.write_bytes(rng.randbytes(rng.randint(1000, 5000)))
        children[path.name] = str(path)
    (cache_dir / f"__grp__{name}.json").write_text(json.dumps({"child_paths": children}))
    return children


def test_strip_keeps_what_a_cache_hit_loads(strip_cache, tmp_path, monkeypatch):
    import random

    rng = random.Random(7)
    cache = tmp_path / "tc"
    a = _kernel_group(cache / "aaaa", "fp8_linear_kernel", rng)
    b = _kernel_group(cache / "bbbb", "codec_conv", rng)
    launcher = cache / "cccc" / "__triton_launcher.so"  # no group: left alone
    launcher.parent.mkdir()
    launcher.write_bytes(rng.randbytes(2048))
    before, after = strip_cache.strip(cache)
    assert before > after > 0
    for key, name, children in (("aaaa", "fp8_linear_kernel", a), ("bbbb", "codec_conv", b)):
        group = json.loads((cache / key / f"__grp__{name}.json").read_text())["child_paths"]
        assert sorted(group) == [f"{name}.cubin", f"{name}.json"]
        for child, path in children.items():
            assert os.path.exists(path) == (child in group)
    assert launcher.exists()
    # bytes left: the binaries, the metadata, the groups and the launcher
    left = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert left == after
    # idempotent: a second pass finds nothing to drop
    assert strip_cache.strip(cache) == (after, after)

    triton_cache = pytest.importorskip("triton.runtime.cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    manager = triton_cache.FileCacheManager("aaaa")
    if not str(manager.cache_dir).startswith(str(cache)):
        pytest.skip("this Triton does not read TRITON_CACHE_DIR at construction")
    found = manager.get_group("fp8_linear_kernel.json")
    assert found is not None and sorted(found) == [
        "fp8_linear_kernel.cubin",
        "fp8_linear_kernel.json",
    ]


def test_strip_leaves_groups_without_metadata_alone(strip_cache, tmp_path):
    cache = tmp_path / "tc"
    d = cache / "dddd"
    d.mkdir(parents=True)
    (d / "x.ptx").write_text("ptx")
    (d / "__grp__x.json").write_text(json.dumps({"child_paths": {"x.ptx": str(d / "x.ptx")}}))
    assert strip_cache.strip(cache)[0] == strip_cache.strip(cache)[1]
    assert (d / "x.ptx").exists()
