"""A small roofline model that turns MEASURED speculative-decoding statistics (τ, target and drafter
forwards per image) into a PROJECTED speed-up for LlamaGen at real sizes on an H100. It is a projection,
not a measurement: it assumes each forward costs max(bytes moved / HBM bandwidth, flops / bf16 peak),
ignores kernel-launch and host overheads (CUDA graphs remove most of them), and counts the verify op as
negligible (it reads T×V logits once: ~4 MB per row at T = 59, V = 16384, well under a weight pass).

    python -m bench.projection --tau 2.9 --draft-forwards-per-step 5 [--batch 1 8] [--tree-tokens 59]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # weights, incl. embeddings and head
    n_layer: int
    dim: int
    tokens: int  # image tokens (256 px: 256; 384 px: 576)


LLAMAGEN = {
    "GPT-B": Model("GPT-B", 111e6, 12, 768, 256),
    "GPT-L": Model("GPT-L", 343e6, 24, 1024, 256),
    "GPT-XL": Model("GPT-XL", 775e6, 36, 1280, 576),
}


def forward_seconds(model: Model, rows: int, new_tokens: int, context: int, params: float = None) -> float:
    """One forward of `rows` sequences, each adding `new_tokens` after `context` cached positions (bf16)."""
    params = model.params if params is None else params
    weight_bytes = 2 * params
    kv_bytes = 2 * 2 * model.n_layer * model.dim * context * rows  # K and V, bf16
    flops = 2 * params * rows * new_tokens + 4 * model.n_layer * model.dim * context * rows * new_tokens
    return max((weight_bytes + kv_bytes) / H100_HBM_BYTES_PER_S, flops / H100_BF16_FLOPS)


def eagle_params(model: Model) -> float:
    """One transformer block plus the fc layer (embeddings and head are the target's, read again)."""
    block = 12 * model.dim**2  # attention 4 d^2 + SwiGLU ~8 d^2
    head_and_embed = 2 * 16384 * model.dim
    return block + 2 * model.dim**2 + head_and_embed


def project(model: Model, tau: float, draft_forwards_per_step: float, batch: int, tree_tokens: int,
            cfg: bool = True) -> dict:
    rows = batch * (2 if cfg else 1)
    mid_context = model.tokens // 2 + 1  # average cached length over an image
    ar = model.tokens * forward_seconds(model, rows, 1, mid_context)
    steps = model.tokens / tau
    verify = forward_seconds(model, rows, tree_tokens, mid_context)
    draft = forward_seconds(model, rows, tree_tokens, mid_context, params=eagle_params(model))
    spec = steps * (verify + draft_forwards_per_step * draft)
    return dict(model=model.name, batch=batch, tau=tau, ar_s_per_batch=ar, spec_s_per_batch=spec,
                projected_speedup=ar / spec, verify_forward_ms=1e3 * verify, ar_forward_ms=1e3 * ar / model.tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau", type=float, required=True, help="measured tokens per target forward")
    parser.add_argument("--draft-forwards-per-step", type=float, required=True, help="measured")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tree-tokens", type=int, default=59)
    parser.add_argument("--json", help="write the projection here")
    args = parser.parse_args()
    rows = [project(m, args.tau, args.draft_forwards_per_step, b, args.tree_tokens) for b in args.batch
            for m in (LLAMAGEN["GPT-B"], LLAMAGEN["GPT-XL"])]
    print("PROJECTION (roofline, H100 3.35 TB/s, 989 TFLOP/s bf16; not a measurement)")
    for r in rows:
        print(f"{r['model']:>7} batch {r['batch']}: AR {r['ar_forward_ms']:.3f} ms/forward, verify "
              f"{r['verify_forward_ms']:.3f} ms/forward at T={args.tree_tokens}: projected speed-up "
              f"{r['projected_speedup']:.2f}x at tau {r['tau']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
