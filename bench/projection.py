"""A small roofline model that turns MEASURED speculative-decoding statistics (τ, target and drafter
forwards per image) into a PROJECTED speed-up for LlamaGen at real sizes on an H100, and the same for
continuous speculative decoding with MAR-H drafted by MAR-B (``project_cspd``). It is a projection,
not a measurement: it assumes each forward costs max(bytes moved / HBM bandwidth, flops / bf16 peak),
ignores kernel-launch and host overheads (CUDA graphs remove most of them), and counts the verify op as
negligible (it reads T×V logits once: ~4 MB per row at T = 59, V = 16384, well under a weight pass).

    python -m bench.projection --tau 2.9 --draft-forwards-per-step 5 [--batch 1 8] [--tree-tokens 59]
    python -m bench.projection --cspd --acceptance 0.3 [--gamma 4 8 16 32] [--batch 1 8 32]

MAR: a MAR step is one transformer forward (the encoder over the 64 buffer slots and the known tokens, the
decoder over all 320 rows; weights read once) plus a head run of 100 diffusion steps over the step's new
tokens (the head's weights read at every diffusion step, which is what small batches pay for). CSpD with
MAR's no-rollback blocks: the target runs the pre-fill steps and one forward per block, its head once per
block over the block's tokens; the drafter runs every other step. Its time does not depend on the
acceptance (a rejected token costs a residual draw, ~free); the acceptance decides the quality.
"""
from __future__ import annotations

import argparse
import json
import math
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


@dataclass(frozen=True)
class MARModel:
    name: str
    transformer_params: float  # encoder + decoder (published totals minus the head)
    head_params: float
    encoder_params: float  # the encoder's share of transformer_params (half: equal depths and widths)
    tokens: int = 256
    buffer: int = 64
    diffusion_steps: int = 100


MAR = {
    "MAR-B": MARModel("MAR-B", 172.17e6, 35.75e6, 86.1e6),
    "MAR-H": MARModel("MAR-H", 791.20e6, 151.21e6, 395.6e6),
}


def mar_forward_seconds(model: MARModel, rows: int, known: int) -> float:
    """One transformer forward of ``rows`` images with ``known`` tokens (bf16, attention flops ignored)."""
    decoder = model.transformer_params - model.encoder_params
    flops = 2 * rows * (model.encoder_params * (model.buffer + known) + decoder * (model.buffer + model.tokens))
    return max(2 * model.transformer_params / H100_HBM_BYTES_PER_S, flops / H100_BF16_FLOPS)


def mar_head_seconds(model: MARModel, token_rows: int) -> float:
    """One head run (all diffusion steps) over ``token_rows`` tokens."""
    step = max(2 * model.head_params / H100_HBM_BYTES_PER_S, 2 * model.head_params * token_rows / H100_BF16_FLOPS)
    return model.diffusion_steps * step


def project_cspd(target: MARModel, drafter: MARModel, gamma: int, batch: int, acceptance: float,
                 prefill: float = 0.05, cfg: bool = True) -> dict:
    """Seconds per batch of target-only MAR (one token per step), CSpD, and MAR at tokens / gamma steps."""
    rows = batch * (2 if cfg else 1)
    n = target.tokens
    known = n // 2  # average known tokens over an image
    step = lambda m, new: mar_forward_seconds(m, rows, known) + mar_head_seconds(m, rows * new)
    ar = n * step(target, 1)
    p = math.ceil(prefill * n)
    blocks = math.ceil((n - p) / gamma)
    cspd = p * step(target, 1) + blocks * step(target, gamma) + (n - p) * step(drafter, 1)
    fewer = (n // gamma) * step(target, gamma)
    return dict(target=target.name, drafter=drafter.name, gamma=gamma, batch=batch, acceptance=acceptance,
                ar_s_per_batch=ar, cspd_s_per_batch=cspd, fewer_steps_s_per_batch=fewer,
                projected_speedup=ar / cspd, fewer_steps_speedup=ar / fewer)


def print_cspd(rows) -> None:
    print("PROJECTION (roofline, H100 3.35 TB/s, 989 TFLOP/s bf16; not a measurement): CSpD MAR-H <- MAR-B, "
          "256 tokens, 100 diffusion steps, guidance")
    for r in rows:
        print(f"  batch {r['batch']:>3} gamma {r['gamma']:>2}: target-only {r['ar_s_per_batch']:.2f}s, CSpD "
              f"{r['cspd_s_per_batch']:.2f}s ({r['projected_speedup']:.2f}x), MAR at {256 // r['gamma']} steps "
              f"{r['fewer_steps_s_per_batch']:.2f}s ({r['fewer_steps_speedup']:.2f}x); measured acceptance "
              f"{r['acceptance']:.3f} (quality, not time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau", type=float, help="measured tokens per target forward")
    parser.add_argument("--draft-forwards-per-step", type=float, help="measured")
    parser.add_argument("--cspd", action="store_true", help="project CSpD (MAR-H drafted by MAR-B) instead")
    parser.add_argument("--acceptance", type=float, default=float("nan"), help="CSpD: measured acceptance")
    parser.add_argument("--gamma", type=int, nargs="+", default=[4, 8, 16, 32], help="CSpD: drafted steps per block")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tree-tokens", type=int, default=59)
    parser.add_argument("--json", help="write the projection here")
    args = parser.parse_args()
    if args.cspd:
        rows = [project_cspd(MAR["MAR-H"], MAR["MAR-B"], g, b, args.acceptance) for b in args.batch
                for g in args.gamma]
        print_cspd(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    if args.tau is None or args.draft_forwards_per_step is None:
        parser.error("--tau and --draft-forwards-per-step are required (or --cspd)")
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
