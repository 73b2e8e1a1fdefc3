"""One decoding call at a time per model.

A GPT model and its drafter keep the decoding state of a call in themselves (the KV caches of
``setup_cache`` / ``reset``), so two calls on one model at once would write each other's caches. Each
decoding entry point holds its models for the whole call (``holds_models``): a call from another thread
on a model in use waits until the model is free (the calls are serialised, each gets its own tokens); a
call from the thread that already holds the model (a progress callback starting another generation on it)
would wait for itself, so it raises RuntimeError naming the model instead.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Callable, Iterator, List

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
