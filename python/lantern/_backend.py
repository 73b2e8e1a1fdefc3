"""Backend selection for ``lantern.ops``.

Every public op in ``lantern.ops`` checks its arguments and asks this module which implementation to run:
``dispatch(op, device, backend)``, where ``backend`` is the op's explicit ``backend=`` argument or, when the
caller gives none, the default that ``lantern.enable_fused()`` / ``lantern.fused()`` set for this thread. Each op
module declares its op once with its backend table (``lantern.ops.library.Op``, docs/dispatch.md);
``_REGISTRY`` maps each backend to the functions, with the public op's signature, that call its operators,
built once (``_load_backends``) from those tables and from what the dispatcher and the Triton kernel modules
provide. The reference implementation (``lantern.ops.reference``) is always available and is the readable
definition of each op; an op a backend does not implement runs the reference, and ``fused_ops()`` says which
ones are fused. ``resolve`` picks the implementation; ``dispatch`` is the same, except that while
torch.compile traces the reference runs as the opaque ``lantern_reference::<op>`` (its Python has
value-dependent control flow a graph cannot hold); eager code calls the reference functions directly.
``resolved_backends(device)`` names, once per run, the backend each op resolves to; passing those names as
``backend=`` skips the default's lookup. A decoding run holds them for its whole call (``holding_backends``,
``decoding.exclusive.one_backend_per_run``): its op calls pass them, and the calls that name no backend (inside
the models) use them too, so the run cannot change backend midway, whatever ``enable_fused`` sets meanwhile.

Before a fused kernel first runs an op on a device, ``resolve`` compares it with the reference on a few tiny
cases (``lantern.ops.self_check``; docs/self_check.md). A kernel that disagrees is never used for that op on
that device again in the process: "auto" moves on to its next candidate, an explicit backend runs the
reference. ``LANTERN_SELF_CHECK=0`` turns the check off.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

BACKENDS = ("reference", "cpu", "cuda", "triton", "auto")

# backend name -> op name -> the function (public op's signature) that runs the backend's op
_REGISTRY: Dict[str, Dict[str, Callable]] = {"reference": {}, "cpu": {}, "cuda": {}, "triton": {}}
# backend name -> callable returning None when usable, else a sentence saying why not
_AVAILABILITY: Dict[str, Callable[[], Optional[str]]] = {}

_state = threading.local()

# (backend, op name, device such as "cpu" or "cuda:0") -> None if the kernel agreed with the reference in its
# self-check, else the mismatch; written once per key, under _self_check_lock (re-entrant, so a kernel that
# calls lantern.ops during its check cannot deadlock; _checking holds the keys in progress, which pass)
_self_checks: Dict[Tuple[str, str, str], Optional[str]] = {}
_self_check_lock = threading.RLock()
_checking: set = set()

# (backend, op name) -> calls of that backend's kernel ("ran": counted by the kernels' Python callers, whoever
# calls them; not while torch.compile traces, nor the self-check's own calls), and public op calls that ran the
# reference instead because the kernel's self-check had disabled it ("disabled"). Tests read them to tell a
# kernel test that ran its kernel from one that silently compared the reference with itself.
_kernel_calls: Dict[str, Dict[Tuple[str, str], int]] = {"ran": {}, "disabled": {}}


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
    _load_backends()  # now, in eager mode: torch.compile cannot trace the loading


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


def wrong_device(backend: str, device) -> Optional[str]:
    """None when ``backend``'s kernels take tensors on ``device``, else the device type they take."""
    expected = {"cpu": "cpu", "cuda": "cuda", "triton": "cuda"}.get(backend)
    if expected is None or torch.device(device).type == expected or (backend == "triton" and _triton_interpret()):
        return None
    return expected


def resolve(op_name: str, device: torch.device, backend: Optional[str] = None) -> Callable:
    """The implementation of ``op_name`` for ``backend`` (default: the active one) and an input on ``device``."""
    return _resolve(op_name, device, count=True, backend=backend)


def _resolve(op_name: str, device: torch.device, count: bool, backend: Optional[str] = None) -> Callable:
    """``resolve``; ``count``: a call that runs the reference because the kernel's self-check disabled it is
    counted (``kernel_calls``), which a mere question (``resolved_backends``) is not."""
    return _resolve_named(op_name, device, count, backend)[1]


def _resolve_named(op_name: str, device: torch.device, count: bool,
                   backend: Optional[str] = None) -> Tuple[str, Callable]:
    """``_resolve`` with the name of the backend it picked: "cpu" and "cuda" share one caller (the dispatcher
    picks the kernel by device), so the implementation alone does not say which backend it is."""
    explicit = backend is not None
    if not explicit:
        run = getattr(_state, "run_backends", None)
        backend = run[op_name] if run is not None else active_backend()
    elif backend not in _REGISTRY and backend != "auto":
        _validate(backend)  # raises, naming the choices
    reference = ("reference", _REGISTRY["reference"][op_name])
    if backend == "reference":
        return reference
    _load_backends()
    if backend == "auto":
        for name in _auto_candidates(device):
            impl = _REGISTRY[name].get(op_name)
            if impl is not None and _why_unavailable(name) is None and _passes_self_check(name, op_name, device):
                return name, impl
        return reference
    impl = _REGISTRY[backend].get(op_name)
    if impl is None:
        why = _why_unavailable(backend) if explicit else None  # enable_fused checked the default already
        if why is not None:
            raise RuntimeError(f"backend '{backend}' is unavailable: {why}")
        return reference
    wrong = wrong_device(backend, device)
    if wrong is not None:
        raise RuntimeError(f"backend '{backend}' runs {op_name} on {wrong} tensors, got tensors on {device}; move "
                           f"the inputs or choose another backend")
    if not _passes_self_check(backend, op_name, device):
        if count:
            _count("disabled", backend, op_name)
        return reference
    return backend, impl


def _count(kind: str, backend: str, op_name: str) -> None:
    calls = _kernel_calls[kind]
    calls[(backend, op_name)] = calls.get((backend, op_name), 0) + 1


def count_kernel(backend: str, op_name: str) -> None:
    """Called by each fused kernel's Python caller (``lantern.ops.library.Op``) on every call."""
    if torch.compiler.is_compiling() or getattr(_state, "self_checking", False):
        return
    _count("ran", backend, op_name)


def kernel_calls() -> Dict[str, Dict[Tuple[str, str], int]]:
    """{"ran": {(backend, op): n}, "disabled": {(backend, op): n}}: the calls so far of each backend's kernels
    (outside the self-checks and torch.compile tracing), and the public op calls that ran the reference
    because that kernel's self-check had disabled it."""
    return {kind: dict(calls) for kind, calls in _kernel_calls.items()}


def resolved_backends(device, backend: Optional[str] = None) -> Dict[str, str]:
    """op -> the backend ("reference", "cpu", "cuda" or "triton") whose implementation ``resolve`` picks for
    inputs on ``device`` under ``backend`` (default: the active one; self-checks included): what a run's
    numerics depend on. A run resolves its backends once with it and passes each op its name."""
    device = torch.device(device)
    _load_backends()
    chosen = {}
    for op_name in sorted(_REGISTRY["reference"]):
        chosen[op_name] = _resolve_named(op_name, device, count=False, backend=backend)[0]
    return chosen


def run_backends(device) -> Dict[str, str]:
    """The backends of the decoding run this thread is in (``holding_backends``), else ``resolved_backends`` of
    ``device`` now."""
    run = getattr(_state, "run_backends", None)
    return run if run is not None else resolved_backends(device)


@contextlib.contextmanager
def holding_backends(device) -> Iterator[Dict[str, str]]:
    """Resolves every op's backend for ``device`` once (``resolved_backends``) and holds the choice for the
    block: op calls on this thread that name no ``backend=`` run it, whatever ``enable_fused`` / ``fused`` set
    meanwhile. Inside a block already holding them (a run that starts another: generate_spec's calibration
    or its AR loop) the outer block's choice stays."""
    if getattr(_state, "run_backends", None) is not None:
        yield _state.run_backends
        return
    _state.run_backends = resolved_backends(device)
    try:
        yield _state.run_backends
    finally:
        _state.run_backends = None


def dispatch(op_name: str, device: torch.device, backend: Optional[str] = None) -> Callable:
    """What a public op calls: ``resolve``'s choice, except that while torch.compile traces, the reference
    definition is replaced by the opaque ``lantern_reference::<op_name>`` that runs it."""
    impl = resolve(op_name, device, backend)
    if torch.compiler.is_compiling() and impl is _REGISTRY["reference"][op_name]:
        return _op_layer.reference_op(op_name)
    return impl



class _OpLayer:
    """What the dispatcher needs from the ops above it, installed by ``lantern.ops`` when it is imported
    (``install_op_layer``), so that this module imports none of them: the opaque reference op of a name (for
    tracing), the self-check module, and the modules that fill the fused tables (imported on first use)."""

    reference_op: Callable[[str], Callable]
    self_check: Callable[[], object]
    fused_modules: Callable[[], Tuple[object, object]]


_op_layer = _OpLayer()


def install_op_layer(reference_op: Callable[[str], Callable], self_check: Callable[[], object],
                     fused_modules: Callable[[], Tuple[object, object]]) -> None:
    """Called once by ``lantern.ops`` at import: see ``_OpLayer``."""
    _op_layer.reference_op, _op_layer.self_check, _op_layer.fused_modules = reference_op, self_check, fused_modules

def _self_check_enabled() -> bool:
    return os.environ.get("LANTERN_SELF_CHECK", "1").strip().lower() not in ("0", "false", "off", "no")


def _device_key(device: torch.device) -> Optional[str]:
    """The cache key of a device ("cpu", "cuda:0"); None for a device no tensor can be made on here."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return None


def _passes_self_check(backend: str, op_name: str, device: torch.device) -> bool:
    """Whether ``backend``'s kernel for ``op_name`` may run on ``device``: its self-check, run on first use
    and cached, found no mismatch. While torch.compile (or export) traces, no check can run (the checker
    needs real tensors): a cached verdict applies, an unchecked kernel is used unchecked. The reference is
    never checked, nor is an op that has no self-check case."""
    if backend == "reference" or not _self_check_enabled():
        return True
    device_key = _device_key(device)
    if device_key is None:
        return True
    key = (backend, op_name, device_key)
    if key in _self_checks:
        return _self_checks[key] is None
    if torch.compiler.is_compiling():
        return True
    if op_name not in _op_layer.self_check().CASES:  # tests/ops/test_self_check.py requires a case for every fused op
        return True
    return _run_self_check(key) is None


def _run_self_check(key: Tuple[str, str, str]) -> Optional[str]:
    self_check = _op_layer.self_check()
    backend, op_name, device_key = key
    with _self_check_lock:
        if key in _self_checks:  # another thread checked it meanwhile
            return _self_checks[key]
        if key in _checking:  # reached again from inside its own check
            return None
        _checking.add(key)
        outer = getattr(_state, "self_checking", False)
        _state.self_checking = True  # the check's kernel calls are not the caller's
        try:
            mismatch = self_check.check(backend, op_name, torch.device(device_key))
        finally:
            _checking.discard(key)
            _state.self_checking = outer
        _self_checks[key] = mismatch
    if mismatch is not None:
        warnings.warn(
            f"lantern self-check: backend '{backend}' disagrees with the reference on {op_name} ({device_key}): "
            f"{mismatch}. Its {op_name} is disabled on {device_key} for this process: backend 'auto' uses the "
            f"next candidate (cuda -> triton -> reference), and backend '{backend}' runs the reference {op_name}. "
            f"LANTERN_SELF_CHECK=0 turns the check off.",
            RuntimeWarning, stacklevel=5)  # the caller of the public op
    return mismatch


def self_check_report() -> Dict[Tuple[str, str, str], Optional[str]]:
    """The self-checks run so far: (backend, op, device) -> None (agrees with the reference) or the
    mismatch that disabled that kernel; a kernel that could not even be loaded is listed with the device
    "*" (every device) and the reason, e.g. ("triton", "verify", "*") -> "lantern.kernels.verify failed to
    import (...)"."""
    report = dict(_self_checks)
    if _loaded:
        _, triton_backend = _op_layer.fused_modules()
        report.update({("triton", op, "*"): why for op, why in triton_backend.import_failures().items()})
    return report


def run_self_checks(device, backends=("cpu", "cuda", "triton")) -> Dict[Tuple[str, str, str], Optional[str]]:
    """Run now (eagerly) the self-check of every fused op of each usable backend in ``backends`` that can run
    on ``device`` — e.g. before torch.compile traces code that calls lantern.ops. Returns self_check_report()."""
    _load_backends()
    device = torch.device(device)
    for backend in backends:
        runs_here = {"cpu": device.type == "cpu", "cuda": device.type == "cuda",
                     "triton": device.type == "cuda" or _triton_interpret()}[backend]
        if runs_here and _why_unavailable(backend) is None:
            for op_name in sorted(_REGISTRY[backend]):
                _passes_self_check(backend, op_name, device)
    return self_check_report()


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
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_loaded = False
_load_lock = threading.Lock()


def _load_backends() -> None:
    """Fill the fused backends' tables (lazily, to keep import cheap: it imports lantern._C and triton):
    "cpu" / "cuda" get the ops whose backend table names lantern._C and that have a kernel for the CPU / CUDA
    dispatch key, "triton" those whose Triton kernel module imports. ``enable_fused`` calls it, so it has run
    before torch.compile traces a fused backend (the reference backend does not need it)."""
    global _loaded
    if _loaded:
        return
    if torch.compiler.is_compiling():
        raise RuntimeError("lantern's fused backends load on first use in eager mode: call lantern.enable_fused() "
                           "(or run any lantern.ops op) before torch.compile traces")
    with _load_lock:  # threads that enable a backend at once load the tables once, and see them whole
        if _loaded:
            return
        extension, triton_backend = _op_layer.fused_modules()
        _AVAILABILITY.update(cpu=extension.cpu_unavailable, cuda=extension.cuda_unavailable,
                             triton=triton_backend.triton_unavailable)
        _REGISTRY["cpu"].update(extension.implementations("CPU"))
        _REGISTRY["cuda"].update(extension.implementations("CUDA"))
        _REGISTRY["triton"].update(triton_backend.implementations())
        _loaded = True
