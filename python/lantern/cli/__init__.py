"""`lantern` command line.

  lantern generate   sample images with a LlamaGen-architecture model (the shipped tiny default, or
                     official checkpoints), write a PNG grid, print tokens/s (and quality for the tiny model)
  lantern sample     many images for evaluation: torchrun data-parallel, resumable, PNGs + one .npz
  lantern eval       quality figures of sampled images (tiny: accuracy / FD; official: FID / IS / P / R)
  lantern neighbours build (and cache) a VQ codebook's latent neighbour table
  lantern demo       verification statistics on synthetic draft trees (delta = 0 vs delta > 0)
"""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from ..demo import DemoConfig, run_demo

    cfg = DemoConfig(vocab=args.vocab, rows=args.rows, neighbours=args.k, seed=args.seed)
    if args.json:
        from ..outputs import check_output_path

        check_output_path(args.json, "--json", [".json"], "a JSON file")
    if args.fused:
        from .._backend import enable_fused

        enable_fused(args.fused)
    rows = run_demo(cfg, deltas=tuple(args.delta))
    if args.json:
        from ..outputs import write_json

        write_json(args.json, rows)
        print(f"wrote {args.json}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .generate import run_generate

    return run_generate(args)


def _sample(args: argparse.Namespace) -> int:
    from .sample import run_sample

    return run_sample(args)


def _eval(args: argparse.Namespace) -> int:
    from .eval import run_eval

    return run_eval(args)


def _neighbours(args: argparse.Namespace) -> int:
    import time

    import torch
    from safetensors.torch import save_file

    from ..neighbours import cache_dir, neighbour_table

    if args.out:  # before the codebook is loaded and the table built
        from ..outputs import check_output_path

        check_output_path(args.out, "--out", [".safetensors"], "a safetensors file")
    if args.K < 1:
        raise SystemExit(f"--K must be >= 1, got {args.K}")
    if args.vq == "tiny":
        from ..pretrained import load_tiny

        codebook = load_tiny().vq.quantize.embedding.weight
    else:
        from ..models import load_vq

        codebook = load_vq(args.vq, args.vq_name, decoder_only=True).quantize.embedding.weight
    t0 = time.perf_counter()
    table = neighbour_table(codebook, args.K, normalize=not args.raw, rebuild=args.rebuild)
    print(f"neighbour table [{table.shape[0]}, {table.shape[1]}] ready in {time.perf_counter() - t0:.1f}s "
          f"(cache: {cache_dir()})")
    if args.out:
        save_file({"neighbours": table.to(torch.int32).contiguous()}, args.out)
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from .eval import add_eval_parser
    from .generate import add_generate_parser
    from .sample import add_sample_parser

    add_generate_parser(sub).set_defaults(func=_generate)

    add_sample_parser(sub).set_defaults(func=_sample)
    add_eval_parser(sub).set_defaults(func=_eval)
    nb = sub.add_parser("neighbours", help="build (and cache on disk) a VQ codebook's latent neighbour table",
                        description="Build the int32 [V, K] table of each code's K nearest codes (squared "
                                    "L2 distance, ties to the lower id) with lantern.ops.latent_neighbours, "
                                    "cache it under $LANTERN_CACHE (default ~/.cache/lantern), optionally "
                                    "also write it to --out.")
    nb.add_argument("--vq", default="tiny", help="'tiny' (the shipped model) or a VQ checkpoint path")
    nb.add_argument("--vq-name", default="VQ-16", help="VQ config of the checkpoint")
    nb.add_argument("--K", type=int, default=1000, help="neighbours per code")
    nb.add_argument("--raw", action="store_true", help="raw codebook rows instead of L2-normalised (LlamaGen's lookup)")
    nb.add_argument("--rebuild", action="store_true", help="ignore the disk cache")
    nb.add_argument("--out", metavar="PATH", help="also write the table as safetensors here (a .safetensors path "
                                                  "in an existing folder; checked before anything is loaded)")
    nb.set_defaults(func=_neighbours)
    demo = sub.add_parser("demo", help="verify synthetic draft trees at several delta / lambda settings and "
                                       "print acceptance statistics (tau, acceptance rate)")
    demo.add_argument("--vocab", type=int, default=4096, help="vocabulary (codebook) size V (default 4096)")
    demo.add_argument("--rows", type=int, default=256, help="batch rows, each with its own tree (default 256)")
    demo.add_argument("--k", type=int, default=64, help="neighbours merged at most per candidate (default 64)")
    demo.add_argument("--delta", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3],
                      help="total-variation budgets to compare; 0 = exact speculative sampling")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the verify stream")
    demo.add_argument("--fused", default=None, help="run through a fused backend: cpu | cuda | triton | auto")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the statistics as JSON")
    demo.set_defaults(func=_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
