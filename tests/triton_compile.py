"""Compile Triton kernels for an H100 (sm_90) without a GPU: a script run in a subprocess without
TRITON_INTERPRET (the interpreter accepts code the compiler rejects, and never compiles device helpers).

The kernels' signatures are not copied into the tests: ``launches(module, *schema_args)`` runs the module's
``launch`` on small CPU tensors with its kernel launches recorded instead of run, and ``compile_launch`` turns
a recorded launch (the kernel, its arguments, the launch options) into the signature, constexprs and options
``triton.compile`` takes. A change of a kernel's arguments therefore reaches the compile tests by itself."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")
POINTER_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int8": "i8",
                 "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}


def run_compile_script(script: str, timeout: int) -> str:
    """The script's stdout (this module importable in it); skips when triton's ptxas is missing, fails with its
    stderr on any other error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = f"import sys\nsys.path.insert(0, {TESTS_DIR!r})\n" + script
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("triton's ptxas is not available on this machine")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


class _Recorder:
    """Stands in for ``launcher(kernel)[grid]``: records the call instead of launching."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def launches(module, *schema_args) -> list:
    """[(kernel, args, kwargs)]: the kernel launches ``module.launch(*schema_args)`` makes, recorded (no
    kernel runs; the launch's outputs are left unwritten). Not under the interpreter."""
    calls: list = []
    real = module.launcher
    module.launcher = lambda kernel: _Recorder(kernel, calls)
    try:
        module.launch(*schema_args)
    finally:
        module.launcher = real
    assert calls, f"{module.__name__}.launch launched no kernel"
    return calls


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(call, config: int = 0, **overrides):
    """(fn, signature, constexprs, options) of a recorded launch: pointer types from the tensors' dtypes,
    scalars as Triton specialises them, constexprs from the keyword arguments and, for an autotuned kernel,
    its ``config``-th configuration. ``overrides`` replace constexprs or options."""
    import torch
    import triton

    kernel, args, kwargs = call
    meta, options = dict(kwargs), {}
    if isinstance(kernel, triton.runtime.Autotuner):
        chosen = kernel.configs[config]
        meta.update(chosen.kwargs)
        options.update(num_warps=chosen.num_warps, num_stages=chosen.num_stages)
        kernel = kernel.fn
    for name in OPTIONS:
        if name in meta:
            options[name] = meta.pop(name)
    for name, value in overrides.items():
        (options if name in OPTIONS else meta)[name] = value
    bound = dict(zip(kernel.arg_names, args), **meta)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + POINTER_TYPES[str(value.dtype).replace("torch.", "")]
        else:
            signature[param.name] = _scalar_type(value)
    return kernel, signature, constexprs, options


def ptx(call, config: int = 0, **overrides) -> str:
    """The sm_90 PTX of a recorded launch (``compile_launch``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constexprs, options = compile_launch(call, config, **overrides)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
