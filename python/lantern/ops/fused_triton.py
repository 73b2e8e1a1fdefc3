"""The "triton" backend: the Triton kernels of ``lantern_kernels`` (one module per op).

Each module ``lantern_kernels.<op>`` declares the op ``lantern_triton::<op>`` (``library.declare_triton``:
a ``torch.library.triton_op`` on a GPU) and defines a function ``<op>`` with the public op's signature that
calls it (after the argument checks in ``lantern.ops`` have run). ``implementations`` lists every one that
exists. The backend is usable when triton imports and either a CUDA device is present or
``TRITON_INTERPRET=1`` (Triton's interpreter runs the same kernels on CPU tensors; that is how the tests
run them without a GPU).
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Dict, Optional

import torch

TRITON_OPS = ("verify", "latent_neighbours", "tree_attention", "compact_kv", "continuous_verify")

try:
    import triton  # noqa: F401
except ImportError as e:  # triton is optional at run time (no wheel on some platforms)
    _IMPORT_ERROR: Optional[str] = f"triton is not installed: {e}"
else:
    _IMPORT_ERROR = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device is available (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
    return None


def implementations() -> Dict[str, Callable]:
    """op name -> ``lantern_kernels.<op>.<op>`` for every kernel module that exists (importing one declares
    its op)."""
    if _IMPORT_ERROR is not None:
        return {}
    found = {}
    for name in TRITON_OPS:
        try:
            module = importlib.import_module(f"lantern_kernels.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"lantern_kernels.{name}":
                raise
            continue  # not written yet: the op runs the reference
        found[name] = getattr(module, name)
    return found
