"""The "triton" backend: the Triton kernels of ``lantern.kernels`` (one module per op).

An op whose backend table names a kernel module (``"triton": "lantern.kernels.<op>"``) gets, when this backend
loads, the op ``lantern_triton::<op>`` declared from that module's ``launch`` (``library.Op.load_triton``: a
``torch.library.triton_op`` on a GPU) and a caller with the public op's signature (run after the argument
checks of the op module). The backend is usable when triton imports, every kernel module imports, and either a
CUDA device is present or ``TRITON_INTERPRET=1`` and Triton's interpreter can run the kernels here (it runs the
same kernels on CPU tensors; that is how the tests run them without a GPU). A kernel module that fails to
import (e.g. a torch whose ``triton_op`` cannot take its declaration) disables this backend only, with the
reason: one ``RuntimeWarning``, ``triton_unavailable()``, and ``import_failures()`` (which
``lantern.self_check_report()`` lists).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Dict, Optional

import torch

from . import library

try:
    import triton  # noqa: F401
except ImportError as e:  # triton is optional at run time (no wheel on some platforms)
    _IMPORT_ERROR: Optional[str] = f"triton is not installed: {e}"
else:
    _IMPORT_ERROR = None

_found: Optional[Dict[str, Callable]] = None  # implementations(), once
_failures: Dict[str, str] = {}  # op -> why its kernel module did not import
_lock = threading.Lock()


def triton_ops() -> tuple:
    """The ops whose backend table names a Triton kernel module."""
    return tuple(op.name for op in library.ops() if op.triton_module)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    implementations()
    if _failures:
        return "; ".join(_failures.values())
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device is available (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
    if not torch.cuda.is_available():
        from ..kernels._common import interpreter_problem

        return interpreter_problem()
    return None


def import_failures() -> Dict[str, str]:
    """op -> why its kernel module failed to import (empty when every module imported)."""
    implementations()
    return dict(_failures)


def implementations() -> Dict[str, Callable]:
    """op name -> its Triton caller, for every op whose kernel module imports (importing one declares its op).
    A module that fails to import is recorded in ``import_failures()`` and warned about once."""
    global _found
    if _IMPORT_ERROR is not None:
        return {}
    with _lock:
        if _found is None:
            _found = _load_kernels()
    return dict(_found)


def _load_kernels() -> Dict[str, Callable]:
    found = {}
    for op in library.ops():
        if not op.triton_module:
            continue
        try:
            found[op.name] = op.load_triton()
        except Exception as e:  # noqa: BLE001 (any failure disables this backend, never the others)
            _failures[op.name] = f"{op.triton_module} failed to import ({type(e).__name__}: {e})"
    if _failures:
        warnings.warn(f"lantern: the triton backend is disabled: {'; '.join(_failures.values())}. The other "
                      f"backends are not affected.", RuntimeWarning, stacklevel=2)
    return found
