"""Custom decode kernels (Triton) with eager PyTorch references.

Every public op here has a reference written in plain PyTorch in the same module and a
`use_triton` switch: None (default) picks the Triton kernel for CUDA tensors when Triton
imports, else the reference. Triton is imported lazily (only inside the `_tl` modules), so
the package imports and its references run on machines without a GPU or Triton.

- fp8_linear: weight-only FP8 (e4m3, per-output-channel fp32 scales) skinny GEMM/GEMV.
- qk_norm_rope: per-head RMSNorm on q and k + rotate-half RoPE + K/V cache write.
- decode_attention: single-query GQA attention over a slot-indexed cache, per-row lengths.
- norm_act: RMSNorm, residual add + RMSNorm, silu(gate) * up, the codec's SnakeBeta.
- fused_linear: a decode linear (bf16 or FP8 weight-only) with a row-gather / RMSNorm
  prologue and a bias / silu(gate) * up / residual-add epilogue: the decoder layer in 4 GEMVs.
- qk_norm_rope_attend: qk_norm_rope + decode_attention in one launch for short caches (the
  code predictor's <= 17 positions).
- sampling: temperature / top-k / top-p / Gumbel-max draw, bit-identical to
  `ttsbuild.generation.sampling.sample`, optionally with the repetition penalty.
"""
