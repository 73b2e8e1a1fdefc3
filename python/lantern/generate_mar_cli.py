"""`lantern generate --model tiny-mar | mar-checkpoint`: sample MAR images, write a PNG grid (and JSON), print
throughput split into transformer and diffusion head (and quality for the tiny model)."""
from __future__ import annotations

import argparse
import time

import torch

MAR_MODELS = ("tiny-mar", "mar-checkpoint")
# the released models' guidance (linear schedule) and a demo step count
OFFICIAL_CFG = {"MAR-B": 2.9, "MAR-L": 3.0, "MAR-H": 3.2}
OFFICIAL_NUM_ITER = 64


def _load(args):
    """(mar, vae, sampling defaults, classes) for the chosen source."""
    if args.model == "tiny-mar":
        from .tiny_mar import load_tiny_mar

        try:
            tiny = load_tiny_mar(args.device)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from e
        return tiny.mar, tiny.vae, tiny.meta["sampling"], list(range(tiny.mar.config.class_num))
    if not args.mar or not args.vae:
        raise SystemExit("--model mar-checkpoint needs --mar PATH (checkpoint-last.pth: its model_ema is used) "
                         "and --vae PATH (kl16.ckpt)")
    from .generate_cli import LLAMAGEN_DEMO_CLASSES
    from .models import load_mar, load_vae

    overrides = {"num_sampling_steps": args.num_sampling_steps} if args.num_sampling_steps else {}
    mar = load_mar(args.mar, args.mar_name, device=args.device, **overrides)
    vae = load_vae(args.vae, args.vae_name, device=args.device)
    defaults = dict(cfg=OFFICIAL_CFG.get(args.mar_name, 3.0), cfg_schedule="linear", num_iter=OFFICIAL_NUM_ITER,
                    temperature=1.0)
    return mar, vae, defaults, LLAMAGEN_DEMO_CLASSES


def _check_discrete_options(args) -> None:
    if args.method != "ar":
        raise SystemExit(f"--method {args.method}: speculative decoding of MAR models (continuous speculative "
                         f"decoding) is not implemented yet; MAR samples with its own loop (--num-iter steps)")
    if args.top_k not in (None, 0) or args.top_p != 1.0:
        raise SystemExit("--top-k / --top-p filter discrete tokens; MAR's tokens are continuous")
    if args.cfg_interval != -1:
        raise SystemExit("--cfg-interval is for the discrete models; MAR uses --cfg-schedule")


def run_generate_mar(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import enable_fused
    from .decoding import sample_mar
    from .generate_cli import check_classes
    from .images import save_grid
    from .models import to_uint8
    from .outputs import write_json

    _check_discrete_options(args)
    if args.fused:
        enable_fused(args.fused)
    mar, vae, defaults, default_classes = _load(args)
    cfg = args.cfg_scale if args.cfg_scale is not None else defaults["cfg"]
    num_iter = args.num_iter or defaults["num_iter"]
    schedule = args.cfg_schedule or defaults["cfg_schedule"]
    classes = args.classes or default_classes
    check_classes(classes, mar.config.class_num)
    labels = torch.tensor(classes).repeat_interleave(args.per_class)  # [N]
    n = len(labels)
    batch = n if args.batch is None else args.batch
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")
    L = mar.config.seq_len
    figures = dict(family="mar", model=args.model, images=n, batch=min(batch, n), tokens_per_image=L,
                   num_iter=num_iter, cfg_scale=cfg, cfg_schedule=schedule, temperature=args.temperature,
                   seed=args.seed, diffusion_steps=mar.diffloss.gen_diffusion.num_timesteps, out=args.out)
    bar = tqdm(total=n * L, desc=f"mar: {n} images", disable=args.no_progress, unit="tok")
    parts, transformer_s, head_s = [], 0.0, 0.0
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        ids = torch.arange(start, min(start + batch, n))  # the images' indices in the run key their noise
        out = sample_mar(mar, labels[ids].to(args.device), num_iter=num_iter, cfg=cfg, cfg_schedule=schedule,
                         temperature=args.temperature, seed=args.seed, image_ids=ids,
                         on_step=lambda step, new, rows=len(ids): bar.update(new * rows))
        parts.append(out.tokens)
        transformer_s += out.stats.transformer_s
        head_s += out.stats.head_s
    figures["wall_s"] = time.perf_counter() - t0
    bar.close()
    figures.update(tokens_per_s=n * L / figures["wall_s"], images_per_s=n / figures["wall_s"],
                   transformer_s=transformer_s, head_s=head_s)
    tokens = torch.cat(parts)
    with torch.no_grad():
        images = torch.cat([vae.decode_tokens(mar.unpatchify(chunk)) for chunk in tokens.split(64)])
    pixels = to_uint8(images).cpu()
    save_grid(pixels, rows=len(classes), path=args.out, scale=max(1, 128 // pixels.shape[1]))
    if args.model == "tiny-mar":
        from .tiny.evaluate import evaluate_samples

        figures.update(evaluate_samples(images.cpu(), labels))
    _print_figures(figures, args)
    if args.json:
        write_json(args.json, figures)
        print(f"wrote {args.json}")
    return 0


def _print_figures(f: dict, args) -> None:
    print(f"{f['images']} images x {f['tokens_per_image']} tokens in {f['wall_s']:.2f}s: {f['tokens_per_s']:.1f} "
          f"tokens/s (MAR, {f['num_iter']} steps, {f['diffusion_steps']} diffusion steps, cfg {f['cfg_scale']} "
          f"{f['cfg_schedule']}, {args.device})")
    print(f"transformer {f['transformer_s']:.2f}s, diffusion head {f['head_s']:.2f}s")
    if "class_accuracy" in f:
        print(f"classifier accuracy {100 * f['class_accuracy']:.1f}%  Frechet distance {f['fd']:.2f}")
    print(f"wrote {args.out}")
