"""Train the tiny default model end to end on CPU, in one command:

    python -m lantern.tiny.train [--out DIR] [--minutes-budget 30]

Stages: (a) the VQ-tiny tokenizer on the procedural shapes (reconstruction + codebook + commitment losses,
L2-normalised codes as in LlamaGen's VQ-16, straight-through gradients, dead codes re-initialised from
encoder outputs), (b) tokenise the dataset, (c) the GPT-tiny class-conditional model on those tokens
(AdamW, warmup + cosine, class dropout 0.1 so classifier-free guidance works), (d) the shape classifier
(the quality metric) on real images, (e) a final evaluation: AR samples with the recommended sampling
settings, classified and compared to the dataset by Frechet distance.

Writes to DIR (default python/lantern/weights/tiny): vq.safetensors, gpt.safetensors (bfloat16, loaded as float32),
classifier.safetensors, fd_reference.safetensors (the dataset's feature statistics) and tiny.json (configs,
dataset seed, training plan, timings, figures, sampling defaults). Load them with
``lantern.pretrained.load_tiny()`` or ``lantern.models.load_gpt / load_vq`` and
``lantern.tiny.classifier.load_classifier``.

Seeded: the same command on the same machine and thread count gives the same weights. ``--minutes-budget``
scales the step counts of the three trainings (deterministically) from the default plan, which took
23 minutes on a shared 2-core machine (VQ 7.8, tokens 0.9, GPT 11.9, classifier 0.5, evaluation 1.5 min)
and about 1.5x that when the other core is busy too. One torch thread by default: see --threads.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .data import CLASS_NAMES, DEFAULT_SEED, make_dataset

DEFAULT_BUDGET_MINUTES = 23.0  # what the default plan took, measured (see the module docstring)


@dataclass(frozen=True)
class Plan:
    seed: int = 0  # torch seed (init, batches, class dropout, sampling)
    data_seed: int = DEFAULT_SEED
    n_images: int = 30000  # training images (VQ, GPT tokens, classifier)
    n_val: int = 1000  # held-out images (seed data_seed + 100) for reconstruction / loss figures
    autocast_bf16: bool = False  # bf16 autocast for the VQ and GPT trainings (much slower than float32 on
    # CPUs without bf16 units: docs/tiny_model.md)
    # (a) VQ
    vq_steps: int = 800
    vq_batch: int = 32
    vq_lr: float = 2e-3
    vq_beta: float = 0.25  # commitment weight
    vq_l1: float = 1.0  # reconstruction = mse + vq_l1 * l1
    vq_reinit_every: int = 20  # dead-code re-init period (steps), for the first 85% of training
    vq_dead_threshold: float = 0.05  # EMA assignments per step below which a code is dead
    # (c) GPT: gpt_steps at gpt_base_layers, then grown to the config's depth (grow_depth) and trained on for
    # gpt_grow_steps
    gpt_name: str = "GPT-tiny-deep"
    gpt_base_layers: int = 4
    gpt_steps: int = 1600
    gpt_batch: int = 32
    gpt_lr: float = 2e-3
    gpt_min_lr_ratio: float = 0.05
    gpt_warmup: int = 80
    gpt_weight_decay: float = 0.05
    gpt_class_dropout: float = 0.1
    gpt_grow_steps: int = 500
    gpt_grow_lr: float = 6e-4
    gpt_grow_warmup: int = 40
    # (d) classifier
    clf_steps: int = 300
    clf_batch: int = 128
    clf_lr: float = 3e-3
    # (e) evaluation / sampling defaults
    eval_per_class: int = 100
    cfg_scale: float = 2.0
    top_k: int = 0
    temperature: float = 1.0

    def scaled(self, factor: float) -> "Plan":
        """Step counts times factor (the --minutes-budget knob)."""
        s = lambda n: max(1, int(round(n * factor)))
        return replace(self, vq_steps=s(self.vq_steps), gpt_steps=s(self.gpt_steps), clf_steps=s(self.clf_steps),
                       gpt_warmup=min(self.gpt_warmup, max(1, s(self.gpt_steps) // 10)),
                       gpt_grow_steps=s(self.gpt_grow_steps),
                       gpt_grow_warmup=min(self.gpt_grow_warmup, max(1, s(self.gpt_grow_steps) // 10)))


def _cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _autocast(plan: Plan):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.autocast_bf16)


def _save(state: dict, path: Path, dtype: Optional[torch.dtype] = None) -> None:
    from safetensors.torch import save_file

    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    save_file(out, str(path))


# ---------------------------------------------------------------------------------------------------
# (a) VQ


def vq_training_forward(vq, images: torch.Tensor):
    """Training forward of a VQModel: -> (reconstruction [B, 3, H, W], codes [B*h*w], normalised latents
    [B*h*w, d] (for dead-code re-init), codebook loss, commitment loss).

    Like LlamaGen's VQ-16: latents and codebook rows are L2-normalised, nearest = largest cosine, the
    codebook loss pulls the chosen rows to the (stopped) latents, the commitment loss pulls the latents to
    the (stopped) rows, and the decoder sees the rows through a straight-through estimator. The
    nearest-code search runs in float32 (outside autocast) so codes equal ``encode_codes``'s."""
    z = vq.quant_conv(vq.encoder(images))  # [B, d, h, w]
    B, d, h, w = z.shape
    with torch.autocast("cpu", enabled=False):
        zf = F.normalize(z.float().permute(0, 2, 3, 1).reshape(-1, d), p=2, dim=-1)  # [B*h*w, d]
        book = vq.quantize.codebook().float()  # [V, d] normalised
        codes = (zf.detach() @ book.t()).argmax(dim=1)  # [B*h*w]
        q = book[codes]
        codebook_loss = F.mse_loss(q, zf.detach())
        commit_loss = F.mse_loss(zf, q.detach())
        q_st = zf + (q - zf).detach()
    recon = vq.decode(q_st.view(B, h, w, d).permute(0, 3, 1, 2))
    return recon, codes, zf.detach(), codebook_loss, commit_loss


def train_vq(plan: Plan, images: torch.Tensor, val_images: torch.Tensor, log=print):
    from ..models import build_vq

    torch.manual_seed(plan.seed)
    vq = build_vq("VQ-tiny")
    vq.train()
    V = vq.config.codebook_size
    opt = torch.optim.AdamW(vq.parameters(), lr=plan.vq_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(plan.seed + 1)
    ema_usage = torch.full((V,), 2.0 * plan.vq_batch * 64 / V)
    reinit_total = 0
    bar = tqdm(range(plan.vq_steps), desc="(a) VQ", mininterval=5.0)
    for step in bar:
        lr = plan.vq_lr * _cosine(step, plan.vq_steps, 50, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, images.shape[0], (plan.vq_batch,), generator=gen)
        x = images[idx]
        flip = torch.rand(plan.vq_batch, generator=gen) < 0.5  # horizontal flips: every class stays in class
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        with _autocast(plan):
            recon, codes, zf, cb_loss, commit_loss = vq_training_forward(vq, x)
        recon = recon.float()
        rec_loss = F.mse_loss(recon, x) + plan.vq_l1 * F.l1_loss(recon, x)
        loss = rec_loss + cb_loss + plan.vq_beta * commit_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        counts = torch.bincount(codes, minlength=V).float()
        ema_usage.mul_(0.95).add_(counts, alpha=0.05)
        if plan.vq_reinit_every and step % plan.vq_reinit_every == 0 and step < 0.85 * plan.vq_steps and step > 0:
            dead = (ema_usage < plan.vq_dead_threshold).nonzero().flatten()
            if dead.numel() > 0:
                pick = torch.randint(0, zf.shape[0], (dead.numel(),), generator=gen)
                with torch.no_grad():
                    new = zf[pick] + 0.02 * torch.randn(dead.numel(), zf.shape[1], generator=gen)
                    vq.quantize.embedding.weight[dead] = F.normalize(new, dim=-1)
                ema_usage[dead] = ema_usage.mean()
                reinit_total += dead.numel()
        if step % 50 == 0 or step == plan.vq_steps - 1:
            bar.set_postfix(rec=f"{rec_loss.item():.4f}", used=int((ema_usage > plan.vq_dead_threshold).sum()),
                            lr=f"{lr:.1e}")
    bar.close()
    vq.eval()
    with torch.no_grad():
        codes = torch.cat([vq.encode_codes(val_images[i : i + 500]) for i in range(0, len(val_images), 500)])
        recon = torch.cat([vq.decode_codes(codes[i : i + 500], 8, 8) for i in range(0, len(codes), 500)])
    figures = dict(val_mse=float(F.mse_loss(recon, val_images)), val_l1=float(F.l1_loss(recon, val_images)),
                   val_psnr_db=float(10 * math.log10(4.0 / F.mse_loss(recon, val_images).item())),
                   val_codes_used=int(torch.unique(codes).numel()), dead_codes_reinitialised=reinit_total)
    log(f"    VQ held-out: mse {figures['val_mse']:.4f} (range [-1, 1]), PSNR {figures['val_psnr_db']:.1f} dB, "
        f"{figures['val_codes_used']} codes used by {len(val_images)} images; {reinit_total} dead-code re-inits")
    return vq, figures


# ---------------------------------------------------------------------------------------------------
# (b) tokens


@torch.no_grad()
def tokenize(vq, images: torch.Tensor, plan: Plan, batch: int = 500) -> torch.Tensor:
    """images [N, 3, 32, 32] -> codes [N, 64] int64. The encoder runs under the plan's bf16 autocast (2x
    faster; a latent within bf16 round-off of two codes may pick the other one than float32
    ``encode_codes`` would), the nearest-code search in float32."""
    vq.eval()
    out = []
    for i in tqdm(range(0, len(images), batch), desc="(b) tokens", mininterval=5.0):
        with _autocast(plan):
            z = vq.quant_conv(vq.encoder(images[i : i + batch]))
        out.append(vq.quantize.nearest(z.float()))
    return torch.cat(out)


def _usage_figures(tokens: torch.Tensor, V: int) -> dict:
    counts = torch.bincount(tokens.flatten(), minlength=V).double()
    p = counts / counts.sum()
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
    return dict(codes_used=int((counts > 0).sum()), code_perplexity=math.exp(entropy))


# ---------------------------------------------------------------------------------------------------
# (c) GPT


def grow_depth(gpt, n_layer: int):
    """GPT [L layers] -> a new GPT with n_layer = k * L layers computing the same function (LLaMA Pro's block
    expansion, Wu et al. 2024): original layer i becomes layer i * k, followed by k - 1 copies of it whose
    output projections (attention ``wo``, feed-forward ``w2``) are zero, so each copy adds nothing to the
    residual stream until training moves them."""
    from ..models.gpt import Transformer

    base = gpt.config.n_layer
    if n_layer < base or n_layer % base:
        raise ValueError(f"n_layer must be a multiple of the model's {base} layers, got {n_layer}")
    per = n_layer // base
    deep = Transformer(replace(gpt.config, n_layer=n_layer))
    state = {}
    for key, value in gpt.state_dict().items():
        if not key.startswith("layers."):
            state[key] = value.clone()
            continue
        _, i, rest = key.split(".", 2)
        for j in range(per):
            w = value.clone()
            if j > 0 and rest in ("attention.wo.weight", "feed_forward.w2.weight"):
                w.zero_()
            state[f"layers.{int(i) * per + j}.{rest}"] = w
    deep.load_state_dict(state, strict=True)
    return deep.train(gpt.training)


def _train_steps(gpt, plan: Plan, tokens, labels, gen, steps: int, peak_lr: float, warmup: int, desc: str):
    """AdamW (weight decay on matrices only), warm-up + cosine, gradient clipping at 1 -> smoothed train loss."""
    decay = [p for n, p in gpt.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in gpt.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.gpt_weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr, betas=(0.9, 0.95))
    gpt.train()
    bar = tqdm(range(steps), desc=desc, mininterval=5.0)
    smooth = None
    for step in bar:
        lr = peak_lr * _cosine(step, steps, warmup, plan.gpt_min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, tokens.shape[0], (plan.gpt_batch,), generator=gen)
        with _autocast(plan):
            loss = gpt.loss(tokens[idx], labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr:.1e}")
    bar.close()
    gpt.eval()
    return smooth


@torch.no_grad()
def _held_out_loss(gpt, val_tokens, val_labels) -> tuple:
    """-> (conditional, unconditional) mean held-out cross-entropy in nats/token."""
    val = [gpt.loss(val_tokens[i : i + 250], val_labels[i : i + 250]).item() for i in range(0, len(val_tokens), 250)]
    drop = torch.ones(len(val_labels), dtype=torch.bool)
    logits = gpt.forward_full(val_tokens[:, :-1], val_labels, force_drop_ids=drop)
    uncond = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), val_tokens.reshape(-1)).item()
    return sum(val) / len(val), uncond


def train_gpt(plan: Plan, tokens: torch.Tensor, labels: torch.Tensor, val_tokens: torch.Tensor,
              val_labels: torch.Tensor, log=print):
    """plan.gpt_name's shape: trained at plan.gpt_base_layers layers for plan.gpt_steps, then grown to the
    config's depth and trained on for plan.gpt_grow_steps (training the deep model from scratch in the same
    time reached a far worse loss: docs/tiny_model.md)."""
    from ..models import GPT_CONFIGS, build_gpt

    n_layer = GPT_CONFIGS[plan.gpt_name].n_layer
    torch.manual_seed(plan.seed + 2)
    gpt = build_gpt(plan.gpt_name, class_dropout_prob=plan.gpt_class_dropout, n_layer=plan.gpt_base_layers)
    gen = torch.Generator().manual_seed(plan.seed + 3)
    smooth = _train_steps(gpt, plan, tokens, labels, gen, plan.gpt_steps, plan.gpt_lr, plan.gpt_warmup,
                          f"(c) GPT {plan.gpt_base_layers} layers")
    figures = dict(train_loss_smoothed=smooth)
    if n_layer != plan.gpt_base_layers:
        base_val, base_uncond = _held_out_loss(gpt, val_tokens, val_labels)
        figures.update(base_layers=plan.gpt_base_layers, base_train_loss_smoothed=smooth, base_val_loss=base_val,
                       base_val_loss_unconditional=base_uncond)
        log(f"    GPT at {plan.gpt_base_layers} layers: held-out loss {base_val:.3f} nats/token "
            f"(unconditional {base_uncond:.3f}); growing to {n_layer} layers")
        gpt = grow_depth(gpt, n_layer)
        smooth = _train_steps(gpt, plan, tokens, labels, gen, plan.gpt_grow_steps, plan.gpt_grow_lr,
                              plan.gpt_grow_warmup, f"(c) GPT {n_layer} layers")
        figures["train_loss_smoothed"] = smooth
    val, val_uncond = _held_out_loss(gpt, val_tokens, val_labels)
    figures.update(val_loss=val, val_loss_unconditional=val_uncond)
    log(f"    GPT held-out loss {val:.3f} nats/token (unconditional {val_uncond:.3f}); "
        f"train (smoothed) {smooth:.3f}")
    return gpt, figures


# ---------------------------------------------------------------------------------------------------
# (d) classifier


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Mild blur / noise / contrast jitter so the classifier does not key on pixel-exact rendering."""
    B = x.shape[0]
    blur = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, 1)
    w = torch.rand(B, 1, 1, 1, generator=gen) * (torch.rand(B, 1, 1, 1, generator=gen) < 0.5)
    x = (1 - w) * x + w * blur
    x = x * (0.85 + 0.3 * torch.rand(B, 1, 1, 1, generator=gen))
    x = x + 0.08 * torch.rand(B, 1, 1, 1, generator=gen) * torch.randn(x.shape, generator=gen)
    flip = torch.rand(B, generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def train_classifier(plan: Plan, images: torch.Tensor, labels: torch.Tensor, val_images: torch.Tensor,
                     val_labels: torch.Tensor, log=print):
    from .classifier import ShapeClassifier

    torch.manual_seed(plan.seed + 4)
    clf = ShapeClassifier()
    clf.train()
    opt = torch.optim.AdamW(clf.parameters(), lr=plan.clf_lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(plan.seed + 5)
    bar = tqdm(range(plan.clf_steps), desc="(d) classifier", mininterval=5.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = plan.clf_lr * _cosine(step, plan.clf_steps, 20, 0.02)
        idx = torch.randint(0, images.shape[0], (plan.clf_batch,), generator=gen)
        loss = F.cross_entropy(clf(_augment(images[idx], gen)), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    clf.eval()
    preds, _ = clf.predict(val_images)
    figures = dict(val_accuracy=float((preds == val_labels).float().mean()))
    log(f"    classifier held-out accuracy {100 * figures['val_accuracy']:.2f}% on {len(val_labels)} real images")
    return clf, figures


# ---------------------------------------------------------------------------------------------------


def override_plan(plan, items):
    """A plan dataclass with ``--set FIELD=VALUE`` items applied (bool, int, float, comma-separated float
    tuples, else the string); an unknown field stops with its name."""
    types = {f.name: f.type for f in fields(plan)}
    for item in items:
        key, value = item.split("=", 1)
        if key not in types:
            raise SystemExit(f"--set: unknown plan field {key!r}")
        typ = types[key]
        if typ in (bool, "bool"):
            v = value.lower() in ("1", "true", "yes")
        elif typ in (int, "int"):
            v = int(value)
        elif typ in (float, "float"):
            v = float(value)
        elif typ in (tuple, "tuple"):
            v = tuple(float(x) for x in value.split(","))
        else:
            v = value
        plan = replace(plan, **{key: v})
    return plan


def main(argv=None) -> int:
    from ..pretrained import TINY_DIR

    p = argparse.ArgumentParser(prog="python -m lantern.tiny.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(TINY_DIR), help="output directory (default: the shipped weights' place)")
    p.add_argument("--minutes-budget", type=float, default=DEFAULT_BUDGET_MINUTES,
                   help="scale the training step counts to fit about this many minutes: the default plan (%(default)s) "
                        "took 23 min on a shared 2-core machine; 11.5 = half the steps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine two threads stall behind other "
                        "processes, 3-5x slower; one thread also makes the result independent of the core count)")
    p.add_argument("--stages", default="vq,gpt,classifier,eval",
                   help="comma list of vq,gpt,classifier,eval; a stage left out reuses DIR's existing weights")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override Plan fields (experiments)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    plan = override_plan(Plan(), args.set)
    if args.minutes_budget != DEFAULT_BUDGET_MINUTES:
        plan = plan.scaled(args.minutes_budget / DEFAULT_BUDGET_MINUTES)
    stages = set(s.strip() for s in args.stages.split(",") if s.strip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "tiny.json"
    reuse_meta = meta_path.exists() and stages != {"vq", "gpt", "classifier", "eval"}
    meta = json.loads(meta_path.read_text()) if reuse_meta else {}
    timings = meta.get("timings_s", {})
    figures = meta.get("figures", {})
    print(f"lantern.tiny.train -> {out}  ({torch.get_num_threads()} threads; plan: vq {plan.vq_steps} steps, "
          f"gpt {plan.gpt_steps} steps, classifier {plan.clf_steps} steps)")
    t_all = time.perf_counter()

    t0 = time.perf_counter()
    images, labels = make_dataset(plan.n_images, plan.data_seed)
    val_images, val_labels = make_dataset(plan.n_val, plan.data_seed + 100)
    timings["data"] = time.perf_counter() - t0
    print(f"[data] {plan.n_images} + {plan.n_val} images (seed {plan.data_seed}) in {timings['data']:.1f}s")

    from ..models import GPT_CONFIGS, load_gpt, load_vq

    if "vq" in stages:
        t0 = time.perf_counter()
        vq, figures["vq"] = train_vq(plan, images, val_images)
        _save(vq.state_dict(), out / "vq.safetensors")
        timings["vq"] = time.perf_counter() - t0
        print(f"[a] VQ trained in {timings['vq'] / 60:.1f} min")
    else:
        vq = load_vq(str(out / "vq.safetensors"), "VQ-tiny")

    if "vq" in stages or "gpt" in stages:
        t0 = time.perf_counter()
        tokens = tokenize(vq, images, plan)
        val_tokens = tokenize(vq, val_images, plan)
        with torch.no_grad():  # LlamaGen's ring of recently used codes, for the record
            used = vq.quantize.codebook_used
            tail = tokens.flatten()[-used.numel():].float()
            used.zero_()
            used[-tail.numel():] = tail
        _save(vq.state_dict(), out / "vq.safetensors")
        figures["tokens"] = _usage_figures(tokens, vq.config.codebook_size)
        timings["tokens"] = time.perf_counter() - t0
        print(f"[b] tokenised in {timings['tokens']:.1f}s: {figures['tokens']['codes_used']} codes used, "
              f"perplexity {figures['tokens']['code_perplexity']:.0f}")

    if "gpt" in stages:
        t0 = time.perf_counter()
        gpt, figures["gpt"] = train_gpt(plan, tokens, labels, val_tokens, val_labels)
        # bf16 on disk (half the size); everything after this point, the evaluation included, uses the
        # shipped bf16-rounded weights computed in float32
        _save(gpt.state_dict(), out / "gpt.safetensors", torch.bfloat16)
        gpt = load_gpt(str(out / "gpt.safetensors"), plan.gpt_name, dtype=torch.float32)
        timings["gpt"] = time.perf_counter() - t0
        print(f"[c] GPT trained in {timings['gpt'] / 60:.1f} min")
    else:
        gpt_name = meta.get("gpt_name", plan.gpt_name)
        gpt = load_gpt(str(out / "gpt.safetensors"), gpt_name) if (out / "gpt.safetensors").exists() else None

    if "classifier" in stages:
        t0 = time.perf_counter()
        clf, figures["classifier"] = train_classifier(plan, images, labels, val_images, val_labels)
        _save(clf.state_dict(), out / "classifier.safetensors")
        from .evaluate import compute_reference_stats, save_reference_stats

        save_reference_stats(out / "fd_reference.safetensors", *compute_reference_stats(clf))
        timings["classifier"] = time.perf_counter() - t0
        print(f"[d] classifier trained in {timings['classifier'] / 60:.1f} min")

    meta.update(
        gpt_name=plan.gpt_name if "gpt" in stages else meta.get("gpt_name", plan.gpt_name), vq_name="VQ-tiny",
        gpt_dtype="bfloat16", class_names=list(CLASS_NAMES),
        configs=dict(gpt=asdict(gpt.config if gpt is not None else GPT_CONFIGS[plan.gpt_name]),
                     vq={**asdict(vq.config), "ch_mult": list(vq.config.ch_mult)}),
        dataset=dict(module="lantern.tiny.data", seed=plan.data_seed, n_images=plan.n_images,
                     val_seed=plan.data_seed + 100, n_val=plan.n_val),
        plan=asdict(plan),
        sampling=dict(cfg_scale=plan.cfg_scale, top_k=plan.top_k, top_p=1.0, temperature=plan.temperature),
    )

    if "eval" in stages and gpt is not None:
        t0 = time.perf_counter()
        from . import evaluate

        evaluate._cache.clear()
        torch.manual_seed(plan.seed + 6)
        samples, sample_labels = evaluate.sample_images(gpt, vq, plan.eval_per_class, cfg_scale=plan.cfg_scale,
                                                        temperature=plan.temperature, top_k=plan.top_k, seed=plan.seed)
        result = evaluate.evaluate_samples(samples, sample_labels, directory=out)
        figures["samples"] = dict(result, cfg_scale=plan.cfg_scale, top_k=plan.top_k, temperature=plan.temperature,
                                  seed=plan.seed)
        timings["eval"] = time.perf_counter() - t0
        print(f"[e] {result['n']} AR samples (cfg {plan.cfg_scale}, top_k {plan.top_k}, temperature "
              f"{plan.temperature}): classifier accuracy {100 * result['class_accuracy']:.1f}%, FD "
              f"{result['fd']:.2f} (real-image floor {result['fd_real_floor']:.2f}) in {timings['eval']:.0f}s")

    timings["total"] = time.perf_counter() - t_all
    meta.update(timings_s=timings, figures=figures, threads=torch.get_num_threads())
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.glob("*")) if f.is_file()}
    print("wrote " + ", ".join(f"{k} ({v / 1e6:.2f} MB)" for k, v in sizes.items()) +
          f"; total {sum(sizes.values()) / 1e6:.2f} MB")
    print("timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
