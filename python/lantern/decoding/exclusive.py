"""One decoding call at a time per model.

A GPT model and its drafter keep the decoding state of a call in themselves (the KV caches of
``setup_cache`` / ``reset``), so two calls on one model at once would write each other's caches. Each
decoding entry point holds its models for the whole call (``holds_models``): a call from another thread
on a model in use waits until the model is free (the calls are serialised, each gets its own tokens); a
call from the thread that already holds the model (a progress callback starting another generation on it)
would wait for itself, so it raises RuntimeError naming the model instead.

Each entry point also holds its ops' backends for the whole call (``one_backend_per_run``): resolved once, at
the start, for the device of its model, so the run cannot change backend midway.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Callable, Iterator, List, Optional

import torch

from .._backend import holding_backends

_STATES: "weakref.WeakKeyDictionary[object, _State]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner = None  # thread ident of the holder


def _state(model) -> _State:
    with _STATES_LOCK:
        state = _STATES.get(model)
        if state is None:
            state = _STATES[model] = _State()
        return state


def _describe(model) -> str:
    name = getattr(getattr(model, "config", None), "name", None)
    return f"{type(model).__name__}{f' {name}' if name else ''} at {id(model):#x}"


def _weakly_referable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _stateful(models) -> List[object]:
    """The objects whose state a call uses: each model, and the model a wrapper drafter decodes with (an
    object that cannot be weakly referenced, e.g. with __slots__, is not tracked)."""
    out, seen = [], set()
    for m in models:
        for obj in (m, getattr(m, "model", None)):
            if obj is not None and id(obj) not in seen and _weakly_referable(obj):
                seen.add(id(obj))
                out.append(obj)
    return sorted(out, key=id)  # one order for every call: no two calls wait for each other


@contextlib.contextmanager
def exclusive(*models) -> Iterator[None]:
    """Holds ``models`` (None skipped) for the block (module docstring)."""
    held = []
    try:
        for model in _stateful(models):
            state = _state(model)
            if state.owner == threading.get_ident():
                raise RuntimeError(f"{_describe(model)} is already decoding in this thread (a callback of a "
                                   f"running lantern.generate called it again); its KV cache holds that call's "
                                   f"state, so it cannot start another call until that one returns")
            state.lock.acquire()
            state.owner = threading.get_ident()
            held.append(state)
        yield
    finally:
        for state in reversed(held):
            state.owner = None
            state.lock.release()


def holds_models(*names: str) -> Callable:
    """Decorator: the call holds the models passed as the arguments ``names`` (``exclusive``). The wrapped
    function's ``unguarded`` attribute is the function itself, for a caller that holds them already."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            with exclusive(*(bound.arguments.get(name) for name in names)):
                return fn(*args, **kwargs)

        wrapper.unguarded = fn
        return wrapper

    return decorate


def model_device(model) -> Optional[torch.device]:
    """Where a decoding model computes: the Target protocol's ``tok_embeddings.weight`` (docs/target.md), else a
    module's first parameter (MAR); None when it has neither."""
    weight = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    parameter = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return parameter.device if parameter is not None else None


def one_backend_per_run(model_arg: str) -> Callable:
    """Decorator of a decoding entry point: the call runs inside ``lantern._backend.holding_backends`` for the
    device of its argument ``model_arg`` (``model_device``; a model without one is not held: its loop resolves
    the backends itself, once, from its own tensors' device)."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            device = model_device(signature.bind_partial(*args, **kwargs).arguments.get(model_arg))
            with contextlib.nullcontext() if device is None else holding_backends(device):
                return fn(*args, **kwargs)
        return wrapper
    return decorate
