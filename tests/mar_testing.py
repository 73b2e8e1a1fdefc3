"""Test-side helpers for MAR: a small random model with every parameter non-trivial, the official state-dict
layouts written out from the published formulas (not from lantern's modules), and a literal re-derivation
of the forward, the head and the sampling chain from raw tensors (loops, explicit formulas)."""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Tuple

import torch

from lantern.models import build_mar

SMALL = dict(img_size=16, vae_stride=4, vae_embed_dim=4, encoder_embed_dim=16, encoder_depth=1, encoder_num_heads=2,
             decoder_embed_dim=24, decoder_depth=2, decoder_num_heads=3, buffer_size=3, class_num=5, diffloss_d=2,
             diffloss_w=32, num_sampling_steps="10", attn_dropout=0.0, proj_dropout=0.0,
             x0_clip=None,  # the reference law (unclipped x0), which the literal re-derivations follow
             neighbour_heads=0)  # plain attention (the reference); the neighbour heads are tested on their own


def small_mar(seed: int = 0, **overrides):
    """MAR-tiny's code at SMALL sizes (4x4 tokens of 4 channels), eval mode, every tensor random (the
    zero-initialised adaLN / final layers included, so that they matter)."""
    torch.manual_seed(seed)
    model = build_mar("MAR-tiny", **{**SMALL, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else 0.5 / math.sqrt(p.shape[-1])))
    return model


@contextlib.contextmanager
def recording_head_inputs(model, store: list):
    """Within the block, every run of the model's head appends (x_T [M, C], step noise [T - 1, M, C]) to store."""
    original = model.diffloss.sample

    def sample(z, x_T, noise, **kw):
        T = model.diffloss.gen_diffusion.num_timesteps
        store.append((x_T.clone(), torch.stack([noise(t) for t in range(1, T)])))
        return original(z, x_T, noise, **kw)

    model.diffloss.sample = sample
    try:
        yield store
    finally:
        model.diffloss.sample = original


# ---------------------------------------------------------------------------------------------------
# official layouts


def _block_shapes(prefix: str, D: int) -> Dict[str, Tuple[int, ...]]:
    return {f"{prefix}norm1.weight": (D,), f"{prefix}norm1.bias": (D,),
            f"{prefix}attn.qkv.weight": (3 * D, D), f"{prefix}attn.qkv.bias": (3 * D,),
            f"{prefix}attn.proj.weight": (D, D), f"{prefix}attn.proj.bias": (D,),
            f"{prefix}norm2.weight": (D,), f"{prefix}norm2.bias": (D,),
            f"{prefix}mlp.fc1.weight": (4 * D, D), f"{prefix}mlp.fc1.bias": (4 * D,),
            f"{prefix}mlp.fc2.weight": (D, 4 * D), f"{prefix}mlp.fc2.bias": (D,)}


def mar_official_shapes(De, Dd, enc_depth, dec_depth, W, d, L=256, B=64, C=16, K=1000):
    """Every tensor of an official MAR state dict (transformer, then diffloss.net) with its shape."""
    s = {"class_emb.weight": (K, De), "fake_latent": (1, De), "z_proj.weight": (De, C), "z_proj.bias": (De,),
         "z_proj_ln.weight": (De,), "z_proj_ln.bias": (De,), "encoder_pos_embed_learned": (1, L + B, De)}
    for i in range(enc_depth):
        s.update(_block_shapes(f"encoder_blocks.{i}.", De))
    s.update({"encoder_norm.weight": (De,), "encoder_norm.bias": (De,), "decoder_embed.weight": (Dd, De),
              "decoder_embed.bias": (Dd,), "mask_token": (1, 1, Dd), "decoder_pos_embed_learned": (1, L + B, Dd)})
    for i in range(dec_depth):
        s.update(_block_shapes(f"decoder_blocks.{i}.", Dd))
    s.update({"decoder_norm.weight": (Dd,), "decoder_norm.bias": (Dd,), "diffusion_pos_embed_learned": (1, L, Dd)})
    n = "diffloss.net."
    s.update({n + "time_embed.mlp.0.weight": (W, 256), n + "time_embed.mlp.0.bias": (W,),
              n + "time_embed.mlp.2.weight": (W, W), n + "time_embed.mlp.2.bias": (W,),
              n + "cond_embed.weight": (W, Dd), n + "cond_embed.bias": (W,),
              n + "input_proj.weight": (W, C), n + "input_proj.bias": (W,)})
    for i in range(d):
        r = f"{n}res_blocks.{i}."
        s.update({r + "in_ln.weight": (W,), r + "in_ln.bias": (W,), r + "mlp.0.weight": (W, W), r + "mlp.0.bias": (W,),
                  r + "mlp.2.weight": (W, W), r + "mlp.2.bias": (W,), r + "adaLN_modulation.1.weight": (3 * W, W),
                  r + "adaLN_modulation.1.bias": (3 * W,)})
    s.update({n + "final_layer.linear.weight": (2 * C, W), n + "final_layer.linear.bias": (2 * C,),
              n + "final_layer.adaLN_modulation.1.weight": (2 * W, W),
              n + "final_layer.adaLN_modulation.1.bias": (2 * W,)})
    return s


OFFICIAL_MAR = {  # name: (shapes, tensors, total parameters in millions, as published)
    "MAR-B": (dict(De=768, Dd=768, enc_depth=12, dec_depth=12, W=1024, d=6), 364, 207.92),
    "MAR-L": (dict(De=1024, Dd=1024, enc_depth=16, dec_depth=16, W=1280, d=8), 476, 478.33),
    "MAR-H": (dict(De=1280, Dd=1280, enc_depth=20, dec_depth=20, W=1536, d=12), 604, 942.40),
}


def _resnet_shapes(prefix: str, cin: int, cout: int):
    s = {prefix + "norm1.weight": (cin,), prefix + "norm1.bias": (cin,), prefix + "conv1.weight": (cout, cin, 3, 3),
         prefix + "conv1.bias": (cout,), prefix + "norm2.weight": (cout,), prefix + "norm2.bias": (cout,),
         prefix + "conv2.weight": (cout, cout, 3, 3), prefix + "conv2.bias": (cout,)}
    if cin != cout:
        s.update({prefix + "nin_shortcut.weight": (cout, cin, 1, 1), prefix + "nin_shortcut.bias": (cout,)})
    return s


def _attn_shapes(prefix: str, c: int):
    s = {prefix + "norm.weight": (c,), prefix + "norm.bias": (c,)}
    for name in ("q", "k", "v", "proj_out"):
        s.update({f"{prefix}{name}.weight": (c, c, 1, 1), f"{prefix}{name}.bias": (c,)})
    return s


def kl16_official_shapes():
    """The KL-16 autoencoder (ch 128, ch_mult 1,1,2,2,4, encoder attention at level 4, none in the decoder's
    levels)."""
    outs = [128, 128, 256, 256, 512]
    s = {"encoder.conv_in.weight": (128, 3, 3, 3), "encoder.conv_in.bias": (128,)}
    cin = 128
    for i, cout in enumerate(outs):
        for j in range(2):
            s.update(_resnet_shapes(f"encoder.down.{i}.block.{j}.", cin, cout))
            cin = cout
            if i == 4:
                s.update(_attn_shapes(f"encoder.down.{i}.attn.{j}.", cout))
        if i < 4:
            s.update({f"encoder.down.{i}.downsample.conv.weight": (cout, cout, 3, 3),
                      f"encoder.down.{i}.downsample.conv.bias": (cout,)})
    for side in ("encoder", "decoder"):
        s.update(_resnet_shapes(f"{side}.mid.block_1.", 512, 512))
        s.update(_attn_shapes(f"{side}.mid.attn_1.", 512))
        s.update(_resnet_shapes(f"{side}.mid.block_2.", 512, 512))
    s.update({"encoder.norm_out.weight": (512,), "encoder.norm_out.bias": (512,),
              "encoder.conv_out.weight": (32, 512, 3, 3), "encoder.conv_out.bias": (32,),
              "decoder.conv_in.weight": (512, 16, 3, 3), "decoder.conv_in.bias": (512,)})
    cin = 512
    for i in reversed(range(5)):
        for j in range(3):
            s.update(_resnet_shapes(f"decoder.up.{i}.block.{j}.", cin, outs[i]))
            cin = outs[i]
        if i > 0:
            s.update({f"decoder.up.{i}.upsample.conv.weight": (outs[i], outs[i], 3, 3),
                      f"decoder.up.{i}.upsample.conv.bias": (outs[i],)})
    s.update({"decoder.norm_out.weight": (128,), "decoder.norm_out.bias": (128,),
              "decoder.conv_out.weight": (3, 128, 3, 3), "decoder.conv_out.bias": (3,),
              "quant_conv.weight": (32, 32, 1, 1), "quant_conv.bias": (32,),
              "post_quant_conv.weight": (16, 16, 1, 1), "post_quant_conv.bias": (16,)})
    return s


def meta_state(shapes) -> Dict[str, torch.Tensor]:
    return {k: torch.empty(v, device="meta") for k, v in shapes.items()}


# ---------------------------------------------------------------------------------------------------
# literal re-derivation (float64, loops over images and heads)


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    return y if w is None else y * w + b


def _lin(x, sd, name):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _silu(x):
    return x / (1 + torch.exp(-x))


def literal_neighbour_bias(cfg, rows, heads):
    """The neighbour heads' attention bias [heads, T, T] for one image's rows (indices into buffer + L),
    from its definition: head h < neighbour_heads favours the grid neighbour at OFFSETS[h] of an image
    query, by -slope * Euclidean distance, and keeps the class slots 3 tokens away."""
    offsets = [(-1, 0), (1, 0), (0, -1), (0, 1), (-1, -1), (1, 1), (-1, 1), (1, -1)]
    B, side, slope = cfg.buffer_size, cfg.seq_side, cfg.neighbour_slope
    bias = torch.zeros(heads, len(rows), len(rows), dtype=torch.float64)
    for h in range(cfg.neighbour_heads):
        dr, dc = offsets[h]
        for i, qi in enumerate(rows):
            if qi < B:
                continue
            qr, qc = divmod(qi - B, side)
            for j, kj in enumerate(rows):
                if kj < B:
                    bias[h, i, j] = -slope * 3.0
                else:
                    kr, kc = divmod(kj - B, side)
                    bias[h, i, j] = -slope * math.sqrt((kr - qr - dr) ** 2 + (kc - qc - dc) ** 2)
    return bias


def _block(x, sd, p, heads, bias=None):
    """x [T, D] one image's rows; bias None or [heads, T, T] added to the scores."""
    D = x.shape[-1]
    hd = D // heads
    h = _ln(x, sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
    qkv = _lin(h, sd, p + "attn.qkv")
    q, k, v = qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:]
    outs = []
    for i in range(heads):
        sl = slice(i * hd, (i + 1) * hd)
        scores = q[:, sl] @ k[:, sl].T / math.sqrt(hd)
        if bias is not None:
            scores = scores + bias[i]
        outs.append(torch.softmax(scores, dim=-1) @ v[:, sl])
    x = x + _lin(torch.cat(outs, dim=1), sd, p + "attn.proj")
    h = _ln(x, sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
    return x + _lin(_gelu(_lin(h, sd, p + "mlp.fc1")), sd, p + "mlp.fc2")


def literal_z(sd, cfg, tokens, mask, labels):
    """z [N, L, Dd] from raw tensors: tokens [N, L, C], mask [N, L] bool (True = unknown), labels [N] or None."""
    sd = {k: v.double() for k, v in sd.items()}
    N, L, _ = tokens.shape
    B = cfg.buffer_size
    out = []
    for n in range(N):
        cls = sd["fake_latent"][0] if labels is None else sd["class_emb.weight"][int(labels[n])]
        rows = [cls] * B + [tokens[n, i].double() @ sd["z_proj.weight"].T + sd["z_proj.bias"] for i in range(L)]
        x = torch.stack(rows) + sd["encoder_pos_embed_learned"][0]
        x = _ln(x, sd["z_proj_ln.weight"], sd["z_proj_ln.bias"], 1e-6)
        kept = list(range(B)) + [B + i for i in range(L) if not bool(mask[n, i])]
        x = x[kept]
        bias = literal_neighbour_bias(cfg, kept, cfg.encoder_num_heads) if cfg.neighbour_heads else None
        for i in range(cfg.encoder_depth):
            x = _block(x, sd, f"encoder_blocks.{i}.", cfg.encoder_num_heads, bias)
        x = _ln(x, sd["encoder_norm.weight"], sd["encoder_norm.bias"], 1e-6)
        y = _lin(x, sd, "decoder_embed")
        full = sd["mask_token"][0].repeat(B + L, 1)
        for row, index in enumerate(kept):
            full[index] = y[row]
        x = full + sd["decoder_pos_embed_learned"][0]
        bias = literal_neighbour_bias(cfg, list(range(B + L)), cfg.decoder_num_heads) if cfg.neighbour_heads else None
        for i in range(cfg.decoder_depth):
            x = _block(x, sd, f"decoder_blocks.{i}.", cfg.decoder_num_heads, bias)
        x = _ln(x, sd["decoder_norm.weight"], sd["decoder_norm.bias"], 1e-6)
        out.append(x[B:] + sd["diffusion_pos_embed_learned"][0])
    return torch.stack(out)


def literal_net(sd, x, t, c, depth):
    """SimpleMLPAdaLN from raw tensors: x [N, C], t float [N] (original step numbers), c [N, Dd] -> [N, 2C]."""
    n = "diffloss.net."
    sd = {k[len(n):]: v.double() for k, v in sd.items() if k.startswith(n)}
    half = 128
    # the reference computes the sinusoidal features in float32, whatever the net's dtype
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    temb = torch.cat([torch.cos(args), torch.sin(args)], dim=1).double()
    y = _lin(_silu(_lin(temb, sd, "time_embed.mlp.0")), sd, "time_embed.mlp.2") + _lin(c.double(), sd, "cond_embed")
    h = _lin(x.double(), sd, "input_proj")
    W = h.shape[1]
    for i in range(depth):
        mod = _lin(_silu(y), sd, f"res_blocks.{i}.adaLN_modulation.1")
        shift, scale, gate = mod[:, :W], mod[:, W:2 * W], mod[:, 2 * W:]
        hn = _ln(h, sd[f"res_blocks.{i}.in_ln.weight"], sd[f"res_blocks.{i}.in_ln.bias"], 1e-6) * (1 + scale) + shift
        h = h + gate * _lin(_silu(_lin(hn, sd, f"res_blocks.{i}.mlp.0")), sd, f"res_blocks.{i}.mlp.2")
    mod = _lin(_silu(y), sd, "final_layer.adaLN_modulation.1")
    shift, scale = mod[:, :W], mod[:, W:]
    return _lin(_ln(h, None, None, 1e-6) * (1 + scale) + shift, sd, "final_layer.linear")


def literal_schedule(n_steps: int):
    """The respaced cosine process written from its formulas: kept original steps, and per respaced index
    beta, alpha_bar, posterior variance and log variance (index 0 replaced), the mean coefficients."""
    abar = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    base_betas = [min(1 - abar((i + 1) / 1000) / abar(i / 1000), 0.999) for i in range(1000)]
    base_abar, acc = [], 1.0
    for b in base_betas:
        acc *= 1 - b
        base_abar.append(acc)
    kept = [math.floor(k * 999 / (n_steps - 1) + 0.5) for k in range(n_steps)]
    abar_kept = [base_abar[i] for i in kept]
    prev = [1.0] + abar_kept[:-1]
    betas = [1 - a / p for a, p in zip(abar_kept, prev)]
    pv = [b * (1 - p) / (1 - a) for b, p, a in zip(betas, prev, abar_kept)]
    return dict(kept=kept, betas=betas, abar=abar_kept, abar_prev=prev, pv=pv,
                log_pv_clipped=[math.log(pv[1])] + [math.log(v) for v in pv[1:]],
                coef1=[b * math.sqrt(p) / (1 - a) for b, p, a in zip(betas, prev, abar_kept)],
                coef2=[(1 - p) * math.sqrt(1 - b) / (1 - a) for b, p, a in zip(betas, prev, abar_kept)])


def literal_chain(sd, depth, sched, z_cond, z_uncond, x_T, noise, cfg, temperature, variance_from="cond"):
    """The guided reverse chain from raw tensors: every step runs the net on the conditional and the
    unconditional z, mixes eps, takes v from ``variance_from``; no noise at index 0. Returns (tokens,
    mean0, std0, logstd_sum)."""
    C = x_T.shape[1]
    x = x_T.double()
    S = torch.zeros(x.shape[0], dtype=torch.float64)
    for j in reversed(range(len(sched["kept"]))):
        t = torch.full((x.shape[0],), float(sched["kept"][j]), dtype=torch.float64)
        oc = literal_net(sd, x, t, z_cond, depth)
        if z_uncond is None:
            eps, v = oc[:, :C], oc[:, C:]
        else:
            ou = literal_net(sd, x, t, z_uncond, depth)
            eps = ou[:, :C] + cfg * (oc[:, :C] - ou[:, :C])
            v = (oc if variance_from == "cond" else ou)[:, C:]
        frac = (v + 1) / 2
        logvar = frac * math.log(sched["betas"][j]) + (1 - frac) * sched["log_pv_clipped"][j]
        a = sched["abar"][j]
        x0 = math.sqrt(1 / a) * x - math.sqrt(1 / a - 1) * eps
        mean = sched["coef1"][j] * x0 + sched["coef2"][j] * x
        std = torch.exp(0.5 * logvar)
        if j > 0:
            S = S + torch.log(std).sum(dim=1)
            x = mean + std * temperature * noise[j].double()
        else:
            x = mean
    return x, mean, std * temperature, S
