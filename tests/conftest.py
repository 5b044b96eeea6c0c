import os
import pathlib
import sys

# fp32 Triton dots in IEEE fp32, not TF32 (Triton's default): the GPU kernel tests compare fp32
# paths with fp32 references at 1e-5 (on the H200, test_talker_fusions' fp32 stack was 5e-4
# off under TF32). Set before any test imports Triton; an explicit setting wins.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# Test helpers (tests/official.py, tests/model/reference_models.py) import by module name.
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "model"))
sys.path.insert(0, str(HERE / "voices"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A converted tiny random-weight stand-in (official layout -> ttsbuild checkpoint)."""
    from ttsbuild.convert.convert import convert_checkpoint
    from ttsbuild.convert.init_random import init_random

    root = tmp_path_factory.mktemp("tiny")
    init_random(root / "src", "tiny", seed=0)
    convert_checkpoint(root / "src", root / "ckpt")
    return root / "ckpt"


@pytest.fixture(scope="session")
def tiny_base_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A converted tiny Base (voice-clone) stand-in: speaker encoder and codec encoder too."""
    from ttsbuild.convert.convert import convert_checkpoint
    from ttsbuild.convert.init_random import init_random

    root = tmp_path_factory.mktemp("tiny-base")
    init_random(root / "src", "tiny-base", seed=0)
    convert_checkpoint(root / "src", root / "ckpt")
    return root / "ckpt"


def pytest_collection_modifyitems(config, items):
    """TTSBUILD_TEST_SHARD=i/n keeps every n-th collected test from the i-th: the interpreter
    kernel run (tests/plugins/test_fused_kernels.py) spreads its tests over the machine's
    cores this way."""
    import os

    shard = os.environ.get("TTSBUILD_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"TTSBUILD_TEST_SHARD={shard}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[t for k, t in enumerate(items) if k % count != index])
    items[:] = items[index::count]
