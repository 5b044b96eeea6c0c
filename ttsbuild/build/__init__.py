"""Engine building: `ttsbuild compile` turns a checkpoint (+ calibration) into an engine dir.

Submodules: `pack` (fused q/k/v and gate/up weights, FP8 weight groups), `codec_fold`
(`FoldedCodec`), `onnx_codec` (the codec step as ONNX), `quality` (FP8 vs bf16 under teacher
forcing), `compile` (`compile_engine_dir`), `engine_dir` (manifest schema, `load_engine_dir`,
`models_from_engine`), `cli` (the `ttsbuild compile` command). Nothing is imported here.
"""
