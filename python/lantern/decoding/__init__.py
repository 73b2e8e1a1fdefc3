"""Decoding loops: autoregressive sampling (``ar``), speculative / LANTERN decoding (``spec``), MAR's
masked loop with a diffusion head (``mar``) and continuous speculative decoding for MAR (``cspd``)."""
from .ar import generate_ar, sample_next
from .calibration import resolve_cost_model
from .config import Sampling, SpecConfig, SpecStats
from .costs import CostModel
from .cspd import CSpDConfig, CSpDSample, CSpDStats, generate_cspd
from .mar import MARSample, MARStats, generate_mar, sample_mar
from .options import check_applicable
from .planner import Plan, Planner, candidate_plans
from .spec import generate_spec

__all__ = ["generate", "generate_ar", "sample_next", "generate_spec", "SpecConfig", "SpecStats", "Sampling",
           "CostModel", "Plan", "Planner", "candidate_plans", "resolve_cost_model", "sample_mar", "generate_mar",
           "MARSample", "MARStats", "generate_cspd", "CSpDConfig", "CSpDStats", "CSpDSample"]


# the defaults of generate's own keywords, against which "given" is told (options.check_applicable)
_DEFAULTS = dict(drafter=None, neighbours=None, tree="auto", k=1000, delta=0.1, lam=None, budget="candidate",
                 top_k=0, top_p=1.0, cfg_interval=-1, length=None, emb_masks=None, compile="auto")


def generate(model, cond_idx, *, method=None, drafter=None, neighbours=None, tree: str = "auto", k: int = 1000,
             delta: float = 0.1, lam=None, budget: str = "candidate", cfg_scale=1.0, temperature=1.0, top_k=0,
             top_p=1.0, cfg_interval: int = -1, seed: int = 0, length=None, emb_masks=None, compile="auto",
             image_ids=None, **options):
    """One entry point: method "ar" | "spec" (exact speculative decoding) | "lantern" (relaxed, the default) |
    "sjd" (Jacobi self-drafting: no drafter; exact, or relaxed like "lantern" when given ``neighbours``) for
    GPT models; "ar" (MAR's own loop, the default) | "cspd" (continuous speculative decoding) for MAR models.
    Returns (tokens [B, L], SpecStats or None for AR); L = ``length`` (default: the whole image).
    tree: "auto" (the planner picks each step's tree, or a plain AR step, from the device's measured costs
    and the run's acceptance), "chain", "static" or "dynamic".
    options go to SpecConfig (depth, n_nodes, top_per_node, static_widths, draft, cost_model, plans; for
    "sjd": window, coupling, init, with tree "auto" or "chain" = every step the whole window; docs/sjd.md).
    emb_masks [B, C] (t2i GPT): which caption positions are real (1) or padding (0), see ``generate_ar``.
    image_ids [B] (integers in [0, 2^32), default 0..B-1): each image's key in the Philox stream of every draw
    (SPEC §5), so an image depends on its id and the seed, not on the batch it is in (with a fixed tree;
    ``tree="auto"`` plans from the whole batch). For MAR models too (``sample_mar``).
    compile: "auto" (default): compiled where torch.compile works on the device (a C++ compiler on a CPU,
    Triton on a GPU; LANTERN_COMPILE=0 turns it off), eager elsewhere, the choice and its reason in the stats
    (``compile``); True runs the target's (and drafter's) forwards through torch.compile (inductor; CUDA
    graphs on a GPU) with node counts padded to a few buckets (``decoding/compiled.py``); False eager; a dict:
    those torch.compile options. Compiled graphs are cached on disk under lantern's cache folder. The one-off
    compile time is in the stats (``compile_s``; AR: pass ``stats={}`` to ``generate_ar``).
    A transformers model wrapped by ``lantern.hf.wrap`` takes the prompt ids as cond_idx (keywords
    attention_mask, negative_prompt_ids, ...) and returns image codes: ``lantern.hf.generate``.
    A MAR model (``model.family == "mar"``) samples with ``sample_mar``: -> (tokens [B, L, C], MARStats);
    its options (num_iter, cfg_schedule, last_step_noise, ...) are passed as keywords. With method="cspd" and
    a MAR drafter it samples with ``generate_cspd``: -> (tokens [B, L, C], CSpDStats); keywords gamma, rule,
    bandwidth, sigma_ratio, prefill, max_tries, last_step_noise, align (``CSpDConfig``) and num_iter,
    cfg_schedule, on_step.

    An option that does not apply to the model, method or tree (a GPT option for MAR, window for "spec", lam
    for "sjd" without a neighbour table, n_nodes for a chain, ...) is refused with a ValueError naming it when
    it is given a value other than its default (``options.py``). One call at a time per GPT model: a call from
    another thread on the same model or drafter waits for it (``exclusive.py``)."""
    if getattr(model, "family", None) == "hf":  # a transformers model wrapped by lantern.hf.wrap
        return model.generate(cond_idx, method=method or "lantern", drafter=drafter, neighbours=neighbours, tree=tree,
                              k=k, delta=delta, lam=lam, budget=budget, cfg_scale=cfg_scale, temperature=temperature,
                              top_k=top_k, top_p=top_p, cfg_interval=cfg_interval, seed=seed, length=length,
                              emb_masks=emb_masks, compile=compile, image_ids=image_ids, **options)
    family = "mar" if getattr(model, "family", None) == "mar" else "gpt"
    if method is None:
        method = "ar" if family == "mar" else "lantern"
    values = dict(drafter=drafter, neighbours=neighbours, tree=tree, k=k, delta=delta, lam=lam, budget=budget,
                  top_k=top_k, top_p=top_p, cfg_interval=cfg_interval, length=length, emb_masks=emb_masks,
                  compile=compile)
    given = {name: v for name, v in values.items() if not _is_default(v, _DEFAULTS[name])}
    if family == "mar" and compile is False:  # MAR's loops run eagerly: False asks for what they do
        given.pop("compile")
    # a config keyword at its default asks for nothing: it is dropped (a MAR run is never passed SpecConfig's)
    options = {name: v for name, v in options.items() if name not in _CONFIG_DEFAULTS
               or not _is_default(v, _CONFIG_DEFAULTS[name])}
    given.update(options)
    relaxed = method == "lantern" or (method == "sjd" and neighbours is not None)
    check_applicable(family, method, given, tree=tree, relaxed=relaxed)
    if family == "mar":
        if image_ids is not None:
            options["image_ids"] = image_ids
        if method == "cspd":
            return _generate_cspd(model, drafter, cond_idx, cfg_scale, temperature, seed, options)
        return generate_mar(model, cond_idx, drafter=drafter, cfg_scale=cfg_scale, temperature=temperature,
                            seed=seed, **options)
    if method == "ar":
        return generate_ar(model, cond_idx, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                           top_p=top_p, cfg_interval=cfg_interval, seed=seed, length=length,
                           emb_masks=emb_masks, compile=compile, image_ids=image_ids), None
    config = SpecConfig(method=method, tree=tree, k=k, delta=delta, lam=lam, budget=budget, compile=compile,
                        **options)
    return generate_spec(model, drafter, cond_idx, neighbours, config=config, cfg_scale=cfg_scale,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, length=length,
                         cfg_interval=cfg_interval, emb_masks=emb_masks, image_ids=image_ids)


# the defaults of the keywords that go to SpecConfig or CSpDConfig
_CONFIG_DEFAULTS = {name: f.default for cls in (CSpDConfig, SpecConfig) for name, f in cls.__dataclass_fields__.items()}


def _is_default(value, default) -> bool:
    """Whether a keyword holds its default: the same object, or an equal number, string or tuple of them (a
    bool only as itself; a tensor never)."""
    if value is default:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return False
    if isinstance(value, (tuple, list)) and isinstance(default, (tuple, list)):
        return len(value) == len(default) and all(_is_default(v, d) for v, d in zip(value, default))
    plain = (int, float, str)
    return isinstance(value, plain) and isinstance(default, plain) and value == default


def _generate_cspd(model, drafter, labels, cfg_scale, temperature, seed, options: dict):
    if drafter is None or getattr(drafter, "family", None) != "mar":
        raise ValueError("method='cspd' needs a MAR drafter (e.g. lantern.tiny_mar.load_tiny_mar().drafter)")
    fields = set(CSpDConfig.__dataclass_fields__)
    config = CSpDConfig(**{k: v for k, v in options.items() if k in fields})
    rest = {k: v for k, v in options.items() if k not in fields}
    out = generate_cspd(model, drafter, labels, config=config, cfg=cfg_scale, temperature=temperature, seed=seed,
                        **rest)
    return out.tokens, out.stats
