"""FP8 calibration: run the model on real texts, record amax of every linear and the KV cache.

Submodules: `corpus` (calibration texts -> requests -> generated frames), `calibrate`
(modelopt max calibration, the calibration file), `cli` (the `ttsbuild calibrate` command).
Nothing is imported here, so the CLI does not pay for torch or modelopt at start-up.
"""
