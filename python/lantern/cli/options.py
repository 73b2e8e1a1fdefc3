"""The option groups that ``lantern generate`` and ``lantern sample`` share: the model, the sampling settings,
the method (speculative decoding, Jacobi, CSpD) and the device. Defaults and choices are the library's
(``SpecConfig``, ``CSpDConfig``, ``sample_settings``); the checks are the library's too
(``sample_options.check_method_options``)."""
from __future__ import annotations

import argparse

from ..decoding import CSpDConfig, SpecConfig
from ..sample_settings import (
    CFG_SCHEDULES,
    DRAFT_KINDS,
    DTYPES,
    IMAGE_SIZES,
    METHODS,
    MODELS,
    VAE_NAMES,
    SampleSettings,
    default_device,
    default_of,
)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model's source (--model and the checkpoint files; shared by generate and sample)."""
    src = p.add_argument_group("model")
    src.add_argument("--model", default=default_of("model"), choices=MODELS,
                     help="'tiny': the shipped default (trained by python -m lantern.tiny.train); "
                          "'checkpoint': official LlamaGen files given by --gpt / --vq; "
                          "'tiny-mar': the continuous-token default (trained by python -m lantern.tiny_mar.train); "
                          "'mar-checkpoint': official MAR files given by --mar / --vae")
    src.add_argument("--gpt", metavar="PATH", help="GPT checkpoint (.pt / .pth / .safetensors)")
    src.add_argument("--gpt-name", help="GPT config: GPT-B, GPT-L, GPT-XL (default), GPT-XXL, GPT-3B")
    src.add_argument("--vq", metavar="PATH", help="VQ-16 tokenizer checkpoint")
    src.add_argument("--image-size", type=int, choices=IMAGE_SIZES,
                     help="official models: image size (16x16, 24x24 or 32x32 tokens; default 256)")
    mar = p.add_argument_group("MAR (--model tiny-mar | mar-checkpoint)")
    mar.add_argument("--mar", metavar="PATH",
                     help="MAR checkpoint (checkpoint-last.pth: its model_ema; or safetensors)")
    mar.add_argument("--mar-name", help="MAR config: MAR-B (default), MAR-L, MAR-H")
    mar.add_argument("--vae", metavar="PATH", help="KL-16 autoencoder checkpoint (kl16.ckpt)")
    mar.add_argument("--vae-name", choices=VAE_NAMES, help="autoencoder config (default KL-16)")
    mar.add_argument("--num-iter", type=int, help="MAR steps (default: the model's recommendation; 64 official)")
    mar.add_argument("--cfg-schedule", choices=CFG_SCHEDULES, help="guidance schedule over the MAR steps "
                     "(default: the model's recommendation, linear)")
    mar.add_argument("--num-sampling-steps", help="official models: diffusion steps of the head (default 100)")


def add_sampling_options(p: argparse.ArgumentParser, classes_help: str):
    """--classes, --seed and the sampling settings (guidance, temperature, filters) -> the group."""
    samp = p.add_argument_group("sampling")
    samp.add_argument("--classes", type=int, nargs="+", help=classes_help)
    samp.add_argument("--seed", type=int, default=default_of("seed"),
                      help="seed of the sampling stream: same seed, same image")
    samp.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale (1 = off; default: the "
                      "model's recommended value, 4.0 for official models)")
    samp.add_argument("--cfg-interval", type=int, default=default_of("cfg_interval"),
                      help="use guidance only up to this step (-1 = always)")
    samp.add_argument("--temperature", type=float, default=default_of("temperature"), help="0 = greedy")
    samp.add_argument("--top-k", type=int, help="keep the top-k logits (0 = off; default: the model's, 2000 official)")
    samp.add_argument("--top-p", type=float, default=default_of("top_p"), help="nucleus filter (1 = off)")
    return samp


def add_method_options(p: argparse.ArgumentParser, run):
    """--method (in ``run``) and each method's options -> the speculative-decoding group."""
    run.add_argument("--method", default=default_of("method"), choices=METHODS,
                     help="ar: one target forward per token (MAR: its own loop); spec: exact speculative decoding; "
                          "lantern: relaxed acceptance over latent neighbours (faster, bounded TV); sjd: Jacobi "
                          "self-drafting, no drafter (exact; relaxed like lantern when given --delta > 0 or --lam); "
                          "cspd: continuous speculative decoding (MAR models)")
    spec = p.add_argument_group("speculative decoding (--method spec | lantern | sjd)")
    spec.add_argument("--tree", default=SpecConfig.tree, choices=_choices("tree"),
                      help="draft tree: auto (each step, the tree or plain AR step that the device's measured "
                           "costs and the run's acceptance predict fastest), chain, fixed static shape (sampled "
                           "drafts), EAGLE-2 dynamic")
    spec.add_argument("--draft", choices=DRAFT_KINDS,
                      help="draft kind: sampled (drawn from the drafter's distribution, kept with probability "
                           "min(1, p/q): accepts far more on image tokens) or deterministic (the drafter's top "
                           "tokens). Default: sampled for chains and static trees, deterministic for EAGLE-2 "
                           "dynamic trees; with --tree auto, sampled leaves out the dynamic trees and "
                           "deterministic the static ones")
    spec.add_argument("--depth", type=int, default=SpecConfig.depth,
                      help="draft levels (chain length / EAGLE-2 expansions; "
                      "auto: the deepest candidate)")
    spec.add_argument("--nodes", type=int, default=SpecConfig.n_nodes,
                      help="EAGLE-2: drafted nodes kept per step (>= 1; for no "
                      "drafts use --method ar)")
    spec.add_argument("--k", type=int, default=SpecConfig.k, help="LANTERN: latent neighbours merged at most")
    spec.add_argument("--delta", type=float, help=f"LANTERN: total-variation budget (default {SpecConfig.delta} for "
                      f"lantern; sjd: 0, exact)")
    spec.add_argument("--lam", type=float, help="LANTERN++: multiplicative cap lambda (instead of --delta)")
    spec.add_argument("--budget", default=SpecConfig.budget, choices=_choices("budget"),
                      help="delta per candidate (upstream) or per tree node (TV <= delta guaranteed)")
    jacobi = p.add_argument_group("Jacobi self-drafting (--method sjd; docs/sjd.md)")
    jacobi.add_argument("--window", type=int, default=SpecConfig.window,
                        help="drafts verified per step (--tree chain), or the "
                        "largest window the planner chooses from (--tree auto)")
    jacobi.add_argument("--coupling", action="store_true", help="coupled drafts (SCD): the draws of one image "
                        "position share their random numbers across steps")
    jacobi.add_argument("--init", default=SpecConfig.init, choices=_choices("init"), help="fresh window slots: copy "
                        "the token to their left, or draw from the last forward's row")
    add_cspd_options(p)
    # the command's defaults (its own set_defaults included), to tell which options were given
    p.set_defaults(parser_default=p.get_default)
    return spec


def add_device_options(run) -> None:
    """--fused, --compile, --device, --dtype."""
    run.add_argument("--fused", metavar="BACKEND",
                     help="enable fused ops: auto | cpu | cuda | triton. Faster, and not only faster: the kernels "
                          "round differently from the reference (tree attention most in bfloat16), so some "
                          "tokens can differ (docs/sampling.md \"Numerics\")")
    run.add_argument("--compile", nargs="?", const="on", default=default_of("compile"), choices=_choices("compile"),
                     help="target and drafter forwards through torch.compile (inductor; CUDA graphs on a GPU), "
                          "node counts padded to a few buckets. auto (default): on where torch.compile works on "
                          "the device (LANTERN_COMPILE=0 turns it off); --compile alone: on. Compiled graphs are "
                          "cached under $LANTERN_CACHE/inductor; the one-off compile time is reported apart")
    run.add_argument("--device", default=default_device())
    run.add_argument("--dtype", default=default_of("dtype"), choices=DTYPES,
                     help="the GPT's compute dtype. auto: bfloat16 on a GPU, and on a CPU with native bf16 dot "
                          "products (AVX512-BF16 / AMX), else float32. float64: slow; last-bit differences "
                          "between kernels (batch shapes, backends) then almost never change a token")


def add_cspd_options(p: argparse.ArgumentParser) -> None:
    """The --method cspd options (None when not given: they apply to MAR models only; CSpDConfig's defaults)."""
    g = p.add_argument_group("continuous speculative decoding (--method cspd, MAR models)")
    g.add_argument("--gamma", type=int, help=f"drafted MAR steps per verification (default {CSpDConfig.gamma})")
    g.add_argument("--rule", choices=_choices("rule"), help="acceptance rule: exact (each token has the target's "
                   "law, needs last-step noise) or the paper's density-ratio surrogate (lossy); default exact")
    g.add_argument("--bandwidth", type=float, help="paper rule: std scale inside the exponent (1 = the paper, 42 = "
                   f"the official code; default {CSpDConfig.bandwidth:g})")
    g.add_argument("--sigma-ratio", choices=_choices("sigma_ratio"), help="paper rule: direction of the per-step std "
                   f"product (paper: prod sigma_q/sigma_p; code: its reciprocal; default {CSpDConfig.sigma_ratio})")
    g.add_argument("--prefill", type=float,
                   help=f"fraction of the MAR steps the target runs alone first (default {CSpDConfig.prefill})")
    g.add_argument("--max-tries", type=int, help="residual sampler's cap; a capped token keeps a target sample and "
                   f"is counted (default {CSpDConfig.max_tries})")
    g.add_argument("--mar-drafter", metavar="PATH", help="--model mar-checkpoint: the drafter's MAR checkpoint")
    g.add_argument("--mar-drafter-name", help="--model mar-checkpoint: the drafter's MAR config (default MAR-B)")


def _choices(name: str) -> tuple:
    """The choices of setting ``name`` (``SampleSettings``)."""
    return SampleSettings.__dataclass_fields__[name].metadata["choices"]
