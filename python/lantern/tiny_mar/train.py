"""Train the tiny continuous-token default on CPU, in one command:

    python -m lantern.tiny_mar.train [--out DIR] [--minutes-budget 70] [--threads 2]

Stages: (a) the KL-tiny autoencoder on the procedural shapes (mse + l1 reconstruction + a small KL to N(0, 1)),
(b) the posterior (mean, std) of every training image and the latent scale (1 / std of posterior samples,
as 0.2325 is for KL-16), (c) the MAR-tiny target and (d) the smaller MAR-tiny-drafter on posterior samples
times the scale, with MAR's objective (random order and truncated-normal mask rate per batch, label dropout,
the head's mse + vb loss on masked tokens), AdamW without weight decay on 1-D tensors, biases and the head,
EMA weights saved; (e) evaluation with the tiny GPT's shape classifier and Frechet-distance reference
(python/lantern/weights/tiny): a guidance sweep on a few samples, then 1000 samples of the target and of the
drafter at the best scale, and the sampling time split into transformer and head at batch 1 and 16.

Writes to DIR (default python/lantern/weights/tiny_mar): vae.safetensors, mar.safetensors,
drafter.safetensors (float32) and tiny_mar.json (configs, latent scale, plan, timings, figures, sampling
defaults). Load them with ``lantern.tiny_mar.load_tiny_mar()``.

Seeded: the same command with the same thread count gives the same weights. Float32 throughout (bf16
autocast measured about 17x slower than float32 on the project's CPU). ``--minutes-budget`` scales the step
counts of the three trainings so that the whole run fits about that many minutes. The default plan took 69.5
minutes at ``--threads 2`` on the shared 2-core machine (2026-11-25): data 0.1 min, VAE 600 steps 3.4 min,
posteriors 0.9 min, target 3000 steps 49.1 min (1.3 steps/s when the machine was otherwise idle, about 3x
slower while a test suite ran beside it), drafter 2000 steps 10.1 min, evaluation 5.8 min (300 + 1000 target
and 1000 drafter samples at 16 MAR steps, 50 diffusion steps and guidance, then the batch 1 / 16 timings).
The target got 3000 steps because 1200 left its samples' FD at 11.5 (docs/mar.md).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..tiny.data import CLASS_NAMES, DEFAULT_SEED, make_dataset
from ..tiny.train import override_plan

DEFAULT_BUDGET_MINUTES = 70.0  # the default plan at --threads 2, measured (module docstring)
FIXED_MINUTES = 7.0  # data, posteriors and evaluation: not scaled by --minutes-budget


@dataclass(frozen=True)
class Plan:
    seed: int = 0
    data_seed: int = DEFAULT_SEED
    n_images: int = 30000
    n_val: int = 1000
    autocast_bf16: bool = False  # bf16 autocast for the trainings (slower than float32 on CPUs without bf16 units)
    # (a) VAE
    vae_steps: int = 600
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_l1: float = 1.0
    vae_kl: float = 1e-4  # weight of the mean KL per latent element against the per-pixel reconstruction
    # (c) target, (d) drafter
    mar_steps: int = 3000
    drafter_steps: int = 2000
    mar_batch: int = 64
    mar_lr: float = 1e-3
    mar_warmup: int = 100
    mar_min_lr_ratio: float = 0.1
    mar_weight_decay: float = 0.02
    mar_grad_clip: float = 3.0
    mar_ema: float = 0.998
    diffusion_batch_mul: int = 2
    # (e) evaluation / sampling defaults
    num_iter: int = 16
    cfg_schedule: str = "linear"
    temperature: float = 1.0
    sweep: tuple = (2.0, 3.0, 4.5)
    sweep_per_class: int = 10
    # the guidance scale: the lowest sweep FD among the scales whose sweep accuracy reaches this (the 95 % target
    # plus a margin for the sweep's 100 samples); the most accurate scale if none does
    sweep_accuracy: float = 0.97
    eval_per_class: int = 100

    def scaled(self, factor: float) -> "Plan":
        """Training step counts times factor (the --minutes-budget knob)."""
        s = lambda n: max(1, int(round(n * factor)))
        return replace(self, vae_steps=s(self.vae_steps), mar_steps=s(self.mar_steps),
                       drafter_steps=s(self.drafter_steps),
                       mar_warmup=min(self.mar_warmup, max(1, s(self.mar_steps) // 10)))


def _lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _autocast(plan: Plan):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.autocast_bf16)


def _save(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().float().contiguous() for k, v in state.items()}, str(path))


# ---------------------------------------------------------------------------------------------------
# (a) VAE, (b) posteriors


def train_vae(plan: Plan, images: torch.Tensor, val_images: torch.Tensor, log=print):
    from ..models import build_vae

    torch.manual_seed(plan.seed)
    vae = build_vae("KL-tiny")
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=plan.vae_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(plan.seed + 1)
    bar = tqdm(range(plan.vae_steps), desc="(a) VAE", mininterval=5.0)
    for step in bar:
        lr = plan.vae_lr * _lr_factor(step, plan.vae_steps, 50, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        x = images[torch.randint(0, images.shape[0], (plan.vae_batch,), generator=gen)]
        flip = torch.rand(plan.vae_batch, generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        with _autocast(plan):
            post = vae.encode(x)
            recon = vae.decode(post.sample(gen)).float()
        rec = F.mse_loss(recon, x) + plan.vae_l1 * F.l1_loss(recon, x)
        kl = post.kl().float().mean() / post.mean[0].numel()
        loss = rec + plan.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == plan.vae_steps - 1:
            bar.set_postfix(rec=f"{rec.item():.4f}", kl=f"{kl.item():.3f}", lr=f"{lr:.1e}")
    bar.close()
    vae.eval()
    with torch.no_grad():
        post = [vae.encode(val_images[i : i + 500]) for i in range(0, len(val_images), 500)]
        recon_mode = torch.cat([vae.decode(p.mode()) for p in post])
        gen_eval = torch.Generator().manual_seed(plan.seed + 7)
        recon_sample = torch.cat([vae.decode(p.sample(gen_eval)) for p in post])
    mse_mode, mse_sample = F.mse_loss(recon_mode, val_images).item(), F.mse_loss(recon_sample, val_images).item()
    figures = dict(val_mse_mode=mse_mode, val_psnr_db_mode=10 * math.log10(4.0 / mse_mode),
                   val_mse_sample=mse_sample, val_psnr_db_sample=10 * math.log10(4.0 / mse_sample),
                   val_kl_per_element=float(torch.cat([p.kl() for p in post]).mean() / post[0].mean[0].numel()))
    log(f"    VAE held-out PSNR {figures['val_psnr_db_mode']:.1f} dB (posterior mode), "
        f"{figures['val_psnr_db_sample']:.1f} dB (posterior sample); "
        f"KL {figures['val_kl_per_element']:.3f} per element")
    return vae, figures


@torch.no_grad()
def posteriors(vae, images: torch.Tensor, batch: int = 500):
    """images -> (mean, std) [N, 16, 8, 8] float32 of the posterior (float32 encoder)."""
    means, stds = [], []
    for i in tqdm(range(0, len(images), batch), desc="(b) latents", mininterval=5.0):
        post = vae.encode(images[i : i + batch])
        means.append(post.mean.float())
        stds.append(post.std.float())
    return torch.cat(means), torch.cat(stds)


def latent_scale(mean: torch.Tensor, std: torch.Tensor, seed: int) -> float:
    """1 / std of posterior samples over the set (no mean shift): MAR's latent normalisation."""
    gen = torch.Generator().manual_seed(seed)
    sample = mean + std * torch.randn(mean.shape, generator=gen)
    return float(1.0 / sample.std())


# ---------------------------------------------------------------------------------------------------
# (c, d) MAR


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith(".bias") or "diffloss" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_mar(plan: Plan, name: str, steps: int, mean: torch.Tensor, std: torch.Tensor, labels: torch.Tensor,
              scale: float, seed_offset: int, log=print):
    """Train MAR ``name`` on scaled posterior samples; returns (EMA model, figures)."""
    from ..models import build_mar

    torch.manual_seed(plan.seed + seed_offset)
    model = build_mar(name, diffusion_batch_mul=plan.diffusion_batch_mul)
    ema = build_mar(name, diffusion_batch_mul=plan.diffusion_batch_mul)
    ema.load_state_dict(model.state_dict())
    ema.eval().requires_grad_(False)
    model.train()
    opt = torch.optim.AdamW(_param_groups(model, plan.mar_weight_decay), lr=plan.mar_lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(plan.seed + seed_offset + 1)
    bar = tqdm(range(steps), desc=f"({'c' if seed_offset == 10 else 'd'}) {name}", mininterval=5.0)
    smooth = None
    warmup = min(plan.mar_warmup, max(1, steps // 10))
    for step in bar:
        lr = plan.mar_lr * _lr_factor(step, steps, warmup, plan.mar_min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, mean.shape[0], (plan.mar_batch,), generator=gen)
        latents = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=gen)) * scale
        with _autocast(plan):
            loss = model.training_loss(latents, labels[idx], generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.mar_grad_clip)
        opt.step()
        decay = min(plan.mar_ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{smooth:.4f}", lr=f"{lr:.1e}")
    bar.close()
    n_params = sum(p.numel() for p in ema.parameters())
    head = sum(p.numel() for p in ema.diffloss.parameters())
    figures = dict(train_loss_smoothed=smooth, params=n_params, head_params=head, steps=steps)
    log(f"    {name}: {n_params / 1e6:.2f}M parameters ({head / 1e6:.2f}M head), smoothed loss {smooth:.4f}")
    return ema, figures


# ---------------------------------------------------------------------------------------------------
# (e) evaluation


def best_scale(sweep: list, accuracy: float) -> float:
    """The scale of the lowest-FD sweep row with class_accuracy >= accuracy, else of the most accurate row
    (ties: lower FD): guidance beyond what the classes need only narrows the samples (FD grows)."""
    accurate = [r for r in sweep if r["class_accuracy"] >= accuracy]
    if accurate:
        return min(accurate, key=lambda r: r["fd"])["cfg"]
    return max(sweep, key=lambda r: (round(r["class_accuracy"], 3), -r["fd"]))["cfg"]


def evaluate_all(plan: Plan, mar, drafter, vae, tiny_dir: Path, log=print) -> dict:
    from ..tiny import evaluate as tiny_eval
    from .evaluate import component_timing, describe, evaluate

    tiny_eval._cache.clear()
    common = dict(num_iter=plan.num_iter, cfg_schedule=plan.cfg_schedule, temperature=plan.temperature,
                  seed=plan.seed, directory=tiny_dir)
    sweep = []
    for cfg in plan.sweep:
        r = evaluate(mar, vae, plan.sweep_per_class, cfg=cfg, **common)
        sweep.append(r)
        log("    sweep " + describe("target", r))
    best = best_scale(sweep, plan.sweep_accuracy)
    target = evaluate(mar, vae, plan.eval_per_class, cfg=best, **common)
    log("    " + describe("target", target))
    draft = evaluate(drafter, vae, plan.eval_per_class, cfg=best, **common)
    log("    " + describe("drafter", draft))
    timing = {role: [component_timing(model, batch=b, cfg=best, num_iter=plan.num_iter, repeats=2) for b in (1, 16)]
              for role, model in (("target", mar), ("drafter", drafter))}
    for role, rows in timing.items():
        for row in rows:
            log(f"    {role} batch {row['batch']}: {row['wall_s']:.2f}s, "
                f"transformer {row['transformer_ms_per_step']:.1f} ms/step, "
                f"head {row['head_ms_per_step']:.1f} ms/step ({100 * row['head_share']:.0f}% head)")
    return dict(sweep=sweep, best_cfg=best, target=target, drafter=draft, timing=timing)


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    from . import META_FILE, TINY_MAR_DIR

    p = argparse.ArgumentParser(prog="python -m lantern.tiny_mar.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(TINY_MAR_DIR), help="output directory (default: the shipped weights' place)")
    p.add_argument("--minutes-budget", type=float, default=DEFAULT_BUDGET_MINUTES,
                   help="scale the training step counts so that the run takes about this many minutes at --threads 2 "
                        "(default plan: %(default)s; data, posteriors and evaluation take about 7 of them whatever the "
                        "budget)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: independent of the core count)")
    p.add_argument("--tiny-dir", default=None, help="the tiny GPT's weights directory, for the classifier and the FD "
                   "reference (default: python/lantern/weights/tiny)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override Plan fields (experiments)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    from .. import enable_fused

    enable_fused("auto")  # the noise stream's fused Philox when lantern._C is built (same numbers, faster)
    plan = override_plan(Plan(), args.set)
    if args.minutes_budget != DEFAULT_BUDGET_MINUTES:
        plan = plan.scaled(max(args.minutes_budget - FIXED_MINUTES, 1.0) / (DEFAULT_BUDGET_MINUTES - FIXED_MINUTES))
    from ..pretrained import TINY_DIR

    tiny_dir = Path(args.tiny_dir) if args.tiny_dir else TINY_DIR
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"lantern.tiny_mar.train -> {out}  ({torch.get_num_threads()} threads; plan: vae {plan.vae_steps} steps, "
          f"target {plan.mar_steps} steps, drafter {plan.drafter_steps} steps, batch {plan.mar_batch})")
    timings, figures = {}, {}
    t_all = time.perf_counter()

    t0 = time.perf_counter()
    images, labels = make_dataset(plan.n_images, plan.data_seed)
    val_images, _ = make_dataset(plan.n_val, plan.data_seed + 100)
    timings["data"] = time.perf_counter() - t0
    print(f"[data] {plan.n_images} + {plan.n_val} images (seed {plan.data_seed}) in {timings['data']:.1f}s")

    t0 = time.perf_counter()
    vae, figures["vae"] = train_vae(plan, images, val_images)
    _save(vae.state_dict(), out / "vae.safetensors")
    timings["vae"] = time.perf_counter() - t0
    print(f"[a] VAE trained in {timings['vae'] / 60:.1f} min")

    t0 = time.perf_counter()
    mean, std = posteriors(vae, images)
    scale = latent_scale(mean, std, plan.seed + 8)
    figures["latents"] = dict(scale=scale, posterior_std_mean=float(std.mean()), mean_abs=float(mean.abs().mean()))
    timings["latents"] = time.perf_counter() - t0
    print(f"[b] posteriors of {len(images)} images in {timings['latents']:.0f}s; latent scale {scale:.4f}")

    t0 = time.perf_counter()
    mar, figures["target"] = train_mar(plan, "MAR-tiny", plan.mar_steps, mean, std, labels, scale, 10)
    _save(mar.state_dict(), out / "mar.safetensors")
    timings["target"] = time.perf_counter() - t0
    print(f"[c] target trained in {timings['target'] / 60:.1f} min")

    t0 = time.perf_counter()
    drafter, figures["drafter"] = train_mar(plan, "MAR-tiny-drafter", plan.drafter_steps, mean, std, labels, scale, 20)
    _save(drafter.state_dict(), out / "drafter.safetensors")
    timings["drafter"] = time.perf_counter() - t0
    print(f"[d] drafter trained in {timings['drafter'] / 60:.1f} min")
    del images, mean, std

    meta = dict(
        mar_name="MAR-tiny", drafter_name="MAR-tiny-drafter", vae_name="KL-tiny", vae_scale=scale,
        mar_overrides={}, drafter_overrides={}, class_names=list(CLASS_NAMES),
        configs=dict(mar=asdict(mar.config), drafter=asdict(drafter.config),
                     vae={**asdict(vae.config), "scale": scale}),
        dataset=dict(module="lantern.tiny.data", seed=plan.data_seed, n_images=plan.n_images,
                     val_seed=plan.data_seed + 100, n_val=plan.n_val),
        plan=asdict(plan),
        sampling=dict(cfg=1.0, cfg_schedule=plan.cfg_schedule, num_iter=plan.num_iter, temperature=plan.temperature),
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        figures["samples"] = evaluate_all(plan, mar, drafter, vae, tiny_dir)
    meta["sampling"]["cfg"] = figures["samples"]["best_cfg"]
    timings["eval"] = time.perf_counter() - t0
    gpt_meta = tiny_dir / "tiny.json"
    if gpt_meta.exists():
        gpt_fd = json.loads(gpt_meta.read_text()).get("figures", {}).get("samples", {}).get("fd")
        if gpt_fd:
            figures["samples"]["fd_ratio_to_tiny_gpt"] = figures["samples"]["target"]["fd"] / gpt_fd
            print(f"[e] target FD / tiny GPT FD = {figures['samples']['fd_ratio_to_tiny_gpt']:.2f}")
    print(f"[e] evaluated in {timings['eval'] / 60:.1f} min")

    timings["total"] = time.perf_counter() - t_all
    meta.update(timings_s=timings, figures=figures, threads=torch.get_num_threads())
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.glob("*")) if f.is_file()}
    print("wrote " + ", ".join(f"{k} ({v / 1e6:.2f} MB)" for k, v in sizes.items()))
    print("timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
