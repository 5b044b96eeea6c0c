"""Every global a Triton kernel reads is one the GPU compiler accepts.

The interpreter (CI's kernel tests) runs kernels as Python and reads any global; the GPU
compiler accepts only constexpr globals, modules, other jit functions and triton.language's
own objects. On 2026-12-07 the FP8 cache's kernels passed every interpreter test and failed
to compile on the GPU because `E4M3_MAX` was a plain float: this check runs the compiler's
rule over every kernel's source, on the CPU.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import ttsbuild.plugins as plugins  # noqa: E402
import ttsbuild.plugins._tl as tl_kernels  # noqa: E402

JIT = triton.runtime.jit.JITFunction
JIT_CALLABLE = getattr(triton.runtime.jit, "JITCallable", JIT)  # (its base class since 3.5)


def _modules():
    names = [f"{plugins.__name__}.{m.name}" for m in pkgutil.iter_modules(plugins.__path__)]
    names += [f"{tl_kernels.__name__}.{m.name}" for m in pkgutil.iter_modules(tl_kernels.__path__)]
    return [importlib.import_module(n) for n in sorted(names)]


def _kernels():
    seen = {}
    for module in _modules():
        for name, value in vars(module).items():
            while not isinstance(value, JIT) and isinstance(
                getattr(value, "fn", None), (JIT, triton.runtime.autotuner.Heuristics,
                                             triton.runtime.autotuner.Autotuner)):  # fmt: skip
                value = value.fn  # an autotuned or heuristics-wrapped kernel: its jit function
            if isinstance(value, JIT) and value.fn.__module__ == module.__name__:
                seen[f"{module.__name__}.{name}"] = value
    return seen


def _local_names(fn_node):
    names = {a.arg for a in ast.walk(fn_node.args) if isinstance(a, ast.arg)}
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return names


def _accepted(value):
    """The GPU code generator's rule for a global read inside a kernel (triton 3.x
    `CodeGenerator.global_lookup`), less its escape hatches."""
    if isinstance(value, (ModuleType, tl.constexpr, tl.dtype, JIT_CALLABLE)):
        return True
    if getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False):
        return True
    return getattr(value, "__module__", "") and value.__module__.startswith("triton.language")


def _refused_globals(source, scope):
    """The globals a function's source reads (names in `scope`, not its own locals) that
    the GPU compiler would refuse."""
    fn_node = next(
        n for n in ast.parse(textwrap.dedent(source)).body if isinstance(n, ast.FunctionDef)
    )
    local = _local_names(fn_node)
    refused = set()
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in local or node.id not in scope:
                continue  # a local, or a Python builtin (range, min, ...)
            if not _accepted(scope[node.id]):
                refused.add(f"{node.id} ({type(scope[node.id]).__name__})")
    return refused


KERNELS = _kernels()


def test_the_kernels_are_found():
    # the package holds dozens of kernels; finding few would mean the walk above went wrong
    assert len(KERNELS) > 40, sorted(KERNELS)
    assert "ttsbuild.plugins._tl._math.e4m3_value" in KERNELS
    assert "ttsbuild.plugins._tl.fp8_linear._gemv" in KERNELS  # (autotuned: unwrapped)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_reads_only_globals_the_gpu_compiler_accepts(name):
    kernel = KERNELS[name]
    assert not _refused_globals(inspect.getsource(kernel.fn), kernel.fn.__globals__), (
        f"{name} reads globals the GPU compiler refuses (make them tl.constexpr)"
    )


def test_the_check_catches_a_plain_float_global():
    # the check itself: the float that broke the GPU compile on 2026-12-07 is refused, its
    # constexpr form and a local are not
    scope = {"tl": tl, "LIMIT": 448.0, "LIMIT_C": tl.constexpr(448.0), "y": 1.0}
    bad = "def bad(x):\n    return tl.minimum(x, LIMIT)\n"
    good = "def good(x):\n    y = x\n    return tl.minimum(y, LIMIT_C)\n"
    assert _refused_globals(bad, scope) == {"LIMIT (float)"}
    assert not _refused_globals(good, scope)
