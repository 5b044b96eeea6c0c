"""The codec decoder's streaming step as ONNX (fixed shape: batch 1, one frame per step).

`CodecStream` mutates its buffers in place; ONNX graphs are functional, so the exported
step takes the whole state as inputs and returns the new state as outputs:
    (codes int64 [1, Q, 1], state_0 .. state_{S-1})  ->  (wav [1, 1, 1920], new_state_0 ..)
with state_0 = frames decoded so far (int64 [1]) and the rest the conv tails, transposed-conv
spills and sliding-window K/V of `CodecStream.tensors()`, in that order, zeros at the start.
Exported with the TorchScript exporter (`dynamo=False`), which needs no onnxscript.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ttsbuild.model.codec import CodecDecoder, CodecStream

OPSET = 17


class CodecStep(nn.Module):
    """Functional wrapper: (codes, *state) -> (wav, *new_state)."""

    def __init__(self, codec: CodecDecoder):
        super().__init__()
        self.codec = codec
        self.stream = CodecStream(codec, 1)

    def forward(self, codes: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        st = self.stream
        fresh = [t.clone() for t in state]  # the step writes its new state into these
        st.pos = fresh[0]
        rest = iter(fresh[1:])
        st.buffers = [tuple(next(rest) for _ in group) for group in st.buffers]
        wav = self.codec.step(codes, st)
        return (wav, st.pos + codes.shape[-1], *(t for g in st.buffers for t in g))


def initial_state(codec: CodecDecoder) -> list[Tensor]:
    return [t.clone() for t in CodecStream(codec, 1, device="cpu").tensors()]


def export_codec_step(codec: CodecDecoder, path: str | Path) -> dict:
    """Write the step graph to `path`; returns its manifest entry (without the diff)."""
    codec = codec.float().cpu().eval()
    state = initial_state(codec)
    codes = torch.zeros(1, codec.config.num_quantizers, 1, dtype=torch.long)
    names = [f"state_{i}" for i in range(len(state))]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            CodecStep(codec), (codes, *state), str(path), dynamo=False, opset_version=OPSET,
            input_names=["codes", *names], output_names=["wav", *(f"new_{n}" for n in names)],
        )
    return {
        "file": Path(path).name,
        "kind": "streaming_step",
        "batch": 1,
        "frames_per_step": 1,
        "opset": OPSET,
        "exporter": f"torch.onnx.export(dynamo=False), torch {torch.__version__}",
        "state_inputs": len(state),
    }


@torch.no_grad()
def check_codec_onnx(codec: CodecDecoder, path: str | Path, steps: int = 4, seed: int = 0) -> float:
    """Max abs difference between onnxruntime (CPU) and `CodecStream` over `steps` frames."""
    import onnxruntime as ort

    codec = codec.float().cpu().eval()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(
        0, codec.config.codebook_size, (1, codec.config.num_quantizers, steps), generator=gen
    )
    stream = CodecStream(codec, 1, device="cpu")
    state = [t.numpy() for t in initial_state(codec)]
    worst = 0.0
    for i in range(steps):
        frame = codes[..., i : i + 1]
        ours = stream.step(frame).numpy()
        wav, *state = sess.run(
            None, {"codes": frame.numpy(), **{f"state_{j}": s for j, s in enumerate(state)}}
        )
        worst = max(worst, float(np.abs(wav - ours).max()))
    return worst
