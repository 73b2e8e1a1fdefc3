"""Pilot harness for tiny MAR recipes (scratch, not committed)."""
import argparse, json, math, time, sys
from dataclasses import replace, asdict
from pathlib import Path
import torch
torch.set_num_threads(1)
from lantern.tiny_mar import train as T
from lantern.tiny_mar.evaluate import evaluate, describe
from lantern.tiny.data import make_dataset, make_class_batch
from lantern.tiny.evaluate import evaluate_samples
from lantern.tiny.train import override_plan
from lantern.models import build_vae, build_mar, load_vae, load_mar
from safetensors.torch import save_file, load_file
from lantern import enable_fused
enable_fused("auto")
import os
if os.environ.get("LOCAL"):
    sys.path.insert(0, "/tmp/mp"); import local; local.install([float(x) for x in os.environ["LOCAL"].split(",")])

def vae_stage(a):
    d = Path(a.dir); d.mkdir(parents=True, exist_ok=True)
    plan = override_plan(T.Plan(), a.set)
    overrides = json.loads(a.vae_cfg) if a.vae_cfg else {}
    images, labels = make_dataset(plan.n_images, plan.data_seed)
    val, _ = make_dataset(plan.n_val, plan.data_seed + 100)
    import lantern.tiny_mar.train as TT
    orig = TT.build_vae if hasattr(TT, "build_vae") else None
    import lantern.models as LM
    real_build = LM.build_vae
    LM.build_vae = lambda name: real_build(name, **overrides)
    t0 = time.perf_counter()
    vae, fig = T.train_vae(plan, images, val)
    fig["train_s"] = time.perf_counter() - t0
    LM.build_vae = real_build
    mean, std = T.posteriors(vae, images)
    scale = T.latent_scale(mean, std, plan.seed + 8)
    fig["scale"] = scale
    fig["std_mean"] = float(std.mean())
    # reconstruction FD on 1000 class-balanced real images (floor seed differs)
    real, rl = make_class_batch(100, 5)
    with torch.no_grad():
        rec = vae.decode(vae.encode(real).mode())
        recs = vae.decode(vae.encode(real).sample(torch.Generator().manual_seed(0)))
    r1 = evaluate_samples(rec, rl); r2 = evaluate_samples(recs, rl)
    fig["recon_mode"] = dict(acc=r1["class_accuracy"], fd=r1["fd"], floor=r1["fd_real_floor"])
    fig["recon_sample"] = dict(acc=r2["class_accuracy"], fd=r2["fd"])
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(d / "vae.safetensors"))
    torch.save(dict(mean=mean, std=std, labels=labels, scale=scale, cfg=overrides), d / "post.pt")
    (d / "vae.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))

def sincos_2d(side, dim):
    import math
    q = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(q, dtype=torch.float64) / q))
    ys, xs = torch.meshgrid(torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64), indexing="ij")
    def emb(pos):
        a = pos.reshape(-1, 1) * omega[None]
        return torch.cat([a.sin(), a.cos()], 1)
    return torch.cat([emb(ys), emb(xs)], 1).float()  # [side*side, dim]

@torch.no_grad()
def sincos_init(m, amp):
    c = m.config; B = c.buffer_size
    for p in (m.encoder_pos_embed_learned, m.decoder_pos_embed_learned):
        p[0, B:] = amp * sincos_2d(c.seq_side, p.shape[-1])
    m.diffusion_pos_embed_learned[0] = amp * sincos_2d(c.seq_side, m.diffusion_pos_embed_learned.shape[-1])

def patch_weight(spec):
    import math
    from lantern.models import diffusion as D
    kind, val = spec.split(":"); val = float(val)
    orig = D.GaussianDiffusion.training_losses
    def tl(self, net, x0, t, noise, c):
        x_t = self.q_sample(x0, t, noise)
        out = net(x_t, self.original_steps(t), c).float()
        C = x0.shape[1]
        mse = ((noise - out[:, :C]) ** 2).mean(dim=1)
        abar = self._at(self.alphas_cumprod, t, x0)[:, 0]
        snr = abar / (1 - abar)
        if kind == "v":
            w = (1 / abar).clamp(max=val)
        elif kind == "minsnr":
            w = snr.clamp(max=val) / snr
        elif kind == "x0":  # x0-mse (1/snr) capped
            w = (1 / snr).clamp(max=val)
        mse = mse * w
        frozen = torch.cat([out[:, :C].detach(), out[:, C:]], dim=1)
        step = self.step_distribution(frozen, x_t, t)
        true_mean, true_log_var = self.q_posterior(x0, x_t, t)
        kl = D.normal_kl(true_mean, true_log_var, step.mean, step.log_variance).mean(dim=1) / math.log(2.0)
        nll = -D.discretized_gaussian_log_likelihood(x0, step.mean, 0.5 * step.log_variance).mean(dim=1) / math.log(2.0)
        return mse + torch.where(t == 0, nll, kl)
    D.GaussianDiffusion.training_losses = tl

def mar_stage(a):
    import os
    if os.environ.get("WEIGHT"):
        patch_weight(os.environ["WEIGHT"])
    d = Path(a.dir)
    plan = override_plan(T.Plan(), a.set)
    p = torch.load(d / "post.pt", weights_only=True)
    over = json.loads(a.mar_cfg) if a.mar_cfg else {}
    import lantern.models as LM
    real_build = LM.build_mar
    import os
    def bm(name, **kw):
        m = real_build(name, **{**kw, **over})
        if os.environ.get("SINCOS"):
            sincos_init(m, float(os.environ["SINCOS"]))
        return m
    LM.build_mar = bm
    t0 = time.perf_counter()
    ema, fig = T.train_mar(plan, a.name, a.steps, p["mean"], p["std"], p["labels"], p["scale"], 10)
    fig["train_s"] = time.perf_counter() - t0
    LM.build_mar = real_build
    out = d / a.tag; out.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in ema.state_dict().items()}, str(out / "mar.safetensors"))
    (out / "cfg.json").write_text(json.dumps(dict(name=a.name, over=over, plan=a.set, fig=fig)))
    print(json.dumps(fig))

def eval_stage(a):
    d = Path(a.dir); out = d / a.tag
    info = json.loads((out / "cfg.json").read_text())
    p = torch.load(d / "post.pt", weights_only=True)
    vae = build_vae("KL-tiny", **p["cfg"], scale=p["scale"]); vae.load_state_dict(load_file(str(d / "vae.safetensors"))); vae.eval()
    extra = json.loads(a.over) if a.over else {}
    mar = build_mar(info["name"], **{**info["over"], **extra}); mar.load_state_dict(load_file(str(out / "mar.safetensors"))); mar.eval()
    res = []
    for cfg in a.cfg:
        for temp in a.temp:
            for ni in a.num_iter:
                t0 = time.perf_counter()
                r = evaluate(mar, vae, a.per_class, cfg=cfg, num_iter=ni, temperature=temp, cfg_schedule=a.sched)
                print(f"{a.tag} {a.over} T={temp} " + describe(info["name"], r), flush=True)
                res.append(dict(cfg=cfg, temp=temp, num_iter=ni, acc=r["class_accuracy"], fd=r["fd"], floor=r["fd_real_floor"], s=r["sample_s"]))
    with open(out / "eval.jsonl", "a") as f:
        for r in res: f.write(json.dumps(dict(per_class=a.per_class, sched=a.sched, **r)) + "\n")

ap = argparse.ArgumentParser()
ap.add_argument("stage"); ap.add_argument("--dir", required=True); ap.add_argument("--set", nargs="*", default=[])
ap.add_argument("--vae-cfg", default=""); ap.add_argument("--mar-cfg", default="")
ap.add_argument("--name", default="MAR-tiny"); ap.add_argument("--steps", type=int, default=300); ap.add_argument("--tag", default="m")
ap.add_argument("--cfg", type=float, nargs="*", default=[3.0]); ap.add_argument("--temp", type=float, nargs="*", default=[1.0])
ap.add_argument("--num-iter", type=int, nargs="*", default=[16]); ap.add_argument("--per-class", type=int, default=20)
ap.add_argument("--sched", default="linear"); ap.add_argument("--over", default="")
a = ap.parse_args()
dict(vae=vae_stage, mar=mar_stage, eval=eval_stage)[a.stage](a)
