"""``lantern.generate`` for a wrapped transformers model: the prompt as the model's own ``generate`` takes it, the
image codes out, through lantern's unchanged loops (``decoding.ar.generate_ar``, ``decoding.spec.generate_spec``)."""
from __future__ import annotations

from typing import Optional

import torch

from ..decoding.ar import generate_ar
from ..decoding import SpecConfig, generate_spec

METHODS = ("ar", "sjd", "lantern", "spec")


def generate(target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             method: str = "lantern", drafter=None, neighbours=None, tree: str = "auto", k: int = 1000,
             delta: float = 0.1, lam=None, budget: str = "candidate", cfg_scale=1.0, temperature=1.0, top_k=0,
             top_p=1.0, cfg_interval: int = -1, seed: int = 0, length: Optional[int] = None, emb_masks=None,
             compile=False, image_ids=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
             **tree_options):
    """input_ids [B, P] (and attention_mask [B, P], 1 = a token) -> (codes [B, N] int64 image codebook ids in
    raster order, SpecStats or None for "ar"); N = the image's tokens, or ``length`` (its first ``length``).

    method names the acceptance rule; the drafts come from ``drafter`` when given (an EAGLE drafter bound to
    the target, ``EagleDrafter.bind``), else from the target itself by Jacobi iteration (SJD):
    "ar" one token per forward; "spec" exact (δ = 0); "lantern" relaxed over the codebook's latent neighbours
    (``neighbours``, default the target's own table, ``HFTarget.neighbour_table(k)``); "sjd" Jacobi drafts,
    exact, or relaxed when given ``neighbours``. Guidance (cfg_scale != 1) uses the model's unconditional
    prompt, or ``negative_prompt_ids`` where the model takes one (Emu3, Chameleon). The other options are
    ``lantern.generate``'s (seed, image_ids, tree, window, ...). Structure tokens (Emu3's row ends) are
    forced, never relaxed, and not in the result; the stats count the loop's sequence, row ends included."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if compile == "auto":  # lantern.generate's default: a wrapped transformers model runs eagerly
        compile = False
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
        tokens = generate_ar(view, cond, compile=compile, **sampling)
        return view.image_codes(tokens), None
    loop_method, neighbours = _method(view, method, drafter, neighbours, k)
    k = min(k, neighbours.shape[1]) if neighbours is not None else 0
    config = SpecConfig(method=loop_method, tree=tree, k=k, delta=delta, lam=lam,
                        budget=budget, compile=compile, **tree_options)
    tokens, stats = generate_spec(view, drafter, cond, neighbours, config=config, **sampling)
    return view.image_codes(tokens), stats


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
