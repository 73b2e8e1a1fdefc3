"""Quality and cost of the tiny MAR models: class accuracy by the shape classifier and the Frechet distance
of its features to the procedural dataset's (the same metric and reference as the tiny GPT,
``lantern.tiny.evaluate``), plus the sampling time split into transformer and diffusion head.

    python -m lantern.tiny_mar.evaluate [--per-class 100] [--cfg 3] [--num-iter 16] [--model mar|drafter]
                                        [--sweep [CFG ...]] [--timing] [--reconstruction]
                                        [--png PATH] [--json PATH]

Images are sampled with ``lantern.decoding.sample_mar`` (image i of the run keyed by image id i, so --batch
changes them only through the last bits of the matrix products) and decoded by the KL-tiny autoencoder.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..tiny.data import CLASS_NAMES, NUM_CLASSES


@torch.no_grad()
def sample_images(mar, vae, per_class: int, *, cfg: float, num_iter: int, temperature: float = 1.0,
                  cfg_schedule: str = "linear", seed: int = 0, batch: int = 250, on_batch=None):
    """per_class samples of every class (class-major) -> (images [10 * per_class, 3, 32, 32], labels, stats
    summed over the batches: transformer_s, head_s, wall_s)."""
    from ..decoding import sample_mar

    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    device = mar.fake_latent.device
    images, totals = [], dict(transformer_s=0.0, head_s=0.0, wall_s=0.0)
    for i in range(0, len(labels), batch):
        ids = torch.arange(i, min(i + batch, len(labels)))
        out = sample_mar(mar, labels[ids].to(device), num_iter=num_iter, cfg=cfg, cfg_schedule=cfg_schedule,
                         temperature=temperature, seed=seed, image_ids=ids)
        images.append(vae.decode_tokens(mar.unpatchify(out.tokens)).float().cpu())
        for key in totals:
            totals[key] += getattr(out.stats, key)
        if on_batch is not None:
            on_batch(len(ids))
    return torch.cat(images), labels, totals


@torch.no_grad()
def component_timing(mar, *, batch: int, cfg: float, num_iter: int, repeats: int = 1, seed: int = 0) -> dict:
    """Wall time of one image batch, split into transformer and head (best of ``repeats``)."""
    from ..decoding import sample_mar

    labels = torch.arange(batch) % NUM_CLASSES
    best = None
    for _ in range(repeats):
        s = sample_mar(mar, labels.to(mar.fake_latent.device), num_iter=num_iter, cfg=cfg, seed=seed).stats
        row = dict(batch=batch, num_iter=num_iter, cfg=cfg, wall_s=s.wall_s, transformer_s=s.transformer_s,
                   head_s=s.head_s, head_share=s.head_s / max(s.wall_s, 1e-12),
                   transformer_ms_per_step=1e3 * s.transformer_s / s.steps,
                   head_ms_per_step=1e3 * s.head_s / s.steps)
        if best is None or row["wall_s"] < best["wall_s"]:
            best = row
    return best


def evaluate(mar, vae, per_class: int, *, cfg: float, num_iter: int, temperature: float = 1.0,
             cfg_schedule: str = "linear", seed: int = 0, batch: int = 250, directory=None) -> dict:
    """Sample and score: dict(class_accuracy, fd, fd_real_floor, per_class_accuracy, n, sampling settings,
    sample_s, transformer_s, head_s)."""
    from ..tiny.evaluate import evaluate_samples

    t0 = time.perf_counter()
    images, labels, totals = sample_images(mar, vae, per_class, cfg=cfg, num_iter=num_iter, temperature=temperature,
                                           cfg_schedule=cfg_schedule, seed=seed, batch=batch)
    result = evaluate_samples(images, labels, directory=directory)
    result.update(cfg=cfg, cfg_schedule=cfg_schedule, num_iter=num_iter, temperature=temperature, seed=seed,
                  sample_s=time.perf_counter() - t0, transformer_s=totals["transformer_s"], head_s=totals["head_s"])
    return result


@torch.no_grad()
def reconstruction(vae, n: int = 1000, batch: int = 250, directory=None) -> dict:
    """Score the autoencoder alone: the held-out images of the training run (``make_dataset(n, DEFAULT_SEED +
    100)``) encoded, decoded from the posterior mode and scored like samples. Its FD bounds what the MAR's
    samples can reach."""
    from ..tiny.data import DEFAULT_SEED, make_dataset
    from ..tiny.evaluate import evaluate_samples

    images, labels = make_dataset(n, DEFAULT_SEED + 100)
    recon = torch.cat([vae.decode(vae.encode(chunk).mode()).float() for chunk in images.split(batch)])
    result = evaluate_samples(recon.clamp(-1, 1), labels, directory=directory)
    result["psnr_db"] = float(10 * torch.log10(4.0 / (recon - images).pow(2).mean()))
    return result


def describe(name: str, r: dict) -> str:
    worst = min(range(NUM_CLASSES), key=lambda c: r["per_class_accuracy"][c])
    return (f"{name} cfg {r['cfg']:<4} num_iter {r['num_iter']}: accuracy {100 * r['class_accuracy']:.1f}% "
            f"(worst {CLASS_NAMES[worst]} {100 * r['per_class_accuracy'][worst]:.0f}%)  FD {r['fd']:.2f} "
            f"(real-image floor at n={r['n']}: {r['fd_real_floor']:.2f})  [{r['sample_s']:.0f}s: transformer "
            f"{r['transformer_s']:.0f}s, head {r['head_s']:.0f}s]")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lantern.tiny_mar.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="weights directory (default: python/lantern/weights/tiny_mar)")
    p.add_argument("--model", default="mar", choices=["mar", "drafter"])
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the shipped recommendation)")
    p.add_argument("--cfg-schedule", default=None, choices=["linear", "constant"])
    p.add_argument("--num-iter", type=int, default=None, help="MAR steps (default: the shipped recommendation)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=250)
    p.add_argument("--sweep", type=float, nargs="*", default=None, metavar="CFG",
                   help="evaluate each of these guidance scales (default list if given without values)")
    p.add_argument("--timing", action="store_true", help="also time transformer vs head at batch 1 and 16")
    p.add_argument("--reconstruction", action="store_true",
                   help="also score the autoencoder's reconstructions of 1000 held-out images (its FD floor)")
    p.add_argument("--fused", default=None, help="fused backend for the noise stream: auto | cpu | cuda")
    p.add_argument("--png", default=None, help="write a grid of the samples (rows = classes, first 10 per class)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.fused:
        from .. import enable_fused

        enable_fused(args.fused)

    from . import TINY_MAR_DIR, load_tiny_mar

    directory = Path(args.dir) if args.dir else TINY_MAR_DIR
    tiny = load_tiny_mar(directory=directory)
    model = tiny.mar if args.model == "mar" else tiny.drafter
    defaults = tiny.meta["sampling"]
    settings = dict(num_iter=args.num_iter or defaults["num_iter"],
                    cfg_schedule=args.cfg_schedule or defaults["cfg_schedule"],
                    temperature=args.temperature if args.temperature is not None else defaults["temperature"])
    scales = ([args.cfg if args.cfg is not None else defaults["cfg"]] if args.sweep is None
              else (args.sweep or [1.0, 2.0, 3.0, 4.0, 6.0]))
    results = []
    for scale in scales if args.per_class > 0 else []:  # --per-class 0: no sampling (e.g. --reconstruction alone)
        r = evaluate(model, tiny.vae, args.per_class, cfg=scale, seed=args.seed, batch=args.batch, **settings)
        results.append(r)
        print(describe(args.model, r))
        if args.png:
            from ..images import save_grid
            from ..models import to_uint8

            images, _, _ = sample_images(model, tiny.vae, min(10, args.per_class), cfg=scale, seed=args.seed,
                                         **settings)
            path = args.png if len(scales) == 1 else args.png.replace(".png", f"_cfg{scale:g}.png")
            save_grid(to_uint8(images), rows=NUM_CLASSES, path=path, scale=4)
            print(f"wrote {path}")
    out = dict(results=results)
    if args.reconstruction:
        r = reconstruction(tiny.vae)
        out["reconstruction"] = r
        print(f"KL-tiny reconstructions of {r['n']} held-out images: PSNR {r['psnr_db']:.1f} dB, accuracy "
              f"{100 * r['class_accuracy']:.1f}%, FD {r['fd']:.2f} (real-image floor {r['fd_real_floor']:.2f})")
    if args.timing:
        out["timing"] = [component_timing(model, batch=b, cfg=scales[0], num_iter=settings["num_iter"], repeats=2)
                         for b in (1, 16)]
        for row in out["timing"]:
            print(f"batch {row['batch']}: {row['wall_s']:.2f}s per batch, "
                  f"transformer {row['transformer_ms_per_step']:.1f} ms/step, "
                  f"head {row['head_ms_per_step']:.1f} ms/step ({100 * row['head_share']:.0f}% head)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
