"""Which refusals of the CUDA step driver raise and which crash (GPU host, repo root).

`tests/runtime/test_driver_host.py::test_host_buffers_that_would_make_a_copy_wait_are_refused`
died of a segmentation fault on the H200 (2026-12-02) at its first refused launch, where the
CPU build raises a RuntimeError. Each case here runs in a child process of its own, so one
crash does not hide the others; a crash is retried under gdb (when the host has it) for the
native backtrace.

    python3 benchmarks/runtime/driver_errors_probe.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys

SETUP = """
import torch
from ttsbuild.runtime.driver import make_driver
drv = make_driver(torch.device("cuda"))
src = torch.randn(4, 6, device="cuda")
pinned = torch.zeros(4, 8).pin_memory()
"""

CASES = {
    "bad lane priority (TORCH_CHECK before any CUDA call)": "drv.add_lane(False, False, 5)",
    "unknown ticket": "drv.wait(12345)",
    "pair count mismatch": "drv.launch(lambda: None, [], [], [src], [])",
    "pair shape mismatch": "drv.launch(lambda: None, [], [], [src], [pinned])",
    "strided pinned destination": "drv.launch(lambda: None, [], [], [src], [pinned[:, :6]])",
    "pageable destination": "drv.launch(lambda: None, [], [], [src], [torch.zeros(4, 6)])",
    "pageable source": "drv.launch(lambda: None, [torch.zeros(4, 6)], [src], [], [])",
    "a good launch": "out = pinned.view(-1)[:24].view(4, 6); drv.wait(drv.launch(lambda: None, "
                     "[], [], [src], [out])); assert torch.equal(out, src.cpu())",
}

BODY = """
try:
    {call}
    print("RESULT ok (no error)")
except RuntimeError as exc:
    print("RESULT RuntimeError:", str(exc).splitlines()[0][:160])
"""


def run(call: str, gdb: bool) -> tuple[int, str]:
    code = SETUP + BODY.format(call=call)
    cmd = [sys.executable, "-X", "faulthandler", "-c", code]
    if gdb:
        cmd = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def main() -> int:
    crashed = 0
    for name, call in CASES.items():
        rc, out = run(call, gdb=False)
        result = [line for line in out.splitlines() if line.startswith("RESULT")]
        print(f"{name:55s} rc={rc:4d} {result[0] if result else 'no result (crashed)'}")
        if rc != 0 and not result:
            crashed += 1
            print("   " + "\n   ".join(out.strip().splitlines()[-8:]))
            if shutil.which("gdb"):
                _, trace = run(call, gdb=True)
                frames = [line for line in trace.splitlines() if line.startswith("#")]
                print("   gdb:\n   " + "\n   ".join(frames[:25]))
            else:
                print("   (no gdb on this host)")
    print(f"{crashed} of {len(CASES)} cases crashed")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
