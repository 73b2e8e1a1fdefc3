"""The models a run samples with, chosen by its settings (``--model`` and the checkpoint options): loading
them, their recommended sampling settings, the drafter and neighbour table a method needs, and MAR's decoding.
Shared by ``lantern generate`` (``lantern.cli``) and ``lantern.sample`` (``sampling``): ``settings`` is any object
with ``sample_settings.SampleSettings``' attribute names (the command line's parsed options have them).
A refusal is a SystemExit naming the option, as the command line shows it."""
from __future__ import annotations

import torch

from .decoding import CSpDConfig

LLAMAGEN_DEMO_CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]
MAR_MODELS = ("tiny-mar", "mar-checkpoint")
# the released MAR models' guidance (linear schedule) and a demo step count
OFFICIAL_CFG = {"MAR-B": 2.9, "MAR-L": 3.0, "MAR-H": 3.2}
OFFICIAL_NUM_ITER = 64
# the --method cspd settings and their defaults (CSpDConfig's)
CSPD_DEFAULTS = {name: getattr(CSpDConfig, name) for name in ("gamma", "rule", "bandwidth", "sigma_ratio", "prefill",
                                                               "max_tries")}

# options that apply to some models only (dest -> the --model values they apply to)
MODEL_OPTIONS = {
    "gpt": ("checkpoint",), "gpt_name": ("checkpoint",), "vq": ("checkpoint",), "image_size": ("checkpoint",),
    "mar": ("mar-checkpoint",), "mar_name": ("mar-checkpoint",), "vae": ("mar-checkpoint",),
    "vae_name": ("mar-checkpoint",), "num_sampling_steps": ("mar-checkpoint",),
    "num_iter": ("tiny-mar", "mar-checkpoint"), "cfg_schedule": ("tiny-mar", "mar-checkpoint"),
    **{name: ("tiny-mar", "mar-checkpoint") for name in ("gamma", "rule", "bandwidth", "sigma_ratio", "prefill",
                                                         "max_tries")},
    "mar_drafter": ("mar-checkpoint",), "mar_drafter_name": ("mar-checkpoint",),
}
MODEL_DEFAULTS = {"gpt_name": "GPT-XL", "image_size": 256, "mar_name": "MAR-B", "vae_name": "KL-16"}


def is_mar(settings) -> bool:
    return settings.model in MAR_MODELS


def relaxed(settings) -> bool:
    """Whether the run relaxes its acceptance over latent neighbours: lantern, or sjd given a TV budget or a
    lambda cap. Such a run, and only such a run, is given a neighbour table (``drafter_and_table``), which is
    what makes the loop's acceptance relaxed (``SpecConfig``'s rule: lantern, or sjd with a table)."""
    return settings.method == "lantern" or (settings.method == "sjd" and ((settings.delta or 0) > 0
                                                                          or settings.lam is not None))


def check_classes(classes, num_classes: int) -> None:
    """--classes must be ids of the model's classes, [0, num_classes)."""
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise SystemExit(f"--classes must be class ids in [0, {num_classes}) for this model "
                         f"({num_classes} classes), got {bad}")


def load_discrete(settings):
    """(gpt, vq, meta) for the chosen source."""
    if settings.model == "tiny":
        from .pretrained import load_tiny

        tiny = load_tiny(settings.device, dtype=dtype_of(settings))
        return tiny.gpt, tiny.vq, tiny.meta
    if not settings.gpt or not settings.vq:
        raise SystemExit("--model checkpoint needs --gpt PATH and --vq PATH")
    from .models import load_gpt, load_vq

    block = (settings.image_size // 16) ** 2
    gpt = load_gpt(settings.gpt, settings.gpt_name, block_size=block, device=settings.device,
                   dtype=dtype_of(settings)).eval()
    vq = load_vq(settings.vq, "VQ-16", decoder_only=True, device=settings.device).eval()
    return gpt, vq, {"sampling": {"cfg_scale": 4.0, "top_k": 2000}}


def dtype_of(settings) -> torch.dtype:
    from .models import decode_dtype

    return decode_dtype(settings.device) if settings.dtype == "auto" else getattr(torch, settings.dtype)


def drafter_and_table(settings, gpt, vq):
    """(drafter, neighbour table): sjd has no drafter, and a table only when relaxed."""
    from .neighbours import neighbour_table

    table = None
    if relaxed(settings):
        V = vq.quantize.embedding.weight.shape[0]
        if settings.k > V:
            raise SystemExit(f"--k must be at most the codebook's {V} codes (latent neighbours merged at most), got "
                             f"{settings.k}")
        K = max(settings.k, 1)
        table = neighbour_table(vq.quantize.embedding.weight, K, normalize=True)
    if settings.method == "sjd":
        return None, table
    if settings.model != "tiny":
        raise SystemExit("--method spec/lantern with official checkpoints needs a trained drafter; "
                         "today the CLI ships one for the tiny model only (docs/usage.md); --method sjd needs none")
    from .pretrained import load_tiny_drafter

    return load_tiny_drafter(gpt), table


def guidance_and_top_k(settings, meta: dict):
    """--cfg-scale and --top-k, or the model's recommendation (meta["sampling"]), or LlamaGen's 4.0 / off."""
    defaults = meta.get("sampling", {})
    cfg_scale = settings.cfg_scale if settings.cfg_scale is not None else defaults.get("cfg_scale", 4.0)
    top_k = settings.top_k if settings.top_k is not None else defaults.get("top_k", 0)
    return cfg_scale, top_k


def method_options(settings) -> dict:
    """The speculative methods' ``lantern.generate`` options from the settings (drafter and table aside)."""
    options = dict(tree=settings.tree, k=settings.k, delta=settings.delta, lam=settings.lam, budget=settings.budget,
                   depth=settings.depth, n_nodes=settings.nodes, draft=settings.draft)
    if settings.method == "sjd":
        options.update(window=settings.window, coupling=settings.coupling, init=settings.init)
    return options


# -- MAR ----------------------------------------------------------------------------------------------------

def load_mar_models(settings):
    """(mar, drafter or None, vae, sampling defaults, classes) for the chosen source."""
    cspd = settings.method == "cspd"
    if settings.model == "tiny-mar":
        from .tiny_mar import load_tiny_mar

        try:
            tiny = load_tiny_mar(settings.device)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from e
        return (tiny.mar, tiny.drafter if cspd else None, tiny.vae, tiny.meta["sampling"],
                list(range(tiny.mar.config.class_num)))
    if not settings.mar or not settings.vae:
        raise SystemExit("--model mar-checkpoint needs --mar PATH (checkpoint-last.pth: its model_ema is used) "
                         "and --vae PATH (kl16.ckpt)")
    if cspd and not settings.mar_drafter:
        raise SystemExit("--method cspd with --model mar-checkpoint needs --mar-drafter PATH (a smaller MAR, e.g. "
                         "MAR-B for MAR-H) and --mar-drafter-name")
    from .models import load_mar, load_vae

    overrides = {"num_sampling_steps": settings.num_sampling_steps} if settings.num_sampling_steps else {}
    mar = load_mar(settings.mar, settings.mar_name, device=settings.device, **overrides)
    drafter = load_mar(settings.mar_drafter, settings.mar_drafter_name or "MAR-B", device=settings.device,
                       **overrides) if cspd else None
    vae = load_vae(settings.vae, settings.vae_name, device=settings.device)
    defaults = dict(cfg=OFFICIAL_CFG.get(settings.mar_name, 3.0), cfg_schedule="linear", num_iter=OFFICIAL_NUM_ITER,
                    temperature=1.0)
    return mar, drafter, vae, defaults, LLAMAGEN_DEMO_CLASSES


def check_mar_method(settings) -> None:
    """What a MAR run refuses (``sample_options.check_method_options`` checks these and the rest, for generate
    and sample, before any model is loaded)."""
    if settings.method not in ("ar", "cspd"):
        raise SystemExit(f"--method {settings.method} is for the discrete models; MAR samples with its own loop "
                         f"(--method ar) or with continuous speculative decoding (--method cspd)")
    if settings.top_k not in (None, 0) or settings.top_p != 1.0:
        raise SystemExit("--top-k / --top-p filter discrete tokens; MAR's tokens are continuous")
    if settings.cfg_interval != -1:
        raise SystemExit("--cfg-interval is for the discrete models; MAR uses --cfg-schedule")
    given = [name for name in (*CSPD_DEFAULTS, "mar_drafter", "mar_drafter_name")
             if getattr(settings, name) is not None]
    if settings.method != "cspd" and given:
        raise SystemExit(f"--{given[0].replace('_', '-')} applies to --method cspd")


def cspd_config(settings) -> CSpDConfig:
    """The CSpDConfig of --method cspd: the given settings over CSpDConfig's defaults, checked by it."""
    values = {k: (getattr(settings, k) if getattr(settings, k) is not None else v) for k, v in CSPD_DEFAULTS.items()}
    config = CSpDConfig(**values)
    try:
        config.check()
    except ValueError as e:  # names the setting (gamma, prefill, bandwidth, max_tries, ...)
        raise SystemExit(f"--method cspd: {e}") from e
    return config


def mar_settings(settings, mar, defaults: dict, config):
    """(guidance scale, MAR steps, guidance schedule): the command line's, else the model's recommendation.
    CSpD (``config`` given) defaults to one token per MAR step, as the paper (its speed comes from drafting
    those steps)."""
    cfg = settings.cfg_scale if settings.cfg_scale is not None else defaults["cfg"]
    L = mar.config.seq_len
    if settings.num_iter is None:
        num_iter = L if config is not None else min(defaults["num_iter"], L)
    elif settings.num_iter > L:
        raise SystemExit(f"--num-iter must be at most the image's {L} tokens (a MAR step predicts at least one), "
                         f"got {settings.num_iter}")
    else:
        num_iter = settings.num_iter
    if config is not None and config.gamma > L:
        raise SystemExit(f"--gamma must be at most the image's {L} tokens (drafted MAR steps per block), got "
                         f"{config.gamma}")
    return cfg, num_iter, settings.cfg_schedule or defaults["cfg_schedule"]


@torch.no_grad()
def decode_mar(mar, vae, tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.decode_tokens(mar.unpatchify(chunk)) for chunk in tokens.split(64)])
