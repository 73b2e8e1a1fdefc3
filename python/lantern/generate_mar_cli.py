"""`lantern generate --model tiny-mar | mar-checkpoint [--method cspd]`: sample MAR images (plainly, or with
continuous speculative decoding and a MAR drafter), write a PNG grid (and JSON), print throughput split into
transformer, diffusion head and verification (and quality for the tiny model). With --method cspd the
target-only MAR at the same settings runs in the same process (unless --no-ar-baseline) for speedup_vs_ar."""
from __future__ import annotations

import argparse
import time

import torch

MAR_MODELS = ("tiny-mar", "mar-checkpoint")
# the released models' guidance (linear schedule) and a demo step count
OFFICIAL_CFG = {"MAR-B": 2.9, "MAR-L": 3.0, "MAR-H": 3.2}
OFFICIAL_NUM_ITER = 64
CSPD_DEFAULTS = dict(gamma=8, rule="exact", bandwidth=1.0, sigma_ratio="paper", prefill=0.05, max_tries=1000)


def add_cspd_options(p: argparse.ArgumentParser) -> None:
    """The --method cspd options (None when not given: they apply to MAR models only)."""
    g = p.add_argument_group("continuous speculative decoding (--method cspd, MAR models)")
    g.add_argument("--gamma", type=int, help=f"drafted MAR steps per verification (default {CSPD_DEFAULTS['gamma']})")
    g.add_argument("--rule", choices=["exact", "paper"], help="acceptance rule: exact (each token has the target's "
                   "law, needs last-step noise) or the paper's density-ratio surrogate (lossy); default exact")
    g.add_argument("--bandwidth", type=float, help="paper rule: std scale inside the exponent (1 = the paper, 42 = "
                   "the official code; default 1)")
    g.add_argument("--sigma-ratio", choices=["paper", "code"], help="paper rule: direction of the per-step std "
                   "product (paper: prod sigma_q/sigma_p; code: its reciprocal; default paper)")
    g.add_argument("--prefill", type=float, help="fraction of the MAR steps the target runs alone first (default 0.05)")
    g.add_argument("--max-tries", type=int, help="residual sampler's cap; a capped token keeps a target sample and "
                   "is counted (default 1000)")
    g.add_argument("--mar-drafter", metavar="PATH", help="--model mar-checkpoint: the drafter's MAR checkpoint")
    g.add_argument("--mar-drafter-name", help="--model mar-checkpoint: the drafter's MAR config (default MAR-B)")


def _load(args):
    """(mar, drafter or None, vae, sampling defaults, classes) for the chosen source."""
    cspd = args.method == "cspd"
    if args.model == "tiny-mar":
        from .tiny_mar import load_tiny_mar

        try:
            tiny = load_tiny_mar(args.device)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from e
        return (tiny.mar, tiny.drafter if cspd else None, tiny.vae, tiny.meta["sampling"],
                list(range(tiny.mar.config.class_num)))
    if not args.mar or not args.vae:
        raise SystemExit("--model mar-checkpoint needs --mar PATH (checkpoint-last.pth: its model_ema is used) "
                         "and --vae PATH (kl16.ckpt)")
    if cspd and not args.mar_drafter:
        raise SystemExit("--method cspd with --model mar-checkpoint needs --mar-drafter PATH (a smaller MAR, e.g. "
                         "MAR-B for MAR-H) and --mar-drafter-name")
    from .generate_cli import LLAMAGEN_DEMO_CLASSES
    from .models import load_mar, load_vae

    overrides = {"num_sampling_steps": args.num_sampling_steps} if args.num_sampling_steps else {}
    mar = load_mar(args.mar, args.mar_name, device=args.device, **overrides)
    drafter = load_mar(args.mar_drafter, args.mar_drafter_name or "MAR-B", device=args.device,
                       **overrides) if cspd else None
    vae = load_vae(args.vae, args.vae_name, device=args.device)
    defaults = dict(cfg=OFFICIAL_CFG.get(args.mar_name, 3.0), cfg_schedule="linear", num_iter=OFFICIAL_NUM_ITER,
                    temperature=1.0)
    return mar, drafter, vae, defaults, LLAMAGEN_DEMO_CLASSES


def _check_options(args) -> None:
    """What a MAR run refuses (``generate_cli.check_method_options`` checks these and the rest, for generate and
    sample, before any model is loaded)."""
    if args.method not in ("ar", "cspd"):
        raise SystemExit(f"--method {args.method} is for the discrete models; MAR samples with its own loop "
                         f"(--method ar) or with continuous speculative decoding (--method cspd)")
    if args.top_k not in (None, 0) or args.top_p != 1.0:
        raise SystemExit("--top-k / --top-p filter discrete tokens; MAR's tokens are continuous")
    if args.cfg_interval != -1:
        raise SystemExit("--cfg-interval is for the discrete models; MAR uses --cfg-schedule")
    given = [name for name in (*CSPD_DEFAULTS, "mar_drafter", "mar_drafter_name") if getattr(args, name) is not None]
    if args.method != "cspd" and given:
        raise SystemExit(f"--{given[0].replace('_', '-')} applies to --method cspd")


def _cspd_config(args):
    from .decoding import CSpDConfig

    values = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in CSPD_DEFAULTS.items()}
    config = CSpDConfig(**values)
    try:
        config.check()
    except ValueError as e:  # names the setting (gamma, prefill, bandwidth, max_tries, ...)
        raise SystemExit(f"--method cspd: {e}") from e
    return config


def mar_settings(args, mar, defaults: dict, config):
    """(guidance scale, MAR steps, guidance schedule): the command line's, else the model's recommendation.
    CSpD (``config`` given) defaults to one token per MAR step, as the paper (its speed comes from drafting
    those steps)."""
    cfg = args.cfg_scale if args.cfg_scale is not None else defaults["cfg"]
    L = mar.config.seq_len
    if args.num_iter is None:
        num_iter = L if config is not None else min(defaults["num_iter"], L)
    elif args.num_iter > L:
        raise SystemExit(f"--num-iter must be at most the image's {L} tokens (a MAR step predicts at least one), "
                         f"got {args.num_iter}")
    else:
        num_iter = args.num_iter
    if config is not None and config.gamma > L:
        raise SystemExit(f"--gamma must be at most the image's {L} tokens (drafted MAR steps per block), got "
                         f"{config.gamma}")
    return cfg, num_iter, args.cfg_schedule or defaults["cfg_schedule"]


def run_generate_mar(args: argparse.Namespace) -> int:
    from . import enable_fused
    from .generate_cli import check_classes
    from .outputs import write_json

    _check_options(args)
    config = _cspd_config(args) if args.method == "cspd" else None
    if args.fused:
        enable_fused(args.fused)
    mar, drafter, vae, defaults, default_classes = _load(args)
    cfg, num_iter, schedule = mar_settings(args, mar, defaults, config)
    classes = args.classes or default_classes
    check_classes(classes, mar.config.class_num)
    labels = torch.tensor(classes).repeat_interleave(args.per_class)  # [N]
    n = len(labels)
    batch = min(n if args.batch is None else args.batch, n)
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")
    L = mar.config.seq_len
    sampling = dict(num_iter=num_iter, cfg=cfg, cfg_schedule=schedule, temperature=args.temperature, seed=args.seed)
    figures = dict(family="mar", method=args.method, model=args.model, images=n, batch=batch, tokens_per_image=L,
                   num_iter=num_iter, cfg_scale=cfg, cfg_schedule=schedule, temperature=args.temperature,
                   seed=args.seed, diffusion_steps=mar.diffloss.gen_diffusion.num_timesteps, out=args.out)
    if config is not None:
        figures.update(gamma=config.gamma, rule=config.rule, bandwidth=config.bandwidth,
                       sigma_ratio=config.sigma_ratio, prefill=config.prefill, max_tries=config.max_tries,
                       last_step_noise=config.resolved_last_step_noise())
    batches = [torch.arange(start, min(start + batch, n)) for start in range(0, n, batch)]
    tokens, timing = _sample(mar, drafter, config, labels, batches, sampling, args)
    figures.update(timing)
    images = _decode(mar, vae, tokens)
    _save(images, len(classes), args.out)
    if args.model == "tiny-mar":
        from .tiny.evaluate import evaluate_samples

        figures.update(evaluate_samples(images.cpu(), labels))
    if config is not None and not args.no_ar_baseline:
        figures.update(_baseline(mar, vae, labels, batches, sampling, config, args))
        figures["speedup_vs_ar"] = figures["ar_wall_s"] / figures["wall_s"]
    _print_figures(figures, args)
    if args.json:
        write_json(args.json, figures)
        print(f"wrote {args.json}")
    return 0


def _sample(mar, drafter, config, labels, batches, sampling: dict, args):
    """Sample every batch (image i keyed by id i): -> (tokens [N, L, C], timing and decoding figures)."""
    from tqdm import tqdm

    from .decoding import CSpDStats, generate_cspd, sample_mar

    L, n = mar.config.seq_len, len(labels)
    bar = tqdm(total=n * L, desc=f"{args.method}: {n} images", disable=args.no_progress, unit="tok")
    parts, transformer_s, head_s, stats = [], 0.0, 0.0, CSpDStats()
    t0 = time.perf_counter()
    for ids in batches:
        progress = dict(on_step=lambda step, new, rows=len(ids): bar.update(new * rows))
        if config is None:
            out = sample_mar(mar, labels[ids].to(args.device), image_ids=ids, **sampling, **progress)
            transformer_s, head_s = transformer_s + out.stats.transformer_s, head_s + out.stats.head_s
        else:
            out = generate_cspd(mar, drafter, labels[ids].to(args.device), config=config, image_ids=ids, **sampling,
                                **progress)
            stats.merge(out.stats)
        parts.append(out.tokens)
    wall = time.perf_counter() - t0
    bar.close()
    figures = dict(wall_s=wall, tokens_per_s=n * L / wall, images_per_s=n / wall)
    if config is None:
        figures.update(transformer_s=transformer_s, head_s=head_s)
    else:
        figures.update(cspd_figures(stats, n))
    return torch.cat(parts), figures


def cspd_figures(stats, images: int) -> dict:
    """The JSON figures of a CSpD run (docs/cspd.md)."""
    return dict(
        acceptance=stats.acceptance, acceptance_by_block_position=stats.acceptance_by_block_position(),
        acceptance_by_step=stats.acceptance_by_step(), tau=stats.tokens_per_target_forward(images),
        drafted=stats.drafted, accepted=stats.accepted, prefill_steps=stats.prefill_steps, blocks=stats.blocks,
        target_forwards=stats.target_forwards, drafter_forwards=stats.drafter_forwards,
        target_head_evaluations=stats.target_head_evaluations,
        drafter_head_evaluations=stats.drafter_head_evaluations, residual_tries_mean=stats.residual_tries_mean,
        residual_tries_max=stats.residual_tries_max, residual_fallbacks=stats.residual_fallbacks,
        transformer_s=stats.transformer_s, head_s=stats.head_s, verify_s=stats.verify_s,
        target_transformer_s=stats.target_transformer_s, drafter_transformer_s=stats.drafter_transformer_s,
        target_head_s=stats.target_head_s, drafter_head_s=stats.drafter_head_s)


def _baseline(mar, vae, labels, batches, sampling: dict, config, args) -> dict:
    """Target-only MAR on the same batches and settings (last-step noise as the CSpD run): speedup_vs_ar and
    the baseline's quality."""
    from .decoding import sample_mar

    t0 = time.perf_counter()
    parts = [sample_mar(mar, labels[ids].to(args.device), image_ids=ids,
                        last_step_noise=config.resolved_last_step_noise(), **sampling).tokens for ids in batches]
    out = dict(ar_wall_s=time.perf_counter() - t0)
    if args.model == "tiny-mar":
        from .tiny.evaluate import evaluate_samples

        quality = evaluate_samples(_decode(mar, vae, torch.cat(parts)).cpu(), labels, with_floor=False)
        out.update(ar_class_accuracy=quality["class_accuracy"], ar_fd=quality["fd"])
    return out


@torch.no_grad()
def _decode(mar, vae, tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.decode_tokens(mar.unpatchify(chunk)) for chunk in tokens.split(64)])


def _save(images: torch.Tensor, rows: int, path: str) -> None:
    from .images import save_grid
    from .models import to_uint8

    pixels = to_uint8(images).cpu()
    save_grid(pixels, rows=rows, path=path, scale=max(1, 128 // pixels.shape[1]))


def _print_figures(f: dict, args) -> None:
    method = "MAR" if f["method"] == "ar" else f"CSpD ({f['rule']} rule, gamma {f['gamma']})"
    print(f"{f['images']} images x {f['tokens_per_image']} tokens in {f['wall_s']:.2f}s: {f['tokens_per_s']:.1f} "
          f"tokens/s ({method}, {f['num_iter']} steps, {f['diffusion_steps']} diffusion steps, cfg {f['cfg_scale']} "
          f"{f['cfg_schedule']}, {args.device})")
    if f["method"] == "cspd":
        print(f"acceptance {f['acceptance']:.3f} per token ({f['accepted']}/{f['drafted']}); tau {f['tau']:.2f} tokens "
              f"per target forward; {f['target_forwards']} target / {f['drafter_forwards']} drafter forwards")
        print(f"residual sampler: {f['residual_tries_mean']:.2f} tries per rejected token (max "
              f"{f['residual_tries_max']}); capped fallbacks {f['residual_fallbacks']}")
        print(f"transformer {f['transformer_s']:.2f}s, diffusion head {f['head_s']:.2f}s, verify {f['verify_s']:.3f}s")
    else:
        print(f"transformer {f['transformer_s']:.2f}s, diffusion head {f['head_s']:.2f}s")
    if "class_accuracy" in f:
        print(f"classifier accuracy {100 * f['class_accuracy']:.1f}%  Frechet distance {f['fd']:.2f}")
    if "speedup_vs_ar" in f:
        quality = (f"; its accuracy {100 * f['ar_class_accuracy']:.1f}%, FD {f['ar_fd']:.2f}"
                   if "ar_class_accuracy" in f else "")
        print(f"speed-up vs target-only MAR (same process, same settings): {f['speedup_vs_ar']:.2f}x "
              f"(MAR {f['ar_wall_s']:.2f}s{quality})")
    print(f"wrote {args.out}")
