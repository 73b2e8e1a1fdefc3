"""`lantern generate --model tiny-mar | mar-checkpoint [--method cspd]`: sample MAR images (plainly, or with
continuous speculative decoding and a MAR drafter), write a PNG grid (and JSON), print throughput split into
transformer, diffusion head and verification (and quality for the tiny model). With --method cspd the
target-only MAR at the same settings runs in the same process (unless --no-ar-baseline) for speedup_vs_ar."""
from __future__ import annotations

import argparse
import time

import torch

from .. import sources


def run_generate_mar(args: argparse.Namespace) -> int:
    from .._backend import enable_fused
    from ..outputs import write_json

    sources.check_mar_method(args)
    config = sources.cspd_config(args) if args.method == "cspd" else None
    if args.fused:
        enable_fused(args.fused)
    mar, drafter, vae, defaults, default_classes = sources.load_mar_models(args)
    cfg, num_iter, schedule = sources.mar_settings(args, mar, defaults, config)
    classes = args.classes or default_classes
    sources.check_classes(classes, mar.config.class_num)
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
    images = sources.decode_mar(mar, vae, tokens)
    _save(images, len(classes), args.out)
    if args.model == "tiny-mar":
        from ..tiny.evaluate import evaluate_samples

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

    from ..decoding import CSpDStats, generate_cspd, sample_mar

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
    from ..decoding import sample_mar

    t0 = time.perf_counter()
    parts = [sample_mar(mar, labels[ids].to(args.device), image_ids=ids,
                        last_step_noise=config.resolved_last_step_noise(), **sampling).tokens for ids in batches]
    out = dict(ar_wall_s=time.perf_counter() - t0)
    if args.model == "tiny-mar":
        from ..tiny.evaluate import evaluate_samples

        quality = evaluate_samples(sources.decode_mar(mar, vae, torch.cat(parts)).cpu(), labels, with_floor=False)
        out.update(ar_class_accuracy=quality["class_accuracy"], ar_fd=quality["fd"])
    return out


def _save(images: torch.Tensor, rows: int, path: str) -> None:
    from ..images import save_grid
    from ..models import to_uint8

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
