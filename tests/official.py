"""Import the official Qwen3-TTS implementation (PyPI `qwen-tts`) as a parity reference.

`import qwen_tts` eagerly imports audio I/O and the 25 Hz tokenizer (librosa, soundfile,
sox, torchaudio), none of which the 12 Hz talker, code predictor or codec decoder use. We put
stand-in modules for them on the path; each raises if anything actually calls it, so a parity
test can never pass by going through a stand-in.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest


def _stub_module(name: str, attrs: tuple[str, ...] = ()) -> types.ModuleType:
    module = types.ModuleType(name)
    # transformers probes optional packages with find_spec, which needs a spec to exist.
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(f"{name} is a test stand-in: the parity path must not call it")

    for attr in attrs:
        setattr(module, attr, _unavailable)
    return module


def _install_stubs() -> None:
    stubs = {
        "librosa": _stub_module("librosa", ("load", "resample")),
        "librosa.filters": _stub_module("librosa.filters", ("mel",)),
        "soundfile": _stub_module("soundfile", ("read", "write")),
        "sox": _stub_module("sox"),
        "torchaudio": _stub_module("torchaudio"),
        "torchaudio.compliance": _stub_module("torchaudio.compliance"),
        "torchaudio.compliance.kaldi": _stub_module("torchaudio.compliance.kaldi", ("fbank",)),
    }
    stubs["librosa"].filters = stubs["librosa.filters"]
    stubs["torchaudio"].compliance = stubs["torchaudio.compliance"]
    stubs["torchaudio.compliance"].kaldi = stubs["torchaudio.compliance.kaldi"]
    for name, module in stubs.items():
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = module


def import_official():
    """Return the `qwen_tts.core` module, or fail loudly: parity tests are never skipped."""
    _install_stubs()
    try:
        import qwen_tts.core as core
        import qwen_tts.core.models as models
    except ImportError as exc:  # pragma: no cover - a broken test environment
        pytest.fail(f"the official qwen-tts package is required for parity tests: {exc}")
    return core, models
