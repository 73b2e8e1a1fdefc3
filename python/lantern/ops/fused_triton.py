"""The "triton" backend: the Triton kernels of ``lantern_kernels`` (one module per op).

Each module ``lantern_kernels.<op>`` defines a function ``<op>`` with the public op's signature (after the
argument checks in ``lantern.ops`` have run). This module registers every one that exists. The backend is
usable when triton imports and either a CUDA device is present or ``TRITON_INTERPRET=1`` (Triton's
interpreter runs the same kernels on CPU tensors; that is how the tests run them without a GPU).
"""
from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from .. import _backend

TRITON_OPS = ("verify", "latent_neighbours", "tree_attention", "compact_kv")

try:
    import triton  # noqa: F401
except ImportError as e:  # triton is optional at run time (no wheel on some platforms)
    _IMPORT_ERROR: Optional[str] = f"triton is not installed: {e}"
else:
    _IMPORT_ERROR = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device is available (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
    return None


_backend.set_availability("triton", _triton_unavailable)

if _IMPORT_ERROR is None:
    for _op in TRITON_OPS:
        try:
            _module = importlib.import_module(f"lantern_kernels.{_op}")
        except ModuleNotFoundError as e:
            if e.name != f"lantern_kernels.{_op}":
                raise
            continue  # not written yet: the op runs the reference
        _backend.register("triton", _op)(getattr(_module, _op))
