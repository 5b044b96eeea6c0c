"""Test helpers for code outside the package: the repo's benchmark scripts (loaded as
modules) and subprocesses run side by side."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at ROOT/relative as a module, registered in sys.modules under its stem (a
    dataclass looks its module up there); `unload_script` takes it out again."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def unload_script(module: ModuleType) -> None:
    sys.modules.pop(module.__name__, None)


def script_fixture(relative: str):
    """A module-scoped fixture of the script at ROOT/relative (`load_script`), unloaded after
    the module's tests: `sim = script_fixture("benchmarks/serve/admission_sim.py")`."""

    @pytest.fixture(scope="module")
    def script():
        module = load_script(relative)
        yield module
        unload_script(module)

    return script


def communicate_all(processes: list[subprocess.Popen], timeout: float) -> list[tuple]:
    """(returncode, stdout, stderr) of processes started side by side; every one still running
    is killed when any of them fails to finish in `timeout` seconds (none outlives the test)."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]
