"""`lantern generate`: sample images, write a PNG grid, print throughput (and quality for the tiny model)."""
from __future__ import annotations

import argparse
import json
import time

import torch

LLAMAGEN_DEMO_CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="sample images (tiny default model or official LlamaGen checkpoints) and write a PNG grid",
        description="Sample class-conditional images autoregressively with LlamaGen's semantics (CFG by "
                    "doubled batch, temperature, top-k, top-p, cfg_interval). Each grid row is one class. "
                    "Prints tokens/s; with the tiny default model also the classifier's class accuracy and "
                    "the Frechet distance to the dataset in the classifier's feature space.")
    src = p.add_argument_group("model")
    src.add_argument("--model", default="tiny", choices=["tiny", "checkpoint"],
                     help="'tiny': the shipped default (trained by python -m lantern.tiny.train); "
                          "'checkpoint': official LlamaGen files given by --gpt / --vq")
    src.add_argument("--gpt", metavar="PATH", help="GPT checkpoint (.pt / .pth / .safetensors)")
    src.add_argument("--gpt-name", default="GPT-XL", help="GPT config: GPT-B, GPT-L, GPT-XL, GPT-XXL, GPT-3B")
    src.add_argument("--vq", metavar="PATH", help="VQ-16 tokenizer checkpoint")
    src.add_argument("--image-size", type=int, default=256, choices=[256, 384, 512],
                     help="official models: image size (16x16, 24x24 or 32x32 tokens)")
    samp = p.add_argument_group("sampling")
    samp.add_argument("--classes", type=int, nargs="+", help="class ids, one grid row each "
                      "(default: every tiny class / LlamaGen's demo classes)")
    samp.add_argument("--per-class", type=int, default=4, help="images per class (grid columns)")
    samp.add_argument("--seed", type=int, default=0, help="seed of the sampling stream: same seed, same image")
    samp.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale (1 = off; default: the "
                      "model's recommended value, 4.0 for official models)")
    samp.add_argument("--cfg-interval", type=int, default=-1, help="use guidance only up to this step (-1 = always)")
    samp.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    samp.add_argument("--top-k", type=int, help="keep the top-k logits (0 = off; default: the model's, 2000 official)")
    samp.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (1 = off)")
    run = p.add_argument_group("run")
    run.add_argument("--method", default="ar", choices=["ar"], help="decoding method")
    run.add_argument("--fused", metavar="BACKEND", help="enable fused ops: auto | cpu | cuda | triton")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--out", default="samples.png", metavar="PATH", help="PNG grid to write")
    run.add_argument("--json", metavar="PATH", help="also write the run's figures as JSON")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _load(args):
    """(gpt, vq, meta) for the chosen source."""
    if args.model == "tiny":
        from .pretrained import load_tiny

        tiny = load_tiny(args.device)
        return tiny.gpt, tiny.vq, tiny.meta
    if not args.gpt or not args.vq:
        raise SystemExit("--model checkpoint needs --gpt PATH and --vq PATH")
    from .models import load_gpt, load_vq

    block = (args.image_size // 16) ** 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    gpt = load_gpt(args.gpt, args.gpt_name, block_size=block, device=args.device, dtype=dtype).eval()
    vq = load_vq(args.vq, "VQ-16", decoder_only=True, device=args.device).eval()
    return gpt, vq, {"sampling": {"cfg_scale": 4.0, "top_k": 2000}}


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import enable_fused
    from .decoding import generate_ar
    from .images import save_grid

    if args.fused:
        enable_fused(args.fused)
    gpt, vq, meta = _load(args)
    defaults = meta.get("sampling", {})
    cfg_scale = args.cfg_scale if args.cfg_scale is not None else defaults.get("cfg_scale", 4.0)
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k", 0)
    classes = args.classes or (list(range(gpt.config.num_classes)) if args.model == "tiny" else LLAMAGEN_DEMO_CLASSES)
    labels = torch.tensor(classes, device=args.device).repeat_interleave(args.per_class)  # [B]
    L = gpt.config.block_size
    bar = tqdm(total=L, desc=f"sampling {len(labels)} images", disable=args.no_progress, unit="tok")
    t0 = time.perf_counter()
    tokens = generate_ar(gpt, labels, cfg_scale=cfg_scale, temperature=args.temperature, top_k=top_k,
                         top_p=args.top_p, cfg_interval=args.cfg_interval, seed=args.seed,
                         on_token=lambda step: bar.update(1))
    wall = time.perf_counter() - t0
    bar.close()
    side = gpt.config.grid_size
    with torch.no_grad():
        images = vq.decode_codes(tokens, side, side)  # [B, 3, H, W]
    pixels = vq.to_uint8(images).cpu()
    save_grid(pixels, rows=len(classes), path=args.out, scale=max(1, 128 // pixels.shape[1]))
    figures = dict(method=args.method, images=len(labels), tokens_per_image=L, wall_s=wall,
                   tokens_per_s=len(labels) * L / wall, seed=args.seed, cfg_scale=cfg_scale,
                   temperature=args.temperature, top_k=top_k, top_p=args.top_p, out=args.out)
    if args.model == "tiny":
        from .tiny.evaluate import evaluate_samples

        figures.update(evaluate_samples(images.cpu(), labels.cpu()))
    print(f"{len(labels)} images x {L} tokens in {wall:.2f}s: {figures['tokens_per_s']:.1f} tokens/s "
          f"({args.method}, {args.device})")
    if "class_accuracy" in figures:
        print(f"classifier accuracy {100 * figures['class_accuracy']:.1f}%  Frechet distance {figures['fd']:.2f}")
    print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"wrote {args.json}")
    return 0
