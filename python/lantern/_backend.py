"""Backend selection for ``lantern.ops``.

Every public op in ``lantern.ops`` is a thin function that asks this module which implementation to run.
The reference implementation (pure PyTorch, ``lantern.ops.reference``) is always available and is the
readable definition of each op. Fused backends register the ops they implement; an op a backend does
not implement yet runs the reference, and ``fused_ops()`` says which ones are fused.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, Optional

import torch

BACKENDS = ("reference", "cpu", "cuda", "triton", "auto")

# backend name -> op name -> implementation
_REGISTRY: Dict[str, Dict[str, Callable]] = {"reference": {}, "cpu": {}, "cuda": {}, "triton": {}}
# backend name -> callable returning None when usable, else a sentence saying why not
_AVAILABILITY: Dict[str, Callable[[], Optional[str]]] = {}

_state = threading.local()


def register(backend: str, op_name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``op_name``."""

    def wrap(fn: Callable) -> Callable:
        _REGISTRY[backend][op_name] = fn
        return fn

    return wrap


def set_availability(backend: str, check: Callable[[], Optional[str]]) -> None:
    _AVAILABILITY[backend] = check


def _why_unavailable(backend: str) -> Optional[str]:
    if backend == "reference":
        return None
    _load_backends()
    check = _AVAILABILITY.get(backend)
    if check is None:
        return f"lantern backend '{backend}' is not implemented yet"
    return check()


def _validate(backend: str) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        why = _why_unavailable(backend)
        if why is not None:
            raise RuntimeError(f"backend '{backend}' is unavailable: {why}")
    return backend


def active_backend() -> str:
    return getattr(_state, "backend", "reference")


def enable_fused(backend: str = "auto") -> None:
    """Route ``lantern.ops`` to fused kernels. ``"auto"`` picks per call from the inputs' device:
    CPU tensors -> ``"cpu"``; CUDA tensors -> ``"cuda"``, then ``"triton"``; else the reference."""
    _state.backend = _validate(backend)


def disable_fused() -> None:
    """Route ``lantern.ops`` back to the PyTorch reference."""
    _state.backend = "reference"


@contextlib.contextmanager
def fused(backend: str = "auto") -> Iterator[None]:
    """``with lantern.fused("cpu"): ...`` — enable a backend inside the block, restore on exit."""
    previous = active_backend()
    enable_fused(backend)
    try:
        yield
    finally:
        _state.backend = previous


def _auto_candidates(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("cuda", "triton")
    if device.type == "cpu":
        return ("cpu",)
    return ()


def resolve(op_name: str, device: torch.device) -> Callable:
    """The implementation of ``op_name`` for the active backend and an input on ``device``."""
    _load_backends()
    backend = active_backend()
    if backend == "auto":
        for name in _auto_candidates(device):
            impl = _REGISTRY[name].get(op_name)
            if impl is not None and _why_unavailable(name) is None:
                return impl
        return _REGISTRY["reference"][op_name]
    impl = _REGISTRY[backend].get(op_name)
    if impl is None:
        return _REGISTRY["reference"][op_name]
    expected = {"cpu": "cpu", "cuda": "cuda", "triton": "cuda"}.get(backend)
    if expected is not None and device.type != expected and not (backend == "triton" and _triton_interpret()):
        raise RuntimeError(
            f"backend '{backend}' runs {op_name} on {expected} tensors, got tensors on {device}; "
            f"move the inputs or choose another backend"
        )
    return impl


def fused_ops(backend: Optional[str] = None) -> Dict[str, bool]:
    """For each op, whether ``backend`` (default: the active one) has a fused implementation."""
    _load_backends()
    backend = backend or active_backend()
    ops = sorted(_REGISTRY["reference"])
    if backend == "reference":
        return {op: False for op in ops}
    names = ("cpu", "cuda", "triton") if backend == "auto" else (backend,)
    return {op: any(op in _REGISTRY[n] for n in names) for op in ops}


def _triton_interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_loaded = False


def _load_backends() -> None:
    """Import the modules that register fused implementations (lazily, to keep import cheap)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .ops import fused_cpu  # noqa: F401  (registers "cpu" and "cuda" ops from lantern._C)
    from .ops import fused_triton  # noqa: F401  (registers "triton" ops from lantern_kernels)
