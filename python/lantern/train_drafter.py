"""Train an EAGLE drafter on images the target generates itself (its own CFG and sampling settings).

    python -m lantern.train_drafter [--images 2048] [--steps 1500] [--target-dir python/lantern/weights/tiny]

Loss (EAGLE): SmoothL1 between the predicted and the target's next hidden state, plus 0.1 x the
cross-entropy of the drafter's logits (the target's frozen head on the prediction) against the target's
own next-token distribution. Rows are trained for both CFG halves (the class and the null class; a t2i
target's caption and its unconditional caption), since decoding runs the drafter on both.

A drafter that attends to the condition (``EagleDrafter(attend_condition=True)``, the LANTERN authors' T2I
layout) trains on the target's hidden states over the condition too: ``target_features(...,
condition_hidden=True)`` gives them (what the target's prefill keeps for the drafter at decoding time) and
``train(..., attend_condition=True, condition_hidden=...)`` passes each batch's rows of them to the drafter.
The command line trains the tiny class-conditional model's drafter (one condition position: nothing to
attend to); the functions take a t2i target.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from .decoding import generate_ar
from .models.drafter import EagleDrafter


@torch.no_grad()
def self_generated(target, n_images: int, *, cfg_scale: float, temperature: float, top_k: int, seed: int,
                   batch: int = 256, conditions=None, emb_masks=None):
    """(tokens [N, L], conditions [N, ...]): the target's own samples; conditions: class ids [N] or t2i
    captions [N, C, caption_dim] (with their emb_masks [N, C]), default the classes, balanced."""
    if conditions is None:
        conditions = torch.arange(n_images) % target.config.num_classes
    elif conditions.shape[0] != n_images:
        raise ValueError(f"conditions must have n_images = {n_images} rows, got {list(conditions.shape)}")
    chunks = []
    for start in tqdm(range(0, n_images, batch), desc="sampling the target", unit="batch"):
        masks = None if emb_masks is None else emb_masks[start: start + batch]
        chunks.append(generate_ar(target, conditions[start: start + batch], cfg_scale=cfg_scale,
                                  temperature=temperature, top_k=top_k, seed=seed + start, emb_masks=masks))
    return torch.cat(chunks), conditions


@torch.no_grad()
def target_features(target, tokens, conditions, *, emb_masks=None, condition_hidden: bool = False):
    """The rows of the conditional and the unconditional half of the same images (the null class; a t2i
    caption's unconditional caption with the caption's padding, as guidance runs them):
    (tokens [2N, L], post-norm hidden states [2N, 1 + L, dim]), and with condition_hidden the hidden states
    over the condition [2N, C, dim] (an attend_condition drafter's prefix)."""
    uncond = target.double_for_cfg(conditions)[conditions.shape[0]:]
    keep = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # no condition dropout
    rows = []
    for cond in (conditions, uncond):
        rows.append(target.forward_full(tokens, cond, force_drop_ids=keep, return_hidden=True, emb_masks=emb_masks,
                                        return_condition_hidden=condition_hidden)[1:])
    features = (torch.cat([tokens, tokens]), *(torch.cat(parts) for parts in zip(*rows)))
    return features


def drafter_loss(drafter, target, tokens, hidden, condition_hidden=None):
    """tokens [R, L]; hidden [R, 1 + L, dim]: hidden[:, t] is the target state before token t; condition_hidden
    [R, C, dim] the target's hidden states over the condition (an attend_condition drafter's)."""
    pred = drafter.forward_train(tokens[:, :-1], hidden[:, :-2], condition_hidden)  # predicts hidden[:, 1:-1]
    want = hidden[:, 1:-1]
    regression = F.smooth_l1_loss(pred, want)
    with torch.no_grad():
        target_probs = torch.softmax(target.output(want).float(), -1)
    ce = -(target_probs * torch.log_softmax(drafter.logits(pred), -1)).sum(-1).mean()
    return regression + 0.1 * ce, regression, ce


def train(target, tokens, hidden, *, steps: int, batch: int, lr: float, seed: int, n_layer: int = 1,
          layout: str = "lantern", attend_condition: bool = False, condition_hidden=None):
    """A drafter (``EagleDrafter(layout, attend_condition)``) trained on rows tokens [N, L] / hidden [N, 1 + L,
    dim] (``target_features``); attend_condition needs condition_hidden [N, C, dim], the target's hidden states
    over each row's condition, of a target whose condition has more than one position (t2i)."""
    _check_condition_hidden(target, tokens.shape[0], attend_condition, condition_hidden)
    torch.manual_seed(seed)
    drafter = EagleDrafter(target.config, n_layer=n_layer, layout=layout,
                           attend_condition=attend_condition).bind(target)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)  # linear warm-up, then cosine decay
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    bar = tqdm(range(steps), desc="training the drafter")
    for step in bar:
        idx = torch.randint(tokens.shape[0], (batch,))
        condition = None if condition_hidden is None else condition_hidden[idx]
        loss, reg, ce = drafter_loss(drafter, target, tokens[idx], hidden[idx], condition)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", reg=f"{reg.item():.4f}", ce=f"{ce.item():.3f}")
    return drafter.eval()


def _check_condition_hidden(target, rows: int, attend_condition: bool, condition_hidden) -> None:
    """ValueError naming the argument unless condition_hidden is given exactly when attend_condition is, with
    [rows, C, dim] and C > 1."""
    if not attend_condition:
        if condition_hidden is not None:
            raise ValueError("condition_hidden is for attend_condition=True (a drafter without it does not read it)")
        return
    C, D = target.config.cond_len, target.config.dim
    if C < 2:
        raise ValueError(f"attend_condition needs a target whose condition has more than one position (t2i); "
                         f"this one has {C}")
    if not isinstance(condition_hidden, torch.Tensor) or tuple(condition_hidden.shape) != (rows, C, D):
        raise ValueError(f"attend_condition=True needs condition_hidden [{rows}, {C}, {D}] (target_features(..., "
                         f"condition_hidden=True)), got {list(getattr(condition_hidden, 'shape', [])) or None}")


@torch.no_grad()
def top1_agreement(drafter, target, tokens, hidden, condition_hidden=None) -> float:
    """How often the drafter's argmax equals the target's argmax (teacher-forced, held-out images)."""
    pred = drafter.forward_train(tokens[:, :-1], hidden[:, :-2], condition_hidden)
    return (drafter.logits(pred).argmax(-1) == target.output(hidden[:, 1:-1]).argmax(-1)).float().mean().item()


def main(argv=None) -> int:
    from .pretrained import TINY_DIR, load_tiny

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048, help="self-generated training images")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-dir", default=str(TINY_DIR),
                        help="the tiny target's weights (a python -m lantern.tiny.train --out folder)")
    parser.add_argument("--out", default=None, help="default: TARGET_DIR/drafter.safetensors")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, like the model trainers: independent of the core count)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out = args.out or str(Path(args.target_dir) / "drafter.safetensors")
    t0 = time.perf_counter()
    tiny = load_tiny(directory=Path(args.target_dir))
    target = tiny.gpt
    sampling = tiny.meta.get("sampling", {})
    cfg_scale, top_k = sampling.get("cfg_scale", 4.0), sampling.get("top_k", 0)
    tokens, labels = self_generated(target, args.images, cfg_scale=cfg_scale, temperature=1.0, top_k=top_k,
                                    seed=args.seed + 1_000_000)
    n_val = max(args.images // 16, 16)
    rows, hidden = target_features(target, tokens, labels)
    val = torch.zeros(rows.shape[0], dtype=torch.bool)
    val[:n_val] = True
    val[tokens.shape[0] : tokens.shape[0] + n_val] = True
    drafter = train(target, rows[~val], hidden[~val], steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    agreement = top1_agreement(drafter, target, rows[val], hidden[val])
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, args.out,
              metadata={"n_layer": str(drafter.config.n_layer)})
    report = dict(images=args.images, steps=args.steps, top1_agreement_heldout=agreement, cfg_scale=cfg_scale,
                  top_k=top_k, minutes=(time.perf_counter() - t0) / 60)
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"drafter: held-out top-1 agreement with the target {100 * agreement:.1f}%, "
          f"{report['minutes']:.1f} min -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
