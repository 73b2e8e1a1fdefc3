"""Ahead-of-time compiled forwards of lantern's own models on a CPU: ``torch.export`` and AOTInductor, compiled
once per machine into ``$LANTERN_CACHE/aot`` and loaded (milliseconds) by every later process.

One package is one forward of one architecture: the GPT's cached forward over a tree (``TreeForward``: prefill
aside, it serves AR steps, chains and trees alike) or the EAGLE drafter's network (``EaglePredict``). It is
exported with dynamic rows, nodes and cache length, so one package serves every batch, every tree of up to 32
nodes (the packed tree mask's first word; larger trees get a package per mask word) and every image length,
with no padding and no recompilation. The package holds no weights: a model's parameters and buffers are
bound to it at load time (AOTInductor's user-managed constants, shared with the model, not copied), so one
package serves every set of weights of that architecture and dtype.

A package's name is a digest of everything its code depends on (``package_key``): lantern's source and built
extension (``_version.source_digest``), torch's version, the CPU's vector ISA, the model's class,
configuration, parameter names, shapes and dtypes, the tree-attention backend and the mask words. A package is
written under a unique name and renamed into place, so concurrent processes never read half a file. The cache
folder is the user's own, like inductor's cache: a package is a shared library that is loaded and run.

The forwards' inputs are made contiguous and checked for their dtypes before every call (the generated code
indexes its inputs with the strides they had when exported); the value checks (token ids, positions, cache
lengths in range) are the callers', as for every compiled forward (docs/compile.md).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import ops
from .._version import source_digest

WORD = 32  # nodes per word of a packed tree mask: a package serves the node counts of one mask width
MAX_ROWS = 1 << 14  # the dynamic dimensions' upper bounds (what the generated code's index arithmetic assumes)
MAX_CACHE_LEN = 1 << 16
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}  # weights are bound at load time
CACHE_BUFFERS = ("kv_cache", "cond_keys")  # the models' per-run buffers: never a package's constants


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """Why AOT-compiled forwards cannot run here, or None: the torch features they use (AOTInductor packages,
    constants bound at load time without a copy, size-oblivious export)."""
    import inspect

    import torch._inductor

    if not hasattr(torch._inductor, "aoti_compile_and_package") or not hasattr(torch._inductor, "aoti_load_package"):
        return f"torch {torch.__version__} has no AOTInductor packages"
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        if "user_managed" not in inspect.signature(AOTICompiledModel.load_constants).parameters:
            return f"torch {torch.__version__} cannot bind a package's weights without copying them"
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious  # noqa: B018 (exports a node count of 1 with the others)
    except (ImportError, AttributeError):
        return f"torch {torch.__version__} cannot export size-oblivious shapes or load AOT packages"
    return None


def supports(model) -> bool:
    """Whether ``model`` (a target, or a drafter) has AOT-compiled forwards: lantern's GPT, an EAGLE drafter of
    lantern's layout, or a GPT drafter over lantern's GPT."""
    from ..models.drafter import EagleDrafter, GPTDrafter
    from ..models.gpt import Transformer

    if type(model) is GPTDrafter:
        model = model.model
    return type(model) in (Transformer, EagleDrafter)


# ---------------------------------------------------------------------------------------------------------
# What a package is exported from


@contextlib.contextmanager
def _bound_cache(model: nn.Module, cache: torch.Tensor):
    """model.kv_cache = cache inside the block (the exported forward's cache is an input, not a buffer)."""
    before = model.kv_cache
    model.kv_cache = cache
    try:
        yield
    finally:
        model.kv_cache = before


class TreeForward(nn.Module):
    """The GPT's cached forward over a tree per row: (cache [n_layer, 2, R, Hkv, Lmax, Dh], tokens [R, T],
    cache_len [R], positions [R, T], tree_mask [R, T, W]) -> (logits [R, T, V], hidden [R, T, D]); writes the
    nodes' K/V into cache. A chain (an AR step, T = 1) is the tree of a causal mask."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def sync(self) -> None:
        """Nothing to follow: every tensor the forward reads is the model's own."""

    def forward(self, cache, tokens, cache_len, positions, tree_mask):
        torch._check(cache.shape[2] == tokens.shape[0])  # the cache holds the forward's rows (and no others)
        with _bound_cache(self.model, cache):
            return self.model(tokens, cache_len=cache_len, positions=positions, tree_mask=tree_mask,
                              return_hidden=True)

    def example(self, rows: int, nodes: int, words: int):
        """Inputs of the traced call (their values are never read)."""
        cfg, weight = self.model.config, self.model.tok_embeddings.weight
        cache = weight.new_zeros(cfg.n_layer, 2, rows, cfg.kv_heads, nodes + 8, cfg.head_dim)
        tokens = torch.zeros(rows, nodes, dtype=torch.int64, device=weight.device)
        return (cache, tokens, tokens[:, 0] + 4, tokens + 1, torch.zeros(rows, nodes, words, dtype=torch.int32,
                                                                        device=weight.device))

    @staticmethod
    def dynamic_shapes(rows, nodes, length):
        per_node = {0: rows, 1: nodes}
        return dict(cache={2: rows, 4: length}, tokens=per_node, cache_len={0: rows}, positions=per_node,
                    tree_mask=per_node)

    def input_dtypes(self):
        return (self.model.tok_embeddings.weight.dtype, torch.int64, torch.int64, torch.int64, torch.int32)


class EaglePredict(nn.Module):
    """The EAGLE drafter's network over a tree per row: (cache, tokens [R, T], features [R, T, D], positions
    [R, T], cache_len [R], tree_mask [R, T, W]) -> predicted hidden states [R, T, D]; writes the nodes' K/V.
    The target's token embedding, which the drafter reads, is a submodule here, so that it is bound like the
    drafter's own weights."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter
        self.embedding = drafter._target[0]

    def sync(self) -> None:
        """Follows the drafter's binding: ``drafter.bind(another_target)`` changes the embedding it reads."""
        if self.embedding is not self.drafter._target[0]:
            self.embedding = self.drafter._target[0]

    def forward(self, cache, tokens, features, positions, cache_len, tree_mask):
        from ..models.gpt import CacheStep

        torch._check(cache.shape[2] == tokens.shape[0])  # the cache holds the forward's rows (and no others)
        step = CacheStep(slots=cache_len[:, None] + torch.arange(tokens.shape[1], device=tokens.device),
                         cache_len=cache_len, tree_mask=tree_mask)
        with _bound_cache(self.drafter, cache):
            return self.drafter.predict(tokens, features, positions, step)

    def example(self, rows: int, nodes: int, words: int):
        cfg, weight = self.drafter.config, self.drafter.fc.weight
        cache = weight.new_zeros(cfg.n_layer, 2, rows, cfg.kv_heads, nodes + 8, cfg.head_dim)
        tokens = torch.zeros(rows, nodes, dtype=torch.int64, device=weight.device)
        return (cache, tokens, weight.new_zeros(rows, nodes, cfg.dim), tokens + 1, tokens[:, 0] + 4,
                torch.zeros(rows, nodes, words, dtype=torch.int32, device=weight.device))

    @staticmethod
    def dynamic_shapes(rows, nodes, length):
        per_node = {0: rows, 1: nodes}
        return dict(cache={2: rows, 4: length}, tokens=per_node, features=per_node, positions=per_node,
                    cache_len={0: rows}, tree_mask=per_node)

    def input_dtypes(self):
        dtype = self.drafter.fc.weight.dtype
        return (dtype, torch.int64, dtype, torch.int64, torch.int64, torch.int32)


# ---------------------------------------------------------------------------------------------------------
# Packages: their names, compiling and loading


def _state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a package of ``module`` binds at load time: its parameters and buffers by name (the caches
    are inputs, never constants)."""
    state = dict(module.named_parameters())
    state.update((name, b) for name, b in module.named_buffers() if not name.endswith(CACHE_BUFFERS))
    return state


def package_key(module: nn.Module, words: int, backend: str) -> str:
    """The package's name: a digest of what its generated code depends on (see the module docstring)."""
    inner = getattr(module, "model", None) or module.drafter
    parts = [source_digest(), torch.__version__, torch.backends.cpu.get_cpu_capability(), type(module).__name__,
             type(inner).__qualname__, repr(inner.config), repr(getattr(inner, "layout", None)),
             f"words {words}", f"tree_attention {backend}"]
    parts += [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in sorted(_state(module).items())]
    return f"{type(module).__name__}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:20]}"


def package_dir() -> Path:
    from ..neighbours import cache_dir

    return cache_dir() / "aot"


def _node_range(words: int) -> Tuple[int, int]:
    """The node counts whose packed mask has ``words`` words."""
    return (1 if words == 1 else WORD * (words - 1) + 1), WORD * words


@contextlib.contextmanager
def _caches_put_aside(module: nn.Module):
    """The model's cache buffers are None while it is exported (a run may hold them): export would lift a
    buffer into the package as a constant, and the forward's cache is an input instead."""
    held = [(m, name, getattr(m, name)) for m in module.modules() for name in CACHE_BUFFERS
            if name in getattr(m, "_buffers", {})]
    for m, name, _ in held:
        setattr(m, name, None)
    try:
        yield
    finally:
        for m, name, value in held:
            setattr(m, name, value)


def compile_package(module: nn.Module, words: int, path: Path) -> None:
    """Exports ``module`` (``TreeForward`` or ``EaglePredict``) with dynamic rows, nodes and cache length and
    compiles it with AOTInductor into ``path`` (written under a unique name, then renamed into place)."""
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim

    lo, hi = _node_range(words)
    rows, nodes = Dim("rows", min=1, max=MAX_ROWS), Dim("nodes", min=lo, max=hi)
    length = Dim("length", min=1, max=MAX_CACHE_LEN)
    example = module.example(3, max(lo, min(4, hi)), words)
    # size-oblivious: a dimension of size 1 (one node, one row) takes the general code, not a specialisation
    with torch.no_grad(), ops.checks.values_checked_by_caller(), fx_config.patch(backed_size_oblivious=True), \
            _caches_put_aside(module):
        exported = torch.export.export(module, example, dynamic_shapes=module.dynamic_shapes(rows, nodes, length),
                                       strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex}.pt2")
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                 inductor_configs=dict(INDUCTOR_CONFIGS))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def ensure_package(module: nn.Module, words: int, path: Path) -> bool:
    """Compiles the package into ``path`` unless it is there -> whether this call compiled it. One process
    compiles a package at a time: the others (``torchrun`` ranks starting together) wait on a lock file beside
    it, then find it there."""
    if path.exists():
        return False
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    # the lock file stays: deleting it while another process waits on it would let a third lock a new file
    with FileLock(str(path.with_suffix(".lock"))):
        if path.exists():
            return False
        compile_package(module, words, path)
        return True


_EVENTS: List[Tuple[str, str, float]] = []  # this process's (what, package, seconds): "compiled" or "loaded"


def process_summary() -> dict:
    """The AOT packages this process compiled and loaded so far: counts and seconds (what a CLI reports as the
    one-off cost, apart from the decoding's time)."""
    def total(what):
        return [s for w, _, s in _EVENTS if w == what]

    compiled, loaded = total("compiled"), total("loaded")
    return {"compiled": len(compiled), "compile_s": sum(compiled), "loaded": len(loaded), "load_s": sum(loaded)}


class AotForward:
    """One forward (``TreeForward`` or ``EaglePredict`` of a model) run from its packages, one per mask width,
    each compiled (once per machine) or loaded (once per process) when first called. ``stats`` (a
    ``compiled.CompileStats``) records the seconds of each compile and each load."""

    def __init__(self, module: nn.Module, kind: str, backend: str):
        self.module, self.kind, self.backend = module, kind, backend
        self.dtypes = module.input_dtypes()
        self.runners: Dict[int, object] = {}  # mask words -> the loaded package, its constants bound
        self.calls: Dict[int, object] = {}  # mask words -> its runner's call (``_direct_call``)
        self.bound: Dict[int, Dict[str, torch.Tensor]] = {}  # the tensors bound to each (kept alive here)
        self.stats = None

    def __call__(self, *args):
        args = self._checked(args)
        words = args[-1].shape[-1]
        call = self.calls.get(words)
        if call is None:
            call = self._load(words)
        return call(*args)

    def refresh(self) -> None:
        """Before a run: drops the packages bound to tensors the model no longer has (``model.to(...)`` or a
        reassigned parameter replaces them; the package may not even fit the new dtype), so that the next call
        loads the right package and binds the model's current tensors. A run holds its models
        (``exclusive.holds_models``), so they do not change during it."""
        self.module.sync()
        state = _state(self.module)
        if any(any(state.get(name) is not t for name, t in self.bound[words].items()) for words in self.runners):
            self.runners.clear()
            self.calls.clear()
            self.bound.clear()

    def _checked(self, args) -> tuple:
        for i, (a, dtype) in enumerate(zip(args, self.dtypes)):
            if a.dtype != dtype or a.device.type != "cpu":
                raise ValueError(f"{self.kind}: input {i} must be a {dtype} CPU tensor, got {a.dtype} on {a.device}")
        cache = args[0]  # [n_layer, 2, rows, heads, length, head_dim]: the dimensions the package was made for
        if cache.shape[2] > MAX_ROWS or cache.shape[4] > MAX_CACHE_LEN:
            raise ValueError(f"{self.kind}: compiled forwards serve at most {MAX_ROWS} model rows and a cache of "
                             f"{MAX_CACHE_LEN} positions, got {cache.shape[2]} rows and {cache.shape[4]} positions: "
                             f"decode in smaller batches, or with compile=False")
        return tuple(a.contiguous() for a in args)

    def _load(self, words: int):
        path = package_dir() / f"{package_key(self.module, words, self.backend)}.pt2"
        t0 = time.perf_counter()
        if ensure_package(self.module, words, path):
            self._record("seen", words, time.perf_counter() - t0, path)
        t0 = time.perf_counter()
        runner = torch._inductor.aoti_load_package(str(path))
        self._bind(runner, words)
        self._record("loaded", words, time.perf_counter() - t0, path)
        self.runners[words] = runner
        call = self.calls[words] = _direct_call(runner)
        return call

    def _bind(self, runner, words: int) -> None:
        """The module's current parameters and buffers become the package's constants (not copied)."""
        state = _state(self.module)
        needed = runner.get_constant_fqns()
        missing = [name for name in needed if name not in state]
        if missing:
            raise RuntimeError(f"{self.kind}: the package needs constants the model does not have: {missing[:5]}")
        bound = {name: state[name] for name in needed}
        runner.load_constants(bound, check_full_update=True, user_managed=True)
        self.bound[words] = bound

    def _record(self, what: str, words: int, seconds: float, path: Path) -> None:
        _EVENTS.append(("compiled" if what == "seen" else "loaded", path.name, seconds))
        if self.stats is not None:
            getattr(self.stats, what)[(f"{self.kind} (aot)", ("words", words))] = seconds


def _direct_call(runner):
    """``runner``'s call for positional tensor arguments, with its input and output specs read once: the
    loaded package's own ``__call__`` parses both from JSON and flattens its arguments on every call (~65 us
    on a 2-core CPU, three calls a speculative step)."""
    from torch.utils import _pytree as pytree

    loader = getattr(runner, "loader", None)
    if loader is None or not hasattr(loader, "boxed_run"):  # another torch's loaded package: its own call
        return runner
    in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
    n_inputs = in_spec.num_leaves

    def call(*args):
        if len(args) != n_inputs:
            raise ValueError(f"the package takes {n_inputs} tensors, got {len(args)}")
        return pytree.tree_unflatten(loader.boxed_run(list(args)), out_spec)

    return call


# ---------------------------------------------------------------------------------------------------------
# The wrappers the decoding loops call


_CAUSAL: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}


def causal_mask(R: int, T: int, device) -> torch.Tensor:
    """The packed mask of a chain of T nodes, int32 [R, T, ceil(T/32)], contiguous (made once per shape)."""
    from ..ops.reference.tree import pack_bits

    key = (R, T, torch.device(device))
    mask = _CAUSAL.get(key)
    if mask is None:
        mask = _CAUSAL[key] = pack_bits(torch.ones(T, T, dtype=torch.bool, device=device).tril()).expand(
            R, -1, -1).contiguous()
    return mask


class AotTarget:
    """The GPT's decoding forwards from its AOT package; the prefill (a condition) and forwards over part of
    the cache's rows run eagerly. Called like ``Transformer.forward``; other attributes are the model's."""

    def __init__(self, model, backend: str, kind: str = "target"):
        self.model = model
        self.forward = AotForward(TreeForward(model), f"{kind} forward", backend)
        self.functions = (self.forward,)

    def __call__(self, tokens=None, cond_idx=None, *, cache_len, positions=None, tree_mask=None,
                 return_hidden=False, emb_masks=None):
        model = self.model
        if cond_idx is not None or emb_masks is not None or tokens.shape[0] != model.kv_cache.shape[2]:
            return model(tokens, cond_idx, cache_len=cache_len, positions=positions, tree_mask=tree_mask,
                         return_hidden=return_hidden, emb_masks=emb_masks)
        R, T = tokens.shape
        if positions is None:  # a chain after the committed tokens
            positions = (cache_len - model.cond_keys[:R])[:, None] + torch.arange(T, device=tokens.device)
        if tree_mask is None:
            tree_mask = causal_mask(R, T, tokens.device)
        logits, hidden = self.forward(model.kv_cache, tokens, cache_len, positions, tree_mask)
        return (logits, hidden) if return_hidden else logits

    def __getattr__(self, name):
        return getattr(self.model, name)


class AotEagleDrafter:
    """The EAGLE drafter's ``commit`` and ``expand`` through its AOT package (the network; the target's
    output head scores the states eagerly); the rest of the interface is the drafter's."""

    accepts_tree_mask = True

    def __init__(self, drafter, backend: str):
        self.drafter = drafter
        self.predict = AotForward(EaglePredict(drafter), "drafter forward", backend)
        self.functions = (self.predict,)

    def commit(self, tokens, features, n_new, positions):
        from ..models.drafter import _last_real

        d = self.drafter
        hidden = self.predict(d.kv_cache, tokens, features, positions, d.cache_len,
                              causal_mask(*tokens.shape, tokens.device))  # [R, P, D]
        d.cache_len = d.cache_len + n_new
        root = _last_real(hidden, n_new)  # [R, D]
        return d.logits(root), root

    def expand(self, tokens, parents, parent_state, positions, tree_mask=None):
        from ..models.drafter import partial_tree_mask

        d = self.drafter
        mask = partial_tree_mask(parents) if tree_mask is None else tree_mask
        hidden = self.predict(d.kv_cache, tokens, parent_state, positions, d.cache_len, mask)  # [R, T, D]
        return d.logits(hidden), hidden

    def __getattr__(self, name):
        return getattr(self.drafter, name)


def aot_drafter(drafter, backend: str):
    """The drafter with AOT-compiled forwards: an EAGLE drafter's network, or a GPT drafter's model."""
    from ..models.drafter import GPTDrafter

    if isinstance(drafter, GPTDrafter):
        wrapped = GPTDrafter(AotTarget(drafter.model, backend, kind="drafter"))
        wrapped.functions = wrapped.model.functions
        return wrapped
    return AotEagleDrafter(drafter, backend)
