"""How the C++ step driver links the C++ runtime (setup.py and the just-in-time build).

No torch import here: setup.py imports this beside torch, and the answer depends only on which
libstdc++ the process has mapped."""

from __future__ import annotations

from pathlib import Path


def mapped_libstdcxx(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The shared libstdc++ this process has mapped (torch's, once torch is imported), or None
    where there is none or no /proc."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split()[-1] if line.split() else ""
        if "/libstdc++.so" in path and Path(path).exists():
            return path
    return None


def cxx_runtime_link_args() -> list[str]:
    """Linker inputs that bind the driver to the process's shared libstdc++, whatever the
    compiler adds: a g++ given -static-libstdc++ (or configured to default to it) rewrites a
    plain -lstdc++ into a static one, but passes a file path to the linker unchanged, and
    the archive it appends later then has nothing left to resolve."""
    path = mapped_libstdcxx()
    return [path] if path else ["-Wl,-lstdc++"]
