"""Helpers shared by the Triton kernels of this package (host side only)."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


def interpreting() -> bool:
    """True under Triton's interpreter (TRITON_INTERPRET=1): kernels run on CPU tensors, one program at a
    time in Python, so the autotuners get a single cheap configuration and tiles are chosen for few steps."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launcher(kernel):
    """What a launch function calls: ``wrap_triton(kernel)`` on a GPU, so that the op, a ``triton_op``, is
    traced into its kernel launches; the kernel itself under the interpreter, where the op is an opaque
    custom op (nothing to trace) and torch releases before 2.14 refuse to wrap interpreted kernels."""
    return kernel if interpreting() else wrap_triton(kernel)


def configs(gpu_configs, interpreter_config):
    """The autotune list: every configuration on a GPU, one under the interpreter (nothing to tune there).
    LANTERN_TRITON_CONFIGS=first (read when a kernel module is imported) keeps only the first GPU
    configuration: a cold start compiles one variant per kernel instead of one per configuration
    (``make gpu-check`` uses it; the choice of configuration changes the speed, never the result)."""
    if interpreting():
        return [interpreter_config]
    if os.environ.get("LANTERN_TRITON_CONFIGS", "all") == "first":
        return list(gpu_configs)[:1]
    return list(gpu_configs)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def _loop_over_argument(out, n):
    total = 0
    for i in range(0, n):
        total += i
    tl.store(out, total)


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> Optional[str]:
    """None when Triton's interpreter runs a kernel that loops up to a scalar argument (every kernel here
    does), else why it cannot: Triton 3.6's interpreter converts a scalar argument with ``int(array)``,
    which numpy 2.4 refuses. Only asked under the interpreter; a compiled kernel is not affected."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_over_argument[(1,)](out, 4)
    except Exception as e:  # noqa: BLE001 (whatever the interpreter raises, the kernels would raise too)
        return (f"Triton {triton.__version__}'s interpreter cannot run a kernel here ({type(e).__name__}: {e}; "
                f"numpy {_numpy_version()}: Triton 3.6's interpreter needs numpy < 2.4)")
    if int(out) != 6:
        return f"Triton {triton.__version__}'s interpreter miscomputes a loop over a scalar argument"
    return None


def _numpy_version() -> str:
    import numpy

    return numpy.__version__
