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
    run.add_argument("--method", default="ar", choices=["ar", "spec", "lantern"],
                     help="ar: one target forward per token; spec: exact speculative decoding; lantern: "
                          "relaxed acceptance over latent neighbours (faster, bounded TV)")
    spec = p.add_argument_group("speculative decoding (--method spec | lantern)")
    spec.add_argument("--tree", default="dynamic", choices=["chain", "static", "dynamic"],
                      help="draft tree: chain, fixed static shape (sampled drafts), EAGLE-2 dynamic")
    spec.add_argument("--draft", choices=["deterministic", "sampled"],
                      help="draft kind (default: sampled for static, deterministic otherwise)")
    spec.add_argument("--depth", type=int, default=5, help="draft levels (chain length / EAGLE-2 expansions)")
    spec.add_argument("--nodes", type=int, default=58, help="EAGLE-2: drafted nodes kept per step")
    spec.add_argument("--k", type=int, default=1000, help="LANTERN: latent neighbours merged at most")
    spec.add_argument("--delta", type=float, default=0.1, help="LANTERN: total-variation budget")
    spec.add_argument("--lam", type=float, help="LANTERN++: multiplicative cap lambda (instead of --delta)")
    spec.add_argument("--budget", default="candidate", choices=["candidate", "node"],
                      help="delta per candidate (upstream) or per tree node (TV <= delta guaranteed)")
    spec.add_argument("--no-ar-baseline", action="store_true",
                      help="skip the AR run that measures speedup_vs_ar in the same process")
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


def _drafter_and_table(args, gpt, vq):
    from .neighbours import neighbour_table

    if args.model != "tiny":
        raise SystemExit("--method spec/lantern with official checkpoints needs a trained drafter; "
                         "today the CLI ships one for the tiny model only (see README)")
    from .pretrained import load_tiny_drafter

    drafter = load_tiny_drafter(gpt)
    table = None
    if args.method == "lantern":
        K = max(args.k, 1)
        table = neighbour_table(vq.quantize.embedding.weight, K, normalize=True)
    return drafter, table


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import enable_fused
    from .decoding import generate, generate_ar
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
    sampling = dict(cfg_scale=cfg_scale, temperature=args.temperature, top_k=top_k, top_p=args.top_p, seed=args.seed)
    figures = dict(method=args.method, images=len(labels), tokens_per_image=L, **sampling, out=args.out)
    bar = tqdm(total=len(labels) * L, desc=f"{args.method}: {len(labels)} images", disable=args.no_progress, unit="tok")
    t0 = time.perf_counter()
    if args.method == "ar":
        tokens = generate_ar(gpt, labels, cfg_interval=args.cfg_interval, on_token=lambda s: bar.update(len(labels)),
                             **sampling)
        figures.update(tau=1.0, target_forwards=L, draft_forwards=0)
    else:
        drafter, table = _drafter_and_table(args, gpt, vq)
        tokens, stats = generate(gpt, labels, method=args.method, drafter=drafter, neighbours=table, tree=args.tree,
                                 k=args.k, delta=args.delta, lam=args.lam, budget=args.budget,
                                 cfg_interval=args.cfg_interval, depth=args.depth, n_nodes=args.nodes,
                                 draft=args.draft, **sampling)
        bar.update(len(labels) * L)
        figures.update(tau=stats.tau, target_forwards=stats.target_forwards, draft_forwards=stats.draft_forwards,
                       tree=args.tree, k=args.k, delta=args.delta, lam=args.lam, budget=args.budget)
    figures["wall_s"] = time.perf_counter() - t0
    bar.close()
    figures["tokens_per_s"] = len(labels) * L / figures["wall_s"]
    if args.method != "ar" and not args.no_ar_baseline:
        t1 = time.perf_counter()
        generate_ar(gpt, labels, **sampling)
        figures["ar_wall_s"] = time.perf_counter() - t1
        figures["speedup_vs_ar"] = figures["ar_wall_s"] / figures["wall_s"]
    side = gpt.config.grid_size
    with torch.no_grad():
        images = vq.decode_codes(tokens, side, side)  # [B, 3, H, W]
    pixels = vq.to_uint8(images).cpu()
    save_grid(pixels, rows=len(classes), path=args.out, scale=max(1, 128 // pixels.shape[1]))
    if args.model == "tiny":
        from .tiny.evaluate import evaluate_samples

        figures.update(evaluate_samples(images.cpu(), labels.cpu()))
    _print_figures(figures, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _print_figures(f: dict, args) -> None:
    print(f"{f['images']} images x {f['tokens_per_image']} tokens in {f['wall_s']:.2f}s: "
          f"{f['tokens_per_s']:.1f} tokens/s ({args.method}, {args.device})")
    if args.method != "ar":
        print(f"tau {f['tau']:.2f} tokens per target forward; {f['target_forwards']} target forwards, "
              f"{f['draft_forwards']} drafter forwards")
        if "speedup_vs_ar" in f:
            print(f"speed-up vs AR (same process): {f['speedup_vs_ar']:.2f}x (AR {f['ar_wall_s']:.2f}s)")
    if "class_accuracy" in f:
        print(f"classifier accuracy {100 * f['class_accuracy']:.1f}%  Frechet distance {f['fd']:.2f}")
    print(f"wrote {args.out}")
