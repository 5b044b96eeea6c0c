"""benchmarks/kernels/bench_chain.py: bad arguments are refused with exit 2, and each link of
its `hop` chain really hands the previous kernel's vector on (on CUDA, or on the CPU under
TRITON_INTERPRET=1), so the chain it times is a chain of dependent kernels."""

import torch
from helpers_scripts import script_fixture
from kernel_device import KDEV, needs_kernel

bench = script_fixture("benchmarks/kernels/bench_chain.py")


def test_bad_arguments_are_refused(bench, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for argv in (["--launches", "3"], ["--launches", "0"], ["--replays", "0"], ["--check"]):
        assert bench.main(argv) == 2
        assert "error:" in capsys.readouterr().err


@needs_kernel
def test_a_hop_hands_its_input_on(bench):
    x = torch.randn(bench.N, generator=torch.Generator().manual_seed(5)).to(KDEV, torch.bfloat16)
    for programs in (1, 8, 64):
        y = torch.full_like(x, 7.0)
        bench._hop_kernel[(programs,)](x, y, N=bench.N, PER=bench.N // programs, PDL=False)
        assert torch.equal(y, x)  # every element written, by the program that owns it
