"""Compiled decoding (``compile=True``): the target's and the drafter's forwards run through
``torch.compile`` (inductor on the CPU, CUDA graphs through ``mode="reduce-overhead"`` on a GPU).

A compiled graph has static shapes, and a decoding run meets many node counts (every plan's tree size, each
drafter depth, each catch-up width). Each forward's node count T is padded to a bucket (``BUCKETS``, then
multiples of the largest), so one run compiles one graph per bucket met and per forward kind, whatever the
trees. Padding nodes never change a real node's result:
- a tree forward's padding node attends to the cache and to itself only (packed tree-mask bit i of node i,
  SPEC §3's padding node: parent -1, an ancestor of nothing; the §6 mask bits), so no real node sees it;
- a drafter partial-tree node of parent -1 hangs off the cached root: an ancestor of nothing, likewise;
- the drafter's catch-up is causal, so columns appended after the real ones are seen by none of them.
Padding nodes take token 0 and position 0 (valid embedding and RoPE rows), and write K/V into cache slots
past the real nodes'; the loops allocate those slots (``pad_room``), and no later read reaches them before
a real token overwrites them. Their outputs are cut off before anything else sees them.

The value scans of the argument checks run in eager code only (docs/dispatch.md), so a compiled forward
never reads a value on the host. The step offset never enters a compiled forward (verify and the draft
sampling run eagerly around them), so a Python int offset causes no recompilation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import weakref
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops.reference.tree import pack_bits

# compile's choice, re-exported where it always was
from .compile_choice import (  # noqa: F401
    AUTO,
    COMPILE_CHOICES,
    CompileChoice,
    CompileOption,
    baseline_compile,
    cannot_compile,
    check_compile,
    compile_options,
    compile_unavailable,
    resolve_compile,
    use_lantern_cache_for_inductor,
)

BUCKETS = (1, 4, 8, 16, 32, 64)
ISOLATES_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters  # torch >= 2.14
RECOMPILE_LIMIT = 64  # graphs per compiled function over a process (buckets x row counts x runs of new shapes)


def bucket(n: int) -> int:
    """The padded node count of n nodes: the smallest bucket >= n, past the largest a multiple of it."""
    for b in BUCKETS:
        if n <= b:
            return b
    top = BUCKETS[-1]
    return -(-n // top) * top


def pad_room(n: int) -> int:
    """Cache slots to add to a cache sized for real forwards of at most n nodes."""
    return bucket(max(n, 1)) - max(n, 1)


class CompileStats:
    """What compiling cost: each call that compiled a graph (the compile and one run), and how many; and each
    AOT package loaded from the disk cache (``aot.py``)."""

    def __init__(self):
        self.seen: Dict[Tuple, float] = {}  # (forward kind, (rows, nodes, cache shape)) -> seconds of first call
        self.loaded: Dict[Tuple, float] = {}  # (forward kind, ("words", W)) -> seconds to load an AOT package

    @property
    def compile_s(self) -> float:
        return sum(self.seen.values())

    @property
    def load_s(self) -> float:
        return sum(self.loaded.values())

    @property
    def graphs(self) -> int:
        return len(self.seen)

    def summary(self) -> dict:
        return {"compile_s": self.compile_s, "graphs": self.graphs, "load_s": self.load_s,
                "shapes": sorted(_shape_name(kind, key) for kind, key in self.seen)}


def _shape_name(kind: str, key: Tuple) -> str:
    """A compiled graph's kind and shape key as text: rows and nodes of a torch.compile graph, the mask words
    of an AOT package."""
    return f"{kind} words {key[1]}" if key[0] == "words" else f"{kind} rows {key[0]} nodes {key[1]}"


def _layout(args) -> Tuple:
    """The shapes, strides and dtypes of the tensors in args (dataclasses of tensors included): a graph is
    specialised to them (an expanded mask and a contiguous one of the same shape are two graphs)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.stride(), a.dtype))
        elif dataclasses.is_dataclass(a):
            out.append(_layout(vars(a).values()))
        else:
            out.append(a)
    return tuple(out)


def _traced_state() -> Tuple:
    """What a graph depends on besides its inputs' shapes and dtypes: the fused backend the ops dispatch to
    while tracing, grad mode and inference mode."""
    from .. import _backend

    return _backend.active_backend(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class _Compiled:
    """A compiled function that times its calls that compiled a new graph (dynamo's graph counter grew).

    A call is keyed by everything its graph is specialised to: the caller's shape key (rows, node count,
    cache shape and dtype), the arguments' shapes, strides and dtypes, and ``_traced_state``. Dynamo checks
    each call's inputs against its graphs' guards (hundreds of tensor checks for a 16-layer model's
    parameters, ~0.3 ms a call on a CPU); at a key already called, only the guards that tell this function's
    graphs apart run (``skip_guard_eval_unsafe``): the graph that served the key before serves it again."""

    def __init__(self, fn, options: dict, kind: str, device: torch.device):
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        # isolate_recompiles: this wrapper's graphs are its own (a process's wrappers of other models share
        # the traced functions' code objects), so the guards that tell them apart are about its shapes only.
        # A torch without it (before 2.14) runs every call with all its guards instead: the unsafe stance
        # could pick another model's graph there.
        isolate = dict(isolate_recompiles=True) if ISOLATES_RECOMPILES else {}
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False, **isolate, **options)
        self.skip_guards = ISOLATES_RECOMPILES
        self.cuda_graphs = options.get("mode") in ("reduce-overhead", "max-autotune")
        self.kind, self.device = kind, device
        self.known = set()  # (shape key, argument layout, traced state) called before (no compile expected)
        self.stats = CompileStats()  # the current run's (set by ``compiled_target`` / ``compiled_drafter``)

    def __call__(self, key: Tuple, *args):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        full_key = (key, _layout(args), _traced_state())
        if full_key in self.known:
            stance = (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if self.skip_guards
                      else contextlib.nullcontext())
            with stance:
                out = self.fn(*args)
            return tuple(o.clone() for o in out) if self.cuda_graphs else out
        from torch._dynamo.utils import counters  # here, not at import: dynamo takes ~1.3 s to import

        self._sync()
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        out = self.fn(*args)
        if self.cuda_graphs:  # a replay overwrites its outputs: the loop keeps some across calls
            out = tuple(o.clone() for o in out)
        self._sync()
        self.known.add(full_key)
        if counters["stats"]["unique_graphs"] != graphs:  # this call compiled (expected at new keys only)
            self.stats.seen[(self.kind, key)] = self.stats.seen.get((self.kind, key), 0.0) + time.perf_counter() - t0
        return out

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _pad_nodes(x: torch.Tensor, T_pad: int, value=0) -> torch.Tensor:
    """x [R, T, ...] -> [R, T_pad, ...], the new nodes filled with value."""
    T = x.shape[1]
    if T == T_pad:
        return x.contiguous()  # a graph is specialised to its inputs' strides
    widths = [0, 0] * (x.dim() - 2) + [0, T_pad - T]
    return F.pad(x, widths, value=value)


_PADDING_BITS: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}


class _PaddedMasks:
    """``pad_tree_mask`` of masks the loops pass again and again (a chain's or a static tree's mask is made
    once per run, ``DecodeState.tree_inputs``): the padded mask of a tensor object, kept while the tensor
    lives and is not written to (its version counter)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self.entries: Dict[int, tuple] = {}  # id(mask) -> (weakref, version, T_pad, padded)

    def __call__(self, mask: torch.Tensor, T_pad: int) -> torch.Tensor:
        entry = self.entries.get(id(mask))
        if entry is not None and entry[0]() is mask and entry[1] == mask._version and entry[2] == T_pad:
            return entry[3]
        padded = pad_tree_mask(mask, T_pad)
        if len(self.entries) >= self.capacity:
            self.entries.pop(next(iter(self.entries)))
        key = id(mask)
        self.entries[key] = (weakref.ref(mask, lambda _, key=key: self.entries.pop(key, None)), mask._version, T_pad,
                             padded)
        return padded


_padded_masks = _PaddedMasks()


def pad_tree_mask(mask: torch.Tensor, T_pad: int) -> torch.Tensor:
    """Packed ancestor bits [R, T, ceil(T/32)] -> [R, T_pad, ceil(T_pad/32)]: the real nodes' bits as they
    were, each padding node i with its own bit i only (it sees itself and the cache)."""
    R, T, W = mask.shape
    if T == T_pad:
        return mask
    key = (T, T_pad, mask.device)
    if key not in _PADDING_BITS:
        _PADDING_BITS[key] = pack_bits(torch.eye(T_pad, dtype=torch.bool, device=mask.device)[T:])  # [T_pad - T, W']
    pad_rows = _PADDING_BITS[key]
    real = F.pad(mask, (0, pad_rows.shape[-1] - W))  # [R, T, W'] zero words for the padding nodes' bits
    return torch.cat([real, pad_rows.expand(R, -1, -1).to(mask.dtype)], 1)


class CompiledTarget:
    """The target's decoding forwards, compiled and padded; the prefill (a condition) runs eagerly.
    Called like ``Transformer.forward``; other attributes are the model's."""

    def __init__(self, model, options: dict, kind: str = "target"):
        self.model = model
        device = model.tok_embeddings.weight.device
        self._tree = _Compiled(self._tree_forward, options, f"{kind} tree", device)
        self._chain = _Compiled(self._chain_forward, options, f"{kind} chain", device)
        self.functions = (self._tree, self._chain)

    def _tree_forward(self, tokens, cache_len, positions, tree_mask):
        return self.model(tokens, cache_len=cache_len, positions=positions, tree_mask=tree_mask, return_hidden=True)

    def _chain_forward(self, tokens, cache_len):
        return self.model(tokens, cache_len=cache_len, return_hidden=True)

    def __call__(self, tokens=None, cond_idx=None, *, cache_len, positions=None, tree_mask=None,
                 return_hidden=False, emb_masks=None):
        if cond_idx is not None or emb_masks is not None:
            return self.model(tokens, cond_idx, cache_len=cache_len, positions=positions, tree_mask=tree_mask,
                              return_hidden=return_hidden, emb_masks=emb_masks)
        R, T = tokens.shape
        if tree_mask is None and positions is None:  # a chain after the committed tokens (AR: T = 1)
            logits, hidden = self._chain((R, T, self._cache_shape()), tokens.contiguous(), cache_len)
        else:
            if positions is None or tree_mask is None:
                raise ValueError("a compiled tree forward takes both positions and tree_mask")
            T_pad = bucket(T)
            logits, hidden = self._tree((R, T_pad, self._cache_shape()), _pad_nodes(tokens, T_pad), cache_len,
                                        _pad_nodes(positions, T_pad), _padded_masks(tree_mask, T_pad))
            logits, hidden = logits[:, :T], hidden[:, :T]
        return (logits, hidden) if return_hidden else logits

    def _cache_shape(self) -> Tuple:  # a graph is specialised to the cache's shape and dtype too
        cache = self.model.kv_cache
        return (*cache.shape, cache.dtype)

    def __getattr__(self, name):
        return getattr(self.model, name)


class CompiledDrafter:
    """The drafter's ``commit`` and ``expand`` compiled, their node counts padded; the rest of the interface
    (reset, release, caches) is the drafter's. EAGLE: the attention masks (packed bits) are built eagerly and
    the network runs compiled (inductor's CPU code generation fails on the bit packing of a padded mask);
    a GPT drafter: its model's forwards as ``CompiledTarget`` runs them, the catch-up as a causal tree."""

    def __init__(self, drafter, device: torch.device, options: dict):
        from ..models.drafter import EagleDrafter

        self.drafter = drafter
        self.eagle = isinstance(drafter, EagleDrafter)
        if self.eagle:
            self._commit = _Compiled(self._eagle_commit, options, "drafter commit", device)
            self._expand = _Compiled(self._eagle_expand, options, "drafter expand", device)
            self.functions = (self._commit, self._expand)
        else:
            self.model = CompiledTarget(drafter.model, options, kind="drafter")
            self.functions = self.model.functions

    def _eagle_commit(self, tokens, features, positions, n_new, step):
        from ..models.drafter import _last_real

        root = _last_real(self.drafter.predict(tokens, features, positions, step), n_new)  # [R, dim]
        return self.drafter.logits(root), root

    def _eagle_expand(self, tokens, parent_state, positions, step):
        hidden = self.drafter.predict(tokens, parent_state, positions, step)  # [R, T, dim]
        return self.drafter.logits(hidden), hidden

    def commit(self, tokens, features, n_new, positions):
        """Causal catch-up: columns appended after the real ones change none of them."""
        from ..models.drafter import _chain_step

        R, P = tokens.shape
        P_pad = bucket(P)
        tokens, positions = _pad_nodes(tokens, P_pad), _pad_nodes(positions, P_pad)
        d = self.drafter
        if not self.eagle:
            causal = _chain_step(d.cache_len, P_pad).tree_mask  # [R, P_pad, W]
            logits = self.model(tokens, cache_len=d.cache_len, positions=positions, tree_mask=causal)
            d.cache_len = d.cache_len + n_new
            return logits[torch.arange(R, device=tokens.device), (n_new - 1).clamp(min=0)], \
                torch.zeros(R, 0, device=tokens.device)
        step = _chain_step(d.cache_len, P_pad)
        out = self._commit((R, P_pad, self._cache_shape()), tokens, _pad_nodes(features, P_pad), positions, n_new,
                           step)
        d.cache_len = d.cache_len + n_new
        return out

    accepts_tree_mask = True

    def expand(self, tokens, parents, parent_state, positions, tree_mask=None):
        """Padding nodes hang off the cached root (parent -1): ancestors of no node. tree_mask: the real
        nodes' ``partial_tree_mask(parents)`` if the caller has it."""
        from ..models.drafter import _tree_step, partial_tree_mask

        R, T = tokens.shape
        T_pad = bucket(T)
        tokens, parents, positions = _pad_nodes(tokens, T_pad), _pad_nodes(parents, T_pad, -1), _pad_nodes(positions,
                                                                                                          T_pad)
        mask = partial_tree_mask(parents) if tree_mask is None else _padded_masks(tree_mask, T_pad)
        if not self.eagle:
            logits = self.model(tokens, cache_len=self.drafter.cache_len, positions=positions, tree_mask=mask)
            return logits[:, :T], torch.zeros(R, T, 0, device=tokens.device)
        step = _tree_step(self.drafter.cache_len, parents, mask)
        logits, state = self._expand((R, T_pad, self._cache_shape()), tokens, _pad_nodes(parent_state, T_pad),
                                     positions, step)
        return logits[:, :T], state[:, :T]

    def _cache_shape(self) -> Tuple:
        cache = self.drafter.kv_cache
        return (*cache.shape, cache.dtype)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {options: compiled wrapper}


def _cached(model, options: dict, make):
    per_model = _CACHE.setdefault(model, {})
    key = repr(sorted(options.items()))
    if key not in per_model:
        per_model[key] = make()
    return per_model[key]


class CompiledRun(NamedTuple):
    """A run's compiled forwards: torch.compile's options (``resolve_compile``), the run's CompileStats, and
    whether lantern's own models run AOT-compiled packages instead (``aot.py``; other models then go through
    torch.compile with ``options``)."""

    options: dict
    stats: CompileStats
    aot: bool = False


def _aot_backend(model, run: CompiledRun) -> Optional[str]:
    """The tree-attention backend an AOT package of ``model`` is made for, or None when the run does not
    AOT-compile ``model``."""
    from .._backend import run_backends
    from . import aot
    from .exclusive import model_device

    if not run.aot or not aot.supports(model) or model_device(getattr(model, "model", model)).type != "cpu":
        return None
    return run_backends(torch.device("cpu"))["tree_attention"]


def compiled_target(target, run: CompiledRun):
    """The compiled wrapper of target, made once per model and options so that later runs reuse its graphs;
    this run's compilations are recorded in run.stats."""
    backend = _aot_backend(target, run)
    if backend is not None:
        from .aot import AotTarget

        return _bind(_cached(target, {"aot": backend}, lambda: AotTarget(target, backend)), run.stats)
    return _bind(_cached(target, run.options, lambda: CompiledTarget(target, run.options)), run.stats)


def compiled_drafter(drafter, device: torch.device, run: CompiledRun):
    """The compiled wrapper of drafter (see ``compiled_target``)."""
    backend = _aot_backend(drafter, run)
    if backend is not None:
        from .aot import aot_drafter

        return _bind(_cached(drafter, {"aot": backend}, lambda: aot_drafter(drafter, backend)), run.stats)
    return _bind(_cached(drafter, run.options, lambda: CompiledDrafter(drafter, device, run.options)), run.stats)


def _bind(wrapper, stats: CompileStats):
    """wrapper's compiled functions record into this run's stats; AOT forwards drop packages bound to tensors
    the model no longer has."""
    for fn in wrapper.functions:
        fn.stats = stats
        if hasattr(fn, "refresh"):
            fn.refresh()
    return wrapper


def compiled_models(target, drafter, options: dict, stats: CompileStats, aot: bool = False):
    """The compiled wrappers of target and drafter (drafter None: the target's only)."""
    run = CompiledRun(options, stats, aot)
    device = target.tok_embeddings.weight.device
    return compiled_target(target, run), (None if drafter is None else compiled_drafter(drafter, device, run))
