"""The "cpu" and "cuda" backends: the C++/CUDA kernels of ``lantern._C``.

Each op module defines its op ``lantern::<op>`` (the schema, once, in Python) and lantern._C registers a CPU
and a CUDA kernel for it (csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu); torch's dispatcher picks the kernel from the
tensors' device, so both backends run the same caller (``library.Op``). ``implementations`` lists the ops that
have a kernel for a dispatch key, asked of the dispatcher. lantern._C registers its kernels when this module
calls ``register_kernels()``, not when it loads: a kernel that does not match its schema (a stale build) raises
there, and registers nothing. If ``lantern._C`` cannot be imported or its kernels do not match, both backends
report why they are unavailable (with a RuntimeWarning for a mismatch), "auto" runs the reference and nothing
else runs.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional

import torch

from . import library

try:
    from .. import _C
except ImportError as e:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR: Optional[str] = (
        f"the C++ extension lantern._C is not built (pip install --no-build-isolation -e .): {e}")
else:
    _IMPORT_ERROR = None
    try:  # after the op modules declared the schemas: a kernel that does not match one raises, registering none
        _C.register_kernels()
    except (AttributeError, RuntimeError) as e:  # AttributeError: built before kernels registered on this call
        _C = None
        _IMPORT_ERROR = (f"lantern._C does not match the lantern Python package (a stale build?): rebuild it with "
                         f"`make install` or `pip install --no-build-isolation -e .` ({e})"
                         if isinstance(e, AttributeError) else str(e))
        warnings.warn(f"lantern: the cpu and cuda backends are disabled: {_IMPORT_ERROR}", RuntimeWarning,
                      stacklevel=2)


def cuda_compiled() -> bool:
    """Whether lantern._C was built with its CUDA kernels (csrc/cuda)."""
    return _C is not None and bool(_C.cuda_compiled())


def build_info() -> str:
    """One line: how lantern._C was built (with or without CUDA kernels, for which architectures), or why it
    cannot be imported."""
    if _C is None:
        return _IMPORT_ERROR
    if not hasattr(_C, "build_info"):  # built before the build recorded its line
        return f"lantern._C {'with' if cuda_compiled() else 'without'} CUDA kernels"
    return _C.build_info()


def cpu_unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def cuda_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not cuda_compiled():
        return ("lantern._C was built without CUDA kernels (no CUDA toolkit at build time, or LANTERN_NO_CUDA=1); "
                "rebuild with CUDA_HOME set")
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def implementations(dispatch_key: str) -> Dict[str, Callable]:
    """op name -> its caller, for the ops of lantern._C with a kernel for ``dispatch_key`` ("CPU", "CUDA")."""
    if _C is None:
        return {}
    found = {op.name: op.extension_kernels(dispatch_key) for op in library.ops()}
    return {name: caller for name, caller in found.items() if caller is not None}
