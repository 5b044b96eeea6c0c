"""`ttsbuild serve` flags: bad values are usage errors (exit 2) before any model loads."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from ttsbuild.cli import app
from ttsbuild.serve.config import PROFILES, ProfileName, SchedulerConfig, ServeConfig
from ttsbuild.serve.service import SpeechService

from .fakes import FakeClock, FakeEngine


@pytest.mark.parametrize("value, message", [("0,2", "frame counts >= 1"),
                                            ("1,x", "comma-separated integers")])  # fmt: skip
def test_a_bad_chunk_schedule_is_a_usage_error(value, message):
    result = CliRunner().invoke(app, ["serve", "--random", "tiny", "--chunk-schedule", value])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_a_chunk_schedule_beyond_the_code_ring_is_refused_at_startup():
    engine = FakeEngine(FakeClock())
    too_long = replace(PROFILES[ProfileName.low_latency], chunk_schedule=(1, 2, 100))
    config = ServeConfig(scheduler=SchedulerConfig(profile=too_long))
    with pytest.raises(ValueError, match="at most 62 frames"):
        SpeechService(engine, config)
    fits = replace(too_long, chunk_schedule=(1, 2, 4, 8))
    SpeechService(engine, ServeConfig(scheduler=SchedulerConfig(profile=fits)))


def test_slots_default_to_256_on_a_gpu_and_stay_small_on_a_cpu(tiny_ckpt, tmp_path):
    """Without --slots: a GPU gets the 256 slots `compile` makes by default (measured on the
    H200), a CPU 8 for a checkpoint and the loader's default for --random weights, and a
    compiled engine its own plan."""
    from ttsbuild.build.engine_dir import ENGINE_FORMAT
    from ttsbuild.serve.cli import _default_slots

    assert _default_slots(tiny_ckpt, "cuda") == 256
    assert _default_slots(None, "cuda:1") == 256
    assert _default_slots(tiny_ckpt, "cpu") == 8
    assert _default_slots(None, "cpu") is None
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text(f'{{"format": "{ENGINE_FORMAT}"}}')
    assert _default_slots(engine, "cuda") is None


@pytest.mark.parametrize("flag, value", [("--max-audio-in-flight", "0"),
                                         ("--max-audio-in-flight", "9"),
                                         ("--codec-step-frames", "-1"),
                                         ("--lane-max-active", "-1"),
                                         ("--queue-timeout", "-1"),
                                         ("--overload-wait", "-0.5"),
                                         ("--standing-queue", "-1"),
                                         ("--overload-slack", "-0.01"),
                                         ("--overload-admit-rate", "-1")])  # fmt: skip
def test_scheduler_bounds_out_of_range_are_usage_errors(flag, value):
    result = CliRunner().invoke(app, ["serve", "--random", "tiny", flag, value])
    assert result.exit_code == 2
    assert flag in " ".join(result.output.split())


def test_the_admission_lane_switch_reaches_the_engine_and_the_metrics():
    """An engine with an admission lane gets a loop that switches it by load (lane_max_active):
    the switch sets the backend's lane_on, express admission follows, /metrics shows it; with
    lane_max_active 0 the lane is never switched."""
    from types import SimpleNamespace

    engine = FakeEngine(FakeClock())
    engine.backend = SimpleNamespace(concurrent_admission=True, lane_on=True, lane_codec_steps=1)
    service = SpeechService(engine, ServeConfig(scheduler=SchedulerConfig(lane_max_active=4)))
    loop, gauge = service.loop, service.metrics.lane
    assert loop.lane_switch is not None and loop.express and gauge._value.get() == 1
    loop._switch_lane(False)
    assert engine.backend.lane_on is False and not loop.express and gauge._value.get() == 0
    loop._switch_lane(True)
    assert engine.backend.lane_on is True and loop.express and gauge._value.get() == 1
    never = SpeechService(engine, ServeConfig(scheduler=SchedulerConfig(lane_max_active=0)))
    assert never.loop.lane_switch is None and never.loop.express


def _loader_arguments(monkeypatch, flags: list[str]) -> dict:
    """The keyword arguments `serve --random tiny --device cpu FLAGS` gives open_engine (a
    stand-in that stops the server there: exit 1 with its message)."""
    from ttsbuild.runtime import loader

    seen = {}

    def fake_open_engine(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(loader, "open_engine", fake_open_engine)
    result = CliRunner().invoke(app, ["serve", "--random", "tiny", "--device", "cpu", *flags])
    assert result.exit_code == 1 and "stop here" in result.output
    return seen


@pytest.mark.parametrize("flags, fit", [([], True), (["--slots", "16"], False)])
def test_serve_fits_its_default_slots_to_the_device_and_never_the_slots_asked_for(
    monkeypatch, flags, fit
):
    """Without --slots the engine may take fewer slots than the default where their KV cache
    would not fit (open_engine(fit_slots=True)); --slots is taken as given (a KV cache too
    large is then the engine's clear error, not a silent cut)."""
    seen = _loader_arguments(monkeypatch, flags)
    assert seen["fit_slots"] is fit
    assert seen["num_slots"] == (16 if flags else None)  # a CPU: --random's own default


@pytest.mark.parametrize("flags, fp8_cp, mega, regular", [
    ([], None, None, None),
    (["--fp8-code-predictor", "--megaframe-code-predictor"], True, True, None),
    (["--fp8-code-predictor", "--megaframe-code-predictor", "--megaframe-lane-only"], True,
     True, False),
    (["--no-fp8-code-predictor", "--no-megaframe-code-predictor", "--megaframe-regular"],
     False, False, True),
])  # fmt: skip
def test_serve_passes_the_code_predictor_choices_to_the_loader(monkeypatch, flags, fp8_cp, mega,
                                                               regular):
    """--fp8-code-predictor / --megaframe-code-predictor / --megaframe-lane-only reach
    open_engine as asked (None: the plan's); the loader's refusal of a bad pair is a message
    and exit 1, not a traceback."""
    seen = _loader_arguments(monkeypatch, flags)
    assert (seen["code_predictor_fp8"], seen["megaframe_code_predictor"],
            seen["megaframe_regular"]) == (fp8_cp, mega, regular)
    monkeypatch.undo()
    for bad_flags, message in ((["--megaframe-code-predictor"], "needs an FP8 code predictor"),
                               (["--megaframe-lane-only"], "it needs the kernel")):
        bad = CliRunner().invoke(app, ["serve", "--random", "tiny", "--device", "cpu",
                                       *bad_flags])  # fmt: skip
        assert bad.exit_code == 1 and message in " ".join(bad.output.split()), bad.output
        assert "Traceback" not in bad.output


@pytest.mark.parametrize("flags, kv_fp8", [([], None), (["--talker-kv-fp8"], True),
                                           (["--talker-kv-bf16"], False)])  # fmt: skip
def test_serve_passes_the_talker_kv_cache_choice_to_the_loader(
    monkeypatch, tiny_checkpoint, flags, kv_fp8
):
    """--talker-kv-fp8 / --talker-kv-bf16 reach open_engine (None: the engine's plan); on a
    checkpoint without k/v scales (not compiled with a calibration; random weights measure
    theirs) the FP8 cache is a message and exit 1, not a traceback."""
    assert _loader_arguments(monkeypatch, flags)["talker_kv_fp8"] is kv_fp8
    monkeypatch.undo()
    bad = CliRunner().invoke(app, ["serve", str(tiny_checkpoint), "--device", "cpu",
                                   "--engine", "graph", "--talker-kv-fp8"])  # fmt: skip
    assert bad.exit_code == 1, bad.output
    assert "compile the engine with a calibration" in " ".join(bad.output.split()), bad.output
    assert "Traceback" not in bad.output
