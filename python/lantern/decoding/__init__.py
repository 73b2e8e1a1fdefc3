"""Decoding loops: autoregressive sampling (``ar``), speculative / LANTERN decoding (``spec``), MAR's
masked loop with a diffusion head (``mar``) and continuous speculative decoding for MAR (``cspd``)."""
from .ar import generate_ar, sample_next
from .costs import CostModel
from .cspd import CSpDConfig, CSpDSample, CSpDStats, generate_cspd
from .mar import MARSample, MARStats, generate_mar, sample_mar
from .planner import Plan, Planner, candidate_plans
from .spec import SpecConfig, SpecStats, generate_spec, resolve_cost_model

__all__ = ["generate", "generate_ar", "sample_next", "generate_spec", "SpecConfig", "SpecStats", "CostModel", "Plan",
           "Planner", "candidate_plans", "resolve_cost_model", "sample_mar", "generate_mar", "MARSample", "MARStats",
           "generate_cspd", "CSpDConfig", "CSpDStats", "CSpDSample"]


def generate(model, cond_idx, *, method: str = "lantern", drafter=None, neighbours=None, tree: str = "auto",
             k: int = 1000, delta: float = 0.1, lam=None, budget: str = "candidate", cfg_scale=1.0,
             temperature=1.0, top_k=0, top_p=1.0, cfg_interval: int = -1, seed: int = 0, length=None,
             emb_masks=None, compile=False, image_ids=None, **tree_options):
    """One entry point: method "ar" | "spec" (exact speculative decoding) | "lantern" (relaxed) | "sjd" (Jacobi
    self-drafting: no drafter; exact, or relaxed like "lantern" when given ``neighbours``) for GPT models;
    "cspd" (continuous speculative decoding) for MAR models.
    Returns (tokens [B, L], SpecStats or None for AR); L = ``length`` (default: the whole image).
    tree: "auto" (the planner picks each step's tree, or a plain AR step, from the device's measured costs
    and the run's acceptance), "chain", "static" or "dynamic".
    tree_options go to SpecConfig (depth, n_nodes, top_per_node, static_widths, draft, cost_model, plans; for
    "sjd": window, coupling, init, with tree "auto" or "chain" = every step the whole window; docs/sjd.md).
    emb_masks [B, C] (t2i GPT): which caption positions are real (1) or padding (0), see ``generate_ar``.
    image_ids [B] (integers in [0, 2^32), default 0..B-1): each image's key in the Philox stream of every draw
    (SPEC §5), so an image depends on its id and the seed, not on the batch it is in (with a fixed tree;
    ``tree="auto"`` plans from the whole batch). For MAR models too (``sample_mar``).
    compile: True runs the target's (and drafter's) forwards through torch.compile (inductor; CUDA graphs on a
    GPU) with node counts padded to a few buckets (``decoding/compiled.py``); a dict: those torch.compile
    options. The one-off compile time is in the stats (``compile_s``; AR: pass ``stats={}`` to
    ``generate_ar``).
    A transformers model wrapped by ``lantern.hf.wrap`` takes the prompt ids as cond_idx (keywords
    attention_mask, negative_prompt_ids, ...) and returns image codes: ``lantern.hf.generate``.
    A MAR model (``model.family == "mar"``) samples with ``sample_mar``: -> (tokens [B, L, C], MARStats);
    its options (num_iter, cfg_schedule, ...) are passed as keywords. With method="cspd" and a MAR
    drafter it samples with ``generate_cspd``: -> (tokens [B, L, C], CSpDStats); keywords gamma, rule,
    bandwidth, sigma_ratio, prefill, max_tries, last_step_noise (``CSpDConfig``) and num_iter, cfg_schedule,
    on_step."""
    if getattr(model, "family", None) == "hf":  # a transformers model wrapped by lantern.hf.wrap
        return model.generate(cond_idx, method=method, drafter=drafter, neighbours=neighbours, tree=tree, k=k,
                              delta=delta, lam=lam, budget=budget, cfg_scale=cfg_scale, temperature=temperature,
                              top_k=top_k, top_p=top_p, cfg_interval=cfg_interval, seed=seed, length=length,
                              emb_masks=emb_masks, compile=compile, image_ids=image_ids, **tree_options)
    if getattr(model, "family", None) == "mar":
        if image_ids is not None:
            tree_options["image_ids"] = image_ids
        if emb_masks is not None:
            raise ValueError("emb_masks (caption padding) is for t2i GPT models, not MAR")
        if compile:
            raise ValueError("compile is for GPT models (AR and speculative decoding), not MAR")
        if method == "cspd":
            return _generate_cspd(model, drafter, cond_idx, cfg_scale, temperature, seed, tree_options)
        return generate_mar(model, cond_idx, drafter=drafter, cfg_scale=cfg_scale, temperature=temperature,
                            seed=seed, **tree_options)
    if method == "cspd":
        raise ValueError("method='cspd' (continuous speculative decoding) is for MAR models")
    if method == "ar":
        return generate_ar(model, cond_idx, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                           top_p=top_p, cfg_interval=cfg_interval, seed=seed, length=length,
                           emb_masks=emb_masks, compile=compile, image_ids=image_ids), None
    config = SpecConfig(method=method, tree=tree, k=k, delta=delta, lam=lam, budget=budget, compile=compile,
                        **tree_options)
    return generate_spec(model, drafter, cond_idx, neighbours, config=config, cfg_scale=cfg_scale,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, length=length,
                         cfg_interval=cfg_interval, emb_masks=emb_masks, image_ids=image_ids)


def _generate_cspd(model, drafter, labels, cfg_scale, temperature, seed, options: dict):
    if drafter is None or getattr(drafter, "family", None) != "mar":
        raise ValueError("method='cspd' needs a MAR drafter (e.g. lantern.tiny_mar.load_tiny_mar().drafter)")
    fields = set(CSpDConfig.__dataclass_fields__)
    config = CSpDConfig(**{k: v for k, v in options.items() if k in fields})
    rest = {k: v for k, v in options.items() if k not in fields}
    out = generate_cspd(model, drafter, labels, config=config, cfg=cfg_scale, temperature=temperature, seed=seed,
                        **rest)
    return out.tokens, out.stats
