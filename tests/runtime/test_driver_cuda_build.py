"""The step driver's CUDA code path compiles, checked where CUDA headers exist but torch is a
CPU build (the CI machine and the development machine): the CUDA-only parts of
`csrc/step_driver.cpp` are otherwise first compiled on the GPU host, where a mistake costs
device time. g++ -fsyntax-only against torch's headers and the CUDA runtime headers; the few
library headers a CPU wheel's ATen/cuda headers name but do not need here (cuBLAS, cuSPARSE,
cuSOLVER, the CMake macros) are stubbed. The WHILE-node source (`csrc/graph_while.cu`, device
code) is compiled by nvcc for sm_90 where nvcc exists (this machine; not the CI machine)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as ext
from helpers_scripts import communicate_all

SOURCE = Path(__file__).resolve().parents[2] / "ttsbuild" / "csrc" / "step_driver.cpp"
WHILE_SOURCE = SOURCE.with_name("graph_while.cu")
CUDA_INCLUDE = Path(ext.CUDA_HOME or "/usr/local/cuda") / "include"
STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n"
    "typedef int cusparseStatus_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "#define C10_CUDA_BUILD_SHARED_LIBS\n",
}


def torch_cuda_includes(stubs: Path) -> list[str]:
    """Include paths for torch's CUDA-side headers on a CPU wheel: torch's, Python's, the CUDA
    runtime's, and `STUBS` written under `stubs`."""
    for name, text in STUBS.items():
        (stubs / name).parent.mkdir(parents=True, exist_ok=True)
        (stubs / name).write_text(text)
    return [*ext.include_paths(), sysconfig.get_paths()["include"], str(CUDA_INCLUDE), str(stubs)]


def start_compile(source: Path, stubs: Path) -> subprocess.Popen:
    includes = torch_cuda_includes(stubs)
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DTTSBUILD_WITH_CUDA", "-DTTSBUILD_GRAPH_WHILE",
           "-DTORCH_EXTENSION_NAME=_driver", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *(f"-I{p}" for p in includes), str(source)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


needs_headers = pytest.mark.skipif(
    shutil.which("g++") is None or not (CUDA_INCLUDE / "cuda_runtime_api.h").exists(),
    reason="needs g++ and the CUDA runtime headers",
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """(return code, stderr) of the CUDA path as it is ("source") and with a mistake
    ("broken"), compiled at once: each is ~30 s of parsing torch's headers on one core."""
    tmp = tmp_path_factory.mktemp("cuda-build")
    broken = tmp / "broken.cpp"
    broken.write_text(SOURCE.read_text().replace("getStreamFromExternal(", "getStreamFromExtern("))
    runs = [start_compile(SOURCE, tmp / "stubs"), start_compile(broken, tmp / "stubs-broken")]
    (ok, _, ok_err), (broken_rc, _, broken_err) = communicate_all(runs, timeout=300)
    return {"source": (ok, ok_err), "broken": (broken_rc, broken_err)}


@needs_headers
def test_the_cuda_code_path_of_the_step_driver_compiles(compiled):
    returncode, stderr = compiled["source"]
    assert returncode == 0, stderr[-3000:]


@needs_headers
def test_the_check_sees_a_mistake_in_the_cuda_path(compiled):
    returncode, stderr = compiled["broken"]
    assert returncode != 0 and "getStreamFromExtern" in stderr


NVCC = shutil.which("nvcc") or str(Path(ext.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc")


def nvcc_compile(source: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", "-c", str(source), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not Path(NVCC).exists(), reason="needs nvcc")
def test_the_while_node_source_compiles_for_hopper(tmp_path):
    done = nvcc_compile(WHILE_SOURCE, tmp_path / "graph_while.o")
    assert done.returncode == 0, done.stderr[-3000:]
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "graph_while.o")], capture_output=True,
                             text=True).stdout  # fmt: skip
    # the host function the binding declares, with its C++ signature
    signature = "ttsbuild_capture_while(" + ", ".join(["unsigned long"] * 4 + ["int"] * 2) + ")"
    assert f"T {signature}" in symbols
    assert "T ttsbuild_while_keeps_programmatic_edges(char const**)" in symbols
    broken = tmp_path / "broken.cu"
    broken.write_text(WHILE_SOURCE.read_text().replace("cudaGraphAddChildGraphNode(",
                                                       "cudaGraphAddChildGraphNod("))
    done = nvcc_compile(broken, tmp_path / "broken.o")
    assert done.returncode != 0 and "cudaGraphAddChildGraphNod" in done.stderr
