"""``lantern.generate`` for a wrapped transformers model: the prompt as the model's own ``generate`` takes it, the
image codes out, through lantern's unchanged loops (``decoding.ar.generate_ar``, ``decoding.spec.generate_spec``).

Compiling. ``compile`` means what it means for a model without AOT packages (``decoding/compiled.py``: the
decoding forwards through ``torch.compile(fullgraph=True)``, node counts padded to buckets; "auto" compiles on a
GPU, and on a CPU AR's loop only unless LANTERN_COMPILE=1), with one more case: a model whose forward does not
trace in one graph (a graph break in the transformers code it runs). The loops meet that at the first compiled
forward; "auto" then runs the call again eagerly (the same tokens: a run depends on its seed, not on earlier
tries) with the reason in the stats, compile=True raises ``NotTraceable`` naming it. The verdict is kept per
model (and attention), so later calls do not trace again.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch._dynamo.exc import TorchDynamoException

from ..decoding import SpecConfig, generate_spec
from ..decoding.ar import generate_ar
from ..decoding.compiled import AUTO, check_compile

METHODS = ("ar", "sjd", "lantern", "spec")


def generate(target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             method: str = "lantern", drafter=None, neighbours=None, tree: str = "auto", k: int = 1000,
             delta: float = 0.1, lam=None, budget: str = "candidate", cfg_scale=1.0, temperature=1.0, top_k=0,
             top_p=1.0, cfg_interval: int = -1, seed: int = 0, length: Optional[int] = None, emb_masks=None,
             compile=AUTO, image_ids=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
             stats: Optional[dict] = None, **tree_options):
    """input_ids [B, P] (and attention_mask [B, P], 1 = a token) -> (codes [B, N] int64 image codebook ids in
    raster order, SpecStats or None for "ar"); N = the image's tokens, or ``length`` (its first ``length``).

    method names the acceptance rule; the drafts come from ``drafter`` when given (an EAGLE drafter bound to
    the target, ``EagleDrafter.bind``), else from the target itself by Jacobi iteration (SJD):
    "ar" one token per forward; "spec" exact (δ = 0); "lantern" relaxed over the codebook's latent neighbours
    (``neighbours``, default the target's own table, ``HFTarget.neighbour_table(k)``); "sjd" Jacobi drafts,
    exact, or relaxed when given ``neighbours``. Guidance (cfg_scale != 1) uses the model's unconditional
    prompt, or ``negative_prompt_ids`` where the model takes one (Emu3, Chameleon). The other options are
    ``lantern.generate``'s (seed, image_ids, tree, window, ...). Structure tokens (Emu3's row ends) are
    forced, never relaxed, and not in the result; the stats count the loop's sequence, row ends included.
    compile: "auto", True, False or torch.compile's options, as for lantern's GPT (module docstring); what it
    resolved to and why is ``stats.compile`` (method "ar": ``stats["compile"]`` of a dict passed as ``stats``).
    A model that does not trace: "auto" runs eagerly, True raises ``NotTraceable``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_compile(compile)
    if stats is not None and (method != "ar" or not isinstance(stats, dict)):
        raise ValueError("stats (a dict) is for method='ar'; the other methods return their stats")
    if emb_masks is not None:
        raise ValueError("emb_masks is LlamaGen's caption padding; pass the prompt's attention_mask")
    guided = not (isinstance(cfg_scale, (int, float)) and cfg_scale == 1.0)
    cond = target.encode_prompt(input_ids, attention_mask, guided=guided, negative_prompt_ids=negative_prompt_ids,
                                negative_prompt_attention_mask=negative_prompt_attention_mask)
    view = target.for_prompt(cond)
    L = view.config.block_size
    if length is not None:
        n_codes = view.config.height * view.config.width
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= n_codes:
            raise ValueError(f"length must be an int in [1, {n_codes}] (image codes), got {length!r}")
        L = view.sequence_length(length)
    sampling = dict(cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    cfg_interval=cfg_interval, length=L, image_ids=image_ids)
    if method == "ar":
        if drafter is not None or neighbours is not None:
            raise ValueError("method='ar' takes no drafter and no neighbours")
        run_stats = {} if stats is None else stats

        def run(compile):
            run_stats.clear()
            return generate_ar(view, cond, compile=compile, stats=run_stats, **sampling), run_stats
    else:
        loop_method, neighbours = _method(view, method, drafter, neighbours, k)
        k = min(k, neighbours.shape[1]) if neighbours is not None else 0

        def run(compile):
            config = SpecConfig(method=loop_method, tree=tree, k=k, delta=delta, lam=lam,
                                budget=budget, compile=compile, **tree_options)
            return generate_spec(view, drafter, cond, neighbours, config=config, **sampling)
    tokens, run_stats = _run_compiled_or_eager(view, run, compile)
    return view.image_codes(tokens), (None if method == "ar" else run_stats)


class NotTraceable(RuntimeError):
    """compile=True on a wrapped model whose forward does not trace in one graph (the reason in the message)."""


_NOT_TRACEABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF model -> {attention: reason}


def _run_compiled_or_eager(target, run, compile):
    """run(compile) -> (tokens, stats); a model that does not trace runs eagerly under "auto" (the reason in the
    stats' compile) and raises NotTraceable under compile=True or options (module docstring)."""
    known = _NOT_TRACEABLE.get(target.model, {}).get(target.tree_attention)
    if known is None and compile is not False:
        try:
            return run(compile)
        except TorchDynamoException as error:
            known = _trace_failure(error)
            _NOT_TRACEABLE.setdefault(target.model, {})[target.tree_attention] = known
    if known is None or compile is False:
        return run(compile)
    if compile != AUTO:
        raise NotTraceable(f"compile={compile!r}: the wrapped {target.config.family} model's forward does not "
                           f"trace under torch.compile(fullgraph=True): {known}; pass compile=False (or "
                           f"'auto', which runs it eagerly)")
    tokens, stats = run(False)
    reason = f"off (auto: the wrapped {target.config.family} model does not trace: {known})"
    if isinstance(stats, dict):
        stats["compile"] = reason
    else:
        stats.compile = reason
    return tokens, stats


def _trace_failure(error: Exception) -> str:
    """The first line of dynamo's message (its explanation follows, then the user stack)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


def _method(target, method: str, drafter, neighbours, k: int):
    """(the loop's method, the neighbour table or None)."""
    relaxed = method == "lantern" or (method == "sjd" and neighbours is not None)
    if method == "spec" and neighbours is not None:
        raise ValueError("method='spec' is exact: it takes no neighbours (method='lantern' relaxes)")
    if drafter is not None and method == "sjd":
        raise ValueError("method='sjd' drafts from the target itself: drafter must be None")
    if not relaxed:
        return ("spec" if drafter is not None else "sjd"), None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1 (neighbours merged at most), got {k!r}")
    if neighbours is None:
        neighbours = target.neighbour_table(min(k, target.rules.n_codes - 1))
    neighbours = target.complete_table(neighbours)
    return ("lantern" if drafter is not None else "sjd"), neighbours
